"""A stand-in for a vLLM worker that streams tokens as fast as a router can take them, so that a
router's capacity can be measured where a real engine on this machine would be the bottleneck.

It speaks what a router sees of a plain vLLM OpenAI server: `GET /health`, `/v1/models` (its
`root` names the model directory, for the router's tokenizer), `/metrics` (the load gauges: open
streams as `vllm:num_requests_running`), and `POST /v1/completions`, streaming or not; and
`POST /bench/itl` `{"ms": M}`, where the harness sets the step period between runs. A stream's
events are vLLM's `text_completion` chunks, one token each, then a chunk with `finish_reason`
"length" and `data: [DONE]`.

Generation is a step loop like an engine's: every `--itl-ms` (0: as fast as the loop turns) each
open stream gets its next token, except a stream whose connection is over its write-buffer limit
(the reader is behind); that stream waits for the next step. So what comes out is bounded by
whoever reads it, and nothing piles up in memory. A stream's first token comes on the step after
its request arrived.

The server is a raw asyncio protocol on uvloop (HTTP/1.1, keep-alive, `Content-Length` bodies):
each token is one prebuilt chunked-encoding frame and one `transport.write`.

    python benchmarks/_stream_upstream.py --port 8300 --model-root DIR [--itl-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import cast

import uvloop

SERVED = "bench"
WRITE_HIGH_WATER = 8192  # bytes buffered per connection before its stream skips a step
TOKEN_ID = 17  # a token of the tiny vocabulary; its text is the router's business, not ours


def frame(payload: bytes) -> bytes:
    """One HTTP/1.1 chunked-encoding frame."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def response(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status.encode(), ctype, len(body), body))


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"transfer-encoding: chunked\r\n\r\n")
NOT_FOUND = response("404 Not Found", b'{"detail":"Not Found"}')


@dataclass
class Stream:
    """One open streaming completion: its prebuilt token frame and how many tokens are left."""

    conn: Connection
    token: bytes
    last: bytes
    left: int


@dataclass
class Engine:
    """The step loop over every open stream."""

    itl_s: float
    model_root: str
    streams: list[Stream] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # a stream was added
    writable: asyncio.Event = field(default_factory=asyncio.Event)  # a connection drained
    skipped: int = 0  # stream-steps skipped because the reader was behind
    served: int = 0

    def add(self, s: Stream) -> None:
        self.streams.append(s)
        self.wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.streams:
                self.wake.clear()
                await self.wake.wait()
            t0 = loop.time()
            self.writable.clear()
            if not self.step() and self.streams:
                await self.writable.wait()  # every reader is behind: no spinning meanwhile
            await asyncio.sleep(max(0.0, self.itl_s - (loop.time() - t0)))

    def step(self) -> int:
        """One token to every open stream whose reader keeps up; how many were written."""
        wrote = 0
        keep = []
        for s in self.streams:
            if s.conn.closed:
                continue
            if s.conn.paused:
                self.skipped += 1
                keep.append(s)
                continue
            s.left -= 1
            wrote += 1
            if s.left > 0:
                s.conn.transport.write(s.token)
                keep.append(s)
            else:
                s.conn.transport.write(s.last)
                s.conn.busy = False
                self.served += 1
        self.streams = keep
        return wrote

    def metrics(self) -> bytes:
        running = len(self.streams)
        text = (f'vllm:num_requests_running{{model_name="{SERVED}"}} {running}\n'
                f'vllm:num_requests_waiting{{model_name="{SERVED}"}} 0\n'
                f'vllm:kv_cache_usage_perc{{model_name="{SERVED}"}} 0.0\n')
        return response("200 OK", text.encode(), b"text/plain; version=0.0.4")

    def models(self) -> bytes:
        body = {"object": "list", "data": [{
            "id": SERVED, "object": "model", "created": 0, "owned_by": "splitserve-bench",
            "root": self.model_root, "parent": None, "max_model_len": 1 << 20}]}
        return response("200 OK", json.dumps(body).encode())


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: requests one at a time, a stream to its end."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.buf = b""
        self.paused = False
        self.closed = False
        self.busy = False  # a stream is open on it
        self.transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.engine.writable.set()  # its stream is dropped at the next step

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.engine.writable.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            method, path = lines[0].split(" ")[:2]
            self.handle(method, path.split("?")[0], body)

    def handle(self, method: str, path: str, body: bytes) -> None:
        if method == "GET":
            pages = {"/health": lambda: response("200 OK", b""), "/v1/models": self.engine.models,
                     "/metrics": self.engine.metrics}
            self.transport.write(pages[path]() if path in pages else NOT_FOUND)
        elif method == "POST" and path == "/v1/completions":
            self.complete(json.loads(body))
        elif method == "POST" and path == "/bench/itl":  # the harness sets the step period
            self.engine.itl_s = float(json.loads(body)["ms"]) / 1e3
            self.transport.write(response("200 OK", b"{}"))
        else:
            self.transport.write(NOT_FOUND)

    def complete(self, req: dict[str, object]) -> None:
        n = max(1, int(req.get("max_tokens") or 16))  # type: ignore[call-overload]
        rid = f"cmpl-{time.monotonic_ns():x}"
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": SERVED}
        token = head | {"choices": [{"index": 0, "text": " tok", "logprobs": None,
                                     "finish_reason": None, "stop_reason": None,
                                     "token_ids": [TOKEN_ID]}]}
        if not req.get("stream"):
            whole = head | {"choices": [{"index": 0, "text": " tok" * n, "logprobs": None,
                                         "finish_reason": "length", "stop_reason": None,
                                         "token_ids": [TOKEN_ID] * n}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": n,
                                      "total_tokens": n + 1}}
            self.transport.write(response("200 OK", json.dumps(whole).encode()))
            return
        last = head | {"choices": [{"index": 0, "text": " tok", "logprobs": None,
                                    "finish_reason": "length", "stop_reason": None,
                                    "token_ids": [TOKEN_ID]}]}
        self.busy = True
        self.transport.write(STREAM_HEAD)
        self.engine.add(Stream(
            self, frame(b"data: " + json.dumps(token).encode() + b"\n\n"),
            frame(b"data: " + json.dumps(last).encode() + b"\n\n")
            + frame(b"data: [DONE]\n\n") + b"0\r\n\r\n", n))


async def serve(port: int, itl_ms: float, model_root: str) -> None:
    engine = Engine(itl_ms / 1e3, model_root)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(engine), "127.0.0.1", port,
                                      backlog=4096)
    async with server:
        await engine.run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--itl-ms", type=float, default=0.0,
                    help="step period: one token per open stream each step (0: no pause)")
    ap.add_argument("--model-root", required=True,
                    help="model directory named in /v1/models (the router's tokenizer)")
    args = ap.parse_args()
    uvloop.run(serve(args.port, args.itl_ms, args.model_root))


if __name__ == "__main__":
    main()
