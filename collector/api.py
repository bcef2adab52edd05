"""The collector's query API under ``/api/v1/`` (aiohttp routes, all GET).

``/kernels`` lists what has per-SM data and kernel spans; ``/heatmap`` renders one heatmap
(:mod:`.heatmap`) as JSON, PNG or HTML and ``/heatmap.html`` the page with all of them;
``/explain`` explains the slowest requests or one trace (:mod:`.explain`); ``/traces/{id}``
returns a trace's stored spans; ``/stragglers`` the tensor-parallel straggler verdict of
each window slot per producer (:mod:`.stragglers`). Each handler below documents its parameters.

Bad parameters answer 400 with ``{"error": {"code": 400, "param": ..., "message": ...}}``;
an unknown trace or kernel answers 404 in the same shape. Cost: heatmaps and explanations
are computed on the default thread pool, so the event loop keeps receiving telemetry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

from aiohttp import web

from ..instrumentation import check_range
from . import explain as explain_mod
from . import heatmap as hm
from .heatmap_page import render_page
from .otlp_points import MAX_LABEL_CHARS
from .query import SmQuery
from .sm_store import SmKey

__all__ = ["add_api_routes", "all_heatmaps"]

# fullmatch, never match with "$": "$" also matches before a trailing newline ("...%0a")
_TRACE_ID = re.compile(r"(?:[0-9a-fA-F]{16}){1,2}")
_KINDS = ("time_sm", "sm_latency")
_FORMATS = ("json", "png", "html")


class _BadParam(Exception):
    def __init__(self, param: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.message, self.status = param, message, status


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    body = {"error": {"code": status, "message": message}}
    if param:
        body["error"]["param"] = param
    return web.json_response(body, status=status)


def _padded(trace_id: str) -> str:
    """A 64-bit (16 hex) B3 trace id as the 128-bit one the Zipkin receiver stores."""
    return trace_id.lower().rjust(32, "0")


def _json(payload) -> web.Response:
    return web.Response(text=json.dumps(hm.finite(payload), allow_nan=False),
                        content_type="application/json")


def _float(request: web.Request, name: str, default: float | None, lo: float, hi: float) -> float | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise _BadParam(name, f"{name}={raw!r} is not a number") from None
    try:
        check_range(name, value, lo, hi)
    except ValueError as exc:
        raise _BadParam(name, str(exc)) from None
    return value


def _choice(request: web.Request, name: str, choices: tuple[str, ...]) -> str:
    value = request.query.get(name, choices[0])
    if value not in choices:
        raise _BadParam(name, f"{name}={value!r} is not one of {', '.join(choices)}")
    return value


def _pick(sm: SmQuery, instance: str | None, gpu: str | None, kernel: str | None) -> SmKey:
    if kernel is not None:
        kernel = kernel[:MAX_LABEL_CHARS]  # what series keep of a name
    entries = sm.gpus()
    candidates = [e for e in entries if (instance is None or e["instance"] == instance)
                  and (gpu is None or gpu in (e["gpu"], e["gpu_index"], e["gpu_label"]))
                  and (kernel is None or kernel in (e["kernel"], e["kernel_label"]))]
    if len(candidates) == 1:
        e = candidates[0]
        return SmKey(e["instance"], e["gpu"], e["kernel"])
    if not candidates:
        if gpu is not None:
            refused = sm.refusals_of(gpu, instance, limit=1)  # an index lookup: the table may be large
            if refused:
                k, r = refused[0]
                raise _BadParam("gpu", f"per-SM data of instance_id={k.instance!r} gpu={k.gpu!r} was refused: "
                                       f"{r.limit}={r.value} reached ({r.refused_series} series refused); "
                                       f"raise {r.limit} or add replicas", status=404)
        raise _BadParam("kernel" if gpu is not None else "gpu",
                        "no per-SM data matches; see /api/v1/kernels", status=404)
    missing = "kernel" if gpu is not None else "gpu"
    if kernel is not None and gpu is not None:
        missing = "instance_id"
    raise _BadParam(missing, f"{len(candidates)} (instance_id, gpu, kernel) match: give instance_id=, gpu= "
                             "and kernel=")


def all_heatmaps(sm: SmQuery, window_s: float | None = None) -> list[dict]:
    """Both views of every (instance, gpu, kernel) with per-SM data, as dicts."""
    out = []
    now_s = sm.now()
    for e in sm.gpus():
        key = SmKey(e["instance"], e["gpu"], e["kernel"])
        out.append(hm.time_sm(sm, key, now_s, window_s).to_dict())
        out.append(hm.sm_latency(sm, key, now_s, window_s).to_dict())
    return out


def add_api_routes(app: web.Application, aggregator) -> None:
    """Adds every ``/api/v1/`` route serving ``aggregator`` to ``app``."""
    horizon = aggregator.config.window.horizon_s

    async def run(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def kernels(request: web.Request) -> web.Response:
        # which (instance, gpu, kernel) have per-SM data (and any admission refusal of their
        # GPU), and which (gpu, kernel) have kernel spans
        return _json({"kernels": aggregator.kernels()})

    async def heatmap(request: web.Request) -> web.Response:
        # ?instance_id=&gpu=&kernel=&kind=time_sm|sm_latency&format=json|png|html&window_s=
        # gpu: the GPU's UUID, index or /metrics label; kernel: its name or /metrics label; any
        # of the three may be left out when only one choice matches. A GPU refused by an
        # admission limit answers 404 naming the limit and its value.
        base = f"{request.scheme}://{request.host}"
        try:
            kind = _choice(request, "kind", _KINDS)
            fmt = _choice(request, "format", _FORMATS)
            window_s = _float(request, "window_s", None, 1e-3, horizon)
            # on a thread: it reads every (instance, gpu, kernel) the store holds
            key = await run(_pick, aggregator.sm, request.query.get("instance_id"), request.query.get("gpu"),
                            request.query.get("kernel"))
        except _BadParam as exc:
            return _error(exc.status, exc.message, exc.param)

        def build():
            fn = hm.time_sm if kind == "time_sm" else hm.sm_latency
            result = fn(aggregator.sm, key, None, window_s)
            if fmt == "png":
                return hm.render_png(result)
            if fmt == "html":
                return render_page([result.to_dict()], title=f"{key.instance} GPU {key.gpu} {key.kernel}",
                                   api_base=base)
            return result.to_dict()

        body = await run(build)
        if fmt == "png":
            return web.Response(body=body, content_type="image/png")
        if fmt == "html":
            return web.Response(text=body, content_type="text/html")
        return _json(body)

    async def heatmap_page(request: web.Request) -> web.Response:
        # the interactive page with every (gpu, kernel) and both views
        try:
            window_s = _float(request, "window_s", None, 1e-3, horizon)
        except _BadParam as exc:
            return _error(exc.status, exc.message, exc.param)
        base = f"{request.scheme}://{request.host}"
        page = await run(lambda: render_page(all_heatmaps(aggregator.sm, window_s), api_base=base))
        return web.Response(text=page, content_type="text/html")

    async def explain(request: web.Request) -> web.Response:
        # ?quantile=0.99&limit=10: the slowest requests (&start_unix_s=&end_unix_s=: of those that
        # lived in that range); ?trace_id=...: one request
        trace_id = request.query.get("trace_id")
        if trace_id is not None:  # one request, e.g. from an exemplar
            if not _TRACE_ID.fullmatch(trace_id):
                return _error(400, f"trace_id={trace_id!r} is not 32 (or 16) hex digits", "trace_id")
            one = await run(explain_mod.explain_trace, aggregator, _padded(trace_id))
            if one is None:
                return _error(404, f"no request trace {trace_id} in the store (never received, evicted, "
                                   "or not a request's trace)", "trace_id")
            return _json(dataclasses.asdict(one))
        try:
            quantile = _float(request, "quantile", 0.99, 0.0, 1.0)
            limit = _float(request, "limit", 10, 1, 1000)
            if limit != int(limit):
                raise _BadParam("limit", f"limit={request.query['limit']} is not an integer")
            start = _float(request, "start_unix_s", None, 0.0, 1e11)
            end = _float(request, "end_unix_s", None, 0.0, 1e11)
            if (start is None) != (end is None) or (start is not None and not start < end):
                raise _BadParam("end_unix_s" if start is not None else "start_unix_s",
                                "give both start_unix_s and end_unix_s, the start before the end")
        except _BadParam as exc:
            return _error(exc.status, exc.message, exc.param)
        within = None if start is None else (start, end)
        result = await run(lambda: explain_mod.explain_slowest(aggregator, quantile, int(limit), within_s=within))
        return _json(result.to_dict())

    async def trace(request: web.Request) -> web.Response:
        # the stored spans of one trace, with their events and status messages; the id is 32
        # hex digits, or 16: a 64-bit B3 id, zero-padded on the left as Zipkin's receiver stores it
        trace_id = request.match_info["trace_id"]
        if not _TRACE_ID.fullmatch(trace_id):
            return _error(400, f"trace_id={trace_id!r} is not 32 (or 16) hex digits", "trace_id")
        result = await run(explain_mod.trace_spans, aggregator, _padded(trace_id))
        if result is None:
            return _error(404, f"trace {trace_id} is not in the store (never received or evicted)",
                          "trace_id")
        return _json(result)

    async def stragglers(request: web.Request) -> web.Response:
        # ?instance_id=...: one producer; each slot's steps, named counts and verdict
        instance = request.query.get("instance_id")
        found = await run(aggregator.stragglers, instance)
        return _json({"slot_s": aggregator.config.window.slot_s, "instances": {
            name: [dataclasses.asdict(v) for v in verdicts] for name, verdicts in found.items()}})

    app.router.add_get("/api/v1/kernels", kernels)
    app.router.add_get("/api/v1/stragglers", stragglers)
    app.router.add_get("/api/v1/heatmap", heatmap)
    app.router.add_get("/api/v1/heatmap.html", heatmap_page)
    app.router.add_get("/api/v1/explain", explain)
    app.router.add_get("/api/v1/traces/{trace_id}", trace)

    async def unknown(request: web.Request) -> web.Response:
        return _error(404, f"no route {request.path}; see /api/v1/kernels, /api/v1/heatmap, "
                           "/api/v1/heatmap.html, /api/v1/explain, /api/v1/traces/{trace_id}, "
                           "/api/v1/stragglers")

    app.router.add_get("/api/v1/{tail:.*}", unknown)
