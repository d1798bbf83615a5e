#!/usr/bin/env bash
# One device call on a lent 1x H200 (python3 with torch 2.11+cu130; no megatron-core, Transformer
# Engine or apex; no network): install megatron-core from the wheels carried in .whl/ into
# /tmp/site, build the CUDA extension, run scripts/throughput.py for proxy_1gpu (DeepSeek-V3 MoE
# layer) and proxy_qwen3_30b_1gpu (Qwen3-30B-A3B MoE layer) with three dispatchers:
# alltoall_grouped (Megatron's alltoall, experts on torch's grouped GEMM: the baseline a TE user's
# TEGroupedMLP stands for), mok, and alltoall (SequentialMLP, what Megatron runs without TE).
# alltoall_grouped runs first: it is the loss curves' reference, and a run cut short by the budget
# is then the slowest baseline's. Each config's table prints, then a summary of mok's speed-ups
# against both baselines, last.
#
#     bash scripts/device_throughput.sh [--budget SECONDS]      # repository root; carry .whl
#
# --budget (default 570): seconds for the whole script; each training run's time limit is cut so
# that everything ends inside it (the device tool stops a command at 600 s; a stopped run still
# leaves its logged iterations in the table). Knobs (environment): ITERS (default 20 for
# proxy_1gpu, 12 for the Qwen3 proxy, whose alltoall run takes ~3 s an iteration); CONFIGS
# ("proxy_1gpu proxy_qwen3_30b_1gpu"); DISPATCHERS (alltoall_grouped,mok,alltoall: the first is
# the loss reference; mok_fp8 adds mok with FP8 experts, mok_fp8_reference the same recipe on the
# reference backend, ~11 s an iteration); PROFILE=1 (one more step per run under torch.profiler:
# MoE layers vs the rest); REBUILD=1 (build even if megatron_mok/_C*.so exists); SKIP_BUILD=1; RUN_TIMEOUT (seconds
# per training run at most, 180); MOK_BACKEND (kernel: a missing extension fails instead of timing
# the reference). A CPU smoke test: SKIP_BUILD=1 MOK_BACKEND=reference CONFIGS=tiny ITERS=3.
#
# Files in $OUT (flat; the device tool brings back 8): build.log, CONFIG.json, CONFIG.png,
# CONFIG.md for each config, logs.tar.gz (every run's Megatron log and the drivers' output).
#
# Time, estimated from the runs of 2026-12-01 (one H200): the build ~1-1.5 min (two nvcc
# translation units; skipped when megatron_mok/_C*.so is carried), then per training run ~30-45 s
# of start-up (imports, model init, torch.compile warm-ups) plus its iterations: proxy_1gpu
# ~0.85 s (mok) / ~1.1 s (alltoall) each, the Qwen3 proxy ~0.6 s (mok) / ~3-3.6 s (alltoall,
# 128 SequentialMLP experts); alltoall_grouped not yet measured, expected between. Six runs at the
# default iterations ~6-7 min, ~8 with the build: inside one call, with the limits as the net.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
budget=570
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) budget=${2:?--budget needs seconds}; shift 2 ;;
        --budget=*) budget=${1#--budget=}; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "device_throughput.sh: unknown argument $1 (--budget SECONDS)"; exit 2 ;;
    esac
done
case "$budget" in ''|*[!0-9]*) echo "device_throughput.sh: --budget $budget: expected whole seconds"; exit 2 ;; esac
OUT=${OUT:-/tmp/mok_out}
CONFIGS=${CONFIGS:-proxy_1gpu proxy_qwen3_30b_1gpu}
DISPATCHERS=${DISPATCHERS:-alltoall_grouped,mok,alltoall}
SCRATCH=/tmp/mok_throughput
mkdir -p "$OUT" "$SCRATCH"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Multicast stays off on these machines (KINDS.md); one GPU does not use it anyway.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$(date +%s)

iters_for() {  # the iterations of one config
    case "$1" in
        proxy_qwen3_30b_1gpu) echo "${ITERS:-12}" ;;
        *) echo "${ITERS:-20}" ;;
    esac
}

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
# Each run's time limit: RUN_TIMEOUT, or less, an equal share of what is left of the budget (less
# 20 s for the summary and the archive) among the runs still to start.
runs_per_config=$(( $(tr -cd , <<< "$DISPATCHERS" | wc -c) + 1 ))
runs_left=$(( $(wc -w <<< "$CONFIGS") * runs_per_config ))
for config in $CONFIGS; do
    ran=$(date +%s)
    per_run=$(( (budget - 20 - (ran - start)) / runs_left ))
    run_timeout=$(( per_run < ${RUN_TIMEOUT:-180} ? per_run : ${RUN_TIMEOUT:-180} ))
    runs_left=$(( runs_left - runs_per_config ))
    if [ "$run_timeout" -lt 30 ]; then
        echo "$config: not run, ${run_timeout} s a run left of --budget $budget"
        continue
    fi
    python3 scripts/throughput.py --config "$config" --dispatchers "$DISPATCHERS" --iters "$(iters_for "$config")" \
        --out "$SCRATCH/$config" --timeout "$run_timeout" ${profile[@]+"${profile[@]}"} \
        -- --mok-backend "${MOK_BACKEND:-kernel}" \
        2>&1 | tee "$SCRATCH/$config.driver.log"
    echo "$config: $(( $(date +%s) - ran )) s (runs limited to $run_timeout s each)"
    for ext in json png md; do
        [ -f "$SCRATCH/$config/throughput.$ext" ] && cp "$SCRATCH/$config/throughput.$ext" "$OUT/$config.$ext"
    done
done
tar -czf "$OUT/logs.tar.gz" -C "$SCRATCH" . 2>/dev/null
echo "total: $(( $(date +%s) - start )) s of --budget $budget"
for config in $CONFIGS; do
    echo
    cat "$OUT/$config.md" 2>/dev/null || echo "$config: no table (see logs.tar.gz)"
done
echo
python3 scripts/throughput.py --summarize $(for config in $CONFIGS; do echo "$OUT/$config.json"; done)
