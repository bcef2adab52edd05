"""Fuzzes every receiver of a real collector, and the engine's request parser, with
generated hostile requests: each case must get a protocol refusal or an acknowledgement,
be counted as what it got, and leave the next known-good batch counted exactly.

Targets (``TARGETS``): the OTLP/HTTP (protobuf and JSON), Zipkin and OTLP/gRPC receivers of
one collector on loopback ports (in this process, its event loop on a thread), and in-process
the engine's request parsers and the exponential-histogram point check. Cases come from a
seeded ``random.Random`` (``Cases``): valid requests and every way to spoil them.
A case is "unhandled" when the answer is a 5xx other than 503, gRPC INTERNAL/UNKNOWN, or
none; at the end, everything acknowledged was processed, and every span counted as
received is aggregated or counted as a duplicate.

Run: ``.venv/bin/python -m bench.fuzz --cases 100000`` (or ``--seconds`` per target);
results: bench/results/fuzz.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import http.client
import json
import os
import platform
import random
import sys
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

from ._common import ROOT, git_commit, utc_now

RESULTS = ROOT / "bench" / "results"
TARGETS = ("otlp_http_protobuf", "otlp_http_json", "zipkin", "otlp_grpc", "engine_parser", "point_validator")
TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
MAX_REQUEST = 256 * 1024
MAX_INFLATED = 1024 * 1024
_DUPLICATES = ("sightline_collector_dropped_total", "duplicate")


# -- generators --------------------------------------------------------------------------------
class Cases:
    """Hostile requests from one seeded generator; ``fresh_*`` are the known-good batches."""

    # Valid requests with ids of every length, bit flips and truncations of valid encodings,
    # random bytes, JSON nested up to 100,000 deep, NaN/Infinity/1e999/2**70/year-3000
    # numbers, lone surrogates and invalid UTF-8, wrong types in every field, unknown fields,
    # gzip with many members, truncated gzip, decompression bombs, unknown encodings and
    # content types, repeated spans, corrupt exponential-histogram points, metrics of unknown
    # names and unsupported types.

    NUMBERS = ("0", "-1", "1.5", "1e30", "-1e30", "1e999", "NaN", "Infinity", "-Infinity", "2147483648",
               "9223372036854775807", "9223372036854775808", "18446744073709551616", "1180591620717411303424",
               "32503680000000000", "-0", "5e-324", "true", "null", '"12"', "[]", "{}")
    STRINGS = ('"ok"', '""', '"\\udc80"', '"a\\ud800b"', '"\\ud83d\\ude00"', '"\\u0000"', '"' + "x" * 300 + '"',
               '"k\\u00e9rnel"', '"\\udfff\\udfff"')

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self._seed = seed
        self._fresh = 0
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.Traces, self.Metrics = ExportTraceServiceRequest, ExportMetricsServiceRequest

    # ids and values
    def hex_id(self) -> str:
        r = self.rng
        choice = r.random()
        if choice < 0.5:
            width = r.choice((16, 32))
            return "%0*x" % (width, r.getrandbits(4 * width) | 1)
        return r.choice(["", "0" * 16, "0" * 32, "01 23 45 67 89ab", "0x23456789abcdef", "+123456789abcdef",
                         "0123456789ABCDEF", "zz23456789abcdef", "%x" % r.getrandbits(r.randint(1, 200)),
                         "0123456789abcdef0", "0123456789abcde"])

    def json_value(self, depth: int = 0) -> str:
        r = self.rng
        roll = r.random()
        if roll < 0.35 or depth > 3:
            return r.choice(self.NUMBERS if r.random() < 0.5 else self.STRINGS)
        if roll < 0.45:
            n = r.choice((70, 5000, 100_000))
            return "[" * n + "]" * n
        if roll < 0.7:
            return "[" + ", ".join(self.json_value(depth + 1) for _ in range(r.randint(0, 3))) + "]"
        keys = ('"a"', '"\\udc80"', '"traceId"', '"value"', '"stringValue"', '"kvlistValue"')
        return "{" + ", ".join(f"{r.choice(keys)}: {self.json_value(depth + 1)}" for _ in range(r.randint(0, 3))) + "}"

    def field(self, good: str) -> str:
        return good if self.rng.random() < 0.6 else self.json_value()

    # requests
    def trace_request(self, n: int, bad_ids: bool) -> bytes:
        r = self.rng
        request = self.Traces()
        scope = request.resource_spans.add().scope_spans.add()
        for i in range(n):
            span = scope.spans.add(name=r.choice(("decode", "engine.step", "", "x" * 50)), kind=r.randint(0, 6),
                                   start_time_unix_nano=r.getrandbits(64), end_time_unix_nano=r.getrandbits(64))
            span.trace_id = r.getrandbits(128).to_bytes(16, "big")
            span.span_id = r.getrandbits(64).to_bytes(8, "big")
            if bad_ids and r.random() < 0.3:
                if r.random() < 0.5:
                    span.trace_id = bytes(r.choice((0, 3, 8, 15, 17, 40))) if r.random() < 0.3 else \
                        r.randbytes(r.choice((0, 3, 8, 15, 17, 40)))
                else:
                    span.span_id = r.randbytes(r.choice((0, 4, 7, 9, 16))) if r.random() < 0.7 else bytes(8)
            if r.random() < 0.3:
                span.parent_span_id = r.randbytes(r.choice((8, 8, 3, 16)))
            span.attributes.add(key=r.choice(("gen_ai.request.model", "\u00e9", "")),
                                value={"string_value": r.choice(("m", "", "\u2603"))})
        return request.SerializeToString()

    def metrics_request(self) -> bytes:
        from opentelemetry.proto.metrics.v1 import metrics_pb2

        r = self.rng
        request = self.Metrics()
        scope = request.resource_metrics.add().scope_metrics.add()
        metric = scope.metrics.add(name=r.choice(("gpu.kernel.cta.duration", "http.server.duration", "")))
        kind = r.random()
        if kind < 0.6:
            for _ in range(r.randint(0, 4)):
                point = self.exp_point(metrics_pb2)
                metric.exponential_histogram.data_points.append(point)
            metric.exponential_histogram.aggregation_temporality = r.randint(0, 2)
        elif kind < 0.8:
            for i in range(r.randint(0, 50)):
                metric.gauge.data_points.add(as_double=r.random(), time_unix_nano=i)
        else:
            for i in range(r.randint(0, 5)):
                metric.histogram.data_points.add(count=1, bucket_counts=[1, 0], explicit_bounds=[1e-5])
        return request.SerializeToString()

    def exp_point(self, metrics_pb2):
        r = self.rng
        counts = [r.choice((0, 1, 5, 1000, 2**40, 2**63, 2**64 - 1)) if r.random() < 0.2 else r.randint(0, 9)
                  for _ in range(r.randint(0, 30))]
        zero = r.choice((0, 0, 1, 2**63))
        honest = sum(counts) + zero
        point = metrics_pb2.ExponentialHistogramDataPoint(
            scale=r.choice((-20, -10, 0, 4, 8, 20, 21)), zero_count=zero,
            count=honest % 2**64 if r.random() < 0.7 else r.getrandbits(64),
            sum=r.choice((1e-3, float("nan"), float("inf"), -1.0, 0.0)),
            time_unix_nano=int(time.time() * 1e9) if r.random() < 0.8 else r.getrandbits(64))
        point.positive.offset = r.choice((-2000, -1100, -900, 0, 2**31 - 1, -(2**31)))
        point.positive.bucket_counts.extend(counts)
        for key, value in (("gpu.id", "0"), ("gpu.sm.id", str(r.randint(0, 131))), ("cuda.kernel.name", "fuzz")):
            if r.random() < 0.95:
                point.attributes.add(key=key, value={"string_value": value})
        if r.random() < 0.3:
            point.exemplars.add(as_double=r.choice((1e-5, float("nan"))), trace_id=r.randbytes(r.choice((16, 3))),
                                span_id=r.randbytes(8))
        return point

    def mutate(self, data: bytes) -> bytes:
        r = self.rng
        if not data:
            return r.randbytes(r.randint(0, 64))
        roll = r.random()
        at = r.randrange(len(data))
        if roll < 0.3:
            return data[:at]
        if roll < 0.6:
            return data[:at] + bytes([data[at] ^ (1 << r.randrange(8))]) + data[at + 1:]
        if roll < 0.8:
            return data[:at] + r.randbytes(r.randint(1, 8)) + data[at:]
        return data[:at] + data[at:at + r.randint(1, 40)] * r.randint(2, 4) + data[at:]

    def encode(self, body: bytes) -> tuple[bytes, dict[str, str]]:
        """Maybe compressed, maybe damaged, maybe a bomb; with its Content-Encoding header."""
        r = self.rng
        roll = r.random()
        if roll < 0.6:
            return body, {}
        if roll < 0.7:
            return gzip.compress(body) * r.choice((1, 2)), {"Content-Encoding": "gzip"}
        if roll < 0.75:
            return gzip.compress(b"") * r.randint(1000, 20_000) + gzip.compress(body), {"Content-Encoding": "gzip"}
        if roll < 0.8:
            return gzip.compress(body)[: r.randint(0, 30)], {"Content-Encoding": "gzip"}
        if roll < 0.85:
            return zlib.compress(body), {"Content-Encoding": r.choice(("deflate", "DEFLATE"))}
        if roll < 0.9:
            return gzip.compress(b"\0" * 4096) * r.randint(300, 3000), {"Content-Encoding": "gzip"}  # bomb
        if roll < 0.95:
            return body, {"Content-Encoding": r.choice(("br", "zstd", "gzip, br", "\u00e9"))}
        return self.mutate(gzip.compress(body)), {"Content-Encoding": "x-gzip"}

    def otlp_protobuf(self) -> tuple[str, dict[str, str], bytes]:
        r = self.rng
        roll = r.random()
        if roll < 0.25:
            path, body = "/v1/metrics", self.metrics_request()
        else:
            path, body = "/v1/traces", self.trace_request(r.randint(0, 8), bad_ids=r.random() < 0.5)
        if r.random() < 0.5:
            body = self.mutate(body)
        elif r.random() < 0.1:
            body = r.randbytes(r.randint(0, 2000)) if r.random() < 0.7 else b"\x0a\x00" * (MAX_INFLATED // 2 + 1)
        body, headers = self.encode(body)
        headers["Content-Type"] = r.choice(("application/x-protobuf",) * 8 + ("application/protobuf", "text/plain"))
        return path, headers, body

    def otlp_json(self) -> tuple[str, dict[str, str], bytes]:
        r = self.rng
        spans = ", ".join(
            "{" + ", ".join(f'"{k}": {v}' for k, v in (
                ("traceId", self.field(json.dumps(self.hex_id()))), ("spanId", self.field(json.dumps(self.hex_id()))),
                ("name", self.field('"decode"')), ("kind", self.field("1")),
                ("startTimeUnixNano", self.field('"1700000000000000000"')),
                ("attributes", self.field('[{"key": "k", "value": ' + self.field('{"stringValue": "v"}') + "}]")))
                if r.random() < 0.9) + "}" for _ in range(r.randint(0, 4)))
        document = r.choice((
            '{"resourceSpans": [{"scopeSpans": [{"spans": [%s]}]}]}' % spans,
            '{"resourceSpans": %s}' % self.json_value(), self.json_value(),
            '{"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"name": %s, "gauge": {"dataPoints": [%s]}}]}]}]}'
            % (self.field('"gpu.kernel.cta.duration"'), self.field('{"asDouble": 1.5}'))))
        body = document.encode("utf-8", "surrogatepass")
        if r.random() < 0.05:
            body = body[: r.randint(0, len(body))] + b"\xff\xfe"
        body, headers = self.encode(body)
        headers["Content-Type"] = "application/json"
        return ("/v1/metrics" if "resourceMetrics" in document else "/v1/traces"), headers, body

    def zipkin(self) -> tuple[str, dict[str, str], bytes]:
        r = self.rng
        fields = (("traceId", lambda: json.dumps(self.hex_id())), ("id", lambda: json.dumps(self.hex_id())[:18] + '"'
                                                                          if r.random() < 0.1 else json.dumps(self.hex_id())),
                  ("parentId", lambda: json.dumps(self.hex_id())), ("name", lambda: self.field('"get"')),
                  ("kind", lambda: self.field('"SERVER"')), ("timestamp", lambda: self.field("1700000000000000")),
                  ("duration", lambda: self.field("25")),
                  ("localEndpoint", lambda: self.field('{"serviceName": %s, "ipv4": "10.0.0.1", "port": %s}'
                                                       % (self.field('"svc"'), self.field("80")))),
                  ("tags", lambda: self.field('{"http.method": %s}' % self.field('"GET"'))),
                  ("annotations", lambda: self.field('[{"timestamp": %s, "value": %s}]'
                                                     % (self.field("1"), self.field('"ws"')))))
        spans = ", ".join("{" + ", ".join(f'"{k}": {make()}' for k, make in fields if r.random() < 0.85) + "}"
                          for _ in range(r.randint(0, 4)))
        document = f"[{spans}]" if r.random() < 0.9 else self.json_value()
        body, headers = self.encode(document.encode("utf-8", "surrogatepass"))
        headers["Content-Type"] = r.choice(("application/json",) * 9 + ("application/x-protobuf",))
        return "/api/v2/spans", headers, body

    def grpc(self) -> tuple[str, bytes]:
        r = self.rng
        if r.random() < 0.25:
            path, body = METRICS_EXPORT, self.metrics_request()
        else:
            path, body = TRACE_EXPORT, self.trace_request(r.randint(0, 8), bad_ids=r.random() < 0.5)
        roll = r.random()
        if roll < 0.5:
            body = self.mutate(body)
        elif roll < 0.53:
            body = b"\x0a\x00" * (MAX_INFLATED // 2 + 1)  # over the message limit
        elif roll < 0.6:
            body = r.randbytes(r.randint(0, 500))
        return path, body

    def engine_body(self) -> tuple[bytes, bool]:
        r = self.rng
        chat = r.random() < 0.5
        fields = [("model", self.field('"tiny"')), ("max_tokens", self.field("4")), ("temperature", self.field("0.5")),
                  ("top_p", self.field("1")), ("seed", self.field("7")), ("stop", self.field('["\\n"]')),
                  ("stream", self.field("false")), ("priority", self.field("0")), ("logit_bias", self.field("{}"))]
        if chat:
            fields.append(("messages", self.field('[{"role": %s, "content": %s}]'
                                                  % (self.field('"user"'), self.field('"hi"')))))
        else:
            fields.append(("prompt", self.field(r.choice(('"hello"', "[1, 2, 3]", '"\\udc80"')))))
        body = "{" + ", ".join(f'"{k}": {v}' for k, v in fields if r.random() < 0.9) + "}"
        data = body.encode("utf-8", "surrogatepass")
        return (self.mutate(data) if r.random() < 0.1 else data), chat

    # the known-good batches
    def fresh_ids(self) -> list[tuple[bytes, bytes]]:
        self._fresh += 1
        trace_id = (0xAA << 120 | (self._seed % 2**56) << 64 | self._fresh).to_bytes(16, "big")
        return [(trace_id, (self._fresh * 4 + i + 1).to_bytes(8, "big")) for i in range(3)]

    def fresh_protobuf(self) -> bytes:
        request = self.Traces()
        scope = request.resource_spans.add().scope_spans.add()
        for trace_id, span_id in self.fresh_ids():
            scope.spans.add(trace_id=trace_id, span_id=span_id, name="decode", start_time_unix_nano=1,
                            end_time_unix_nano=2)
        return request.SerializeToString()

    def fresh_zipkin(self) -> bytes:
        return json.dumps([{"traceId": t.hex(), "id": s.hex(), "name": "get", "timestamp": 1, "duration": 1}
                           for t, s in self.fresh_ids()]).encode()


# -- running ---------------------------------------------------------------------------------------
class Tally:
    def __init__(self, target: str) -> None:
        self.target = target
        self.cases = 0
        self.outcomes: Counter[str] = Counter()  # "accepted" or "refused:<reason>"
        self.statuses: Counter[str] = Counter()
        self.unhandled: list[str] = []
        self.miscounted: list[str] = []
        self.good_batch_failures: list[str] = []
        self.point_drops: Counter[str] = Counter()
        self.seconds = self.cpu_s = 0.0

    def to_dict(self) -> dict:
        return {"cases": self.cases, "unhandled": len(self.unhandled), "miscounted": len(self.miscounted),
                "good_batch_failures": len(self.good_batch_failures), "seconds": round(self.seconds, 1),
                "cpu_s": round(self.cpu_s, 1), "outcomes": dict(sorted(self.outcomes.items())),
                "statuses": dict(sorted(self.statuses.items())),
                "aggregator_point_drops": dict(sorted(self.point_drops.items())),
                "unhandled_samples": self.unhandled[:5], "miscounted_samples": self.miscounted[:5],
                "good_batch_samples": self.good_batch_failures[:5]}


class FuzzCollector:
    """A collector on loopback ports, its loop on a thread; counters read in-process."""

    def __init__(self) -> None:
        from sightline.collector.app import Collector
        from sightline.collector.config import CollectorConfig

        config = CollectorConfig(otlp_grpc_address="127.0.0.1:0", otlp_http_address="127.0.0.1:0",
                                 zipkin_address="127.0.0.1:0", http_address="127.0.0.1:0",
                                 auth_token_env="SIGHTLINE_FUZZ_TOKEN_NEVER_SET", max_request_bytes=MAX_REQUEST,
                                 max_decompressed_bytes=MAX_INFLATED, queue_max_items=1_000_000,
                                 queue_max_bytes=512 * 1024 * 1024, header_timeout_s=30)
        self.loop = asyncio.new_event_loop()
        self.collector = Collector(config)
        self.ports = self.loop.run_until_complete(self.collector.start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def counters(self) -> dict:
        return self.collector.metrics.snapshot()

    def point_drops(self) -> dict[str, int]:
        return dict(self.collector.aggregator.dropped)

    def stop(self):
        summary = asyncio.run_coroutine_threadsafe(self.collector.stop(), self.loop).result(120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        return summary


def _moves(before: dict, after: dict, receiver: str) -> tuple[list[str], float]:
    """(refusal reasons whose counter moved, with repeats by amount; spans+points received)."""
    reasons: list[str] = []
    received = 0.0
    for key, value in after.items():
        delta = value - before.get(key, 0.0)
        if not delta or receiver not in key:
            continue
        if key[0].startswith("sightline_collector_rejected"):
            reasons += [key[2]] * int(delta)
        elif "received" in key[0]:
            received += delta
    return reasons, received


class HttpClient:
    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> int:
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                self.conn.request("POST", path, body=body, headers=headers)
                response = self.conn.getresponse()
                response.read()
                if response.getheader("Connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                return response.status
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


def run_receiver(target: str, col: FuzzCollector, cases: Cases, n: int, seconds: float) -> Tally:
    import grpc

    tally = Tally(target)
    receiver = {"otlp_grpc": "otlp_grpc", "zipkin": "zipkin"}.get(target, "otlp_http")
    port = {"zipkin": col.ports.zipkin}.get(target, col.ports.otlp_http)
    client = HttpClient(port)
    channel = grpc.insecure_channel(f"127.0.0.1:{col.ports.otlp_grpc}",
                                    options=[("grpc.max_send_message_length", 8 * MAX_INFLATED)])
    calls = {TRACE_EXPORT: channel.unary_unary(TRACE_EXPORT), METRICS_EXPORT: channel.unary_unary(METRICS_EXPORT)}

    def send_case() -> tuple[str, str]:
        """(status label, kind: ok | refused | unhandled)."""
        try:
            if target == "otlp_grpc":
                path, body = cases.grpc()
                try:
                    calls[path](body, timeout=60)
                    return "OK", "ok"
                except grpc.RpcError as error:
                    code = error.code()
                    return code.name, "unhandled" if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) \
                        else "refused"
            path, headers, body = {"otlp_http_protobuf": cases.otlp_protobuf, "otlp_http_json": cases.otlp_json,
                                   "zipkin": cases.zipkin}[target]()
            status = client.post(path, body, headers)
            kind = "ok" if status < 300 else "refused" if status < 500 or status == 503 else "unhandled"
            return str(status), kind
        except Exception as exc:  # no response at all
            return type(exc).__name__, "unhandled"

    def send_good() -> bool:
        if target == "otlp_grpc":
            try:
                calls[TRACE_EXPORT](cases.fresh_protobuf(), timeout=60)
                return True
            except grpc.RpcError:
                return False
        if target == "zipkin":
            return client.post("/api/v2/spans", cases.fresh_zipkin(), {"Content-Type": "application/json"}) == 202
        return client.post("/v1/traces", cases.fresh_protobuf(), {"Content-Type": "application/x-protobuf"}) == 200

    started, cpu0 = time.monotonic(), time.process_time()
    drops0 = col.point_drops()
    # Per case, the collector's counters before and after: a 2xx must move no refusal
    # counter, a refusal exactly one rejected_total{reason} by 1; then a known-good batch
    # (3 spans with fresh ids) must be acknowledged and counted exactly.
    while tally.cases < n and time.monotonic() - started < seconds:
        before = col.counters()
        status, kind = send_case()
        after = col.counters()
        reasons, _ = _moves(before, after, receiver)
        tally.cases += 1
        tally.statuses[status] += 1
        if kind == "unhandled":
            tally.unhandled.append(f"case {tally.cases}: {status}")
        elif kind == "ok" and reasons:
            tally.miscounted.append(f"case {tally.cases}: {status} but refusals counted {reasons}")
        elif kind == "refused" and len(reasons) != 1:
            tally.miscounted.append(f"case {tally.cases}: {status} with refusals counted {reasons}")
        tally.outcomes["accepted" if kind == "ok" else f"refused:{reasons[0]}" if len(reasons) == 1
                       else "unhandled" if kind == "unhandled" else "miscounted"] += 1
        ok = send_good()
        final = col.counters()
        good_reasons, received = _moves(after, final, receiver)
        repeats = final.get(_DUPLICATES, 0.0) - after.get(_DUPLICATES, 0.0)
        if not ok or received != 3 or good_reasons or repeats:
            tally.good_batch_failures.append(f"after case {tally.cases}: ok={ok} received={received} "
                                             f"refused={good_reasons} counted as duplicates={repeats}")
    tally.seconds, tally.cpu_s = time.monotonic() - started, time.process_time() - cpu0
    drops1 = col.point_drops()
    tally.point_drops.update({k: v - drops0.get(k, 0) for k, v in drops1.items() if v - drops0.get(k, 0)})
    channel.close()
    return tally


def run_in_process(target: str, cases: Cases, n: int, seconds: float) -> Tally:
    from opentelemetry.proto.metrics.v1 import metrics_pb2

    from sightline.collector.otlp_points import cta_point_histogram
    from sightline.collector.point_check import PointRefused
    from sightline.engine.openai_protocol import ProtocolError, parse_chat_request, parse_completion_request, \
        parse_json

    tally = Tally(target)
    started, cpu0 = time.monotonic(), time.process_time()
    while tally.cases < n and time.monotonic() - started < seconds:
        tally.cases += 1
        try:
            if target == "engine_parser":
                body, chat = cases.engine_body()
                try:
                    parsed = parse_json(body)
                    request = parse_chat_request(parsed) if chat else parse_completion_request(parsed)
                    for text in [request.model, *request.stop,
                                 *([m.content for m in request.messages] if chat else
                                   [request.prompt] if isinstance(request.prompt, str) else [])]:
                        text.encode("utf-8")
                    tally.outcomes["accepted"] += 1
                except ProtocolError as error:
                    assert 400 <= error.status < 500
                    tally.outcomes[f"refused:{error.code or error.type}"] += 1
            else:
                try:
                    cta_point_histogram(cases.exp_point(metrics_pb2), 160)
                    tally.outcomes["accepted"] += 1
                except PointRefused as refused:
                    tally.outcomes[f"refused:{refused.reason}"] += 1
        except Exception as exc:
            tally.unhandled.append(f"case {tally.cases}: {type(exc).__name__}: {exc}"[:300])
            tally.outcomes["unhandled"] += 1
    tally.seconds, tally.cpu_s = time.monotonic() - started, time.process_time() - cpu0
    return tally


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--cases", type=int, default=100_000, help="cases per target (at most)")
    parser.add_argument("--seconds", type=float, default=600.0, help="wall seconds per target (at most)")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--out", type=Path, default=RESULTS / "fuzz")
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    col = FuzzCollector()
    tallies: dict[str, Tally] = {}
    try:
        for i, target in enumerate(targets):
            cases = Cases(args.seed + i)
            if target in ("engine_parser", "point_validator"):
                tally = run_in_process(target, cases, args.cases, args.seconds)
            else:
                tally = run_receiver(target, col, cases, args.cases, args.seconds)
            tallies[target] = tally
            print(json.dumps({target: tally.to_dict()}), flush=True)
        assert col.collector.pipeline.wait_idle(120)
        counters = col.counters()
        aggregator = col.collector.aggregator
    finally:
        summary = col.stop()
    received_spans = sum(v for k, v in counters.items() if k[0] == "sightline_collector_spans_received_total")
    duplicates = counters.get(_DUPLICATES, 0.0)
    invariants = {
        "spans_received": received_spans, "duplicates": duplicates,
        "spans_acknowledged": summary.spans_acknowledged, "spans_processed": summary.spans_processed,
        "spans_aggregated_by_aggregator": aggregator.spans_seen,
        "data_points_acknowledged": summary.data_points_acknowledged,
        "data_points_taken_by_aggregator": aggregator.points_seen,
        "data_points_dropped_by_aggregator": sum(aggregator.dropped.values()),
        "dropped_after_ack": summary.dropped,
        # one meaning of "acknowledged": /metrics' received counts and the exit summary agree
        "received_equals_acknowledged": received_spans == summary.spans_acknowledged,
        "acknowledged_equals_processed_plus_duplicates":
            summary.spans_acknowledged == summary.spans_processed + summary.spans_duplicate
            and summary.spans_duplicate == duplicates
            and summary.data_points_acknowledged == summary.data_points_processed,
    }
    document = {"benchmark": "fuzz", "git_commit": git_commit(dirty_paths=("collector", "engine", "bench/fuzz.py")),
                "date_utc": utc_now(), "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                   "platform": platform.platform()},
                "method": {"seed": args.seed, "max_cases": args.cases, "max_seconds": args.seconds,
                           "max_request_bytes": MAX_REQUEST, "max_decompressed_bytes": MAX_INFLATED},
                "targets": {t: tally.to_dict() for t, tally in tallies.items()}, "invariants": invariants}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    lines = ["# Fuzzing the receivers and the engine's request parser", "",
             f"commit `{document['git_commit']}`, {document['date_utc']}, {os.cpu_count()} CPUs (shared), "
             f"Python {platform.python_version()}; seed {args.seed}; collector in-process with "
             f"max_request_bytes {MAX_REQUEST}, max_decompressed_bytes {MAX_INFLATED}.", "",
             "| target | cases | unhandled | miscounted | good batch not counted exactly | accepted | "
             "refusals by reason | wall s | CPU s |", "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for target, tally in tallies.items():
        refusals = ", ".join(f"{k.split(':', 1)[1]} {v:,}" for k, v in sorted(tally.outcomes.items(),
                                                                               key=lambda kv: -kv[1])
                             if k.startswith("refused:"))
        lines.append(f"| {target} | {tally.cases:,} | {len(tally.unhandled)} | {len(tally.miscounted)} | "
                     f"{len(tally.good_batch_failures)} | {tally.outcomes.get('accepted', 0):,} | {refusals} | "
                     f"{tally.seconds:.0f} | {tally.cpu_s:.0f} |")
    drops = Counter()
    for tally in tallies.values():
        drops.update(tally.point_drops)
    lines += ["", "Data points acknowledged and then refused by the aggregator, by reason (all receivers): "
              + (", ".join(f"{k} {v:,}" for k, v in drops.most_common()) or "none") + ".", "",
              "End of run: " + ", ".join(f"{k} = {v}" for k, v in invariants.items()) + ".", "",
              "A case is *unhandled* when the answer is a 5xx other than 503, gRPC INTERNAL/UNKNOWN, or no "
              "answer; *miscounted* when its answer and `sightline_collector_rejected_total` disagree (a 2xx "
              "that moved a refusal counter, or a refusal that did not move exactly one). After every case a "
              "known-good batch of 3 spans with fresh ids must be acknowledged and counted exactly 3 (and none as a duplicate). CPU s is "
              "this process's (client and collector share it).",
              "Command: `.venv/bin/python -m bench.fuzz" + "".join(
                  " " + a for a in (sys.argv[1:] if argv is None else argv)) + "`"]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = all(not t.unhandled and not t.miscounted and not t.good_batch_failures for t in tallies.values())
    return 0 if ok and invariants["received_equals_acknowledged"] \
        and invariants["acknowledged_equals_processed_plus_duplicates"] else 1


if __name__ == "__main__":
    sys.exit(main())
