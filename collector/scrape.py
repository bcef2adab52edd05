"""/metrics served from one shared, immutable page per format, streamed with a write deadline.

:class:`SharedPages` renders the page (a thread's work, off the event loop) once for every
scrape that arrives while it renders, and lends a rendered page to the scrapes that arrive
while others still stream it, within ``reuse_s`` of its render: 100 slow scrapers hold one
page between them, not 100 copies. A page is streamed in ``CHUNK_BYTES`` slices, each
written only once the transport has drained the one before, so a reader that does not read
holds at most a slice or two of buffered bytes; one not done within ``deadline_s`` is cut.
Guarantee: at most ``1 + deadline_s / reuse_s`` pages alive per format, whatever the number
or speed of scrapers; a scrape sees data no older than ``reuse_s`` plus a render.
Cost: one render per format per ``reuse_s`` at most under a crowd of readers, else one per scrape.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiohttp import web
from prometheus_client.exposition import choose_encoder

__all__ = ["CHUNK_BYTES", "SharedPages"]

CHUNK_BYTES = 64 * 1024


class _Page:
    __slots__ = ("rendered_at", "future", "readers")

    def __init__(self, rendered_at: float, future: asyncio.Future) -> None:
        self.rendered_at = rendered_at
        self.future = future  # (body, headers)
        self.readers = 0  # scrapes streaming it now


class SharedPages:
    """See the module docstring. ``render(accept, gzipped)`` returns ``(body, headers)``;
    ``on_cut()`` is called for each scrape cut at the deadline (event-loop thread)."""

    def __init__(self, render: Callable[[str, bool], tuple[bytes, dict[str, str]]], *, reuse_s: float = 10.0,
                 deadline_s: float = 30.0, on_cut: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._render = render
        self.reuse_s, self.deadline_s = reuse_s, deadline_s
        self._on_cut = on_cut
        self._clock = clock
        self._pages: dict[tuple[str, bool], _Page] = {}  # (content type, gzipped) -> newest page
        self.renders = 0

    def _page(self, accept: str, gzipped: bool) -> _Page:
        _, content_type = choose_encoder(accept)
        key = (content_type, gzipped)
        now = self._clock()
        page = self._pages.get(key)
        if page is not None and (not page.future.done()
                                 or (page.readers and now - page.rendered_at < self.reuse_s)):
            return page
        self.renders += 1
        future = asyncio.get_running_loop().run_in_executor(None, self._render, accept, gzipped)
        page = self._pages[key] = _Page(now, future)
        return page

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The aiohttp handler of ``GET /metrics``."""
        gzipped = "gzip" in request.headers.get("Accept-Encoding", "")
        page = self._page(request.headers.get("Accept", ""), gzipped)
        page.readers += 1
        try:
            # shielded: a scraper that leaves must not cancel the render the others wait for
            body, headers = await asyncio.shield(page.future)
            response = web.StreamResponse(headers=headers)
            response.content_length = len(body)
            try:
                await asyncio.wait_for(self._stream(request, response, body), self.deadline_s)
            except asyncio.TimeoutError:
                if self._on_cut is not None:
                    self._on_cut()
                if request.transport is not None:
                    request.transport.abort()  # drops what is buffered for it at once
                raise ConnectionResetError(f"/metrics not read within {self.deadline_s} s") from None
            return response
        finally:
            page.readers -= 1

    @staticmethod
    async def _stream(request: web.Request, response: web.StreamResponse, body: bytes) -> None:
        await response.prepare(request)
        view = memoryview(body)
        for start in range(0, len(body), CHUNK_BYTES):
            # each write waits for the transport to drain: a slice or two buffered per reader
            await response.write(view[start:start + CHUNK_BYTES])
