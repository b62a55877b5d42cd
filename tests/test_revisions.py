"""Hub revisions as checkpoints (docs/sweeps.md#checkpoints): ``id@revision`` is read by the loader and, in a sweep's
models, two revisions that serve the same weight files are refused before anything runs. The Hub is replaced by a
stand-in here (no network): its file listing with each weight file's SHA-256."""

from types import SimpleNamespace

import pytest

from attnviz.core.loading import models
from attnviz.errors import InputError, ModelLoadError
from attnviz.sweep.spec import checkpoint_models

SERVED = {  # revision -> the weight files' SHA-256 the Hub lists (step143000 is the final weights, as is main)
    "step1000": "a" * 64, "step2000": "b" * 64, "step143000": "f" * 64, "main": "f" * 64}


def _info(repo, revision=None, files_metadata=False):
    if revision not in SERVED:
        raise OSError(f"Revision Not Found for url: https://huggingface.co/api/models/{repo}/revision/{revision}")
    weights = SimpleNamespace(rfilename="model.safetensors", lfs=SimpleNamespace(sha256=SERVED[revision]), blob_id="x")
    config = SimpleNamespace(rfilename="config.json", lfs=None, blob_id=revision)  # differs, not a weight file
    return SimpleNamespace(siblings=[config, weights])


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **k: _info(*a, **k))


def test_an_id_at_a_revision_is_read_and_a_half_written_one_refused():
    assert models.hub_revision("EleutherAI/pythia-70m@step1000") == ("EleutherAI/pythia-70m", "step1000")
    assert models.hub_revision("EleutherAI/pythia-70m") == ("EleutherAI/pythia-70m", None)
    for bad in ("EleutherAI/pythia-70m@", "@step1000"):
        with pytest.raises(InputError, match="id@revision"):
            models.hub_revision(bad)


def test_the_loader_asks_the_hub_for_the_revision(monkeypatch):
    import transformers

    asked = {}

    def config(source, **kwargs):
        asked.update(source=source, **kwargs)
        raise OSError("stand-in: stop before any download")

    monkeypatch.setattr(models, "hub_reachable", lambda timeout=2.0: True)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", config)
    with pytest.raises(ModelLoadError):
        models.load("EleutherAI/pythia-70m@step1000")
    assert asked["source"] == "EleutherAI/pythia-70m" and asked["revision"] == "step1000"


def test_revisions_serving_the_same_weights_are_refused_in_one_line(hub):
    repo = "EleutherAI/pythia-70m"
    assert checkpoint_models([f"{repo}@step1000", f"{repo}@step2000", f"{repo}@step143000"]) == [
        f"{repo}@step1000", f"{repo}@step2000", f"{repo}@step143000"]
    with pytest.raises(InputError, match="serve the same weights") as err:
        checkpoint_models([f"{repo}@step1000", f"{repo}@step143000", f"{repo}@main"])
    assert "\n" not in str(err.value) and "@step143000" in str(err.value) and "@main" in str(err.value)
    assert models.revision_hash(f"{repo}@step143000") == models.revision_hash(f"{repo}@main")
    assert models.revision_hash(f"{repo}@step1000") != models.revision_hash(f"{repo}@step2000")


def test_a_revision_the_hub_does_not_serve_is_one_line(hub):
    with pytest.raises(InputError, match="cannot read the weights of 'EleutherAI/pythia-70m@step7'") as err:
        checkpoint_models(["EleutherAI/pythia-70m@step7"])
    assert "\n" not in str(err.value)


def test_a_folder_copied_from_a_revision_hashes_as_that_revision(tmp_path, monkeypatch):
    import hashlib

    import huggingface_hub

    (tmp_path / "model.safetensors").write_bytes(b"weights of step1000")
    (tmp_path / "config.json").write_text("{}")  # not a weight file: in neither hash
    served = hashlib.sha256(b"weights of step1000").hexdigest()
    listing = SimpleNamespace(siblings=[SimpleNamespace(rfilename="config.json", lfs=None, blob_id="c"),
                                        SimpleNamespace(rfilename="model.safetensors",
                                                        lfs=SimpleNamespace(sha256=served), blob_id="x")])
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **k: listing)
    assert models.folder_hash(tmp_path) == models.revision_hash("EleutherAI/pythia-70m@step1000")
