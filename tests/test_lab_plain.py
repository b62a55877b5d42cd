"""No silent softmax outside attnviz (docs/lab.md#plain-transformers): a lab checkpoint of a kind transformers does not
compute (softpick, softmax-off-by-one) names attnviz's attention implementation in its config.json, so a plain
``AutoModelForCausalLM.from_pretrained`` in a process that has not imported attnviz refuses it, and after ``import
attnviz`` (in a fresh process, where transformers is imported after attnviz, and in this one) computes the trained kind:
its maps and next-token distribution equal attnviz's capture within 1e-5. A softmax checkpoint loads plainly as
before; an older checkpoint (no attention implementation saved) still loads in attnviz; each checkpoint carries a
model card that names its kind and says what a plain load does."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attnviz
from attnviz.capture import capture
from attnviz.core.loading import plain
from attnviz.errors import ModelLoadError
from attnviz.lab.tasks import BigramBackcopy
from attnviz.lab.train import Setup, train
from attnviz.plan import Keep

ROOT = Path(__file__).resolve().parent.parent
TEXT = "t5 T1 t5 t7 t9 T2 t9 t4 t6"
KINDS = {"softpick": "attnviz_softpick", "sink(logit=0)": "attnviz_sink", "softmax": None}

# a plain load of each folder (argv[1]: JSON of folders, argv[2]: the ids): its maps and log-probabilities, or the
# refusal
PLAIN = """
import json, sys, torch
from transformers import AutoModelForCausalLM
folders, ids, found = json.loads(sys.argv[1]), json.loads(sys.argv[2]), {}
for kind, folder in folders.items():
    try:
        model = AutoModelForCausalLM.from_pretrained(folder)
    except ValueError as err:
        found[kind] = {"refused": str(err).splitlines()[0]}
        continue
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    found[kind] = {"implementation": model.config._attn_implementation,
                   "map": out.attentions[0][0].tolist() if out.attentions else None,
                   "logprobs": torch.log_softmax(out.logits[0, -1], -1).tolist()}
print("FOUND", json.dumps({"found": found, "attnviz": sorted(m for m in sys.modules if m.startswith("attnviz"))}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each kind's tiny run (two steps), its last checkpoint and attnviz's capture of it."""
    out, made = tmp_path_factory.mktemp("plain"), {}
    for kind in KINDS:
        setup = Setup(layers=1, width=32, heads=2, steps=2, batch=4, every=2, warmup=1, device="cpu", kind=kind,
                      task=BigramBackcopy(vocab=16, triggers=2, length=16))
        end = train(setup, out / kind.replace("(", "-").replace(")", "").replace("=", ""))
        lm = attnviz.load(str(end), device="cpu")
        made[kind] = (end, capture(lm, TEXT, keep=Keep(storage_dtype=torch.float32)))
    return made


def _plain(runs, before: str = "") -> dict:
    ids = runs["softmax"][1].token_ids
    folders = {kind: str(end) for kind, (end, _) in runs.items()}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", before + PLAIN, json.dumps(folders), json.dumps(ids)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("FOUND", 1)[1])


def _equal(found: dict, cap) -> None:
    """The maps (where the load gives them: SDPA, a softmax checkpoint's, gives none) and the log-probabilities."""
    if found["map"] is not None:
        np.testing.assert_allclose(np.array(found["map"]), cap.layer_probs(0), atol=1e-5)
    np.testing.assert_allclose(np.array(found["logprobs"]), cap.next_logprobs, atol=1e-5)


def test_without_attnviz_a_plain_load_refuses_a_kind_transformers_does_not_compute(runs):
    result = _plain(runs)
    assert result["attnviz"] == []  # the process never imported attnviz
    found = result["found"]
    for kind in ("softpick", "sink(logit=0)"):
        assert f'attn_implementation="{KINDS[kind]}"` is not supported' in found[kind]["refused"], found[kind]
    assert found["softmax"]["implementation"] == "sdpa"  # a softmax checkpoint loads plainly, as before
    _equal(found["softmax"], runs["softmax"][1])


def test_after_import_attnviz_a_fresh_process_computes_the_kind_with_a_plain_load(runs):
    """transformers imported after attnviz: the names are registered as its modeling code is imported."""
    result = _plain(runs, "import sys, attnviz\nassert 'transformers.modeling_utils' not in sys.modules\n")
    for kind, name in KINDS.items():
        found = result["found"][kind]
        assert found["implementation"] == (name or "sdpa") and (found["map"] is None) == (name is None)
        _equal(found, runs[kind][1])


@pytest.mark.parametrize("kind", list(KINDS))
def test_in_this_process_a_plain_load_equals_the_capture(runs, kind):
    from transformers import AutoModelForCausalLM

    end, cap = runs[kind]
    model = AutoModelForCausalLM.from_pretrained(end)
    assert model.config._attn_implementation == (KINDS[kind] or "sdpa")
    with torch.no_grad():
        out = model(torch.tensor([cap.token_ids]), output_attentions=True)
    _equal({"map": out.attentions[0][0].numpy() if out.attentions else None,
            "logprobs": torch.log_softmax(out.logits[0, -1], -1).numpy()}, cap)
    if kind == "softpick":  # not the softmax: a row of softpick sums below 1
        assert float(out.attentions[0][0, :, 1:].sum(-1).max()) < 1 - 1e-3


def test_each_checkpoint_carries_a_model_card_and_says_what_a_plain_load_does(runs):
    for kind, name in KINDS.items():
        end = runs[kind][0]
        card = (end / "README.md").read_text()
        saved = json.loads((end / "config.json").read_text())
        assert card.startswith(f"# attnviz lab checkpoint: {kind}, step 2") and "| mask | `fwd` |" in card
        assert "bigram-backcopy" in card and 'attnviz.load("<folder>")' in card
        assert saved.get("attn_implementation") == name
        if name:
            assert f"`{name}`" in card and "refuses it where attnviz is not imported" in card
        else:
            assert "loads it as any LlamaForCausalLM and computes what was trained" in card
    assert r"Σ \|exp(z) − 1\|" in (runs["softpick"][0] / "README.md").read_text()  # the table keeps its cells


def test_which_kinds_name_an_attention_implementation():
    """Those the engine writes out itself; the softmax, gpt-oss's learned sink and Qwen3-Next's gate load plainly."""
    named = {kind: plain.implementation(kind) for kind in ("softmax", "sink", "sink(init=0.5)", "gate", "softpick",
                                                           "sigmoid", "sigmoid(bias=0)", "relu", "sink(logit=-1)")}
    assert named == {"softmax": None, "sink": None, "sink(init=0.5)": None, "gate": None,
                     "softpick": "attnviz_softpick", "sigmoid": "attnviz_sigmoid", "sigmoid(bias=0)": "attnviz_sigmoid",
                     "relu": "attnviz_relu", "sink(logit=-1)": "attnviz_sink"}


def test_an_older_checkpoint_loads_in_attnviz_and_a_resumed_run_keeps_the_name(runs, tmp_path):
    import shutil

    end, cap = runs["softpick"]
    old = tmp_path / "old"
    shutil.copytree(end, old)
    saved = json.loads((old / "config.json").read_text())
    del saved["attn_implementation"]  # saved before checkpoints named one
    (old / "config.json").write_text(json.dumps(saved))
    record = json.loads((old / "attnviz_run.json").read_text())
    del record["sha256"]  # nor did it hold its files' SHA-256
    (old / "attnviz_run.json").write_text(json.dumps(record))
    again = capture(attnviz.load(str(old), device="cpu"), TEXT, keep=Keep(storage_dtype=torch.float32))
    np.testing.assert_allclose(again.next_logprobs, cap.next_logprobs, atol=1e-6)

    run = tmp_path / "run"
    shutil.copytree(end.parent, run)
    setup = Setup(layers=1, width=32, heads=2, steps=3, batch=4, every=2, warmup=1, device="cpu", kind="softpick",
                  task=BigramBackcopy(vocab=16, triggers=2, length=16))
    resumed = train(setup, run)  # loads step-2 through from_pretrained, with the name it saved
    assert resumed.name == "step-3"
    assert json.loads((resumed / "config.json").read_text())["attn_implementation"] == "attnviz_softpick"


def test_a_config_whose_name_and_kind_disagree_is_refused(runs, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    edited = tmp_path / "edited"
    shutil.copytree(runs["softpick"][0], edited)
    saved = json.loads((edited / "config.json").read_text())
    saved["attnviz_kind"] = "relu"
    (edited / "config.json").write_text(json.dumps(saved))
    model = AutoModelForCausalLM.from_pretrained(edited)
    with pytest.raises(ModelLoadError, match="names the attention implementation attnviz_softpick, but its own kind "
                                             "is relu"):
        model(torch.tensor([[0, 5, 1]]))


def test_a_lab_model_finetuned_keeps_its_name(runs, tmp_path):
    """``attnviz finetune`` of a softpick checkpoint saves a folder that names attnviz_softpick too."""
    from attnviz.effects.finetune import finetune

    lm = attnviz.load(str(runs["softpick"][0]), device="cpu")
    ids = BigramBackcopy(vocab=16, triggers=2, length=16).batch(8, 1).flatten().tolist()
    finetune(lm, ids, tmp_path / "ft", steps=1, seq_len=8, batch=2, save_every=1)
    assert json.loads((tmp_path / "ft" / "config.json").read_text())["attn_implementation"] == "attnviz_softpick"
