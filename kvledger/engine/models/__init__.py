"""Models the reference engine runs: `base` (the interface), `llama` (SmolLM2-135M, or a user's Llama) and tiny-v4;
`registry` names them and reads a user's own by path (`weights`: GGUF files and Hugging Face folders, `tokenizer`,
`chat_template`)."""
