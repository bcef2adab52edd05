"""The front end's half of a step: the core's token ids become text, stop strings, metrics.

``OutputProcessor.process(batch)`` takes one ``OutputBatch`` and returns each request's
``RequestOutput``: the text its new token completed (``IncrementalDetokenizer``: no half
characters), held back while it could start a stop string. A stop string ends the request
here: its text is cut, and ``stop(request_id, n)`` asks the core to finish it after ``n``
output tokens; an in-process core answers at once with the final figures, a core in another
process in a later batch (tokens it made meanwhile are dropped). The request series of
``EngineMetrics`` (TTFT, TPOT, ITL, end to end, tokens) and, with ``record_steps``, the
step series are recorded here, never in the core. Stop strings are searched only in the
text added since the last search (plus what could start one): O(new text) per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..instrumentation import Detokenized
from .core_records import (ERROR_INVALID, ERROR_QUEUE_FULL, ERROR_STOPPED, FinalOutput,
                           OutputBatch, StepStats)
from .metrics import EngineMetrics, trace_exemplar
from .request import SamplingParams
from .request_output import RequestOutput, RequestStream
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["LiveRequest", "OutputProcessor"]

# refusals, not requests that ran: no request series for them
_REFUSED = (ERROR_QUEUE_FULL, ERROR_INVALID, ERROR_STOPPED)


@dataclass(eq=False)
class LiveRequest:
    """Front-end state of one live request: its text so far and what was handed out."""

    request_id: str
    stream: RequestStream | None
    detok: IncrementalDetokenizer | None
    key: int | None = None  # its key in the lifecycle events; None when not traced
    stops: tuple[str, ...] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # tokens received
    text: str = ""  # generated text after stop-string truncation
    emitted: int = 0  # chars of text already handed out
    checked: int = 0  # chars of text already searched for stop strings
    new_tokens: list[int] | None = None
    hold: int = 0  # chars kept back while they could start a stop string
    stop_at: int | None = None  # a stop string ended it after this many output tokens
    exemplar: dict[str, str] | None = None  # points the request's latency observations at its trace
    last_token_s: float = 0.0  # monotonic time of its latest token (inter-token latency)
    slowest_itl_s: float = 0.0  # its slowest inter-token gap so far

    def itl_exemplar(self, itl_s: float) -> dict[str, str] | None:
        """The exemplar for an inter-token gap of ``itl_s``: the request's only when the gap is
        its slowest so far. A bucket keeps one exemplar, the latest, so one per token (a few
        µs each in prometheus_client) buys nothing more than this does: every bucket a
        request's first gap or a new slowest gap falls in points at it."""
        if itl_s <= self.slowest_itl_s:
            return None
        self.slowest_itl_s = itl_s
        return self.exemplar

    def hit_stop(self) -> bool:
        """Truncates ``text`` at the first stop string; True when one appeared."""
        stops = self.stops
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
            return True
        return False

    def delta(self, final: bool) -> RequestOutput:
        """The text and tokens not handed out yet (all of the text when ``final``)."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        text = self.text[self.emitted:end]
        self.emitted = end
        tokens, self.new_tokens = self.new_tokens or [], None
        return RequestOutput(self.request_id, text, tokens, num_prompt_tokens=self.num_prompt_tokens,
                             num_output_tokens=self.num_output_tokens)


class OutputProcessor:
    """Text, stop strings and request metrics for the requests of one front end."""

    def __init__(self, tokenizer: Tokenizer, metrics: EngineMetrics,
                 stop: Callable[[str, int], FinalOutput | None], recorder=None,
                 record_steps: bool = True) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._stop = stop
        self.recorder = recorder   # for Detokenized events; None when tracing is off
        self.record_steps = record_steps
        self.live: dict[str, LiveRequest] = {}
        self.stats: StepStats | None = None   # the latest step's

    def add(self, request_id: str, num_prompt_tokens: int, sampling: SamplingParams,
            stream: RequestStream | None, trace=None) -> LiveRequest:
        """Starts following a request the core is given; ``trace``: its RequestHandle."""
        live = LiveRequest(request_id, stream, IncrementalDetokenizer(self.tokenizer),
                           trace.key if trace is not None else None, sampling.stop,
                           num_prompt_tokens,
                           hold=max((len(s) for s in sampling.stop), default=1) - 1,
                           exemplar=trace_exemplar(trace))
        self.live[request_id] = live
        return live

    def process(self, batch: OutputBatch) -> list[tuple[LiveRequest, RequestOutput]]:
        """One step's outputs: first tokens, then the batch's order (going on, then ended).
        The caller hands them out in this order, so a request's first token (its TTFT) does
        not wait behind the batch's other streams (the core lists new prompts last)."""
        outputs = []
        firsts = []
        now = time.monotonic()
        live_of = self.live.get
        for request_id, token in zip(batch.request_ids, batch.token_ids):
            live = live_of(request_id)
            if live is None or live.stop_at is not None:   # tokens past a stop string
                continue
            first = not live.num_output_tokens
            if self._token(live, token, now):
                final = self._stop(request_id, live.num_output_tokens)
                if final is not None:
                    outputs.append(self._finish(live, final))
            else:
                (firsts if first else outputs).append((live, live.delta(final=False)))
        for final in batch.finished:
            live = live_of(final.request_id)
            if live is None:
                continue
            if live.stop_at is None:
                for token in final.new_token_ids:
                    if self._token(live, token, now):
                        break
            outputs.append(self._finish(live, final))
        self.stats = batch.stats
        if self.record_steps:
            self._record_step(batch.stats)
        return firsts + outputs if firsts else outputs

    def fail(self, request_id: str, message: str, code: str) -> tuple[LiveRequest, RequestOutput] | None:
        """Ends a request the core will not report on (it died): an error output."""
        live = self.live.get(request_id)
        if live is None:
            return None
        return self._finish(live, FinalOutput(request_id, [], "abort", message, code,
                                              live.num_prompt_tokens, live.num_output_tokens))

    def _token(self, live: LiveRequest, token: int, now: float) -> bool:
        """Adds one token to a request; True when it completed a stop string."""
        if live.num_output_tokens:
            itl_s = now - live.last_token_s
            self.metrics.itl.observe(itl_s, live.itl_exemplar(itl_s))
        else:
            self.metrics.prompt_tokens.inc(live.num_prompt_tokens)
        live.last_token_s = now
        live.num_output_tokens += 1
        if live.new_tokens is None:
            live.new_tokens = [token]
        else:
            live.new_tokens.append(token)
        live.text += live.detok.push(token)
        if live.hit_stop():
            live.stop_at = live.num_output_tokens
            return True
        return False

    def _finish(self, live: LiveRequest, final: FinalOutput) -> tuple[LiveRequest, RequestOutput]:
        """The request's final output; records its metrics and its ``Detokenized`` event."""
        del self.live[live.request_id]
        reason = final.finish_reason
        num_output = final.num_output_tokens
        if live.stop_at is not None:   # the stop string came first, whatever the core saw
            reason, num_output = "stop", min(num_output, live.stop_at)
        detok_start = time.time_ns() if live.key is not None else 0
        if live.stop_at is None and reason != "abort":
            # Bytes held back as an incomplete character are final now (U+FFFD if still bad).
            live.text += live.detok.flush()
            live.hit_stop()
        live.num_output_tokens = num_output
        output = live.delta(final=True)
        if live.key is not None and self.recorder is not None:
            self.recorder.record(Detokenized(live.key, detok_start, time.time_ns()))
        output.finished, output.finish_reason = True, reason
        output.error, output.error_code = final.error, final.error_code
        output.num_preemptions, output.num_cached_tokens = final.num_preemptions, final.num_cached_tokens
        output.e2e_s, output.queue_s = final.e2e_s, final.queue_s
        output.ttft_s, output.tpot_s = final.ttft_s, final.tpot_s
        if final.error_code not in _REFUSED:
            self.metrics.request_finished(
                reason, e2e_s=final.e2e_s or 0.0, queue_s=final.queue_s, ttft_s=final.ttft_s,
                tpot_s=final.tpot_s, prefill_s=final.prefill_s, decode_s=final.decode_s,
                prompt_tokens=final.num_prompt_tokens, generation_tokens=num_output,
                cached_tokens=final.num_cached_tokens, exemplar=live.exemplar)
        return live, output

    def _record_step(self, stats: StepStats) -> None:
        m = self.metrics
        if stats.duration_s is not None:
            m.step.observe(stats.duration_s)
            m.step_tokens.observe(stats.num_prefill_tokens + stats.num_decode_tokens)
            m.generation_tokens.inc(stats.num_generated)
        if stats.num_preemptions:
            m.preemptions.inc(stats.num_preemptions)
        m.prefix_cache_step(stats)
        m.running.set(stats.running)
        m.waiting.set(stats.waiting)
        m.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
