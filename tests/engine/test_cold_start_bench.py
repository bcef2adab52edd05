"""bench/cold_start.py on the CPU: the whole flow with the tiny model, and its arithmetic.

The dry run starts ``sightline engine serve`` (the engine core and two API servers) twice (an
empty compile cache, then the same cache), as the H200 run does, with small sizes; the record holds every measurement the
markdown reports, and the CPU's torch paths meet no kernel variant while serving.
"""

from __future__ import annotations

import json

import pytest

from bench.cold_start import checks, main, parse_metric
from sightline.instrumentation import semconv as sc

from ..support import free_port


def test_parse_metric_sums_the_samples_of_one_name_only():
    page = "\n".join([
        "# HELP sightline_engine_jit_compiles_total Kernel variants ...",
        "# TYPE sightline_engine_jit_compiles_total counter",
        'sightline_engine_jit_compiles_total{kernel="a",kind="compiled",model="m"} 2.0',
        'sightline_engine_jit_compiles_total{kernel="b",kind="disk_cache",model="m"} 1.0',
        'sightline_engine_jit_compiles_totally_else 7.0',
        'sightline_engine_jit_compiles_created{kernel="a"} 1.7e9'])
    assert parse_metric(page, "sightline_engine_jit_compiles_total") == 3.0
    assert parse_metric(page, "sightline_engine_missing_total") == 0.0


def test_checks_apply_the_issues_bounds():
    def result(first_ttft, first_step, compiles):
        return {"cold": {"first_request": {"ttft_s": first_ttft}, "warm_ttft_s": [0.1, 0.3, 0.2],
                         "first_burst": {"longest_step_s": first_step},
                         "warm_burst": {"longest_step_s": 0.02},
                         "jit_compiles_while_serving": compiles, "ready_s": 59.0},
                "warm": {"ready_s": 21.0}}
    met = checks(result(0.4, 0.03, 0))
    assert met["first_ttft_over_warm_median"] == pytest.approx(2.0) and met["first_ttft_within_2x"]
    assert met["first_burst_within_1_5x"]
    assert met["first_burst_longest_over_warm"] == pytest.approx(1.5)
    assert met["no_compile_while_serving"] and met["cold_within_60s"] and not met["warm_within_20s"]
    missed = checks(result(0.41, 0.031, 1))
    assert not (missed["first_ttft_within_2x"] or missed["first_burst_within_1_5x"]
                or missed["no_compile_while_serving"])


def test_a_cpu_dry_run_measures_every_part_cold_and_warm(tmp_path):
    out = tmp_path / "results"
    assert main(["--model", "tiny", "--device", "cpu", "--levels", "requests", "--burst", "3",
                 "--burst-prompt", "16", "--burst-output", "3", "--warm-requests", "2",
                 "--mixed", "10", "--first-output", "3", "--max-num-seqs", "8",
                 "--api-server-count", "2",
                 "--port", str(free_port()), "--out", str(out), "--logs", str(tmp_path / "logs")]) == 0
    [path] = out.glob("cold_start-*.json")
    record = json.loads(path.read_text())
    result = record["levels"]["requests"]
    phases = [sc.STARTUP_IMPORTS, sc.STARTUP_LOAD_WEIGHTS, sc.STARTUP_ALLOCATE_KV,
              sc.STARTUP_WARMUP_FUSED, sc.STARTUP_WARMUP_PREFILL, sc.STARTUP_WARMUP_DECODE,
              sc.STARTUP_WARMUP_MIXED, sc.STARTUP_WARMUP_SAMPLER]
    for run in ("cold", "warm"):
        part = result[run]
        assert 0 < part["live_s"] <= part["ready_s"]
        assert list(part["startup"]["phases"]) == phases
        assert part["startup"]["total_s"] == pytest.approx(part["health"]["startup_s"], abs=1e-3)
        assert part["first_request"]["finish_reason"] == "length"
        assert part["first_request"]["ttft_s"] > 0
    cold = result["cold"]
    for name in ("first_burst", "warm_burst"):
        assert cold[name]["requests"] == 3 and cold[name]["steps"] >= 3
        assert cold[name]["longest_step_s"] > 0
        assert max(cold[name]["step_durations_s"]) == cold[name]["longest_step_s"]
        prefill, decode = cold[name]["longest_step_tokens"]   # what the longest step ran
        assert prefill + decode >= 1
    assert len(cold["warm_ttft_s"]) == 2
    assert cold["mixed"]["requests"] == 10 and cold["mixed"]["finished"] == 10
    assert len(cold["mixed"]["sampling_cases"]) == 10
    assert cold["jit_compiles_while_serving"] == 0 and result["checks"]["no_compile_while_serving"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "cold_start-requests-cold.log", "cold_start-requests-warm.log"]
    report = path.with_suffix(".md").read_text()
    assert "## trace level requests" in report and "| warmup_prefill |" in report
    assert "kernel variants met while serving" in report and "Command: `" in report
