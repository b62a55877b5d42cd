"""Any existing model directory loads without asking the Hub, in every form a user
types it; only names that are not directories go to the Hub. The Hub is made unreachable here."""

import json
import re

import pytest
import torch

from attnviz import capture, load
from attnviz.core.loading import models
from attnviz.errors import ModelLoadError

from test_cli import run


@pytest.fixture(scope="module")
def tiny_dir(default_model, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("models")
    config = LlamaConfig(vocab_size=len(default_model.tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "my-llama")
    default_model.tokenizer.save_pretrained(root / "my-llama")
    return root / "my-llama"


@pytest.fixture
def hub_unreachable(monkeypatch):
    """The Hub cannot be reached; a load that asks it anyway is recorded."""
    asked = []
    monkeypatch.setattr(models, "hub_reachable", lambda *a, **k: asked.append(True) or False)
    return asked


def _forms(tiny_dir, monkeypatch):
    home = tiny_dir.parent
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    (home / "nested").mkdir(exist_ok=True)
    if not (home / "nested" / "again").exists():
        (home / "nested" / "again").symlink_to(tiny_dir, target_is_directory=True)
    return {"absolute": str(tiny_dir), "dot-relative": "./my-llama", "relative": "nested/again",
            "home": "~/my-llama", "bare name": "my-llama"}


@pytest.mark.parametrize("form", ["absolute", "dot-relative", "relative", "home", "bare name"])
def test_every_form_of_a_directory_loads_offline(form, tiny_dir, hub_unreachable, monkeypatch):
    name = _forms(tiny_dir, monkeypatch)[form]
    lm = load(name)
    assert hub_unreachable == []  # never asked
    assert lm.model_id == name and lm.n_layers == 2
    reference = load(str(tiny_dir))
    ids = torch.tensor([lm.tokenizer("Same weights?")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, reference.model(ids).logits)
    assert capture(lm, "A local model.", "fwd").layer_masks == ["fwd", "fwd"]


def test_names_that_are_not_directories(tiny_dir, hub_unreachable, monkeypatch):
    monkeypatch.chdir(tiny_dir.parent)
    with pytest.raises(ModelLoadError, match="Hub cannot be reached"):
        load("someone/some-model")  # a Hub id: asks the Hub, which cannot be reached
    assert hub_unreachable == [True]
    with pytest.raises(ModelLoadError, match="does not exist"):
        load("./no-such-model")  # looks like a path: never sent to the Hub
    with pytest.raises(ModelLoadError, match="does not exist"):
        load("/no/such/model")
    (tiny_dir.parent / "file.txt").write_text("x")
    with pytest.raises(ModelLoadError, match="is not a directory"):
        load("file.txt")
    assert hub_unreachable == [True]


def test_finetune_round_trip_with_an_absolute_directory_and_no_hub(default_model, tmp_path):
    """`finetune --out /abs/dir`, then `eval --model /abs/dir`, with the Hub unreachable for real
    (offline mode off, the endpoint a closed local port)."""
    out = tmp_path / "ft"
    assert out.is_absolute()
    no_hub = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    done = run("finetune", "--corpus", "stdlib:specialnames", "--steps", "1", "--seq-len", "32", "--batch", "2",
               "--max-tokens", "400", "--out", str(out), env=no_hub)
    assert done.returncode == 0, done.stderr
    again = run("eval", "--model", str(out), "--corpus", "stdlib:specialnames", "--max-tokens", "200", env=no_hub)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["perplexity"] > 1
    gone = run("eval", "--model", "someone/some-model", "--max-tokens", "200", env=no_hub)
    assert gone.returncode == 2 and "Hub cannot be reached" in gone.stderr


@pytest.mark.parametrize("name", ["", "   ", 123, None, ["default"]])
def test_a_name_that_is_no_model_is_refused_in_one_line(name):
    """'' loaded the default model, and 123 failed with a foreign AttributeError."""
    from attnviz.errors import InputError

    with pytest.raises(InputError, match="a model is named by a string: 'default', a Hugging Face id or a local "
                                         f"directory, not {re.escape(repr(name))}$"):
        load(name)


def test_a_folder_that_lacks_its_weights_or_its_tokenizer_says_what_it_lacks(tmp_path):
    """A config.json alone failed deep in transformers' tokenizer code (a ValueError of six lines)."""
    import tiny
    from attnviz.errors import InputError
    from attnviz.lab.text import bytes_tokenizer

    model = tiny.build("llama")
    folder = tmp_path / "m"
    model.config.save_pretrained(folder)
    with pytest.raises(InputError, match=r"has a config.json but no weights \(a .safetensors or .gguf file; "
                                         r"attnviz loads only safetensors or GGUF\) and no tokenizer \(one of "
                                         r"tokenizer.json") as err:
        load(str(folder))
    assert isinstance(err.value, ModelLoadError) and "\n" not in str(err.value)
    model.save_pretrained(folder)
    with pytest.raises(InputError, match=r"has a config.json but no tokenizer \(one of tokenizer.json, "):
        load(str(folder))
    (folder / "model.safetensors").unlink()
    bytes_tokenizer().save_pretrained(folder)
    with pytest.raises(InputError, match=r"but no weights \(a .safetensors or .gguf file"):
        load(str(folder))
