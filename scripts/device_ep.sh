#!/usr/bin/env bash
# One device call for the in-kernel exchange: build, the emulated symmetric layer against EP = 1,
# then the EP tests. Logs under $OUT; every step bounded by `timeout`.
#   STEPS="bench tests digests memory"   which steps (default bench tests); PYTEST_K / TESTS narrow the
#   tests; digests compares scripts/digests.py with DIGESTS (EP = 1 unchanged); memory runs
#   scripts/ep_memory.py (MEMORY_ARGS)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/mok_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
status=0
for step in ${STEPS:-bench tests}; do
  case $step in
    bench)
      timeout 240 python3 scripts/bench_emulated.py --ranks ${RANKS:-2,4,8} --exchange symmetric ${BENCH_ARGS:---no-time} \
        > "$OUT/bench_emulated.log" 2>&1 || status=1
      tail -30 "$OUT/bench_emulated.log";;
    tests)
      MEGATRON_MOK_REQUIRE_EXTENSION=1 timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -x \
        ${TESTS:-tests/comm/test_gpu_emulation.py} ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/tests.log" 2>&1 || status=1
      grep -E "passed|failed|Error|error:" "$OUT/tests.log" | tail -15;;
    digests)
      timeout 300 python3 scripts/digests.py --compare "${DIGESTS:-docs/log/digests_2026-12-01_before_restructure.json}" \
        > "$OUT/digests.log" 2>&1 || status=1
      tail -3 "$OUT/digests.log";;
    memory)
      timeout 300 python3 scripts/ep_memory.py ${MEMORY_ARGS:-} --json "$OUT/ep_memory.json" > "$OUT/ep_memory.log" 2>&1 || status=1
      tail -12 "$OUT/ep_memory.log";;
  esac
done
exit $status
