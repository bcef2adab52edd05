"""``sightline heatmap``, ``sightline explain`` and ``sightline replay``.

Module-level imports are the standard library only (``sightline --help`` stays instant
and never imports numpy or protobuf); each handler imports what it needs.

* ``sightline heatmap --url http://127.0.0.1:8889 --out DIR``: every (gpu, kernel) with
  per-SM data, both views, as JSON and PNG, plus one interactive ``index.html``.
* ``sightline explain --url ... --quantile 0.99 --limit 5``: the slowest requests, with
  their cause, phases, steps, kernels and slowest SM (``--json`` for the raw answer).
* ``sightline replay FILE [--collector http://127.0.0.1:4318] [--speed 1]``: feeds a
  capture to a running collector's OTLP/HTTP port, or (without ``--collector``) to an
  in-process aggregator and prints what it found (``--out DIR`` writes its heatmaps).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

__all__ = ["register"]


def register(subcommands: argparse._SubParsersAction) -> None:
    heatmap = subcommands.add_parser("heatmap", help="write per-SM heatmaps (JSON, PNG, HTML) from a collector",
                                     description="Fetches every per-SM heatmap from a running collector's "
                                                 "query port and writes JSON, PNG and one interactive HTML page.")
    heatmap.add_argument("--url", default="http://127.0.0.1:8889", help="collector query port (default %(default)s)")
    heatmap.add_argument("--out", type=Path, required=True, help="directory to write into (created)")
    heatmap.add_argument("--gpu", default=None, help="only this GPU")
    heatmap.add_argument("--kernel", default=None, help="only this kernel")
    heatmap.add_argument("--window-s", type=float, default=None, help="look back this many seconds")
    heatmap.set_defaults(handler=_heatmap)

    explain = subcommands.add_parser("explain", help="explain the slowest requests seen by a collector",
                                     description="Prints the requests at or above a latency quantile with "
                                                 "their queue/prefill/decode breakdown, the engine steps they "
                                                 "rode, the slowest kernels and the slowest SM.")
    explain.add_argument("--url", default="http://127.0.0.1:8889", help="collector query port (default %(default)s)")
    explain.add_argument("--quantile", type=float, default=0.99, help="latency quantile (default %(default)s)")
    explain.add_argument("--limit", type=int, default=5, help="at most this many requests (default %(default)s)")
    explain.add_argument("--trace-id", default=None, help="explain this one request (32 hex digits), "
                                                          "e.g. from a Prometheus exemplar")
    explain.add_argument("--between", default=None, metavar="START,END",
                         help="only requests that lived between these Unix times (seconds)")
    explain.add_argument("--json", action="store_true", help="print the API's JSON instead of text")
    explain.set_defaults(handler=_explain)

    replay = subcommands.add_parser("replay", help="replay an OTLP capture into a collector (or in-process)",
                                    description="Reads an OTLP capture (JSON Lines, .gz allowed) and sends each "
                                                "export to a collector's OTLP/HTTP port, or aggregates it "
                                                "in-process when --collector is not given.")
    replay.add_argument("file", type=Path, help="capture file (instrumentation/capture.py format)")
    replay.add_argument("--collector", default=None, metavar="URL",
                        help="OTLP/HTTP base URL, e.g. http://127.0.0.1:4318 (default: in-process)")
    replay.add_argument("--speed", type=float, default=0.0,
                        help="N > 0: N times the recorded pace, time compressed to match (each export "
                             "stamped when it is sent); 0 (default): as fast as possible, the capture "
                             "shifted to end now with its spacing kept")
    replay.add_argument("--no-rebase", action="store_true",
                        help="keep the recorded timestamps (default: shift them to now)")
    replay.add_argument("--out", type=Path, default=None, help="in-process only: write heatmaps here")
    replay.add_argument("--quantile", type=float, default=0.99, help="in-process only: explain this quantile")
    replay.set_defaults(handler=_replay)


# -- helpers --------------------------------------------------------------------------------
def _get(url: str, timeout_s: float = 30.0) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except Exception:
            message = exc.reason
        raise RuntimeError(f"{url}: HTTP {exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        raise RuntimeError(f"{url}: {exc.reason}") from None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:80] or "kernel"


def _heatmap(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/")
    kernels = json.loads(_get(base + "/api/v1/kernels"))["kernels"]
    pairs = [(k["gpu"], k["kernel"]) for k in kernels if k["source"] == "sm_probe"
             and (args.gpu is None or k["gpu"] == args.gpu) and (args.kernel is None or k["kernel"] == args.kernel)]
    args.out.mkdir(parents=True, exist_ok=True)
    extra = {} if args.window_s is None else {"window_s": args.window_s}
    written = []
    for gpu, kernel in pairs:
        for kind in ("time_sm", "sm_latency"):
            for fmt in ("json", "png"):
                query = urllib.parse.urlencode({"gpu": gpu, "kernel": kernel, "kind": kind, "format": fmt, **extra})
                target = args.out / f"gpu{_slug(gpu)}_{_slug(kernel)}_{kind}.{fmt}"
                target.write_bytes(_get(f"{base}/api/v1/heatmap?{query}"))
                written.append(target)
    page = args.out / "index.html"
    page.write_bytes(_get(base + "/api/v1/heatmap.html" + ("?" + urllib.parse.urlencode(extra) if extra else "")))
    written.append(page)
    print(f"{len(pairs)} (gpu, kernel) pairs; wrote {len(written)} files to {args.out}")
    for path in written:
        print(f"  {path}")
    return 0 if pairs else 1


def format_explanation(result: dict) -> str:
    """Human-readable text of an ``/api/v1/explain`` answer."""
    lines = []
    if not result["requests"]:
        return f"no requests in the trace store (considered {result['requests_considered']})"
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f} ms"  # noqa: E731
    if result["quantile"] is not None:
        lines.append(f"P{result['quantile'] * 100:g} of e2e over {result['requests_considered']} stored "
                     f"requests: {ms(result['threshold_s'])}")
    for r in result["requests"]:
        p = r["phases"]
        lines.append(f"\ntrace {r['trace_id']}  {r['name']}  model={r['model']} priority={r['priority']}")
        cause = r.get("cause")
        if cause:
            lines.append(f"  cause: {cause['name']}: {cause['summary']}")
            lines.append(f"    compared with: {cause['compared_with']}")
        lines.append(f"  e2e {ms(r['e2e_s'])}  ttft {ms(r['ttft_s'])}  tpot {ms(r['tpot_s'])}  "
                     f"finish={r['finish_reason']}")
        lines.append(f"  phases: queue {ms(p['queue_s'])}  prefill {ms(p['prefill_s'])}  "
                     f"decode {ms(p['decode_s'])}  other {ms(p['other_s'])}")
        cache = r.get("prompt_cache")
        if cache:
            lines.append(_prompt_cache_line(cache, ms))
        lines.append(f"  steps ridden: {r['steps_total']} (slowest shown)")
        for s in r["steps"]:
            note = ""
            if s.get("kernel_trace_reason"):
                note += f"  [kernels traced: {s['kernel_trace_reason']}]"
            cached = s.get("prefill_cached_tokens")
            cached = f" prefill_cached_tokens={cached}" if cached else ""
            lines.append(f"    step {s['step_id']}  {ms(s['duration_s'])}  batch={s['batch_size']}  "
                         f"prefill_tokens={s['prefill_tokens']}{cached} decode_tokens={s['decode_tokens']}{note}")
            for k in s["kernels"]:
                sm = f"  slowest SM {k['slowest_sm']}" if k["slowest_sm"] is not None else ""
                lines.append(f"      {k['name'][:70]}  gpu {k['gpu']}  {k['duration_s'] * 1e6:.1f} us{sm}")
        if r["slowest_sm"]:
            s = r["slowest_sm"]
            value = "" if s["value_s"] is None else f" ({s['value_s'] * 1e6:.1f} us"
            value += f", {s['score']:.2f}x the median SM)" if s.get("score") else (")" if value else "")
            lines.append(f"  slowest SM: gpu {s['gpu']} SM {s['sm']} in {s['kernel'][:60]}{value} "
                         f"[from {s['source']}]")
    return "\n".join(lines)


def _prompt_cache_line(cache: dict, ms) -> str:
    """The prompt's prefix cache outcome and what computing its uncached part took."""
    computed = f"{cache['computed_tokens']} computed in prefill {ms(cache['prefill_s'])}"
    if not cache["hit"]:
        return f"  prompt: {cache['prompt_tokens']} tokens, prefix cache miss: {computed}"
    return (f"  prompt: {cache['prompt_tokens']} tokens, {cache['cached_tokens']} from the prefix cache "
            f"({cache['cached_ratio']:.0%}), {computed}")


def _explain(args: argparse.Namespace) -> int:
    if args.trace_id:
        query = urllib.parse.urlencode({"trace_id": args.trace_id})
        one = json.loads(_get(f"{args.url.rstrip('/')}/api/v1/explain?{query}"))
        result = {"quantile": None, "threshold_s": None, "requests_considered": 1, "requests": [one]}
        print(json.dumps(one, indent=2) if args.json else format_explanation(result))
        return 0
    params = {"quantile": args.quantile, "limit": args.limit}
    if args.between:
        start, _, end = args.between.partition(",")
        params.update(start_unix_s=start, end_unix_s=end)
    result = json.loads(_get(f"{args.url.rstrip('/')}/api/v1/explain?{urllib.parse.urlencode(params)}"))
    print(json.dumps(result, indent=2) if args.json else format_explanation(result))
    return 0


def _replay(args: argparse.Namespace) -> int:
    from .replay import AggregatorSink, HttpSink, ReplayConfig, replay

    config = ReplayConfig(speed=args.speed, rebase=not args.no_rebase)
    if args.collector:
        result = replay(args.file, HttpSink(args.collector), config)
        print(f"replayed {result.exports} exports ({result.spans} spans, {result.data_points} data points) "
              f"to {args.collector} in {result.duration_s:.2f} s ({result.retries} retries)")
        return 0
    from .aggregator import Aggregator
    from .api import all_heatmaps
    from .explain import explain_slowest
    from .heatmap import render_png, sm_latency, time_sm
    from .heatmap_page import render_page
    from .sm_store import SmKey

    aggregator = Aggregator()
    result = replay(args.file, AggregatorSink(aggregator), config)
    print(f"aggregated {result.exports} exports ({result.spans} spans, {result.data_points} data points) "
          f"in {result.duration_s:.2f} s")
    for entry in aggregator.kernels():
        print(f"  {entry}")
    print(format_explanation(explain_slowest(aggregator, args.quantile, 3).to_dict()))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for entry in aggregator.sm.gpus():
            for fn in (time_sm, sm_latency):
                h = fn(aggregator.sm, SmKey(entry["instance"], entry["gpu"], entry["kernel"]))
                stem = f"{_slug(entry['instance'])}_gpu{_slug(entry['gpu'])}_{_slug(entry['kernel'])}_{h.kind}"
                (args.out / f"{stem}.json").write_text(json.dumps(h.to_dict()))
                (args.out / f"{stem}.png").write_bytes(render_png(h))
        (args.out / "index.html").write_text(render_page(all_heatmaps(aggregator.sm)))
        print(f"wrote heatmaps to {args.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="sightline")
    register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    sys.exit(ns.handler(ns))
