"""OpenAI's API: /v1/chat/completions and /v1/completions (routes.py), their request models (protocol.py)."""
