"""Streamlit glue shared by the pages: sidebar controls, cached model and captures, export widgets.

The library (``attnviz``) never imports Streamlit; everything Streamlit-specific lives here or in
``pages/``.
"""
