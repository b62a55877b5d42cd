"""attnviz web app: `streamlit run app.py` (listens on localhost unless configured otherwise)."""


from pathlib import Path

import streamlit as st

from ui.shared import apply_settings, gate
from ui.sidebar import sidebar

# icons shipped with the app (a file and emoji), never Material Symbols: nothing is fetched, offline included
ICON = Path(__file__).resolve().parent / "assets" / "icon.png"
st.set_page_config(page_title="attnviz", page_icon=str(ICON), layout="wide")

PAGES_DIR = Path(__file__).resolve().parent / "pages"  # absolute: AppTest reruns need it
PAGES = [
    st.Page(str(PAGES_DIR / "heatmaps.py"), title="Heatmaps", icon="🟦", default=True),
    st.Page(str(PAGES_DIR / "sinks.py"), title="Attention sinks", icon="💧"),
    st.Page(str(PAGES_DIR / "shifting.py"), title="Sink shifting", icon="↔️"),
    st.Page(str(PAGES_DIR / "compare.py"), title="Compare A vs B", icon="⚖️"),
    st.Page(str(PAGES_DIR / "heads.py"), title="Heads", icon="🧩"),
    st.Page(str(PAGES_DIR / "why.py"), title="Why", icon="❓"),
    st.Page(str(PAGES_DIR / "routes.py"), title="Routes", icon="🧭"),
    st.Page(str(PAGES_DIR / "patching.py"), title="Patching", icon="🩹"),
    st.Page(str(PAGES_DIR / "effects.py"), title="Effects", icon="⚡"),
    st.Page(str(PAGES_DIR / "sweeps.py"), title="Sweeps", icon="📊"),
    st.Page(str(PAGES_DIR / "emergence.py"), title="Emergence", icon="🌱"),
    st.Page(str(PAGES_DIR / "designer.py"), title="Mask designer", icon="📐"),
    st.Page(str(PAGES_DIR / "walkthrough.py"), title="Walkthrough", icon="🎓"),
    st.Page(str(PAGES_DIR / "definitions.py"), title="Definitions", icon="📖"),
]

NO_MODEL = {"designer", "walkthrough", "sweeps", "emergence", "definitions"}  # url paths of pages that work without a model: they never wait for one
#: pages that read none of the sidebar's settings, and what they read instead (the sidebar says so first)
OWN_INPUTS = {"emergence": "This page shows the lab's training runs (its runs folder, its own models and their probe "
                           "text): the sidebar's model, text and recipe do not apply here."}

if not apply_settings():  # the environment and secrets.toml, read once a run and handed to the library
    st.stop()
page = st.navigation(PAGES, expanded=True)  # every page in view (14: above twelve Streamlit would fold them)
gate()  # sign-in where the server configures it, before any page (docs/sharing.md)
# Drawn on every page, the walkthrough too: widgets Streamlit does not draw in a run lose their state.
st.session_state["settings"], st.session_state["loaded"] = sidebar(needs_model=page.url_path not in NO_MODEL,
                                                                    elsewhere=OWN_INPUTS.get(page.url_path))
page.run()
