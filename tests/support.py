"""Test plumbing shared by every room's tests: free loopback ports, waiting for servers."""

from __future__ import annotations

import os
import random
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_EPHEMERAL_LOW, _EPHEMERAL_HIGH = _ephemeral_range()
# Each process (pytest, or a bench script) draws from its own shuffled slice of the ports
# below the ephemeral range, so two suites on one machine rarely meet either.
_PORT_POOL = list(range(10_000, min(_EPHEMERAL_LOW, 32_768)))
random.Random(os.getpid()).shuffle(_PORT_POOL)
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and that no one else will take.

    A port the kernel picked with bind(0) is in the ephemeral range, which it also hands
    to client sockets: between our probe and the server's bind, an outgoing connection
    of another test can take it (CI saw EADDRINUSE). Ports below that range are only
    ever bound on purpose, and this process never hands out the same one twice.
    """
    while _PORT_POOL:
        port = _PORT_POOL.pop()
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free loopback port left below the ephemeral range")


def wait_for_http(url: str, timeout_s: float = 30.0, process=None) -> None:
    """Polls ``url`` until it answers 2xx; fails early if ``process`` has exited."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if 200 <= response.status < 300:
                    return
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            last_error = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s: {last_error}")
