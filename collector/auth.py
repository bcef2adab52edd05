"""Optional bearer-token authentication and TLS for the ingest receivers.

Auth: when a token is configured (file or environment variable, see ``CollectorConfig``),
every ingest request must carry ``Authorization: Bearer <token>`` (HTTP header or gRPC
metadata ``authorization``; the scheme is case-insensitive, RFC 7235). A missing or
wrong token gets HTTP 401 with ``WWW-Authenticate: Bearer`` or gRPC UNAUTHENTICATED,
before the body is read. The comparison is constant-time. The query API (``/api/v1/``)
takes its own optional token (``CollectorConfig.read_query_token``); ``/metrics``,
``/healthz`` and ``/readyz`` stay open for scrapers and probes.

TLS: with ``--tls-cert-file``/``--tls-key-file`` the three ingest listeners (OTLP gRPC,
OTLP HTTP, Zipkin) serve TLS only.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Iterable
from pathlib import Path

__all__ = ["TokenAuth", "grpc_ssl_context", "http_ssl_context"]


class TokenAuth:
    """Checks bearer tokens; ``TokenAuth(None)`` allows everything at the cost of one branch."""

    def __init__(self, token: str | None) -> None:
        self.enabled = token is not None
        self._expected = token.encode() if token is not None else b""

    def allows(self, authorization: str | None) -> bool:
        """True when auth is off or ``authorization`` is ``Bearer <token>`` (any case of
        the scheme, any run of spaces after it)."""
        if not self.enabled:
            return True
        if authorization is None:
            return False
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        try:
            given = credentials.strip().encode()
        except UnicodeEncodeError:
            return False
        return hmac.compare_digest(given, self._expected)

    def allows_grpc(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        if not self.enabled:
            return True
        for key, value in metadata or ():
            if key == "authorization":
                return self.allows(value.decode() if isinstance(value, bytes) else value)
        return False


def http_ssl_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A server-side TLS context (TLS 1.2+) for aiohttp sites."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert_file), str(key_file))
    return context


def grpc_ssl_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """The server-side TLS context for the gRPC listener: as for HTTP, negotiating HTTP/2."""
    context = http_ssl_context(cert_file, key_file)
    context.set_alpn_protocols(["h2"])
    return context
