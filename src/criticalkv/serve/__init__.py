"""Keep compressed contexts and answer questions on them: the ``compress`` / ``ask`` commands and an
OpenAI-compatible HTTP server (docs/serving.md)."""
