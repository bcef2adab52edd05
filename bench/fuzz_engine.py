"""Fuzzes a real engine's OpenAI endpoints over HTTP: each generated case must get a
well-formed 200 (JSON, or an SSE stream ending with ``[DONE]``) or an OpenAI-shaped 4xx, and
the engine must serve on, its log free of tracebacks and its 5xx counters at 0.

The engine is ``sightline engine serve`` (tiny model, CPU, ``--max-model-len 64``, so that an
accepted request costs a few steps) in a subprocess; ``--workers`` client threads with
keep-alive connections send the cases of one seeded generator (``EngineCases``): valid
requests of every parameter, and every way to spoil them: wrong types, NaN/1e999/2**70/
5e-324/1e-40, lone surrogates, integers past 4,300 digits, allowed ids past the vocabulary
or 2**18, long stop strings, priorities out of range, unsupported fields, in-flight request
ids reused, truncated and bit-flipped bodies, unknown routes and methods. Unhandled: a 5xx, no
answer, a malformed 200, an error not in OpenAI's shape, an SSE error event. Every 500 cases
a greedy completion must return exactly the text it returned first.
Run: ``python -m bench.fuzz_engine --cases 100000 --seconds 600`` (results/fuzz_engine.*).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from ._common import ROOT, git_commit, utc_now
from .fuzz import Cases

RESULTS = ROOT / "bench" / "results"
MAX_MODEL_LEN = 64
VOCAB = 512  # the tiny preset's
GOOD = b'{"model": "tiny", "prompt": "known good", "max_tokens": 8, "temperature": 0, "ignore_eos": true}'


class EngineCases:
    """OpenAI requests from one seeded generator: (method, path, headers, body)."""

    HOSTILE = ("0", "-1", "1e999", "NaN", "-Infinity", "2147483648", "18446744073709551616",
               "1180591620717411303424", "5e-324", "1e-40", "1e-300", "-0.0", "true", "null", '"12"', "[]", "{}",
               '"\\udc80"', "7" * 5000, '{"a": [1, {"b": null}]}')

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.spoil = Cases(seed + 1)  # the collector fuzzer's JSON values and byte mutations
        self._ids = 0
        self.clean = False  # a case whose every value is valid (so that many are served)

    def value(self, good: str) -> str:
        r = self.rng
        if self.clean or r.random() < 0.8:
            return good
        return r.choice(self.HOSTILE) if r.random() < 0.5 else self.spoil.json_value()

    def pick(self, valid: tuple[str, ...], invalid: tuple[str, ...] = ()) -> str:
        """One of ``valid``, or (in a hostile case, sometimes) one of ``invalid``."""
        r = self.rng
        return r.choice(invalid) if invalid and not self.clean and r.random() < 0.3 else r.choice(valid)

    def text(self, longest: int = 16) -> str:
        r = self.rng
        alphabet = "abc xyz\n\t\"\\é✓日本🙂\u0000\u2028"
        return json.dumps("".join(r.choice(alphabet) for _ in range(r.randint(0, longest))))

    def ids(self, n: int, hi: int = VOCAB) -> str:
        return json.dumps([self.rng.randrange(hi) for _ in range(n)])

    def fields(self, chat: bool) -> dict[str, str]:
        r = self.rng
        stream = r.random() < 0.4
        fields = {
            "model": '"tiny"', "max_tokens": str(r.randint(1, 6)),
            "temperature": self.pick(("0", "0.7", "1.0", "2.0", "1e-6", "1e-40", "5e-324"), ("2.5", "-1e-40")),
            "top_p": self.pick(("1", "0.9", "0.3", "1e-300", "5e-324"), ("0", "-0.0", "1.5")),
            "top_k": self.pick(("-1", "0", "1", "5", "1099511627776"), ("-2",)),
            "min_p": self.pick(("0", "0.1", "1.0", "1e-300"), ("1.1",)),
            "seed": str(r.randrange(-(2**63), 2**64)),
            "stop": self.pick(('"\\n"', json.dumps(["a", "é"]), json.dumps(["x" * 512])),
                              (json.dumps(["x" * 513]), json.dumps(["a", "b", "c", "d", "e"]), '[""]')),
            "stream": "true" if stream else "false",
            "priority": self.pick((str(r.randint(-100, 100)),), ("101", "-101", "2147483648")),
            "ignore_eos": r.choice(("true", "false")),
            "allowed_token_ids": self.pick((self.ids(r.randint(1, 8)), self.ids(VOCAB)),
                                           (self.ids(VOCAB + 1), "[600]", "[]", "[-1]") if r.random() < 0.999
                                           else (self.ids((1 << 18) + 1),)),
            "repetition_penalty": self.pick(("1.0", "1.3", "0.5", "10", str(2.0**-126)), ("1e-40", "10.5")),
            "presence_penalty": self.pick(("0", "1.5", "-2"), ("2.5",)),
            "frequency_penalty": self.pick(("0", "0.5", "-2"), ("-2.1",)),
            "logit_bias": self.pick(("{}",), ('{"5": 10}',)), "n": self.pick(("1",), ("2",)), "extra_field": "1",
        }
        if stream:
            fields["stream_options"] = json.dumps({"include_usage": r.random() < 0.5,
                                                   "continuous_usage_stats": r.random() < 0.5})
        if chat:
            roles = ("system", "user", "assistant", "developer", "tool")
            fields["messages"] = "[" + ", ".join(
                '{"role": %s, "content": %s}' % (self.value(json.dumps(r.choice(roles))), self.value(self.text()))
                for _ in range(r.randint(1, 2))) + "]"
            fields["max_completion_tokens"] = str(r.randint(1, 6))
        else:
            fields["prompt"] = r.choice((self.text(), self.text(), self.ids(r.randint(1, 6)), self.text(300)))
        return fields

    def case(self) -> tuple[str, str, dict[str, str], bytes]:
        r = self.rng
        self.clean = r.random() < 0.35
        roll = r.random()
        chat = roll < 0.47
        path = "/v1/chat/completions" if chat else "/v1/completions"
        method = "POST"
        if roll > 0.95 and not self.clean:
            method, path = r.choice((("POST", "/v1/embeddings"), ("GET", "/v1/completions"),
                                     ("POST", "/v1/models"), ("POST", "/v1/completions/x")))
        keep = {"model": 0.97, "prompt": 0.97, "messages": 0.97}
        body = "{" + ", ".join(f'"{k}": {self.value(v)}' for k, v in self.fields(chat).items()
                               if r.random() < keep.get(k, 0.35)) + "}"
        data = body.encode("utf-8", "surrogatepass")
        if not self.clean and r.random() < 0.1:
            data = self.spoil.mutate(data)
        headers = {"Content-Type": "application/json" if r.random() < 0.95 else "text/plain"}
        if r.random() < 0.1:
            self._ids += 1
            # a few ids repeat while in flight (duplicate_request_id); some are no visible ASCII
            headers["X-Request-Id"] = r.choice((f"fuzz-{self._ids}", "fuzz-shared", "x" * 257, "a b"))
        return method, path, headers, data


def check_answer(status: int, content_type: str, data: bytes) -> str | None:
    """None when the answer is a well-formed 200 or an OpenAI-shaped 4xx; else what is wrong."""
    try:
        if status != 200:
            if not 400 <= status < 500:
                return f"status {status}: {data[:200]!r}"
            error = json.loads(data)["error"]
            if set(error) != {"message", "type", "param", "code"} or not error["message"]:
                return f"status {status} with an error not in OpenAI's shape: {data[:200]!r}"
            return None
        if content_type.startswith("text/event-stream"):
            events = [e for e in data.decode().split("\n\n") if e]
            if events[-1] != "data: [DONE]":
                return f"stream not ended by [DONE]: {events[-1][:200]!r}"
            for event in events[:-1]:
                chunk = json.loads(event.removeprefix("data: "))
                if "error" in chunk:
                    return f"error event: {event[:200]!r}"
            return None
        reply = json.loads(data)
        if [c["finish_reason"] for c in reply["choices"]] not in (["stop"], ["length"]):
            return f"finish reasons {reply['choices']!r}"[:300]
        return None
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        return f"status {status}, malformed body ({type(exc).__name__}): {data[:200]!r}"


class Engine:
    """``sightline engine serve`` on a free port, its output in a log file."""

    def __init__(self, log: Path) -> None:
        from sightline.deploy.processes import free_port

        self.port = free_port()
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sightline.deploy.cli", "engine", "serve", "--model", "tiny", "--device", "cpu",
             "--port", str(self.port), "--kv-cache-gib", "0.05", "--max-model-len", str(MAX_MODEL_LEN),
             "--trace-level", "off", "--log-level", "warning", "--shutdown-timeout", "10"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ, SIGHTLINE_TRACE_LEVEL="off"))
        deadline = time.monotonic() + 180
        while True:
            try:
                if self.request("GET", "/health", {}, b"")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the engine did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)

    def request(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request(method, path, body=body or None, headers=headers)
            response = conn.getresponse()
            return response.status, response.getheader("Content-Type", ""), response.read()
        finally:
            conn.close()

    def server_errors(self) -> float:
        text = self.request("GET", "/metrics", {}, b"")[2].decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("sightline_engine_request_errors_total{") and 'code="5' in line)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


class Client:
    """One keep-alive connection; a connection the server closed is reopened once."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def send(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            try:
                self.conn.request(method, path, body=body, headers=headers)
                response = self.conn.getresponse()
                data = response.read()
                if response.getheader("Connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                return response.status, response.getheader("Content-Type", ""), data
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


def run(engine: Engine, seed: int, cases: int, seconds: float, workers: int) -> dict:
    generator = EngineCases(seed)
    lock = threading.Lock()
    statuses: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    unhandled: list[str] = []
    good_failures: list[str] = []
    first_good = check_answer(*engine.request("POST", "/v1/completions", {"Content-Type": "application/json"}, GOOD))
    assert first_good is None
    good_text = json.loads(engine.request("POST", "/v1/completions", {"Content-Type": "application/json"},
                                          GOOD)[2])["choices"][0]["text"]
    sent = 0
    started = time.monotonic()

    def worker() -> None:
        nonlocal sent
        client = Client(engine.port)
        while True:
            with lock:
                if sent >= cases or time.monotonic() - started > seconds:
                    return
                sent += 1
                number = sent
                method, path, headers, body = generator.case()
            try:
                status, content_type, data = client.send(method, path, headers, body)
                problem = check_answer(status, content_type, data)
            except Exception as exc:  # no answer at all
                status, problem = type(exc).__name__, f"no answer: {exc!r}"[:300]
            with lock:
                statuses[str(status)] += 1
                if problem is not None:
                    unhandled.append(f"case {number}: {problem} <- {body[:300]!r}")
                    outcomes["unhandled"] += 1
                elif status == 200:
                    outcomes["streamed" if content_type.startswith("text/event-stream") else "completed"] += 1
                else:
                    outcomes[f"refused:{json.loads(data)['error']['code']}"] += 1
            if number % 500 == 0:
                reply = client.send("POST", "/v1/completions", {"Content-Type": "application/json"}, GOOD)
                text = json.loads(reply[2])["choices"][0]["text"] if reply[0] == 200 else None
                if text != good_text:
                    with lock:
                        good_failures.append(f"after case {number}: {reply[0]} {reply[2][:200]!r}")

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    cpu0 = time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"cases": sent, "unhandled": len(unhandled), "good_request_failures": len(good_failures),
            "seconds": round(time.monotonic() - started, 1), "client_cpu_s": round(time.process_time() - cpu0, 1),
            "outcomes": dict(sorted(outcomes.items(), key=lambda kv: -kv[1])),
            "statuses": dict(sorted(statuses.items())), "unhandled_samples": unhandled[:10],
            "good_request_samples": good_failures[:5]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=600.0, help="wall seconds at most")
    parser.add_argument("--workers", type=int, default=8, help="concurrent client connections")
    parser.add_argument("--seed", type=int, default=20261203)
    parser.add_argument("--out", type=Path, default=RESULTS / "fuzz_engine")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".log")
    engine = Engine(log)
    try:
        result = run(engine, args.seed, args.cases, args.seconds, args.workers)
        result["server_5xx_counted"] = engine.server_errors()
        result["engine_alive"] = engine.proc.poll() is None
    finally:
        result_exit = engine.stop()
    text = log.read_text()
    result.update(engine_exit_code=result_exit, engine_log_tracebacks=text.count("Traceback"),
                  engine_log_bytes=len(text))
    if not result["engine_log_tracebacks"]:
        log.unlink()  # else kept beside the results, to read
    document = {"benchmark": "fuzz_engine", "git_commit": git_commit(dirty_paths=("engine", "bench/fuzz_engine.py")),
                "date_utc": utc_now(), "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                   "platform": platform.platform()},
                "method": {"seed": args.seed, "max_cases": args.cases, "max_seconds": args.seconds,
                           "workers": args.workers, "max_model_len": MAX_MODEL_LEN}, "result": result}
    args.out.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    refusals = ", ".join(f"{k.split(':', 1)[1]} {v:,}" for k, v in result["outcomes"].items() if k.startswith("refused:"))
    lines = ["# Fuzzing the engine's OpenAI endpoints over HTTP", "",
             f"commit `{document['git_commit']}`, {document['date_utc']}, {os.cpu_count()} CPUs (shared), "
             f"Python {platform.python_version()}; seed {args.seed}; `sightline engine serve --model tiny --device cpu "
             f"--max-model-len {MAX_MODEL_LEN}` in a subprocess, {args.workers} keep-alive client connections.", "",
             "| cases | unhandled | known-good request wrong | completed (JSON) | streamed (SSE) | refusals (4xx) by code "
             "| server 5xx counted | tracebacks in the engine's log | wall s |",
             "|---:|---:|---:|---:|---:|---|---:|---:|---:|",
             f"| {result['cases']:,} | {result['unhandled']} | {result['good_request_failures']} | "
             f"{result['outcomes'].get('completed', 0):,} | {result['outcomes'].get('streamed', 0):,} | {refusals} | "
             f"{result['server_5xx_counted']:.0f} | {result['engine_log_tracebacks']} | {result['seconds']:.0f} |", "",
             f"Statuses: {', '.join(f'{k} {v:,}' for k, v in result['statuses'].items())}. The engine was alive at "
             f"the end: {result['engine_alive']}; it exited {result_exit} on SIGTERM.", "",
             "A case is *unhandled* when the answer is a 5xx, none, a 200 that is not a well-formed completion (JSON "
             "with one choice and a finish reason, or an SSE stream without error events ending with `[DONE]`), or "
             "an error not in OpenAI's shape. Every 500 cases a greedy completion must return the text it returned "
             "before the run.",
             "Command: `python -m bench.fuzz_engine" + "".join(" " + a for a in (sys.argv[1:] if argv is None else argv))
             + "`"]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = (not result["unhandled"] and not result["good_request_failures"] and not result["server_5xx_counted"]
          and not result["engine_log_tracebacks"] and result["engine_alive"] and result_exit == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
