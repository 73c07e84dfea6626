"""Ollama's native API (/api/...): generation in quantserve.server.ollama.routes, models in .models."""
