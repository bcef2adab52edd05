"""Test plumbing shared by every room's tests: free loopback ports, waiting for servers."""

from __future__ import annotations

import json
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


# A cold numba cache (a fresh machine or checkout) means tens of seconds of compiling before
# a collector is ready; its /readyz says so, and the wait is bounded by that, not by a guess.
COLLECTOR_READY_TIMEOUT_S = 300.0


def wait_for_collector(query_url: str, process=None, live_timeout_s: float = 30.0,
                       ready_timeout_s: float = COLLECTOR_READY_TIMEOUT_S) -> None:
    """Waits for a collector's ``/healthz`` (the process serves), then for its ``/readyz``
    (its compiled paths are warm); a timeout names what ``/readyz`` last said."""
    wait_for_http(f"{query_url}/healthz", live_timeout_s, process)
    deadline = time.monotonic() + ready_timeout_s
    said = ""
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"collector exited with {process.returncode} before it was ready: {said}")
        try:
            with urllib.request.urlopen(f"{query_url}/readyz", timeout=2) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as error:
            said = error.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            said = repr(exc)
        time.sleep(0.1)
    raise TimeoutError(f"{query_url}/readyz not ready within {ready_timeout_s}s: {said}")


def get_json(url: str, timeout_s: float = 10.0) -> tuple[int, dict]:
    """``(status, JSON body)`` of a GET, error statuses included (their bodies are JSON too)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
