"""The benchmark: each case against its floor (ceilings measured in-process) and the peers, and the
report formats.

Every time below comes from `timing.time_fn`, in the same process as the ceilings it is judged
against (shared/REFERENCE.md: both ceilings drift between runs and with how long the GPU has been
loaded). Under the interpreter the code paths run on tiny sizes and the numbers mean nothing.

    floor_ms = max(bytes_moved / read bandwidth, flops / matrix rate)      %SOL = floor_ms / ms · 100
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone

import torch

from . import space, target
from .ceilings import SUSTAINED_CALLS, Ceilings, floor_ms, free_gpu_memory, measure_ceilings
from .peers import PEERS, Peer
from .reference import error_stats, moe_reference
from .timing import SmClockSampler, Timing, kernel_breakdown, time_fn
from .workloads import Case, experts_touched, make_tokens, make_weights

# Untimed calls before each entry's timing. The first case after the weights are made and prepared ran
# slow for its first ~25 ms of calls (NOTES 95: seed16 T=1 x1.17 on an H100, where the same case later in
# the process did not), which an unsettled T=1 timing (~20-40 ms of calls) sits in; 50 ms clears it. Far
# short of the tuner's SETTLE_MS, which times in the power cap's state.
BENCH_SETTLE_MS = 50.0


def _time(fn, *, graph: bool, reps: int, warmup: int, settle_ms: float = 0.0) -> Timing:
    """time_fn in a CUDA graph when `graph`, falling back to plain events if capture fails."""
    if graph:
        try:
            return time_fn(fn, reps=reps, warmup=warmup, graph=True, settle_ms=settle_ms)
        except RuntimeError as exc:
            print(f"[bench] CUDA graph capture failed ({str(exc)[:120]}); timing without it",
                  file=sys.stderr, flush=True)
    return time_fn(fn, reps=reps, warmup=warmup, graph=False, settle_ms=settle_ms)


def _measure(fn, args, ref_TH, case: Case, floor: float, bytes_moved: int, *, graph: bool, timer) -> dict:
    """Run once, check against the reference, and only then time. A failing output gets no time."""
    entry = {"ok": False, "failures": [], "error": None, "ms": None, "timing": None,
             "pct_sol": None, "tflops": None, "tbps": None}
    try:
        out_TH = fn(*args)
    except Exception as exc:  # noqa: BLE001 - a crashing party is a flagged row, not a crashed benchmark
        entry["failures"] = [f"raised {type(exc).__name__}: {exc}"[:500]]
        return entry
    stats = error_stats(out_TH, ref_TH)
    entry["error"] = asdict(stats)
    entry["failures"] = stats.failures()
    if out_TH.shape != ref_TH.shape or out_TH.dtype != args[0].dtype:
        entry["failures"].append(f"returned {tuple(out_TH.shape)} {out_TH.dtype}")
    if entry["failures"]:
        return entry
    del out_TH
    with SmClockSampler() as clock:
        timing = timer(lambda: fn(*args), graph=graph)
    sec = timing.median_ms * 1e-3
    entry.update(ok=True, ms=timing.median_ms, timing=timing.as_dict(), pct_sol=floor / timing.median_ms * 100,
                 tflops=case.flops / sec / 1e12, tbps=bytes_moved / sec / 1e12, sm_clock_mhz=clock.summary(),
                 board_power_w=clock.power_summary())
    return entry


def _bench_case(fused_experts, case, w13_EnH, w2_EHI, ceilings, peers, timer, variant_for=None,
                prepared=None) -> dict:
    """One row: reference, experts touched, floor, then ours and each peer checked and timed (and,
    given the variant that serves T, the rows each of our GEMMs computes). Ours takes `prepared`,
    the weights its prepare_weights made, where it has one; the reference and the peers the weights."""
    x_TH, w_TK, ids_TK = make_tokens(case, target.device())
    args = (x_TH, w13_EnH, w2_EHI, w_TK, ids_TK)
    ours_args = args if prepared is None else (x_TH, *prepared, w_TK, ids_TK)
    ref_TH = moe_reference(*args)
    touched = experts_touched(ids_TK, case.shape.E)
    floor, nbytes = floor_ms(case, touched, ceilings), case.bytes_moved(touched)
    row = {"key": case.key, "case": case.as_dict(), "T": case.T, "experts_touched": touched,
           "bytes": nbytes, "flops": case.flops, "floor_ms": floor}
    measure = lambda fn, graph, args=args: _measure(fn, args, ref_TH, case, floor, nbytes, graph=graph, timer=timer)
    row["ours"] = measure(fused_experts, True, ours_args)
    if variant_for is not None:
        row["ours"]["rows_computed"] = list(space.rows_computed(variant_for(case.T), ids_TK, case.shape.E))
    row["peers"] = {}
    for peer in peers:
        entry = measure(peer.fn, peer.graph_safe)
        ours_ms = row["ours"]["ms"]
        entry["speedup"] = entry["ms"] / ours_ms if entry["ms"] and ours_ms else None
        row["peers"][peer.name] = entry
    if row["ours"]["ok"]:
        # Profiled last, so the profiler cannot disturb any timing above.
        row["ours"]["kernels"] = kernel_breakdown(lambda: fused_experts(*ours_args))
    return row


def _mean_or_none(values: list) -> float | None:
    """Mean over all cases, or None if any case has no number: a partial mean is not the headline."""
    return statistics.fmean(values) if values and all(v is not None for v in values) else None


def _means(rows: list[dict], peers: tuple[Peer, ...]) -> dict:
    parties = {"ours": [r["ours"] for r in rows]}
    parties.update({p.name: [r["peers"][p.name] for r in rows] for p in peers})
    means = {"floor_ms": _mean_or_none([r["floor_ms"] for r in rows])}
    for name, entries in parties.items():
        means[name] = {"ms": _mean_or_none([e["ms"] for e in entries]),
                       "pct_sol": _mean_or_none([e["pct_sol"] for e in entries]),
                       "failed": sum(not e["ok"] for e in entries)}
    return means


def _progress(i: int, n: int, row: dict) -> None:
    def say(entry):
        if not entry["ok"]:
            return "FAILED " + "; ".join(entry["failures"])
        text, clock, power = f"{entry['ms']:.4g} ms", entry.get("sm_clock_mhz"), entry.get("board_power_w")
        if clock:
            watts = f", {power['median']:.0f} W" if power else ""
            text += f" (SM {clock['first']}->{clock['last']} MHz{watts})"
        return text
    parts = [f"[bench] {i}/{n} {row['key']}: floor {row['floor_ms']:.4g} ms, ours {say(row['ours'])}"]
    parts += [f"{name} {say(e)}" for name, e in row["peers"].items()]
    print(", ".join(parts), file=sys.stderr, flush=True)


def _prepare(prepare_weights, w13_EnH, w2_EHI, shape) -> tuple[tuple, dict]:
    """The module's one-time weight step, timed apart from the op: its result, and a record of one
    call's wall time after a first (the first pays the allocator's growth)."""
    prepared = prepare_weights(w13_EnH, w2_EHI)
    sync = torch.cuda.synchronize if target.has_gpu() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    again = prepare_weights(w13_EnH, w2_EHI)
    sync()
    ms = (time.perf_counter() - t0) * 1e3
    del again
    nbytes = 2 * sum(w.numel() * w.element_size() for w in (w13_EnH, w2_EHI))
    return prepared, {"shape": shape.key, "ms": ms, "bytes": nbytes, "tbps": nbytes / ms / 1e9}


def run_bench(fused_experts, cases: list[Case], *, peers: bool = True, ceilings: Ceilings | None = None,
              reps: int = 20, warmup: int = 3, settle_ms: float = BENCH_SETTLE_MS, variant_for=None,
              prepare_weights=None) -> dict:
    """Benchmark `fused_experts` (the op's signature) on `cases` against the floor and the peers.
    `variant_for(T)`, where given (an emitted module's select_variant), names the variant that serves
    T, so that each row also records the rows our GEMMs compute (space.rows_computed). Where the
    module reads a weight layout of its own, `prepare_weights` makes it once per shape: that step is
    timed on its own (result["prepare_weights"]), and the op's timings take its result.

    Weights: make_weights(shape, device, seed=0), once per Shape; tokens: make_tokens(case). Every
    output is checked against moe_reference before it is timed. Returns a JSON-serialisable dict:
    fingerprint, date, ceilings, peers, one row per case, and means over the cases. Every entry (ours
    and each peer's) is timed after `settle_ms` of untimed calls.
    """
    ceilings = ceilings or measure_ceilings(reps=reps)
    used = PEERS if peers else ()
    timer = functools.partial(_time, reps=reps, warmup=warmup, settle_ms=settle_ms)
    rows, prepare_records = [], []
    for shape in dict.fromkeys(c.shape for c in cases):
        w13_EnH, w2_EHI = make_weights(shape, target.device(), seed=0)
        prepared = None
        if prepare_weights is not None:
            prepared, record = _prepare(prepare_weights, w13_EnH, w2_EHI, shape)
            prepare_records.append(record)
            print(f"[bench] prepare_weights ({shape.key}): {record['ms']:.1f} ms, once (not in any case's time)",
                  file=sys.stderr, flush=True)
        for case in (c for c in cases if c.shape == shape):
            rows.append(_bench_case(fused_experts, case, w13_EnH, w2_EHI, ceilings, used, timer,
                                    variant_for, prepared))
            _progress(len(rows), len(cases), rows[-1])
        del w13_EnH, w2_EHI, prepared
        free_gpu_memory()
    return {
        "fingerprint": target.fingerprint().as_dict(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "ceilings": ceilings.as_dict(),
        "peers": [{"name": p.name, "label": p.label, "short": p.short} for p in used],
        "cases": rows,
        "mean": _means(rows, used),
        **({"prepare_weights": prepare_records} if prepare_weights is not None else {}),
    }


def format_kernels(result: dict, top: int = 4) -> str:
    """Per case, our kernels' device time per call (profiled outside a graph), longest first."""
    lines = []
    for row in result["cases"]:
        kernels = row["ours"].get("kernels")
        if not kernels:
            continue
        total = sum(k["us"] for k in kernels)
        parts = [f"{k['name'].lstrip('_').removesuffix('_kernel')} {k['us']:.1f}"
                 + (f" (x{k['launches']:g})" if k["launches"] != 1 else "") for k in kernels[:top]]
        rest = total - sum(k["us"] for k in kernels[:top])
        if rest > 0:
            parts.append(f"other {rest:.1f}")
        lines.append(f"T={row['T']:<6} kernels {total:9.1f} us (graph {row['ours']['ms'] * 1e3:9.1f}): "
                     + ", ".join(parts))
    return "\n".join(lines)


def format_gemm_rates(result: dict) -> str:
    """Per case, each GEMM's profiled time and its matrix rate on the rows it computes (padding
    included), with the rate on the rows the op needs (T*k) in brackets: how much of a GEMM's gap to
    the ceiling is padding and how much is the kernel. Cases without a profile or row counts are left
    out."""
    lines = []
    for row in result["cases"]:
        ours, shape = row["ours"], row["case"]["shape"]
        kernels, computed = ours.get("kernels"), ours.get("rows_computed")
        if not kernels or not computed:
            continue
        needed = row["T"] * shape["k"]
        parts = [f"T={row['T']:<6} rows x{computed[0] / needed:.3f} / x{computed[1] / needed:.3f}"]
        # GEMM1: [rows, H] x [H, 2I]; GEMM2: [rows, I] x [I, H].
        for which, rows, n, k_dim in ((1, computed[0], 2 * shape["I"], shape["H"]),
                                      (2, computed[1], shape["H"], shape["I"])):
            us = sum(k["us"] for k in kernels if k["name"].lstrip("_").startswith(f"gemm{which}"))
            if us:
                rate = 2 * n * k_dim / (us * 1e-6) / 1e12
                parts.append(f"GEMM{which} {us:.0f} us {rate * rows:.0f} TFLOP/s ({rate * needed:.0f})")
        lines.append("  ".join(parts))
    return "\n".join(lines)


def _num(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def format_table(result: dict) -> str:
    """Markdown: one row per case (T, ours, floor, %SOL, rates, each peer and our speed-up), then means."""
    peers = result["peers"]
    head = ["T", "ms", "floor ms", "%SOL", "TFLOP/s", "TB/s"]
    for p in peers:
        head += [f"{p['label']} ms", f"speed-up vs {p['short']}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in result["cases"]:
        o = r["ours"]
        cells = [str(r["T"]), _num(o["ms"], ".4g") if o["ok"] else "FAIL", _num(r["floor_ms"], ".4g"),
                 _num(o["pct_sol"], ".1f"), _num(o["tflops"], ".1f"), _num(o["tbps"], ".2f")]
        for p in peers:
            e = r["peers"][p["name"]]
            cells += [_num(e["ms"], ".4g") if e["ok"] else "FAIL", _num(e["speedup"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    m = result["mean"]
    cells = ["**mean**", _num(m["ours"]["ms"], ".4g"), _num(m["floor_ms"], ".4g"),
             _num(m["ours"]["pct_sol"], ".1f"), "", ""]
    for p in peers:
        pm, om = m[p["name"]]["ms"], m["ours"]["ms"]
        cells += [_num(pm, ".4g"), _num(pm / om if pm and om else None, ".2f")]
    lines.append("| " + " | ".join(cells) + " |")
    for record in result.get("prepare_weights", ()):
        lines.append(f"\nprepare_weights, once per model ({record['shape']}): {record['ms']:.1f} ms "
                     f"({record['bytes'] / 1e9:.1f} GB read and written), in no case's time above.")
    return "\n".join(lines) + "\n"


def format_sustained(result: dict) -> str:
    """One line: the matrix rate under sustained load beside the ceiling, and each compute-bound
    case's rate against it ("" where it was not measured)."""
    c = result["ceilings"]
    rate = c.get("sustained_matmul_flops_per_s")
    if not rate:
        return ""
    clock = c.get("sustained_sm_clock_mhz")
    clock_note = f", SM clock {clock['first']} -> {clock['last']} MHz" if clock else ""
    bound = [r for r in result["cases"] if r["ours"]["ok"] and r["ours"].get("tflops")
             and r["flops"] / c["matmul_flops_per_s"] >= r["bytes"] / c["read_bytes_per_s"]]
    cases = ", ".join(f"T={r['T']} {100 * r['ours']['tflops'] * 1e12 / rate:.1f}%" for r in bound)
    return (f"Matrix rate under sustained load: {rate / 1e12:.0f} TFLOP/s (our GEMM, replays of "
            f"{SUSTAINED_CALLS} back-to-back calls{clock_note}), against the ceiling's "
            f"{c['matmul_flops_per_s'] / 1e12:.0f} on short replays. Not in the floor."
            + (f" The compute-bound cases against it: {cases}." if cases else ""))


def _finite(obj):
    """JSON has no NaN or Inf (an error stat of a broken output can be either): write them as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(result: dict, path) -> None:
    with open(path, "w") as f:
        json.dump(_finite(result), f, indent=1, allow_nan=False)
        f.write("\n")


def write_png(result: dict, path) -> None:
    """Latency vs T (log-log) for ours, the floor and each peer; %SOL vs T beside it."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("the bench plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["cases"] if r["T"] > 0]  # log axes have no place for T = 0

    def known(values):
        """(T, value) pairs where the value exists: failed and unavailable cells are left out."""
        pairs = [(r["T"], v) for r, v in zip(rows, values, strict=True) if v is not None]
        return [t for t, _ in pairs], [v for _, v in pairs]

    fig, (lat, sol) = plt.subplots(1, 2, figsize=(12, 4.5))
    # One colour per party in both panels; the floor is the black dashed line.
    parties = [("ours", "C0", [r["ours"] for r in rows])]
    parties += [(p["label"], f"C{i + 1}", [r["peers"][p["name"]] for r in rows])
                for i, p in enumerate(result["peers"])]
    lat.loglog(*known([r["floor_ms"] for r in rows]), "k--", label="floor (SOL)")
    for label, colour, entries in parties:
        lat.loglog(*known([e["ms"] for e in entries]), marker="o", ms=3, color=colour, label=label)
        sol.semilogx(*known([e["pct_sol"] for e in entries]), marker="o", ms=3, color=colour, label=label)
    lat.set(xlabel="tokens T", ylabel="ms", title="latency")
    lat.legend()
    # Above 100% only if a ceiling was mismeasured: show it rather than clip it.
    top = max([100.0] + [e["pct_sol"] or 0.0 for _, _, entries in parties for e in entries])
    sol.set(xlabel="tokens T", ylabel="% of SOL", title="% of speed of light", ylim=(0, top * 1.05))
    sol.legend()
    for ax in (lat, sol):
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{result['fingerprint']['gpu']}  {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
