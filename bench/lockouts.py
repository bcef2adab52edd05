"""Can one client lock the others out of a collector? Each attack held against a collector
process at ``ulimit -n 256``, while normal clients export and probe.

    python -m bench.lockouts [--hold-s 30] [--attacks idle_calls,rapid_reset] [--scale 1]

Attacks (``ATTACKS``; each runs in a process of its own, from the normal clients' address,
and reopens what the collector closes): 64 gRPC calls that send HEADERS and no message (8
connections); 200 calls whose answers are never read (SETTINGS_INITIAL_WINDOW_SIZE=0); 300
idle TCP connections to the gRPC port; 1,024 kept-alive connections to each HTTP listener,
authenticated or answered 401; HEADERS + RST_STREAM as fast as one connection takes them.
Normal clients, every ``--every-s``: the OTel SDK's gRPC and HTTP exporters (new exporters,
connecting after the attack began), a Zipkin v2 POST, and ``/healthz`` on a new connection.
Reported per attack: each export's and probe's latency (max, median), failures, what the
collector counted, its descriptors and RSS. ``--scale`` multiplies the attack counts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ._collector import CollectorProcess
from ._common import ROOT, git_commit, utc_now, write_report

__all__ = ["ATTACKS", "Ports", "hold_attack", "probe", "sdk_spans", "start_collector"]

ATTACKS = ("idle_calls", "unread_calls", "idle_tcp", "keepalive", "unauthenticated", "rapid_reset")
TOKEN = "lockouts-bench-token"
TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
RESULTS = ROOT / "bench" / "results"
_REOPEN_PER_S = 100.0  # per listener: the keep-alive attackers hold their connections, not flood


@dataclass(frozen=True)
class Ports:
    grpc: int
    http: int
    zipkin: int
    query: int


# -- the collector under test -------------------------------------------------------------
def start_collector(workdir: Path, nofile: int = 256, extra: tuple[str, ...] = ()) -> tuple[CollectorProcess, Ports]:
    """``sightline collector run`` with RLIMIT_NOFILE ``nofile``, ingest and query auth on."""
    token_file = workdir / "token"
    token_file.write_text(TOKEN)

    def limit_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    collector = CollectorProcess(workdir / "collector.log", ["--auth-token-file", str(token_file), "--query-auth",
                                                              *extra], preexec_fn=limit_fds, ready_timeout_s=60)
    return collector, Ports(**collector.ports)


def _process_facts(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "rss_mib": round(rss / 1024, 1)}


def _refusals(ports: Ports) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{ports.query}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sightline_collector_rejected_total" and sample.value:
                out[f"{sample.labels['receiver']}/{sample.labels['reason']}"] = sample.value
    return out


# -- attacks (each in its own process: ``python -m bench.lockouts --attack NAME``) -----------
class _Sockets:
    """Plain TCP connections from ``source`` that each send ``request`` (if any), read what
    comes back and stay open; one closed by the server is reopened after ``reopen_s``, at
    most ``reopen_per_s`` a second (0: no limit): the attacker holds, it does not flood."""

    def __init__(self, port: int, count: int, request: bytes = b"", reopen_s: float = 1.0,
                 source: str = "127.0.0.1", reopen_per_s: float = 0.0) -> None:
        self.port, self.count, self.request, self.reopen_s = port, count, request, reopen_s
        self.source, self.reopen_per_s = source, reopen_per_s
        self._tokens, self._stamp = 0.0, time.monotonic()
        self.selector = selectors.DefaultSelector()
        self.due: list[float] = [0.0] * count
        self.open = 0
        self.opened = 0
        self.closed_by_server = 0
        self.answered: set[int] = set()  # sockets the server answered or closed at least once

    def step(self, now: float) -> None:
        if self.reopen_per_s:
            self._tokens = min(self.count, self._tokens + (now - self._stamp) * self.reopen_per_s)
            self._stamp = now
        for i, due in enumerate(self.due):
            if due and due <= now:
                if self.reopen_per_s:
                    if self._tokens < 1:
                        break
                    self._tokens -= 1
                self._connect(i, now)
        for key, _ in self.selector.select(0.05):
            sock, i = key.fileobj, key.data
            try:
                data = sock.recv(65_536)
            except OSError:
                data = b""
            self.answered.add(i)
            if not data:
                self.selector.unregister(sock)
                sock.close()
                self.open -= 1
                self.closed_by_server += 1
                self.due[i] = now + self.reopen_s

    def _connect(self, i: int, now: float) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=1,
                                            source_address=(self.source, 0))
            if self.request:
                sock.sendall(self.request)
        except OSError:
            self.due[i] = now + self.reopen_s
            return
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ, i)
        self.due[i] = 0.0
        self.open += 1
        self.opened += 1

    def start(self) -> None:
        now = time.monotonic()
        for i in range(self.count):
            self._connect(i, now)


def _attack_sockets(groups: list[_Sockets], stop: threading.Event, ready) -> dict:
    """Holds the groups' sockets; ``ready()`` once the collector has dealt with every socket of
    the first wave (answered or closed it), so what follows measures the attack held, not its
    opening burst."""
    for group in groups:
        group.start()
    first_wave = time.monotonic() + 30
    waiting = True
    while not stop.is_set():
        now = time.monotonic()
        for group in groups:
            group.step(now)
        if waiting and (all(len(g.answered) >= g.count or not g.request for g in groups) or now > first_wave):
            waiting = False
            ready()
    if waiting:
        ready()
    return {"held_at_end": [g.open for g in groups], "opened": [g.opened for g in groups],
            "closed_by_server": [g.closed_by_server for g in groups]}


def _http_request(method: str, path: str, body: bytes, token: str | None, content_type: str) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: collector\r\nContent-Type: {content_type}\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _attack_calls(ports: Ports, stop: threading.Event, ready, *, calls: int, connections: int,
                  window: int | None, message: bytes | None) -> dict:
    """``calls`` calls over ``connections`` held open: HEADERS only (``message`` None) or
    whole calls whose answers are not read (``window`` 0); ended ones are opened again."""
    from .h2_raw import RawH2, grpc_frame

    per = calls // connections
    conns: list[RawH2 | None] = [None] * connections
    streams: list[list[int]] = [[] for _ in range(connections)]
    opened = ended = reconnects = 0

    def fill(k: int) -> None:
        nonlocal opened
        conn = conns[k]
        while len(streams[k]) < per and not conn.closed:
            try:
                stream_id = conn.open(TRACE_EXPORT)
                if message is not None:
                    conn.send(stream_id, grpc_frame(message))
            except Exception:  # the server closed it meanwhile: reopened next round
                return
            streams[k].append(stream_id)
            opened += 1

    for k in range(connections):
        conns[k] = RawH2(ports.grpc, window=window, token=TOKEN)
        fill(k)
    ready()
    while not stop.wait(0.05):
        for k in range(connections):
            conn = conns[k]
            if conn.closed:
                conn.close()
                conns[k] = RawH2(ports.grpc, window=window, token=TOKEN)
                streams[k] = []
                reconnects += 1
            else:
                with conn.lock:
                    alive = [s for s in streams[k] if not conn.streams[s].ended]
                ended += len(streams[k]) - len(alive)
                streams[k] = alive
            fill(k)
    return {"calls_opened": opened, "calls_ended_by_server": ended, "reconnects": reconnects}


def _attack_rapid_reset(ports: Ports, stop: threading.Event, ready) -> dict:
    from .h2_raw import RawH2

    resets = connections = goaways = 0
    conn = RawH2(ports.grpc, token=TOKEN)
    connections = 1
    ready()
    while not stop.is_set():
        if conn.open_and_reset():
            resets += 1
            continue
        goaways += conn.goaway_code is not None
        conn.close()
        conn = RawH2(ports.grpc, token=TOKEN)  # straight back
        connections += 1
    conn.close()
    return {"resets_sent": resets, "connections": connections, "goaways": goaways}


def run_attack(name: str, ports: Ports, stop: threading.Event, ready, scale: float = 1.0) -> dict:
    """Holds attack ``name`` until ``stop`` is set; ``ready()`` once it is in place."""
    n = lambda count: max(1, round(count * scale))  # noqa: E731
    if name == "idle_calls":
        return _attack_calls(ports, stop, ready, calls=n(64), connections=8, window=None, message=None)
    if name == "unread_calls":
        return _attack_calls(ports, stop, ready, calls=n(200), connections=8, window=0, message=b"")
    if name == "idle_tcp":
        return _attack_sockets([_Sockets(ports.grpc, n(300))], stop, ready)
    if name in ("keepalive", "unauthenticated"):
        token = TOKEN if name == "keepalive" else None
        requests = [(ports.http, _http_request("POST", "/v1/traces", b"", token, "application/x-protobuf")),
                    (ports.zipkin, _http_request("POST", "/api/v2/spans", b"[]", token, "application/json")),
                    (ports.query, _http_request("GET", "/healthz" if token else "/api/v1/heatmap?gpu=x", b"",
                                                None, "text/plain"))]
        # unauthenticated clients come from another address than the normal ones: the
        # collector blocks an address for a while once it fails authentication too often
        source = "127.0.0.1" if token else "127.0.0.2"
        return _attack_sockets([_Sockets(port, n(1024), request, source=source, reopen_per_s=_REOPEN_PER_S)
                                for port, request in requests], stop, ready)
    if name == "rapid_reset":
        return _attack_rapid_reset(ports, stop, ready)
    raise ValueError(f"attack {name!r} is not one of {', '.join(ATTACKS)}")


def _attack_process(name: str, ports: Ports, scale: float) -> None:
    """The attacker process: prints "holding" once the attack is in place, holds it until its
    stdin closes, then prints its summary as JSON."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    summary = run_attack(name, ports, stop, lambda: print("holding", flush=True), scale)
    print(json.dumps(summary), flush=True)


class hold_attack:
    """``with hold_attack(name, ports):`` runs the attacker process for the block's length;
    ``.summary`` is what it reported."""

    def __init__(self, name: str, ports: Ports, scale: float = 1.0, settle_s: float = 1.5) -> None:
        self.name, self.ports, self.scale, self.settle_s = name, ports, scale, settle_s
        self.summary: dict = {}

    def __enter__(self) -> "hold_attack":
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.lockouts", "--attack", self.name, "--scale", str(self.scale),
             "--ports", ",".join(str(p) for p in (self.ports.grpc, self.ports.http, self.ports.zipkin,
                                                   self.ports.query))],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        if line.strip() != "holding":
            raise RuntimeError(f"attack {self.name} did not start: {line!r}")
        time.sleep(self.settle_s)  # the collector has seen it (and any reopening) for a while
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.process.communicate("", timeout=60)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        self.summary = json.loads(lines[-1]) if lines else {"error": out[-500:]}


# -- normal clients ------------------------------------------------------------------------
def sdk_spans(count: int) -> list:
    """``count`` finished spans from the OTel SDK (fresh ids each call)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "lockouts-probe"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("lockouts")
    for i in range(count):
        with tracer.start_as_current_span("probe", attributes={"i": i}):
            pass
    return list(memory.get_finished_spans())


def _zipkin_body(count: int) -> bytes:
    now_us = int(time.time() * 1e6)
    spans = [{"traceId": os.urandom(16).hex(), "id": os.urandom(8).hex(), "name": "probe",
              "timestamp": now_us, "duration": 100, "localEndpoint": {"serviceName": "lockouts-probe"}}
             for _ in range(count)]
    return json.dumps(spans).encode()


def probe(ports: Ports, seconds: float, every_s: float = 0.25, spans: int = 20) -> dict:
    """Exports through every receiver and gets /healthz every ``every_s`` for ``seconds``;
    each one's latency in seconds, and what failed."""
    import requests
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    auth = {"authorization": f"Bearer {TOKEN}"}
    grpc_exporter = GrpcExporter(endpoint=f"127.0.0.1:{ports.grpc}", insecure=True, headers=auth, timeout=10)
    http_exporter = HttpExporter(endpoint=f"http://127.0.0.1:{ports.http}/v1/traces", headers=auth, timeout=10)
    zipkin = requests.Session()
    latencies: dict[str, list[float]] = {"otlp_grpc": [], "otlp_http": [], "zipkin": [], "healthz": []}
    failures: list[str] = []

    def timed(kind: str, call) -> None:
        started = time.perf_counter()
        try:
            ok, what = call()
        except Exception as exc:  # a failure is a result here
            ok, what = False, f"{type(exc).__name__}: {exc}"[:200]
        latencies[kind].append(time.perf_counter() - started)
        if not ok:
            failures.append(f"{kind}: {what}")

    def healthz():
        with urllib.request.urlopen(f"http://127.0.0.1:{ports.query}/healthz", timeout=10) as response:
            return response.status == 200, response.status

    def zipkin_post(body: bytes):
        response = zipkin.post(f"http://127.0.0.1:{ports.zipkin}/api/v2/spans", data=body,
                               headers={"Content-Type": "application/json", **auth}, timeout=10)
        return response.status_code == 202, response.status_code

    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            round_start = time.monotonic()
            batches = sdk_spans(spans), sdk_spans(spans), _zipkin_body(spans)  # made outside the timings
            timed("healthz", healthz)
            timed("otlp_grpc", lambda: (lambda r: (r == SpanExportResult.SUCCESS, r))(
                grpc_exporter.export(batches[0])))
            timed("otlp_http", lambda: (lambda r: (r == SpanExportResult.SUCCESS, r))(
                http_exporter.export(batches[1])))
            timed("zipkin", lambda: zipkin_post(batches[2]))
            time.sleep(max(0.0, every_s - (time.monotonic() - round_start)))
    finally:
        grpc_exporter.shutdown()
        http_exporter.shutdown()
        zipkin.close()
    return {"latencies_s": latencies, "failures": failures}


def _summary(values: list[float]) -> str:
    """median / p99 / max in ms, and how many took over 1 s."""
    if not values:
        return "-"
    ordered = sorted(values)
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    over = sum(v > 1.0 for v in ordered)
    return (f"{1e3 * statistics.median(ordered):.1f} / {1e3 * p99:.0f} / {1e3 * ordered[-1]:.0f}"
            + (f" ({over} > 1 s)" if over else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--hold-s", type=float, default=30.0, help="how long normal clients probe under each")
    parser.add_argument("--every-s", type=float, default=0.25)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the attacks' counts")
    parser.add_argument("--nofile", type=int, default=256)
    parser.add_argument("--out", type=Path, default=RESULTS / "lockouts")
    parser.add_argument("--attack", help=argparse.SUPPRESS)  # the attacker process
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.attack:
        _attack_process(args.attack, Ports(*(int(p) for p in args.ports.split(","))), args.scale)
        return
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        collector, ports = start_collector(Path(tmp), args.nofile)
        try:
            for name in args.attacks.split(","):
                with hold_attack(name, ports, args.scale) as attack:
                    seen = probe(ports, args.hold_s, args.every_s)
                    facts = _process_facts(collector.pid)
                results[name] = {**seen, **facts, "attack": attack.summary, "refusals": _refusals(ports),
                                 "load_avg_1m": os.getloadavg()[0]}
                print(name, json.dumps({k: v for k, v in results[name].items() if k != "latencies_s"}),
                      flush=True)
        finally:
            collector.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"commit": git_commit(), "when": utc_now(),
                                                          "args": {k: str(v) for k, v in vars(args).items()},
                                                          "results": results}, indent=1))
    lines = [f"# Lockouts: each attack held {args.hold_s:.0f} s against a collector at ulimit -n {args.nofile}",
             "", f"commit `{git_commit()}`, {utc_now()}, {os.cpu_count()} CPUs (shared with other work: the load "
             f"average is the machine's at each attack's end); attack counts x{args.scale}; normal clients every "
             f"{args.every_s} s, each export of 20 spans; latency median / p99 / max in ms.", "",
             "| attack | OTLP/gRPC export | OTLP/HTTP export | Zipkin export | /healthz | failures | "
             "collector fds | RSS MiB | load | what the collector counted (receiver/reason: n) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, result in results.items():
        lat = result["latencies_s"]
        refusals = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(result["refusals"].items()))
        lines.append(f"| {name} | {_summary(lat['otlp_grpc'])} | {_summary(lat['otlp_http'])} | "
                     f"{_summary(lat['zipkin'])} | {_summary(lat['healthz'])} | {len(result['failures'])} | "
                     f"{result['fds']} | {result['rss_mib']} | {result['load_avg_1m']:.1f} | {refusals} |")
    lines += ["", "Counts are cumulative over the run (the attacks ran in the order listed). What each "
              "attacker saw is in the .json (`attack`)."]
    write_report(args.out, "lockouts", argv, lines)


if __name__ == "__main__":
    main()
