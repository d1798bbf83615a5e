"""Digests of mok_moe's output and every gradient over a fixed table of GPU cases.

    python scripts/digests.py --out before.json            # record
    python scripts/digests.py --compare before.json        # recompute, exit 1 on any difference

A refactor that must not change behaviour records the digests before and compares after, on the
same device and torch build: inputs come from a seeded CUDA generator, so they are the same bits
in both runs, and the layer is bitwise reproducible, so any changed digest is a changed result.
Only the public API (MoKConfig, mok_moe) is used, so the script runs on either side of a move.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import zlib

import torch

from megatron_mok import MoKConfig, mok_moe

SHAPES = {
    # name: (tokens, hidden, ffn, experts, topk)
    "tiny": (1, 256, 128, 4, 2),
    "small": (256, 512, 256, 8, 4),
    "odd_tokens": (1000, 1024, 384, 16, 8),  # T not a multiple of 128
    "ring_wraps": (4096, 2048, 768, 32, 8),  # 32768 rows: the 16-minibatch ring is reused
}
ROUTINGS = ("uniform", "skewed", "one_expert", "dropped")
CONFIGS = {
    "auto": MoKConfig(backend="kernel"),
    "grouped_mm": MoKConfig(backend="kernel", expert_gemm="grouped_mm"),
    "sm90": MoKConfig(backend="kernel", expert_gemm="sm90"),
    "sm90_no_ring": MoKConfig(backend="kernel", expert_gemm="sm90", dispatch_ring_minibatches=0),
    "sm90_ring3": MoKConfig(backend="kernel", expert_gemm="sm90", dispatch_ring_minibatches=3),
}


def make_inputs(shape, routing: str, seed: int):
    t, h, f, e, k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    scores = torch.randn(t, e, device="cuda", generator=gen)
    if routing == "skewed":
        scores[:, 0] += 4.0  # most tokens pick expert 0 first
    weights, ids = torch.softmax(scores, dim=1).topk(k, dim=1)
    if routing == "one_expert":
        ids[:, 0] = 0
    if routing == "dropped":
        drop = torch.rand(t, k, device="cuda", generator=gen) < 0.3
        ids = torch.where(drop, -1, ids)
    fc1 = (torch.randn(e, 2 * f, h, device="cuda", generator=gen) / h**0.5).bfloat16()
    fc2 = (torch.randn(e, h, f, device="cuda", generator=gen) / f**0.5).bfloat16()
    grad = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    return x, ids.to(torch.int64).contiguous(), weights.float().contiguous(), fc1, fc2, grad


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def run_case(shape, routing: str, config: MoKConfig, seed: int) -> dict[str, str]:
    x, ids, weights, fc1, fc2, grad = make_inputs(shape, routing, seed)
    leaves = [t.requires_grad_() for t in (x, weights, fc1, fc2)]
    y = mok_moe(x, ids, weights, fc1, fc2, config=config)
    y.backward(grad)
    return {"y": digest(y), **{f"d_{n}": digest(t.grad) for n, t in zip(("x", "topk_weights", "fc1", "fc2"), leaves)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the digests to this JSON file")
    parser.add_argument("--compare", help="compare against a JSON file written by --out")
    args = parser.parse_args()
    digests = {}
    for (shape_name, shape), routing, (config_name, config) in itertools.product(SHAPES.items(), ROUTINGS, CONFIGS.items()):
        name = f"{shape_name}/{routing}/{config_name}"
        digests[name] = run_case(shape, routing, config, seed=zlib.crc32(name.encode()))
    print(f"digests: {len(digests)} cases")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(digests, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            expected = json.load(f)
        changed = sorted(name for name in expected if digests.get(name) != expected[name])
        missing = sorted(set(expected) - set(digests))
        for name in changed:
            print(f"CHANGED {name}: {expected[name]} -> {digests.get(name)}")
        print(f"digests: {len(expected) - len(changed)} of {len(expected)} cases bitwise equal" + (f", {len(missing)} missing" if missing else ""))
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
