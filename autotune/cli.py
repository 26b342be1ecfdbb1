"""`moe-tune`: tune MoE routed-expert kernels for this GPU, emit the best as a module, bench it, and
inspect the tuning database (tune, emit, bench, show, check, space, sm90)."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from pathlib import Path

import torch


def _cases(args, kernels_run: bool = True):
    """The cases the options name; bf16 is refused without a GPU where kernels will run on them."""
    from . import workloads

    if args.shape:
        shape, tokens = workloads.parse_shape(args.shape, args.dtype), workloads.SEED16_TOKENS
    elif _gpu():
        shape, tokens = workloads.SEED16_SHAPE, workloads.SEED16_TOKENS
    else:
        shape, tokens = workloads.DEMO_SHAPE, workloads.DEMO_TOKENS
    if args.tokens:
        tokens = workloads.parse_tokens(args.tokens)
    if not _gpu() and shape.dtype == "bfloat16" and kernels_run:
        raise ValueError("bf16 cannot run here: triton's interpreter returns garbage for bf16 tl.dot; "
                         "pass --dtype float16 (or float32) on a machine without a GPU")
    return workloads.suite(shape, tokens, args.routing)


def _gpu() -> bool:
    from . import target

    return target.has_gpu()


def _url(args) -> str:
    """--db as an SQLAlchemy URL; a plain file path means an SQLite database there."""
    from . import db

    if args.db is not None and not args.db.strip():
        raise ValueError("--db is empty: give an SQLAlchemy URL or an SQLite file path")
    if args.db and "://" not in args.db:
        return f"sqlite:///{Path(args.db).resolve()}"
    if args.db in ("sqlite://", "sqlite:///:memory:"):
        raise ValueError(f"--db {args.db} is an in-memory database: every result would be lost when the "
                         "command ends; give a file path or a server URL")
    return args.db or db.default_url(_gpu())


def _announce_cpu(what: str, timed: bool = True) -> None:
    if not _gpu():
        print(f"No CUDA GPU here: {what} runs through the Triton interpreter on the CPU (a small fp16 demo "
              "unless --shape says otherwise)"
              + ("; timings are interpreter wall-clock, not GPU figures." if timed else "."),
              file=sys.stderr, flush=True)


def cmd_tune(args) -> int:
    from . import space
    from .tuner import TuneConfig, tune

    cases = _cases(args)
    why = space.unfit(cases[0].shape)
    if why:
        raise ValueError(why)
    try:
        probes = tuple(space.parse_assignments(p) for p in args.probe)
    except ValueError as e:
        raise ValueError(f"--probe {e}") from None
    _announce_cpu("tuning")
    cfg = TuneConfig(storage_url=_url(args), trials=args.trials, time_budget_s=args.time_budget,
                     more=args.more, seed=args.seed, isolate=not args.in_process, reps=args.reps,
                     timeout_s=args.timeout, command=" ".join(sys.argv), probes=probes,
                     retime=args.retime, settle_ms=args.settle_ms, neighbours=args.neighbours)
    best = tune(cases, cfg)
    failed = [key for key, ms in best.items() if math.isnan(ms)]  # no verified variant: NaN
    for key, ms in best.items():
        print(f"{key}: " + (f"no variant passed (see `moe-tune show --history 20 --case-key {key}`)"
                            if key in failed else f"leader {ms:.4f} ms"))
    return 1 if failed else 0


def cmd_emit(args) -> int:
    from sqlalchemy.orm import Session

    from . import db, emit, target

    cases = _cases(args, kernels_run=False)
    with Session(db.connect(_url(args), create=False)) as session:
        path = emit.emit(session, args.fingerprint or target.fingerprint().key, cases, args.name,
                         Path(args.out_dir) if args.out_dir else emit.OUT_DIR, args.hot_routing,
                         log=lambda m: print(m, file=sys.stderr), weight_layout=args.weight_layout)
    print(path)
    return 0


def _load_module(path: Path):
    """An emitted module by path; ValueError naming the path where it is not one."""
    from . import render

    if not path.is_file():
        raise ValueError(f"--module {path}: no such file (emit one with `moe-tune emit`)")
    try:
        module = render.load_path(path)
    except Exception as exc:  # any error of the file's own code
        raise ValueError(f"--module {path}: cannot import it: {type(exc).__name__}: {exc}") from exc
    if not callable(getattr(module, "fused_experts", None)):
        raise ValueError(f"--module {path}: defines no fused_experts; is it a module `moe-tune emit` wrote?")
    return module


def _writable(path: Path, option: str) -> None:
    """ValueError naming `option` unless a file can be written at `path` (its folder is made)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option} {path}: {exc}") from exc


def _module_path(args, cases) -> Path:
    from . import emit

    return Path(args.module) if args.module else emit.this_machine_module_path(cases[0].shape.key)


def cmd_check(args) -> int:
    from . import render, target
    from .reference import BAR, error_stats, moe_reference
    from .workloads import make_tokens, make_weights

    cases = _cases(args)
    _announce_cpu("the check", timed=False)
    path = _module_path(args, cases)
    module = _load_module(path)
    dev = target.device()
    w13, w2 = make_weights(cases[0].shape, dev, seed=11)
    weights = render.weights_for(module, w13, w2)  # a k64 module's own copy
    failed = 0
    for case in cases:
        x, w, ids = make_tokens(case, dev, seed_offset=101)
        try:
            got = module.fused_experts(x, *weights, w, ids)
        except (TypeError, ValueError, RuntimeError) as exc:  # refused or failed: this case fails, not the check
            failed += 1
            print(f"T={case.T:<6} FAIL: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        stats = error_stats(got, moe_reference(x, w13, w2, w, ids))
        bad = stats.failures(BAR)
        failed += bool(bad)
        print(f"T={case.T:<6} rel L2 {stats.global_rel_l2:.2e}  worst token {stats.worst_token_rel_l2:.2e}  "
              f"{'FAIL: ' + '; '.join(bad) if bad else 'ok'}")
    print(f"{path}: {len(cases) - failed} of {len(cases)} cases pass the bar")
    return 1 if failed else 0


def cmd_bench(args) -> int:
    from . import bench

    cases = _cases(args)
    _announce_cpu("the benchmark")
    path = _module_path(args, cases)
    module = _load_module(path)
    json_path = Path(args.json) if args.json else path.with_suffix(".bench.json")
    _writable(json_path, "--json")  # before the run, not after it
    result = bench.run_bench(module.fused_experts, cases, peers=not args.no_peers,
                             variant_for=getattr(module, "select_variant", None),
                             prepare_weights=getattr(module, "prepare_weights", None))
    result["module"] = str(path)
    print(bench.format_table(result))
    if not _gpu():
        print("(Interpreter wall-clock on the CPU, ceilings included: the pipeline runs end to end, but the "
              "%SOL, rates and speed-ups say nothing about any GPU.)")
    sustained = bench.format_sustained(result)
    if sustained:
        print(sustained)
    kernels = bench.format_kernels(result)
    if kernels:
        print("\nWhere our time goes (device time per call, profiled outside a CUDA graph):\n" + kernels)
    rates = bench.format_gemm_rates(result)
    if rates:
        print("\nEach GEMM on the rows it computes, padding included (in brackets: on the T*k rows the op needs;"
              "\nthe profile's times, so a kernel launched early under PDL counts its wait):\n" + rates)
    bench.write_json(result, json_path)
    print(f"wrote {json_path}")
    if args.png:
        try:
            bench.write_png(result, Path(args.png))
            print(f"wrote {args.png}")
        except RuntimeError as exc:
            print(f"no plot: {exc}", file=sys.stderr)
    return 0


def cmd_show(args) -> int:
    from sqlalchemy.orm import Session

    from . import db, emit
    from .workloads import Case

    url = _url(args)
    hint = "" if url == db.GPU_URL else f" (the committed GPU runs are in --db {db.GPU_PATH})"
    if args.db is None and not Path(url.removeprefix("sqlite:///")).exists():
        print(f"{url} holds no runs yet{hint}")  # this machine's default: nothing tuned here so far
        return 0
    with Session(db.connect(url, create=False)) as session:
        fps = db.fingerprints(session)
        if not fps:
            print(f"{url} holds no runs yet{hint}")
            return 0
        for fp in fps:
            print(f"== {fp}: per case, the leader (what `emit` ships: of the code the templates render today, "
                  "and a challenger leads only by beating the leader in the same run)")
            fastest = sorted(db.best_trials(session, fp).values(), key=lambda t: (t.case["shape"]["E"], t.case["T"]))
            print(f"{'case':<52} {'ms':>9} {'%SOL':>6} {'err':>8}  variant")
            for raw in fastest:
                t = emit.leader(session, fp, Case.from_dict(raw.case))
                if t is None:
                    print(f"{raw.case_key:<52} {'-':>9}  no trial of today's templates (re-tune to emit)")
                    continue
                sol = f"{100 * t.floor_ms / t.median_ms:5.1f}%" if t.floor_ms else "   n/a"
                print(f"{t.case_key:<52} {t.median_ms:9.4f} {sol} {t.global_rel_l2:8.1e}  {t.label}")
            if args.hill:
                for raw in fastest:
                    if args.case_key in (None, raw.case_key):
                        _print_hill(emit.hill(session, fp, Case.from_dict(raw.case)), raw.case_key)
            if args.case_key and args.case_key not in {t.case_key for t in fastest}:
                print(f"(no verified trial of case {args.case_key!r} on {fp}: the keys are those listed above)")
        if args.history:
            print(f"== last {args.history} trials" + (f" of {args.case_key}" if args.case_key else ""))
            for t in db.history(session, args.case_key, args.history):
                ms = f"{t.median_ms:.4f} ms" if t.median_ms is not None else t.status
                print(f"#{t.id} run {t.run_id} {t.case_key} {ms} {t.label}"
                      + (f" | {t.error.splitlines()[-1][:100]}" if t.error else ""))
    return 0


def _print_hill(steps, case_key: str) -> None:
    """Each run's contest for one case: the leader as the run timed it, the best challenger, the outcome."""
    print(f"== {case_key}: the leader run by run (a challenger must beat the leader's best timing in the "
          "run by more than the spread of its timings there)")
    for step in steps:
        if step.bar_ms is None:
            print(f"run {step.run_id:>3}: {step.leader.median_ms:.4f} ms leads (the first run) | {step.leader.label}")
            continue
        timed = (f"timed {step.leader_timings}x, spread {step.spread_ms:.4f}" if step.leader_timings
                 else "not timed: its latest figure")
        if step.challenger is not None and "settled" in (step.challenger.timing_method or ""):
            timed += ", settled"
        if step.challenger is None:
            print(f"run {step.run_id:>3}: leader {step.leader.median_ms:.4f} ms ({timed}), no challenger")
            continue
        outcome = "takes the lead" if step.took_over else "holds"
        print(f"run {step.run_id:>3}: bar {step.bar_ms:.4f} ms ({timed}); challenger {step.challenger.median_ms:.4f} "
              f"ms: {outcome} | {step.challenger.label}")


def cmd_space(args) -> int:
    from . import space, workloads

    case = _cases(args, kernels_run=False)[0] if args.shape else None
    if case is not None:
        print(f"(choices for {case.key}: some are capped by T, so other token counts may allow more)")
    print(f"{'parameter':<16} {'choices':<28} what it is for")
    for p in space.PARAMS:
        values = space.choices(p, case) if case else p.choices
        print(f"{p.name:<16} {', '.join(map(str, values)):<28} {p.doc}")
    if case is None:
        s = workloads.SEED16_SHAPE
        print(f"\n(choices capped per case by its dimensions: pass --shape and --tokens, e.g. --shape "
              f"{s.E},{s.H},{s.I},{s.k} --tokens 8192)")
    return 0


def cmd_sm90(args) -> int:
    from sqlalchemy.orm import Session

    from . import db, emit, sm90, target
    from .space import Variant

    fingerprint = args.fingerprint or target.fingerprint().key
    cases = _cases(args, kernels_run=False)
    with Session(db.connect(_url(args), create=False)) as session:
        print(f"{'case':<12} {'kernel':<38} {'smem KB':>8} {'regs':>5} {'local B':>8} {'wgmma':>6} {'tma':>4} "
              f"{'cp.async':>8}  wgmma shape")
        for case in cases:
            best = emit.leader(session, fingerprint, case)
            if best is None:
                print(f"T={case.T:<10} no verified trial of today's templates on {fingerprint} (tune this case, "
                      "or pass --fingerprint)")
                continue
            for r in sm90.gemm_reports(Variant.from_dict(best.params), case):
                print(f"T={case.T:<10} {r.name:<38} {r.shared_bytes / 1024:8.1f} {r.registers or '?':>5} "
                      f"{r.spill_bytes if r.spill_bytes is not None else '?':>8} {r.wgmma:>6} {r.tma_copies:>4} "
                      f"{r.async_copies:>8}  {' '.join(r.wgmma_shapes) or '-'}")
    return 0


def _case_args(p: argparse.ArgumentParser) -> None:
    from .workloads import DTYPES, ROUTINGS

    p.add_argument("--shape", help="E,H,I,k of a model (default: seed16 on a GPU, a tiny demo on the CPU)")
    p.add_argument("--tokens", help="token counts, e.g. 1,16,512 (default: the suite's)")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES),
                   help="dtype of the activations and weights with --shape (default bfloat16, which the "
                   "interpreter on a CPU cannot run: pass float16 there)")
    p.add_argument("--routing", default="uniform", choices=ROUTINGS)
    p.add_argument("--db", help="SQLAlchemy URL or SQLite file path (default: this machine's under db/)")


def _at_least(low: float, kind, strict: bool = False):
    """An argparse type: a number of `kind` of at least `low`, or above it if `strict` (0 repeats or a
    0 s timeout would record every trial as failed; a negative count or budget means nothing)."""
    def parse(text: str):
        value = kind(text)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'above' if strict else 'at least'} {low}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def _positive(kind):
    """An argparse type: a number of `kind` above zero."""
    return _at_least(0, kind, strict=True)


def parser() -> argparse.ArgumentParser:
    from .runner import TRIAL_TIMEOUT_S
    from .space import PARAM_BY_NAME
    from .timing import SETTLE_MS
    from .workloads import ROUTINGS

    ap = argparse.ArgumentParser(prog="moe-tune", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tune", help="search the variant space per case; every trial goes to the database")
    _case_args(p)
    p.add_argument("--trials", type=_positive(int), default=None,
                   help="finished trials per case, resumed studies included "
                   "(default 40 on a GPU, 4 on the CPU)")
    p.add_argument("--more", type=_at_least(0, int), default=None,
                   help="run this many sampled trials per case beyond those "
                   "done and the queued re-timings and probes (instead of --trials' total; what each of several "
                   "workers on one database should give)")
    p.add_argument("--time-budget", type=_positive(float), default=None, help="seconds for the whole run")
    p.add_argument("--seed", type=int, default=None, help="the sampler's seed, to repeat a run (default: one "
                   "per worker, from its host and process, so that workers on one database sample apart)")
    p.add_argument("--reps", type=_positive(int), default=None, help="timed repeats per trial (default 20 GPU, 2 CPU)")
    p.add_argument("--settle-ms", type=_at_least(0, float), default=SETTLE_MS,
                   help="device time each trial runs untimed before "
                   "its timing, so that every contender is timed in the state sustained load leaves the GPU in "
                   f"(default {SETTLE_MS:.0f}; 0: none)")
    p.add_argument("--timeout", type=_positive(float), default=TRIAL_TIMEOUT_S,
                   help="seconds before a trial counts as hung")
    p.add_argument("--in-process", action="store_true", help="no worker process (a GPU fault ends the run)")
    p.add_argument("--probe", action="append", default=[], metavar="PARAM=VALUE[,...]",
                   help="also try each case's best variant with these parameters set, first (repeatable)")
    p.add_argument("--neighbours", action="store_true",
                   help="also try each case's best variant moved one step in each parameter (the next choice either "
                   "side, or the other flag), where unmeasured: a local search the sampler seldom does")
    p.add_argument("--retime", type=_at_least(0, int), default=0, metavar="N",
                   help="first re-time each case's N best contenders (the leader first) in this run, so that "
                   "challengers meet them on one state of the GPU (default: 2 whenever the run measures anything), "
                   "and its N fastest variants whose code changed since they were timed (default 3)")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("emit", help="write the best variant per case as kernels_generated/<name>.py")
    _case_args(p)
    p.add_argument("--name", help="module name (default: <gpu>_sm<cc>_<shape>, e.g. "
                   "h200_sm90_e256_h4096_i2048_k8_bfloat16)")
    p.add_argument("--out-dir", help="where the module goes (default: kernels_generated/)")
    p.add_argument("--fingerprint", help="machine fingerprint to emit for (default: this machine's)")
    p.add_argument("--hot-routing", choices=ROUTINGS,
                   help="routing-adaptive rows: where a case was also tuned under this routing (e.g. zipf), "
                   "its leader runs the experts routed many rows")
    p.add_argument("--weight-layout", choices=("auto", *PARAM_BY_NAME["weight_layout"].choices), default="auto",
                   help="the weight layout the module reads, every row of one (space: weight_layout); auto: the "
                   "layout whose leaders have the highest mean %%SOL at tuning time, of those tuned on every case "
                   "(default)")
    p.set_defaults(func=cmd_emit)

    p = sub.add_parser("bench", help="ceilings, floor, the emitted module and two peers; table, JSON, PNG")
    _case_args(p)
    p.add_argument("--module", help="emitted module path (default: this machine's for the shape)")
    p.add_argument("--json", help="where the JSON goes (default: next to the module, .bench.json)")
    p.add_argument("--png", help="write a plot here")
    p.add_argument("--no-peers", action="store_true", help="time the module alone, without the per-expert "
                   "loop and the torch._grouped_mm pipeline")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("show", help="best variant per case and trial history from the database")
    p.add_argument("--db", help="SQLAlchemy URL or SQLite file path (default: this machine's under db/; the "
                   "committed GPU results: db/moe_tune.sqlite3)")
    p.add_argument("--history", type=_at_least(0, int), default=0, help="also list the last N trials")
    p.add_argument("--case-key", help="limit the history (and --hill) to one case key")
    p.add_argument("--hill", action="store_true",
                   help="also each case's leader run by run: the bar, the best challenger, the outcome")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("sm90", help="compile each case's shipped GEMMs for sm_90 here (no GPU needed): shared "
                       "memory, registers, local memory, wgmma/TMA/cp.async use")
    _case_args(p)
    p.add_argument("--fingerprint", help="whose trials (default: this machine's)")
    p.set_defaults(func=cmd_sm90)

    p = sub.add_parser("space", help="the declared variant space: every parameter, its values and purpose")
    _case_args(p)
    p.set_defaults(func=cmd_space)

    p = sub.add_parser("check", help="check an emitted module against the fp32 reference on fresh inputs")
    _case_args(p)
    p.add_argument("--module", help="emitted module path (default: this machine's for the shape)")
    p.set_defaults(func=cmd_check)
    return ap


def _stop(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    if not torch.cuda.is_available():
        # Kernels can only run through the interpreter here; set before any kernel is defined.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from . import target

    target.quiet_interpreter()
    args = parser().parse_args(argv)
    if getattr(args, "trials", 0) is None:
        args.trials = 40 if _gpu() else 4
    if getattr(args, "reps", 0) is None:
        args.reps = 20 if _gpu() else 2
    # A TERM (a job scheduler's stop) unwinds like Ctrl-C, so the tuner's worker process is killed
    # rather than left running its trial. (Signals are the main thread's to handle.)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop) if in_main else None
    try:
        return args.func(args)
    except (ValueError, LookupError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted" + (": every finished trial is in the database; the same command resumes"
                                 if args.command == "tune" else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:  # the output went into `head` or the like, which stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
