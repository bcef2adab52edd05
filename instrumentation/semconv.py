"""Every telemetry name Sightline produces or reads: spans, attributes, metrics, units.

One module, imported by the engine (producer), the collector (consumer), the
dashboards and the alert rules' tests, so that a rename is one edit and a typo is an
``AttributeError`` rather than an empty panel. OpenTelemetry semantic conventions are
used where they exist (``gen_ai.*``, ``http.*``, ``server.*``, ``hw.gpu.*``);
everything else is ``sightline.*``. Prometheus names carry their unit (``_seconds``).
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------
# Resource / instrumentation scope
# ---------------------------------------------------------------------------------
SERVICE_NAME_ENGINE = "sightline-engine"
SERVICE_NAME_COLLECTOR = "sightline-collector"
INSTRUMENTATION_SCOPE = "sightline"

# ---------------------------------------------------------------------------------
# Span names. The request tree is
#   POST /v1/... (SERVER) > tokenize > queue > prefill > decode > detokenize
# Steps are separate traces-of-one-span linked to the requests they served;
# kernels are children of their step.
# ---------------------------------------------------------------------------------
SPAN_HTTP_COMPLETIONS = "POST /v1/completions"
SPAN_HTTP_CHAT_COMPLETIONS = "POST /v1/chat/completions"
SPAN_TOKENIZE = "tokenize"
SPAN_QUEUE = "queue"
SPAN_PREFILL = "prefill"
SPAN_DECODE = "decode"
SPAN_DETOKENIZE = "detokenize"
SPAN_ENGINE_STEP = "engine.step"
# One tensor-parallel rank's part of a step: a child of its engine.step span per rank.
SPAN_RANK_STEP = "engine.step.rank"
# Kernel spans are named after the kernel itself; this prefix marks them.
SPAN_KERNEL_PREFIX = "kernel "
# A traced step's launches of one (non-attention) kernel summarised in one span: "kernels <name>".
# Not a kernel's duration, so the collector's per-kernel latency series leave it out.
SPAN_KERNEL_SUMMARY_PREFIX = "kernels "

REQUEST_PHASE_SPANS = (SPAN_TOKENIZE, SPAN_QUEUE, SPAN_PREFILL, SPAN_DECODE, SPAN_DETOKENIZE)

# ---------------------------------------------------------------------------------
# Span attributes: OpenTelemetry semantic conventions
# ---------------------------------------------------------------------------------
HTTP_REQUEST_METHOD = "http.request.method"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
HTTP_ROUTE = "http.route"
URL_PATH = "url.path"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
# error.type of a request whose client went away: its finish reason is "abort", not an error
ERROR_TYPE_CLIENT_DISCONNECTED = "client_disconnected"

GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "chat" | "text_completion"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
# of the input tokens, those whose KV the engine's prefix cache held (OTel GenAI, experimental)
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
# Opt-in only (SIGHTLINE_CAPTURE_CONTENT / --capture-content).
GEN_AI_PROMPT = "gen_ai.prompt"
GEN_AI_COMPLETION = "gen_ai.completion"

GEN_AI_SYSTEM_VALUE = "sightline"

HW_GPU_ID = "gpu.id"  # attribute of per-SM metrics and kernel spans
# The process that recorded a span's events (request, phase and step spans): with an
# API-server process and an engine-core process, one request's trace has spans of both.
PROCESS_PID = "process.pid"

# ---------------------------------------------------------------------------------
# Span attributes: Sightline's own
# ---------------------------------------------------------------------------------
# request
REQUEST_ID = "sightline.request.id"
REQUEST_PRIORITY = "sightline.request.priority"
# The documented range of a request's priority (an integer, lower is more urgent): the engine
# refuses a value outside it (400) and the collector clamps one to the nearest end (a
# non-integer to "other"), so that client-chosen values cannot multiply the per-priority series.
REQUEST_PRIORITY_MIN, REQUEST_PRIORITY_MAX = -100, 100
PRIORITY_LABEL_OTHER = "other"
REQUEST_STREAM = "sightline.request.stream"
REQUEST_TTFT_S = "sightline.request.time_to_first_token_s"
REQUEST_TPOT_S = "sightline.request.time_per_output_token_s"
REQUEST_QUEUE_S = "sightline.request.queue_time_s"
REQUEST_E2E_S = "sightline.request.e2e_s"
REQUEST_PREEMPTIONS = "sightline.request.preemptions"
REQUEST_PREFILL_CHUNKS = "sightline.request.prefill_chunks"
EVENT_PREEMPTED = "sightline.preempted"
EVENT_FIRST_TOKEN = "sightline.first_token"

# which kind of process recorded a span's events (with PROCESS_PID)
PROCESS_ROLE = "sightline.process.role"
PROCESS_ROLE_API_SERVER = "api_server"      # HTTP, tokenize, detokenize: the server span
PROCESS_ROLE_ENGINE_CORE = "engine_core"    # scheduler and GPU: queue, prefill, decode, steps

# step
STEP_ID = "sightline.step.id"
STEP_BATCH_SIZE = "sightline.step.batch_size"
STEP_PREFILL_TOKENS = "sightline.step.prefill_tokens"  # computed (the prefix cache's are not)
# prompt tokens of the requests this step admitted whose KV came from the prefix cache
# (on every step of an engine with a prefix cache, 0 included; absent without one)
STEP_PREFILL_CACHED_TOKENS = "sightline.step.prefill_cached_tokens"
STEP_DECODE_TOKENS = "sightline.step.decode_tokens"
STEP_NUM_PREFILL_SEQS = "sightline.step.prefill_seqs"
STEP_NUM_DECODE_SEQS = "sightline.step.decode_seqs"
STEP_KV_BLOCKS_USED = "sightline.step.kv_blocks_used"
STEP_KV_BLOCKS_TOTAL = "sightline.step.kv_blocks_total"
# on a step whose kernels were traced (CUPTI on), and on its kernel spans; one of:
STEP_TRACE_REASON = "sightline.step.kernel_trace_reason"
TRACE_REASON_SAMPLED = "sampled"        # the random draw at the usual ratio
TRACE_REASON_AFTER_TAIL = "after_tail"  # the step after one over the recent P99.9
TRACE_REASON_SLOW_SPELL = "slow_spell"  # the random draw during a slow spell (a higher ratio)
# the first step with prefill tokens once none was traced for an interval (chosen by kind, not speed)
TRACE_REASON_PREFILL = "prefill_interval"
# whether the step's forward pass ran as a CUDA graph replay (decode-only steps), and the
# padded batch size of the graph it replayed (absent when eager)
STEP_CUDA_GRAPH = "sightline.step.cuda_graph"
STEP_GRAPH_BATCH_SIZE = "sightline.step.graph_batch_size"
# on a step with prefill tokens whose work between attentions replayed CUDA graphs: their
# padded token count (the attention kernels ran eagerly)
STEP_GRAPH_TOKENS = "sightline.step.graph_tokens"
# on a step whose kernels were traced: when the engine began waiting for its results. With
# overlapped scheduling the next step is planned and launched first; the step's end beyond
# this and its kernels is its own host time, the time before it the next step's
STEP_WAIT_START_NS = "sightline.step.wait_start_unix_nano"
# on a step whose kernels were traced: the CPU time the engine's thread spent in the step's
# host phases (its launches, and from its wait's return to its end). Host time beyond this is
# time the thread was kept off the CPU (another thread holding the GIL, another process on
# its core): a stall, where CPU time that grows with the batch is the engine's own work
STEP_HOST_CPU_S = "sightline.step.host_cpu_s"
# on a step whose launches met kernel variants for the first time in the process (a compile,
# a load from the on-disk cache or an autotuning while serving: each one a defect of the
# warm-up): how many, which kernels (one name per variant) and the seconds they took
STEP_JIT_COMPILES = "sightline.step.jit_compiles"
STEP_JIT_COMPILE_KERNELS = "sightline.step.jit_compile_kernels"
STEP_JIT_COMPILE_S = "sightline.step.jit_compile_s"

# start-up: one trace per engine start, a root span and one child span per phase
SPAN_ENGINE_STARTUP = "engine.startup"
SPAN_STARTUP_PHASE_PREFIX = "engine.startup."   # + the phase name
STARTUP_PHASE = "sightline.startup.phase"
STARTUP_STATUS = "sightline.startup.status"     # compiled | cached | warm | timed_out
STARTUP_VARIANTS_RUN = "sightline.startup.variants_run"
STARTUP_VARIANTS_SKIPPED = "sightline.startup.variants_skipped"   # past the time limit
STARTUP_VARIANTS_COMPILED = "sightline.startup.variants_compiled"
STARTUP_VARIANTS_CACHED = "sightline.startup.variants_cached"     # from the on-disk cache
STARTUP_AUTOTUNED = "sightline.startup.autotuned"
STARTUP_KERNELS_COMPILED = "sightline.startup.kernels_compiled"   # kernel[constexprs] per variant
STARTUP_COMPILE_S = "sightline.startup.compile_s"
STARTUP_COMPILE_CACHE_DIR = "sightline.startup.compile_cache_dir"
STARTUP_DURATION_S = "sightline.startup.duration_s"   # root: process start to ready
# Phase names (span suffixes and the phase label of ENGINE_STARTUP_SECONDS), in order.
STARTUP_IMPORTS = "imports"                 # process start to the engine's construction
STARTUP_LOAD_WEIGHTS = "load_weights"
STARTUP_PROFILE_MEMORY = "profile_memory"   # CUDA: a full-size step sizes the KV cache
STARTUP_ALLOCATE_KV = "allocate_kv"
STARTUP_WARMUP_FUSED = "warmup_fused_kernels"   # RMSNorm, SwiGLU, RoPE
STARTUP_WARMUP_PREFILL = "warmup_prefill"
STARTUP_WARMUP_DECODE = "warmup_decode"
STARTUP_WARMUP_MIXED = "warmup_mixed"
STARTUP_WARMUP_SAMPLER = "warmup_sampler"
STARTUP_WARMUP_TELEMETRY = "warmup_telemetry"   # SM probe and CUPTI (trace level kernels)
STARTUP_CUDA_GRAPHS = "cuda_graph_capture"
STARTUP_PHASES = (STARTUP_IMPORTS, STARTUP_LOAD_WEIGHTS, STARTUP_PROFILE_MEMORY,
                  STARTUP_ALLOCATE_KV, STARTUP_WARMUP_FUSED, STARTUP_WARMUP_PREFILL,
                  STARTUP_WARMUP_DECODE, STARTUP_WARMUP_MIXED, STARTUP_WARMUP_SAMPLER,
                  STARTUP_CUDA_GRAPHS, STARTUP_WARMUP_TELEMETRY)

# tensor parallelism. On a step whose ranks reported their part: the group's size, and per
# rank (index = rank) the seconds of its forward pass spent computing and waiting inside
# collectives (a rank that arrives early at an all-reduce waits for the others there).
TP_SIZE = "sightline.tp.size"
TP_RANK = "sightline.tp.rank"  # on rank spans, kernel spans and per-SM metrics
STEP_RANK_COMPUTE_S = "sightline.step.rank_compute_s"  # double array
STEP_RANK_COLLECTIVE_WAIT_S = "sightline.step.rank_collective_wait_s"  # double array
# on a rank span
RANK_COMPUTE_S = "sightline.rank.compute_s"
RANK_COLLECTIVE_WAIT_S = "sightline.rank.collective_wait_s"
RANK_COLLECTIVE_CALLS = "sightline.rank.collective_calls"
# on collective kernel spans (NCCL) and rank spans: the collective and its payload per call
COLLECTIVE_OP = "sightline.collective.op"  # "all_reduce"
COLLECTIVE_BYTES = "sightline.collective.bytes"

# kernel (CUPTI)
CUDA_KERNEL_NAME = "cuda.kernel.name"
CUDA_GRID = "cuda.kernel.grid"  # "x,y,z"
CUDA_BLOCK = "cuda.kernel.block"
CUDA_REGISTERS = "cuda.kernel.registers_per_thread"
CUDA_SHARED_MEMORY_BYTES = "cuda.kernel.shared_memory_bytes"
CUDA_STREAM = "cuda.stream.id"
CUDA_DEVICE = "cuda.device.id"
CUDA_CORRELATION_ID = "cuda.correlation_id"
KERNEL_SMS_USED = "sightline.kernel.sms_used"
KERNEL_WAVES = "sightline.kernel.waves"
KERNEL_SLOWEST_SM = "sightline.kernel.slowest_sm"
KERNEL_CTA_SPREAD = "sightline.kernel.cta_duration_spread"  # max/median CTA duration
KERNEL_CTAS = "sightline.kernel.ctas"
# A kernel span that summarises every launch of one kernel in a traced step (all but the
# attention kernels, which get a span per launch): its start is the first launch's start,
# its end the last launch's end.
KERNEL_LAUNCHES = "sightline.kernel.launches"
KERNEL_TOTAL_DURATION_S = "sightline.kernel.total_duration_s"
KERNEL_MAX_DURATION_S = "sightline.kernel.max_duration_s"
# when the host's (last) launch call of the span's kernels returned (Unix ns, CUPTI's API
# records): a step's host time is until its last launch; after it, kernels wait on the GPU
KERNEL_LAUNCH_END_NS = "sightline.kernel.launch_end_unix_nano"

# ---------------------------------------------------------------------------------
# OTLP metrics emitted by the instrumentation (names per OTel conventions)
# ---------------------------------------------------------------------------------
METRIC_CTA_DURATION = "gpu.kernel.cta.duration"  # exponential histogram, unit "s"
METRIC_CTA_DURATION_UNIT = "s"
ATTR_GPU_ID = "gpu.id"  # the GPU's index on its host (every host's first GPU is 0)
ATTR_GPU_UUID = "gpu.uuid"  # NVML's UUID: the GPU's identity across hosts
ATTR_SM_ID = "gpu.sm.id"
ATTR_KERNEL_NAME = "cuda.kernel.name"
# Sum (delta, per gpu and kernel): CTAs of the launches with at least WIDE_LAUNCH_WAVES times
# as many CTAs as the GPU has SMs, and of one-wave launches of kernels that rotate their work
# over their CTAs at each launch. Other launches put the same CTA (the same work) on the same
# SM launch after launch, so only these CTAs' durations say something of the SM they ran on.
METRIC_CTA_WIDE = "gpu.kernel.cta.wide_launches"
METRIC_CTA_COUNT_UNIT = "{cta}"  # the CTA-count sums below (wide launches, dealt)
ATTR_GPU_SM_COUNT = "gpu.sm.count"  # on METRIC_CTA_WIDE points: the GPU's SMs
WIDE_LAUNCH_WAVES = 2
# Sum (delta, per gpu, SM and kernel): the probed CTAs that the GPU's dispatch order deals
# this SM (instrumentation/dispatch_order.py); what an SM should run with nothing else on it.
METRIC_CTA_DEALT = "gpu.kernel.cta.dealt"

# ---------------------------------------------------------------------------------
# Prometheus metrics: the engine's /metrics
# ---------------------------------------------------------------------------------
ENGINE_PREFIX = "sightline_engine_"
ENGINE_REQUESTS_TOTAL = "sightline_engine_requests"  # counter -> _total; labels model, finish_reason
ENGINE_REQUEST_ERRORS_TOTAL = "sightline_engine_request_errors"  # labels model, code
ENGINE_TTFT_SECONDS = "sightline_engine_time_to_first_token_seconds"
ENGINE_TPOT_SECONDS = "sightline_engine_time_per_output_token_seconds"
ENGINE_E2E_SECONDS = "sightline_engine_e2e_request_latency_seconds"
ENGINE_QUEUE_SECONDS = "sightline_engine_queue_time_seconds"
ENGINE_RUNNING = "sightline_engine_requests_running"
ENGINE_WAITING = "sightline_engine_requests_waiting"
ENGINE_KV_USAGE = "sightline_engine_kv_cache_usage_ratio"
ENGINE_PREEMPTIONS_TOTAL = "sightline_engine_preemptions"
ENGINE_STEP_SECONDS = "sightline_engine_step_duration_seconds"
ENGINE_STEP_TOKENS = "sightline_engine_step_tokens"
ENGINE_PROMPT_TOKENS_TOTAL = "sightline_engine_prompt_tokens"
ENGINE_GENERATION_TOKENS_TOTAL = "sightline_engine_generation_tokens"
# What vLLM users expect beside those: one ITL observation per generated token after the
# first; per finished request its token counts and its prefill (first scheduled to first
# token) and decode (first token to last) times.
ENGINE_ITL_SECONDS = "sightline_engine_inter_token_latency_seconds"
ENGINE_REQUEST_PROMPT_TOKENS = "sightline_engine_request_prompt_tokens"
ENGINE_REQUEST_GENERATION_TOKENS = "sightline_engine_request_generation_tokens"
ENGINE_PREFILL_SECONDS = "sightline_engine_request_prefill_time_seconds"
ENGINE_DECODE_SECONDS = "sightline_engine_request_decode_time_seconds"
# Prefix cache. Queries and hits count tokens, as vLLM's: a request's tokens when it is
# admitted and, of those, the ones whose KV the cache held (a preempted request admitted
# again is counted again). Blocks: cached now, held or evictable; evictions: cached blocks
# taken for other content. TTFT by outcome: label prefix_cache, hit when any prompt token
# was served from the cache.
ENGINE_PREFIX_CACHE_QUERIES_TOTAL = "sightline_engine_prefix_cache_queries"
ENGINE_PREFIX_CACHE_HITS_TOTAL = "sightline_engine_prefix_cache_hits"
ENGINE_PREFIX_CACHE_BLOCKS = "sightline_engine_prefix_cache_blocks"
ENGINE_PREFIX_CACHE_EVICTIONS_TOTAL = "sightline_engine_prefix_cache_evictions"
ENGINE_PREFIX_CACHE_TTFT_SECONDS = "sightline_engine_prefix_cache_time_to_first_token_seconds"
# Connections the HTTP server closed, by reason (a deadline, a slot given to a newer one, or
# refused with 503): engine/http_limits.py's CLOSE_REASONS
ENGINE_HTTP_CONNECTIONS_CLOSED_TOTAL = "sightline_engine_http_connections_closed"  # labels model, reason
# start-up (gauges, set once ready): seconds per phase (label phase), and process start to ready
ENGINE_STARTUP_SECONDS = "sightline_engine_startup_seconds"
ENGINE_STARTUP_TOTAL_SECONDS = "sightline_engine_startup_total_seconds"
# counter -> _total; labels model, kernel, kind (compiled | disk_cache | autotune): kernel
# variants met for the first time while serving. Any increase is a defect of the warm-up.
ENGINE_JIT_COMPILES_TOTAL = "sightline_engine_jit_compiles"
# GPU health (NVML)
GPU_MEMORY_USED_BYTES = "sightline_gpu_memory_used_bytes"  # labels gpu
GPU_PROCESS_MEMORY_BYTES = "sightline_gpu_process_memory_used_bytes"  # labels gpu, pid
GPU_CUDA_CONTEXTS = "sightline_gpu_cuda_contexts"  # labels gpu (processes with a context)
# Telemetry pipeline self-metrics (exporters inside the engine)
TELEMETRY_SPANS_DROPPED_TOTAL = "sightline_telemetry_spans_dropped"
TELEMETRY_EXPORT_FAILURES_TOTAL = "sightline_telemetry_export_failures"
TELEMETRY_SPANS_EXPORTED_TOTAL = "sightline_telemetry_spans_exported"
# counter -> _total, label reason: lifecycle events and GPU records the engine could not
# hand to its telemetry process (buffer_full | process_down | queue_full | build_error)
TELEMETRY_EVENTS_DROPPED_TOTAL = "sightline_telemetry_events_dropped"
TELEMETRY_PROCESS_RESTARTS_TOTAL = "sightline_telemetry_process_restarts"  # counter -> _total
TELEMETRY_PROCESS_UP = "sightline_telemetry_process_up"  # gauge: 1 while it runs
# counters -> _total, in the telemetry process: a request's events that arrived before its
# start (from another producer process) and waited for it; events never matched to a request
TELEMETRY_EVENTS_HELD_TOTAL = "sightline_telemetry_events_held"
TELEMETRY_EVENTS_ORPHANED_TOTAL = "sightline_telemetry_events_orphaned"

LABEL_MODEL = "model"
LABEL_PRIORITY = "priority"
LABEL_FINISH_REASON = "finish_reason"
LABEL_CODE = "code"
# On the collector's per-SM series: the GPU's identity, gpu.uuid when the producer sends it,
# else "<instance_id>:<gpu.id>" (every host's first GPU is gpu.id=0).
LABEL_GPU = "gpu"
LABEL_GPU_INDEX = "gpu_index"  # gpu.id
# the producing resource (service.instance.id, else host.name); not "instance", which
# Prometheus sets to the scraped target (the collector)
LABEL_INSTANCE_ID = "instance_id"
LABEL_KERNEL_NAME = "kernel_name"  # the whole name, where the kernel label is shortened
LABEL_SM = "sm"
LABEL_KERNEL = "kernel"
LABEL_RECEIVER = "receiver"
LABEL_REASON = "reason"
LABEL_SIGNAL = "signal"
LABEL_PHASE = "phase"
LABEL_PID = "pid"
LABEL_RANK = "rank"
LABEL_PREFIX_CACHE = "prefix_cache"  # a request's prefix cache outcome: hit | miss
PREFIX_CACHE_HIT = "hit"
PREFIX_CACHE_MISS = "miss"
LABEL_COMPILE_KIND = "kind"   # compiled | disk_cache | autotune
LABEL_CAUSE = "cause"

# The cause classes explain names for a slow request (collector/causes.py)
CAUSE_SM_CONTENTION = "sm_contention"  # another tenant on some SMs
CAUSE_DEVICE_CONTENTION = "device_contention"  # every SM slower alike (memory bandwidth, clocks)
CAUSE_HOST_STALL = "host_stall"  # the GPU idle between kernels: the engine's host side was held up
CAUSE_QUEUEING = "queueing"  # waiting behind other (more urgent) requests
CAUSE_COMPILE = "compile"  # a kernel compiled while serving
CAUSE_PREFILL_INTERFERENCE = "prefill_interference"  # its decode steps carried other requests' prefill
CAUSE_UNKNOWN = "unknown"
CAUSES = (CAUSE_SM_CONTENTION, CAUSE_DEVICE_CONTENTION, CAUSE_HOST_STALL, CAUSE_QUEUEING, CAUSE_COMPILE,
          CAUSE_PREFILL_INTERFERENCE, CAUSE_UNKNOWN)

# Buckets after the OpenTelemetry GenAI semantic conventions' recommendations.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12,
                              10.24, 20.48, 40.96, 81.92)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075) + TPOT_BUCKETS_S + (5.0, 10.0)
# 1-2-5 steps, as vLLM's request token histograms
REQUEST_TOKENS_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
STEP_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
TOKENS_PER_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# ---------------------------------------------------------------------------------
# Prometheus metrics: the collector's /metrics
# ---------------------------------------------------------------------------------
COLLECTOR_REQUEST_TTFT_SECONDS = "sightline_request_time_to_first_token_seconds"  # model, priority
COLLECTOR_REQUEST_TPOT_SECONDS = "sightline_request_time_per_output_token_seconds"
COLLECTOR_REQUEST_E2E_SECONDS = "sightline_request_e2e_seconds"
COLLECTOR_REQUEST_QUEUE_SECONDS = "sightline_request_queue_seconds"
COLLECTOR_REQUESTS_TOTAL = "sightline_requests"  # model, priority, finish_reason
COLLECTOR_KERNEL_DURATION_SECONDS = "sightline_kernel_duration_seconds"  # gpu, kernel
COLLECTOR_STEP_DURATION_SECONDS = "sightline_step_duration_seconds"
COLLECTOR_SM_CTA_DURATION_SECONDS = "sightline_sm_cta_duration_seconds"  # gpu, sm, kernel
COLLECTOR_SM_CTA_P99_SECONDS = "sightline_sm_cta_p99_seconds"  # gauge over the last window
COLLECTOR_SM_HOTSPOT_RATIO = "sightline_sm_hotspot_ratio"  # gpu, kernel: max SM P99 / median SM P99
COLLECTOR_SM_HOTTEST = "sightline_sm_hottest"  # gpu, kernel: the SM with the largest P99
# gpu, kernel, reason (CONTENTION_REASONS): SMs the contention tests (collector/contention.py)
# flagged in any slot of the gauge window; 0 when none
COLLECTOR_SM_CONTENDED = "sightline_sm_contended_sms"
# gpu, kernel, sm: only SMs flagged then (sparse): the largest contention score of their
# flagged slots, max(own P90 / other SMs' P90, expected CTAs / own CTAs)
COLLECTOR_SM_CONTENTION_SCORE = "sightline_sm_contention_score"
CONTENTION_SLOW = "slow"  # more of its CTAs than chance allows above the other SMs' P90
CONTENTION_STARVED = "starved"  # fewer CTAs than chance allows against its share of the slot's
CONTENTION_REASONS = (CONTENTION_SLOW, CONTENTION_STARVED)
# gpu, kernel: CTA durations of all SMs of one GPU (classic buckets)
COLLECTOR_GPU_CTA_DURATION_SECONDS = "sightline_gpu_cta_duration_seconds"
COLLECTOR_GPU_INFO = "sightline_gpu"  # gpu, instance_id, gpu_index: 1 per GPU with per-SM data
COLLECTOR_SM_KERNEL_INFO = "sightline_sm_kernel"  # kernel (short), kernel_name: 1 per kernel
# tensor parallelism, per producing instance (label instance_id) and rank (label rank):
# steps whose ranks all reported, the steps that named each rank the straggler (the rank
# the others waited for), and each rank's compute and collective-wait seconds (counters ->
# _total); the straggler of the newest complete window slot with steps (-1: none) and the
# share of that slot's steps that named it (gauges).
COLLECTOR_TP_STEPS_TOTAL = "sightline_tp_steps"
COLLECTOR_TP_STRAGGLER_STEPS_TOTAL = "sightline_tp_straggler_steps"
COLLECTOR_TP_COMPUTE_SECONDS_TOTAL = "sightline_tp_rank_compute_seconds"
COLLECTOR_TP_COLLECTIVE_WAIT_SECONDS_TOTAL = "sightline_tp_rank_collective_wait_seconds"
COLLECTOR_TP_STRAGGLER_RANK = "sightline_tp_straggler_rank"
COLLECTOR_TP_STRAGGLER_SHARE = "sightline_tp_straggler_share"
# counter -> _total, label cause (CAUSES): slow requests the collector explained, by the cause
# it named (collector/causes.py); each request counted once, when it is first classified
COLLECTOR_SLOW_REQUESTS_EXPLAINED = "sightline_slow_requests_explained"
# self-metrics
COLLECTOR_SPANS_RECEIVED_TOTAL = "sightline_collector_spans_received"  # receiver
COLLECTOR_DATAPOINTS_RECEIVED_TOTAL = "sightline_collector_data_points_received"  # receiver
COLLECTOR_REJECTED_TOTAL = "sightline_collector_rejected"  # receiver, reason
COLLECTOR_DROPPED_TOTAL = "sightline_collector_dropped"  # reason
COLLECTOR_QUEUE_DEPTH = "sightline_collector_queue_depth"
COLLECTOR_PROCESSING_SECONDS = "sightline_collector_processing_seconds"
COLLECTOR_SCRAPES_CUT_TOTAL = "sightline_collector_scrapes_cut"  # counter -> _total: /metrics past its write deadline
COLLECTOR_SERIES_OVERFLOW_TOTAL = "sightline_collector_series_overflow"
# counter -> _total, label family: series let go from a full table after idling past the
# window horizon (their counters restart at 0 if they come back)
COLLECTOR_SERIES_EVICTED_TOTAL = "sightline_collector_series_evicted"

# Histogram buckets for the collector's exposition of span-derived latencies and
# per-SM CTA durations (seconds). CTA durations of attention blocks span ~1 us..100 ms.
COLLECTOR_LATENCY_BUCKETS_S = TTFT_BUCKETS_S + (20.0, 40.0, 80.0)
CTA_BUCKETS_S = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3,
                 1e-2, 2e-2, 5e-2, 1e-1)

# Receiver label values
RECEIVER_OTLP_GRPC = "otlp_grpc"
RECEIVER_OTLP_HTTP = "otlp_http"
RECEIVER_ZIPKIN = "zipkin"
RECEIVER_REPLAY = "replay"

# Recording rule names (deploy/prometheus rules; dashboards read them)
RULE_TTFT_P99 = "sightline:request_ttft_seconds:p99_5m"
RULE_ERROR_RATIO_PREFIX = "sightline:request_error_ratio:rate"
RULE_SM_HOTSPOT = "sightline:sm_cta_p99_over_median:ratio"

# ---------------------------------------------------------------------------------
# Link bookkeeping on request-phase and step spans
# ---------------------------------------------------------------------------------
# Links beyond the per-span cap (TelemetryConfig.max_links_per_span) are not added;
# this attribute counts them so that readers know the link list is partial.
SPAN_LINKS_DROPPED = "sightline.span.links_dropped"
# Name of the phase span open when an event happened (e.g. on EVENT_PREEMPTED).
PHASE_NAME = "sightline.phase"

# Collector aggregation: refusals and the overflow series' family label.
COLLECTOR_AGGREGATOR_DROPPED_TOTAL = "sightline_collector_aggregator_dropped"  # reason
LABEL_FAMILY = "family"
OVERFLOW_LABEL_VALUE = "__overflow__"

# Recording rules and the exemplar label of the dashboards and alerts.
# The label under which exemplars carry the trace id; Grafana's Prometheus datasource
# links it to Tempo (deploy/grafana provisioning).
EXEMPLAR_TRACE_ID_LABEL = "trace_id"
# Fraction of requests whose TTFT exceeded the SLO threshold, per window (suffix 5m, 1h...).
RULE_TTFT_SLO_BAD_RATIO_PREFIX = "sightline:request_ttft_over_slo_ratio:rate"
RULE_KERNEL_P99 = "sightline:kernel_duration_seconds:p99_5m"  # gpu, kernel
# instance_id, rank: the share of tensor-parallel steps that named the rank the straggler
RULE_TP_STRAGGLER_SHARE = "sightline:tp_straggler_share:ratio_5m"

# ---------------------------------------------------------------------------------
# Engine-agnostic series, recorded by the adapter rules (deploy/prometheus_adapter.py)
# from Sightline's engine and collector and from vLLM. Dashboards and SLO alerts read
# only these. Names follow vLLM's where one exists; histograms and counters keep the
# client libraries' suffixes (_bucket/_sum/_count, _total). Labels: model, le,
# finish_reason, code, priority (sampled set only, where known), plus job/instance.
# ---------------------------------------------------------------------------------
LLM_TTFT_SECONDS = "llm:time_to_first_token_seconds"
LLM_ITL_SECONDS = "llm:inter_token_latency_seconds"
LLM_TPOT_SECONDS = "llm:time_per_output_token_seconds"
LLM_E2E_SECONDS = "llm:e2e_request_latency_seconds"
LLM_QUEUE_SECONDS = "llm:request_queue_time_seconds"
LLM_PREFILL_SECONDS = "llm:request_prefill_time_seconds"
LLM_DECODE_SECONDS = "llm:request_decode_time_seconds"
LLM_REQUEST_PROMPT_TOKENS = "llm:request_prompt_tokens"
LLM_REQUEST_GENERATION_TOKENS = "llm:request_generation_tokens"
LLM_ITERATION_TOKENS = "llm:iteration_tokens"  # histogram: tokens per engine step
LLM_REQUESTS_TOTAL = "llm:requests"  # counter -> _total; finish_reason
LLM_REQUEST_ERRORS_TOTAL = "llm:request_errors"  # counter -> _total; code ("500", or vLLM's "5xx")
LLM_PROMPT_TOKENS_TOTAL = "llm:prompt_tokens"
LLM_GENERATION_TOKENS_TOTAL = "llm:generation_tokens"
LLM_PREEMPTIONS_TOTAL = "llm:preemptions"
LLM_RUNNING = "llm:requests_running"
LLM_WAITING = "llm:requests_waiting"
LLM_KV_USAGE = "llm:kv_cache_usage_ratio"
LLM_PREFIX_CACHE_QUERIES_TOTAL = "llm:prefix_cache_queries"  # counter -> _total; tokens
LLM_PREFIX_CACHE_HITS_TOTAL = "llm:prefix_cache_hits"
# Sightline only (vLLM exposes no such series):
LLM_PREFIX_CACHE_BLOCKS = "llm:prefix_cache_blocks"
LLM_PREFIX_CACHE_EVICTIONS_TOTAL = "llm:prefix_cache_evictions"
LLM_PREFIX_CACHE_TTFT_SECONDS = "llm:prefix_cache_time_to_first_token_seconds"  # prefix_cache
# The sampled set: per-request latencies with a priority label, from request traces where
# a Sightline collector receives them (sampled requests only: counts undercount at
# sampling < 1), else from the engine's own histograms (vLLM: every request, no priority).
LLM_SAMPLED_TTFT_SECONDS = "llm:sampled_time_to_first_token_seconds"
LLM_SAMPLED_TPOT_SECONDS = "llm:sampled_time_per_output_token_seconds"
LLM_SAMPLED_E2E_SECONDS = "llm:sampled_e2e_request_latency_seconds"
LLM_SAMPLED_QUEUE_SECONDS = "llm:sampled_request_queue_time_seconds"
LLM_SAMPLED_REQUESTS_TOTAL = "llm:sampled_requests"  # counter -> _total; finish_reason, priority
# Added by the adapter to every llm: series: which engine's series it copies.
LABEL_SOURCE = "source"
SOURCE_SIGHTLINE = "sightline"
SOURCE_VLLM = "vllm"

# vLLM's own series (vllm/v1/metrics/loggers.py), read by the adapter. Labels model_name
# and engine (the engine-core index); request_success carries finished_reason.
VLLM_TTFT_SECONDS = "vllm:time_to_first_token_seconds"
VLLM_ITL_SECONDS = "vllm:inter_token_latency_seconds"
VLLM_TPOT_SECONDS = "vllm:request_time_per_output_token_seconds"
VLLM_E2E_SECONDS = "vllm:e2e_request_latency_seconds"
VLLM_QUEUE_SECONDS = "vllm:request_queue_time_seconds"
VLLM_PREFILL_SECONDS = "vllm:request_prefill_time_seconds"
VLLM_DECODE_SECONDS = "vllm:request_decode_time_seconds"
VLLM_REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
VLLM_REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
VLLM_ITERATION_TOKENS = "vllm:iteration_tokens_total"  # a histogram despite its _total
VLLM_REQUEST_SUCCESS_TOTAL = "vllm:request_success"  # counter -> _total; finished_reason
VLLM_PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens"
VLLM_GENERATION_TOKENS_TOTAL = "vllm:generation_tokens"
VLLM_PREEMPTIONS_TOTAL = "vllm:num_preemptions"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"  # a fraction 0..1 despite its name
VLLM_PREFIX_CACHE_QUERIES_TOTAL = "vllm:prefix_cache_queries"  # counter -> _total; tokens
VLLM_PREFIX_CACHE_HITS_TOTAL = "vllm:prefix_cache_hits"
# vLLM's HTTP server counts responses through prometheus-fastapi-instrumentator
VLLM_HTTP_REQUESTS_TOTAL = "http_requests"  # counter -> _total; handler, method, status ("2xx".."5xx")
VLLM_LABEL_MODEL = "model_name"
VLLM_LABEL_FINISHED_REASON = "finished_reason"
VLLM_LABEL_STATUS = "status"
VLLM_LABEL_HANDLER = "handler"

# Zipkin receiver (collector/zipkin.py): how Zipkin v2 fields land in OTLP.
RESOURCE_SERVICE_NAME = "service.name"
RESOURCE_SERVICE_INSTANCE_ID = "service.instance.id"
RESOURCE_HOST_NAME = "host.name"
PEER_SERVICE = "peer.service"
NETWORK_PEER_ADDRESS = "network.peer.address"
NETWORK_PEER_PORT = "network.peer.port"
NETWORK_LOCAL_ADDRESS = "network.local.address"
NETWORK_LOCAL_PORT = "network.local.port"
ZIPKIN_SHARED = "zipkin.shared"  # Zipkin's "shared": the span id is shared with the client
ZIPKIN_SCOPE_NAME = "sightline.zipkin"  # instrumentation scope of converted spans
