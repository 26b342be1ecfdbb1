"""Does a module's time at T depend on how it is timed? Emitted modules timed, in one process, the way
the tuner times a trial (into a buffer passed as out=, after SETTLE_MS of untimed load) and the way
`moe-tune bench` times a case (allocating its output, unsettled), in interleaved rounds whose order
rotates (timing.turns), each output checked against the fp32 reference first.

    python tools/methods.py 1,2 kernels_generated/h200_sm90_e256_h4096_i2048_k8_bfloat16.py [other.py ...]

Why (NOTES 91): on the H200 the tuner timed seed16's T=1 leader on the k-blocked weights at 0.0997 ms,
and the bench of the module emitted from it, minutes later in the same call, at 0.1145 ms. Each module
takes the tuner's inputs, its weights as it reads them (its prepare_weights where it has one). ROUNDS
sets the rounds (default 3), each 20 CUDA-graph replays per module and method.
"""

import os
import statistics
import sys
from pathlib import Path

import torch

from autotune import render, target
from autotune.reference import BAR
from autotune.runner import CaseState
from autotune.timing import SETTLE_MS, time_fn, turns
from autotune.workloads import SEED16_SHAPE, Case, suite

# (name, pass out=, settle ms): the tuner's way and the bench's, and the two mixed, to tell which part moves.
METHODS = (("tuner", True, SETTLE_MS), ("bench", False, 0.0), ("out=, unsettled", True, 0.0),
           ("alloc, settled", False, SETTLE_MS))


def calls(state: CaseState, module, case: Case) -> dict[str, tuple]:
    """Each method's (call, settle ms) on the case's timed tokens and weights as `module` reads them
    (`state`, the runner's: one prepared copy shared by every module of a layout), its output checked
    first as the tuner checks a trial; {} if it fails."""
    state.prepare(case)
    weights, stats, _ = state.verify(module)
    failures = stats.failures(BAR)
    if failures:
        print(f"T={case.T} {module.__name__}: fails the bar ({'; '.join(failures)}), not timed")
        return {}
    x, w, ids = state.tokens
    out = torch.empty_like(x)
    return {name: ((lambda: module.fused_experts(x, *weights, w, ids, out=out)) if into
                   else (lambda: module.fused_experts(x, *weights, w, ids)), settle)
            for name, into, settle in METHODS}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if not target.has_gpu():
        print("tools/methods.py times on the GPU; there is none here")
        return 1
    tokens, paths = [int(t) for t in argv[0].split(",")], argv[1:]
    rounds = int(os.environ.get("ROUNDS", 3))
    state = CaseState()
    modules = [render.load_path(p, f"methods_{i}") for i, p in enumerate(paths)]
    for T in tokens:
        case = suite(SEED16_SHAPE, [T])[0]  # the routing seed the tuner and the bench use
        runs = {(Path(p).stem, name): fn for p, m in zip(paths, modules, strict=True)
                for name, fn in calls(state, m, case).items()}
        samples = {key: [] for key in runs}
        for r in range(rounds):
            for key in turns(list(runs), r):
                call, settle = runs[key]
                samples[key].append(time_fn(call, reps=20, settle_ms=settle).median_ms)
        for (stem, name), s in samples.items():
            print(f"T={T:<6} {statistics.median(s):8.4f} ms  {name:16s} {stem}  rounds {[round(v, 4) for v in s]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
