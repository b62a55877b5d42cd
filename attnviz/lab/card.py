"""A lab checkpoint's model card (``README.md``) and the attention implementation its ``config.json`` names
(docs/lab.md#plain-transformers): what was trained (the kind with its definition and paper, the mask, the family,
the task, the setup, the step and loss), how to load it with attnviz, and what plain transformers does with it.
"""

from __future__ import annotations

import json
from pathlib import Path

from attnviz.core.loading import plain
from attnviz.core.spec import kinds

CARD = "README.md"


def write(folder, model, setup, step: int, loss: float) -> Path:
    """Into a checkpoint's ``folder`` (``model`` saved there): the attention implementation of its kind in its
    ``config.json`` (:func:`attnviz.core.loading.plain.mark`) and its card. Returns the card's path."""
    name = plain.mark(folder, model.config)
    path = Path(folder) / CARD
    path.write_text(card(setup, step, loss, name, type(model).__name__))
    return path


def _cell(text: str) -> str:
    return text.replace("|", r"\|")  # a table cell's own bars (softpick's |exp(z) − 1|)


def _plain_load(spec: str, name: str | None, family: str) -> str:
    if name is None:
        return (f"- Plain transformers (`AutoModelForCausalLM.from_pretrained`, no remote code) loads it as any "
                f"{family} and computes what was trained: {family} computes {spec} itself.")
    return (f"- Plain transformers refuses it where attnviz is not imported: its `config.json` names the attention "
            f"implementation `{name}`, which only attnviz registers, so `AutoModelForCausalLM.from_pretrained` "
            f"raises `ValueError: Specified attn_implementation=\"{name}\" is not supported` instead of running a "
            f"softmax the model was not trained with.\n"
            f"- After `import attnviz`, the same plain `AutoModelForCausalLM.from_pretrained(folder)` computes {spec} "
            "(attnviz registers the name with transformers' `AttentionInterface`; no remote code).\n"
            "- An explicit `attn_implementation=` (\"sdpa\", \"eager\") overrides the saved one and computes a plain "
            f"softmax: not what was trained.")


def card(setup, step: int, loss: float, name: str | None, family: str) -> str:
    """The model card of a checkpoint of ``setup`` at ``step``; ``name`` the attention implementation its config
    names (None: none), ``family`` its transformers class."""
    kind = kinds.parse(setup.kind)
    task = setup.as_dict()["task"]
    rows = [("kind", f"`{kind.spec}`: {type(kind).line}"), ("mask", f"`{setup.arch}`"),
            ("family", f"`{family}`"),
            ("task", f"`{task['name']}` " + ", ".join(f"{k}={v}" for k, v in task.items() if k != "name")),
            ("step", f"{step} of {setup.steps}" + (f", loss {loss:.4f}" if loss == loss else "")),
            ("attn_implementation", f"`{name}`" if name else "none (the family's own)")]
    rows += [(k, f"`{json.dumps(v)}`") for k, v in setup.as_dict().items() if k not in ("kind", "arch", "task")]
    mask = ("" if setup.arch == "fwd" else
            f"\nIt was trained under the mask `{setup.arch}`, which no forward applies unless asked: a plain forward "
            f"(and attnviz without a recipe) runs the causal mask; capture it as trained with "
            f"`attnviz capture --model <folder> --arch \"{setup.arch}\"` or `attnviz.capture(lm, text, "
            f"\"{setup.arch}\")`.\n")
    return (f"# attnviz lab checkpoint: {kind.spec}, step {step}\n\n"
            "A small decoder trained from scratch by the attnviz lab (docs/lab.md in attnviz), to watch where an "
            "attention sink forms under an attention kind and a mask.\n\n"
            "| | |\n|---|---|\n" + "".join(f"| {k} | {_cell(v)} |\n" for k, v in rows) +
            "\n## Loading\n\n"
            "- With attnviz: `attnviz.load(\"<folder>\")` (or the run folder, for its last step), then "
            "`attnviz.capture(lm, text)`: the engine computes the kind, and the maps and the next-token distribution "
            "equal the model's own forward.\n"
            + _plain_load(kind.spec, name, family) + "\n" + mask)
