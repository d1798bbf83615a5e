"""ops.fp8_expert_gemm's argument checks on the CPU: the wrapper checks types, dtypes, shapes, the
multiples of 128 and contiguity before devices, so every error but the device's shows without a GPU
and before any kernel runs (the kernel's own checks and results: tests/ops/test_gpu_fp8_gemm.py)."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_mok import ops
from megatron_mok.limits import fp8_scale_rows
from cuda_checks import NEEDS_TOOLCHAIN

E4M3 = torch.float8_e4m3fn
R, K, N, E = 10, 256, 384, 3  # R = 10 rows: a_scales pads them to fp8_scale_rows(10) = 12


def gemm_args(**changes):
    """Valid arguments (but for the device: CPU tensors), with `changes` applied."""
    args = dict(
        a=torch.zeros(R, K, dtype=E4M3),
        a_scales=torch.ones(K // 128, fp8_scale_rows(R)),
        weight=torch.zeros(E, N, K, dtype=E4M3),
        weight_scales=torch.ones(E, N // 128, K // 128),
        expert_offsets=torch.tensor([0, 4, 4, 10], dtype=torch.int32),
        cluster_m=1,
        group_m=16,
    )
    args.update(changes)
    return args


# name: (the changed arguments, the error's words)
BAD_ARGS = {
    "a_bf16": (dict(a=torch.zeros(R, K, dtype=torch.bfloat16)), "a must be torch.float8_e4m3fn"),
    "a_e5m2": (dict(a=torch.zeros(R, K, dtype=torch.float8_e5m2)), "a must be torch.float8_e4m3fn"),
    "weight_bf16": (dict(weight=torch.zeros(E, N, K, dtype=torch.bfloat16)), "weight must be torch.float8_e4m3fn"),
    "a_scales_bf16": (dict(a_scales=torch.ones(K // 128, 12, dtype=torch.bfloat16)), "a_scales must be torch.float32"),
    "weight_scales_fp64": (dict(weight_scales=torch.ones(E, N // 128, K // 128, dtype=torch.float64)),
                           "weight_scales must be torch.float32"),
    "offsets_int64": (dict(expert_offsets=torch.tensor([0, 4, 4, 10])), "expert_offsets must be torch.int32"),
    "a_not_tensor": (dict(a=[[0.0] * K] * R), "a must be a tensor"),
    "a_3d": (dict(a=torch.zeros(1, R, K, dtype=E4M3)), r"a must be \(R, K\)"),
    "weight_2d": (dict(weight=torch.zeros(N, K, dtype=E4M3)), r"weight must be \(E, N, K\)"),
    "k_mismatch": (dict(weight=torch.zeros(E, N, 128, dtype=E4M3)), r"weight \(E, N, K\) must have a's K = 256"),
    "no_expert": (dict(weight=torch.zeros(0, N, K, dtype=E4M3)), "weight must hold at least one expert"),
    "k_not_multiple_of_128": (
        dict(a=torch.zeros(R, 192, dtype=E4M3), weight=torch.zeros(E, N, 192, dtype=E4M3)),
        "K .* must be a positive multiple of 128",
    ),
    "n_not_multiple_of_128": (dict(weight=torch.zeros(E, 320, K, dtype=E4M3)), "N .* must be a positive multiple of 128"),
    "a_scales_unpadded": (dict(a_scales=torch.ones(K // 128, R)), r"a_scales must be \(K/128, fp8_scale_rows\(R\)\)"),
    "a_scales_row_major": (dict(a_scales=torch.ones(12, K // 128)), r"a_scales must be \(K/128, fp8_scale_rows\(R\)\)"),
    "weight_scales_transposed": (dict(weight_scales=torch.ones(E, K // 128, N // 128)),
                                 r"weight_scales must be \(E, N/128, K/128\)"),
    "offsets_short": (dict(expert_offsets=torch.tensor([0, 4, 10], dtype=torch.int32)),
                      r"expert_offsets must be \(E \+ 1,\)"),
    "cluster_of_4": (dict(cluster_m=4), "cluster_m must be 1 or 2"),
    "cluster_bool": (dict(cluster_m=True), "cluster_m must be 1 or 2"),
    "group_odd_for_pairs": (dict(cluster_m=2, group_m=3), "group_m must be a multiple of cluster_m"),
    "group_zero": (dict(group_m=0), "group_m must be"),
    "group_float": (dict(group_m=16.0), "group_m must be"),
    "a_not_contiguous": (dict(a=torch.zeros(K, R, dtype=E4M3).t()), "a must be contiguous"),
    "weight_not_contiguous": (dict(weight=torch.zeros(E, K, N, dtype=E4M3).transpose(1, 2)),
                              "weight must be contiguous"),
    "a_scales_not_contiguous": (dict(a_scales=torch.ones(12, K // 128).t()), "a_scales must be contiguous"),
    "cpu_tensors": ({}, r"a must be a CUDA tensor on a's device"),
    "variant_unknown": (dict(variant="fastest"), r"variant must be one of \('default', "),
    "variant_index": (dict(variant=0), r"variant must be one of .* got 0"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_argument_is_a_value_error_naming_it(case):
    changes, words = BAD_ARGS[case]
    with pytest.raises(ValueError, match=f"fp8_expert_gemm: {words}"):
        ops.fp8_expert_gemm(**gemm_args(**changes))


@pytest.mark.parametrize("out,words", [
    (torch.zeros(R, N, dtype=torch.float32), r"out must be torch.bfloat16 \(R, N\)"),
    (torch.zeros(R + 1, N, dtype=torch.bfloat16), r"out must be torch.bfloat16 \(R, N\) = \(10, 384\)"),
    (torch.zeros(N, R, dtype=torch.bfloat16).t(), "out must be contiguous"),
    ("out", "out must be a tensor or None"),
])
def test_bad_out_is_a_value_error_naming_it(out, words):
    with pytest.raises(ValueError, match=f"fp8_expert_gemm: {words}"):
        ops.fp8_expert_gemm(**gemm_args(out=out))


@pytest.mark.parametrize("name,shape", [("a", (R, K)), ("weight", (E, N, K))])
def test_misaligned_operand_is_a_value_error(name, shape):
    """a and weight are read through TMA, whose global address must be 16-byte aligned: a view that
    starts one byte in is refused before any kernel runs (the kernel's tensor map would refuse it
    as a RuntimeError)."""
    numel = 1
    for size in shape:
        numel *= size
    misaligned = torch.zeros(numel + 1, dtype=E4M3)[1:].view(shape)
    with pytest.raises(ValueError, match=f"fp8_expert_gemm: {name} must start 16-byte aligned"):
        ops.fp8_expert_gemm(**gemm_args(**{name: misaligned}))


def test_misaligned_a_scales_is_a_value_error_for_the_staged_scales_variant():
    """wide_ordered_staged_scales bulk-copies each K block's A scales, from a 16-byte aligned row of
    them: a_scales starting one float in is refused before any kernel runs, by both ops it serves,
    naming a_scales and the variant; the other variants read the scales one by one and take it (the
    CPU tensors then stop them at the device check)."""
    shape = (K // 128, fp8_scale_rows(R))
    misaligned = torch.ones(shape[0] * shape[1] + 1)[1:].view(shape)
    words = r"a_scales must start 16-byte aligned for variant 'wide_ordered_staged_scales'"
    with pytest.raises(ValueError, match=f"fp8_expert_gemm: {words}"):
        ops.fp8_expert_gemm(**gemm_args(a_scales=misaligned, variant="wide_ordered_staged_scales"))
    with pytest.raises(ValueError, match=f"fp8_expert_gemm_push: {words}"):
        ops.fp8_expert_gemm_push(**push_args(a_scales=misaligned, variant="wide_ordered_staged_scales"))
    with pytest.raises(ValueError, match="fp8_expert_gemm: a must be a CUDA tensor"):
        ops.fp8_expert_gemm(**gemm_args(a_scales=misaligned, variant="wide_ordered"))


def test_misaligned_or_overlapping_out_is_a_value_error():
    """out starting off a 16-byte boundary, or sharing bytes with an input the kernel reads while it
    writes out (here the weight's), is refused before any kernel runs."""
    misaligned = torch.zeros(R * N + 1, dtype=torch.bfloat16)[1:].view(R, N)
    with pytest.raises(ValueError, match="fp8_expert_gemm: out must start 16-byte aligned"):
        ops.fp8_expert_gemm(**gemm_args(out=misaligned))
    args = gemm_args()
    aliased = args["weight"].view(torch.uint8).view(-1)[: R * N * 2].view(torch.bfloat16).view(R, N)
    with pytest.raises(ValueError, match="fp8_expert_gemm: out must not overlap weight in memory"):
        ops.fp8_expert_gemm(**dict(args, out=aliased))


def test_reference_is_the_promoted_block_formula():
    """The reference on CPU tensors, against the formula written out in float64 (E4M3 products and
    their 128-term sums are exact in fp32 when the values are small integers, so the fp32 reference
    must equal the float64 one exactly here)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-4, 5, (R, K), generator=gen).float().to(E4M3)
    weight = torch.randint(-4, 5, (E, N, K), generator=gen).float().to(E4M3)
    a_scales = torch.ones(K // 128, fp8_scale_rows(R))
    a_scales[:, :R] = 2.0 ** torch.randint(-3, 4, (K // 128, R), generator=gen).float()
    weight_scales = 2.0 ** torch.randint(-3, 4, (E, N // 128, K // 128), generator=gen).float()
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32)  # row 9 is past the last segment: zero
    got = ops.fp8_expert_gemm_reference(a, a_scales, weight, weight_scales, offsets)
    want = torch.zeros(R, N, dtype=torch.float64)
    for e in range(E):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        for b in range(K // 128):
            cols = slice(128 * b, 128 * (b + 1))
            partial = a[lo:hi, cols].double() @ weight[e, :, cols].double().T
            scale = a_scales[b, lo:hi].double()[:, None] * weight_scales[e, :, b].double().repeat_interleave(128)[None]
            want[lo:hi] += scale * partial
    assert got.dtype == torch.float32 and got.shape == (R, N)
    assert torch.equal(got.double(), want)


def test_swiglu_checks_name_their_op_and_f():
    """fp8_expert_gemm_swiglu checks as fp8_expert_gemm does, under its own name, and F (half the
    weight's rows) must itself be a multiple of 128: a 1x128 act block never straddles gate and up."""
    with pytest.raises(ValueError, match="fp8_expert_gemm_swiglu: a must be torch.float8_e4m3fn"):
        ops.fp8_expert_gemm_swiglu(**gemm_args(a=torch.zeros(R, K, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="fp8_expert_gemm_swiglu: weight .* F a multiple of 128, got 384 rows"):
        ops.fp8_expert_gemm_swiglu(**gemm_args())  # 2F = 384: F = 192
    weight = torch.zeros(E, 256, K, dtype=E4M3)
    with pytest.raises(ValueError, match="fp8_expert_gemm_swiglu: a must be a CUDA tensor"):
        ops.fp8_expert_gemm_swiglu(**gemm_args(weight=weight, weight_scales=torch.ones(E, 2, K // 128)))
    # Its mainloops: default and overlap (no pingpong instance), checked before the operands.
    with pytest.raises(ValueError, match=r"fp8_expert_gemm_swiglu: variant must be one of \('default', 'overlap'\), got 'pingpong'"):
        ops.fp8_expert_gemm_swiglu(**gemm_args(weight=weight, weight_scales=torch.ones(E, 2, K // 128), variant="pingpong"))




def push_args(**changes):
    """Valid arguments of ops.fp8_expert_gemm_push (CPU tensors), with `changes` applied: a region
    of 5 tokens x top-2 routes per rank, 3 ranks (this rank's region and two other addresses)."""
    own = torch.zeros(5 * 2, N, dtype=torch.bfloat16)
    args = dict(gemm_args(), slot_to_route=torch.full((R,), -1, dtype=torch.int64), topk=2, num_tokens=5,
                own_combine=own, peer_combine_ptrs=[own.data_ptr(), 1 << 20, 1 << 21])
    args.update(changes)
    return args


# name: (the changed arguments, the error's words)
BAD_PUSH_ARGS = {
    "variant_pingpong": (dict(variant="pingpong"), "fp8_expert_gemm_push: variant must be one of"),
    "routes_int32": (dict(slot_to_route=torch.full((R,), -1, dtype=torch.int32)), "slot_to_route must be an int64 tensor"),
    "routes_short": (dict(slot_to_route=torch.full((R - 1,), -1, dtype=torch.int64)), "slot_to_route must be an int64 tensor of a's rows"),
    "topk_zero": (dict(topk=0), "topk must be an int >= 1"),
    "tokens_negative": (dict(num_tokens=-1), "num_tokens must be an int >= 0"),
    "combine_fp32": (dict(own_combine=torch.zeros(10, N)), r"own_combine must be torch.bfloat16 \(num_tokens \* topk, N\)"),
    "combine_wrong_rows": (dict(own_combine=torch.zeros(9, N, dtype=torch.bfloat16)), "own_combine must be torch.bfloat16"),
    "no_peers": (dict(peer_combine_ptrs=[]), "peer_combine_ptrs must hold 1 to 8"),
    "nine_peers": (dict(peer_combine_ptrs=[1 << 20] * 9), "peer_combine_ptrs must hold 1 to 8"),
    "misaligned_peer": (dict(peer_combine_ptrs=[1 << 20, (1 << 21) + 8]), "16-byte aligned"),
    "own_not_a_peer": (dict(peer_combine_ptrs=[1 << 20, 1 << 21]), "own_combine's address must be one of peer_combine_ptrs"),
    "a_bf16": (dict(a=torch.zeros(R, K, dtype=torch.bfloat16)), "fp8_expert_gemm_push: a must be torch.float8_e4m3fn"),
}


@pytest.mark.parametrize("case", list(BAD_PUSH_ARGS))
def test_bad_push_argument_is_a_value_error_naming_it(case):
    changes, words = BAD_PUSH_ARGS[case]
    with pytest.raises(ValueError, match=words):
        ops.fp8_expert_gemm_push(**push_args(**changes))


def test_push_on_the_cpu_is_a_value_error_after_the_shape_checks():
    """Every argument valid but the device: the error names the device, no kernel runs."""
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        ops.fp8_expert_gemm_push(**push_args())


def swiglu_backward_args(**changes):
    """Valid fp8_expert_gemm_swiglu_backward arguments (but for the device: CPU tensors): weight the
    transposed fc2 copy (E, F, H) with F = N, gate_up (R, 2F)."""
    args = dict(gemm_args(), gate_up=torch.zeros(R, 2 * N, dtype=torch.bfloat16), pow2=False)
    args.update(changes)
    return args


def swiglu_backward_out(**changes):
    out = dict(grad_gate_up=torch.zeros(R, 2 * N, dtype=torch.bfloat16), rows_q=torch.zeros(R, 2 * N, dtype=E4M3),
               rows_scales=torch.ones(2 * N // 128, fp8_scale_rows(R)))
    out.update(changes)
    return tuple(out.values())


BAD_SWIGLU_BACKWARD_ARGS = {
    "wide_variant": (dict(variant="wide"), "variant must be one of"),
    "gate_up_fp32": (dict(gate_up=torch.zeros(R, 2 * N)), r"gate_up must be torch.bfloat16 \(R, 2F\)"),
    "gate_up_f_columns": (dict(gate_up=torch.zeros(R, N, dtype=torch.bfloat16)), r"gate_up must be torch.bfloat16 \(R, 2F\)"),
    "pow2_int": (dict(pow2=1), "pow2 must be a bool"),
    "out_pair": (dict(out=swiglu_backward_out()[:2]), "out must be None or"),
    "out_q_bf16": (dict(out=swiglu_backward_out(rows_q=torch.zeros(R, 2 * N, dtype=torch.bfloat16))),
                   "out's rows_q must be torch.float8_e4m3fn"),
    "out_scales_unpadded": (dict(out=swiglu_backward_out(rows_scales=torch.ones(2 * N // 128, R))),
                            "out's rows_scales must be torch.float32"),
    "out_not_contiguous": (dict(out=swiglu_backward_out(grad_gate_up=torch.zeros(2 * N, R, dtype=torch.bfloat16).t())),
                           "grad_gate_up must be contiguous"),
    "a_bf16": (dict(a=torch.zeros(R, K, dtype=torch.bfloat16)), "a must be torch.float8_e4m3fn"),
}


@pytest.mark.parametrize("case", list(BAD_SWIGLU_BACKWARD_ARGS))
def test_bad_swiglu_backward_argument_is_a_value_error_naming_it(case):
    changes, words = BAD_SWIGLU_BACKWARD_ARGS[case]
    with pytest.raises(ValueError, match="fp8_expert_gemm_swiglu_backward: " + words):
        ops.fp8_expert_gemm_swiglu_backward(**swiglu_backward_args(**changes))


def test_swiglu_backward_out_overlapping_an_input_or_another_output_is_a_value_error():
    args = swiglu_backward_args()
    with pytest.raises(ValueError, match="out's grad_gate_up must not overlap gate_up"):
        ops.fp8_expert_gemm_swiglu_backward(**args, out=(args["gate_up"], *swiglu_backward_out()[1:]))
    shared = torch.zeros(R, 2 * N, dtype=torch.bfloat16)
    q = shared.view(torch.uint8)[:, : 2 * N].view(E4M3)  # rows_q's bytes inside grad_gate_up's
    with pytest.raises(ValueError, match="out's grad_gate_up must not overlap rows_q"):
        ops.fp8_expert_gemm_swiglu_backward(**args, out=(shared, q, swiglu_backward_out()[2]))


def test_swiglu_backward_on_the_cpu_is_a_value_error_after_the_shape_checks():
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        ops.fp8_expert_gemm_swiglu_backward(**swiglu_backward_args())
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        ops.fp8_expert_gemm_swiglu_backward(**swiglu_backward_args(out=swiglu_backward_out()))


@pytest.fixture(scope="module")
def compiled_bindings(tmp_path_factory):
    """(ptxas's log, its (kernel, spill bytes) list, the object's path) of csrc/bindings/fp8_gemm_ops.cu
    compiled once for this module's tests."""
    from cuda_checks import ptxas_report

    out_dir = tmp_path_factory.mktemp("fp8_gemm_ops")
    log, found = ptxas_report("fp8_gemm_ops.cu", out_dir)
    return log, found, str(out_dir / "fp8_gemm_ops.cu.o")


@NEEDS_TOOLCHAIN
def test_kernels_compile_without_spills_or_wgmma_serialization(compiled_bindings):
    """ptxas's verdict on every FP8 GEMM kernel the bindings instantiate (csrc/bindings/fp8_gemm_ops.cu
    compiled as setup.py does): the store, SwiGLU and push epilogues in the default and overlap
    mainloops, the store epilogue in the pingpong, overlap_late_scales and overlap_eager_retire
    ones, and the wide kernel with the store and push epilogues, the next tile's first block issued
    after or before a tile's epilogue (wide, wide_across_tiles), each also with the consumers' blocks
    issued in turn (wide_ordered, wide_ordered_across_tiles), and in turn with the A scales through the
    stages (wide_ordered_staged_scales), at both cluster sizes, all without a
    spill (the promoted sums, the partials and the scales fit the consumers' registers; the pingpong
    turns' bounded waits too), and none of the silent losses tests/ops/test_extension.py lists for
    the BF16 kernels (C7510 a call, C7507 setmaxnreg ignored, C7518 / C7515 wgmma serialized), nor C7514 / C7517
    (accumulators read while ptxas cannot prove their wgmmas done: it serializes every wgmma of the
    kernel; a K loop whose wgmma groups ptxas could not follow did that to a 128 x 192 tile tried on
    2026-12-04, docs/log/changes_2026-12-04.md)."""
    log, found, _ = compiled_bindings
    for warning in ("C7510", "C7507", "C7518", "C7515", "C7514", "C7517"):
        assert warning not in log, log
    kernels = [(name, spill) for name, spill in found if "Fp8ExpertGemmKernel" in name or "Fp8ExpertGemmWideKernel" in name]
    # (cluster 1 and 2) x (SwiGLU default, SwiGLU overlap, store default, store pingpong, store overlap,
    # store overlap_late_scales, store overlap_eager_retire, push default, push overlap, SwiGLU backward
    # default, SwiGLU backward overlap, wide store, wide push, wide_across_tiles store, wide_across_tiles push,
    # wide_ordered store, wide_ordered push, wide_ordered_across_tiles store, wide_ordered_across_tiles push,
    # wide_ordered_staged_scales store, wide_ordered_staged_scales push)
    assert len(kernels) == 42, [name for name, _ in kernels] or log[-4000:]
    assert sum("Fp8SwigluBackwardEpilogue" in name for name, _ in kernels) == 4, [name for name, _ in kernels]
    assert sum("Fp8ExpertGemmWideKernel" in name for name, _ in kernels) == 20, [name for name, _ in kernels]
    assert sum("Fp8PushEpilogue" in name for name, _ in kernels) == 14, [name for name, _ in kernels]
    for name, spill in kernels:
        assert spill == 0, f"{spill} bytes spilled in {name}"


def _opcode(instruction: str) -> str:
    """The opcode of a SASS instruction, without its predicate (@P0, @!P1)."""
    words = instruction.split()
    return words[1] if words[0].startswith("@") else words[0]


@NEEDS_TOOLCHAIN
def test_late_scales_mainloop_issues_each_block_without_a_promotion_in_between(compiled_bindings):
    """overlap_late_scales's one difference from overlap is where ptxas may put the promotion's
    arithmetic (csrc/gemm/fp8_gemm_sm90.cuh kOverlapLateScales). In its SASS, at both cluster sizes:
    every K block's four QGMMAs (from the one that starts a fresh partial to the one that closes the
    group, gsb0) are issued with no FMUL or FFMA among them; and every wait that retires a block
    (WARPGROUP.DEPBAR) has its two A scales through the identity PRMT (selector 0x3210). ptxas puts
    overlap's products among the QGMMAs (docs/log/gpu_2026-12-04_fp8_gemm_scale_stall.log); should
    it learn to fold the PRMT (the identity it is), this fails instead of the variant silently
    becoming overlap again."""
    from cuda_checks import sass_by_function

    _, _, object_path = compiled_bindings
    functions = {name: code for name, code in sass_by_function(object_path).items()
                 if "Fp8ExpertGemmKernel" in name and "Fp8StoreEpilogue" in name and "Fp8MainloopE3" in name}
    assert len(functions) == 2, list(functions)  # cluster 1 and 2
    for name, code in functions.items():
        opcodes = [_opcode(instruction) for instruction in code]
        blocks = 0
        start = None  # the index of the QGMMA that began the block being issued
        for i, instruction in enumerate(code):
            if not opcodes[i].startswith("QGMMA"):
                continue
            if start is None:
                assert "RZ, !UPT" in instruction, (name, i, instruction)  # a fresh partial
                start = i
            if "gsb0" in instruction:
                issued = opcodes[start:i + 1]
                assert sum(op.startswith("QGMMA") for op in issued) == 4, (name, start, code[start:i + 1])
                assert not {"FMUL", "FFMA"} & set(issued), (name, start, code[start:i + 1])
                blocks += 1
                start = None
        # The unrolled K loop's issue sites: block 0, the loop's two, the two-blocks-left tail's.
        assert blocks >= 4, (name, blocks)
        waits = sum(op.startswith("WARPGROUP.DEPBAR") for op in opcodes)
        identities = sum(op == "PRMT" and "0x3210" in ins for op, ins in zip(opcodes, code))
        assert waits >= 4 and identities == 2 * waits, (name, waits, identities)


@NEEDS_TOOLCHAIN
def test_ordered_wide_kernels_take_turns_and_the_others_do_not(compiled_bindings):
    """wide_ordered and wide_ordered_across_tiles differ from wide and wide_across_tiles only by the
    consumers' turns (csrc/gemm/fp8_gemm_wide_sm90.cuh kIssueOrder; wide_ordered_staged_scales takes
    them as wide_ordered does): in their SASS, at both cluster sizes and with both epilogues, the
    issue-order barrier (named barrier 5, tile_sm90.cuh kIssueOrderBarrier, over both consumer
    warpgroups' 256 threads) is taken at exactly two sites, each predicated (one warpgroup's after
    its issue, the other's before), and no other wide kernel takes it. Should the template flag stop
    reaching the loop, this fails instead of the variant silently running as wide."""
    from cuda_checks import named_barrier_syncs, sass_by_function

    _, _, object_path = compiled_bindings
    functions = {name: code for name, code in sass_by_function(object_path).items() if "Fp8ExpertGemmWideKernel" in name}
    assert len(functions) == 20, list(functions)
    ordered = 0
    for name, code in functions.items():
        turns = named_barrier_syncs(code, 5, 256)
        # The kernel's bool template arguments after its epilogue, mangled: kAcrossTiles, kIssueOrder.
        flags = re.search(r"EpilogueELb([01])ELb([01])E", name)
        assert flags is not None, name
        if flags.group(2) == "1":
            ordered += 1
            assert len(turns) == 2 and all(turn.startswith("@") for turn in turns), (name, turns)
        else:
            assert not turns, (name, turns)
    # (cluster 1, 2) x (store, push) x (wide_ordered, wide_ordered_across_tiles, wide_ordered_staged_scales)
    assert ordered == 12, ordered


@NEEDS_TOOLCHAIN
def test_staged_scales_kernels_copy_the_scales_and_the_others_do_not(compiled_bindings):
    """wide_ordered_staged_scales differs from wide_ordered by where the A scales come from
    (csrc/gemm/fp8_gemm_wide_sm90.cuh kStagedScales): in its SASS, at both cluster sizes and with
    both epilogues, the producer bulk-copies them into the stage (UBLKCP, one site), the consumers
    read them from shared memory (LDS: two rows at each of the two sites where a block's products
    are formed, and no other LDS in the kernel), and every stage hand-back that follows a
    scale read is fenced against the async proxy first. No other wide kernel copies or reads scales
    through shared memory. Should the flag stop reaching the producer or the loop, this fails instead
    of the variant silently running as wide_ordered."""
    from cuda_checks import sass_by_function

    _, _, object_path = compiled_bindings
    functions = {name: code for name, code in sass_by_function(object_path).items() if "Fp8ExpertGemmWideKernel" in name}
    staged = 0
    for name, code in functions.items():
        opcodes = [_opcode(instruction) for instruction in code]
        copies = sum(op.startswith("UBLKCP") for op in opcodes)
        # The kernel's bool template arguments after its epilogue, mangled: kAcrossTiles, kIssueOrder, kStagedScales.
        flags = re.search(r"EpilogueELb([01])ELb([01])ELb([01])E", name)
        assert flags is not None, name
        if flags.group(3) == "1":
            staged += 1
            assert flags.group(2) == "1", name  # built in turn only
            assert copies == 1, (name, copies)
            reads = [i for i, op in enumerate(opcodes) if op.startswith("LDS")]
            assert len(reads) == 4, (name, [code[i] for i in reads])
            # Between a scale read and the next consumer arrival on an empty barrier, a proxy fence.
            for i in reads:
                arrival = next(j for j in range(i, len(opcodes)) if opcodes[j].startswith("SYNCS.ARRIVE"))
                assert any(op.startswith("FENCE.VIEW.ASYNC.S") for op in opcodes[i:arrival]), (name, i, arrival)
        else:
            assert copies == 0, (name, copies)
            assert not any(op.startswith("LDS") for op in opcodes), name
    assert staged == 4, staged  # (cluster 1, 2) x (store, push)
