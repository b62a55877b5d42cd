"""Definitions: docs/methods.md, the formula, paper, function and test of every number the app shows."""

import streamlit as st

from ui.docs import METHODS

st.markdown(METHODS.read_text(encoding="utf-8"))
