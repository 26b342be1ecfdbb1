"""Same-process A/B on the GPU: each case's leader against variants of it, verified, then timed in
interleaved rounds so that a drifting clock weighs on every variant alike (each round rotates the
order, so each variant also takes each turn alike).

    python tools/ab.py 16384,32768 "g1_tma_store=True,g2_sorted_out=True" [more assignments ...]

Each assignment is applied to the case's leader (the variant `moe-tune emit` would ship from
db/moe_tune.sqlite3 for this GPU); variants the space rejects are reported and skipped. With
BREAKDOWN=1 it also prints where each variant's device time goes, kernel by kernel. ROUNDS sets the
number of rounds (default 5, each 5 CUDA-graph replays per variant), and SETTLE_MS the untimed load
before each variant's replays in a round (default the tuner's, timing.SETTLE_MS; 0 for none), so
that every timing is taken in the capped state that sustained load leaves the card in. With EAGER=1
each round also times 5 eager back-to-back calls per variant (no graph), reported beside the graph
figures: a difference that shows in one and not the other is the graph's (NOTES 20). LEADERS_OF names
another card's fingerprint key to take the leaders from (e.g. H200-sm90-triton3.6.0 when only an H100
is to be had): the comparison is then relative, on this card, of variants tuned on that one. MODULES
names a folder to write each verified variant's one-variant module to, as T<T>-<i>.py (0 the leader,
then the assignments in order), for tools that take a module file (tools/dram.sh).
"""

import functools
import os
import statistics
import sys
from pathlib import Path

import torch
from sqlalchemy.orm import Session

from autotune import db, emit, render, space, target
from autotune.reference import BAR
from autotune.runner import CaseState
from autotune.space import Variant
from autotune.timing import SETTLE_MS, kernel_breakdown, time_fn, turns
from autotune.workloads import SEED16_SHAPE, Case, suite


def candidates(lead: Variant, case: Case, assignments: list[str]) -> list[tuple[str, Variant]]:
    """The leader, then each assignment applied to it, rejected and repeated ones left out."""
    out = [("leader", lead)]
    for text in assignments:
        v = Variant.from_dict({**lead.as_dict(), **space.parse_assignments(text)})
        bad = space.violations(v, case)
        if bad:
            print(f"T={case.T} {text}: rejected ({'; '.join(bad[:2])})")
        elif all(v != seen for _, seen in out):
            out.append((text, v))
    return out


def compare(case: Case, cands: list[tuple[str, Variant]], rounds: int, breakdown: bool, eager: bool = False,
            settle_ms: float = SETTLE_MS) -> None:
    state = CaseState()
    state.prepare(case)
    runs = []
    save = Path(os.environ["MODULES"]) if os.environ.get("MODULES") else None
    if save:
        save.mkdir(parents=True, exist_ok=True)
    for i, (name, v) in enumerate(cands):
        source = render.render_variant(v)
        module = render.load_source(source)
        weights, stats, _ = state.verify(module)
        failures = stats.failures(BAR)
        if failures:
            print(f"T={case.T} {v.label}: fails the bar ({'; '.join(failures)}), not timed")
            continue
        if save:
            (save / f"T{case.T}-{i}.py").write_text(source)
        runs.append((name, v, module, weights))
    x, w, ids = state.tokens
    buf = torch.empty_like(x)
    calls = {name: functools.partial(module.fused_experts, x, *weights, w, ids, out=buf)
             for name, _, module, weights in runs}
    methods = ("graph", "eager") if eager else ("graph",)
    samples = {(name, how): [] for name in calls for how in methods}
    for r in range(rounds):
        for name in turns(list(calls), r):
            for how in methods:
                timing = time_fn(calls[name], reps=5, graph=how == "graph", settle_ms=settle_ms)
                samples[name, how].append(timing.median_ms)
    for how in methods:
        lead_ms = statistics.median(samples["leader", how])
        for name, v, *_ in runs:
            ms = statistics.median(samples[name, how])
            print(f"T={case.T:<6} {ms:8.4f} ms  x{ms / lead_ms:.3f}  {how:5s}  {v.label}  rounds "
                  f"{[round(s, 3) for s in samples[name, how]]}")
    if breakdown:
        for name, call in calls.items():
            kernels = kernel_breakdown(call, calls=3) or []
            print(f"         {name}: " + ", ".join(f"{k['name'][:28]} {k['us']:.0f} us" for k in kernels[:5]))


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]) or not argv:
        print(__doc__)
        return 0 if argv else 2
    if not target.has_gpu():
        print("tools/ab.py times on the GPU; there is none here")
        return 1
    tokens = [int(t) for t in argv[0].split(",")]
    rounds = int(os.environ.get("ROUNDS", 5))
    source = os.environ.get("LEADERS_OF") or target.fingerprint().key
    with Session(db.connect(db.GPU_URL)) as session:
        for T in tokens:
            case = suite(SEED16_SHAPE, [T])[0]  # the routing seed the tuner and the bench use
            best = emit.leader(session, source, case)
            if best is None:
                print(f"T={T}: no leader of today's templates in the database for {source}")
                continue
            compare(case, candidates(Variant.from_dict(best.params), case, argv[1:]), rounds,
                    bool(os.environ.get("BREAKDOWN")), bool(os.environ.get("EAGER")),
                    float(os.environ.get("SETTLE_MS", SETTLE_MS)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
