"""quantserve as a library, no server: load a model and stream two chats that run batched together."""

import asyncio

import quantserve


async def ask(llm, question: str) -> str:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": question},
    ]
    return "".join([piece async for piece in llm.chat(messages, max_tokens=48, temperature=0)])


async def main() -> None:
    llm = quantserve.load("smollm2", threads=2)
    try:
        answers = await asyncio.gather(
            ask(llm, "What is the capital of France?"), ask(llm, "What is 12 times 12?")
        )
        for a in answers:
            print("-", a)
    finally:
        llm.close()


asyncio.run(main())
