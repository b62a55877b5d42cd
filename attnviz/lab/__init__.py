"""Training small decoders from scratch under any mask and attention kind, to watch a sink form (docs/lab.md)."""
