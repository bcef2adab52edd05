"""``serve_cpu_s`` (bench/_common.py) on a real process tree: the child holding the listening
socket is the API server, a busy sibling the engine core, the resource tracker neither."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

from bench._common import serve_cpu_s
from sightline.deploy.processes import free_ports

_PARENT = textwrap.dedent("""
    import subprocess, sys, time
    port = int(sys.argv[1])
    # 50 ms of start-up work first: a bare interpreter's start can round to 0 clock ticks
    listen = ("import socket, time\\nend = time.time() + 0.05\\nwhile time.time() < end: pass\\n"
              "s = socket.socket(); s.bind(('127.0.0.1', %d)); s.listen(); time.sleep(60)" % port)
    spin = "import time; end = time.time() + 60\\nwhile time.time() < end: pass"
    kids = [subprocess.Popen([sys.executable, "-c", listen]), subprocess.Popen([sys.executable, "-c", spin])]
    print("ready", flush=True)
    time.sleep(60)
""")


def test_the_process_holding_the_port_is_the_api_server_and_its_busy_sibling_the_core():
    port = free_ports(1)[0]
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:   # the listener is up once a connection succeeds
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        before = serve_cpu_s(parent.pid, port)
        time.sleep(1.0)
        after = serve_cpu_s(parent.pid, port)
        assert set(after) == {"launcher", "api_servers", "engine_core"}
        # the spinning child used up to a core for the second (less on a loaded machine); the
        # sleeping ones next to nothing
        assert after["engine_core"] - before["engine_core"] >= 0.2
        assert after["api_servers"] - before["api_servers"] < 0.1
        assert after["api_servers"] > 0   # its start-up, counted under its role
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)], check=False)
        parent.kill()
        parent.wait()
