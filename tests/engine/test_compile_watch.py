"""The compile watch and the compile cache, with real Triton compiles on the CPU.

Triton cannot launch a kernel without a GPU, but ``triton.compile`` builds one for a named
target (here Hopper, sm_90) all the same, through the same ``triton.compile`` and the same
compilation listener that a JIT cache miss goes through. A new variant is compiled; the
same variant in a new process-level miss comes from the on-disk cache; events are charged
to the thread that met them; a listener installed earlier still hears every compile.
"""

from __future__ import annotations

import os
import threading
import urllib.request

import pytest

from sightline.engine.compile_cache import (ENV_COMPILE_CACHE_DIR, default_compile_cache_dir,
                                            resolve_compile_cache)
from sightline.engine.compile_watch import CompileWatch

triton = pytest.importorskip("triton")
from tests.engine.triton_variants import compile_variant  # noqa: E402


@pytest.fixture
def watch(tmp_path, monkeypatch):
    """A watch hooked for this test only, over an empty Triton cache."""
    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    heard: list[bool] = []
    before = knobs.compilation.listener

    def earlier(*, cache_hit, **kwargs) -> None:   # a listener someone set before ours
        heard.append(cache_hit)

    knobs.compilation.listener = earlier
    w = CompileWatch()
    assert w.hook_triton() and w.hooked
    w.heard = heard
    yield w
    knobs.compilation.listener = before


def test_a_new_variant_is_compiled_then_comes_from_the_disk_cache(watch):
    assert watch.thread_count() == 0
    compile_variant(64)
    [event] = watch.thread_events()
    assert (event.kernel, event.source) == ("doubler", "compiled") and event.duration_s > 0
    assert str(event) == event.variant == "doubler[BLOCK=64] w4 s3"
    compile_variant(64)          # a new process-level miss of the same variant: Triton's disk cache
    compile_variant(128)         # another constexpr: another variant, compiled
    assert [(e.kernel, e.source) for e in watch.since(1)] == [("doubler", "disk_cache"),
                                                            ("doubler", "compiled")]
    assert watch.total == 3 and watch.heard == [False, True, False]


def test_events_belong_to_the_thread_that_met_them(watch):
    counts: dict[str, int] = {}

    def other() -> None:
        compile_variant(256)
        counts["other"] = watch.thread_count()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert counts == {"other": 1} and watch.thread_count() == 0 and watch.total == 1


def test_a_bad_source_is_refused(watch):
    with pytest.raises(ValueError, match="source='jit' is not one of compiled|disk_cache|autotune"):
        watch.record("k", "jit")


def test_cache_directory_argument_beats_environment_beats_default(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_COMPILE_CACHE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "users-triton"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")   # apply() below sets it; restored after
    default = resolve_compile_cache()
    assert default.source == "default" and default.root == tmp_path / "xdg/sightline/compile"
    assert default_compile_cache_dir() == tmp_path / "xdg/sightline/compile"
    assert default.triton_dir == tmp_path / "users-triton"   # the user's variable, kept
    monkeypatch.setenv(ENV_COMPILE_CACHE_DIR, str(tmp_path / "env"))
    env = resolve_compile_cache()
    assert (env.source, env.root, env.triton_dir) == ("environment", tmp_path / "env",
                                                      tmp_path / "env/triton")
    arg = resolve_compile_cache(tmp_path / "arg")
    assert (arg.source, arg.triton_dir, arg.inductor_dir) == (
        "argument", tmp_path / "arg/triton", tmp_path / "arg/inductor")
    assert arg.triton_entries() == 0
    arg.apply()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "arg/triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "arg/inductor")
    assert arg.tuning_file == tmp_path / "arg/fa2_prefill_tuning.json"
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ValueError, match="compile cache directory .*/file/x' cannot be created"):
        resolve_compile_cache(tmp_path / "file/x").apply()
    monkeypatch.setenv(ENV_COMPILE_CACHE_DIR, str(tmp_path / "file/y"))
    assert resolve_compile_cache().apply() is False   # not the argument: logged, compilers' own


def test_compiled_kernels_land_in_the_applied_cache(tmp_path, monkeypatch, watch):
    cache = resolve_compile_cache(tmp_path / "cache")
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):   # apply() sets them
        monkeypatch.setenv(name, "")                                 # restored after the test
    cache.apply()
    compile_variant(32)
    assert cache.triton_entries() >= 1 and [e.source for e in watch.thread_events()] == ["compiled"]


def test_a_variant_met_while_serving_is_counted_and_named_on_its_step(tmp_path, monkeypatch):
    """The served engine, ready: a step whose launch meets a kernel variant for the first time
    (here the sampler's launch, when a batch first uses top-k, compiles one for real, on the
    engine's thread, as a JIT miss would) is counted in sightline_engine_jit_compiles_total
    and its step span names the kernel; steps before and after carry nothing, and a compile
    on another thread is not the engine's."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sightline.engine.config import EngineConfig
    from sightline.engine.api_server import serve_in_thread
    from sightline.instrumentation import semconv as sc
    from sightline.instrumentation.config import TelemetryConfig
    from sightline.instrumentation.tracing import Telemetry

    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):   # the engine sets them
        monkeypatch.setenv(name, "")                                 # restored after the test
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.start(TelemetryConfig(level="steps", exporter="none", schedule_delay_s=0.05,
                                                metrics_enabled=False), span_exporters=[exporter])
    running = serve_in_thread(EngineConfig(model="tiny", device="cpu", kv_cache_gib=0.01, port=0,
                                           compile_cache_dir=str(tmp_path / "cache"),
                                           shutdown_timeout_s=5), telemetry=telemetry)
    sampler = running.engine.runner.sampler
    sample, met = sampler.sample, set()

    def sample_meeting_new_variants(logits, batch):
        if batch.top_ks is not None and "top_k" not in met:   # the JIT's cache: once
            met.add("top_k")
            compile_variant(512)
        return sample(logits, batch)

    sampler.sample = sample_meeting_new_variants
    try:
        import openai
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)

        def complete(**extra) -> None:
            out = client.completions.create(model="tiny", prompt="warm?", max_tokens=3,
                                            extra_body={"ignore_eos": True, **extra})
            assert out.choices[0].finish_reason == "length"

        def counted() -> dict[str, float]:
            text = urllib.request.urlopen(running.url + "/metrics", timeout=5).read().decode()
            return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith(sc.ENGINE_JIT_COMPILES_TOTAL + "_total")}

        complete(temperature=0)
        assert counted() == {}
        complete(temperature=0.5, top_k=5)          # its first step compiles
        complete(temperature=0.5, top_k=5)          # the variant is known now
        compile_variant(1024)                              # another thread's compile: not the engine's
        assert counted() == {f'{sc.ENGINE_JIT_COMPILES_TOTAL}_total{{kernel="doubler",kind="compiled",'
                             f'model="tiny"}}': 1.0}
    finally:
        running.stop()
    steps = sorted((s for s in exporter.get_finished_spans() if s.name == sc.SPAN_ENGINE_STEP),
                   key=lambda s: s.start_time)
    assert len(steps) == 9   # 3 requests, one at a time: a prefill step and 2 decode steps each
    marked = [i for i, s in enumerate(steps) if sc.STEP_JIT_COMPILES in s.attributes]
    assert marked == [3]     # the second request's prefill step
    attributes = steps[3].attributes
    assert attributes[sc.STEP_JIT_COMPILES] == 1
    assert tuple(attributes[sc.STEP_JIT_COMPILE_KERNELS]) == ("doubler",)
    assert attributes[sc.STEP_JIT_COMPILE_S] > 0
