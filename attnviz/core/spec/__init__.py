"""What a forward computes, as the call syntax writes it: masks (predicates), per-layer architectures, interventions, and the allow-sets they make."""
