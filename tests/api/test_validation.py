"""Bad input raises ValueError/TypeError naming the argument, before any work."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import MoKConfig, mok_moe

T, H, F, E, K = 6, 8, 4, 3, 2


def good():
    return dict(
        x=torch.randn(T, H),
        topk_ids=torch.randint(0, E, (T, K)),
        topk_weights=torch.rand(T, K),
        fc1=torch.randn(E, 2 * F, H),
        fc2=torch.randn(E, H, F),
    )


def call(args, **kwargs):
    return mok_moe(args.pop("x"), args.pop("topk_ids"), args.pop("topk_weights"), args.pop("fc1"), args.pop("fc2"), **args, **kwargs)


BAD_INPUTS = [
    # (case, change, exception, message fragment)
    ("x not a tensor", lambda a: a.update(x=[[1.0]]), TypeError, "x must be a torch.Tensor"),
    ("x 3-D", lambda a: a.update(x=a["x"].view(2, 3, H)), ValueError, "x must be"),
    ("x fp16", lambda a: a.update(x=a["x"].half()), TypeError, "x must be bfloat16 or float32"),
    ("x fp64", lambda a: a.update(x=a["x"].double()), TypeError, "x must be bfloat16 or float32"),
    ("x non-contiguous", lambda a: a.update(x=torch.randn(H, T).t()), ValueError, "x must be contiguous"),
    ("ids float", lambda a: a.update(topk_ids=a["topk_ids"].float()), TypeError, "topk_ids must be int32 or int64"),
    ("ids 1-D", lambda a: a.update(topk_ids=a["topk_ids"][:, 0]), ValueError, "topk_ids must be"),
    ("ids T mismatch", lambda a: a.update(topk_ids=a["topk_ids"][:-1]), ValueError, "topk_ids has 5 rows"),
    ("ids zero columns", lambda a: a.update(topk_ids=a["topk_ids"][:, :0], topk_weights=a["topk_weights"][:, :0]), ValueError, "topk_ids must have at least one column"),
    ("id too large", lambda a: a["topk_ids"].__setitem__((0, 0), E), ValueError, "topk_ids holds expert id 3"),
    ("id below -1", lambda a: a["topk_ids"].__setitem__((1, 1), -2), ValueError, "topk_ids holds expert id -2"),
    ("weights bf16", lambda a: a.update(topk_weights=a["topk_weights"].bfloat16()), TypeError, "topk_weights must be float32"),
    ("weights K mismatch", lambda a: a.update(topk_weights=torch.rand(T, K + 1)), ValueError, "topk_weights has shape"),
    ("fc1 2-D", lambda a: a.update(fc1=a["fc1"][0]), ValueError, "fc1 must be"),
    ("fc1 dtype", lambda a: a.update(fc1=a["fc1"].bfloat16()), TypeError, "fc1 must have x's dtype"),
    ("fc1 hidden mismatch", lambda a: a.update(fc1=torch.randn(E, 2 * F, H + 1)), ValueError, "fc1 has input size"),
    ("fc1 odd rows", lambda a: a.update(fc1=torch.randn(E, 2 * F + 1, H)), ValueError, "fc1 must stack gate and up"),
    ("fc1 non-contiguous", lambda a: a.update(fc1=torch.randn(E, H, 2 * F).transpose(1, 2)), ValueError, "fc1 must be contiguous"),
    ("fc2 wrong ffn", lambda a: a.update(fc2=torch.randn(E, H, F + 1)), ValueError, "fc2 must be"),
    ("fc2 wrong experts", lambda a: a.update(fc2=torch.randn(E + 1, H, F)), ValueError, "fc2 must be"),
    ("fc2 dtype", lambda a: a.update(fc2=a["fc2"].bfloat16()), TypeError, "fc2 must have x's dtype"),
    ("no experts", lambda a: a.update(fc1=torch.randn(0, 2 * F, H), fc2=torch.randn(0, H, F)), ValueError, "fc1 must hold at least one local expert"),
    ("shared_fc1 alone", lambda a: a.update(shared_fc1=torch.randn(4, H)), ValueError, "shared_fc1 and shared_fc2 must be given together"),
    ("shared_fc1 shape", lambda a: a.update(shared_fc1=torch.randn(4, H + 1), shared_fc2=torch.randn(H, 2)), ValueError, "shared_fc1 must be"),
    ("shared_fc2 shape", lambda a: a.update(shared_fc1=torch.randn(4, H), shared_fc2=torch.randn(H, 3)), ValueError, "shared_fc2 must be"),
    ("config type", lambda a: a.update(config="reference"), TypeError, "config must be a MoKConfig"),
]


@pytest.mark.parametrize("case,change,error,fragment", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_rejected(case, change, error, fragment):
    args = good()
    change(args)
    with pytest.raises(error, match=fragment):
        call(args)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(backend="fast"), "MoKConfig.backend"),
        (dict(segment_alignment=0), "MoKConfig.segment_alignment"),
        (dict(expert_gemm="cublas"), "MoKConfig.expert_gemm"),
        (dict(dispatch_ring_minibatches=2), "MoKConfig.dispatch_ring_minibatches"),
        (dict(dispatch_ring_minibatches=-1), "MoKConfig.dispatch_ring_minibatches"),
        (dict(dispatch_ring_minibatches=4.0), "MoKConfig.dispatch_ring_minibatches"),
        (dict(dispatch_ring_minibatches=True), "MoKConfig.dispatch_ring_minibatches"),
    ],
)
def test_bad_config(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        MoKConfig(**kwargs)


def test_group_without_distributed_is_rejected():
    import torch.distributed as dist

    assert not dist.is_initialized()
    args = good()
    with pytest.raises(ValueError, match="group was given"):
        call(args, group=object())


@pytest.mark.parametrize(
    "case,change,fragment",
    [("config type", lambda a: a.update(config={"precision": "fp8_blockwise"}), "config must be a MoKConfig"),
     ("x not a tensor", lambda a: a.update(x=[[1.0]]), "x must be a torch.Tensor")],
    ids=["config type", "x not a tensor"],
)
def test_functional_forward_names_the_argument_before_reading_it(case, change, fragment):
    """The functional entry reads config's fields and x's device (the group) first: it checks them
    before, as mok_moe does."""
    from megatron_mok import functional

    args = good()
    change(args)
    with pytest.raises(TypeError, match=fragment):
        functional.forward(args.pop("x"), args.pop("topk_ids"), args.pop("topk_weights"), args.pop("fc1"), args.pop("fc2"), **args)
