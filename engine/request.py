"""One generation request and its sampling parameters: the record every engine stage shares.

A ``Request`` is created by the server, owned by the scheduler from ``Scheduler.add`` until it
finishes, and read by the model runner. Only the scheduler changes ``status``,
``num_computed_tokens``, ``num_cached_tokens``, ``output_token_ids`` and the timing fields; only
the KV cache manager changes ``block_ids`` and ``prefix_ids``. Plain Python, no torch: every
property is O(1) except ``all_token_ids``, which builds a new list (O(prompt + output)).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum

from ..instrumentation import check_range
from ..instrumentation import semconv as sc

__all__ = ["FinishReason", "RequestStatus", "SamplingParams", "Request", "pending_token"]

# Temperatures below this sample as greedy, as in vLLM: softmax(logits / T) tends to argmax as
# T -> 0, and T = 1e-40 is not even a normal float32.
GREEDY_BELOW_TEMPERATURE = 1e-5
# repetition_penalty divides logits: below the smallest normal float32 it is no number the
# sampler can divide by.
MIN_REPETITION_PENALTY = 2.0 ** -126


def pending_token(row: int) -> int:
    """Stand-in for a token sampled on the device but not read yet (overlapped scheduling):
    row ``row`` of its step's sampled ids. Negative, so never a vocabulary id."""
    return -1 - row


class FinishReason(str, Enum):
    """Why a request stopped; the values are the OpenAI ``finish_reason`` strings."""

    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # the client went away or the server cancelled it


class RequestStatus(Enum):
    """Where a request is: in the waiting queue, holding KV blocks, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SamplingParams:
    """How to pick tokens. Validated on construction; errors name the bad value and the range.
    A temperature below ``GREEDY_BELOW_TEMPERATURE`` is stored as 0 (greedy)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_k: int | None = None  # keep the k most likely tokens (None: all)
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    repetition_penalty: float = 1.0  # logits of prompt/output tokens: / when > 0, * when < 0
    presence_penalty: float = 0.0  # subtracted from the logits of tokens already generated
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the output
    allowed_token_ids: tuple[int, ...] | None = None  # only these ids can be sampled (None: all)

    def __post_init__(self) -> None:
        check_range("max_tokens", self.max_tokens, 1, integer=True)
        check_range("temperature", self.temperature, 0, 100)
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0
        check_range("top_p", self.top_p, 0, 1, lo_open=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):  # a lone string is one stop sequence, not its characters
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.top_k is not None:
            check_range("top_k", self.top_k, 1, integer=True, hint="(or None)")
        check_range("min_p", self.min_p, 0.0, 1.0)
        check_range("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, 10.0)
        for name in ("presence_penalty", "frequency_penalty"):
            check_range(name, getattr(self, name), -2.0, 2.0)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = tuple(self.allowed_token_ids)
            if not self.allowed_token_ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be None or a non-empty list of token ids >= 0, got "
                                 f"{self.allowed_token_ids!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """True when some penalty changes the logits (the sampler then counts tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(eq=False)  # identity equality: two requests with equal fields are still two requests
class Request:
    """A prompt, its generated tokens, and the scheduler/KV bookkeeping around them.

    Invariants kept by the scheduler: ``num_computed_tokens <= num_tokens``; a WAITING request
    holds no blocks and has ``num_computed_tokens == 0``; a FINISHED request holds no blocks.
    While a step is in flight, its sampled tokens are ``pending_token`` stand-ins in
    ``output_token_ids`` until ``Scheduler.resolve``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower is more urgent
    arrival_time_s: float = field(default_factory=time.monotonic)
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    # prefix_ids[i]: the prefix cache's id of the tokens through full block i (engine/prefix_cache.py)
    prefix_ids: list[int] = field(default_factory=list)
    # prompt tokens whose KV the prefix cache held when the request was first scheduled
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time_s: float | None = None
    first_token_time_s: float | None = None
    telemetry: int | None = None  # the request's key in the telemetry's lifecycle events; None: untraced
    finish_time_s: float | None = None  # scheduler clock when it finished (extension)
    cache_salt: str | None = None  # the prefix cache shares blocks only among requests of one salt

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: prompt_token_ids must hold at least 1 token, got 0")
        check_range("priority", self.priority, sc.REQUEST_PRIORITY_MIN, sc.REQUEST_PRIORITY_MAX, integer=True,
                    hint="(lower is more urgent)")
        if not _is_real(self.arrival_time_s):
            raise ValueError(f"arrival_time_s must be a finite number, got {self.arrival_time_s!r}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_output_tokens_read(self) -> int:
        """Output tokens known on the host: stand-ins of steps in flight excluded."""
        n = len(self.output_token_ids)
        while n and self.output_token_ids[n - 1] < 0:
            n -= 1
        return n

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the sequence length known so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output, as a new list (O(num_tokens))."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The newest known token: the input of the next decode step."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt+output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
