"""A lab's shared server (docs/sharing.md): paths typed in the browser stay inside the roots after symlinks
and '..', writes stay in the write root, models come from the allow-list, remote code only by the server's
configuration; heavy jobs take turns; the sign-in gate. The rules alone (attnviz.access), then the app
through AppTest with shared mode on."""

import threading
import time

import pytest

from attnviz.access import Access, is_shared
from attnviz.settings import Settings
from attnviz.errors import InputError

from test_app import app_test, on_page, texts
from tiny import build, char_tokenizer


@pytest.fixture
def lab(tmp_path, monkeypatch):
    """A root with a results folder, a text file and a tiny model directory; outside it a secret folder, a
    model directory, and a symlink from inside the root to the outside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "results").mkdir(parents=True)
    (root / "notes.txt").write_text("One paragraph about lamps.\n\nAnother about ships.\n")
    outside.mkdir()
    (outside / "secret.txt").write_text("not for visitors")
    for where in (root / "tiny-model", outside / "tiny-model"):
        build("llama").save_pretrained(where)
        char_tokenizer().save_pretrained(where)
    (root / "escape").symlink_to(outside)
    monkeypatch.setenv("ATTNVIZ_SHARED", "1")
    monkeypatch.setenv("ATTNVIZ_ROOTS", str(root))
    monkeypatch.setenv("ATTNVIZ_WRITE_ROOT", str(root / "results"))
    monkeypatch.delenv("ATTNVIZ_MODELS", raising=False)
    monkeypatch.delenv("ATTNVIZ_TRUST_REMOTE_CODE", raising=False)
    return root, outside


def test_shared_mode_is_on_beyond_the_loopback(monkeypatch):
    monkeypatch.delenv("ATTNVIZ_SHARED", raising=False)
    unset = Settings.from_environment()
    assert not is_shared("localhost", unset) and not is_shared("127.0.0.1", unset) and not is_shared("::1", unset)
    assert is_shared("0.0.0.0", unset) and is_shared("", unset) and is_shared(None, unset)  # listens everywhere
    monkeypatch.setenv("ATTNVIZ_SHARED", "1")
    assert is_shared("localhost", Settings.from_environment())
    monkeypatch.setenv("ATTNVIZ_SHARED", "0")  # behind a proxy of one's own
    assert not is_shared("0.0.0.0", Settings.from_environment())


def test_reads_writes_and_models_stay_inside_the_roots(lab, monkeypatch):
    root, outside = lab
    rules = Access.from_env(True)
    assert rules.readable(root / "notes.txt") == (root / "notes.txt").resolve()
    assert rules.readable(f"{root}/results/../notes.txt") == (root / "notes.txt").resolve()
    for bad in ("/etc", "/etc/passwd", f"{root}/../outside/secret.txt", str(root / "escape" / "secret.txt"), "../..",
                "~"):
        with pytest.raises(InputError, match="reads only under"):
            rules.readable(bad, "text file")
    assert rules.writable(root / "results" / "new") == (root / "results" / "new").resolve()
    for bad in ("/tmp/elsewhere", str(root / "notes-dir"), str(root / "results" / ".." / ".." / "outside")):
        with pytest.raises(InputError, match="writes only under"):
            rules.writable(bad)
    assert rules.model("default") == "default"
    assert rules.model(str(root / "tiny-model")) == str((root / "tiny-model").resolve())
    for bad, message in [(str(outside / "tiny-model"), "reads only under"), (str(root / "escape" / "tiny-model"), "reads only under"),
                         ("HuggingFaceTB/SmolLM2-360M", "loads only default"), (str(root / "missing"), "does not exist")]:
        with pytest.raises(InputError, match=message):
            rules.model(bad)
    monkeypatch.setenv("ATTNVIZ_MODELS", "default,HuggingFaceTB/SmolLM2-360M")
    assert Access.from_env(True).model("HuggingFaceTB/SmolLM2-360M") == "HuggingFaceTB/SmolLM2-360M"
    assert not rules.remote_code(True)  # a visitor's switch does nothing when shared
    monkeypatch.setenv("ATTNVIZ_TRUST_REMOTE_CODE", "1")
    assert Access.from_env(True).remote_code(False)
    private = Access.from_env(False)  # one researcher's own server: every path, as before
    assert private.readable("/etc") and private.model("gpt2") == "gpt2" and private.remote_code(True)


def sidebar_text(at) -> str:
    return texts(at.sidebar.error) + texts(at.sidebar.caption)


def test_the_app_refuses_paths_and_models_outside_the_roots(lab, tmp_path):
    root, outside = lab
    at = app_test(tmp_path)
    at.run()
    assert not at.exception
    assert not [t for t in at.sidebar.toggle if t.key == "trust_remote_code"]  # no remote-code switch for visitors
    assert "anyone who reaches this port" in texts(at.sidebar.caption)
    for bad in ("/etc", str(outside / "tiny-model"), str(root / "escape" / "tiny-model"), "../.."):
        at.sidebar.text_input(key="model").set_value(bad).run()
        assert "reads only under" in texts(at.sidebar.error), bad
        assert at.session_state["loaded"] is None
    at.sidebar.text_input(key="model").set_value(str(root / "tiny-model")).run()
    assert not at.sidebar.error and at.session_state["loaded"] is not None  # inside the roots: it loads

    on_page(at, "pages/sweeps.py")
    for bad in ("/etc", "../..", str(root / "escape")):
        at.text_input(key="sw_folder").set_value(bad).run()
        assert "reads only under" in texts(at.error), bad
    at.text_input(key="sw_folder").set_value(str(root / "results")).run()
    assert not at.error and "No results in" in texts(at.info)
    elsewhere = tmp_path / "elsewhere"
    at.text_input(key="sw_folder").set_value(str(elsewhere)).run()
    at.text_area(key="sw_spec").set_value('models = ["default"]\narchs = ["fwd"]\n[measures.sinks]\n').run()
    at.button(key="sw_run").click().run()
    assert "writes only under" in texts(at.error) and not elsewhere.exists()  # nothing created on the way


def test_a_text_file_and_a_finetune_folder_outside_the_roots_are_refused(lab, tmp_path):
    root, outside = lab
    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/effects.py")
    source = next(s for s in at.selectbox if s.options and "A text file on the server" in s.options)
    source.set_value("A text file on the server").run()
    path = next(t for t in at.text_input if t.label.startswith("Text file"))
    path.set_value(str(outside / "secret.txt")).run()
    assert "reads only under" in texts(at.error) and "not for visitors" not in str(at)
    path = next(t for t in at.text_input if t.label.startswith("Text file"))
    path.set_value(str(root / "notes.txt")).run()
    assert "reads only under" not in texts(at.error)


def test_heavy_jobs_take_turns_first_come_first_served():
    from ui.shared import FairQueue

    queue = FairQueue()
    order, seen = [], {}
    release = threading.Event()

    def job(session, hold=False):
        def waiting(position, running):
            seen.setdefault(session, []).append(position)
        with queue.turn(session, 1, waiting):
            order.append(session)
            if hold:
                release.wait(10)

    first = threading.Thread(target=job, args=("a", True))
    first.start()
    while queue.running() != ["a"]:
        time.sleep(0.01)
    others = [threading.Thread(target=job, args=(s,)) for s in ("b", "c")]
    for count, t in enumerate(others, 1):
        t.start()
        while len(queue.positions()) < count:
            time.sleep(0.01)
    assert queue.positions() == ["b", "c"]
    time.sleep(0.6)
    release.set()
    for t in [first, *others]:
        t.join(10)
    assert order == ["a", "b", "c"] and seen["b"][0] == 1 and seen["c"][0] == 2
    assert queue.running() == [] and queue.positions() == []


def test_a_session_that_leaves_gives_up_its_place():
    from ui.shared import FairQueue

    queue = FairQueue()

    class Left(Exception):
        pass

    def leaving(position, running):
        raise Left  # what Streamlit's stop does at the next st call of a session that left

    with queue.turn("a", 1):
        with pytest.raises(Left):
            with queue.turn("b", 1, leaving):
                pass
        assert queue.positions() == []  # b's place is given up
    with queue.turn("c", 1):
        assert queue.running() == ["c"]


def test_a_second_session_waits_with_its_position_shown(lab, tmp_path):
    from ui.shared import QUEUE

    root, _ = lab
    at = app_test(tmp_path)
    at.session_state["model"] = str(root / "tiny-model")
    hold, holding = threading.Event(), threading.Event()

    def other_session():
        with QUEUE.turn("another browser", 1):
            holding.set()
            hold.wait(30)

    other = threading.Thread(target=other_session)
    other.start()
    holding.wait(10)
    runner = threading.Thread(target=at.run)
    runner.start()
    deadline = time.time() + 60
    while not QUEUE.positions() and time.time() < deadline:
        time.sleep(0.05)
    assert len(QUEUE.positions()) == 1  # this session waits, first in line, while the other's job runs
    time.sleep(1.0)
    hold.set()
    runner.join(120)
    other.join(10)
    assert not at.exception
    assert "in the server's queue (position 1 at first)" in texts(at.caption)


def test_sign_in_is_required_where_auth_is_configured(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNVIZ_SHARED", "1")
    at = app_test(tmp_path)
    at.secrets["auth"] = {"redirect_uri": "http://localhost:8501/oauth2callback", "cookie_secret": "x" * 32,
                          "client_id": "attnviz", "client_secret": "y", "server_metadata_url":
                              "https://idp.example/.well-known/openid-configuration"}
    at.user = {"is_logged_in": False}
    at.run()
    assert not at.exception
    assert [b.label for b in at.button] == ["Sign in"] and "asks you to sign in" in texts(at.info)
    assert not at.get("plotly_chart") and "settings" not in at.session_state  # no page ran
    at.user = {"is_logged_in": True, "email": "ada@lab.example"}
    at.run()
    assert not at.exception and "signed in as ada@lab.example" in texts(at.sidebar.caption)
    assert "settings" in at.session_state


def test_a_text_over_the_shared_servers_token_cap_is_refused_before_it_runs(lab, tmp_path, monkeypatch):
    """The per-job token cap (``max_tokens`` in secrets.toml) is the library's refusal of the text, asked once with
    the capture's plan: one message that says where it can run, and nothing captured; a shorter text runs."""
    from attnviz.capture import Prepared

    root, _ = lab
    at = app_test(tmp_path)
    at.secrets["attnviz"] = {"max_tokens": 24}
    at.run()
    at.sidebar.text_input(key="model").set_value(str(root / "tiny-model")).run()
    runs, original = [], Prepared.run
    monkeypatch.setattr(Prepared, "run", lambda self, *a, **k: runs.append(self.text) or original(self, *a, **k))
    at.sidebar.text_area(key="text").input("The keeper lit the lamp at dusk, and the ships came home.").run()
    message = texts(at.error)
    assert "captures at most 24" in message and "This shared server runs at most 24 tokens a job" in message
    assert not runs
    at.sidebar.text_area(key="text").input("The lamp.").run()
    assert not at.exception and not at.error, texts(at.error)
    assert runs == ["The lamp."]
