#!/usr/bin/env bash
# One device call on a lent 1x H200 (python3 with torch 2.11+cu130; no megatron-core, Transformer
# Engine or apex; no network): install megatron-core from the wheels carried in .whl/ into
# /tmp/site, build the CUDA extension, run scripts/throughput.py for proxy_1gpu (DeepSeek-V3 MoE
# layer) and proxy_qwen3_30b_1gpu (Qwen3-30B-A3B MoE layer) with alltoall and mok, 20 iterations
# each; alltoall first, so the speed-up column reads as mok over alltoall.
# The two tables print last.
#
#     bash scripts/device_throughput.sh                 # from the repository root; carry .whl
#
# Knobs (environment): ITERS (20); CONFIGS ("proxy_1gpu proxy_qwen3_30b_1gpu"); DISPATCHERS
# (alltoall,mok: the first is the baseline); PROFILE=1 (one more step per run under torch.profiler:
# MoE layers vs the rest); REBUILD=1 (build even if megatron_mok/_C*.so exists); SKIP_BUILD=1;
# RUN_TIMEOUT (seconds per training run, 180); BUDGET (seconds for the whole script, 540);
# MOK_BACKEND (kernel: a missing extension fails instead of timing the reference).
# A CPU smoke test: SKIP_BUILD=1 MOK_BACKEND=reference CONFIGS=tiny ITERS=3.
#
# Files in $OUT (flat; the device tool brings back 8): build.log, CONFIG.json, CONFIG.png,
# CONFIG.md for each config, logs.tar.gz (every run's Megatron log and the drivers' output).
#
# Time, estimated (not measured as one script): the build (two nvcc translation units, so MAX_JOBS
# hardly matters), then per training run ~30-45 s of start-up (imports, model init, torch.compile
# warm-ups) plus 20 iterations: proxy_1gpu ~0.85 s (mok) / ~1.1 s (alltoall) each, the Qwen3
# proxy well under 1 s (mok) / ~1-2 s (alltoall, 128 SequentialMLP experts). Four runs ~3-4 min.
# The build measured 2 min 39 s on a busy 2-core CPU host (both units in parallel, 1 min 45 s CPU),
# so about 1-1.5 min there; the whole script ~5-6 min. The Qwen3 proxy is cut to 6 layers and vocab
# 32768 for memory and time (configs/proxy_qwen3_30b_1gpu.yaml).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/mok_out}
ITERS=${ITERS:-20}
CONFIGS=${CONFIGS:-proxy_1gpu proxy_qwen3_30b_1gpu}
DISPATCHERS=${DISPATCHERS:-alltoall,mok}
SCRATCH=/tmp/mok_throughput
mkdir -p "$OUT" "$SCRATCH"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Multicast stays off on these machines (KINDS.md); one GPU does not use it anyway.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$(date +%s)

if ! python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('megatron') is None)"; then
    ls .whl/megatron_core-*.whl >/dev/null 2>&1 \
        || { echo "device_throughput.sh: megatron-core is not installed and .whl/ holds no megatron_core wheel"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
python3 - <<'PY' || exit 1
import importlib.metadata, torch
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print("torch", torch.__version__, "| megatron-core", importlib.metadata.version("megatron-core"), "|", device)
PY

if [ "${SKIP_BUILD:-0}" = 1 ]; then
    echo "build: skipped (SKIP_BUILD=1)" | tee "$OUT/build.log"
elif [ "${REBUILD:-0}" = 1 ] || ! ls megatron_mok/_C*.so >/dev/null 2>&1; then
    built=$(date +%s)
    MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    echo "build: $(( $(date +%s) - built )) s"
else
    echo "build: skipped, megatron_mok/_C*.so exists (REBUILD=1 to build)" | tee "$OUT/build.log"
fi

profile=()
[ "${PROFILE:-0}" = 1 ] && profile=(--profile)
# Each run's time limit: RUN_TIMEOUT, or less so that everything ends inside BUDGET seconds (the
# device tool stops a command at 600 s; a stopped run still leaves its iterations in the table).
configs_left=$(wc -w <<< "$CONFIGS")
runs_per_config=$(( $(tr -cd , <<< "$DISPATCHERS" | wc -c) + 1 ))
for config in $CONFIGS; do
    ran=$(date +%s)
    per_run=$(( (${BUDGET:-540} - (ran - start)) / (configs_left * runs_per_config) ))
    run_timeout=$(( per_run < ${RUN_TIMEOUT:-180} ? per_run : ${RUN_TIMEOUT:-180} ))
    configs_left=$(( configs_left - 1 ))
    python3 scripts/throughput.py --config "$config" --dispatchers "$DISPATCHERS" --iters "$ITERS" \
        --out "$SCRATCH/$config" --timeout "$run_timeout" ${profile[@]+"${profile[@]}"} \
        -- --mok-backend "${MOK_BACKEND:-kernel}" \
        2>&1 | tee "$SCRATCH/$config.driver.log"
    echo "$config: $(( $(date +%s) - ran )) s"
    for ext in json png md; do
        [ -f "$SCRATCH/$config/throughput.$ext" ] && cp "$SCRATCH/$config/throughput.$ext" "$OUT/$config.$ext"
    done
done
tar -czf "$OUT/logs.tar.gz" -C "$SCRATCH" . 2>/dev/null
echo "total: $(( $(date +%s) - start )) s"
for config in $CONFIGS; do
    echo
    cat "$OUT/$config.md" 2>/dev/null || echo "$config: no table (see logs.tar.gz)"
done
