"""Trace-context propagation for HTTP: W3C traceparent/tracestate, W3C baggage, Zipkin B3.

Extraction is liberal: it accepts every supported format on every request (W3C
``traceparent``/``tracestate``, ``baggage``, B3 single ``b3`` and multi ``X-B3-*``), from
a plain mapping whose keys may be in any case (aiohttp, starlette, WSGI dicts). When a
request carries both W3C and B3 headers, W3C wins (it is the OpenTelemetry default).
Injection is conservative: only the formats configured (``OTEL_PROPAGATORS``).

Cost: one lower-cased copy of the header mapping per extraction (a dict comprehension),
then, when any of their header names is present, each format's parse; nothing global is
touched (no ``set_global_textmap``), so several instances with different settings can live
in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping

from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.b3 import B3MultiFormat, B3SingleFormat
from opentelemetry.propagators.textmap import Getter, Setter, TextMapPropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["HeaderPropagator", "extract_context", "inject_headers"]


class _LowerDictGetter(Getter[Mapping[str, str]]):
    """Reads a mapping whose keys were lower-cased on the way in."""

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = carrier.get(key.lower())
        if value is None:
            return None
        return [value]

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier.keys())


class _DictSetter(Setter[MutableMapping[str, str]]):
    def set(self, carrier: MutableMapping[str, str], key: str, value: str) -> None:
        carrier[key] = value


_GETTER = _LowerDictGetter()
_SETTER = _DictSetter()


def _lowered(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
    """Lower-cased copy; for repeated keys the first value wins (as traceparent requires)."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: dict[str, str] = {}
    for key, value in items:
        low = key.lower()
        if low not in out:
            out[low] = value
    return out


_INJECTORS = {
    "tracecontext": TraceContextTextMapPropagator,
    "baggage": W3CBaggagePropagator,
    "b3": B3SingleFormat,
    "b3multi": B3MultiFormat,
}


class HeaderPropagator:
    """Extracts any supported context from headers; injects the configured formats.

    ``inject_formats`` is a subset of ``tracecontext|baggage|b3|b3multi`` (order kept).
    """

    def __init__(self, inject_formats: Iterable[str] = ("tracecontext", "baggage")) -> None:
        formats = tuple(inject_formats)
        for name in formats:
            if name not in _INJECTORS:
                raise ValueError(
                    f"propagator {name!r} is not one of {'|'.join(_INJECTORS)}"
                )
        self.inject_formats = formats
        # Order matters for extraction: later formats overwrite earlier ones, so W3C
        # trace context runs after B3 and wins when both are present.
        self._extractors: tuple[TextMapPropagator, ...] = (
            B3MultiFormat(),  # also reads the single ``b3`` header
            TraceContextTextMapPropagator(),
            W3CBaggagePropagator(),
        )
        # most requests carry no context: a set test on the header names spares them the
        # three parses (the server pays this on every request, on the engine's GIL); the
        # multi-header B3 extractor also reads the single ``b3`` header
        self._extract_fields = frozenset(
            {f.lower() for p in self._extractors for f in p.fields} | B3SingleFormat().fields)
        self._injectors: tuple[TextMapPropagator, ...] = tuple(_INJECTORS[n]() for n in formats)

    def extract(
        self,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] | None,
        context: Context | None = None,
    ) -> Context:
        """The context carried by ``headers`` (an empty ``Context()`` when none or on bad input)."""
        ctx = Context() if context is None else context
        if not headers:
            return ctx
        carrier = _lowered(headers)
        if self._extract_fields.isdisjoint(carrier):
            return ctx
        for propagator in self._extractors:
            ctx = propagator.extract(carrier, context=ctx, getter=_GETTER)
        return ctx

    def inject(
        self,
        headers: MutableMapping[str, str] | None = None,
        context: Context | None = None,
    ) -> MutableMapping[str, str]:
        """Writes the configured headers for ``context`` (default: the current one); returns them."""
        carrier: MutableMapping[str, str] = {} if headers is None else headers
        for propagator in self._injectors:
            propagator.inject(carrier, context=context, setter=_SETTER)
        return carrier

    @property
    def fields(self) -> set[str]:
        """Header names that ``inject`` may write."""
        out: set[str] = set()
        for propagator in self._injectors:
            out |= set(propagator.fields)
        return out


_DEFAULT = HeaderPropagator(("tracecontext", "baggage"))


def extract_context(headers: Mapping[str, str] | None, context: Context | None = None) -> Context:
    """Module-level convenience: :meth:`HeaderPropagator.extract` with the default instance."""
    return _DEFAULT.extract(headers, context)


def inject_headers(
    headers: MutableMapping[str, str] | None = None,
    context: Context | None = None,
    formats: Iterable[str] = ("tracecontext", "baggage"),
) -> MutableMapping[str, str]:
    """Injects ``formats`` for ``context`` into ``headers`` (a new dict when None)."""
    formats = tuple(formats)
    propagator = _DEFAULT if formats == _DEFAULT.inject_formats else HeaderPropagator(formats)
    return propagator.inject(headers, context)
