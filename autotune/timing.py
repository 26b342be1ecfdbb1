"""The one timing path: the tuner, `moe-tune bench` and every script measure through `time_fn`.

On the GPU, `inner` calls are captured in one CUDA graph and each replay is timed with device
events, so launch gaps between the pipeline's kernels do not hide (or inflate) kernel time; the
result is the per-call median over `reps` replays. Under the interpreter, wall-clock time.

`settle_ms` first runs the call for that long, untimed. Under sustained load the H200 holds its
700 W cap by lowering the SM clock (1980 -> ~1500 MHz within the first ~100 ms of tensor work, NOTES
21), so without it a long call's timing depends on how long the card rested before it; the tuner
settles every trial so that its contenders are timed in one state, the state a sustained prefill
runs in.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from . import target

# The tuner's settle: past the power cap's onset on the H200 (NOTES 21: the clock falls within the
# first ~100 ms of back-to-back tensor work); every trial pays it in device time.
SETTLE_MS = 400.0


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    mean_ms: float
    std_ms: float
    reps: int
    method: str  # "cuda-graph", "cuda-events" or "wall-clock"
    samples_ms: tuple[float, ...]
    calls_per_sample: int = 1  # the calls each sample times back to back (one graph replay of them)

    def as_dict(self) -> dict:
        return asdict(self)


def turns(names: list, r: int) -> list:
    """The order the parties take in round r of an interleaved comparison: the list rotated by r, so
    that over len(names) rounds each takes each turn alike. Under the power cap the turn can move a
    time by itself (NOTES 76: at T=8192 the order of the parties moved them more than their kernels
    did), and a fixed order would charge that to whichever party always came second."""
    r %= max(len(names), 1)
    return names[r:] + names[:r]


def _summary(samples: list[float], method: str, calls: int = 1) -> Timing:
    ordered = sorted(samples)
    n = len(ordered)
    return Timing(
        median_ms=statistics.median(ordered),
        p10_ms=ordered[int(0.1 * (n - 1))],
        p90_ms=ordered[int(0.9 * (n - 1))],
        mean_ms=statistics.fmean(ordered),
        std_ms=statistics.pstdev(ordered),
        reps=n,
        method=method,
        samples_ms=tuple(round(s, 6) for s in samples),
        calls_per_sample=calls,
    )


def _inner_count(single_ms: float, target_ms: float = 2.0, cap: int = 32) -> int:
    """Calls per graph replay: enough that one replay lasts ~target_ms, so event jitter is small."""
    return max(1, min(cap, int(target_ms / max(single_ms, 1e-3))))


def time_fn(fn: Callable[[], object], *, reps: int = 20, warmup: int = 3, graph: bool = True,
            settle_ms: float = 0.0) -> Timing:
    """Median time of one `fn()` call, after `settle_ms` of untimed calls (GPU only). `fn` must not
    synchronise the host when `graph` is set."""
    if not target.has_gpu():
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return _summary(samples, "wall-clock")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    single_ms = min(_one_call_ms(fn) for _ in range(3))
    inner = _inner_count(single_ms)

    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(inner):
                fn()
        g.replay()
        run, method = g.replay, "cuda-graph"
    else:
        def run():
            for _ in range(inner):
                fn()
        run()
        method = "cuda-events"
    if settle_ms > 0:
        _settle(run, settle_ms)
        method += f", settled {settle_ms:.0f} ms"
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in pairs:
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    samples = [a.elapsed_time(b) / inner for a, b in pairs]
    return _summary(samples, method, inner)


def _settle(run: Callable[[], object], settle_ms: float) -> None:
    """Runs `run` untimed until settle_ms have passed: once to learn how long a run takes, then as
    many runs as the rest of the time needs, measured again until it is spent. Counting the runs from
    a call timed alone (as time_fn did) cut the settle to a few runs wherever that call was slow, and
    left the timing in the state the settle is there to end (NOTES 98)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    runs, batch, spent_ms = 0, 1, 0.0
    while spent_ms < settle_ms:
        for _ in range(batch):
            run()
        torch.cuda.synchronize()
        runs += batch
        spent_ms = (time.perf_counter() - start) * 1e3
        batch = math.ceil((settle_ms - spent_ms) * runs / max(spent_ms, 1e-6))  # what is left, at the rate so far


def _one_call_ms(fn: Callable[[], object]) -> float:
    """One `fn()` call's time between device events on the caller's stream. It can include host work
    the call does once (an emitted module captures its own graph at a key's second call on a stream:
    graph_replay.py.j2), during which the device waits: time_fn sizes its replays by the least of a
    few (NOTES 93: one such call set seed16 T=1's replays to one call each)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def per_kernel(events: list[tuple[str, float]], calls: int) -> list[dict]:
    """(kernel name, device µs) events from `calls` calls -> one entry per kernel, longest first:
    µs per call and launches per call."""
    totals: dict[str, float] = {}
    launches: dict[str, int] = {}
    for name, us in events:
        totals[name] = totals.get(name, 0.0) + us
        launches[name] = launches.get(name, 0) + 1
    return [{"name": name, "us": total / calls, "launches": launches[name] / calls}
            for name, total in sorted(totals.items(), key=lambda kv: -kv[1])]


@contextlib.contextmanager
def own_launches():
    """Inside, an emitted module launches each kernel through triton, outside any CUDA graph: a triton
    launch hook (a no-op) is installed, for which it sets aside its planned launches and the graphs it
    replays for small calls (fast_launch.py.j2, graph_replay.py.j2)."""
    import triton

    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        yield
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)


def kernel_breakdown(fn: Callable[[], object], *, calls: int = 5) -> list[dict] | None:
    """Where one `fn()` call's device time goes, kernel by kernel (torch.profiler's CUDA activity,
    after a warm-up call), with each kernel launched on its own (own_launches): in a graph's replay,
    a kernel launched early by PDL counts its wait for the one before it (NOTES 93). None without a
    GPU: interpreted kernels have no device time."""
    if not target.has_gpu():
        return None
    from torch.profiler import ProfilerActivity, profile

    with own_launches():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return per_kernel([(e.name, e.device_time) for e in prof.events() if e.device_type == cuda], calls)


def _smi_id() -> str:
    """This process's GPU as nvidia-smi names it: by UUID, which CUDA_VISIBLE_DEVICES cannot renumber."""
    uuid = target.gpu_uuid()
    return f"GPU-{uuid}" if uuid is not None else str(torch.cuda.current_device())


class SmClockSampler:
    """The SM clock (MHz) and the board's power draw (W), sampled by `nvidia-smi -lms` while the
    block runs: whether a timing was taken at full clock or under the card's sustained-load drop, and
    how close to its power limit the load ran. `summary()` and `power_summary()` are None where there
    is no GPU or no nvidia-smi; sampling never fails the caller."""

    def __init__(self, period_ms: int = 50):
        self.period_ms = period_ms
        self.samples: list[int] = []
        self.watts: list[float] = []
        self._proc = None

    def __enter__(self) -> SmClockSampler:
        if target.has_gpu():
            try:
                self._proc = subprocess.Popen(
                    ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                     "-i", _smi_id(), "-lms", str(self.period_ms)],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.samples, self.watts = _parse_smi(out)

    def summary(self) -> dict | None:
        if not self.samples:
            return None
        return {"min": min(self.samples), "median": statistics.median(self.samples), "max": max(self.samples),
                "first": self.samples[0], "last": self.samples[-1], "samples": len(self.samples)}

    def power_summary(self) -> dict | None:
        """Board power in W (median, max, last sample); None where the card does not report it."""
        if not self.watts:
            return None
        return {"median": statistics.median(self.watts), "max": max(self.watts), "last": self.watts[-1],
                "samples": len(self.watts)}


def _parse_smi(out: str) -> tuple[list[int], list[float]]:
    """`clocks.sm, power.draw` lines into clocks and watts. A field nvidia-smi cannot read ("[N/A]") is
    skipped; so is a last line the sampler's termination cut short (no newline after it)."""
    clocks, watts = [], []
    lines = out.splitlines() if out.endswith("\n") else out.splitlines()[:-1]
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2:
            continue
        if fields[0].isdigit():
            clocks.append(int(fields[0]))
        if fields[1]:
            try:
                watts.append(float(fields[1]))
            except ValueError:
                pass
    return clocks, watts
