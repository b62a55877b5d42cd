"""Training small decoders from scratch under any mask and attention kind, to watch a sink form, and measuring how
it forms over the checkpoints (docs/lab.md)."""
