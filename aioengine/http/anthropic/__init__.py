"""Anthropic's API family: the Messages API over the chat path."""
