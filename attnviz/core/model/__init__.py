"""The model's anatomy, found from the model itself (layers, blocks, norms, residual writes, the probe that checks them), its modules read for attention, and devices and precision."""
