"""Models the reference engine runs: SmolLM2-135M (Llama, real weights) and tiny-v4 (V4 structure, toy size)."""
