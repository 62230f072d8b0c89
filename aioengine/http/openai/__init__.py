"""OpenAI's API family: chat completions, completions, the Responses API and embeddings."""
