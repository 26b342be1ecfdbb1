"""Where an eager call is bound by the host: the emitted module timed per call in a CUDA graph and
eagerly (back-to-back calls, no graph), beside the host's own time per call, on the GPU.

    python tools/host.py 1,2,4,64,4096 [MODULE.py [E,H,I,k]]

The host's time is the wall clock of 50 back-to-back calls that never wait for the GPU (argument
checks, variant choice, allocations and the triton launches), divided by 50, the best of 5 such
rounds: the host is shared and its speed moves between rounds (NOTES 53, 66), so one round does not
separate two forms of the host code, and one round of 200 calls can fill the launch queue and time
the GPU instead (T=64 in run 85). Where the host's time exceeds the graph's time per call, eager
calls leave the GPU idle between kernels and run at the host's pace; where it is below, the launch
queue runs ahead and eager calls cost what the graph's do. Each of the module's eager paths is timed:
its own graph replays for few tokens (`_GRAPH_MAX_TOKENS`, NOTES 67), its planned launches (NOTES 66;
`_GRAPH_MAX_TOKENS = 0`) and triton's own launches (`_FAST_LAUNCH = False` too), host rounds
interleaved. The device timings come after the tuner's settle (timing.SETTLE_MS), the modes (the
caller's graph, then each eager path) in an order that rotates each round (timing.turns): the first
timing of a process runs at a higher clock than the later ones (NOTES 54), so a fixed order favours
whichever mode goes first. Each mode's figure is the median of its rounds' medians. MODULE defaults to this GPU's
emitted seed16 module, the shape to seed16's (bf16).
"""

import functools
import statistics
import sys
import time
from pathlib import Path

import torch

from autotune import emit, render, target
from autotune.timing import SETTLE_MS, time_fn, turns
from autotune.workloads import SEED16_SHAPE, make_tokens, make_weights, parse_shape, suite

HOST_CALLS = 50
HOST_ROUNDS = 5
ROUNDS = 4  # each mode takes each turn once with up to four modes


def eager_paths(module) -> dict[str, tuple[bool, int]]:
    """The module's eager paths as its (_FAST_LAUNCH, _GRAPH_MAX_TOKENS) settings: its own graph replays
    (NOTES 67) and planned launches (NOTES 66) where it has them, triton's own launches always."""
    paths = {}
    if getattr(module, "_GRAPH_MAX_TOKENS", 0):
        paths["replay"] = (True, module._GRAPH_MAX_TOKENS)
    if getattr(module, "_FAST_LAUNCH", False):
        paths["planned"] = (True, 0)
    paths["triton"] = (False, 0)
    return paths


def set_path(module, setting: tuple[bool, int]) -> None:
    module._FAST_LAUNCH, module._GRAPH_MAX_TOKENS = setting


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
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not target.has_gpu():
        print("tools/host.py times on the GPU; there is none here")
        return 1
    if not argv:
        print(__doc__)
        return 2
    tokens = [int(t) for t in argv[0].split(",")]
    path = Path(argv[1]) if len(argv) > 1 else emit.this_machine_module_path(SEED16_SHAPE.key)
    shape = parse_shape(argv[2]) if len(argv) > 2 else SEED16_SHAPE
    module = render.load_path(path)
    dev = target.device()
    w13, w2 = render.weights_for(module, *make_weights(shape, dev, seed=3))
    print(f"{path.name} on {target.fingerprint().key}")
    paths = eager_paths(module)
    own = getattr(module, "_FAST_LAUNCH", False), getattr(module, "_GRAPH_MAX_TOKENS", 0)
    print("| T | graph us | " + " | ".join(f"eager us, {p}" for p in paths) + " | "
          + " | ".join(f"eager / graph, {p}" for p in paths) + " | "
          + " | ".join(f"host us per call, {p}" for p in paths) + " |")
    print("|---:|---:|" + "---:|" * 3 * len(paths))
    try:
        for T in tokens:
            x, w, ids = make_tokens(suite(shape, [T])[0], dev)
            call = functools.partial(module.fused_experts, x, w13, w2, w, ids, out=torch.empty_like(x))
            modes = [None, *paths]  # None: the whole call as the caller's CUDA graph
            times = {m: [] for m in modes}
            for r in range(ROUNDS):
                for m in turns(modes, r):
                    set_path(module, own if m is None else paths[m])
                    times[m].append(time_fn(call, graph=m is None, settle_ms=SETTLE_MS).median_ms * 1e3)
            us = {m: statistics.median(v) for m, v in times.items()}
            host = dict.fromkeys(paths, float("inf"))
            for _ in range(HOST_ROUNDS):
                for p in paths:
                    set_path(module, paths[p])
                    host[p] = min(host[p], host_us_per_call(call))
            print(f"| {T} | {us[None]:.1f} | " + " | ".join(f"{us[p]:.1f}" for p in paths) + " | "
                  + " | ".join(f"{us[p] / us[None]:.3f}" for p in paths) + " | "
                  + " | ".join(f"{host[p]:.1f}" for p in paths) + " |")
    finally:
        set_path(module, own)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
