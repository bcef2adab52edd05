"""Kernel variants this process meets for the first time, recorded per thread as they happen.

A ``@triton.jit`` kernel keeps its compiled variants (one per signature, constexprs and
specialization) in memory; a miss calls ``triton.compile``, which loads the binary from the
on-disk cache (``TRITON_CACHE_DIR``) or compiles it, and tells Triton's compilation
listener which (``cache_hit``). ``compile_watch()`` installs one listener for the process
(Triton allows one; a listener set before is still called) and records each miss as a
``CompileEvent``: ``compiled`` or ``disk_cache``. The FA2 prefill's autotuning records
``autotune`` events itself (timing candidates costs seconds though nothing compiles).

Events are kept per thread, so that the engine charges a compile to the step whose launch
met it (``thread_count`` before and after: two attribute reads) and a warm-up phase to
itself. Without Triton, or under its interpreter, nothing compiles: counts stay 0 and
``unavailable_reason`` says why. Cost: nothing per launch; a list append per miss.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from ..instrumentation import semconv as sc

__all__ = ["CompileEvent", "CompileWatch", "compile_watch", "step_compile_attributes"]

log = logging.getLogger(__name__)

Source = Literal["compiled", "disk_cache", "autotune"]
SOURCES: tuple[Source, ...] = ("compiled", "disk_cache", "autotune")


@dataclass(frozen=True)
class CompileEvent:
    """One kernel variant met for the first time in this process."""

    kernel: str          # the @triton.jit function's name
    source: Source
    duration_s: float    # Triton's own compile (or cache load) time; autotune: the tuning
    time_ns: int         # when it ended (time.time_ns)
    variant: str = ""    # which one: its constexprs and launch options, or the tuning key

    def __str__(self) -> str:
        return self.variant or self.kernel


class CompileWatch:
    """Per-thread lists of ``CompileEvent``; see the module docstring."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self.total = 0                    # every thread's events
        self.hooked = False
        self.unavailable_reason = ""
        self._previous = None             # a listener installed before ours

    # -- recording -----------------------------------------------------------------
    def record(self, kernel: str, source: Source, duration_s: float = 0.0,
               variant: str = "") -> None:
        """Records one event on the calling thread's list (any thread)."""
        if source not in SOURCES:
            raise ValueError(f"source={source!r} is not one of {'|'.join(SOURCES)}")
        self.thread_events().append(CompileEvent(kernel, source, duration_s, time.time_ns(),
                                                 variant))
        with self._lock:
            self.total += 1

    def thread_events(self) -> list[CompileEvent]:
        """The calling thread's events, oldest first (the list itself: it grows)."""
        events = getattr(self._local, "events", None)
        if events is None:
            events = self._local.events = []
        return events

    def thread_count(self) -> int:
        """How many events the calling thread has recorded so far."""
        events = getattr(self._local, "events", None)
        return 0 if events is None else len(events)

    def since(self, count: int) -> list[CompileEvent]:
        """The calling thread's events after its first ``count``."""
        return self.thread_events()[count:]

    # -- Triton -------------------------------------------------------------------
    def hook_triton(self) -> bool:
        """Installs the listener once; False (with ``unavailable_reason``) when it cannot."""
        if self.hooked:
            return True
        if os.environ.get("TRITON_INTERPRET") == "1":   # hooked all the same: triton.compile works
            self.unavailable_reason = "TRITON_INTERPRET=1: launched kernels are interpreted"
        try:
            from triton import knobs
        except Exception as exc:   # no Triton (CPU-only torch), or a Triton without knobs
            self.unavailable_reason = f"triton has no compilation hooks here ({exc})"
            return False
        compilation = getattr(knobs, "compilation", None)
        if compilation is not None and hasattr(compilation, "listener"):
            self._previous = compilation.listener
            compilation.listener = self._listener
        elif hasattr(getattr(knobs, "runtime", None), "jit_post_compile_hook"):
            # Triton 3.3 has no listener: every miss counts as compiled (no cache_hit there)
            self._previous = knobs.runtime.jit_post_compile_hook
            knobs.runtime.jit_post_compile_hook = self._post_compile_hook
        else:
            self.unavailable_reason = "this triton has neither a compilation listener nor a JIT hook"
            return False
        self.hooked = True
        return True

    def _listener(self, *, src, metadata, metadata_group, times, cache_hit, **kwargs) -> None:
        try:
            name = str(getattr(src, "name", None) or (metadata or {}).get("name") or "<unknown>")
            micros = getattr(times, "total", 0) or 0
            self.record(name, "disk_cache" if cache_hit else "compiled", micros / 1e6,
                        _variant(name, src, metadata or {}))
        except Exception:   # counting must never break a compile
            log.exception("compile watch: could not record a compile")
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group,
                           times=times, cache_hit=cache_hit, **kwargs)

    def _post_compile_hook(self, *, key, repr, fn, compile, is_manual_warmup,
                           already_compiled, **kwargs):
        try:
            self.record(str(getattr(fn, "name", "<unknown>")), "compiled")
        except Exception:
            log.exception("compile watch: could not record a compile")
        if self._previous is not None:
            return self._previous(key=key, repr=repr, fn=fn, compile=compile,
                                  is_manual_warmup=is_manual_warmup,
                                  already_compiled=already_compiled, **kwargs)
        return None


def _variant(name: str, src, metadata: dict) -> str:
    """``kernel[CONSTEXPR=value,...] w<warps> s<stages>``: what tells a kernel's variants
    apart (specialized ints appear among the constexprs); the name alone when unreadable."""
    try:
        arg_names = src.fn.arg_names
        constants = sorted((arg_names[key[0]], value) for key, value in src.constants.items()
                           if len(key) == 1 and isinstance(value, (bool, int, str)))
        inner = ",".join(f"{k}={v}" for k, v in constants)
        options = " ".join(f"{tag}{metadata[key]}" for key, tag in (("num_warps", "w"),
                                                                      ("num_stages", "s"))
                           if key in metadata)
        return f"{name}[{inner}]" + (f" {options}" if options else "")
    except Exception:   # another Triton's source object: the name says enough
        return name


def step_compile_attributes(events: list[CompileEvent]) -> dict[str, Any]:
    """The step span's attributes for the variants its launches met (``STEP_JIT_*``)."""
    return {sc.STEP_JIT_COMPILES: len(events),
            sc.STEP_JIT_COMPILE_KERNELS: [e.kernel for e in events],
            sc.STEP_JIT_COMPILE_S: round(sum(e.duration_s for e in events), 6)}


_watch: CompileWatch | None = None
_watch_lock = threading.Lock()


def compile_watch() -> CompileWatch:
    """The process's watch, its Triton listener installed on first use (Triton's listener
    is one per process, hence one watch per process)."""
    global _watch
    with _watch_lock:
        if _watch is None:
            _watch = CompileWatch()
            if not _watch.hook_triton():
                log.info("kernel compiles are not counted: %s", _watch.unavailable_reason)
        return _watch
