"""Best variant per case -> kernels_generated/<name>.py, a standalone module (torch + triton only)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import textwrap
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

from sqlalchemy.orm import Session

from . import __version__, db, render, target
from .space import PARAM_BY_NAME, Variant, hot_split_violations
from .workloads import Case

OUT_DIR = Path(__file__).resolve().parent.parent / "kernels_generated"


def default_name(fp_key: str, shape_key: str) -> str:
    """A module name from the machine and the shape, e.g. h200_sm90_e256_h4096_i2048_k8_bfloat16."""
    gpu = fp_key.split("-triton")[0]
    text = f"{gpu}_{shape_key}".lower()
    return "".join(c if c.isalnum() else "_" for c in text)


def module_path(fp_key: str, shape_key: str, out_dir: Path = OUT_DIR, name: str | None = None) -> Path:
    """Where the module of a machine and a shape is emitted (default_name unless `name` is given)."""
    return out_dir / f"{name or default_name(fp_key, shape_key)}.py"


def this_machine_module_path(shape_key: str) -> Path:
    """Where `moe-tune emit` writes this machine's module for a shape, by default: what the CLI's
    commands and the tools run when no module is named."""
    return module_path(target.fingerprint().key, shape_key)


# Eager calls of the rows tuned faster than this replay a CUDA graph of the call (graph_replay.py.j2).
# A replay saves the host's time (a planned eager call takes 70-160 µs at T=1 on the lent machines'
# hosts) but adds GPU time (the copies, the graph's launch: ~13-15 µs, 8-10 since NOTES 69), so it
# gains where the GPU's time is short of the host's by more than that. On the H200 machine (NOTES 67) it gained at
# GPU times of 31-98 µs (Qwen T=1-4, seed16 T=1: x0.54-0.93) and lost at 131 µs (Qwen T=8: x1.09); on
# a faster H100 host it lost 9-12% from ~100 µs up.
GRAPH_BELOW_MS = 0.125


def graph_tokens(rows: list[tuple[int, float, float]]) -> tuple[int, str]:
    """How many tokens a call may have and replay a graph, from (tuned T, row's token limit, tuned ms)
    in order: the tokens served by the leading rows tuned under GRAPH_BELOW_MS, the last of them up to
    its tuned T only (beyond it the GPU's time grows towards the next, slower row's); and the reason,
    for the module."""
    fast = []
    for T, limit, ms in rows:
        if ms >= GRAPH_BELOW_MS:
            break
        fast.append((T, limit))
    if not fast:
        return 0, f"no row tuned under {GRAPH_BELOW_MS} ms (emit.GRAPH_BELOW_MS)"
    n = max(fast[-1][0], int(fast[-2][1]) if len(fast) > 1 else 0)
    tuned = ", ".join(str(T) for T, _ in fast)
    return n, f"the rows of T = {tuned}, tuned under {GRAPH_BELOW_MS} ms (emit.GRAPH_BELOW_MS)"


def thresholds(tokens: list[int]) -> list[float]:
    """Each tuned T serves up to the geometric midpoint to the next tuned T; the last serves the rest."""
    return [math.floor(math.sqrt(a * b)) for a, b in zip(tokens, tokens[1:], strict=False)] + [math.inf]


def _current(t: db.Trial) -> bool:
    """Whether a trial measured the code the templates render today for its variant."""
    return t.source_hash == render.variant_hash(Variant.from_dict(t.params))


@dataclass(frozen=True)
class HillStep:
    """One run of a case's king-of-the-hill history (see `leader`)."""

    run_id: int
    leader: db.Trial  # the leader after this run
    challenger: db.Trial | None  # the run's fastest trial of another source (None: the leader alone, or the first run)
    bar_ms: float | None  # what a challenger had to beat (None in the first run)
    leader_timings: int  # how often the run timed the incumbent (0: compared with its latest figure)
    spread_ms: float  # the spread of those timings: the run's noise

    @property
    def took_over(self) -> bool:
        return self.challenger is not None and self.leader is self.challenger


def hill(session: Session, fingerprint: str, case: Case, layout: str | None = None) -> list[HillStep]:
    """The runs of `case` in order, each with the leader it left: king of the hill.

    The first run's fastest trial leads. In each later run that timed the leader (the tuner re-times
    it before and after a run's challengers), a challenger takes the lead only by beating the
    leader's best timing in that run by more than the spread of its timings there: the same code
    timed twice shows how far the card drifted, and a difference smaller than that is noise. So two
    timings are never compared across states of the GPU, whose clock moves runs apart by as much as
    the variants differ. A run that did not time the leader is set against the leader's latest
    figure, the best it has. Trials of code the templates no longer render are skipped: never
    shipped on the strength of another kernel's time. With `layout`, only variants that read the
    weights in that layout (space's weight_layout) take part.
    """
    runs: dict[int, dict[str, list[db.Trial]]] = {}
    for t in db.verified_trials(session, fingerprint, case.key):
        if _current(t) and (layout is None or Variant.from_dict(t.params).weight_layout == layout):
            runs.setdefault(t.run_id, {}).setdefault(t.source_hash, []).append(t)
    steps: list[HillStep] = []
    for run_id in sorted(runs):
        best = {h: min(ts, key=lambda t: t.median_ms) for h, ts in runs[run_id].items()}
        if not steps:
            steps.append(HillStep(run_id, min(best.values(), key=lambda t: t.median_ms), None, None, 0, 0.0))
            continue
        lead = steps[-1].leader
        challenger = min((t for h, t in best.items() if h != lead.source_hash), key=lambda t: t.median_ms,
                         default=None)
        own = [t.median_ms for t in runs[run_id].get(lead.source_hash, [])]
        spread = max(own) - min(own) if own else 0.0
        if own:
            lead = best[lead.source_hash]
        bar = lead.median_ms - spread
        if challenger is not None and challenger.median_ms < bar:
            lead = challenger
        steps.append(HillStep(run_id, lead, challenger, bar, len(own), spread))
    return steps


def leader(session: Session, fingerprint: str, case: Case, layout: str | None = None) -> db.Trial | None:
    """The variant `emit` ships for `case`: the last leader of its `hill` (of one weight layout's
    variants, with `layout`)."""
    steps = hill(session, fingerprint, case, layout)
    return steps[-1].leader if steps else None


WEIGHT_LAYOUTS = ("auto", *PARAM_BY_NAME["weight_layout"].choices)


def _mean_sol(trials: list[db.Trial]) -> float:
    return sum(t.floor_ms / t.median_ms for t in trials) / len(trials)


class LayoutChoice(NamedTuple):
    """The weight layout a module reads, each case's leader in it (by case key), and, when "auto"
    weighed layouts against each other, a sentence for the module's header saying how and what the
    choice costs (empty otherwise)."""
    name: str
    best: dict[str, db.Trial]
    why: str = ""


def choose_layout(session: Session, fingerprint: str, cases: list[Case], layout: str = "auto",
                  log=lambda m: None) -> LayoutChoice:
    """The weight layout a module of `cases` reads (`LayoutChoice`). A module takes one layout
    (render_module), so its rows all come from one. "auto" takes, of the layouts with a leader for
    every case that has one at all, the one whose leaders' mean %SOL at tuning time is highest (the
    bench's measure; each case's leaders were timed in its runs), and names the cases where another
    layout's leader was faster: the price of one layout a module. A named layout takes that one's
    leaders, and a case without one is left to the nearest row."""
    by_layout = {name: {c.key: t for c in cases if (t := leader(session, fingerprint, c, name)) is not None}
                 for name in WEIGHT_LAYOUTS[1:]}
    if layout != "auto":
        return LayoutChoice(layout, by_layout[layout])
    tuned = {key for best in by_layout.values() for key in best}
    full = {name: best for name, best in by_layout.items() if best.keys() == tuned and tuned}
    if len(full) < 2 or any(not t.floor_ms for best in full.values() for t in best.values()):
        name = "rows" if "rows" in full or not full else next(iter(full))
        return LayoutChoice(name, by_layout[name])
    sol = {name: _mean_sol(list(best.values())) for name, best in full.items()}
    name = max(sol, key=sol.get)
    why = (f"Chosen by mean %SOL at tuning time over {len(tuned)} cases: "
           + ", ".join(f"{n} {100 * v:.1f}%" for n, v in sol.items()) + ".")
    for other in (n for n in full if n != name):
        faster = [(c.T, full[other][c.key].median_ms / full[name][c.key].median_ms)
                  for c in sorted(cases, key=lambda c: c.T)
                  if c.key in tuned and full[other][c.key].median_ms < full[name][c.key].median_ms]
        if faster:
            why += (f" The {other} layout's leader was faster at T = "
                    + ", ".join(f"{T} (x{ratio:.3f} of the time)" for T, ratio in faster) + ".")
    log(f"weight layout {name}: {why}")
    return LayoutChoice(name, full[name], why)


def contenders(session: Session, fingerprint: str, case: Case, n: int) -> list[db.Trial]:
    """The leader, then the fastest other verified trials of today's templates (each source by its
    latest timing): n in all, the variants worth re-timing beside a challenger."""
    lead = leader(session, fingerprint, case)
    if lead is None or n < 1:
        return []
    rest = (t for t in db.ranked_trials(session, fingerprint, case.key)
            if t.source_hash != lead.source_hash and _current(t))
    return [lead, *itertools.islice(rest, n - 1)]


def stale_leaders(session: Session, fingerprint: str, case: Case, n: int) -> list[dict]:
    """Params of the n fastest trials whose code as rendered today was never timed: worth re-timing."""
    out = []
    for t in db.ranked_trials(session, fingerprint, case.key)[:n]:
        v = Variant.from_dict(t.params)
        digest = render.variant_hash(v)
        if t.source_hash != digest and db.cached_result(session, fingerprint, case.key, digest) is None:
            out.append(v.as_dict())
    return out


def hot_partner(session: Session, fingerprint: str, case: Case, cold: Variant, routing: str) -> db.Trial | None:
    """The variant a routing-adaptive row runs its hot experts by: the leader of `case` tuned under
    `routing` (a hot-expert load), where it can share a call with `cold` (space.hot_split_violations:
    larger blocks, one y in slot order; the same weight layout); otherwise None, and the row stays one
    variant."""
    lead = leader(session, fingerprint, dataclasses.replace(case, routing=routing), cold.weight_layout)
    if lead is None or hot_split_violations(cold, Variant.from_dict(lead.params)):
        return None
    return lead


def _op_name(stem: str, source: str) -> str:
    """The module's torch operator, moe_tune::<this>: its file name made an identifier, and a digest of
    its code. A process defines an operator once (library_op.py.j2), so two modules of one name (an
    older emission beside a newer, or one --name used for two shapes) must not share it: compiled
    code would run the first one imported."""
    name = re.sub(r"\W", "_", stem)
    name = name if name.isidentifier() else f"m_{name}"
    return f"{name}_{render.source_hash(source)[:8]}"


def _tuned_gpu(gpu: str, capability: str, case: Case) -> render.TunedGpu | None:
    """What the module checks its GPU against; None for a module tuned under the interpreter."""
    if capability == "none":
        return None
    s = case.shape
    return render.TunedGpu(gpu, tuple(int(x) for x in capability.split(".")),
                           f"--shape {s.E},{s.H},{s.I},{s.k} --dtype {s.dtype}")


def _table_line(lead: str, text: str, width: int = 120) -> list[str]:
    """A header table row: `lead` (the figures) then `text`, wrapped under the text's column where the
    row would pass the module's line length (a long variant label)."""
    return textwrap.wrap(text, width, initial_indent=lead, subsequent_indent=" " * len(lead),
                         break_on_hyphens=False)


def _header(run, runs: list[int], tuned: list[Case], rows: list, best: dict, hot: dict, hot_routing: str | None,
            missing: list[int], weight_layout: str, layout_why: str) -> list[str]:
    """The emitted module's header lines: where and when its variants were tuned, each row's variant
    and its time and %SOL at tuning time (and its hot partner's), how they were timed, and the weight
    layout it reads and why."""
    shape = tuned[0].shape
    header = [
        f"Tuned by moe-tune {__version__} on {run.gpu} (compute capability {run.capability}), "
        f"driver {run.driver}, CUDA {run.cuda},",
        f"torch {run.torch}, triton {run.triton}; emitted {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC "
        f"from database run(s) {', '.join(map(str, runs))}.",
        f"Shape: E={shape.E} H={shape.H} I={shape.I} k={shape.k} {shape.dtype}, {tuned[0].routing} routing.",
        "Measured per case at tuning time (median of the timed repeats, by the method named below; %SOL",
        "against the floor from the ceilings measured in the same run):",
        "",
        f"    {'T':>6} {'ms':>9} {'%SOL':>6}  variant",
    ]
    for c, row in zip(tuned, rows, strict=True):
        t = best[c.key]
        sol = f"{100 * t.floor_ms / t.median_ms:.1f}%" if t.floor_ms else "n/a"
        header += _table_line(f"    {c.T:>6} {t.median_ms:9.4f} {sol:>6}  ", t.label)
        if c.key in hot:
            h = hot[c.key]
            header += _table_line(f"    {'':>6} {h.median_ms:9.4f} {'':>6}  ",
                                  f"{hot_routing}, experts >= {row.hot_rows} rows: {h.label}")
    methods: dict[str, list[int]] = {}
    for c in tuned:
        methods.setdefault(best[c.key].timing_method or "unrecorded", []).append(c.T)
    header += textwrap.wrap("Timing method: " + "; ".join(f"{m} (T = {', '.join(map(str, ts))})"
                                                        for m, ts in methods.items()) + ".", 100)
    if missing:
        header.append(f"Not tuned (served by the nearest row): T = {', '.join(map(str, missing))}.")
    if weight_layout != "rows":
        header.append(f"Weight layout: {weight_layout}; pass the weights through prepare_weights once (see below).")
    header += textwrap.wrap(layout_why, 100)
    return header


def emit(session: Session, fingerprint: str, cases: list[Case], name: str | None = None,
         out_dir: Path = OUT_DIR, hot_routing: str | None = None, log=lambda m: None,
         weight_layout: str = "auto") -> Path:
    """Render the module of the best verified variant of each case measured on `fingerprint`, all of
    one weight layout (`choose_layout`). With `hot_routing`, a row whose case was also tuned under
    that routing runs its hot experts (those routed at least half the hot variant's block of rows) by
    that routing's leader (`hot_partner`). Cases without one are served by the nearest tuned row,
    and `log` is told."""
    if name is not None and not name.isidentifier():
        raise ValueError(f"--name must be a Python identifier (the module's import name, without .py), got {name!r}")
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {', '.join(WEIGHT_LAYOUTS)}, got {weight_layout!r}")
    weight_layout, best, layout_why = choose_layout(session, fingerprint, cases, weight_layout, log)
    tuned = sorted((c for c in cases if c.key in best), key=lambda c: c.T)
    if not tuned:
        held = ", ".join(db.fingerprints(session)) or "none"
        raise LookupError(f"no verified trial on {fingerprint} for any of the {len(cases)} cases; run `moe-tune "
                          f"tune` first, or pass --fingerprint (this database holds runs of: {held})")
    missing = [c.T for c in cases if c.key not in best]
    if missing:
        log(f"not tuned on {fingerprint} (the nearest tuned row serves them): T = {', '.join(map(str, missing))}")
    rows, hot = [], {}
    for c, limit in zip(tuned, thresholds([c.T for c in tuned]), strict=True):
        v = Variant.from_dict(best[c.key].params)
        partner = hot_partner(session, fingerprint, c, v, hot_routing) if hot_routing else None
        if partner is None:
            rows.append(render.Row(limit, v))
            continue
        hot[c.key] = partner
        hot_v = Variant.from_dict(partner.params)
        rows.append(render.Row(limit, v, hot_v, hot_v.block_m // 2))
    if hot_routing:
        adaptive = ", ".join(str(c.T) for c in tuned if c.key in hot) or "none"
        log(f"--hot-routing {hot_routing}: routing-adaptive rows T = {adaptive} (a row is one where its case was "
            f"tuned under {hot_routing} routing too and that leader can share a call with the row's)")
        elsewhere = [c.T for c in tuned if c.key not in hot and any(
            leader(session, fingerprint, dataclasses.replace(c, routing=hot_routing), other) is not None
            for other in WEIGHT_LAYOUTS[1:] if other != weight_layout)]
        if elsewhere:
            log(f"--hot-routing {hot_routing}: T = {', '.join(map(str, elsewhere))} have a {hot_routing} leader only "
                f"in another weight layout than this module's {weight_layout}, so their rows are not routing-adaptive; "
                f"`moe-tune tune --routing {hot_routing} --probe weight_layout={weight_layout}` gives them one")
    shape = tuned[0].shape
    runs = sorted({t.run_id for t in [*best.values(), *hot.values()]})
    run = db.run_of(session, runs[-1])
    header = _header(run, runs, tuned, rows, best, hot, hot_routing, missing, weight_layout, layout_why)
    path = module_path(fingerprint, shape.key, out_dir, name)
    gpu = _tuned_gpu(run.gpu, run.capability, tuned[0])
    graphed, why = graph_tokens([(c.T, r.max_tokens, best[c.key].median_ms) for c, r in zip(tuned, rows, strict=True)])
    def render_with(header, op_name):
        return render.render_module(rows, f"MoE routed experts for {run.gpu}: generated by moe-tune.", header,
                                    gpu, op_name, fast_launch=gpu is not None, graph_max_tokens=graphed,
                                    graph_reason=why)

    # The digest is of the code alone, not the header (which holds the emission's time).
    source = render_with(header, _op_name(path.stem, render_with([], "op")))
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return path
