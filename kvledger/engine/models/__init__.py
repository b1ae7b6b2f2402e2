"""Models the reference engine runs: `base` (the interface), SmolLM2-135M (Llama, real weights) and tiny-v4."""
