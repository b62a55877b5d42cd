"""Run a Hugging Face decoder with one mask per layer and record what every head attends to: the engine's one way
in (:func:`forward`), in parts along the flow (docs/layout.md#the-engine):

- :mod:`attnviz.core.engine.run`: the run of one forward and what it keeps (``Computes``, ``Record``, ``Feed``, ``Run``),
  and :mod:`attnviz.core.engine.forward`: the forward itself, and a forward resumed from a layer's kept input;
- :mod:`attnviz.core.spec.allowsets`: which keys each query may see, and the sink key a mask leaves open;
- :mod:`attnviz.core.engine.attention` and :mod:`attnviz.core.engine.routes`: the registered attention function and each
  layer's route (SDPA, the fused kernel, or the block route's explicit softmax);
- :mod:`attnviz.core.engine.sites`: the named sites, the one way to read or replace an activation, and
  :mod:`attnviz.core.engine.hooks`: the engine's own functions there (``patch``, kept layer inputs);
- :mod:`attnviz.core.sizing.sizes`: the sizes a run works to, as the plan decides them.

This module gathers their names, so that callers write ``engine.forward(...)`` and ``engine.Record(...)``.
"""

from attnviz.core.spec.allowsets import AllowSet, auto_key, sink_keys  # noqa: F401
from attnviz.core.engine.attention import KEY, Caught, attention, catching, mask_builder, prepare  # noqa: F401
from attnviz.core.engine.forward import Resumed, check_head, checked_head, forward, head_logits, make_run, resume  # noqa: F401
from attnviz.core.model.anatomy import decoder_layers  # noqa: F401
from attnviz.core.engine.hooks import hook_blocks  # noqa: F401
from attnviz.core.model.modules import attention_modules, output_linear, output_projection, value_norms  # noqa: F401
from attnviz.core.engine.routes import Facts, Route, choose_route  # noqa: F401
from attnviz.core.engine.run import (NOTHING, Asked, Cached, Computes, Feed, Record, Recorded, Run, Stacks,  # noqa: F401
                              active, n_layers)
