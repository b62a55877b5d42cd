"""What a capture will hold and need, before it runs: arithmetic on what the plan read once (the model's
:class:`~attnviz.core.sizing.sizes.Shape`, the recorded layers, the recipe's :class:`~attnviz.core.sizing.sizes.Masks`) and on
what the capture keeps (an :class:`attnviz.plan.Keep`, read by its fields). The plan decides with these
(:mod:`attnviz.plan`); ``tests/test_sizing.py`` holds them to what runs, every allocation tracked.

- :func:`held`: the host bytes the capture holds (as :func:`ui.lru.nbytes` counts it);
- :func:`working`: the device bytes it needs beyond the weights, and :func:`check`, its refusal;
- the checkpoints (:func:`checkpoint_layers`, :func:`checkpoint_bytes`, :func:`checkpoint_count`) and the pooled
  maps' side (:func:`pooled_side`); :func:`largest`, the "what would fit" of every refusal.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from attnviz.core.kernel import kernels
from attnviz.core.model import devices
from attnviz.core.record.pooled import pool_factor
from attnviz.core.record.packed import WORTH
from attnviz.core.record.reduce import GROUP_BYTES
from attnviz.core.sizing.sizes import Masks, Shape, Sizes
from attnviz.stats import metrics


def _named(keep) -> tuple[str, ...] | None:
    """The statistics a keep names (None: every one)."""
    return None if keep.statistics is True else keep.statistics


def held(shape: Shape, keep, n: int, masks: Masks, recorded: list[int]) -> int:
    """What a capture of ``n`` tokens of ``recorded`` layers keeping ``keep`` will hold on the host.

    Full maps: storage-dtype (H, n, n) per recorded layer, their lower triangle where every mask is causal (held
    packed: docs/methods.md#full-maps-held-packed); statistics: :func:`metrics.statistic_floats` per head and
    token per layer, plus the fp16 pooled maps (and pooled value-weighted maps and scores when ``value_norms`` /
    ``scores`` ask for them) at the side :func:`pooled_side` gives; the recorded layers' allow-sets as the recipe's
    ``masks`` make them (:meth:`Masks.host_bytes`); the extras; the checkpoints; the last position's log-probs."""
    heads = shape.n_heads
    if keep.statistics:
        pooled_maps = 1 + keep.value_norms + keep.scores  # weights, and value-weighted maps / scores when asked
        floats = metrics.statistic_floats(_named(keep))
        per_layer = heads * n * 4 * floats + heads * pooled_side(n, keep.pool) ** 2 * 2 * pooled_maps
    else:  # probabilities held packed under causal masks (their lower triangle, and the spans), scores whole;
        # bfloat16 maps are held in float32 (numpy has no bfloat16)
        itemsize = 4 if keep.storage_dtype == torch.bfloat16 else keep.storage_dtype.itemsize
        triangle = n * (n + 1) // 2 if masks.causal and n > 1 else n * n
        per_layer = heads * (triangle + n * n * keep.scores) * itemsize + (8 * (3 * n + 1) if triangle < n * n else 0)
    per_layer += heads * n * 4 if keep.value_norms else 0
    per_layer += (heads + 2 * shape.n_kv_heads) * n * shape.head_dim * 4 if keep.qkv else 0  # fp32 q, k, v
    boundaries = shape.n_layers + 1  # the embeddings and every layer's output
    hidden = boundaries * n * shape.hidden * 2 if keep.hidden_states else 0
    activations = boundaries * (n + 40) * 4 if keep.activations else 0  # norms, and a few top values each
    kept = len(checkpoint_layers(shape, keep.checkpoints)) * checkpoint_bytes(shape, n)
    allow = masks.host_bytes(recorded, n, heads)
    return len(recorded) * per_layer + allow + hidden + activations + kept + 4 * shape.vocab


def working(shape: Shape, keep, n: int, masks: Masks, recorded: list[int]) -> int:
    """What a capture of ``n`` tokens of ``recorded`` layers keeping ``keep`` needs on the model's device beyond the
    weights (on the block route: the fused one needs less): the layer in flight, in the model's dtype, which holds
    the embeddings, its input and its normed input, then the larger of

    - its attention: queries, keys, values, the output gathered block by block, one query block's working set
      (:func:`block_copies` fp32 copies of a block of :meth:`Sizes.block_of` bytes), the layer's statistics and
      pooled maps while they are made (fp32; finished layers go to the host), its full maps where they are staged
      on the device (:meth:`Sizes.room`), with their packed cells and the index that gathers them;
    - its MLP: three n × intermediate activations, beside the sum after attention;

    and, for the whole forward: on a GPU, the fused layers' sums waiting to be finished together; the allow-sets,
    one n × n bool each (``masks.device``), or a block's rows of each where a statistics capture makes them a block
    of rows at a time (above the whole-allow size); every recorded layer's value norms; every layer's hidden states
    when asked, and after the forward what is made of them (their stack, the activations' fp32 copies) where that
    is more; the last position's logits. Full maps go to the host as they are made, so they count against host
    memory (:func:`held`), not here; on the CPU the two are one memory, and a capture's peak there is at most their
    sum."""
    heads, itemsize, hidden = shape.n_heads, shape.itemsize, shape.hidden
    sizes = Sizes.of(keep)
    rows = min(n, max(1, sizes.block_of(shape.block) // (4 * heads * n)))
    cells = masks.largest_block(n, rows, every_key=keep.full_maps and keep.scores)
    block = 4 * heads * cells * block_copies(shape, keep, masks, recorded)
    made = 0
    if keep.statistics:
        made = heads * n * 4 * metrics.statistic_floats(_named(keep)) + heads * pooled_side(n, keep.pool) ** 2 * 4 * (
            1 + keep.value_norms + keep.scores)
    maps = heads * n * n * keep.storage_dtype.itemsize * (1 + keep.scores) if keep.full_maps else 0
    staged = maps if maps and not shape.on_cpu and Sizes.room(maps, shape.free) else 0
    if staged and n > 1:  # beside it, its probabilities packed for the host (float32 from bfloat16) and their index
        cells = n * (n + 1) // 2 if masks.causal else int(WORTH * n * n)  # the most a packed layer holds
        half = 4 if keep.storage_dtype == torch.bfloat16 else 0
        staged += cells * (heads * (keep.storage_dtype.itemsize + half) + 8)
    attention = n * (2 * heads + 2 * shape.n_kv_heads) * shape.head_dim * itemsize + int(block) + made + staged
    layer = 3 * n * hidden * itemsize + max(attention, n * (hidden + 3 * shape.inner) * itemsize)
    cells = (shape.n_layers + 1) * n * hidden  # every layer's hidden states, the embeddings first
    states = cells * itemsize if keep.hidden_states or keep.activations else 0
    # after the forward, beside them: their stack (and its fp16 copy on an accelerator), two fp32 copies
    # for the activations' norms and top values
    half = 0 if shape.on_cpu or shape.dtype == torch.float16 else cells * 2
    after = states + max(states + half if keep.hidden_states else 0, 2 * cells * 4 if keep.activations else 0)
    norms = len(recorded) * heads * n * 4 if keep.value_norms else 0
    # an allow-set above the whole-allow size is made a block of rows at a time on the statistics route
    # (an AllowSet of form "rows"): only a block's rows are ever on the device, not n × n
    rowwise = keep.statistics and n * n > sizes.whole_allow and not masks.per_head(recorded)
    allow = masks.device * (rows if rowwise else n) * n
    # on the fused route (CUDA with Triton), the layers' kernel sums wait to be finished together
    # (reduce.GROUP_BYTES, and one layer more), then are stacked beside themselves
    raw = heads * (6 * n + (1 + keep.value_norms + keep.scores) * pooled_side(n, keep.pool) ** 2) * 4
    fused = keep.statistics and torch.device(shape.device).type == "cuda" and kernels.available()
    waiting = 2 * min(len(recorded) * raw, GROUP_BYTES + raw) if fused else 0
    return max(layer + states, after) + norms + allow + waiting + 4 * shape.vocab


def block_copies(shape: Shape, keep, masks: Masks, recorded=()) -> float:
    """fp32 copies of one query block alive at once on the block route, the most of three moments:

    - the softmax being made: the scores (it runs in place) and what the recipe makes beside them
      (``masks.softmax``); in a half-precision model, the matmul's own scores beside their fp32 copy;
    - the recorders: the probabilities and the largest of what a recorder makes of them: a pooled map's padded
      copy, the value-weighted block and its padded copy, the masked scores and their padded copy, a
      statistic's own row sum, the entropy's temporary (one head's rows at a time);
    - in a half-precision model, the probabilities cast for P·V (half a copy).

    Where the ``recorded`` layers' heads have masks of their own, the block's per-head allow-set (bools: a
    quarter of a copy) is there throughout, and its complement while the scores are masked."""
    half = shape.itemsize / 4 if shape.itemsize < 4 else 0.0
    temps = [half]
    if keep.statistics:
        needed = metrics.needed_sums(metrics.kept_statistics(_named(keep)))
        temps.append(1 / shape.n_heads if "plogp" in needed else 0.0)
        temps.append(float(any(isinstance(x, metrics.RowSum) for x in needed)))
        temps += [float(bool(keep.pool)), 2.0 * bool(keep.pool and keep.value_norms), 2.0 * bool(keep.scores)]
    allow = 0.25 if masks.per_head(recorded) else 0.0
    return allow + 1 + max(max(masks.softmax, half) + allow, max(temps))


def check(shape: Shape, keep, n: int, masks: Masks, recorded: list[int], what: str = "this capture") -> None:
    """Refuse, before running, a capture whose device working set (:func:`working`) exceeds the device's free
    memory (``torch.cuda.mem_get_info``, or ``ATTNVIZ_DEVICE_MB``), saying what would fit."""
    free, need = shape.free, working(shape, keep, n, masks, recorded)
    if free is None or need <= free:
        return
    fit = largest(n, lambda m: working(shape, keep, m, masks, recorded) <= free)
    smaller = working(shape, replace(keep, block_bytes=4 * devices.MB), n, masks, recorded)
    hint = f"; with ATTNVIZ_BLOCK_MB=4, ~{devices.mb(smaller)}" if smaller < need else ""
    raise devices.DeviceMemoryError(
        f"{what} needs ~{devices.mb(need)} on {shape.device} for {n} tokens, more than the "
        f"{devices.mb(free)} free there{hint}. What would fit: "
        + (f"a text of at most ~{fit} tokens" if fit else "nothing until memory is freed on that device")
        + ("" if keep.statistics else ", or statistics only (`attnviz sinks`, a lower ATTNVIZ_FULL_MAPS_MB)"))


def pooled_side(n: int, pool: int | None) -> int:
    """Cells a side of the pooled maps of ``n`` tokens at most ``pool`` cells a side (0 without a pool): ceil(n / f)
    for the factor :func:`pool_factor` rounds up to, between pool / 2 and pool."""
    return -(-int(n) // pool_factor(n, pool)) if pool else 0


def checkpoint_bytes(shape: Shape, n_tokens: int) -> int:
    """One kept layer input: (n, hidden size) in the model's dtype."""
    return int(n_tokens) * shape.hidden * shape.itemsize


def checkpoint_layers(shape: Shape, count: int) -> frozenset[int]:
    """The layers whose inputs ``count`` checkpoints keep: evenly spaced above layer 0 (whose input is the
    embeddings, cheap to recompute), so a region of any layer resumes at most ceil(L / (count + 1)) - 1
    layers below it. Empty where the family cannot resume (:attr:`Shape.resumable`); a capture keeps
    none under a residual variant (its own layer loop)."""
    if count <= 0 or not shape.resumable:
        return frozenset()
    stride = -(-shape.n_layers // (min(count, shape.n_layers - 1) + 1))
    return frozenset(range(stride, shape.n_layers, stride))


def checkpoint_count(shape: Shape, n_tokens: int, budget: int, most: int = 8) -> int:
    """How many checkpoints of ``n_tokens`` fit ``budget`` bytes (at most ``most``: eight put every
    region within ceil(L / 9) layers of one)."""
    one = checkpoint_bytes(shape, n_tokens)
    return 0 if one <= 0 else max(0, min(most, budget // one))


def largest(n: int, fits, step: int = 64) -> int:
    """The largest length ≤ ``n`` on a grid of ``step`` for which ``fits(length)`` holds (0 when none): the
    "what would fit" of every refusal of the plan and its device check."""
    return next((m for m in range(n, 0, -step) if fits(m)), 0)
