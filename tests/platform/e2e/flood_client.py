"""A flood of streamed completions from a process of its own, as other clients would send.

``python -m tests.platform.e2e.flood_client URL KEY MODEL STREAMS MAX_TOKENS`` keeps
``STREAMS`` streamed completions open (each starts the next when it ends) until its stdin
closes, then prints how many completions it finished and exits.

A flood run from the test's own process would share the interpreter lock with the server
and the probe it is meant to disturb: parsing two dozen streams' chunks there delays the
server's event loop and the probe's own client by whole switch intervals, a cost a server
never pays for clients on other machines.
"""

from __future__ import annotations

import asyncio
import sys

import openai


async def _stream(client: openai.AsyncOpenAI, model: str, k: int, max_tokens: int, done: list):
    i = 0
    while True:
        i += 1
        stream = await client.completions.create(
            model=model,
            prompt=f"flood stream {k} request {i}: a story about the sea and a lighthouse.",
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            pass
        done.append(k)


async def flood(url: str, key: str, model: str, streams: int, max_tokens: int) -> int:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    done: list[int] = []
    tasks = [
        asyncio.create_task(_stream(client, model, k, max_tokens, done)) for k in range(streams)
    ]
    # Until the test closes our stdin (read in a thread: stdin is not a socket here).
    await asyncio.to_thread(sys.stdin.read)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return len(done)


def main() -> None:
    url, key, model, streams, max_tokens = sys.argv[1:6]
    finished = asyncio.run(flood(url, key, model, int(streams), int(max_tokens)))
    print(finished, flush=True)


if __name__ == "__main__":
    main()
