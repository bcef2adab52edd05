"""The collector's process configuration: listen addresses, limits, queue, auth, TLS.

One frozen dataclass, ``CollectorConfig``, handed to ``collector/app.py``. Each field is
declared once with ``setting``: its range check, flag and help come from there, and an
error names the bad value and the allowed range.

Addresses default to the loopback interface (127.0.0.1) on the standard ports (OTLP
gRPC 4317, OTLP HTTP 4318, Zipkin 9411, query/metrics 8889): a collector started by
hand on a laptop must not accept telemetry from the network unless told to. Containers
and Kubernetes pass ``--otlp-grpc 0.0.0.0:4317`` etc. explicitly (deploy/ does).

Secrets never travel as flag values (they would show in ``ps`` and shell history): the
ingest bearer token comes from a file (``--auth-token-file``) or from an environment
variable whose *name* is configurable (default ``SIGHTLINE_COLLECTOR_TOKEN``); the query
API's read token likewise (``--query-token-file``, ``SIGHTLINE_COLLECTOR_READ_TOKEN``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..instrumentation import check_range, check_settings, setting

__all__ = [
    "DEFAULT_READ_TOKEN_ENV",
    "DEFAULT_TOKEN_ENV",
    "CollectorConfig",
    "parse_address",
]

DEFAULT_TOKEN_ENV = "SIGHTLINE_COLLECTOR_TOKEN"
DEFAULT_READ_TOKEN_ENV = "SIGHTLINE_COLLECTOR_READ_TOKEN"
MiB = 1024 * 1024


def parse_address(value: str, *, what: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ``[::1]:4317`` for IPv6. Port 0 = any free port."""
    text = value.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"{what}: address {value!r} is not host:port (for example 127.0.0.1:4317)")
    port = int(port_text)
    check_range(f"{what} port", port, 0, 65535, integer=True)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"{what}: address {value!r} has no host (use 0.0.0.0 for all interfaces)")
    return host, port


@dataclass(frozen=True)
class CollectorConfig:
    """Everything ``sightline collector run`` needs; see the module docstring for defaults.

    Limits (each request is checked before it costs memory):
    - ``max_request_bytes``: body as it arrives on the wire (compressed or not).
      Larger -> HTTP 413 / gRPC RESOURCE_EXHAUSTED, decided from Content-Length when
      present, otherwise while reading.
    - ``max_decompressed_bytes``: body after gzip/deflate; decompression is streamed and
      stops at this limit, so a gzip bomb costs at most this much memory.
    - ``max_decompression_ratio``: a compressed body inflates to at most this many times its
      wire size (bodies inflating to under 1 MiB excepted), so that no small body buys a
      large amount of work.
    - ``max_resources_per_request``, ``max_scopes_per_request`` (scopes and metrics),
      ``max_spans_per_request``, ``max_points_per_request``, ``max_values_per_request``
      (attributes, events, links, exemplars), ``max_buckets_per_request`` (histogram bucket
      counts): an encoded request's messages, empty ones included, are counted before it is
      parsed, and one past any cap is refused (413 / RESOURCE_EXHAUSTED), so the parse and
      aggregation of one request are bounded. ``max_json_values``: the same for JSON bodies
      (objects, arrays and elements, bounded before ``json.loads``).
    - ``queue_max_items`` / ``queue_max_bytes``: the pipeline queue between receivers and
      the aggregator holds at most this many spans+data points and this many bytes of
      parsed requests (estimated from their message counts, encodings included); beyond
      either, receivers answer 429 / RESOURCE_EXHAUSTED with a retry hint of ``retry_after_s``.
    - ``max_inflight_requests``: export requests being decoded at once, per listener,
      counted from when the whole body (gRPC: message) has arrived, so slow or stalled
      senders hold no slot; more -> 429 / RESOURCE_EXHAUSTED at once.
    - ``request_timeout_s``: a body (gRPC: the call's message) that has not fully arrived
      by then -> 408 / DEADLINE_EXCEEDED (a stalled sender cannot hold a slot forever).
    - ``max_connections``: open connections per listener (the gRPC port, both HTTP ingest
      ports and the query port), lowered at start so that all listeners together stay
      under the process's file-descriptor limit. A full listener takes back an idle or
      incomplete connection for a new one (:mod:`.connection_table`), else answers 503.
    - ``header_timeout_s``: every request's headers must arrive within this of their first
      byte (the first request's: of the connection's opening), else 408 and closed;
      ``keepalive_timeout_s``: an idle kept-alive connection (HTTP, or gRPC with no call
      open) is closed after this; ``handshake_timeout_s``: a gRPC connection must finish
      TLS and the HTTP/2 preface within this.
    - ``max_streams_per_connection`` / ``max_calls_per_peer``: gRPC calls open at once on
      one connection (more are refused with REFUSED_STREAM) and from one IP address (more
      -> RESOURCE_EXHAUSTED); ``response_timeout_s``: a gRPC answer the client does not
      read (flow control) within this is reset.
    - ``dedupe_window_spans``: a fingerprint of (trace id, span id) of about the last N
      spans admitted is remembered; a span arriving again (an exporter's retry) is
      acknowledged, not stored or counted twice, and counted in
      ``dropped_total{reason="duplicate"}``. 0 = off. 8 bytes per remembered span.
    - ``max_json_depth``: OTLP/JSON and Zipkin bodies nested deeper -> 400.
    - ``scrape_deadline_s``: a /metrics response not read by then is cut (scrapers share one
      rendered page and each holds only a slice of it buffered).

    Query API auth (``/api/v1/``: it serves span attributes): on when ``query_auth`` is set
    or a read token is configured (file or environment variable). The read token, when
    there is one, is required; otherwise the ingest token. ``/metrics``, ``/healthz`` and
    ``/readyz`` stay open (scrapers and probes).
    """

    otlp_grpc_address: str = setting("127.0.0.1:4317", "OTLP/gRPC listen address", flag="--otlp-grpc",
                                     metavar="HOST:PORT")
    otlp_http_address: str = setting("127.0.0.1:4318", "OTLP/HTTP listen address (/v1/traces, /v1/metrics; "
                                                       "protobuf and JSON)", flag="--otlp-http", metavar="HOST:PORT")
    zipkin_address: str = setting("127.0.0.1:9411", "Zipkin v2 listen address (/api/v2/spans)", flag="--zipkin",
                                  metavar="HOST:PORT")
    http_address: str = setting("127.0.0.1:8889", "query port: /metrics, /healthz, /readyz, /api/v1/",
                                flag="--http", metavar="HOST:PORT")
    max_request_bytes: int = setting(8 * MiB, "largest request body on the wire", lo=1024, hi=1024 * MiB)
    max_decompressed_bytes: int = setting(16 * MiB, "largest body (or gRPC message) after gzip/deflate",
                                          lo=1024, hi=4096 * MiB)
    max_decompression_ratio: int = setting(200, "a compressed body may inflate to at most this many times its "
                                                "size", lo=2, hi=1_000_000)
    max_resources_per_request: int = setting(4_096, "resources in one export request, empty ones included, "
                                                    "counted before it is parsed; more -> 413", lo=1, hi=1 << 30)
    max_scopes_per_request: int = setting(16_384, "scopes and metrics in one export request, same effect",
                                          lo=1, hi=1 << 30)
    max_spans_per_request: int = setting(32_768, "spans in one export request, same effect", lo=1, hi=1 << 30)
    max_points_per_request: int = setting(4_096, "metric data points in one export request, same effect",
                                          lo=1, hi=1 << 30)
    max_values_per_request: int = setting(524_288, "attributes, events, links and exemplars in one export "
                                                   "request, same effect", lo=1, hi=1 << 30)
    max_buckets_per_request: int = setting(2_097_152, "histogram bucket counts in one export request, same "
                                                      "effect", lo=1, hi=1 << 30)
    max_json_values: int = setting(65_536, "objects, arrays and elements in one OTLP/JSON or Zipkin body, "
                                           "counted before it is parsed; more -> 413", lo=1, hi=1 << 30)
    queue_max_items: int = setting(100_000, "spans+data points waiting for the aggregator before "
                                            "429/RESOURCE_EXHAUSTED", lo=1, hi=100_000_000)
    queue_max_bytes: int = setting(128 * MiB, "bytes of parsed requests waiting (estimated), same effect",
                                   lo=1024, hi=64 * 1024 * MiB)
    workers: int = setting(1, "aggregator worker threads", lo=1, hi=64)
    max_inflight_requests: int = setting(64, "export requests read/parsed at once per listener before "
                                             "429/RESOURCE_EXHAUSTED", lo=1, hi=100_000)
    request_timeout_s: float = setting(30.0, "a request body must arrive within this many seconds (else 408)",
                                       lo=0.1, hi=3600.0)
    max_connections: int = setting(1024, "open connections per listener before 503 (lowered to fit the "
                                         "file-descriptor limit)", lo=8, hi=1_000_000)
    header_timeout_s: float = setting(10.0, "every request's headers must arrive within this many seconds of "
                                            "their first byte (else 408)", lo=0.1, hi=3600.0)
    keepalive_timeout_s: float = setting(15.0, "an idle kept-alive connection (HTTP, or gRPC with no call open) "
                                               "is closed after this many seconds", lo=0.1, hi=3600.0)
    handshake_timeout_s: float = setting(5.0, "a gRPC connection must finish TLS and the HTTP/2 preface within "
                                              "this many seconds", lo=0.1, hi=3600.0)
    max_streams_per_connection: int = setting(32, "gRPC calls open at once on one connection (more are refused "
                                                  "with REFUSED_STREAM)", lo=1, hi=10_000)
    max_calls_per_peer: int = setting(256, "gRPC calls open at once from one IP address (more get "
                                           "RESOURCE_EXHAUSTED)", lo=1, hi=1_000_000)
    response_timeout_s: float = setting(10.0, "a gRPC answer the client does not read within this many seconds "
                                              "is reset", lo=0.1, hi=3600.0)
    max_connection_age_s: float = setting(600.0, "a gRPC connection older than this (give or take 10 percent) is sent "
                                                 "GOAWAY, so that clients reconnect and spread over replicas "
                                                 "(0 = no limit)", lo=0.0, hi=365 * 86400.0)
    max_connection_age_grace_s: float = setting(30.0, "after that GOAWAY, the calls open on the connection get "
                                                      "this many seconds to finish before it is closed",
                                                lo=0.0, hi=3600.0)
    dedupe_window_spans: int = setting(262_144, "remember the ids of about this many recent spans; a span sent "
                                                "again is acknowledged, not counted twice (0 = off; 8 bytes per "
                                                "span)", lo=0, hi=100_000_000)
    max_json_depth: int = setting(64, "OTLP/JSON and Zipkin bodies nested deeper are refused with 400",
                                  lo=2, hi=512)
    retry_after_s: int = setting(1, "retry hint sent with 429/RESOURCE_EXHAUSTED", lo=1, hi=3600)
    shutdown_timeout_s: float = setting(30.0, "how long the drain on SIGTERM may take", lo=0.0, hi=3600.0)
    scrape_deadline_s: float = setting(30.0, "a /metrics response not read within this many seconds is cut",
                                       lo=0.1, hi=3600.0)
    auth_token_file: Path | None = setting(None, "file holding the ingest bearer token")
    auth_token_env: str = setting(DEFAULT_TOKEN_ENV, "environment variable holding the ingest bearer token "
                                                     "(if set)")
    query_auth: bool = setting(False, "require a bearer token on the query API (/api/v1/): the read token if "
                                      "one is set, else the ingest token; /metrics, /healthz, /readyz stay open")
    query_token_file: Path | None = setting(None, "file holding the query API's read token (turns query auth "
                                                  "on)")
    query_token_env: str = setting(DEFAULT_READ_TOKEN_ENV, "environment variable holding the query API's read "
                                                           "token (if set, query auth is on)")
    tls_cert_file: Path | None = setting(None, "PEM certificate for the ingest listeners")
    tls_key_file: Path | None = setting(None, "PEM private key for the ingest listeners")
    summary_file: Path | None = setting(None, "write acknowledged-vs-aggregated totals as JSON here on exit")
    # the counterpart of rotel's blackhole exporter, for benchmarks of receivers and queue
    sink: Literal["aggregator", "discard"] = setting("aggregator", "'discard' skips aggregation (ingest "
                                                                   "benchmarks only)")

    def __post_init__(self) -> None:
        for name in ("otlp_grpc_address", "otlp_http_address", "zipkin_address", "http_address"):
            parse_address(getattr(self, name), what=name)
        check_settings(self)
        check_range("max_decompressed_bytes", self.max_decompressed_bytes, self.max_request_bytes, 4096 * MiB,
                    integer=True, hint="(at least max_request_bytes)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                f"tls_cert_file={self.tls_cert_file!r} and tls_key_file={self.tls_key_file!r}: "
                "give both or neither"
            )
        for name in ("tls_cert_file", "tls_key_file", "auth_token_file", "query_token_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}={str(path)!r} is not a readable file")
        for name in ("auth_token_env", "query_token_env"):
            value = getattr(self, name)
            if not value or not value.replace("_", "").isalnum():
                raise ValueError(f"{name}={value!r} is not an environment variable name")

    # -- derived ---------------------------------------------------------------------
    def request_limits(self):
        """The caps on one request's messages, as the decoders take them."""
        from .request_shape import RequestLimits  # numpy and numba: not at this module's import

        return RequestLimits(self.max_resources_per_request, self.max_scopes_per_request,
                             self.max_spans_per_request, self.max_values_per_request,
                             self.max_buckets_per_request, self.max_json_values, self.max_points_per_request)

    def address(self, name: str) -> tuple[str, int]:
        """(host, port) of ``otlp_grpc`` | ``otlp_http`` | ``zipkin`` | ``http``."""
        return parse_address(getattr(self, f"{name}_address"), what=f"{name}_address")

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert_file is not None

    def read_auth_token(self) -> str | None:
        """The ingest bearer token: the file wins over the environment variable; None = no auth.

        Raises ValueError when the configured source exists but is empty, since an empty
        token would silently turn authentication off.
        """
        return _read_token(self.auth_token_file, "auth_token_file", self.auth_token_env)

    def read_query_token(self) -> str | None:
        """The token the query API requires (see the class docstring); None = open.

        Raises ValueError when query auth is asked for and there is no token at all."""
        token = _read_token(self.query_token_file, "query_token_file", self.query_token_env)
        if token is not None:
            return token
        if not self.query_auth:
            return None
        token = self.read_auth_token()
        if token is None:
            raise ValueError("query_auth is on but there is no token: set a read token "
                             f"(query_token_file or ${self.query_token_env}) or an ingest token "
                             f"(auth_token_file or ${self.auth_token_env})")
        return token


def _read_token(path: Path | None, path_name: str, env_name: str) -> str | None:
    """A token from ``path`` (wins) or the environment variable ``env_name``; None if neither."""
    if path is not None:
        token = Path(path).read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"{path_name}={str(path)!r} is empty")
        return token
    token = os.environ.get(env_name)
    if token is None:
        return None
    token = token.strip()
    if not token:
        raise ValueError(f"environment variable {env_name} is set but empty")
    return token
