"""A mixed-priority, streamed load generator for any OpenAI-compatible server.

Drives ``requests`` completions through the official ``openai`` async client with at most
``concurrency`` in flight, priorities assigned round-robin from ``priorities`` (each gets
an exact, known share; in the body as ``priority``, vLLM's spelling). Measured on the
client: TTFT (sent -> first chunk carrying a token), TPOT ((e2e - TTFT) / (output tokens -
1), tokens from the server's streamed usage when sent, else from chunks) and e2e (sent ->
stream closed). Each request carries a W3C ``traceparent`` generated here, so that the
collector's explanation of a slow request can be looked up by its trace id.

Guarantee: percentiles are exact (linear interpolation between order statistics, NumPy's
default) over the records; cost O(n log n) per summary.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Literal

from ..instrumentation import check_range

__all__ = [
    "LoadConfig",
    "RequestRecord",
    "LatencyStats",
    "PrioritySummary",
    "LoadSummary",
    "LoadResult",
    "percentile",
    "summarize",
    "run_load",
    "run_load_sync",
    "format_summary",
]

_WORDS = ("the quick brown fox jumps over the lazy dog while a model streams tokens to "
          "a patient client that measures every gap between them").split()


@dataclass(frozen=True)
class LoadConfig:
    """What to send. ``url`` is the server's base (``http://host:port``, ``/v1`` optional)."""

    url: str
    requests: int = 32
    concurrency: int = 8
    priorities: tuple[int, ...] = (0, 1, 2)
    max_tokens: int = 16
    stream: bool = True
    api: Literal["completions", "chat"] = "completions"
    model: str | None = None  # None: the first model /v1/models lists
    prompt_words_min: int = 4
    prompt_words_max: int = 48
    temperature: float = 0.0
    timeout_s: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"LoadConfig.url={self.url!r} must start with http:// or https://")
        check_range("LoadConfig.requests", self.requests, 1, 1_000_000, integer=True)
        check_range("LoadConfig.concurrency", self.concurrency, 1, 10_000, integer=True)
        if not self.priorities:
            raise ValueError("LoadConfig.priorities must name at least one priority")
        check_range("LoadConfig.max_tokens", self.max_tokens, 1, 65_536, integer=True)
        if self.api not in ("completions", "chat"):
            raise ValueError(f"LoadConfig.api={self.api!r} must be 'completions' or 'chat'")
        if not 1 <= self.prompt_words_min <= self.prompt_words_max <= 100_000:
            raise ValueError(f"prompt words [{self.prompt_words_min}, {self.prompt_words_max}] "
                             "must satisfy 1 <= min <= max <= 100000")
        check_range("LoadConfig.timeout_s", self.timeout_s, 0, 3600, lo_open=True)

    @property
    def base_url(self) -> str:
        base = self.url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"

    def priority_of(self, index: int) -> int:
        return self.priorities[index % len(self.priorities)]

    def prompt_of(self, index: int) -> str:
        # Lengths spread deterministically over [min, max] so prefill cost varies.
        span = self.prompt_words_max - self.prompt_words_min + 1
        n_words = self.prompt_words_min + (index * 7919 + self.seed) % span
        words = [_WORDS[(index + k) % len(_WORDS)] for k in range(n_words)]
        return f"Request {index}: " + " ".join(words)


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. Latencies are None when they do not apply."""

    index: int
    priority: int
    status: Literal["ok", "error"]
    trace_id: str  # 32 hex digits, the W3C trace id this client sent
    e2e_s: float
    ttft_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    http_status: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class LatencyStats:
    count: int
    p50_s: float
    p99_s: float
    mean_s: float
    max_s: float

    @staticmethod
    def of(values: Sequence[float]) -> LatencyStats | None:
        if not values:
            return None
        return LatencyStats(count=len(values), p50_s=percentile(values, 50),
                            p99_s=percentile(values, 99), mean_s=sum(values) / len(values),
                            max_s=max(values))


@dataclass(frozen=True)
class PrioritySummary:
    priority: int
    requests: int
    ok: int
    errors: int
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    e2e: LatencyStats | None


@dataclass(frozen=True)
class LoadSummary:
    requests: int
    ok: int
    errors: int
    wall_s: float
    output_tokens: int
    by_priority: tuple[PrioritySummary, ...]
    ttft: LatencyStats | None
    tpot: LatencyStats | None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class LoadResult:
    config: LoadConfig
    model: str
    records: list[RequestRecord] = field(default_factory=list)
    summary: LoadSummary | None = None

    def slowest(self, n: int = 3, key: str = "e2e_s") -> list[RequestRecord]:
        """The ``n`` successful requests with the largest ``key`` (e2e_s, ttft_s, tpot_s)."""
        ok = [r for r in self.records if r.status == "ok" and getattr(r, key) is not None]
        return sorted(ok, key=lambda r: getattr(r, key), reverse=True)[:n]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    check_range("percentile q", q, 0, 100)
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(records: Sequence[RequestRecord], wall_s: float) -> LoadSummary:
    """Per-priority and overall latency statistics over the successful records."""
    by_priority = []
    for prio in sorted({r.priority for r in records}):
        mine = [r for r in records if r.priority == prio]
        ok = [r for r in mine if r.status == "ok"]
        by_priority.append(PrioritySummary(
            priority=prio, requests=len(mine), ok=len(ok), errors=len(mine) - len(ok),
            ttft=LatencyStats.of([r.ttft_s for r in ok if r.ttft_s is not None]),
            tpot=LatencyStats.of([r.tpot_s for r in ok if r.tpot_s is not None]),
            e2e=LatencyStats.of([r.e2e_s for r in ok])))
    ok_all = [r for r in records if r.status == "ok"]
    return LoadSummary(
        requests=len(records), ok=len(ok_all), errors=len(records) - len(ok_all), wall_s=wall_s,
        output_tokens=sum(r.output_tokens for r in ok_all), by_priority=tuple(by_priority),
        ttft=LatencyStats.of([r.ttft_s for r in ok_all if r.ttft_s is not None]),
        tpot=LatencyStats.of([r.tpot_s for r in ok_all if r.tpot_s is not None]))


def _traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


class _Progress:
    """One status line: redrawn in place on a terminal, a line every ~10% otherwise."""

    def __init__(self, total: int, stream: IO[str] | None) -> None:
        self.total, self.stream = total, stream
        self.done = self.errors = 0
        self.start = time.monotonic()
        self._tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self._last_decile = -1

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.errors += record.status != "ok"
        if self.stream is None:
            return
        elapsed = time.monotonic() - self.start
        width = 30
        filled = int(width * self.done / self.total)
        line = (f"load [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"errors {self.errors} {elapsed:5.1f}s")
        if self._tty:
            self.stream.write("\r" + line + ("\n" if self.done == self.total else ""))
            self.stream.flush()
        else:
            decile = 10 * self.done // self.total
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(line + "\n")
                self.stream.flush()


async def _one(client, config: LoadConfig, model: str, index: int) -> RequestRecord:
    import openai

    priority = config.priority_of(index)
    trace_id, traceparent = _traceparent()
    kwargs = dict(model=model, max_tokens=config.max_tokens, temperature=config.temperature,
                  extra_body={"priority": priority}, extra_headers={"traceparent": traceparent})
    prompt = config.prompt_of(index)
    if config.stream:
        kwargs["stream"] = True
        kwargs["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    ttft = None
    chunks_with_tokens = 0
    usage_tokens = None
    finish_reason = None
    try:
        if config.api == "chat":
            call = client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **kwargs)
        else:
            call = client.completions.create(prompt=prompt, **kwargs)
        response = await call
        if config.stream:
            async for chunk in response:
                now = time.perf_counter()
                if getattr(chunk, "usage", None) is not None:
                    usage_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices or ():
                    text = (choice.delta.content if config.api == "chat" else choice.text)
                    if config.api == "chat" and not text and getattr(choice.delta, "role", None):
                        text = None  # the role announcement that opens a chat stream: no token
                    # A trailing chunk with only a finish reason carries no token.
                    if text is not None and (text != "" or choice.finish_reason is None):
                        if ttft is None:
                            ttft = now - start
                        chunks_with_tokens += 1
                    if choice.finish_reason is not None:
                        finish_reason = choice.finish_reason
        else:
            usage_tokens = response.usage.completion_tokens if response.usage else None
            finish_reason = response.choices[0].finish_reason if response.choices else None
        e2e = time.perf_counter() - start
    except openai.APIStatusError as exc:
        return RequestRecord(index=index, priority=priority, status="error", trace_id=trace_id,
                             e2e_s=time.perf_counter() - start, http_status=exc.status_code,
                             error=f"{type(exc).__name__}: {exc.message}"[:300])
    except Exception as exc:  # noqa: BLE001 - connection drops mid-stream surface as httpx errors
        # Recorded, not raised: one broken request must not end the run (cancellation,
        # a BaseException, still propagates).
        return RequestRecord(index=index, priority=priority, status="error", trace_id=trace_id,
                             e2e_s=time.perf_counter() - start,
                             error=f"{type(exc).__name__}: {exc}"[:300])
    tokens = usage_tokens if usage_tokens is not None else chunks_with_tokens
    if not config.stream or (ttft is None and tokens):
        # without streaming, or when no chunk before the last carried text (tokens that
        # decode to nothing are not streamed), the first token arrives with the last
        ttft = e2e
    tpot = None
    if config.stream and ttft is not None and tokens > 1:
        # Over e2e, not the last content chunk: a server may hold back tokens that end
        # inside a multi-byte character and send them together, so chunks != tokens.
        tpot = (e2e - ttft) / (tokens - 1)
    return RequestRecord(index=index, priority=priority, status="ok", trace_id=trace_id,
                         e2e_s=e2e, ttft_s=ttft, tpot_s=tpot, output_tokens=tokens,
                         finish_reason=finish_reason, http_status=200)


async def _first_model(client) -> str:
    models = await client.models.list()
    for model in models.data:
        return model.id
    raise RuntimeError("the server lists no models at /v1/models")


async def run_load(config: LoadConfig, *, progress: IO[str] | None = sys.stderr,
                   on_record: Callable[[RequestRecord], None] | None = None) -> LoadResult:
    """Sends the load; returns every request's record (in index order) and the summary.

    Failed requests are recorded with status "error", never raised; only an unreachable
    server while resolving the model name raises.
    """
    import openai

    client = openai.AsyncOpenAI(base_url=config.base_url, api_key="sightline",
                                timeout=config.timeout_s, max_retries=0)
    try:
        model = config.model or await _first_model(client)
        bar = _Progress(config.requests, progress)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(config.requests):
            queue.put_nowait(index)
        records: list[RequestRecord] = []

        async def worker() -> None:
            while True:
                try:
                    index = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                record = await _one(client, config, model, index)
                records.append(record)
                bar.update(record)
                if on_record is not None:
                    on_record(record)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(config.concurrency, config.requests))))
        wall = time.perf_counter() - start
    finally:
        await client.close()
    records.sort(key=lambda r: r.index)
    return LoadResult(config=config, model=model, records=records,
                      summary=summarize(records, wall))


def run_load_sync(config: LoadConfig, **kwargs) -> LoadResult:
    """``run_load`` from synchronous code (a fresh event loop)."""
    return asyncio.run(run_load(config, **kwargs))


def _ms(stats: LatencyStats | None, attr: str) -> str:
    return f"{getattr(stats, attr) * 1000:9.1f}" if stats is not None else f"{'-':>9}"


def format_summary(summary: LoadSummary) -> str:
    """A fixed-width table: TTFT and TPOT P50/P99 (ms) per priority, then totals."""
    lines = [f"{'priority':>8} {'ok':>5} {'err':>4} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'TPOT p50':>9} {'TPOT p99':>9} {'e2e p50':>9} {'e2e p99':>9}   (ms)"]
    for row in summary.by_priority:
        lines.append(f"{row.priority:>8} {row.ok:>5} {row.errors:>4} {_ms(row.ttft, 'p50_s')} "
                     f"{_ms(row.ttft, 'p99_s')} {_ms(row.tpot, 'p50_s')} {_ms(row.tpot, 'p99_s')} "
                     f"{_ms(row.e2e, 'p50_s')} {_ms(row.e2e, 'p99_s')}")
    lines.append(f"{'all':>8} {summary.ok:>5} {summary.errors:>4} {_ms(summary.ttft, 'p50_s')} "
                 f"{_ms(summary.ttft, 'p99_s')} {_ms(summary.tpot, 'p50_s')} "
                 f"{_ms(summary.tpot, 'p99_s')}")
    lines.append(f"{summary.requests} requests in {summary.wall_s:.1f}s, "
                 f"{summary.output_tokens} output tokens ({summary.output_tokens_per_s:.1f}/s)")
    return "\n".join(lines)
