"""Does a module's time at T depend on how it is timed? Emitted modules timed, in one process, the way
the tuner times a trial (into a buffer passed as out=, after SETTLE_MS of untimed load) and the way
`moe-tune bench` times a case (allocating its output, unsettled), in interleaved rounds whose order
rotates (tools/ab.py's turns), each output checked against the fp32 reference first.

    python tools/methods.py 1,2 kernels_generated/h200_sm90_e256_h4096_i2048_k8_bfloat16.py [other.py ...]

Why (NOTES 91): on the H200 the tuner timed seed16's T=1 leader on the k-blocked weights at 0.0997 ms,
and the bench of the module emitted from it, minutes later in the same call, at 0.1145 ms. Each module
takes seed16's weights as it reads them (its prepare_weights where it has one). ROUNDS sets the rounds
(default 3), each 20 CUDA-graph replays per module and method.
"""

import os
import statistics
import sys
from pathlib import Path

import torch

from autotune import render, target
from autotune.reference import BAR, error_stats, moe_reference
from autotune.timing import SETTLE_MS, time_fn
from autotune.workloads import SEED16_SHAPE, Case, make_tokens, make_weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import turns  # noqa: E402

# (name, pass out=, settle ms): the tuner's way and the bench's, and the two mixed, to tell which part moves.
METHODS = (("tuner", True, SETTLE_MS), ("bench", False, 0.0), ("out=, unsettled", True, 0.0),
           ("alloc, settled", False, SETTLE_MS))


def calls(module, weights, model_weights, case: Case) -> dict[str, tuple]:
    """Each method's (call, settle ms) on the case's tokens, `weights` as the module reads them, its
    output checked first against the reference on `model_weights`; {} if it fails."""
    x, w, ids = make_tokens(case, target.device())
    ref = moe_reference(x, *model_weights, w, ids)
    failures = error_stats(module.fused_experts(x, *weights, w, ids), ref).failures(BAR)
    if failures:
        print(f"T={case.T} {module.__name__}: fails the bar ({'; '.join(failures)}), not timed")
        return {}
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
    model_weights = make_weights(SEED16_SHAPE, target.device(), seed=0)  # the bench's and the tuner's
    modules = [render.load_path(p, f"methods_{i}") for i, p in enumerate(paths)]
    weights = [render.weights_for(m, *model_weights) for m in modules]
    for T in tokens:
        runs = {(Path(p).stem, name): fn for p, m, ww in zip(paths, modules, weights, strict=True)
                for name, fn in calls(m, ww, model_weights, Case(SEED16_SHAPE, T)).items()}
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
