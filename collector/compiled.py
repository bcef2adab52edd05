"""The collector's compiled byte walks, compiled off the event loop, exact before they are.

A function decorated ``@ahead(signature)`` is compiled by numba for ``signature`` (and
cached on disk, ``cache=True``) when :func:`warm` or :func:`warm_in_background` reaches it,
not at import: on an empty numba cache that is tens of seconds, during which a collector
must already answer liveness and serve ingest. Until its compile is done a call runs the
same function's Python source (every numba function it calls replaced by its Python
source too): the same results, slower. :func:`state` is what readiness reports.

Guarantee: a call never waits for a compile and never fails because of one (a failed
compile is logged and the Python path stays). Cost once warm: one Python call more per
call (~0.2 us), none per byte; before, the walks run at CPython's speed (microseconds per
protobuf field). Process-wide: the compile happens once, whichever collector starts it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import types as pytypes
from dataclasses import dataclass
from typing import Any, Callable

import numba
import numpy as np
from numba.core.dispatcher import Dispatcher

__all__ = ["Ahead", "WarmState", "ahead", "state", "wait", "warm", "warm_in_background"]

log = logging.getLogger("sightline.collector")

_registry: list[Ahead] = []  # every decorated function, in import order
_lock = threading.Lock()
_started: threading.Thread | None = None
_done = threading.Event()
_failure: str | None = None


class Ahead:
    """A numba function compiled on demand (:meth:`compile`); its Python source until then."""

    def __init__(self, func: Callable, signature, options: dict[str, Any]) -> None:
        self.py_func = func
        self.signature = signature
        self.options = options
        self._compiled: Dispatcher | None = None
        self._pure: Callable | None = None
        functools.update_wrapper(self, func)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def compile(self) -> None:
        """Compiles (or loads from numba's cache) for the signature; later calls run it."""
        if self._compiled is None:
            self._compiled = numba.njit(self.signature, cache=True, **self.options)(self.py_func)

    def __call__(self, *args):
        compiled = self._compiled
        if compiled is not None:
            return compiled(*args)
        return self.python(*args)

    def python(self, *args):
        """The call on the Python path, compiled or not (what runs until the compile is done)."""
        if self._pure is None:
            self._pure = _python_source(self.py_func, {})
        # numba's integers wrap silently; numpy's scalars would warn at each wrap
        with np.errstate(over="ignore"):
            return self._pure(*args)


def ahead(signature, **options) -> Callable[[Callable], Ahead]:
    """Decorator: ``numba.njit(signature, cache=True, **options)``, compiled by :func:`warm`."""

    def register(func: Callable) -> Ahead:
        function = Ahead(func, signature, options)
        with _lock:
            _registry.append(function)
        return function

    return register


def _python_source(func: Callable, mirrors: dict[int, dict]) -> Callable:
    """``func`` re-created over a copy of its module's globals in which every numba function
    (and :class:`Ahead`) is its own Python source, recursively."""
    source = func.py_func if isinstance(func, (Dispatcher, Ahead)) else func
    module = source.__globals__
    mirror = mirrors.get(id(module))
    if mirror is None:
        mirror = mirrors[id(module)] = dict(module)  # registered before filling: calls may recurse
        for name, value in module.items():
            if isinstance(value, (Dispatcher, Ahead)):
                mirror[name] = _python_source(value, mirrors)
    return pytypes.FunctionType(source.__code__, mirror, source.__name__, source.__defaults__,
                                source.__closure__)


@dataclass(frozen=True)
class WarmState:
    """What readiness says about the compiled paths."""

    ready: bool
    reason: str  # why not ready; "" when ready


def state() -> WarmState:
    with _lock:
        functions = list(_registry)
    done = sum(f.compiled for f in functions)
    if _failure is not None:
        return WarmState(False, f"compiling the byte walks failed ({_failure}); ingest runs the slower "
                                "Python paths")
    if done == len(functions) and _done.is_set():
        return WarmState(True, "")
    return WarmState(False, f"compiling the byte walks: {done} of {len(functions)} compiled (numba cache "
                            "cold; ingest is served meanwhile, by the slower Python paths)")


def warm() -> float:
    """Compiles every registered function in this thread; returns the seconds it took.
    Raises what numba raises (the caller decides whether that is fatal)."""
    from . import request_shape, span_ids  # noqa: F401  (their functions register at import)

    began = time.monotonic()
    with _lock:
        functions = list(_registry)
    for function in functions:
        function.compile()
    took = time.monotonic() - began
    _done.set()
    return took


def warm_in_background() -> None:
    """Starts :func:`warm` on a daemon thread, once per process (later calls do nothing)."""
    global _started
    with _lock:
        if _started is not None:
            return
        _started = threading.Thread(target=_warm_logged, name="sightline-compile", daemon=True)
    _started.start()


def _warm_logged() -> None:
    global _failure
    try:
        took = warm()
    except Exception as exc:  # a numba or LLVM failure: the Python paths keep serving
        _failure = f"{type(exc).__name__}: {exc}"
        log.error("compiling the byte walks failed; ingest stays on the slower Python paths", exc_info=exc)
        _done.set()  # no waiter waits for a compile that is not coming
        return
    log.info("byte walks compiled in %.1f s: ready", took)


def wait(timeout_s: float | None = None) -> bool:
    """Blocks until the compile finished (True) or failed or ``timeout_s`` passed (False)."""
    return _done.wait(timeout_s) and _failure is None
