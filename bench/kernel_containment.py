"""Share of kernel spans lying inside their parent step span's time, from a capture.

The contract: kernel spans (CUPTI, GPU timestamps) are children of their ``engine.step``
span and lie inside its time in at least 99.9 % of cases.

    python -m bench.kernel_containment deploy/captures/h200-20261202-http.jsonl.gz

``step_containment`` takes any iterable of OTLP spans (``capture_spans`` yields a
capture's), so other scripts apply the same rule to spans they already hold.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from sightline.instrumentation import semconv
from sightline.instrumentation.capture import read_capture

__all__ = ["attribute", "capture_spans", "containment", "step_containment"]


def capture_spans(path: str | Path) -> Iterator[Span]:
    """Every span of a capture, in file order."""
    for signal, _, request in read_capture(path):
        if signal != "traces":
            continue
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                yield from scope_spans.spans


def attribute(span: Span, key: str, default=None):
    """The value of an OTLP span's attribute ``key`` (whichever type it holds), or ``default``."""
    for kv in span.attributes:
        if kv.key == key:
            return getattr(kv.value, kv.value.WhichOneof("value"))
    return default


def step_path(step: Span) -> str:
    """How a step ran its forward pass: ``mixed_graphs`` (prefill tokens, CUDA graphs between
    eager attentions), ``decode_graph`` (a decode-only graph replay) or ``eager``."""
    if attribute(step, semconv.STEP_GRAPH_TOKENS):
        return "mixed_graphs"
    return "decode_graph" if attribute(step, semconv.STEP_CUDA_GRAPH) else "eager"


def step_containment(spans: Iterable[Span]) -> dict:
    """Steps, kernel spans (children of a step span) and how many lie inside their step's time,
    in all and by the step's path (``step_path``)."""
    steps: dict[bytes, tuple[int, int, str]] = {}
    children: list[tuple[bytes, int, int]] = []
    for span in spans:
        if span.name == semconv.SPAN_ENGINE_STEP:
            steps[span.span_id] = (span.start_time_unix_nano, span.end_time_unix_nano, step_path(span))
        elif span.parent_span_id:
            children.append((span.parent_span_id, span.start_time_unix_nano, span.end_time_unix_nano))
    # File order is export order, not parent-first: join only once every step is known.
    kernels = [(parent, start, end) for parent, start, end in children if parent in steps]
    by_path: dict[str, dict[str, int]] = {}
    for parent, start, end in kernels:
        begun, ended, path = steps[parent]
        counts = by_path.setdefault(path, {"kernel_spans": 0, "inside_step": 0})
        counts["kernel_spans"] += 1
        counts["inside_step"] += begun <= start and end <= ended
    inside = sum(c["inside_step"] for c in by_path.values())
    return {"steps": len(steps), "kernel_spans": len(kernels), "inside_step": inside,
            "fraction_inside": inside / len(kernels) if kernels else None, "by_step_path": by_path}


def containment(path: str) -> dict:
    return {"capture": path, **step_containment(capture_spans(path))}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("capture")
    print(json.dumps(containment(parser.parse_args().capture), indent=1))
