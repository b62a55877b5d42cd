"""What a forward computes, as the call syntax writes it: masks (predicates), per-layer architectures,
attention kinds (``kinds.py``, docs/methods.md#attention-kinds), interventions, and the allow-sets they make."""
