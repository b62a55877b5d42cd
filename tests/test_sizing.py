"""The plan's estimates against what runs: captures of the default model at about 1,000 tokens, every allocation
tracked, hold what ``Keep.host_bytes`` says and make what ``Keep.device_bytes`` says, within 10 % or 16 MB.

How it is measured, on the CPU, where the device's memory is the host's:

- torch: a ``TorchDispatchMode`` sees every operator. Each CPU tensor an operator makes in new storage (a view, an
  in-place or ``out=`` operator, or a ``to``/``reshape`` that returns its input, makes none) is counted by its
  storage's bytes until that storage is freed (a ``weakref.finalize`` on the storage, which torch keeps alive
  exactly as long as the memory). Allocations inside an operator's own kernel (workspaces) are not seen.
- numpy: numpy reports its data allocations to ``tracemalloc``, which the dispatch mode reads at every operator
  (Python objects are counted there too: small beside the arrays).

Three numbers per capture, each compared with its estimate:

- held: what the capture holds, as ``lru.nbytes`` counts it (the app's cache), against ``host_bytes``;
- working: the peak of the torch bytes that do not outlive the capture (blocks, activations, allow-sets: what a
  GPU would hold beside the weights), against ``device_bytes``;
- peak: the peak of everything tracked, torch and numpy together, at most ``host_bytes + device_bytes`` (on the CPU
  one memory holds both; the host copies made after the forward do not meet its working set). At each operator
  the numpy peak since the previous operator is added to the torch bytes live after the previous operator, never
  fewer than were live then, so the peak is not missed between operators.

Deterministic: the same operators allocate the same sizes on every run; nothing is timed.
"""


import pytest
import torch

from attnviz import plan
from attnviz.capture import capture, prepare
from ui.lru import nbytes
from allocations import Allocations
from attnviz.plan import Keep
from attnviz.recipe import Recipe
from attnviz.tokens import tokenize

from conftest import ENGLISH

MB = 2**20
TEXT = " ".join([ENGLISH] * 21)  # 1,008 tokens of the default model


def close(measured: int, estimate: int) -> bool:
    return abs(measured - estimate) <= max(0.10 * estimate, 16 * MB)


def per_head(lm) -> Recipe:
    """Every other head of the lower half of the layers on a sink and a window: those layers keep each head's
    allow-set, the others share the mask's."""
    heads = ",".join(map(str, range(0, lm.n_heads, 2)))
    return Recipe.of(lm, "fwd", f"headwindow(heads={heads}, s=4, w=64)@0-{lm.n_layers // 2 - 1}")


CASES = {
    "full maps": (lambda lm: "fwd", Keep()),
    "statistics": (lambda lm: "fwd", Keep(statistics=True)),
    "one statistic": (lambda lm: "fwd", Keep(statistics=("alpha",))),
    "pooled maps": (lambda lm: "fwd", Keep(statistics=True, pool=plan.POOL, value_norms=True, scores=True)),
    "per-head mask": (per_head, Keep(statistics=True, pool=plan.POOL)),
}


@pytest.mark.parametrize("case", CASES)
def test_the_estimates_are_what_a_capture_holds_and_makes(default_model, case):
    recipe, keep = CASES[case]
    recipe = recipe(default_model)
    masks = plan.masks_of(default_model, recipe)
    n = len(tokenize(default_model, TEXT)[0])
    host, device = keep.host_bytes(default_model, n, masks), keep.device_bytes(default_model, n, masks)
    capture(default_model, TEXT[:400], recipe, keep)  # first-use caches (tokenizer, hooks) are not the capture's
    with Allocations() as seen:
        cap = capture(default_model, TEXT, recipe, keep)
    held, working = nbytes(cap), seen.working()
    table = (f"{case}, {n} tokens: held {held / MB:.1f} MB (host_bytes {host / MB:.1f}), working {working / MB:.1f} MB "
             f"(device_bytes {device / MB:.1f}), peak {seen.peak / MB:.1f} MB (sum {(host + device) / MB:.1f})")
    assert close(held, host), table
    assert close(working, device), table
    assert seen.peak <= host + device + max(0.10 * (host + device), 16 * MB), table


def test_the_engine_reads_its_sizes_from_the_plan():
    """The block size on each device and the staging of full maps are asked of the run's ``Sizes`` (the plan's),
    never computed by the engine; staged maps come out as the written ones."""
    from attnviz.core import engine
    from attnviz.core.spec.arch import parse

    from tiny import loaded

    lm, n = loaded("llama"), 60
    asked = []

    class Asked(plan.Sizes):
        def block_bytes(self, device):
            asked.append(("block", torch.device(device).type))
            return 4 * lm.n_heads * n * 7  # 7-row blocks

        def stages(self, nbytes, device):
            asked.append(("staged", nbytes))
            return True

    ids = torch.randint(3, 90, (1, n), generator=torch.Generator().manual_seed(0))
    masks = parse("fwd*2 + bidir", lm.n_layers).layers
    _, staged = engine.forward(lm.model, ids, masks, engine.Record(storage_dtype=torch.float32, sizes=Asked()))
    _, written = engine.forward(lm.model, ids, masks, engine.Record(storage_dtype=torch.float32))
    assert ("block", "cpu") in asked and asked.count(("staged", lm.n_heads * n * n * 4)) == lm.n_layers
    for layer in range(lm.n_layers):
        torch.testing.assert_close(staged.probs[layer], written.probs[layer])
    assert not plan.Sizes.stages(1, "cpu")  # on the CPU the blocks go straight into the host array


def test_a_recipes_per_head_masks_are_charged_what_they_hold():
    """A headwindow layer keeps each head's allow-set and the cells some head may see, its own; the other layers
    share their mask's. The plan reads that from the recipe (before: a few n × n per capture, whatever the
    recipe)."""
    from tiny import loaded

    lm = loaded("llama")
    recipe = Recipe.of(lm, "fwd", "headwindow(heads=1,3, s=2, w=5)@0-1")
    keep, text = Keep(statistics=True, pool=24), "The quick brown fox jumps over the lazy dog. " * 5
    masks = plan.masks_of(lm, recipe)
    cap = capture(lm, text, recipe, keep)
    n = cap.n_tokens
    assert masks.host_bytes([0, 1, 2], n, lm.n_heads) == (1 + 2 * (lm.n_heads + 1)) * n * n
    assert 0 <= nbytes(cap) - keep.host_bytes(lm, n, masks) < 32 * 1024  # the tokens' Python objects
    assert prepare(lm, text, recipe, keep, plan.Budget(10**12, 10**12)).plan.estimate == keep.host_bytes(lm, n, masks)
