#!/usr/bin/env bash
# One device call made of named steps, each bounded by `timeout`, all inside one budget, so that a
# step that hangs costs its bound and not the call: installs the wheels carried in .whl/ into
# /tmp/site, builds the extension when megatron_mok/_C*.so is absent (or REBUILD=1), runs the steps
# in order, and prints each step's failures and a table last. $OUT gets few files (the device tool
# brings back only the first 8): table.md, steps.log (every step's output, in order, appended as each
# step ends), build.log only when the build failed, and what the steps themselves write there (the
# layer benchmark's JSON and plot, ncu's CSV, the throughput runs' files).
#
#     STEPS="tol digests emul" bash scripts/device_steps.sh     # repository root; carry .whl
#
# STEPS (default "tol digests emul"): the step names of step_command below.
# BUDGET (default 570): seconds for the whole call, the build included (the device tool stops a
# command at 600 s); a step's bound is cut to what is left, and a step with under 20 s left is skipped.
# PYTEST_ARGS: extra pytest arguments for every pytest step (e.g. "-x").
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OUT=${OUT:-/tmp/mok_out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-570}
STEPS=${STEPS:-"tol digests emul"}
start=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# Multicast stays off on these machines (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# On a Hopper GPU a kernel test fails (not skips) when the extension cannot load.
export MEGATRON_MOK_REQUIRE_EXTENSION=1
table="$OUT/table.md"
steps_log="$OUT/steps.log"
LOGS=$(mktemp -d /tmp/mok_steps.XXXXXX)  # each step's own log, before it joins steps.log
: > "$steps_log"
printf '| step | rc | s | summary |\n| --- | --- | --- | --- |\n' > "$table"
if [ "${REBUILD:-0}" = 1 ] || ! ls megatron_mok/_C*.so >/dev/null 2>&1; then
    built=$(date +%s)
    MAX_JOBS=16 python3 setup.py build_ext --inplace > "$LOGS/build.log" 2>&1
    rc=$?
    echo "| build | $rc | $(( $(date +%s) - built )) | |" >> "$table"
    [ $rc = 0 ] || { cp "$LOGS/build.log" "$OUT/build.log"; tail -40 "$OUT/build.log"; cat "$table"; exit 1; }
    { echo "== build (its last 20 lines)"; tail -20 "$LOGS/build.log"; echo; } >> "$steps_log"
fi
PYTEST="python3 -m pytest -q -p no:cacheprovider --no-header -rfE ${PYTEST_ARGS:-}"

# The largest EP the emulated DeepSeek-V3 ranks of ep_memory_fp8 fit: 8 on a card of over 100 GB, else 4.
ep_ranks() {
    local mib
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    if [ "${mib:-0}" -gt 100000 ]; then echo 8; else echo 4; fi
}
export -f ep_ranks

step_command() {  # prints "BOUND COMMAND" for a step name
    case "$1" in
        tol) echo 200 "$PYTEST tests/backends/test_gpu_kernels.py tests/backends/test_gpu_reference.py tests/ops/test_gpu_expert_gemm.py tests/megatron/test_grouped_mm_experts.py" ;;
        # The Megatron experts' part of tol alone (carry .whl: it needs megatron-core).
        megatron_experts) echo 120 "$PYTEST tests/megatron/test_grouped_mm_experts.py" ;;
        digests) echo 100 "python3 scripts/digests.py --compare docs/log/digests_2026-12-01_before_restructure.json" ;;
        emul) echo 130 "$PYTEST tests/comm/test_gpu_emulation.py" ;;
        procs_layer) echo 150 "$PYTEST -s tests/comm/test_gpu_processes.py -k equals_ep1" ;;
        procs_failures) echo 330 "$PYTEST -x -s tests/comm/test_gpu_processes.py -k 'not equals_ep1'" ;;
        procs_module) echo 200 "$PYTEST -s tests/comm/test_gpu_process_group.py tests/megatron/test_gpu_process_group_module.py" ;;
        fp8_gemm) echo 150 "$PYTEST tests/ops/test_gpu_fp8_gemm.py" ;;
        fp8_wgrad) echo 150 "$PYTEST tests/ops/test_gpu_fp8_wgrad.py" ;;
        # The weight gradient over receive windows, run after run, in every mainloop (races show as some runs in many).
        fp8_wgrad_stress) echo 150 "python3 scripts/stress_fp8_wgrad_windows.py" ;;
        fp8_quant) echo 200 "$PYTEST tests/ops/test_gpu_fp8_quant.py" ;;
        fp8_layer) echo 200 "$PYTEST tests/backends/test_gpu_fp8_reference.py tests/backends/test_gpu_fp8_kernel.py -k 'not symmetric'" ;;
        # The FP8 layer's per-rank memory against layer_memory_bound, every routing, EP 1 and 4, one window and several.
        fp8_memory) echo 200 "$PYTEST -s tests/comm/test_gpu_fp8_memory.py tests/comm/test_gpu_emulation.py -k memory" ;;
        # Per-rank memory at the DeepSeek-V3 shape, EP 1, 2 and 8 (emulated ranks; 4 instead of 8 on a
        # card under 100 GB, where eight ranks do not fit): FP8 without and with the weight cache, BF16 beside.
        ep_memory_fp8) echo 300 "r=\$(ep_ranks) && python3 scripts/ep_memory.py --ranks 1,2,\$r --precision fp8_blockwise --no-fp8-weight-cache --json \$OUT/ep_memory_fp8_uncached.json && python3 scripts/ep_memory.py --ranks 1,\$r --precision fp8_blockwise && python3 scripts/ep_memory.py --ranks 1,2,\$r" ;;
        # Where the one-rank layer's memory peaks, stage by stage (DeepSeek-V3 shape): FP8 with and without the weight cache, BF16.
        memory_stages) echo 200 "python3 scripts/memory_stages.py --precision fp8_blockwise && python3 scripts/memory_stages.py --precision fp8_blockwise --no-fp8-weight-cache && python3 scripts/memory_stages.py" ;;
        # The same over the in-kernel exchange in 4 receive windows (receive_capacity_factor 0.25), as an EP 4 rank's.
        memory_stages_windows) echo 200 "for a in '--precision fp8_blockwise --no-fp8-weight-cache' '--precision fp8_blockwise' ''; do python3 scripts/memory_stages.py --factor 0.25 \$a; done" ;;
        fp8_no_tokens) echo 120 "$PYTEST tests/backends/test_gpu_fp8_kernel.py -k without_tokens" ;;
        fp8_symmetric) echo 200 "$PYTEST tests/backends/test_gpu_fp8_kernel.py -k symmetric" ;;
        fp8_bench) echo 200 "python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants default,pingpong,overlap" ;;
        # The FP8 weight gradient in every mainloop (overlap_across_tiles: the next tile's first block issued before the epilogue).
        # The wide FP8 GEMM's short-K projections at the steady clock beside overlap (fc2: 16 K blocks a tile,
        # where a tile's start weighs most).
        fp8_wide_short_k_sustained) echo 120 "for p in fc2 dgrad_fc1; do python3 scripts/bench_gemm_sustained.py --shape deepseek_v3_ep8 --projection \$p --variants overlap,wide --seconds 2; done" ;;
        # The FP8 weight gradient in every mainloop and in the 128 x 192 wide kernel, same run.
        fp8_wgrad_wide_bench) echo 200 "python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants wide --fp8-clusters 1 --fp8-projections wgrad_fc1,wgrad_fc2" ;;
        fp8_across_bench) echo 200 "python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants overlap --fp8-clusters 1 --fp8-projections wgrad_fc1,wgrad_fc2" ;;
        # The FP8 GEMM's scale products after each block's wait (overlap_late_scales) beside the overlap mainloop, same run.
        fp8_late_scales_bench) echo 200 "python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants overlap,overlap_late_scales --fp8-clusters 1 --fp8-projections fc1,fc2,dgrad_fc2,dgrad_fc1" ;;
        # The FP8 GEMM's overlap_eager_retire mainloop (a block retired before the wait for a late next
        # stage): its cases of the GEMM tests (bitwise the default's), then its time beside overlap's.
        fp8_eager_retire_bench) echo 300 "$PYTEST tests/ops/test_gpu_fp8_gemm.py -k 'eager_retire or knows_every_variant' && python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants overlap,overlap_eager_retire --fp8-clusters 1 --fp8-projections fc1,fc2,dgrad_fc2,dgrad_fc1" ;;
        # The FP8 GEMM's raster: the overlap mainloop at every group_m (m-tiles per raster group), fc1, fc2 and the dgrads.
        # The FP8 GEMM's 128 x 192 kernel (variant wide: one partial per warpgroup, B multicast at 2-CTA
        # clusters) held bitwise to the default, then timed beside overlap at both cluster sizes.
        fp8_wide_bench) echo 330 "$PYTEST tests/ops/test_gpu_fp8_gemm.py -k 'wide or knows_every_variant' && python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants overlap,wide --fp8-clusters 1,2 --fp8-projections fc1,fc2,dgrad_fc2,dgrad_fc1" ;;
        # The wide FP8 GEMM with the next tile's first block issued before a tile's epilogue
        # (wide_across_tiles): the GEMM and push tests of both wide variants (bitwise the default), then
        # its time beside wide's, single calls and at the steady clock (the short-K projections, where a
        # tile's start and end weigh most).
        fp8_across_gemm) echo 200 "$PYTEST tests/ops/test_gpu_fp8_gemm.py -k 'wide or knows_every_variant'" ;;
        fp8_across_gemm_bench) echo 120 "python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants wide,wide_across_tiles --fp8-clusters 1 --fp8-projections fc1,fc2,dgrad_fc2,dgrad_fc1" ;;
        fp8_across_sustained) echo 150 "for sp in deepseek_v3_ep8:fc2 deepseek_v3_ep8:dgrad_fc1 qwen3_30b:fc2; do python3 scripts/bench_gemm_sustained.py --shape \${sp%%:*} --projection \${sp##*:} --variants wide,wide_across_tiles --seconds 2; done" ;;
        # The same and both at 2-CTA clusters (the weight slice multicast), every projection at the steady clock.
        fp8_cluster_sustained) echo 200 "for sp in deepseek_v3_ep8:fc1 deepseek_v3_ep8:fc2 deepseek_v3_ep8:dgrad_fc2 deepseek_v3_ep8:dgrad_fc1 qwen3_30b:fc1 qwen3_30b:fc2; do python3 scripts/bench_gemm_sustained.py --shape \${sp%%:*} --projection \${sp##*:} --variants wide,wide_across_tiles --clusters 1,2 --seconds 2; done" ;;
        # The wide FP8 GEMM with its consumers' K blocks issued in turn (wide_ordered) beside wide, both
        # cluster sizes: single calls at every projection, then at the steady clock (dense 8192^3 beside
        # cuBLASLt's blockwise kernel, whose issue order it takes).
        fp8_ordered_bench) echo 120 "python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants wide,wide_ordered --fp8-clusters 1,2 --fp8-projections fc1,fc2,dgrad_fc2,dgrad_fc1" ;;
        # The same under ncu (dense 8192^3 fc1, each at both cluster sizes): the tensor pipe's activity, issue slots, stall reasons.
        fp8_ordered_profile) echo 200 "for c in 1 2; do ncu --clock-control none --kernel-name-base demangled --kernel-name regex:'WideKernel' --launch-skip 2 --launch-count 4 --csv --page raw --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum' python3 scripts/profile_expert_gemm.py --fp8 --shape dense_8192 --projection fc1 --fp8-variants wide,wide_ordered --fp8-cluster \$c > \$OUT/ordered_profile_c\$c.csv; done" ;;
        # wide_ordered with the next tile's first block before a tile's epilogue too, beside wide_ordered:
        # single calls, then at the steady clock (the short-K projections, where a tile's end weighs most).
        fp8_ordered_across_bench) echo 120 "python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants wide_ordered,wide_ordered_across_tiles --fp8-clusters 1 --fp8-projections fc1,fc2,dgrad_fc2,dgrad_fc1" ;;
        fp8_ordered_across_sustained) echo 150 "for sp in deepseek_v3_ep8:fc2 deepseek_v3_ep8:dgrad_fc1 qwen3_30b:fc2 qwen3_30b:fc1; do python3 scripts/bench_gemm_sustained.py --shape \${sp%%:*} --projection \${sp##*:} --variants wide_ordered,wide_ordered_across_tiles --seconds 2; done" ;;
        fp8_ordered_wgrad_bench) echo 120 "python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants wide --fp8-clusters 1 --fp8-projections wgrad_fc1,wgrad_fc2" ;;
        fp8_ordered_sustained) echo 220 "for sp in dense_8192:fc1 deepseek_v3_ep8:fc1 deepseek_v3_ep8:fc2 deepseek_v3_ep8:dgrad_fc1 qwen3_30b:fc2; do python3 scripts/bench_gemm_sustained.py --shape \${sp%%:*} --projection \${sp##*:} --variants wide,wide_ordered --clusters 1,2 --seconds 2; done" ;;
        # wide_ordered with the A scales through the stages (wide_ordered_staged_scales): the GEMM and push
        # tests of every wide variant (bitwise the default, the padding scales poisoned, every K block
        # promoted), then it timed beside wide_ordered in single calls and at the steady clock.
        fp8_staged) echo 240 "$PYTEST tests/ops/test_gpu_fp8_gemm.py -k 'wide or knows_every_variant'" ;;
        fp8_staged_bench) echo 120 "python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants wide_ordered,wide_ordered_staged_scales --fp8-clusters 1 --fp8-projections fc1,fc2,dgrad_fc2,dgrad_fc1" ;;
        fp8_staged_sustained) echo 150 "for sp in dense_8192:fc1 deepseek_v3_ep8:fc1 deepseek_v3_ep8:fc2 deepseek_v3_ep8:dgrad_fc1 qwen3_30b:fc2; do python3 scripts/bench_gemm_sustained.py --shape \${sp%%:*} --projection \${sp##*:} --variants wide_ordered,wide_ordered_staged_scales --seconds 2; done" ;;
        # The same under ncu (dense 8192^3 fc1): the tensor pipe's activity, issue slots, stall reasons.
        fp8_staged_profile) echo 120 "ncu --clock-control none --kernel-name-base demangled --kernel-name regex:'WideKernel' --launch-skip 2 --launch-count 4 --csv --page raw --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum' python3 scripts/profile_expert_gemm.py --fp8 --shape dense_8192 --projection fc1 --fp8-variants wide_ordered,wide_ordered_staged_scales --fp8-cluster 1 > \$OUT/staged_profile.csv" ;;
        # wide_ordered_staged_scales at 1- and 2-CTA clusters: single calls, then at the steady clock.
        fp8_staged_clusters_bench) echo 90 "python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants wide_ordered_staged_scales --fp8-clusters 1,2 --fp8-projections fc1,fc2,dgrad_fc2,dgrad_fc1" ;;
        fp8_staged_clusters_sustained) echo 150 "for sp in dense_8192:fc1 deepseek_v3_ep8:fc2 deepseek_v3_ep8:dgrad_fc1 qwen3_30b:fc2; do python3 scripts/bench_gemm_sustained.py --shape \${sp%%:*} --projection \${sp##*:} --variants wide_ordered_staged_scales --clusters 1,2 --seconds 2; done" ;;
        # MoKConfig.fp8_cache_transposed_weights: the layer bitwise the default's (first and second call),
        # its graph replay, and the memory tests (the bound's transposed copies).
        # The SwiGLU math's batched fast path against the IEEE formulas for every fp32 gate, the
        # quantization kernels that call it, BF16's digests, and the quantization launches timed.
        swiglu_fast) echo 420 "f=0; $PYTEST tests/ops/test_gpu_swiglu_math.py || f=1; $PYTEST tests/ops/test_gpu_fp8_quant.py -k swiglu || f=1; python3 scripts/digests.py --compare docs/log/digests_2026-12-01_before_restructure.json || f=1; [ \$f = 0 ] && python3 scripts/bench_quantize.py --shapes deepseek_v3,qwen3_30b" ;;
        fp8_kept) echo 200 "$PYTEST tests/backends/test_gpu_fp8_kernel.py tests/comm/test_gpu_fp8_memory.py -k kept" ;;
        # The one-rank layer over the in-kernel exchange (one window, four) with the storing and pushing FP8
        # GEMMs in wide_ordered and in wide_ordered_staged_scales.
        fp8_staged_windows) echo 240 "python3 scripts/bench_windows.py --factors 1.0,0.25 --gemm-variants wide_ordered,wide_ordered_staged_scales" ;;
        # The push op's tests (every variant, the wide kernel's among them, bitwise the GEMM then push_rows).
        fp8_wide_push) echo 200 "$PYTEST tests/ops/test_gpu_fp8_gemm.py -k 'push or knows_every_variant'" ;;
        # The one-rank layer over the in-kernel exchange with the plain FP8 GEMMs (storing and pushing) in overlap and in wide.
        fp8_wide_push_bench) echo 200 "python3 scripts/bench_windows.py --factors 1.0 --gemm-variants overlap,wide" ;;
        # The down dgrad with the SwiGLU backward in its epilogue: the op bitwise the two launches, the FP8 layer.
        fp8_swiglu_bwd) echo 300 "$PYTEST tests/ops/test_gpu_fp8_gemm.py -k 'swiglu_backward' && $PYTEST tests/backends/test_gpu_fp8_kernel.py -k 'not symmetric'" ;;
        # The same op timed against the two launches it replaces (scripts/bench_swiglu_backward_epilogue.py).
        fp8_swiglu_bwd_bench) echo 150 "python3 scripts/bench_swiglu_backward_epilogue.py" ;;
        # The SM clock and power while the FP8 GEMM runs (is the ~900-950 TFLOP/s ceiling the card's
        # power limit?): nvidia-smi sampled every 250 ms beside the fc1 and dgrad fc1 benchmark (CLOCK_SHAPES,
        # CLOCK_VARIANTS and CLOCK_PROJECTIONS change what it runs, e.g. CLOCK_SHAPES=dense_8192,deepseek_v3_ep8).
        fp8_gemm_clocks) echo 240 "nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_throttle_reasons.active --format=csv,noheader,nounits -lms 250 > \$OUT/clocks.csv & s=\$!; python3 scripts/bench_expert_gemm.py --fp8 --shapes \${CLOCK_SHAPES:-deepseek_v3_ep8} --fp8-variants \${CLOCK_VARIANTS:-overlap} --fp8-clusters 1 --fp8-projections \${CLOCK_PROJECTIONS:-fc1,dgrad_fc1}; kill \$s; python3 -c \"import csv,statistics as st; r=[x for x in csv.reader(open('\$OUT/clocks.csv')) if len(x)==5]; busy=[x for x in r if float(x[2])>300]; print('samples',len(r),'over 300 W',len(busy)); [print(n, min(v), st.median(v), max(v)) for n,v in (('sm MHz',[float(x[0]) for x in busy]),('W',[float(x[2]) for x in busy]))] if busy else None; print('max MHz',r[0][1] if r else None,'limit W',r[0][3] if r else None,'reasons',sorted({x[4].strip() for x in busy}))\"" ;;
        # The dense 8192^3 FP8 GEMM (shape dense_8192, fc1): ours (overlap) beside torch's FP8 rowwise and
        # blockwise (cuBLASLt's nvjet kernel, promotion per 128 of K like ours) under ncu: tensor pipe,
        # issue slots, stall reasons per issued instruction, clock, time; every launch of the script, its
        # setup included (the blockwise layout search), in order (dense_stalls.csv stays in \$OUT).
        fp8_dense_profile) echo 200 "ncu --clock-control none --kernel-name-base demangled --kernel-name regex:'Fp8ExpertGemm|cutlass|nvjet' --launch-count 16 --csv --page raw --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second,gpu__time_duration.sum' python3 scripts/profile_expert_gemm.py --fp8 --shape dense_8192 --projection fc1 --fp8-variants overlap > \$OUT/dense_stalls.csv && python3 scripts/ncu_stalls.py \$OUT/dense_stalls.csv" ;;
        # Each FP8 GEMM run back to back for seconds: its steady rate beside the SM clock and power the card's
        # limit lets it run at (scripts/bench_gemm_sustained.py), ours and torch's rowwise and blockwise.
        fp8_sustained) echo 150 "python3 scripts/bench_gemm_sustained.py --shape dense_8192 --variants overlap,wide && python3 scripts/bench_gemm_sustained.py --shape deepseek_v3_ep8 --variants overlap" ;;
        # The same with our mainloops at 1- and 2-CTA clusters (B multicast), as cuBLASLt's kernel runs.
        fp8_sustained_clusters) echo 200 "python3 scripts/bench_gemm_sustained.py --shape dense_8192 --variants overlap,wide --clusters 1,2 && python3 scripts/bench_gemm_sustained.py --shape deepseek_v3_ep8 --variants overlap --clusters 1,2" ;;
        fp8_group_m_bench) echo 200 "python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants overlap --fp8-clusters 1 --fp8-group-m 1,4,8,16,32,64 --fp8-projections fc1,fc2,dgrad_fc2,dgrad_fc1" ;;
        # The FP8 weight gradients in every mainloop, and the gate/up GEMM with and without its SwiGLU
        # epilogue (the layer's overlap mainloop), beside torch's.
        fp8_wgrad_bench) echo 200 "python3 scripts/bench_expert_gemm.py --fp8 --shapes deepseek_v3_ep8,qwen3_30b --fp8-variants overlap --fp8-projections fc1,fc1+swiglu,wgrad_fc1,wgrad_fc2" ;;
        # The layer: mok FP8 beside mok BF16, torchao's FP8 rowwise op and the PyTorch pipeline (bench_layer.json in \$OUT).
        fp8_layer_bench) echo 400 "python3 scripts/bench_layer.py --fp8 --shapes deepseek_v3,qwen3_30b --out \$OUT" ;;
        # The FP8 layer's kernels by stage (the quantization steps' share), forward and backward.
        # The same, FP8 and BF16, mok_moe on one GPU beside one emulated rank over the in-kernel exchange (a real EP launch's path).
        fp8_stages_symmetric) echo 300 "python3 scripts/profile_layer_kernels.py --shapes deepseek_v3,qwen3_30b --backward --precision fp8_blockwise --exchange direct,symmetric && python3 scripts/profile_layer_kernels.py --shapes deepseek_v3 --backward --exchange direct,symmetric" ;;
        fp8_stages) echo 150 "python3 scripts/profile_layer_kernels.py --shapes deepseek_v3,qwen3_30b --backward --precision fp8_blockwise" ;;
        # Warp stall reasons, tensor-pipe activity and time of the FP8 GEMM's variants beside torch's
        # FP8 rowwise grouped GEMM (fc1, DeepSeek-V3 EP 8 shape); stalls.csv stays in \$OUT.
        fp8_profile) echo 240 "ncu --clock-control none --kernel-name-base demangled --kernel-name regex:'Fp8ExpertGemm|cutlass' --launch-skip 4 --launch-count 4 --csv --page raw --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum' python3 scripts/profile_expert_gemm.py --fp8 --projection fc1 > \$OUT/stalls.csv && python3 scripts/ncu_stalls.py \$OUT/stalls.csv" ;;
        # The FP8 weight gradient's mainloops under ncu (fc2's, DeepSeek-V3 EP 8 shape): speed of light,
        # warp states, pipes and memory, as ncu prints them.
        fp8_wgrad_profile) echo 240 "ncu --clock-control none --kernel-name-base demangled --kernel-name regex:'Fp8ExpertWgrad' --launch-skip 2 --launch-count 2 --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis python3 scripts/profile_expert_gemm.py --fp8 --projection wgrad_fc2" ;;
        # The same kernel's warp stall reasons per issued instruction and tensor-pipe activity, both
        # mainloops (wgrad_stalls.csv stays in \$OUT).
        fp8_wgrad_stalls) echo 240 "ncu --clock-control none --kernel-name-base demangled --kernel-name regex:'Fp8ExpertWgrad' --launch-skip 2 --launch-count 2 --csv --page raw --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum' python3 scripts/profile_expert_gemm.py --fp8 --projection wgrad_fc2 > \$OUT/wgrad_stalls.csv && python3 scripts/ncu_stalls.py \$OUT/wgrad_stalls.csv" ;;
        # The SwiGLU-epilogue gate/up GEMM (both mainloops) and the plain fc1 GEMM beside it (DeepSeek-V3
        # EP 8 shape): stall reasons, tensor pipe, shared-memory, L2 and DRAM throughput, time.
        fp8_swiglu_stalls) echo 240 "ncu --clock-control none --kernel-name-base demangled --kernel-name regex:'Fp8ExpertGemm' --launch-skip 6 --launch-count 3 --csv --page raw --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed' python3 scripts/profile_expert_gemm.py --fp8 --projection fc1+swiglu > \$OUT/swiglu_stalls.csv && python3 scripts/ncu_stalls.py \$OUT/swiglu_stalls.csv" ;;
        # Where the warps of the layer's SwiGLU-epilogue GEMM and weight gradient stall, per SASS
        # instruction (PC sampling; DeepSeek-V3 EP 8 shape): scripts/ncu_hot_sass.py.
        fp8_hot_sass) echo 300 "ncu --section SourceCounters --section WarpStateStats --kernel-name-base demangled --kernel-name regex:'Fp8SwigluEpilogue.*Mainloop.2' --launch-skip 2 --launch-count 1 -o \$OUT/swiglu python3 scripts/profile_expert_gemm.py --fp8 --projection fc1+swiglu > /dev/null && ncu -i \$OUT/swiglu.ncu-rep --page source --csv --print-source sass > /tmp/swiglu_sass.csv && python3 scripts/ncu_hot_sass.py /tmp/swiglu_sass.csv 45 && ncu --section SourceCounters --section WarpStateStats --kernel-name-base demangled --kernel-name regex:'Fp8WgradMainloop.1' --launch-skip 2 --launch-count 1 -o \$OUT/wgrad python3 scripts/profile_expert_gemm.py --fp8 --projection wgrad_fc2 > /dev/null && ncu -i \$OUT/wgrad.ncu-rep --page source --csv --print-source sass > /tmp/wgrad_sass.csv && python3 scripts/ncu_hot_sass.py /tmp/wgrad_sass.csv 45; rm -f \$OUT/*.ncu-rep" ;;
        # Where the plain FP8 GEMM's warps stall (overlap mainloop, fc1, DeepSeek-V3 EP 8 shape), per SASS instruction (PC sampling).
        fp8_gemm_hot_sass) echo 300 "ncu --section SourceCounters --section WarpStateStats --kernel-name-base demangled --kernel-name regex:'Fp8StoreEpilogue.*Mainloop.2' --launch-skip 2 --launch-count 1 -o \$OUT/gemm python3 scripts/profile_expert_gemm.py --fp8 --projection fc1 --fp8-variants overlap > /dev/null && ncu -i \$OUT/gemm.ncu-rep --page source --csv --print-source sass > /tmp/gemm_sass.csv && python3 scripts/ncu_hot_sass.py /tmp/gemm_sass.csv 60; rm -f \$OUT/*.ncu-rep" ;;
        # The dense 8192^3 fc1 GEMM's SASS with PC sampling per instruction, cuBLASLt's blockwise kernel and
        # ours (wide at 2-CTA clusters, as cuBLASLt runs) side by side: the whole source pages stay in \$OUT
        # (nvjet_sass.csv, wide_c2_sass.csv),
        # the hottest instructions of each are printed (scripts/ncu_hot_sass.py).
        fp8_dense_sass) echo 300 "for k in nvjet:nvjet:overlap:1 'WideKernel<.{0,6}2,:wide_c2:wide:2'; do IFS=: read -r r n v c <<< \$k; ncu --section SourceCounters --section WarpStateStats --kernel-name-base demangled --kernel-name regex:\"\$r\" --launch-skip 2 --launch-count 1 -o /tmp/\$n python3 scripts/profile_expert_gemm.py --fp8 --shape dense_8192 --projection fc1 --fp8-variants \$v --fp8-cluster \$c > /dev/null && ncu -i /tmp/\$n.ncu-rep --page source --csv --print-source sass > \$OUT/\${n}_sass.csv && python3 scripts/ncu_hot_sass.py \$OUT/\${n}_sass.csv 40; done" ;;
        # Shared memory's load on the FP8 GEMM (fc1, every mainloop, beside torch's FP8 rowwise) and weight gradient (fc2):
        # bank reads and writes (the wgmmas' operand reads, the TMA writes, the promotion's loads) against the tensor pipe.
        fp8_smem) echo 240 "for p in fc1 wgrad_fc2; do ncu --clock-control none --kernel-name-base demangled --kernel-name regex:'Fp8ExpertGemm|Fp8ExpertWgrad|cutlass' --launch-skip 2 --launch-count 4 --csv --page raw --metrics 'l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum' python3 scripts/profile_expert_gemm.py --fp8 --projection \$p > \$OUT/smem_\$p.csv && python3 scripts/ncu_stalls.py \$OUT/smem_\$p.csv; done" ;;
        # The layer at EP = 1 over the in-kernel exchange in one receive window and in several, BF16 and
        # FP8, the FP8 dgrads in one expert range per window and in tuning's ranges.
        windows_bench) echo 200 "python3 scripts/bench_windows.py" ;;
        # The FP8 weight gradients' operands quantized straight from the ranks' regions
        # (tuning.FP8_WGRAD_COLUMNS_FROM_PEERS, off by default until this step passes): the kernel
        # against the concatenated regions, the emulated ranks bitwise EP = 1, the memory against the
        # bound, then the one-rank symmetric path's time with and without it. Each pytest file part in
        # its own process (a trap's sticky CUDA error fails every later test of its process), the
        # benchmark only after all of them passed.
        fp8_columns_from_peers) echo 420 "f=0; $PYTEST tests/ops/test_gpu_fp8_quant.py -k from_peers || f=1; $PYTEST tests/backends/test_gpu_fp8_kernel.py -k regions || f=1; $PYTEST tests/backends/test_gpu_fp8_kernel.py -k symmetric || f=1; $PYTEST tests/comm/test_gpu_fp8_memory.py -k regions || f=1; [ \$f = 0 ] && python3 scripts/bench_windows.py --factors 1.0,0.25 --columns-from-peers" ;;
        # The FP8 GEMMs' push epilogue (tuning.FP8_PUSH_IN_EPILOGUE): the op against the GEMM then the push
        # kernel, the layer over the emulated symmetric exchange bitwise EP = 1, its memory against the
        # bound (each pytest part in its own process), then the one-rank symmetric path's time with the
        # push kernel and with the epilogue, and its kernels by stage.
        fp8_push) echo 480 "f=0; $PYTEST tests/ops/test_gpu_fp8_gemm.py -k push || f=1; $PYTEST tests/backends/test_gpu_fp8_kernel.py -k 'symmetric or regions' || f=1; $PYTEST tests/comm/test_gpu_fp8_memory.py || f=1; [ \$f = 0 ] && python3 scripts/bench_windows.py --factors 1.0,0.25 --push-in-epilogue && python3 scripts/profile_layer_kernels.py --shapes deepseek_v3,qwen3_30b --backward --precision fp8_blockwise --exchange symmetric" ;;
        # The one-rank FP8 layer's memory by stage over the in-kernel exchange in 4 receive windows, the rows
        # pushed by the GEMMs' epilogue and by the push kernel (its peak lines and the pushing stages).
        fp8_push_memory) echo 200 "for a in '' '--push-kernel'; do python3 scripts/memory_stages.py --factor 0.25 --precision fp8_blockwise \$a | grep -E 'fp8_blockwise|peak|expert_down|dgrad_rows'; done" ;;
        # The FP8 step over the in-kernel exchange timed both ways in one run (wall, kernels, ten steps queued
        # back to back): rows pushed by the push kernel, then by the GEMMs' epilogue.
        fp8_push_queued) echo 200 "for a in --push-kernel ''; do python3 scripts/profile_layer_kernels.py --shapes deepseek_v3,qwen3_30b --backward --precision fp8_blockwise --exchange symmetric \$a | grep -E 'wall'; done" ;;
        # Forward's route table kept by the combine as it reads the region (functional._combine_keeping_table):
        # the op against the combine (bitwise, the rows read copied, the others unwritten), the emulated
        # ranks over the symmetric exchange bitwise EP = 1 (BF16, FP8), each pytest part in its own
        # process; then one rank's step over the exchange both ways, BF16 and FP8, the same run.
        table_keep) echo 560 "f=0; $PYTEST tests/backends/test_gpu_kernels.py -k 'data_movement or op_registration' || f=1; $PYTEST tests/comm/test_gpu_emulation.py || f=1; $PYTEST tests/backends/test_gpu_fp8_kernel.py -k symmetric || f=1; [ \$f = 0 ] && for p in bf16 fp8_blockwise; do for a in --table-copy ''; do echo \"== \$p \${a:-kept by the combine}\"; python3 scripts/profile_layer_kernels.py --shapes deepseek_v3,qwen3_30b --backward --precision \$p --exchange symmetric \$a | grep -E 'wall|combine|^[a-z0-9_]+ '; done; done" ;;
        # The depth of CUDA's launch queue behind an unfinished kernel (emulation.py's symmetric form),
        # and the case it bounds: the reference backend over the emulated symmetric exchange at EP 4.
        launch_queue) echo 150 "python3 scripts/probe_launch_queue.py --streams 1,3 && $PYTEST -s tests/backends/test_gpu_fp8_kernel.py -k 'symmetric and 4-reference'" ;;
        # d gate_up's two FP8 copies from one pass, and act's column copy with them
        # (tuning.FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS, FP8_ACT_COLUMNS_IN_ONE_PASS, off until this step
        # passes): the op against the reference and the launches it replaces, the layer bitwise every
        # way, then each launch's GB/s (the pairs beside each other), the step's kernels by stage with
        # each form on (the quantization launches' shares), and the layer every way.
        grad_gate_up_copies) echo 540 "f=0; $PYTEST tests/ops/test_gpu_fp8_quant.py -k 'swiglu_backward' || f=1; $PYTEST tests/backends/test_gpu_fp8_kernel.py -k 'one_pass' || f=1; [ \$f = 0 ] && python3 scripts/bench_quantize.py --shapes deepseek_v3,qwen3_30b && for a in FP8_ACT_COLUMNS_IN_ONE_PASS=False FP8_ACT_COLUMNS_IN_ONE_PASS=True; do python3 scripts/profile_layer_kernels.py --shapes deepseek_v3,qwen3_30b --backward --precision fp8_blockwise --tuning FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS=True --tuning \$a; done && python3 scripts/bench_layer.py --fp8 --shapes deepseek_v3,qwen3_30b" ;;
        # Each quantization launch of the FP8 layer alone, GB/s beside the same run's device copy.
        quant_bench) echo 150 "python3 scripts/bench_quantize.py --shapes deepseek_v3,qwen3_30b" ;;
        # Where the column-wise quantizations (the weight gradients' operands) and the SwiGLU backward
        # stall, their DRAM throughput and the warps they keep active (DeepSeek-V3 shape, one launch each).
        quant_columns_profile) echo 200 "ncu --clock-control none --kernel-name-base demangled --kernel-name regex:'quantize_columns|quantize_swiglu_backward' --launch-count 10 --csv --page raw --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum' python3 scripts/bench_quantize.py --shapes deepseek_v3 > \$OUT/quant_stalls.csv && python3 scripts/ncu_stalls.py \$OUT/quant_stalls.csv" ;;
        # Megatron on proxy_1gpu: FP8 experts on the kernels against BF16 mok's loss curve (the loss
        # criterion of scripts/throughput.py) beside both baselines (FP8_DISPATCHERS overrides the list,
        # e.g. mok,mok_fp8,mok_fp8_reference: the kernels against the recipe on the reference backend);
        # the run's budget is the step's bound.
        fp8_throughput) echo 420 "env CONFIGS=proxy_1gpu DISPATCHERS=\${FP8_DISPATCHERS:-alltoall_grouped,mok,mok_fp8,alltoall} bash scripts/device_throughput.sh --budget \$((bound - 10))" ;;
        *) echo 0 "unknown" ;;
    esac
}

for step in $STEPS; do
    read -r bound command <<< "$(step_command "$step")"
    if [ "$bound" = 0 ]; then
        echo "| $step | unknown step | 0 | see step_command in $0 |" >> "$table"
        continue
    fi
    left=$(( BUDGET - ($(date +%s) - start) - 5 ))
    if [ $left -lt 20 ]; then
        echo "| $step | skipped | 0 | no time left |" >> "$table"
        continue
    fi
    [ "$bound" -lt "$left" ] || bound=$left
    log="$LOGS/$(echo "$step" | tr -c 'A-Za-z0-9_\n' '_').log"
    began=$(date +%s)
    # In a shell of its own, so that a step made of several commands is bounded and logged whole.
    export bound
    timeout -k 5 "$bound" bash -c "$command" > "$log" 2>&1
    rc=$?
    summary=$(grep -E "[0-9]+ (passed|failed|skipped|errors?)|bitwise equal" "$log" | tail -1 | cut -c1-100)
    [ $rc = 124 ] && summary="killed at its $bound s bound; $summary"
    echo "| $step | $rc | $(( $(date +%s) - began )) | $summary |" >> "$table"
    { echo "== $step (rc $rc, bound $bound s)"; cat "$log"; echo; } >> "$steps_log"
    echo "== $step"
    grep -E "^(FAILED|ERROR)" "$log" | head -15
done
cat "$table"
