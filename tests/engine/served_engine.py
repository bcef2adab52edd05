"""``sightline engine serve`` of the tiny model on the CPU in a subprocess, and streamed
completions on threads against it (shared by the process-split and tensor-parallel tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai

from tests.support import free_port, wait_for_http

MODEL = "tiny"


class Served:
    """``sightline engine serve`` in a subprocess; its /health, /debug/kv and /metrics."""

    def __init__(self, api_servers: int, *args: str, trace_level: str = "off", **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sightline.deploy.cli", "engine", "serve", "--model", MODEL,
             "--device", "cpu", "--port", str(self.port), "--kv-cache-gib", "0.02",
             "--trace-level", trace_level, "--api-server-count", str(api_servers),
             "--log-level", "warning", *args],
            env=dict(os.environ, SIGHTLINE_TRACE_LEVEL=trace_level, **env))
        try:
            wait_for_http(self.url + "/health", timeout_s=120, process=self.process)
        except BaseException:
            self.close()
            raise

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def kv(self) -> dict:
        status, body = self.get("/debug/kv")
        assert status == 200, body
        return body

    def wait_kv(self, predicate, timeout_s: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            kv = self.kv()
            if predicate(kv) or time.monotonic() > deadline:
                return kv
            time.sleep(0.05)

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        want = ",".join(f'{k}="{v}"' for k, v in sorted({"model": MODEL, **labels}.items()))
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and
                   ",".join(sorted(line[len(name) + 1:line.index("}")].split(","))) == want)

    def close(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(10)


class Streams:
    """Streamed completions on threads, each on its own connection; records how each ended."""

    def __init__(self, served: Served, n: int, max_tokens: int = 2000) -> None:
        self.chunks = [0] * n
        self.ended: list[tuple[float, BaseException | None] | None] = [None] * n
        self.streams: list = [None] * n
        self.threads = [threading.Thread(target=self._run, args=(served, i, max_tokens), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, served: Served, i: int, max_tokens: int) -> None:
        error = None
        try:
            self.streams[i] = stream = served.client().completions.create(
                model=MODEL, prompt=f"stream {i}", max_tokens=max_tokens, stream=True, temperature=0,
                extra_body={"ignore_eos": True})
            for _ in stream:
                self.chunks[i] += 1
        except BaseException as exc:  # how it ended is the test's question
            error = exc
        self.ended[i] = (time.monotonic(), error)

    def wait_tokens(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while min(self.chunks) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert min(self.chunks) >= 2, self.chunks

    def join(self, timeout_s: float) -> None:
        for t in self.threads:
            t.join(timeout_s)
