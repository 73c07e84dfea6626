"""Chat with a running quantserve (`make serve`) through the official openai client, streaming the reply."""

import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("QUANTSERVE_URL", "http://127.0.0.1:8000") + "/v1", api_key="unused")

stream = client.chat.completions.create(
    model="smollm2",
    messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three rivers in Europe."},
    ],
    max_tokens=64,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")
