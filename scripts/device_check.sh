#!/usr/bin/env bash
# One device call: build the extension, run every GPU test (and the extension's own), compare the
# output digests when given a file, run the benchmarks. Logs go to $OUT (build.log, tests.log,
# digests.log, bench.log, bench_layer.json/png); a table prints last. Exits non-zero when the build,
# any test or the digest comparison failed (the benchmarks still run, for the record).
#   DIGESTS=docs/log/digests_....json  compare scripts/digests.py against that file
#   PYTEST_K="expr"                    select the tests (pytest -k)
#   SKIP_BENCH=1 / SKIP_GEMM=1 / SKIP_LAYER=1   skip the benchmarks / the expert-GEMM one / the layer one
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/mok_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
start=$(date +%s)
MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
cuobjdump --dump-sass megatron_mok/_C*.so > "$OUT/sass.txt" 2>/dev/null
echo "SASS instructions: $(wc -l < "$OUT/sass.txt") lines"
# The persistent expert GEMM must issue HGMMA (wgmma) fed by UTMALDG (TMA) with register reallocation.
awk '/Function : .*expert_gemm_kernel/{on=1} /Function : /&&!/expert_gemm_kernel/{on=0} on' "$OUT/sass.txt" \
    | grep -oE "HGMMA\.[0-9x]+\.[A-Z0-9.]+|UTMALDG\.[0-9A-Z]+|USETMAXREG[.A-Z]*|SYNCS\.[A-Z.]+" | sort | uniq -c
status=0
# Every GPU test module and the extension's checks; on a Hopper GPU a kernel test fails (not skips)
# when the extension cannot load (tests/cuda_checks.py).
MEGATRON_MOK_REQUIRE_EXTENSION=1 python3 -m pytest -q -p no:cacheprovider tests/ops/test_extension.py tests/*/test_gpu_*.py \
    ${PYTEST_K:+-k "$PYTEST_K"} ${EXTRA_TESTS:-} > "$OUT/tests.log" 2>&1 || status=1
tail -25 "$OUT/tests.log"
if [ -n "${DIGESTS:-}" ]; then
    python3 scripts/digests.py --compare "$DIGESTS" > "$OUT/digests.log" 2>&1 || status=1
    tail -3 "$OUT/digests.log"
fi
if [ "${PRETRAIN:-0}" = 1 ]; then
    # The README's main job on the GPU, in bf16 (kernel backend) beside alltoall from the same seed.
    for dispatcher in mok alltoall; do
        python3 -m megatron_mok.pretrain --train-iters 6 --bf16 --moe-token-dispatcher-type $dispatcher \
            > "$OUT/pretrain_$dispatcher.log" 2>&1
        echo "pretrain $dispatcher rc=$?"
        grep " iteration " "$OUT/pretrain_$dispatcher.log" | \
            sed -E 's/.*(iteration +[0-9]+\/ +[0-9]+).*(elapsed time per iteration \(ms\): [0-9.]+).*(tokens\/s\/GPU: [0-9.]+).*(lm loss: [0-9.E+-]+).*/\1 | \2 | \3 | \4/'
        grep -i "running the reference backend" "$OUT/pretrain_$dispatcher.log" | head -1
    done
fi
if [ "${PROFILE:-0}" = 1 ]; then
    # Warp stall reasons of the sm90 GEMM (from dispatched rows, and dispatching) beside torch's CUTLASS one.
    timeout 300 ncu --clock-control none --kernel-name regex:'expert_gemm|cutlass|Kernel' --launch-skip 3 --launch-count 3 \
        --csv --page raw --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,lts__t_sector_hit_rate.pct' \
        python3 scripts/profile_expert_gemm.py ${PROFILE_ARGS:---projection gate_up} > "$OUT/stalls.csv" 2>"$OUT/ncu.err"
    python3 scripts/ncu_stalls.py "$OUT/stalls.csv" || tail -5 "$OUT/ncu.err"
    python3 - "$OUT/stalls.csv" <<'PY' || true
import csv, sys
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
h = rows[0]
for r in rows[2:]:
    d = dict(zip(h, r))
    print(d["Kernel Name"][:60], "us", d.get("gpu__time_duration.sum"), "tensor%", d.get("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"), "L2 hit%", d.get("lts__t_sector_hit_rate.pct"))
PY
fi
[ "${SKIP_BENCH:-0}" = 1 ] || [ "${SKIP_GEMM:-0}" = 1 ] || python3 scripts/bench_expert_gemm.py ${GEMM_ARGS:-} 2>"$OUT/bench_gemm.err" | tee "$OUT/bench_gemm.log"
[ "${SKIP_BENCH:-0}" = 1 ] || [ "${SKIP_LAYER:-0}" = 1 ] || python3 scripts/bench_layer.py --out "$OUT" ${BENCH_ARGS:-} 2>"$OUT/bench.err" | tee "$OUT/bench.log"
exit $status
