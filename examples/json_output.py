"""Structured output: the reply is forced by a grammar to match a JSON schema (server from `make serve`)."""

import json
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("QUANTSERVE_URL", "http://127.0.0.1:8000") + "/v1", api_key="unused")
schema = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}
r = client.chat.completions.create(
    model="smollm2",
    messages=[{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
    response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
    temperature=0,
)
print(json.loads(r.choices[0].message.content))
