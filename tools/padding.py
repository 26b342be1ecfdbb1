"""What an expert's padded rows cost: the emitted module on the suite's routing against a balanced one,
on the GPU, in one process.

    python tools/padding.py 4096,8192,16384 [MODULE.py]

Balanced routing gives every expert exactly T*k/E slots (token t takes experts t*k .. t*k + k - 1,
mod E: k distinct experts per token), so where T*k/E is a multiple of the variant's block (or half
of it, with half tails) no row block is padded; each line says how many rows the sorted route's
GEMM1 / GEMM2 compute per slot (space.rows_computed). The two routings are timed in interleaved
rounds whose order rotates (CUDA-graph replays, each after the tuner's settle), then each call's
kernels are profiled once. The ratio bounds what any cut of the padding can buy at that T. MODULE defaults to this GPU's
emitted seed16 module; ROUNDS sets the rounds (default 5).
"""

import functools
import os
import statistics
import sys
from pathlib import Path

import torch

from autotune import emit, render, space, target
from autotune.timing import SETTLE_MS, kernel_breakdown, time_fn, turns
from autotune.workloads import SEED16_SHAPE, make_tokens, make_weights, suite


def balanced_ids(T: int, k: int, E: int, like: torch.Tensor) -> torch.Tensor:
    """[T, k] expert ids, k distinct per token (k <= E), every expert taking T*k/E slots when E divides T*k."""
    if k > E:
        raise ValueError(f"k={k} distinct experts per token needs E >= k (E={E})")
    slots = torch.arange(T * k, device=like.device).view(T, k)
    return (slots % E).to(like.dtype)


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]) or not argv:
        print(__doc__)
        return 0 if argv else 2
    if not target.has_gpu():
        print("tools/padding.py times on the GPU; there is none here")
        return 1
    shape = SEED16_SHAPE
    module = render.load_path(Path(argv[1]) if len(argv) > 1 else emit.this_machine_module_path(shape.key))
    rounds = int(os.environ.get("ROUNDS", 5))
    w13, w2 = render.weights_for(module, *make_weights(shape, target.device()))
    for T in (int(t) for t in argv[0].split(",")):
        x, w, ids = make_tokens(suite(shape, [T])[0], target.device())
        routings = {"suite": ids, "balanced": balanced_ids(T, shape.k, shape.E, ids)}
        out = torch.empty_like(x)
        calls = {name: functools.partial(module.fused_experts, x, w13, w2, w, r, out=out)
                 for name, r in routings.items()}
        samples = {name: [] for name in calls}
        for r in range(rounds):
            for name in turns(list(calls), r):
                samples[name].append(time_fn(calls[name], reps=5, settle_ms=SETTLE_MS).median_ms)
        base = statistics.median(samples["suite"])
        row = module.select_variant(T)
        form = f"M{row.block_m}{'/half' if getattr(row, 'half_tail', False) else ''}"
        for name, call in calls.items():
            ms = statistics.median(samples[name])
            rows1, rows2 = space.rows_computed(row, routings[name], shape.E)
            kernels = kernel_breakdown(call, calls=3) or []
            print(f"T={T:<6} {name:8s} {ms:8.4f} ms  x{ms / base:.3f}  rows computed ({form}): "
                  f"x{rows1 / (T * shape.k):.3f} / x{rows2 / (T * shape.k):.3f}  "
                  f"rounds {[round(s, 3) for s in samples[name]]}")
            print("         " + ", ".join(f"{q['name'][:28]} {q['us']:.0f} us" for q in kernels[:5]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
