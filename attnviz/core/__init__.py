"""Running attention: masks, architectures, the call syntax, attention kinds, interventions, residual variants, the engine, the fused kernel, devices and model loading."""
