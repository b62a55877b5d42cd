"""Contribution graphs: which tokens, through which heads and MLPs, feed a prediction, under any recipe
(docs/methods.md#contributions, docs/methods.md#routes)."""
