"""quantserve as a library, no server: load a model, stream two chats that run batched together, then take a whole
reply that calls a tool (docs/library.md)."""

import asyncio

import quantserve


async def ask(llm, question: str) -> str:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": question},
    ]
    return "".join([piece async for piece in llm.chat(messages, max_tokens=48, temperature=0)])


async def main() -> None:
    llm = quantserve.load("smollm2")
    try:
        answers = await asyncio.gather(
            ask(llm, "What is the capital of France?"), ask(llm, "What is 12 times 12?")
        )
        for a in answers:
            print("-", a)
        weather = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
        question = [{"role": "user", "content": "What is the weather like in Paris?"}]
        reply = await llm.reply(
            question, tools=[weather], tool_choice="required", max_tokens=64, temperature=0
        )
        for call in reply.tool_calls:
            print(f"tool call: {call.name}({call.arguments})")
    finally:
        llm.close()


asyncio.run(main())
