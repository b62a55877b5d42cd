"""Figures: pure functions from capture data to Plotly figures (no Streamlit, no model)."""

from attnviz.figures.dataset import alpha_by_key, averaged_map, rate_bars  # noqa: F401
from attnviz.figures.effects import (  # noqa: F401
                       compression_curves,
                       generation_view,
                       k_sweep,
                       kept_keys,
                       linformer_errors,
                       linformer_map,
                       perplexity_bars,
                       residual_table_figure,
                       streaming_curves,
)
from attnviz.figures.heatmaps import (  # noqa: F401
                       heatmap,
                       overview,
                       panels,
                       region_heatmap,
                       tile_at,
)
from attnviz.figures.masks import (  # noqa: F401
                       architecture_masks,
                       labelled_matrix,
                       stablemask_pseudo,
)
from attnviz.figures.routes import routes_figure, sink_share_figure  # noqa: F401
from attnviz.figures.shifting import (  # noqa: F401
                       cosine_figure,
                       difference,
                       shift_panels,
                       shift_rate_figure,
                       sink_key_grids,
                       sink_mass_change,
                       where_sinks_went,
)
from attnviz.figures.sinks import (  # noqa: F401
                       allocation_bars,
                       alpha_grid,
                       discarded_figure,
                       key_profile,
                       sink_grid,
                       sink_map,
)
from attnviz.figures.why import (  # noqa: F401
                       massive_activations,
                       sink_shares,
                       top_activation_rows,
)
