"""Model files: a name to a checkpoint folder (HF or GGUF), its config, tokenizer and pooling."""
