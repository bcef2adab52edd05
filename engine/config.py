"""Engine configuration: one typed dataclass per concern, composed into ``EngineConfig``.

* ``ModelConfig``   — the Llama architecture's shape (a preset, or a local HF ``config.json``).
* ``HttpLimits``    — the server's connection deadlines and caps.
* ``EngineConfig``  — which model, where it runs (device, dtype), how much memory the paged KV
  cache may take, the scheduler's limits, the telemetry settings and the server address.

Each field of ``EngineConfig`` and the configs it nests is declared once (``setting``): its
range, its flag and its help; an error names the field, the bad value and the allowed range,
so a typo on the command line fails at start-up with a sentence. Nothing here imports torch
or aiohttp: the CLI builds its flags from these classes before paying for heavy imports.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

from ..instrumentation import TelemetryConfig, check_range, check_settings, setting
from .scheduler import SchedulerConfig

__all__ = ["ModelConfig", "EngineConfig", "HttpLimits", "PRESETS", "DEVICES", "DTYPES",
           "resolve_model_config"]

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
DEVICES = get_args(Device)
DTYPES = get_args(DType)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-architecture decoder (names follow HF ``LlamaConfig`` where they exist)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    # Llama-3.x long-context frequency scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings), or None for plain RoPE.
    rope_llama3_scaling: tuple[float, float, float, int] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    init_std: float = 0.02  # random-weight presets only
    path: str | None = None  # a local HF-style directory with weights, or None (random weights)
    torch_dtype: str | None = None  # the checkpoint's dtype, from config.json

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            check_range(name, getattr(self, name), 1, integer=True)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (GQA groups must be whole)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        check_range("rope_theta", self.rope_theta, 0.0, 1e12, lo_open=True)
        check_range("rms_norm_eps", self.rms_norm_eps, 0.0, 1.0, lo_open=True)

    def check_shardable(self, size: int) -> None:
        """Raises ValueError naming the count that ``size`` tensor-parallel ranks cannot
        split evenly (each rank holds an equal share of the KV heads and MLP columns)."""
        for name in ("num_kv_heads", "intermediate_size"):
            value = getattr(self, name)
            if value % size:
                raise ValueError(f"tensor_parallel_size={size} does not divide {name}={value} of "
                                 f"model {self.name!r} (each rank holds an equal part)")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count (embedding + layers + final norm + untied head)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads * d) * 2 + h * (self.num_kv_heads * d) * 2
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        """Reads ``config.json`` of a local HF Llama-style checkpoint directory."""
        directory = Path(path)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise ValueError(f"model path {str(directory)!r} has no config.json")
        raw = json.loads(config_path.read_text())
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        if raw.get("model_type", "llama") not in ("llama", "mistral") and "LlamaForCausalLM" not in archs:
            raise ValueError(f"{config_path}: model_type={raw.get('model_type')!r} is not a "
                             "Llama-architecture model (llama|mistral)")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        scaling = raw.get("rope_scaling") or None
        llama3 = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                llama3 = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                          float(scaling["high_freq_factor"]),
                          int(scaling["original_max_position_embeddings"]))
            elif kind not in (None, "default"):
                raise ValueError(f"{config_path}: rope_scaling type {kind!r} is not supported "
                                 "(default|llama3)")
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):  # Llama-3 instruct lists several; the first ends a turn
            eos = eos[0] if eos else None
        return cls(
            name=directory.name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_llama3_scaling=llama3,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
            path=str(directory),
            torch_dtype=raw.get("torch_dtype"),
        )


# Random-weight presets. ``tiny`` is the CPU demo model (byte-level vocabulary fits in 512);
# ``tiny-256k`` is smaller still but has the widest vocabulary in use (Gemma 3's 262,144 ids), so
# that per-vocabulary costs (sampling, masks) are those of real models on the CPU; the other two
# have the shapes of Llama-3.2-1B and Llama-3.1-8B, so that GPU timings are those of the real
# architectures without downloading anything.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(name="tiny", vocab_size=512, hidden_size=256, intermediate_size=688,
                        num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
                        max_position_embeddings=2048, rope_theta=10000.0, init_std=0.08),
    "tiny-256k": ModelConfig(name="tiny-256k", vocab_size=262144, hidden_size=64, intermediate_size=176,
                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                             max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
                             init_std=0.08),
    "llama-1b": ModelConfig(name="llama-1b", vocab_size=128256, hidden_size=2048,
                            intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                            head_dim=64, max_position_embeddings=8192, rope_theta=500000.0,
                            tie_word_embeddings=True),
    "llama-8b": ModelConfig(name="llama-8b", vocab_size=128256, hidden_size=4096,
                            intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                            head_dim=128, max_position_embeddings=8192, rope_theta=500000.0),
}


def resolve_model_config(model: str) -> ModelConfig:
    """A preset name, or a path to a local HF-style directory."""
    if model in PRESETS:
        return PRESETS[model]
    if os.path.isdir(model):
        return ModelConfig.from_hf_dir(model)
    raise ValueError(f"model={model!r} is neither a preset ({'|'.join(PRESETS)}) nor a "
                     "directory with config.json")


@dataclass(frozen=True)
class HttpLimits:
    """Connection deadlines in seconds and caps (engine/http_limits.py applies them);
    ``max_connections`` is lowered to fit ``RLIMIT_NOFILE`` with the descriptors open at start
    and ``reserved_fds`` more (files, outgoing sockets) left free."""

    header_timeout_s: float = setting(10.0, "seconds a connection's request headers may take (else 408)",
                                      lo=0.0, hi=3600.0, lo_open=True, flag="--http-header-timeout")
    body_timeout_s: float = setting(30.0, "seconds a request body may take once its headers are in "
                                          "(else 408)", lo=0.0, hi=3600.0, lo_open=True,
                                    flag="--http-body-timeout")
    # past the 5 s after which httpx (the openai SDK) stops reusing a connection, so that the
    # client, not the server, ends an idle one and never sends into a closing socket
    keepalive_timeout_s: float = setting(10.0, "seconds an idle connection is kept between requests",
                                         lo=0.0, hi=3600.0, lo_open=True, flag="--http-keepalive-timeout")
    max_connections: int = setting(4096, "open connections at most (lowered to fit the file-descriptor "
                                         "limit)", lo=1, hi=1 << 20)
    peer_share: float = setting(0.5, "fraction of the connections one client address may hold (behind a "
                                     "single gateway or load balancer: 1.0)", lo=0.0, hi=1.0, lo_open=True)
    reserved_fds: int = setting(64, "file descriptors kept free of connections (files, outgoing sockets)",
                                lo=0, hi=1 << 20)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass
class EngineConfig:
    """Everything the engine needs, composed at the top (CLI or tests build one of these).

    KV budget: on CUDA the cache takes what is left of ``gpu_memory_utilization`` of the
    device's memory once weights and the activations of a full-size step are resident; on the
    CPU it takes ``kv_cache_gib``. ``max_model_len`` (prompt + output) defaults to the model's
    position limit, capped by what the cache can hold. Each field is declared once
    (``setting``): its range, its ``sightline engine serve`` flag and its help.
    """

    model: str = setting("tiny", "preset (tiny, llama-1b, llama-8b: random weights) or a local HF-style "
                                 "directory with config.json and *.safetensors")
    served_model_name: str | None = setting(None, "model id reported by the API (default: the model arg)")
    device: Device = setting("auto", "where the model runs")
    dtype: DType = setting("auto", "weights and activations (auto: float32 on the CPU, bfloat16 on CUDA)")
    seed: int = setting(0, "random weights and unseeded sampling", lo=0, hi=2**63 - 1)
    block_size: int = setting(16, "tokens per KV block (8|16|32|64|128)")
    kv_cache_gib: float = setting(0.5, "KV cache size on the CPU", lo=0.0, hi=4096.0, lo_open=True)
    gpu_memory_utilization: float = setting(0.90, "fraction of GPU memory for weights, activations and KV "
                                                  "cache", lo=0.0, hi=1.0, lo_open=True)
    max_model_len: int | None = setting(None, "prompt + output limit", lo=2, hi=1 << 24)
    scheduler: SchedulerConfig = setting(factory=SchedulerConfig)
    attention_backend: Literal["auto", "triton", "torch"] = setting("auto", "attention kernels")
    # CUDA graphs for decode-only steps (captured at start-up per padded batch size, on CUDA
    # only); True runs every step eagerly (vLLM's --enforce-eager).
    enforce_eager: bool = setting(False, "run every step eagerly: no CUDA graphs for decode steps (by "
                                         "default they are captured at start-up on CUDA)")
    cuda_graph_capture_limit_s: float = setting(120.0, "the start-up CUDA graph capture stops past this; "
                                                       "the sizes left are logged", lo=0.0, hi=3600.0,
                                                flag="--cuda-graph-capture-limit", metavar="SECONDS")
    # Before ready, run every kernel variant the configuration can reach (engine/warmup.py),
    # for at most warmup_limit_s (the cases left are logged and reported).
    warmup: bool = setting(True, "before /health answers 200, run every kernel variant the configuration "
                                 "can reach, then capture the CUDA graphs")
    warmup_limit_s: float = setting(600.0, "the warm-up stops past this; the cases left are logged", lo=0.0,
                                    hi=86400.0, lo_open=True, flag="--warmup-limit", metavar="SECONDS")
    # Triton's (and inductor's) compile cache; None: SIGHTLINE_COMPILE_CACHE_DIR, else
    # ~/.cache/sightline/compile (engine/compile_cache.py, which reads the variable)
    compile_cache_dir: str | None = setting(None, "where compiled kernels are kept across restarts (Triton's "
                                                  "cache, FA2 tuning): default SIGHTLINE_COMPILE_CACHE_DIR, "
                                                  "else ~/.cache/sightline/compile", metavar="DIR")
    # Overlapped scheduling: the next step is planned and launched while the device runs this
    # one (vLLM's --async-scheduling). None: on with CUDA, off on the CPU, where the model
    # runs synchronously and there is nothing to overlap.
    async_scheduling: bool | None = setting(None, "plan and launch the next step while the device runs this "
                                                  "one (default: on with CUDA, off on the CPU)")
    # Ranks of tensor parallelism (vLLM's --tensor-parallel-size): 1 runs the model in the
    # engine core alone; N > 1 splits its heads and MLP columns over the core (rank 0) and
    # N - 1 worker processes, one GPU each on CUDA (cuda:0..N-1), gloo on the CPU.
    tensor_parallel_size: int = setting(1, "split the model's heads and MLP columns over N ranks: the engine "
                                           "core and N - 1 worker processes, one GPU each (NCCL), or gloo "
                                           "on the CPU (1: the model in the engine core alone)", lo=1, hi=64,
                                        metavar="N")
    # Automatic prefix caching: full KV blocks found again by their tokens and reused across
    # requests (vLLM's --enable-prefix-caching). None: on with CUDA; off on the CPU, where the
    # engine serves tests and demos whose step counts and timings should not depend on what
    # ran before them (turn it on there with True).
    enable_prefix_caching: bool | None = setting(None, "reuse the KV cache of prompt prefixes seen before, "
                                                       "block by block (default: on with CUDA, off on the CPU)")
    # CPU only: torch intra-op threads. None: all cores but one, which the server's event loop
    # keeps (oversubscribed OpenMP threads spin and stall every step).
    cpu_threads: int | None = setting(None, "torch threads per process on the CPU", lo=1, hi=1024)
    host: str = setting("127.0.0.1", "listen address")
    port: int = setting(8000, "listen port", lo=0, hi=65535)
    http: HttpLimits = setting(factory=HttpLimits)  # connection deadlines and caps
    shutdown_timeout_s: float = setting(30.0, "seconds in-flight requests may finish after SIGTERM", lo=0.0,
                                        hi=3600.0, flag="--shutdown-timeout")
    telemetry: TelemetryConfig | None = setting(None)  # None: tracing off
    # where spans are built: a telemetry process the engine supervises, or a thread here
    telemetry_mode: Literal["process", "thread"] = setting(
        "process", "build spans in a supervised telemetry process or on a thread of the engine's process")

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model={self.model!r} must be a preset name or a directory")
        check_settings(self)
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size={self.block_size!r} is not one of 8|16|32|64|128")
        for name in ("enforce_eager", "warmup"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.compile_cache_dir is not None and (not isinstance(self.compile_cache_dir, str)
                                                   or not self.compile_cache_dir):
            raise ValueError(f"compile_cache_dir={self.compile_cache_dir!r} must be a non-empty "
                             "path or None")
        for name in ("async_scheduling", "enable_prefix_caching"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):   # 1 == True
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool or None")
        if self.tensor_parallel_size > 1:
            resolve_model_config(self.model).check_shardable(self.tensor_parallel_size)
        if not isinstance(self.http, HttpLimits):
            raise ValueError(f"http={self.http!r} must be an HttpLimits")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ValueError(f"scheduler={self.scheduler!r} must be a SchedulerConfig")
        if self.telemetry is not None and not isinstance(self.telemetry, TelemetryConfig):
            raise ValueError(f"telemetry={self.telemetry!r} must be a TelemetryConfig or None")

    @property
    def model_name(self) -> str:
        """The model id the API reports."""
        if self.served_model_name:
            return self.served_model_name
        return self.model if self.model in PRESETS else Path(self.model).name

    def prefix_caching_on(self, device_type: str) -> bool:
        """``enable_prefix_caching``, its default resolved for a device of ``device_type``."""
        if self.enable_prefix_caching is None:
            return device_type == "cuda"
        return self.enable_prefix_caching

    def replace(self, **changes: Any) -> "EngineConfig":
        return replace(self, **changes)
