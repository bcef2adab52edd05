"""What the engine hands a request's caller: outputs per step, streamed to asyncio.

``LiveRequest`` is the engine thread's state of one request (its detokenized text, the
part held back while it could still start a stop string, what was already handed out);
``RequestStream`` is the caller's async iterator of ``RequestOutput``s, fed by ``deliver``
once per step and event loop (one ``call_soon_threadsafe`` each). Stop strings are searched
only in the text added since the last search (plus what could start one), O(new text).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .request import Request
from .tokenizer import IncrementalDetokenizer

__all__ = ["LiveRequest", "RequestOutput", "RequestStream", "deliver"]


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
    error: str | None = None  # set when the engine failed this request
    ttft_s: float | None = None  # the timing fields are set on the final output
    tpot_s: float | None = None
    queue_s: float | None = None
    e2e_s: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (known once scheduled)


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


@dataclass(eq=False)
class LiveRequest:
    """Engine-thread state of one live request: its text so far and what was handed out."""

    request: Request
    stream: RequestStream | None
    detok: IncrementalDetokenizer
    key: int | None  # its key in the lifecycle events; None when not traced
    text: str = ""  # generated text after stop-string truncation
    emitted: int = 0  # chars of text already handed out
    checked: int = 0  # chars of text already searched for stop strings
    new_tokens: list[int] | None = None
    hold: int = 0  # chars kept back while they could start a stop string
    stopped: bool = False  # a stop string ended it
    exemplar: dict[str, str] | None = None  # points the request's latency observations at its trace
    last_token_s: float = 0.0  # monotonic time of its latest token (inter-token latency)
    slowest_itl_s: float = 0.0  # its slowest inter-token gap so far

    def itl_exemplar(self, itl_s: float) -> dict[str, str] | None:
        """The exemplar for an inter-token gap of ``itl_s``: the request's only when the gap is
        its slowest so far. A bucket keeps one exemplar, the latest, so one per token (a few
        µs each in prometheus_client, on the engine thread) buys nothing more than this does:
        every bucket a request's first gap or a new slowest gap falls in points at it."""
        if itl_s <= self.slowest_itl_s:
            return None
        self.slowest_itl_s = itl_s
        return self.exemplar

    def hit_stop(self) -> bool:
        """Truncates ``text`` at the first stop string; True when one appeared."""
        stops = self.request.sampling.stop
        if not stops:
            return False
        start = max(0, self.checked - self.hold)
        cut = -1
        for stop in stops:
            index = self.text.find(stop, start)
            if index >= 0 and (cut < 0 or index < cut):
                cut = index
        self.checked = len(self.text)
        if cut >= 0:
            self.text = self.text[:cut]
            self.checked = cut
            self.stopped = True
            return True
        return False

    def delta(self, final: bool) -> RequestOutput:
        """The text and tokens not handed out yet (all of the text when ``final``)."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        text = self.text[self.emitted:end]
        self.emitted = end
        tokens, self.new_tokens = self.new_tokens or [], None
        request = self.request
        return RequestOutput(request.request_id, text, tokens,
                             num_prompt_tokens=request.num_prompt_tokens,
                             num_output_tokens=request.num_output_tokens_read,
                             num_cached_tokens=request.num_cached_tokens)


def deliver(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    """Puts one step's outputs into their streams (on the streams' event loop)."""
    for stream, output in batch:
        stream.queue.put_nowait(output)
