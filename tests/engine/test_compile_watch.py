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

import pytest

from sightline.engine.compile_cache import (ENV_COMPILE_CACHE_DIR, default_compile_cache_dir,
                                            resolve_compile_cache)
from sightline.engine.compile_watch import CompileWatch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@triton.jit
def doubler(X, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs, mask=offs < N) * 2, mask=offs < N)


def _compile(block: int) -> None:
    """One variant of ``doubler`` (its BLOCK), built for an H100/H200."""
    source = ASTSource(doubler, signature={"X": "*fp32", "N": "i32", "BLOCK": "constexpr"},
                       constexprs={"BLOCK": block})
    triton.compile(source, target=GPUTarget("cuda", 90, 32))


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
    _compile(64)
    [event] = watch.thread_events()
    assert (event.kernel, event.source) == ("doubler", "compiled") and event.duration_s > 0
    _compile(64)          # a new process-level miss of the same variant: Triton's disk cache
    _compile(128)         # another constexpr: another variant, compiled
    assert [(e.kernel, e.source) for e in watch.since(1)] == [("doubler", "disk_cache"),
                                                            ("doubler", "compiled")]
    assert watch.total == 3 and watch.heard == [False, True, False]


def test_events_belong_to_the_thread_that_met_them(watch):
    counts: dict[str, int] = {}

    def other() -> None:
        _compile(256)
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


def test_compiled_kernels_land_in_the_applied_cache(tmp_path, monkeypatch, watch):
    cache = resolve_compile_cache(tmp_path / "cache")
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):   # apply() sets them
        monkeypatch.setenv(name, "")                                 # restored after the test
    cache.apply()
    _compile(32)
    assert cache.triton_entries() >= 1 and [e.source for e in watch.thread_events()] == ["compiled"]
