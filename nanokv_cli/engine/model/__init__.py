"""A model from disk: weights (safetensors, GGUF), tokenizer, chat template."""
