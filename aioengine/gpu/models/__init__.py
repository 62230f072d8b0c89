"""Model implementations built from a Hugging Face config.json."""
