"""attnviz web app: `streamlit run app.py` (listens on localhost unless configured otherwise)."""

import streamlit as st

from ui.state import sidebar

st.set_page_config(page_title="attnviz", page_icon="assets/icon.png", layout="wide")

PAGES = [
    st.Page("pages/heatmaps.py", title="Heatmaps", icon=":material/grid_on:", default=True),
    st.Page("pages/sinks.py", title="Attention sinks", icon=":material/water_drop:"),
    st.Page("pages/shifting.py", title="Sink shifting", icon=":material/swap_horiz:"),
    st.Page("pages/compare.py", title="Compare A vs B", icon=":material/compare:"),
    st.Page("pages/designer.py", title="Mask designer", icon=":material/architecture:"),
    st.Page("pages/walkthrough.py", title="Walkthrough", icon=":material/school:"),
]

page = st.navigation(PAGES)
if page.title != "Walkthrough":  # the walkthrough needs no model
    st.session_state["settings"], st.session_state["loaded"] = sidebar()
page.run()
