"""The engine's HTTP face: app, OpenAI routes, SSE, admission."""
