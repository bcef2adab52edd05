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
variable whose *name* is configurable (default ``SIGHTLINE_COLLECTOR_TOKEN``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_TOKEN_ENV",
    "CollectorConfig",
    "parse_address",
]

DEFAULT_TOKEN_ENV = "SIGHTLINE_COLLECTOR_TOKEN"
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
    - ``queue_max_items`` / ``queue_max_bytes``: the pipeline queue between receivers and
      the aggregator holds at most this many spans+data points and this many payload
      bytes; beyond either, receivers answer 429 / RESOURCE_EXHAUSTED with a retry hint
      of ``retry_after_s``. A parsed request occupies about 3.7x its encoded size in
      memory (upb, measured on engine-like spans), and protobuf trace requests keep their
      encoding too (the trace store takes it), so the default 32 MiB is ~150 MiB
      resident at most.
    - ``max_inflight_requests``: export requests being read/parsed at once, per
      listener (gRPC: ``maximum_concurrent_rpcs``); more -> 429 / RESOURCE_EXHAUSTED at
      once. With the body limits this bounds the memory of requests not yet queued.
    - ``request_timeout_s``: a body that has not fully arrived by then -> 408 (a slow or
      stalled sender cannot hold a slot forever).
    """

    otlp_grpc_address: str = "127.0.0.1:4317"
    otlp_http_address: str = "127.0.0.1:4318"
    zipkin_address: str = "127.0.0.1:9411"
    http_address: str = "127.0.0.1:8889"
    max_request_bytes: int = 8 * MiB
    max_decompressed_bytes: int = 32 * MiB
    queue_max_items: int = 100_000
    queue_max_bytes: int = 32 * MiB
    workers: int = 1
    max_inflight_requests: int = 64
    request_timeout_s: float = 30.0
    retry_after_s: int = 1
    shutdown_timeout_s: float = 30.0
    auth_token_file: Path | None = None
    auth_token_env: str = DEFAULT_TOKEN_ENV
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
        _check_range("queue_max_items", self.queue_max_items, 1, 100_000_000)
        _check_range("queue_max_bytes", self.queue_max_bytes, 1024, 64 * 1024 * MiB)
        _check_range("workers", self.workers, 1, 64)
        _check_range("max_inflight_requests", self.max_inflight_requests, 1, 100_000)
        _check_range("request_timeout_s", self.request_timeout_s, 0.1, 3600.0)
        _check_range("retry_after_s", self.retry_after_s, 1, 3600)
        _check_range("shutdown_timeout_s", self.shutdown_timeout_s, 0.0, 3600.0)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                f"tls_cert_file={self.tls_cert_file!r} and tls_key_file={self.tls_key_file!r}: "
                "give both or neither"
            )
        for name in ("tls_cert_file", "tls_key_file", "auth_token_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}={str(path)!r} is not a readable file")
        if not self.auth_token_env or not self.auth_token_env.replace("_", "").isalnum():
            raise ValueError(f"auth_token_env={self.auth_token_env!r} is not an environment variable name")
        if self.sink not in ("aggregator", "discard"):
            raise ValueError(f"sink={self.sink!r} is not one of 'aggregator', 'discard'")

    # -- derived ---------------------------------------------------------------------
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
        if self.auth_token_file is not None:
            token = Path(self.auth_token_file).read_text(encoding="utf-8").strip()
            if not token:
                raise ValueError(f"auth_token_file={str(self.auth_token_file)!r} is empty")
            return token
        token = os.environ.get(self.auth_token_env)
        if token is None:
            return None
        token = token.strip()
        if not token:
            raise ValueError(f"environment variable {self.auth_token_env} is set but empty")
        return token
