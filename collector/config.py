"""The collector's process configuration: listen addresses, limits, queue, auth, TLS.

One frozen dataclass, ``CollectorConfig``, composed at the top by ``collector/cli.py``
and handed to ``collector/app.py``. Every field is range-checked in ``__post_init__``
and an error names the bad value and the allowed range.

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
    if not 0 <= port <= 65535:
        raise ValueError(f"{what}: port {port} in {value!r} is outside 0..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"{what}: address {value!r} has no host (use 0.0.0.0 for all interfaces)")
    return host, port


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r} is outside the allowed range {low}..{high}")


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
    - ``max_inflight_requests``: export requests being decoded at once, per listener
      (HTTP: counted from when the whole body has arrived, so slow senders hold no slot;
      gRPC: ``maximum_concurrent_rpcs``); more -> 429 / RESOURCE_EXHAUSTED at once.
    - ``request_timeout_s``: a body that has not fully arrived by then -> 408 (a slow or
      stalled sender cannot hold a connection forever).
    - ``max_connections``: open connections per HTTP listener (both ingest ports and the
      query port); one more is answered 503 and closed. Lowered at start so that all
      listeners together stay under the process's file-descriptor limit.
    - ``header_timeout_s``: a new connection must send its request headers within this
      (else 408 and closed): connections that never finish their headers cannot pile up.
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

    otlp_grpc_address: str = "127.0.0.1:4317"
    otlp_http_address: str = "127.0.0.1:4318"
    zipkin_address: str = "127.0.0.1:9411"
    http_address: str = "127.0.0.1:8889"
    max_request_bytes: int = 8 * MiB
    max_decompressed_bytes: int = 16 * MiB
    max_decompression_ratio: int = 200
    max_resources_per_request: int = 4_096
    max_scopes_per_request: int = 16_384
    max_spans_per_request: int = 32_768
    max_points_per_request: int = 4_096
    max_values_per_request: int = 524_288
    max_buckets_per_request: int = 2_097_152
    max_json_values: int = 49_152
    queue_max_items: int = 100_000
    queue_max_bytes: int = 128 * MiB
    workers: int = 1
    max_inflight_requests: int = 64
    request_timeout_s: float = 30.0
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    dedupe_window_spans: int = 262_144
    max_json_depth: int = 64
    retry_after_s: int = 1
    shutdown_timeout_s: float = 30.0
    scrape_deadline_s: float = 30.0
    auth_token_file: Path | None = None
    auth_token_env: str = DEFAULT_TOKEN_ENV
    query_auth: bool = False
    query_token_file: Path | None = None
    query_token_env: str = DEFAULT_READ_TOKEN_ENV
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    summary_file: Path | None = None
    # "aggregator" (normal) or "discard" (benchmarks: receivers and queue only, the
    # counterpart of rotel's blackhole exporter).
    sink: str = "aggregator"

    def __post_init__(self) -> None:
        for name in ("otlp_grpc_address", "otlp_http_address", "zipkin_address", "http_address"):
            parse_address(getattr(self, name), what=name)
        _check_range("max_request_bytes", self.max_request_bytes, 1024, 1024 * MiB)
        _check_range("max_decompressed_bytes", self.max_decompressed_bytes, 1024, 4096 * MiB)
        if self.max_decompressed_bytes < self.max_request_bytes:
            raise ValueError(
                f"max_decompressed_bytes={self.max_decompressed_bytes} is below "
                f"max_request_bytes={self.max_request_bytes}; it must be >= it"
            )
        _check_range("max_decompression_ratio", self.max_decompression_ratio, 2, 1_000_000)
        for name in ("max_resources_per_request", "max_scopes_per_request", "max_spans_per_request",
                     "max_points_per_request", "max_values_per_request", "max_buckets_per_request",
                     "max_json_values"):
            _check_range(name, getattr(self, name), 1, 1 << 30)
        _check_range("queue_max_items", self.queue_max_items, 1, 100_000_000)
        _check_range("queue_max_bytes", self.queue_max_bytes, 1024, 64 * 1024 * MiB)
        _check_range("workers", self.workers, 1, 64)
        _check_range("max_inflight_requests", self.max_inflight_requests, 1, 100_000)
        _check_range("request_timeout_s", self.request_timeout_s, 0.1, 3600.0)
        _check_range("max_connections", self.max_connections, 8, 1_000_000)
        _check_range("header_timeout_s", self.header_timeout_s, 0.1, 3600.0)
        _check_range("dedupe_window_spans", self.dedupe_window_spans, 0, 100_000_000)
        _check_range("max_json_depth", self.max_json_depth, 2, 512)
        _check_range("retry_after_s", self.retry_after_s, 1, 3600)
        _check_range("shutdown_timeout_s", self.shutdown_timeout_s, 0.0, 3600.0)
        _check_range("scrape_deadline_s", self.scrape_deadline_s, 0.1, 3600.0)
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
        if self.sink not in ("aggregator", "discard"):
            raise ValueError(f"sink={self.sink!r} is not one of 'aggregator', 'discard'")

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
