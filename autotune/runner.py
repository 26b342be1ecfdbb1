"""Compile, verify and time one rendered variant on one case, isolated in a worker process.

The worker keeps the current case's inputs and reference between trials (seed16's weights are
12.9 GB). A variant that fails to compile, faults, hangs or is wrong comes back as a failed result
with its reason; a fault that poisons the CUDA context ends only the worker, which is restarted.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
import traceback
from dataclasses import dataclass, field

import torch
import triton

from . import render, target
from .reference import BAR, ErrorStats, error_stats, moe_reference
from .timing import time_fn
from .workloads import Case, experts_touched, make_tokens, make_weights

# Verification uses inputs drawn apart from the timed ones: a fresh weight seed and token seed.
VERIFY_WEIGHT_SEED = 1
VERIFY_TOKEN_OFFSET = 7919
# Seconds before a trial counts as hung, generous: a trial's first call compiles all of its kernels,
# and a shape's first trial also builds its inputs and the fp32 reference.
TRIAL_TIMEOUT_S = 900.0
# Errors after which the CUDA context cannot be trusted: the worker exits after reporting.
_FATAL_MARKERS = ("illegal memory access", "unspecified launch failure", "device-side assert", "CUDA error")


@dataclass
class Result:
    status: str
    error: str | None = None
    compile_s: float | None = None
    stats: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    experts_touched: int | None = None


class CaseState:
    """Inputs and reference of the case being tuned; rebuilt only when the case changes. The runner's,
    and every tool's that verifies a module before it times it, so all verify alike."""

    def __init__(self):
        self.shape = None
        self.case = None
        self.prepared = None

    def prepare(self, case: Case) -> None:
        dev = target.device()
        if self.shape != case.shape:
            self.shape = self.case = None
            self.weights = self.verify_weights = self.prepared = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            self.weights = make_weights(case.shape, dev, seed=0)
            self.verify_weights = make_weights(case.shape, dev, seed=VERIFY_WEIGHT_SEED)
            self.shape = case.shape
        if self.case != case:
            self.tokens = make_tokens(case, dev)
            self.verify_tokens = make_tokens(case, dev, seed_offset=VERIFY_TOKEN_OFFSET)
            x, w, ids = self.verify_tokens
            self.reference = moe_reference(x, *self.verify_weights, w, ids)
            self.experts_touched = experts_touched(self.tokens[2], case.shape.E)
            self.case = case

    def weights_for(self, module) -> tuple[tuple, tuple]:
        """(timed weights, verification weights) as `module` takes them: the case's own, or for a module
        that reads a layout of its own (it defines prepare_weights; today only the k-blocked one) its
        prepared copies, made once per shape and shared by every such trial."""
        if not hasattr(module, "prepare_weights"):
            return self.weights, self.verify_weights
        if self.prepared is None:
            self.prepared = render.weights_for(module, *self.weights), render.weights_for(module, *self.verify_weights)
        return self.prepared

    def verify(self, module) -> tuple[tuple, ErrorStats, float]:
        """Run `module` once on the verification inputs of the prepared case: the weights to time it
        on (as it reads them), its error against the reference, and the seconds its first call took
        (on a fresh module, mostly compiling its kernels). Raises what the call raises."""
        weights, verify_weights = self.weights_for(module)
        x, w, ids = self.verify_tokens
        t0 = time.perf_counter()
        out = module.fused_experts(x, *verify_weights, w, ids)
        if target.has_gpu():
            torch.cuda.synchronize()
        first_call_s = time.perf_counter() - t0
        return weights, error_stats(out, self.reference), first_call_s


def evaluate(state: CaseState, case: Case, source: str, reps: int, settle_ms: float = 0.0) -> Result:
    """Render-to-number for one variant: compile (first call), verify, then time."""
    try:
        state.prepare(case)
        module = render.load_source(source)
        weights, stats, compile_s = state.verify(module)
    except (triton.CompilationError, triton.runtime.errors.OutOfResources) as exc:
        return Result("compile_error", _short(exc))
    except Exception as exc:  # a variant's failure is data, not the end of the run
        return Result("runtime_error", _short(exc))

    bad = stats.failures(BAR)
    if bad:
        return Result("wrong", "; ".join(bad), compile_s, stats.__dict__)

    x, w, ids = state.tokens
    out = torch.empty_like(x)
    try:
        timing = time_fn(lambda: module.fused_experts(x, *weights, w, ids, out=out), reps=reps,
                         settle_ms=settle_ms)
    except Exception as exc:
        return Result("runtime_error", _short(exc), compile_s, stats.__dict__)
    return Result("ok", None, compile_s, stats.__dict__, timing.as_dict(), state.experts_touched)


def _short(exc: BaseException, limit: int = 2000) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text if len(text) <= limit else text[:limit] + " ..."


def _worker(conn) -> None:
    # Ctrl-C reaches the whole process group: the tuner handles it (and kills this worker), so the
    # worker does not print a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    target.quiet_interpreter()
    state = CaseState()
    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, payload = msg
        if kind == "ceilings":
            from .ceilings import measure_ceilings

            conn.send(measure_ceilings().as_dict())
            continue
        case, source, reps, settle_ms = payload
        result = evaluate(state, Case.from_dict(case), source, reps, settle_ms)
        conn.send(result.__dict__)
        if result.error and any(m in result.error for m in _FATAL_MARKERS):
            return


class Runner:
    """Evaluates variants in a worker process (or in this one with isolate=False, for tests)."""

    def __init__(self, isolate: bool = True, timeout_s: float = TRIAL_TIMEOUT_S, reps: int = 20,
                 settle_ms: float = 0.0):
        self.isolate, self.timeout_s, self.reps, self.settle_ms = isolate, timeout_s, reps, settle_ms
        self._proc = self._conn = None
        self._state = None if isolate else CaseState()

    def _ensure_worker(self):
        if self._proc is None or not self._proc.is_alive():
            ctx = mp.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=_worker, args=(child,), daemon=True)
            self._proc.start()
            child.close()

    def _ask(self, msg):
        """Send one request; its reply, "timeout" when the worker hung, None when it died (either way it
        is then killed)."""
        self._ensure_worker()
        try:
            self._conn.send(msg)
            if self._conn.poll(self.timeout_s):
                return self._conn.recv()
            self._kill()
            return "timeout"
        except (EOFError, OSError, BrokenPipeError):
            self._kill()
            return None

    def evaluate(self, case: Case, source: str) -> Result:
        if not self.isolate:
            return evaluate(self._state, case, source, self.reps, self.settle_ms)
        answer = self._ask(("evaluate", (case.as_dict(), source, self.reps, self.settle_ms)))
        if answer == "timeout":
            return Result("timeout", f"no answer within {self.timeout_s:g} s; worker killed")
        if answer is None:
            return Result("crashed", "the worker process died during the trial")
        return Result(**answer)

    def ceilings(self) -> dict | None:
        """The run's ceilings, measured in the process that times the trials (GPU only)."""
        if not target.has_gpu():
            return None
        if not self.isolate:
            from .ceilings import measure_ceilings

            return measure_ceilings().as_dict()
        answer = self._ask(("ceilings", None))
        return answer if isinstance(answer, dict) else None

    def _kill(self):
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=10)
        self._proc = self._conn = None

    def close(self):
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
                self._proc.join(timeout=30)
            except (OSError, BrokenPipeError):
                pass
        self._kill()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:  # an error or an interruption: the worker's trial is not waited for
            self._kill()
        else:
            self.close()
