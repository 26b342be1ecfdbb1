"""Where an eager call is bound by the host: the emitted module timed per call in a CUDA graph and
eagerly (back-to-back calls, no graph), beside the host's own time per call, on the GPU.

    python tools/host.py 1,2,4,64,4096 [MODULE.py [E,H,I,k]]

The host's time is the wall clock of 50 back-to-back calls that never wait for the GPU (argument
checks, variant choice, allocations and the triton launches), divided by 50, the best of 5 such
rounds: the host is shared and its speed moves between rounds (NOTES 53, 66), so one round does not
separate two forms of the host code, and one round of 200 calls can fill the launch queue and time
the GPU instead (T=64 in run 85). Where the host's time exceeds the graph's time per call, eager
calls leave the GPU idle between kernels and run at the host's pace; where it is below, the launch
queue runs ahead and eager calls cost what the graph's do. A module with planned launches (NOTES 66)
is also timed with them off (`_FAST_LAUNCH = False`: triton's own launches), its rounds interleaved
with the planned ones. Both device timings come after the tuner's settle (timing.SETTLE_MS), in ABBA
rounds (graph, eager, eager, graph, ...): the first timing of a process runs at a higher clock than
the later ones (NOTES 54), so a fixed order favours whichever mode goes first. Each mode's figure is
the median of its rounds' medians. MODULE defaults to this GPU's emitted seed16 module, the shape to
seed16's (bf16).
"""

import functools
import statistics
import sys
import time
from pathlib import Path

import torch

from autotune import emit, render, target
from autotune.timing import SETTLE_MS, time_fn
from autotune.workloads import SEED16_SHAPE, make_tokens, make_weights, parse_shape, suite

HOST_CALLS = 50
HOST_ROUNDS = 5
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


def host_figures(module, call) -> dict[str, float]:
    """The best of HOST_ROUNDS host rounds per launch path: "planned" and "triton" where the module
    plans its launches (rounds interleaved, the module's setting restored), else "host" alone."""
    if not getattr(module, "_FAST_LAUNCH", False):
        return {"host": min(host_us_per_call(call) for _ in range(HOST_ROUNDS))}
    setting, best = module._FAST_LAUNCH, {"planned": float("inf"), "triton": float("inf")}
    try:
        for _ in range(HOST_ROUNDS):
            for path in best:
                module._FAST_LAUNCH = path == "planned"
                best[path] = min(best[path], host_us_per_call(call))
    finally:
        module._FAST_LAUNCH = setting
    return best


def main(argv: list[str]) -> int:
    if not target.has_gpu():
        print("tools/host.py times on the GPU; there is none here")
        return 1
    if not argv:
        print(__doc__)
        return 2
    tokens = [int(t) for t in argv[0].split(",")]
    path = Path(argv[1]) if len(argv) > 1 else emit.module_path(target.fingerprint().key, SEED16_SHAPE.key)
    shape = parse_shape(argv[2]) if len(argv) > 2 else SEED16_SHAPE
    module = render.load_path(path)
    dev = target.device()
    w13, w2 = make_weights(shape, dev, seed=3)
    print(f"{path.name} on {target.fingerprint().key}")
    planned = getattr(module, "_FAST_LAUNCH", False)
    host_columns = "host us per call, planned | host us per call, triton's launches" if planned else "host us per call"
    print(f"| T | graph us | eager us | eager / graph | {host_columns} |")
    print("|---:|---:|---:|---:|---:|" + ("---:|" if planned else ""))
    for T in tokens:
        x, w, ids = make_tokens(suite(shape, [T])[0], dev)
        call = functools.partial(module.fused_experts, x, w13, w2, w, ids, out=torch.empty_like(x))
        times = {True: [], False: []}
        for _ in range(ROUNDS):
            for graph in (True, False, False, True):
                times[graph].append(time_fn(call, graph=graph, settle_ms=SETTLE_MS).median_ms * 1e3)
        graph, eager = statistics.median(times[True]), statistics.median(times[False])
        host = host_figures(module, call)
        print(f"| {T} | {graph:.1f} | {eager:.1f} | {eager / graph:.3f} | "
              + " | ".join(f"{us:.1f}" for us in host.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
