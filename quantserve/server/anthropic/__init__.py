"""Anthropic's Messages API: /v1/messages and count_tokens (routes.py), its request models (protocol.py)."""
