"""Figures: pure functions from capture data to Plotly figures (no Streamlit, no model)."""

from .heatmaps import heatmap, overview, panels, region_heatmap, tile_at  # noqa: F401
from .masks import architecture_masks, labelled_matrix, stablemask_pseudo  # noqa: F401
from .shifting import (cosine_figure, difference, shift_panels, shift_rate_figure, sink_key_grids,  # noqa: F401
                       sink_mass_change)
from .sinks import allocation_bars, alpha_grid, discarded_figure, key_profile, sink_grid  # noqa: F401
from .effects import (compression_curves, generation_view, k_sweep, kept_keys, linformer_errors,  # noqa: F401
                      linformer_map, perplexity_bars, residual_table_figure, streaming_curves)
from .dataset import alpha_by_key, averaged_map, rate_bars  # noqa: F401
from .why import massive_activations, sink_shares, top_activation_rows  # noqa: F401
