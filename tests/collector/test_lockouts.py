"""No lockouts: every attack of ``bench.lockouts``, at its full count, held against a collector
process at ``ulimit -n 256`` while normal clients export through every receiver.

Held in a process of its own: 64 gRPC calls without a message, 200 whose answers are never
read, 300 idle TCP connections to the gRPC port, 1,024 kept-alive connections to each HTTP
listener (authenticated, or answered 401 from another address), a HEADERS + RST_STREAM
flood. Meanwhile the OTel SDK's gRPC and HTTP exporters (connecting after the attack
began), a Zipkin client and ``/healthz`` on new connections: every export succeeds within
1 s, /healthz answers within 100 ms at the 90th percentile (and within 1 s always: the
test machine is shared), and the collector stays under its descriptor limit.
"""

from __future__ import annotations

import os

import pytest

from bench.lockouts import ATTACKS, hold_attack, probe, start_collector

pytestmark = pytest.mark.timeout(180)
NOFILE = 256


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    process, ports = start_collector(tmp_path_factory.mktemp("lockouts"), nofile=NOFILE)
    yield process, ports
    assert process.stop() == 0  # drained cleanly, nothing acknowledged was lost


@pytest.mark.parametrize("attack", ATTACKS)
def test_normal_clients_get_through_while_an_attack_is_held(collector, attack):
    process, ports = collector
    with hold_attack(attack, ports) as held:
        seen = probe(ports, seconds=2.0, every_s=0.2)
        fds = len(os.listdir(f"/proc/{process.pid}/fd"))
    assert seen["failures"] == []
    latencies = seen["latencies_s"]
    for receiver in ("otlp_grpc", "otlp_http", "zipkin"):
        assert len(latencies[receiver]) >= 5 and max(latencies[receiver]) < 1.0, (receiver, latencies[receiver])
    healthz = sorted(latencies["healthz"])
    assert healthz[-1] < 1.0 and healthz[int(0.9 * (len(healthz) - 1))] < 0.1, healthz
    assert fds < NOFILE - 16
    assert "error" not in held.summary, held.summary
