"""Where an eager call is bound by the host: the emitted module timed per call in a CUDA graph and
eagerly (back-to-back calls, no graph), beside the host's own time per call, on the GPU.

    python tools/host.py 1,2,4,64,4096 [MODULE.py]

The host's time is the wall clock of 50 back-to-back calls that never wait for the GPU (argument
checks, variant choice, allocations and the triton launches), divided by 50. Where it exceeds the
graph's time per call, eager calls leave the GPU idle between kernels and run at the host's pace;
where it is below, the launch queue runs ahead and eager calls cost what the graph's do. Both device
timings come after the tuner's settle (timing.SETTLE_MS), in ABBA rounds (graph, eager, eager, graph,
...): the first timing of a process runs at a higher clock than the later ones (NOTES 54), so a fixed
order favours whichever mode goes first. Each mode's figure is the median of its rounds' medians.
MODULE defaults to this GPU's emitted seed16 module.
"""

import functools
import statistics
import sys
import time
from pathlib import Path

import torch

from autotune import emit, render, target
from autotune.timing import SETTLE_MS, time_fn
from autotune.workloads import SEED16_SHAPE, make_tokens, make_weights, suite

HOST_CALLS = 50
ROUNDS = 2  # each an ABBA pair: graph, eager, eager, graph


def host_us_per_call(fn, calls: int = HOST_CALLS) -> float:
    """Wall-clock µs per call of `calls` back-to-back calls that do not wait for the device."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main(argv: list[str]) -> int:
    if not target.has_gpu():
        print("tools/host.py times on the GPU; there is none here")
        return 1
    if not argv:
        print(__doc__)
        return 2
    tokens = [int(t) for t in argv[0].split(",")]
    path = Path(argv[1]) if len(argv) > 1 else emit.module_path(target.fingerprint().key, SEED16_SHAPE.key)
    module = render.load_path(path)
    dev = target.device()
    w13, w2 = make_weights(SEED16_SHAPE, dev, seed=3)
    print(f"{path.name} on {target.fingerprint().key}")
    print("| T | graph us | eager us | eager / graph | host us per call |")
    print("|---:|---:|---:|---:|---:|")
    for T in tokens:
        x, w, ids = make_tokens(suite(SEED16_SHAPE, [T])[0], dev)
        call = functools.partial(module.fused_experts, x, w13, w2, w, ids, out=torch.empty_like(x))
        times = {True: [], False: []}
        for _ in range(ROUNDS):
            for graph in (True, False, False, True):
                times[graph].append(time_fn(call, graph=graph, settle_ms=SETTLE_MS).median_ms * 1e3)
        graph, eager = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {T} | {graph:.1f} | {eager:.1f} | {eager / graph:.3f} | {host_us_per_call(call):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
