"""The fused Triton kernel of a layer's statistics: its launch, its source and its compile check."""
