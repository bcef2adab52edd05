#!/usr/bin/env bash
# One GPU run: install what the GPU machine lacks, then run the named parts, each
# under its own time limit so that one slow part cannot cost the others' results.
#
#   bash bench/gpu_session.sh tests engine overhead-http   # parts, in the order given
#
# Parts: tests (pytest -m gpu on the GPU test modules), probe (bench.kernels --only
# probe), profile (bench.profile_levels: py-spy stacks of each level's engine under load;
# carry .pyspy too), cold-path (bench.telemetry_cold_path on CUDA: the per-step calls by kind
# of step, warm and cold), cupti-idle (bench.cupti_idle_cost: CUPTI's cost to CUDA calls between traced steps), kernels (all of bench.kernels), capture (bench.record_capture; HTTP-served requests),
# overhead-http (bench.overhead_http: served engine, spans to a collector), served
# (bench.served_throughput: the split server's tok/s and TTFT at 1, 64 and 256 concurrent
# beside the offline engine and the weight-read floor),
# engine (the fused-kernel, CUDA-graph (decode and mixed), prefix-cache and sampler GPU tests (alone: engine-tests), then bench.engine_throughput
# on llama-8b: graphs and eager side by side. SIGHTLINE_ENGINE_MODEL/_DEVICE/_ARGS
# override the bench's model, device and extra flags, e.g. tiny/cpu for a CPU dry run),
# decode-step (bench.decode_step: the batch-64 decode step's GEMMs, paged attention and
# argmax, each next to its floor), incident (the neighbour's GPU test, then bench.record_incident: served load with a noisy
# neighbour on measured SMs, calibrated first, the capture diagnosed after), prefix-cache (the prefix cache's GPU
# test, then bench.prefix_cache on llama-8b: cache on and off served side by side), cold-start
# (bench.cold_start on llama-8b through `sightline engine serve`: start-up from an empty compile
# cache and from a warm one, the first request and burst against warm ones, compiles while
# serving; COLD_START_LEVELS picks the trace levels, one per call keeps each call within 10
# minutes), readiness-tests (the GPU tests of tests/engine/test_readiness.py: no kernel variant
# met while serving), scenarios (bench.scenarios: SM neighbours of a quarter and half of the
# SMs, an HBM hog, a GIL-holding thread, a priority burst, a surge of the usual load and a
# control, planted in the engine core of an `engine serve` and scored live by a collector;
# SCENARIOS_ARGS adds flags, e.g. --runs 3).
# Results go to $RESULTS_DIR (default /tmp/sightline-results) and are copied into bench/results/,
# with the commit and device they came from in their names.
#
# The GPU machine has torch, triton and numpy but no network: the remaining wheels come
# from .whl/ (downloaded beforehand with `pip download --only-binary=:all:` for its Python: the OpenTelemetry
# SDK, exporters and proto, grpcio, protobuf, cupti-python, pyelftools, and for the crash test
# in `tests` the openai SDK with httpx2, httpcore2, truststore, jiter, pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions and sniffio), installed into
# /tmp/site, and the project itself into /tmp/site2, without its dependencies.
set -u
RESULTS_DIR=${RESULTS_DIR:-/tmp/sightline-results}
export RESULTS_DIR
mkdir -p "$RESULTS_DIR"
# the installs log outside $RESULTS_DIR, which keeps only the parts' logs and results
pip_log=/tmp/gpu_session_pip.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$pip_log" 2>&1 || tail -n 20 "$pip_log"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site2 . \
    >>"$pip_log" 2>&1 || tail -n 20 "$pip_log"
export PYTHONPATH=/tmp/site2:/tmp/site
export SIGHTLINE_FA2_PREFILL_CONFIG=${SIGHTLINE_FA2_PREFILL_CONFIG:-128,64,8,3}
# the GPU machine may get a copy of the tree without .git: the caller passes SIGHTLINE_COMMIT
export SIGHTLINE_COMMIT=${SIGHTLINE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
commit=${SIGHTLINE_COMMIT:0:8}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv >"$RESULTS_DIR/nvidia-smi.csv" 2>&1

part() {  # name, limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    timeout "$limit" "$@" >"$RESULTS_DIR/$name.log" 2>&1
    echo "== $name rc=$? $(date -u +%H:%M:%S)"
    tail -n 25 "$RESULTS_DIR/$name.log"
}

for p in "$@"; do
    case $p in
    tests) part "gpu-tests-$commit" "${TESTS_LIMIT_S:-150}" python3 -m pytest -q -m gpu \
        tests/engine/test_kernels.py tests/instrumentation/test_sm_probe.py tests/instrumentation/test_dispatch_order.py \
        tests/instrumentation/test_cupti.py tests/instrumentation/test_nvml.py tests/instrumentation/test_host_copy.py \
        tests/engine/test_metrics.py tests/engine/test_async_scheduling.py \
        tests/engine/test_telemetry_process.py ;;
    probe) part "probe-$commit" 120 python3 -m bench.kernels --only probe --out "$RESULTS_DIR" ;;
    profile) python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .pyspy/*.whl >>"$RESULTS_DIR/pip.log" 2>&1
        PATH=/tmp/pyspy/bin:$PATH part "profile_levels-$commit" 300 python3 -m bench.profile_levels \
            --levels "${PROFILE_LEVELS:-off,steps,kernels}" --top 60 --out "$RESULTS_DIR" ${PROFILE_ARGS:-} ;;
    cold-path) part "telemetry_cold_path-$commit" 120 python3 -m bench.telemetry_cold_path --device cuda --out "$RESULTS_DIR" ;;
    cupti-idle) part "cupti_idle_cost-$commit" 240 python3 -m bench.cupti_idle_cost --repeats "${CUPTI_REPEATS:-3}" --out "$RESULTS_DIR" ;;
    kernels) part "kernels-$commit" 420 python3 -m bench.kernels --out "$RESULTS_DIR" ;;
    decode-step) part "decode_step-$commit" 180 python3 -m bench.decode_step --out "$RESULTS_DIR" ;;
    capture) part "capture-$commit" 300 python3 -m bench.record_capture --out "$RESULTS_DIR" ;;
    served) part "served_throughput-$commit" "${SERVED_LIMIT_S:-420}" python3 -m bench.served_throughput \
        --model llama-8b --device cuda --out "$RESULTS_DIR" ${SERVED_ARGS:-} ;;
    overhead-http) part "overhead_http-$commit" "${HTTP_LIMIT_S:-530}" python3 -m bench.overhead_http \
        --model llama-8b --device cuda --rounds "${HTTP_ROUNDS:-12}" --concurrency ${HTTP_CONCURRENCY:-64 256} \
        --levels "${HTTP_LEVELS:-off,off-b,requests,steps,kernels}" --out "$RESULTS_DIR" ${HTTP_ARGS:-} ;;
    engine|engine-tests)
        part "engine-gpu-tests-$commit" 180 python3 -m pytest -q -m gpu \
            tests/engine/test_fused_kernels.py tests/engine/test_cuda_graphs.py \
            tests/engine/test_mixed_graphs.py tests/engine/test_prefix_cache_engine.py \
            tests/engine/test_sampling.py tests/engine/test_async_scheduling.py
        [ "$p" = engine-tests ] && continue
        # shellcheck disable=SC2086  # the extra flags are meant to split
        part "engine-throughput-$commit" "${ENGINE_LIMIT_S:-300}" python3 -m bench.engine_throughput \
            --model "${SIGHTLINE_ENGINE_MODEL:-llama-8b}" --device "${SIGHTLINE_ENGINE_DEVICE:-cuda}" \
            --out "$RESULTS_DIR" ${SIGHTLINE_ENGINE_ARGS:-} ;;
    cold-start)   # the FA2 tuning is part of a cold start: no fixed config here
        SIGHTLINE_FA2_PREFILL_CONFIG= part "cold_start-$commit" "${COLD_START_LIMIT_S:-560}" \
            python3 -m bench.cold_start --model llama-8b --device cuda \
            --levels "${COLD_START_LEVELS:-requests,kernels}" --out "$RESULTS_DIR" --logs "$RESULTS_DIR" ;;
    readiness-tests)
        part "readiness-gpu-tests-$commit" 300 python3 -m pytest -q -m gpu \
            tests/engine/test_readiness.py ;;
    incident)
        part "incident-gpu-test-$commit" 60 python3 -m pytest -q -m gpu tests/instrumentation/test_record_incident.py
        part "incident-$commit" "${INCIDENT_LIMIT_S:-310}" python3 -m bench.record_incident --out "$RESULTS_DIR" ;;
    prefix-cache)
        part "prefix-cache-gpu-test-$commit" 120 python3 -m pytest -q -m gpu tests/engine/test_prefix_cache_engine.py
        part "prefix_cache-$commit" "${PREFIX_CACHE_LIMIT_S:-540}" python3 -m bench.prefix_cache \
            --model llama-8b --device cuda --rounds "${PREFIX_CACHE_ROUNDS:-5}" --out "$RESULTS_DIR" ;;
    dispatch-order) part "dispatch-order-gpu-test-$commit" 90 python3 -m pytest -q -m gpu \
        tests/instrumentation/test_dispatch_order.py ;;
    scenarios) part "scenarios-$commit" "${SCENARIOS_LIMIT_S:-520}" python3 -m bench.scenarios \
        --out "$RESULTS_DIR" ${SCENARIOS_ARGS:-} ;;
    *) echo "unknown part: $p" ;;
    esac
done

# the captures go back in archives of at most 15 MiB: a run brings back 8 files of at most
# 16 MiB each, and its results and logs leave room for 4 archives (a burst's segments alone
# came to more than one)
shopt -s nullglob
captures=("$RESULTS_DIR"/*.jsonl.gz)
if [ ${#captures[@]} -gt 1 ]; then
    archive=1 size=0 batch=()
    pack() {
        if [ ${#batch[@]} -gt 0 ]; then
            tar -C "$RESULTS_DIR" -cf "$RESULTS_DIR/captures-$commit-$archive.tar" "${batch[@]##*/}" && rm -f "${batch[@]}"
            archive=$((archive + 1)) size=0 batch=()
        fi
    }
    for c in "${captures[@]}"; do
        bytes=$(stat -c %s "$c")
        [ $((size + bytes)) -gt $((15 * 1024 * 1024)) ] && pack
        batch+=("$c") size=$((size + bytes))
    done
    pack
fi

# the results name the machine's output folder as $RESULTS_DIR: its path there is no fact about the run
for f in "$RESULTS_DIR"/*.json "$RESULTS_DIR"/*.md "$RESULTS_DIR"/*.log; do
    sed -i "s#$RESULTS_DIR#\$RESULTS_DIR#g" "$f"
done
