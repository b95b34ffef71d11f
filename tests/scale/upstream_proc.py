"""TEST DOUBLE: a tiny OpenAI-compatible model server, run as its own process so a test can
SIGKILL it in the middle of a call.

    python upstream_proc.py PORT

Plain asyncio HTTP/1.1 with keep-alive (the gateway pools connections). ``POST
/v1/chat/completions`` answers ``"echo: <last user message>"``, except when that message is
``"hang"``: then it prints ``HANG`` and never answers. Prints ``READY <port>`` once listening.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


def _completion(body: dict) -> dict:
    messages = body.get("messages") or [{}]
    text = f"echo: {messages[-1].get('content')}"
    return {
        "id": f"chatcmpl-{time.monotonic_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "double"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


async def _answer(writer: asyncio.StreamWriter, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    writer.write(head.encode() + payload)
    await writer.drain()


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
            raw = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and path.endswith("/models"):
                await _answer(writer, 200, {"object": "list", "data": [{"id": "double", "object": "model"}]})
                continue
            body = json.loads(raw or b"{}")
            if (body.get("messages") or [{}])[-1].get("content") == "hang":
                print("HANG", flush=True)
                await asyncio.Event().wait()  # never answers: the test kills this process
            await _answer(writer, 200, _completion(body))
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", port)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
