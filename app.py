"""attnviz web app: `streamlit run app.py` (listens on localhost unless configured otherwise)."""


from pathlib import Path

import streamlit as st

from ui.shared import gate
from ui.sidebar import sidebar

# icons shipped with the app (a file and emoji), never Material Symbols: nothing is fetched, offline included
ICON = Path(__file__).resolve().parent / "assets" / "icon.png"
st.set_page_config(page_title="attnviz", page_icon=str(ICON), layout="wide")

PAGES_DIR = Path(__file__).resolve().parent / "pages"  # absolute: AppTest reruns need it
#: each page's file (pages/), title and icon, in the navigation's order
NAV = (("heatmaps", "Heatmaps", "🟦"), ("sinks", "Attention sinks", "💧"), ("shifting", "Sink shifting", "↔️"),
       ("compare", "Compare A vs B", "⚖️"), ("heads", "Heads", "🧩"), ("why", "Why", "❓"), ("routes", "Routes", "🧭"),
       ("patching", "Patching", "🩹"), ("effects", "Effects", "⚡"), ("sweeps", "Sweeps", "📊"),
       ("designer", "Mask designer", "📐"), ("walkthrough", "Walkthrough", "🎓"), ("definitions", "Definitions", "📖"))
PAGES = [st.Page(str(PAGES_DIR / f"{name}.py"), title=title, icon=icon, default=name == "heatmaps")
         for name, title, icon in NAV]

NO_MODEL = {"designer", "walkthrough", "sweeps", "definitions"}  # url paths of pages that work without a model: they never wait for one

page = st.navigation(PAGES, expanded=True)  # every page in view (13: above twelve Streamlit would fold three)
gate()  # sign-in where the server configures it, before any page (docs/sharing.md)
# Drawn on every page, the walkthrough too: widgets Streamlit does not draw in a run lose their state.
st.session_state["settings"], st.session_state["loaded"] = sidebar(needs_model=page.url_path not in NO_MODEL)
page.run()
