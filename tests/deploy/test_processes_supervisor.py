"""The supervisor under deploy/stack.py: logs, health checks, process-group shutdown."""

from __future__ import annotations

import os
import sys
import time

import pytest

from sightline.deploy.processes import (HealthCheck, ProcessFailedError, ProcessSpec, Supervisor,
                                        free_ports)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_logs_go_to_own_file_and_combined(tmp_path):
    with Supervisor(tmp_path) as sup:
        proc = sup.start(ProcessSpec(name="echoer", argv=(
            sys.executable, "-c", "import sys; print('out line'); print('err line', file=sys.stderr)")))
        proc.popen.wait(timeout=30)
    own = (tmp_path / "echoer.log").read_text().splitlines()
    assert sorted(own) == ["err line", "out line"]
    combined = (tmp_path / "combined.log").read_text()
    assert "[echoer] out line" in combined and "[echoer] err line" in combined


def test_stop_kills_the_whole_group_even_when_sigterm_is_ignored(tmp_path):
    # The child ignores SIGTERM and has a grandchild; both must be gone after stop().
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import signal,time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(600)\n")
    with Supervisor(tmp_path) as sup:
        proc = sup.start(ProcessSpec(name="stubborn", argv=(sys.executable, "-c", script),
                                     stop_timeout_s=1.0))
        deadline = time.monotonic() + 30
        while not (tmp_path / "stubborn.log").read_text().strip():
            assert time.monotonic() < deadline, "child never printed its grandchild's pid"
            time.sleep(0.05)
        grandchild = int((tmp_path / "stubborn.log").read_text().split()[0])
        assert _alive(grandchild)
        start = time.monotonic()
        code = proc.stop()
        took = time.monotonic() - start
    assert code == -9  # SIGKILL, after the SIGTERM was ignored
    assert 0.9 <= took < 10
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_sigterm_is_enough_for_a_polite_child(tmp_path):
    with Supervisor(tmp_path) as sup:
        proc = sup.start(ProcessSpec(name="polite", argv=(
            sys.executable, "-c", "import time; time.sleep(600)")))
        assert proc.stop() == -15
        assert sup.stop_all() == {"polite": -15}  # idempotent


def test_health_check_waits_for_http(tmp_path):
    port = free_ports(1)[0]
    with Supervisor(tmp_path) as sup:
        spec = ProcessSpec(name="web", argv=(
            sys.executable, "-c",
            f"import time, http.server; time.sleep(0.5); "
            f"http.server.HTTPServer(('127.0.0.1', {port}), "
            f"http.server.SimpleHTTPRequestHandler).serve_forever()"),
            cwd=tmp_path, health=HealthCheck(http_url=f"http://127.0.0.1:{port}/", timeout_s=30))
        proc = sup.start(spec)
        assert proc.alive
        tcp = HealthCheck(tcp_address=("127.0.0.1", port), timeout_s=5)
        assert proc.wait_healthy(tcp) < 1.0


def test_exit_before_healthy_raises_with_log_tail(tmp_path):
    port = free_ports(1)[0]
    with Supervisor(tmp_path) as sup:
        spec = ProcessSpec(name="crasher", argv=(
            sys.executable, "-c", "import sys; print('config is broken'); sys.exit(3)"),
            health=HealthCheck(http_url=f"http://127.0.0.1:{port}/", timeout_s=30))
        with pytest.raises(ProcessFailedError, match=r"(?s)crasher exited with code 3.*config is broken"):
            sup.start(spec)


def test_health_timeout_stops_the_child(tmp_path):
    port = free_ports(1)[0]
    with Supervisor(tmp_path) as sup:
        spec = ProcessSpec(name="silent", argv=(sys.executable, "-c", "import time; time.sleep(600)"),
                           health=HealthCheck(tcp_address=("127.0.0.1", port), timeout_s=0.5))
        with pytest.raises(ProcessFailedError, match="not healthy"):
            sup.start(spec)
        assert not sup["silent"].alive


def test_free_ports_are_distinct_and_bindable():
    import socket

    from sightline.deploy.processes import _ephemeral_port_range

    ports = free_ports(20)
    assert len(set(ports)) == 20
    # below the range the kernel gives client sockets (when it leaves room below), and
    # never handed out twice
    if _ephemeral_port_range()[0] > 20_000:
        assert max(ports) < _ephemeral_port_range()[0]
        assert not set(free_ports(20)) & set(ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_specs_check_their_values():
    with pytest.raises(ValueError, match="stop_timeout_s=0"):
        ProcessSpec(name="x", argv=("true",), stop_timeout_s=0)
    with pytest.raises(ValueError, match="name='a b'"):
        ProcessSpec(name="a b", argv=("true",))
    with pytest.raises(ValueError, match="exactly one"):
        HealthCheck()


def test_free_ports_fall_back_to_the_kernels_choice_when_none_is_left_below_the_range(monkeypatch):
    import socket

    from sightline.deploy import processes

    monkeypatch.setattr(processes, "_ports_to_draw", [])
    monkeypatch.setattr(processes, "_ephemeral_port_range", lambda: (1024, 65535))  # nothing below
    ports = processes.free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
