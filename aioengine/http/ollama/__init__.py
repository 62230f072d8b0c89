"""Ollama's API (/api/*): generate.py (generate, chat), models.py (tags, show, ps, version, embed)."""
