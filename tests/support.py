"""Test plumbing shared by every room's tests: free loopback ports, waiting for servers."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

# below the ephemeral range, so no client socket takes it before the server binds it
from sightline.deploy.processes import free_port  # noqa: F401  (re-exported for the tests)


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
