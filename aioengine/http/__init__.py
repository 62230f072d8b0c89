"""aioengine.http: the OpenAI-compatible aiohttp server; speaks protocols, never touches tensors."""
