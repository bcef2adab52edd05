"""What a request's caller gets: one ``RequestOutput`` per step, streamed to asyncio.

``RequestStream`` is the caller's async iterator of ``RequestOutput``s, fed by ``deliver``
once per step (from another thread: one ``call_soon_threadsafe`` per step and event loop;
on the loop itself: directly). O(1) per output.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

__all__ = ["RequestOutput", "RequestStream", "deliver"]


@dataclass
class RequestOutput:
    """What one step produced for one request; the last one has ``finished=True``."""

    request_id: str
    text: str  # new text since the previous output (stop strings never included)
    token_ids: list[int]  # new tokens since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # set when the engine failed or refused this request
    error_code: str | None = None  # core_records.ERROR_*: why
    ttft_s: float | None = None  # the timing fields are set on the final output
    tpot_s: float | None = None
    queue_s: float | None = None
    e2e_s: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (final output)


class RequestStream:
    """Async iterator over one request's outputs; created and consumed on the server's loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self.queue.get()
        self.finished = output.finished
        return output


def deliver(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    """Puts one step's outputs into their streams (on the streams' event loop)."""
    for stream, output in batch:
        stream.queue.put_nowait(output)
