"""Ollama's native API (/api/...): quantserve.server.ollama.routes."""
