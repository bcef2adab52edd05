"""Core plugins (``$SIGHTLINE_CORE_PLUGINS``): called in the engine core's process with the
warm core before it serves; one that cannot be found stops start-up, naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.engine.served_engine import MODEL, Served


def test_a_core_plugin_runs_in_the_engine_core_with_the_warm_core_before_it_serves(tmp_path):
    out = tmp_path / "plugin.json"
    served = Served(1, SIGHTLINE_CORE_PLUGINS="tests.engine.core_plugin_probe:record",
                    SIGHTLINE_TEST_PLUGIN_OUT=str(out))
    try:
        ran = json.loads(out.read_text())   # there by the time /health said warm
        assert ran["ppid"] == served.process.pid and ran["pid"] != served.process.pid   # a child: the core
        assert ran["model"] == MODEL and ran["kv_blocks"] == served.kv()["total"]
        answer = served.client().completions.create(model=MODEL, prompt="ab", max_tokens=3, temperature=0)
        assert answer.usage.completion_tokens == 3   # the engine serves on after it
    finally:
        assert served.close() == 0


def test_a_core_plugin_that_cannot_be_found_stops_start_up_naming_it():
    done = subprocess.run(
        [sys.executable, "-m", "sightline.deploy.cli", "engine", "serve", "--model", MODEL, "--device", "cpu",
         "--port", "0", "--kv-cache-gib", "0.02", "--trace-level", "off", "--log-level", "warning"],
        env=dict(os.environ, SIGHTLINE_CORE_PLUGINS="tests.engine.no_such_module:start"),
        capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "SIGHTLINE_CORE_PLUGINS: 'tests.engine.no_such_module:start' is not an importable" in done.stderr
