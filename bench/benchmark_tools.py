"""guidellm and aiperf against ``sightline engine serve``: do they see what the engine measures?

Starts the engine (tiny model, CPU, tracing off) as its own process, then for each tool
found in ``--tools-venv``, and for Python's own ``http.client`` (the client-side floor):
scrapes ``/metrics``, runs the tool (sequential streamed completions, fixed prompt and
output lengths, server-reported token counts), scrapes again, and compares the tool's
mean TTFT and inter-token latency with the engine's (histogram sum / count over the same
requests) and its token totals with the engine's exact counters. Prints a table; writes
``bench/results/benchmark_tools-cpu-<commit>.md``.

Requests set ``allowed_token_ids`` to printable ASCII (``--all-token-ids``: not): both tools
time the first token at the first chunk with text, and most of the random-weight model's
tokens decode to nothing (ids past the byte range, bytes of an unfinished UTF-8 character).
The tools' synthetic prompts need a Hugging Face tokenizer: a byte-level one is written to a
temporary folder. Usage: ``.venv/bin/python -m bench.benchmark_tools --tools-venv VENV``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from sightline.deploy.processes import free_port
from sightline.instrumentation import semconv as sc

from ._common import ROOT, device_name, git_commit, utc_now

_TOKENIZER = """
import json, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.save(sys.argv[1] + "/tokenizer.json")
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048},
          open(sys.argv[1] + "/tokenizer_config.json", "w"))
"""

# One character per token, so that "first chunk with text" is the first token.
PRINTABLE_IDS = list(range(0x20, 0x7f))


@dataclass
class Comparison:
    tool: str
    requests: int
    ttft_ms: tuple[float, float]  # (tool mean, engine mean)
    itl_ms: tuple[float, float]
    output_tokens: tuple[int, int]
    prompt_tokens: tuple[int, int]
    text_ttft_ms: float | None = None  # the tool's mean time to the first chunk with text, when it reports one


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def _engine_delta(before: dict, after: dict) -> dict[str, float]:
    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    return {"requests": d(sc.ENGINE_TTFT_SECONDS + "_count"),
            "ttft_ms": 1e3 * d(sc.ENGINE_TTFT_SECONDS + "_sum") / d(sc.ENGINE_TTFT_SECONDS + "_count"),
            "itl_ms": 1e3 * d(sc.ENGINE_ITL_SECONDS + "_sum") / d(sc.ENGINE_ITL_SECONDS + "_count"),
            "output_tokens": d(sc.ENGINE_REQUEST_GENERATION_TOKENS + "_sum"),
            "prompt_tokens": d(sc.ENGINE_REQUEST_PROMPT_TOKENS + "_sum")}


def _allowed(args, spell) -> list[str]:
    """The tool's spelling of ``{"allowed_token_ids": [...]}``; none with ``--all-token-ids``."""
    return [] if args.all_token_ids else [spell({"allowed_token_ids": PRINTABLE_IDS})]


def _aiperf(venv: Path, url: str, tokenizer: Path, work: Path, args) -> dict:
    out = work / "aiperf"
    subprocess.run([str(venv / "bin" / "aiperf"), "profile", "--model", "tiny", "--tokenizer", str(tokenizer),
                    "--url", url, "--endpoint-type", "completions", "--streaming", "--request-count",
                    str(args.requests), "--concurrency", "1", "--use-server-token-count",
                    "--synthetic-input-tokens-mean", str(args.prompt_tokens), "--synthetic-input-tokens-stddev", "0",
                    "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", "0",
                    "--extra-inputs", "ignore_eos:true", *_allowed(args, json.dumps), "--random-seed", "1",
                    "--output-artifact-dir", str(out), "--no-auto-plot"], check=True, capture_output=True, text=True, timeout=900, cwd=work)
    data = json.loads((out / "profile_export_aiperf.json").read_text())
    return {"requests": data["request_count"]["avg"], "ttft_ms": data["time_to_first_token"]["avg"],
            "itl_ms": data["inter_token_latency"]["avg"], "output_tokens": data["total_output_tokens"]["avg"],
            "prompt_tokens": data["input_sequence_length"]["sum"]}


def _guidellm(venv: Path, url: str, tokenizer: Path, work: Path, args) -> dict:
    out = work / "guidellm.json"
    allowed = "".join(_allowed(args, lambda body: "".join(
        f",extras.body.allowed_token_ids[{i}]={t}" for i, t in enumerate(body["allowed_token_ids"]))))
    subprocess.run([str(venv / "bin" / "guidellm"), "run", "--backend",
                    f"kind=openai_http,target={url},model=tiny{allowed}", "--profile", "kind=synchronous",
                    "--constraint", f"kind=max_requests,count={args.requests}", "--data",
                    f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
                    "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--output", f"kind=json,path={out}",
                    "--disable-console-interactive"], check=True, capture_output=True, text=True, timeout=900,
                   cwd=work)
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]

    def ok(name: str) -> dict:
        return metrics[name]["successful"]

    return {"requests": metrics["request_totals"]["successful"], "ttft_ms": ok("time_to_first_token_ms")["mean"],
            "itl_ms": ok("inter_token_latency_ms")["mean"], "output_tokens": ok("output_token_count")["total_sum"],
            "prompt_tokens": ok("prompt_token_count")["total_sum"]}


def _plain_http(venv: Path, url: str, tokenizer: Path, work: Path, args) -> dict:
    """The floor: the standard library's HTTP client, one SSE line read as it arrives."""
    import http.client
    from urllib.parse import urlsplit

    host = urlsplit(url)
    ttfts, text_ttfts, gaps, outputs, prompts = [], [], [], 0, 0
    body = json.dumps({"model": "tiny", "prompt": "x" * args.prompt_tokens, "max_tokens": args.output_tokens,
                       "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
                       **({} if args.all_token_ids else {"allowed_token_ids": PRINTABLE_IDS})})
    for _ in range(args.requests):
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=60)
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        arrivals, first_text, usage = [], None, None
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                arrivals.append(time.perf_counter())
                if first_text is None and chunk["choices"][0]["text"]:
                    first_text = arrivals[-1]
            elif chunk.get("usage"):
                usage = chunk["usage"]
        conn.close()
        ttfts.append(arrivals[0] - start)
        text_ttfts.append((first_text or arrivals[-1]) - start)
        gaps += [b - a for a, b in zip(arrivals, arrivals[1:])]
        outputs += usage["completion_tokens"]
        prompts += usage["prompt_tokens"]
    return {"requests": args.requests, "ttft_ms": 1e3 * sum(ttfts) / len(ttfts), "itl_ms": 1e3 * sum(gaps) / len(gaps),
            "output_tokens": outputs, "prompt_tokens": prompts,
            "text_ttft_ms": 1e3 * sum(text_ttfts) / len(text_ttfts)}


def run(args) -> list[Comparison]:
    venv = Path(args.tools_venv)
    tools = {name: fn for name, fn in (("guidellm", _guidellm), ("aiperf", _aiperf))
             if (venv / "bin" / name).exists()}
    if not tools:
        raise SystemExit(f"neither guidellm nor aiperf in {venv}/bin")
    tools["http.client"] = _plain_http
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "sightline.deploy.cli", "engine", "serve", "--model", "tiny",
                               "--device", "cpu", "--port", str(port), "--trace-level", "off", "--log-level",
                               "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if engine.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the engine did not start") from None
                time.sleep(0.5)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            tokenizer = work / "tokenizer"
            tokenizer.mkdir()
            subprocess.run([str(venv / "bin" / "python"), "-c", _TOKENIZER, str(tokenizer)], check=True)
            for name, fn in tools.items():
                before = _scrape(url)
                seen = fn(venv, url, tokenizer, work, args)
                engine_seen = _engine_delta(before, _scrape(url))
                results.append(Comparison(name, int(seen["requests"]),
                                          (seen["ttft_ms"], engine_seen["ttft_ms"]),
                                          (seen["itl_ms"], engine_seen["itl_ms"]),
                                          (int(seen["output_tokens"]), int(engine_seen["output_tokens"])),
                                          (int(seen["prompt_tokens"]), int(engine_seen["prompt_tokens"])),
                                          seen.get("text_ttft_ms")))
                if engine_seen["requests"] != seen["requests"]:
                    print(f"{name}: the engine saw {engine_seen['requests']:g} requests, the tool "
                          f"{seen['requests']:g} (warm-up requests?)")
    finally:
        engine.terminate()
        engine.wait(60)
    return results


def report(results: list[Comparison], args) -> str:
    lines = ["# guidellm and aiperf against `sightline engine serve --model tiny --device cpu`", "",
             f"commit {git_commit(short=True)}, {device_name('cpu')}, {utc_now()}; {args.requests} sequential streamed "
             f"completions per tool, {args.prompt_tokens} prompt / {args.output_tokens} output tokens "
             "(server-reported counts); "
             + ("any token id may be sampled." if args.all_token_ids else
                "`allowed_token_ids` = printable ASCII (one character per token)."), "",
             "Engine figures: histogram sum / count over the tool's requests (`/metrics` before and after).", "",
             "| tool | requests | TTFT tool / engine (ms) | ITL tool / engine (ms) | output tokens tool / engine "
             "| prompt tokens tool / engine |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.tool} | {r.requests} | {r.ttft_ms[0]:.2f} / {r.ttft_ms[1]:.2f} "
                     f"(Δ {r.ttft_ms[0] - r.ttft_ms[1]:+.2f}) | {r.itl_ms[0]:.2f} / {r.itl_ms[1]:.2f} "
                     f"(Δ {r.itl_ms[0] - r.itl_ms[1]:+.2f}) | {r.output_tokens[0]} / {r.output_tokens[1]} "
                     f"| {r.prompt_tokens[0]} / {r.prompt_tokens[1]} |")
    lines += [f"\n{r.tool}: first chunk with text after {r.text_ttft_ms:.2f} ms on average (TTFT as the "
              "tools count it)." for r in results if r.text_ttft_ms is not None]
    lines += ["", f"Command: `.venv/bin/python -m bench.benchmark_tools --tools-venv {args.tools_venv} "
              f"--requests {args.requests}{' --all-token-ids' if args.all_token_ids else ''}`", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools-venv", required=True, help="a virtual environment with guidellm and/or aiperf")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--all-token-ids", action="store_true",
                        help="no allowed_token_ids: any token may be sampled, most decode to no text")
    args = parser.parse_args()
    results = run(args)
    text = report(results, args)
    print(text)
    suffix = "-all-token-ids" if args.all_token_ids else ""
    out = ROOT / "bench" / "results" / f"benchmark_tools-cpu-{git_commit(short=True)}{suffix}.md"
    out.write_text(text, encoding="utf-8")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
