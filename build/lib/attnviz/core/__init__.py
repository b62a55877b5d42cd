"""Running attention: masks, architectures, the call syntax, interventions, residual variants, the engine, the fused kernel, devices and model loading."""
