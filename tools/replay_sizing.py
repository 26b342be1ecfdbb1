"""NOTES 93 on a GPU: an emitted module benched with its timed replays sized two ways, in one process,
alternating, each on a fresh import of the module (so each meets its own graph capture at a key's
second call): the way before NOTES 93 (the calls a replay holds counted from the first call timed
alone) and the way since (from the fastest of three). Prints each case's median, calls per sample,
p10-p90 and kernel breakdown; writes $OUT/replay_sizing.json where OUT is set.

    python tools/replay_sizing.py [T,T,...] [MODULE.py [E,H,I,k]]

Defaults: T = 1,2,1 (T=1 first, as in the bench, and again after T=2), this repository's seed16 H200
module, seed16's shape (bf16).
"""

import json
import math
import os
import sys

from autotune import bench, ceilings, db, emit, render, timing
from autotune.workloads import SEED16_SHAPE, Case, parse_shape

SEED16_MODULE = emit.module_path(db.COMMITTED_FINGERPRINT, SEED16_SHAPE.key)
ROUNDS = ("least of 3", "first", "least of 3 again", "first again")


def sized_by_first_call(one_call_ms):
    """A stand-in for timing._one_call_ms: of the three lone calls time_fn asks for, the first one's
    time and no others (inf), so the count comes from that call alone, as before NOTES 93."""
    asked = [0]

    def first_alone(fn) -> float:
        asked[0] += 1
        return one_call_ms(fn) if asked[0] % 3 == 1 else math.inf
    return first_alone


def compare(path: str, cases: list[Case]) -> dict[str, list[dict]]:
    """The bench's rows of `cases` per round of ROUNDS (ceilings measured once)."""
    ceil = ceilings.measure_ceilings()
    fastest, out = timing._one_call_ms, {}
    try:
        for i, label in enumerate(ROUNDS):
            timing._one_call_ms = sized_by_first_call(fastest) if label.startswith("first") else fastest
            module = render.load_path(path, f"replay_sizing_{i}")
            result = bench.run_bench(module.fused_experts, cases, peers=False, ceilings=ceil,
                                     prepare_weights=getattr(module, "prepare_weights", None))
            out[label] = result["cases"]
            for c in result["cases"]:
                ours, t = c["ours"], c["ours"]["timing"] or {}
                kernels = [(k["name"][:28], round(k["us"], 1)) for k in ours.get("kernels") or []]
                print(f"{label:>16} T={c['T']:<5} {ours['ms'] or ours['failures']!s:>10} ms, "
                      f"{t.get('calls_per_sample')} calls a sample, p10-p90 {t.get('p10_ms')}-{t.get('p90_ms')}; "
                      f"{kernels}", flush=True)
    finally:
        timing._one_call_ms = fastest
    return out


def main(argv: list[str]) -> int:
    tokens = [int(t) for t in (argv[0] if argv else "1,2,1").split(",")]
    path = argv[1] if len(argv) > 1 else SEED16_MODULE
    shape = parse_shape(argv[2]) if len(argv) > 2 else SEED16_SHAPE
    out = compare(path, [Case(shape, T) for T in tokens])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "replay_sizing.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
