"""The typed records between the API servers and the engine core, and their wire form.

API server -> core: ``Hello`` (once, then ``Ready`` comes back), ``AddRequest``, ``Abort``
(a client gone, or a stop string found: then the core finishes the request with reason
``stop``, keeping ``stop_at`` output tokens), ``UtilityCall``, ``TelemetryDrops``. Core -> API server:
``Phase`` (start-up progress), ``Ready``, ``OutputBatch`` (ONE per engine step and API
server: its requests' new tokens in two columns, ended ones with their figures, the
step's stats),
``UtilityResult``. Each direction is one tagged union, encoded with msgpack (msgspec):
a record is one array on the wire, its tag first. Guarantee: ``decode(encode(r)) == r``
for every record. Cost: one encode per step per API server; no text crosses the boundary.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from .request import SamplingParams

__all__ = ["TraceContext", "Hello", "AddRequest", "Abort", "UtilityCall", "TelemetryDrops", "Phase", "Ready",
           "FinalOutput", "StepStats", "OutputBatch", "UtilityResult", "ToCore", "FromCore",
           "encode", "core_decoder", "client_decoder", "ERROR_QUEUE_FULL", "ERROR_INVALID",
           "ERROR_STOPPED", "ERROR_ENGINE"]

# FinalOutput.error_code: why the core refused or failed a request (the API server maps
# each to an HTTP status: 429, 400, 503, 500)
ERROR_QUEUE_FULL = "queue_full"
ERROR_INVALID = "invalid_request"
ERROR_STOPPED = "shutting_down"
ERROR_ENGINE = "engine_error"


class TraceContext(msgspec.Struct, array_like=True, frozen=True):
    """A traced request's telemetry key (unique over all producers) and its server span."""

    key: int
    trace_id: str   # 32 hex digits (msgpack integers stop at 64 bits)
    span_id: str    # 16 hex digits


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """An API server connected; the core answers with ``Ready`` once it has started."""

    client_index: int
    pid: int


class AddRequest(msgspec.Struct, tag="add", array_like=True, frozen=True):
    request_id: str            # unique per API server; the core keys by (server, id)
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    client_index: int = 0
    trace: TraceContext | None = None
    cache_salt: str | None = None   # only requests with the same salt share prefix-cache blocks


class Abort(msgspec.Struct, tag="abort", array_like=True, frozen=True):
    """Drop a request (``stop_at`` None: reason abort), or end it on a stop string found in
    its text after ``stop_at`` output tokens (reason stop; later tokens are discarded)."""

    request_id: str
    client_index: int = 0
    stop_at: int | None = None


class UtilityCall(msgspec.Struct, tag="call", array_like=True, frozen=True):
    """A question for the core, answered between steps: its step times, its KV blocks, its
    start-up report, or its own Prometheus series (start-up, compiles while serving, its
    telemetry's; ``argument``: the scraper's Accept header)."""

    call_id: int
    client_index: int
    method: Literal["debug_steps", "kv_blocks", "startup_report", "core_metrics"]
    argument: str = ""


class TelemetryDrops(msgspec.Struct, tag="drops", array_like=True, frozen=True):
    """An API server's telemetry drops so far, by reason (``telemetry_link``): the core's
    telemetry series count them beside its own, once for all API servers."""

    client_index: int
    dropped: dict[str, int]


ToCore = Union[Hello, AddRequest, Abort, UtilityCall, TelemetryDrops]


class Phase(msgspec.Struct, tag="phase", array_like=True, frozen=True):
    """Start-up progress before ``Ready`` (``/health`` reports it): the phase starting, the
    phases done, and when start-up began (Unix ns; 0: unknown)."""

    name: str
    phases_done: tuple[str, ...] = ()
    start_ns: int = 0


class Ready(msgspec.Struct, tag="ready", array_like=True, frozen=True):
    """What an API server needs to know about the core, sent once per ``Hello``."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    num_kv_blocks: int
    block_size: int
    max_waiting: int            # the waiting queue's bound: the front end answers 429 past it
    max_num_seqs: int
    device: str                 # "cpu", "cuda:0"
    dtype: str
    async_scheduling: bool
    core_pid: int
    telemetry_endpoint: str | None = None   # where API servers join the core's telemetry
    startup_s: float = 0.0                  # from process start to ready (the warm-up included)
    startup_trace_id: str | None = None     # the start-up trace (32 hex digits), when traced
    tp_worker_pids: list[int] = []          # tensor-parallel ranks 1..N-1 (empty: N = 1)


class FinalOutput(msgspec.Struct, array_like=True):
    """A request that ended: its last tokens (if any), why it ended, and its timing figures."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str                 # "stop" | "length" | "abort"
    error: str | None = None
    error_code: str | None = None      # ERROR_*: refused at add, or failed by the engine
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    queue_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0         # prompt tokens whose KV the prefix cache held


class StepStats(msgspec.Struct, array_like=True):
    """The step completed (``step_id`` None: none was, e.g. aborts only) and the queue after."""

    step_id: int | None
    duration_s: float | None
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_generated: int          # tokens sampled in the step
    num_preemptions: int
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    # the prefix cache since the last batch: prompt tokens looked up, of them found, and
    # cached blocks evicted; cached blocks now (held or evictable)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    prefix_cache_blocks: int = 0


class OutputBatch(msgspec.Struct, tag="out", array_like=True):
    """One step's news for one API server, in columns: the requests that got one token and
    go on (``request_ids[i]`` got ``token_ids[i]``), then those that ended."""

    request_ids: list[str]
    token_ids: list[int]
    finished: list[FinalOutput]
    stats: StepStats
    received: int = 0   # AddRequests the core has taken from this API server so far


class UtilityResult(msgspec.Struct, tag="result", array_like=True, frozen=True):
    call_id: int
    result: dict[str, Any]


FromCore = Union[Phase, Ready, OutputBatch, UtilityResult]

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode


def core_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what API servers send (one per core)."""
    return msgspec.msgpack.Decoder(ToCore)


def client_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the core sends (one per API server)."""
    return msgspec.msgpack.Decoder(FromCore)
