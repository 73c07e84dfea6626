"""OpenAI's Responses API: /v1/responses (routes.py), its request and item models (protocol.py), and the
bounded store that previous_response_id reads (store.py)."""
