"""Optuna studies: one per case and machine fingerprint, every trial persisted, resumable.

A study's name carries the fingerprint (GPU, compute capability, Triton version), so a result from
another machine or Triton release is never reused silently: it lives in another study.
"""

from __future__ import annotations

import collections
import math
import os
import socket
import sys
import time
import zlib
from dataclasses import dataclass
from datetime import datetime

import optuna
from optuna.trial import TrialState
from sqlalchemy.orm import Session

from . import db, emit, render, search, space, target, timing
from .runner import TRIAL_TIMEOUT_S, Runner
from .workloads import Case

# Rejected points (cannot compile or exceed shared memory) are cheap; cap them so a narrow space
# cannot spin the sampler forever.
MAX_REJECTS_PER_TRIAL = 20
# Fastest variants whose code changed since they were timed, re-timed first in a resumed study (or
# --retime's count, if larger).
STALE_RETIME = 3
# Contenders re-timed in any run that measures anything else for their case (see _tune_case).
AUTO_RETIME = 2


@dataclass
class TuneConfig:
    storage_url: str
    trials: int = 30  # total per case: a resumed study only runs what is missing
    more: int | None = None  # if set, run this many trials per case beyond those already done
    time_budget_s: float | None = None  # for the whole run, shared out over the remaining cases
    # The sampler's seed; None: one of this worker's own (_worker_seed), so that workers started together
    # on one study do not sample the same points.
    seed: int | None = 0
    isolate: bool = True
    reps: int = 20
    # Untimed load before each trial's timing (timing.time_fn): contenders timed in one card state.
    settle_ms: float = timing.SETTLE_MS
    timeout_s: float = TRIAL_TIMEOUT_S
    command: str = ""
    # Each case's leader is also tried with each of these assignments (e.g. {"g1_weight_tma": True}).
    probes: tuple[dict, ...] = ()
    # Also try each case's leader moved one step in each parameter (search.neighbours).
    neighbours: bool = False
    # Re-time each case's n best contenders (emit.contenders: the leader first) in this run, so that
    # challengers meet them on one state of the GPU (its clock moves with load and temperature); and
    # as many of its fastest variants whose code changed since they were timed.
    retime: int = 0


def study_name(case: Case, fp: target.Fingerprint) -> str:
    return f"{case.key}@{fp.key}"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# How long past the trial timeout a trial of another machine may stay RUNNING before a worker
# counts it abandoned: its compile and verification, and the two machines' clocks.
STALE_MARGIN_S = 600.0
# How long a trial may stay RUNNING without naming its worker: the moment between a worker's ask and
# its naming itself, with room for a slow database.
UNNAMED_GRACE_S = 60.0


def _owner() -> dict:
    """The worker a trial belongs to, recorded when it is asked: host and process."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _abandoned(t: optuna.trial.FrozenTrial, timeout_s: float) -> bool:
    """Whether a RUNNING trial's worker is gone: a process of this host that has exited, a trial that
    names no worker (from before trials named theirs; a live worker names itself right after asking),
    or one running longer than a live worker lets a trial run. Another worker's live trial (many
    tuners on one study) is none of these."""
    started = t.datetime_start  # naive local time, as Optuna records it
    age_s = math.inf if started is None else (datetime.now() - started).total_seconds()
    owner = t.user_attrs.get("owner")
    if owner is None:
        return age_s > UNNAMED_GRACE_S
    if owner["host"] == socket.gethostname() and not _alive(owner["pid"]):
        return True
    return age_s > timeout_s + STALE_MARGIN_S


def _close_interrupted(study: optuna.Study, t: optuna.trial.FrozenTrial) -> None:
    """Close `t` as failed and marked interrupted: it does not count towards the target."""
    study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
    study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)


def _fail_stale(study: optuna.Study, timeout_s: float) -> None:
    """Trials left RUNNING by an interrupted run are closed as failed, marked interrupted (they do
    not count towards the target) and their point is queued again. Trials other workers are running
    now are left to them."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not _abandoned(t, timeout_s):
            continue
        _close_interrupted(study, t)
        if t.params:
            study.enqueue_trial(t.params)


def _worker_seed() -> int:
    """A sampler seed of this worker's own: its host and process."""
    return zlib.crc32(f"{socket.gethostname()}:{os.getpid()}".encode())


def sampler_seed(cfg: TuneConfig) -> int:
    return _worker_seed() if cfg.seed is None else cfg.seed


def _take_waiting(study: optuna.Study) -> list[dict]:
    """The points an earlier run queued and did not reach (its time budget ran out), taken off the
    queue to be queued again behind this run's re-timings: a run's first trials time the leader, so
    that whatever a cut-short run measures meets the leader as timed in that run, never an older figure
    from another state of the card. Each is claimed as optuna claims a queued point (a point another
    worker has just taken stays its own), then closed as interrupted (not counted as finished)."""
    points = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        try:
            if not study._storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
        _close_interrupted(study, t)
        points.append(t.system_attrs["fixed_params"])
    return points


def _tell(study: optuna.Study, trial: optuna.Trial, value=None, state=TrialState.COMPLETE, log=_log) -> None:
    """study.tell, where a trial closed meanwhile by another worker (it took this one for abandoned)
    is logged, not fatal: the measurement is in mt_trials either way."""
    try:
        study.tell(trial, value, state=state)
    except ValueError as e:
        log(f"[{study.study_name}] trial {trial.number} was closed by another worker ({e}); result kept in mt_trials")


def _finished(study: optuna.Study) -> int:
    """Trials that ran to an answer (a time or a failure), not those cut off by an interruption."""
    return sum(not t.user_attrs.get("interrupted")
               for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)))


def tune(cases: list[Case], cfg: TuneConfig, log=_log) -> dict[str, float]:
    """Tune every case to `cfg.trials` finished trials (or the time budget); returns per case the ms of
    its leader, the variant `emit` would ship (NaN if none passed)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    fp = target.fingerprint()
    engine = db.connect(cfg.storage_url)
    storage = db.optuna_storage(cfg.storage_url)
    deadline = None if cfg.time_budget_s is None else time.monotonic() + cfg.time_budget_s
    best: dict[str, float] = {}
    with Session(engine) as session, Runner(cfg.isolate, cfg.timeout_s, cfg.reps, cfg.settle_ms) as runner:
        ceilings = runner.ceilings()
        run = db.start_run(session, fp, cfg.command, ceilings)
        log(f"run {run.id} on {fp.gpu} ({fp.key}); storage {cfg.storage_url}")
        if ceilings:
            log(f"ceilings: read {ceilings['read_bytes_per_s'] / 1e12:.2f} TB/s, "
                f"matrix {ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
        for i, case in enumerate(cases):
            case_deadline = None
            if deadline is not None:
                case_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(cases) - i)
            best[case.key] = _tune_case(case, cfg, fp, storage, session, runner, run, ceilings, case_deadline,
                                       log)
        db.finish_run(session, run)
    return best


def _tune_case(case, cfg, fp, storage, session, runner, run, ceilings, deadline, log) -> float:
    name = study_name(case, fp)
    sampler = optuna.samplers.TPESampler(seed=sampler_seed(cfg), n_startup_trials=min(10, max(2, cfg.trials // 3)))
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                direction="minimize", load_if_exists=True)
    _fail_stale(study, cfg.timeout_s)
    if not study.get_trials(deepcopy=False):
        for v in search.starting_points(case):
            study.enqueue_trial(v.as_dict())
    kinds = _challengers(session, fp, case, cfg, log)
    challengers = [c for points in kinds.values() for c in points]
    challengers = [c for i, c in enumerate(challengers) if c not in challengers[:i]]
    # Points an earlier run queued and did not reach (its time budget ran out) are owed work too, and
    # must not take the places of this run's; they are asked after this run's re-timings.
    waiting = _take_waiting(study)
    done = _finished(study)
    # Re-timings go first: --retime's, and at least the leader and its runner-up whenever this run
    # measures anything else for the case. A challenger takes the lead only by beating the leader as
    # timed in its own run (emit.leader), so the leader must run in every run that has challengers.
    # The re-timings run on top of what the run would do without them (even past --trials' total).
    target_trials = trial_target(done, len(waiting) + len(challengers), cfg)
    challenged = target_trials > done
    n_retime = max(cfg.retime, AUTO_RETIME if challenged else 0)
    retimed = emit.contenders(session, fp.key, case, n_retime)
    # Measured again however often they were timed before (contenders' recorded hashes are today's).
    retimes = collections.Counter(t.source_hash for t in retimed)
    queued = [space.Variant.from_dict(t.params).as_dict() for t in retimed] + waiting + challengers
    target_trials += len(retimed)
    # With challengers (new points, or the other re-timed contenders), the leader is timed once more as
    # the run's last trial: the spread of its two timings is the noise a challenger must beat it by
    # (emit.leader).
    closing = retimed[0] if retimed and (challenged or len(retimed) > 1) else None
    target_trials += closing is not None
    for params in queued:
        study.enqueue_trial(params)
    first_done = done
    asked = ", ".join(f"{len(points)} {kind}" for kind, points in kinds.items() if points)
    log(f"[{case.key}] study {name}: {done} trials done, target {target_trials}"
        + (f"; queued: {asked}" if asked else ""))
    rejects = 0
    while done < target_trials and rejects < MAX_REJECTS_PER_TRIAL * target_trials:
        # Past the deadline a case still gets one trial: its leader re-timed on today's templates.
        if deadline is not None and time.monotonic() > deadline and done > first_done:
            log(f"[{case.key}] time budget reached after {done} trials")
            break
        if closing is not None and done == target_trials - 1:
            study.enqueue_trial(space.Variant.from_dict(closing.params).as_dict())
            retimes[closing.source_hash] += 1
            closing = None
        trial = study.ask()
        trial.set_user_attr("owner", _owner())
        v = search.suggest(trial, case)
        why = space.violations(v, case)
        if why:
            rejects += 1
            db.record_trial(session, **_row(run, name, fp, case, trial, v, None, "rejected", "; ".join(why)))
            _tell(study, trial, state=TrialState.PRUNED, log=log)
            continue
        source = render.render_variant(v)
        digest = render.source_hash(source)
        earlier = None if retimes[digest] else db.cached_result(session, fp.key, case.key, digest)
        if retimes[digest]:
            retimes[digest] -= 1
        if earlier is not None:
            # The same code on the same case and machine: reuse its measurement.
            _tell(study, trial, earlier.median_ms if earlier.status == "ok" else None,
                  TrialState.COMPLETE if earlier.status == "ok" else TrialState.FAIL, log)
            done += 1
            continue
        result = runner.evaluate(case, source)
        row = _measured_row(_row(run, name, fp, case, trial, v, digest, result.status, result.error), case,
                            result, ceilings)
        if result.status == "ok":
            _tell(study, trial, row["median_ms"], log=log)
        else:
            _tell(study, trial, state=TrialState.FAIL, log=log)
        db.record_trial(session, **row)
        done += 1
        leader = emit.leader(session, fp.key, case)
        log(_progress(case, done, target_trials, v, row, leader))
    leader = emit.leader(session, fp.key, case)
    return leader.median_ms if leader is not None else math.nan


def _challengers(session, fp, case: Case, cfg: TuneConfig, log) -> dict[str, list[dict]]:
    """This run's points for `case` beyond the sampler's, by kind, in the order they are asked:
    leaders timed before the templates last changed (their new code is unmeasured), then the leader
    with each parameter added since it was measured set to its other values, then other shapes'
    leaders at the nearest load, then --probe's points, then (--neighbours) the leader's unmeasured
    neighbours."""
    leader = emit.leader(session, fp.key, case)
    return {
        "stale leaders": emit.stale_leaders(session, fp.key, case, max(STALE_RETIME, cfg.retime)),
        "new-parameter probes": _new_dimension_probes(session, fp, case, leader),
        "other shapes' leaders": _transfer_probes(session, fp, case),
        "--probe points": _leader_probes(session, fp, case, leader, cfg.probes, log),
        "neighbours": _neighbour_probes(session, fp, case, leader) if cfg.neighbours else [],
    }


def _measured_row(row: dict, case: Case, result, ceilings: dict | None) -> dict:
    """`row` (the trial's, from _row) with what the runner measured: compile time, errors against the
    reference and, for a variant that passed, its timing and the case's floor."""
    row.update(compile_s=result.compile_s, experts_touched=result.experts_touched)
    row.update({k: result.stats.get(k) for k in ("global_rel_l2", "worst_token_rel_l2", "rms_ratio")})
    if result.status == "ok":
        t = result.timing
        row.update(median_ms=t["median_ms"], p10_ms=t["p10_ms"], p90_ms=t["p90_ms"], mean_ms=t["mean_ms"],
                   std_ms=t["std_ms"], reps=t["reps"], timing_method=t["method"], samples_ms=list(t["samples_ms"]),
                   floor_ms=_floor_ms(case, result.experts_touched, ceilings))
    return row


def _floor_ms(case: Case, experts_touched: int, ceilings: dict | None) -> float | None:
    """The case's floor under the run's ceilings (the worker sends them as a dict); None without."""
    if not ceilings:
        return None
    from .ceilings import Ceilings, floor_ms

    return floor_ms(case, experts_touched, Ceilings(**ceilings))


def trial_target(done: int, queued: int, cfg: TuneConfig) -> int:
    """Finished trials a case's study runs to. Re-timings of stale leaders and probes are owed work:
    they run on top of `--more N` sampled trials, and even past `--trials`' total."""
    if cfg.more is not None:
        return done + queued + cfg.more
    return max(cfg.trials, done + queued)


def _unmeasured(session, fp, case, v: space.Variant) -> bool:
    """Whether today's code for `v` has no result on `case` on this machine (a probe worth queueing)."""
    return db.cached_result(session, fp.key, case.key, render.variant_hash(v)) is None


def _new_dimension_probes(session, fp, case, leader) -> list[dict]:
    """The case's leader (what emit ships, None if none) with each parameter it predates set to that
    parameter's other values.

    A new dimension otherwise waits for the sampler to stumble on it; probing it from the best known
    point answers "does it help here" in a trial or two. Probes already measured are skipped.
    """
    if leader is None:
        return []
    probes = []
    for p in space.PARAMS:
        if p.default is None or p.name in leader.params:
            continue
        for value in space.choices(p, case):
            if value == p.default:
                continue
            v = space.Variant.from_dict({**leader.params, p.name: value})
            if not space.violations(v, case) and _unmeasured(session, fp, case, v):
                probes.append(v.as_dict())
    return probes


def _transfer_probes(session, fp, case) -> list[dict]:
    """The leaders of other shapes' studies on this machine, from the cases nearest this one in rows
    per expert (T*k/E, the load that decides a variant's grain), one on either side, where they can
    run this case and are unmeasured on it: a new shape starts from what its neighbours' searches
    found rather than from the hand-picked points alone. Same dtype and routing only."""
    def load(c: Case) -> float:
        return math.log(max(c.T * c.shape.k / c.shape.E, 1e-9))

    others: dict[str, list[Case]] = collections.defaultdict(list)
    for d in db.tuned_cases(session, fp.key):
        other = Case.from_dict(d)
        if (other.shape.key != case.shape.key and other.shape.dtype == case.shape.dtype
                and other.routing == case.routing):
            others[other.shape.key].append(other)
    probes = []
    for cases in others.values():
        below = [c for c in cases if load(c) <= load(case)]
        above = [c for c in cases if load(c) > load(case)]
        for other in ([max(below, key=load)] if below else []) + ([min(above, key=load)] if above else []):
            lead = emit.leader(session, fp.key, other)
            if lead is None:
                continue
            try:
                v = space.Variant.from_dict(lead.params)
            except ValueError:  # a withdrawn value: not a variant today
                continue
            if (v.as_dict() not in probes and space.in_space(v, case) and not space.violations(v, case)
                    and _unmeasured(session, fp, case, v)):
                probes.append(v.as_dict())
    return probes


def _leader_probes(session, fp, case, leader, assignments, log=lambda m: None) -> list[dict]:
    """The case's leader (what emit ships, None if none) with each of `assignments` applied, where
    that point can run the case and today's code for it is unmeasured; a probe that cannot run the
    case is logged with the reason."""
    if leader is None or not assignments:
        return []
    probes = []
    for change in assignments:
        v = space.Variant.from_dict({**leader.params, **change})
        why = space.off_choices(change, case) or space.violations(v, case)
        if why:
            text = ",".join(f"{k}={value}" for k, value in change.items())
            log(f"[{case.key}] --probe {text} on the leader cannot run: {'; '.join(why)}")
            continue
        if v.as_dict() in probes:
            continue
        if _unmeasured(session, fp, case, v):
            probes.append(v.as_dict())
    return probes


def _neighbour_probes(session, fp, case, leader) -> list[dict]:
    """--neighbours: the case's leader (what emit ships, None if none) moved one step in each
    parameter (search.neighbours), where today's code for that point is unmeasured."""
    if leader is None:
        return []
    return [v.as_dict() for v in search.neighbours(space.Variant.from_dict(leader.params), case)
            if _unmeasured(session, fp, case, v)]


def _row(run, name, fp, case, trial, v, digest, status, error) -> dict:
    return dict(run_id=run.id, study=name, fingerprint=fp.key, case_key=case.key, case=case.as_dict(),
                optuna_number=trial.number, params=v.as_dict(), label=v.label, source_hash=digest,
                status=status, error=error)


def _progress(case, done, total, v, row, leader) -> str:
    """One trial's line; `leader` is what emit would ship now (the study's own best may be a timing of
    code the templates no longer render, or an older timing of a re-timed source)."""
    if row["status"] == "ok":
        sol = f" {100 * row['floor_ms'] / row['median_ms']:.0f}% SOL" if row.get("floor_ms") else ""
        what = f"{row['median_ms']:.4f} ms{sol} (err {row['global_rel_l2']:.1e})"
    else:
        what = f"{row['status']}: {(row['error'] or '?').splitlines()[-1][:120]}"
    best = f"leader {leader.median_ms:.4f} ms" if leader is not None else "no valid trial yet"
    return f"[{case.key}] {done}/{total} {what} | {v.label} | {best}"
