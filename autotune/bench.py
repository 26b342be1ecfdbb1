"""The benchmark: ceilings measured in-process, the roofline floor, peers, and the report formats.

Every time below comes from `timing.time_fn`, in the same process as the ceilings it is judged
against (shared/REFERENCE.md: both ceilings drift between runs and with how long the GPU has been
loaded). Under the interpreter the code paths run on tiny sizes and the numbers mean nothing.

    floor_ms = max(bytes_moved / read bandwidth, flops / matrix rate)      %SOL = floor_ms / ms · 100
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import torch
import triton
import triton.language as tl

from . import target
from .peers import PEERS, Peer
from .reference import error_stats, moe_reference
from .timing import SmClockSampler, Timing, kernel_breakdown, time_fn
from .workloads import Case, experts_touched, make_tokens, make_weights

# Our GEMM must agree with torch.matmul this closely before its rate counts: both accumulate in
# fp32 and round to 16 bits once, which leaves a relative L2 difference near 2^-9.
GEMM_REL_L2_BAR = 1e-2


@dataclass(frozen=True)
class GemmTiles:
    """Tiles and schedule of the persistent GEMM; `GPU` is the configuration REFERENCE.md measured."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_stages: int
    num_warps: int


GPU_TILES = GemmTiles(block_m=128, block_n=256, block_k=64, group_m=8, num_stages=3, num_warps=8)
# Small enough that the interpreter gets through a 64³ problem in well under a second.
INTERPRETER_TILES = GemmTiles(block_m=32, block_n=32, block_k=32, group_m=2, num_stages=1, num_warps=4)


@triton.jit
def _read_sum_kernel(buf_ptr, partial_ptr, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    """partial[p] = fp32 sum of buf[p·SPAN : (p+1)·SPAN]: reads every byte once, writes next to nothing."""
    # 64-bit offsets: a 4 GiB bf16 buffer holds 2^31 elements.
    start = tl.program_id(0).to(tl.int64) * SPAN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in tl.range(0, SPAN, BLOCK):
        acc += tl.load(buf_ptr + start + off + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _gemm_persistent_kernel(a_desc, b_desc, c_desc, M, N, K,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr):
    """C[M, N] = A[M, K] @ B[N, K]^T through TMA descriptors; fp32 accumulator, C in its own dtype.

    Persistent: program p computes output tiles p, p + P, p + 2P, ... (P programs, one per SM).
    Tiles are numbered in groups of GROUP_M tile rows walked column by column, so the B tiles a
    group shares are read from HBM once and then hit in L2.
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    steps_k = tl.cdiv(K, BLOCK_K)
    tiles_per_group = GROUP_M * tiles_n
    # flatten: the k loops of successive tiles form one pipelined loop, so the next tile's loads
    # start while this tile's last products are still in flight.
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=True):
        first_m = (tile // tiles_per_group) * GROUP_M
        rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
        in_group = tile % tiles_per_group
        off_m = (first_m + in_group % rows_here) * BLOCK_M
        off_n = (in_group // rows_here) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(steps_k):
            a = a_desc.load([off_m, step * BLOCK_K])
            b = b_desc.load([off_n, step * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def measure_read_bandwidth(*, reps: int = 20) -> float:
    """Bytes/s of `_read_sum_kernel` over a buffer far larger than L2 (4 GiB bf16 on the GPU).

    Under the interpreter the buffer is 8 KiB: the path runs, the number is meaningless.
    Raises RuntimeError if the partial sums are wrong (the kernel did not read what it claims).
    """
    if target.has_gpu():
        # 128 KiB per program: 32768 programs keep every SM busy to the end (a short tail).
        span, block, n_programs = 65536, 4096, 32768
    else:
        span, block, n_programs = 1024, 256, 4
    buf = torch.ones(n_programs * span, dtype=torch.bfloat16, device=target.device())
    partial = torch.empty(n_programs, dtype=torch.float32, device=buf.device)
    launch = lambda: _read_sum_kernel[(n_programs,)](buf, partial, SPAN=span, BLOCK=block, num_warps=8)
    launch()
    if not bool((partial == span).all()):
        raise RuntimeError("read-bandwidth kernel: partial sums differ from the span length")
    timing = time_fn(launch, reps=reps)
    return buf.numel() * buf.element_size() / (timing.median_ms * 1e-3)


def _gemm_launcher(a_MK: torch.Tensor, b_NK: torch.Tensor, c_MN: torch.Tensor, tiles: GemmTiles):
    """A no-argument launcher of the persistent GEMM into c_MN; descriptors are built once, here."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (M, K), N = a_MK.shape, b_NK.shape[0]
    a_desc = TensorDescriptor.from_tensor(a_MK, [tiles.block_m, tiles.block_k])
    b_desc = TensorDescriptor.from_tensor(b_NK, [tiles.block_n, tiles.block_k])
    c_desc = TensorDescriptor.from_tensor(c_MN, [tiles.block_m, tiles.block_n])
    n_tiles = triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n)
    grid = (min(target.sm_count(), n_tiles),)
    return lambda: _gemm_persistent_kernel[grid](
        a_desc, b_desc, c_desc, M, N, K,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        num_stages=tiles.num_stages, num_warps=tiles.num_warps,
    )


@dataclass(frozen=True)
class MatmulRates:
    """FLOP/s of torch.matmul, of our persistent TMA GEMM and (GPU only) of our warp-specialised
    Gluon GEMM (`wsgemm`); None for one of ours that failed or was wrong."""

    torch_flops_per_s: float
    triton_flops_per_s: float | None
    notes: tuple[str, ...] = ()
    gluon_flops_per_s: float | None = None

    @property
    def best(self) -> float:
        return max(self.torch_flops_per_s, self.triton_flops_per_s or 0.0, self.gluon_flops_per_s or 0.0)


def _checked_rate(name: str, launch_factory, c_ours, c_ref, flops: int, reps: int) -> tuple[float | None, str]:
    """FLOP/s of one of our GEMMs, counted only if its output matches torch.matmul's within
    GEMM_REL_L2_BAR; otherwise, or if it fails to compile or launch, None and the reason."""
    try:
        launch = launch_factory()
        launch()
        rel = float((c_ours.float() - c_ref.float()).norm() / c_ref.float().norm())
        if not rel <= GEMM_REL_L2_BAR:
            return None, f"{name} rejected: relative L2 {rel:.2e} vs torch.matmul"
        return flops / (time_fn(launch, reps=reps).median_ms * 1e-3), f"{name} relative L2 vs torch.matmul {rel:.2e}"
    except Exception as exc:  # noqa: BLE001 - any failure of our GEMM means "use another rate"; say why
        return None, f"{name} failed: {type(exc).__name__}: {exc}"[:500]


def measure_matmul_rate(n: int | None = None, *, reps: int = 20) -> MatmulRates:
    """The best of torch.matmul, our persistent TMA GEMM and (GPU only) our warp-specialised Gluon
    GEMM (`wsgemm`) on one n×n×n problem (2n³ FLOPs).

    GPU: bf16, n = 8192, `GPU_TILES` and `wsgemm.TILES`. Interpreter: fp16 (its bf16 tl.dot is
    broken), n = 64, `INTERPRETER_TILES`. Each of our GEMMs counts only if its output matches
    torch.matmul's within GEMM_REL_L2_BAR; otherwise, or if it fails to compile or launch, the reason
    goes into `notes`.
    """
    gpu = target.has_gpu()
    n = n or (8192 if gpu else 64)
    dtype, tiles = (torch.bfloat16, GPU_TILES) if gpu else (torch.float16, INTERPRETER_TILES)
    gen = torch.Generator(device=target.device()).manual_seed(0)
    a_MK = torch.randn(n, n, generator=gen, device=target.device()).to(dtype)
    b_NK = torch.randn(n, n, generator=gen, device=target.device()).to(dtype)
    flops = 2 * n**3
    c_torch = torch.matmul(a_MK, b_NK.T)
    with SmClockSampler() as clock:
        torch_rate = flops / (time_fn(lambda: torch.matmul(a_MK, b_NK.T), reps=reps).median_ms * 1e-3)
    sampled = clock.summary()
    clock_note = (f"SM clock while timing torch.matmul: {sampled['first']} -> {sampled['last']} MHz" if sampled
                  else "SM clock not sampled")
    c_ours = torch.empty_like(c_torch)
    triton_rate, triton_note = _checked_rate("triton GEMM", lambda: _gemm_launcher(a_MK, b_NK, c_ours, tiles),
                                             c_ours, c_torch, flops, reps)
    if not gpu:  # Gluon kernels do not run under the interpreter
        return MatmulRates(torch_rate, triton_rate, (triton_note, clock_note))
    gluon_rate, gluon_note = _gluon_rate(n, reps)
    return MatmulRates(torch_rate, triton_rate, (triton_note, gluon_note, clock_note), gluon_rate)


def _gluon_rate(n: int, reps: int) -> tuple[float | None, str]:
    """The warp-specialised Gluon GEMM's FLOP/s on the same problem, measured in a child process (it has
    not been seen to run yet: a hang must not stop the bench), counted only within GEMM_REL_L2_BAR."""
    from . import wsgemm

    try:
        r = wsgemm.measure(n, reps)
    except Exception as exc:  # noqa: BLE001 - a failure means "not a ceiling candidate"; say why
        return None, f"gluon GEMM failed: {type(exc).__name__}: {str(exc)[-400:]}"
    if not r["rel_l2"] <= GEMM_REL_L2_BAR:
        return None, f"gluon GEMM rejected: relative L2 {r['rel_l2']:.2e} vs torch.matmul"
    return r["flops_per_s"], f"gluon GEMM relative L2 vs torch.matmul {r['rel_l2']:.2e} (child process)"


def gemm_sm90_compile_report(tiles: GemmTiles = GPU_TILES) -> dict:
    """Compile the persistent GEMM (bf16) for sm_90 without a GPU; report shared memory and TMA/wgmma use.

    Compiles in a child process, so it works under the interpreter too.
    """
    from .sm90 import in_child_process

    return in_child_process("autotune.bench:_gemm_sm90_compile_here", asdict(tiles))


def _gemm_sm90_compile_here(tiles: dict) -> dict:
    from .sm90 import compile_sm90

    t = GemmTiles(**tiles)
    signature = {
        "a_desc": f"tensordesc<bf16[{t.block_m}, {t.block_k}]>",
        "b_desc": f"tensordesc<bf16[{t.block_n}, {t.block_k}]>",
        "c_desc": f"tensordesc<bf16[{t.block_m}, {t.block_n}]>",
        "M": "i32", "N": "i32", "K": "i32",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr",
    }
    constexprs = {"BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "GROUP_M": t.group_m}
    compiled = compile_sm90(_gemm_persistent_kernel, signature, constexprs, num_warps=t.num_warps,
                            num_stages=t.num_stages)
    ptx = compiled.asm["ptx"]
    # A TMA store copies global <- shared; every other bulk tensor copy is a load.
    tma_stores = ptx.count("cp.async.bulk.tensor.2d.global.shared")
    return {
        "shared_bytes": compiled.metadata.shared,
        "smem_limit_bytes": target.HOPPER_SMEM_BYTES,
        "tma_loads": ptx.count("cp.async.bulk.tensor") - tma_stores,
        "tma_stores": tma_stores,
        "wgmma": ptx.count("wgmma.mma_async"),
    }


@dataclass(frozen=True)
class Ceilings:
    """The two rates the floor divides by, and how the matrix rate was chosen."""

    read_bytes_per_s: float
    matmul_flops_per_s: float  # max of the three below
    torch_matmul_flops_per_s: float
    triton_gemm_flops_per_s: float | None
    notes: tuple[str, ...] = ()
    gluon_gemm_flops_per_s: float | None = None
    # Information beside the floor, never in it: our triton GEMM's rate under a load as long as the
    # largest cases' (SUSTAINED_CALLS back-to-back per replay), with the SM clock sampled meanwhile.
    sustained_matmul_flops_per_s: float | None = None
    sustained_sm_clock_mhz: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def measure_ceilings(*, reps: int = 20) -> Ceilings:
    """Read bandwidth and matrix rate, measured now, in this process; GPU memory freed afterwards."""
    read = measure_read_bandwidth(reps=reps)
    rates = measure_matmul_rate(reps=reps)
    sustained, clock = measure_sustained_matmul_rate(reps=reps) if target.has_gpu() else (None, None)
    _free_gpu_memory()
    return Ceilings(read, rates.best, rates.torch_flops_per_s, rates.triton_flops_per_s, rates.notes,
                    rates.gluon_flops_per_s, sustained, clock)


# 16 GEMMs of 8192^3 take ~21 ms at ~800 TFLOP/s: one replay lasts as long as one T=32768 call.
SUSTAINED_CALLS = 16


def measure_sustained_matmul_rate(n: int = 8192, *, reps: int = 20) -> tuple[float | None, dict | None]:
    """FLOP/s of our persistent TMA GEMM (GPU_TILES, bf16 n^3) timed in replays of SUSTAINED_CALLS
    back-to-back calls, and the SM clock meanwhile; (None, None) if it fails.

    The matrix ceiling is timed on ~2 ms replays, as REFERENCE.md fixes it, where the card holds its
    top clock. Under a load as long as a large case's, its power cap lowers the clock (on the H200,
    1980 -> ~1450 MHz at 700 W) and any GEMM runs slower: this is that rate, to read the large cases
    against. It is not used in the floor.
    """
    try:
        a_MK = torch.randn(n, n, device=target.device()).to(torch.bfloat16)
        b_NK = torch.randn(n, n, device=target.device()).to(torch.bfloat16)
        c_MN = torch.empty(n, n, device=target.device(), dtype=torch.bfloat16)
        launch = _gemm_launcher(a_MK, b_NK, c_MN, GPU_TILES)

        def load():
            for _ in range(SUSTAINED_CALLS):
                launch()

        with SmClockSampler() as clock:
            ms = time_fn(load, reps=reps).median_ms / SUSTAINED_CALLS
        return 2 * n**3 / (ms * 1e-3), clock.summary()
    except Exception:  # noqa: BLE001 - information only: a failure leaves it out, never stops the bench
        return None, None


def floor_ms(case: Case, experts_touched: int, ceilings: Ceilings) -> float:
    """The case's speed-of-light time in ms: max(bytes / read bandwidth, flops / matrix rate)."""
    bytes_s = case.bytes_moved(experts_touched) / ceilings.read_bytes_per_s
    flops_s = case.flops / ceilings.matmul_flops_per_s
    return max(bytes_s, flops_s) * 1e3


def _free_gpu_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _time(fn, *, graph: bool, reps: int, warmup: int) -> Timing:
    """time_fn in a CUDA graph when `graph`, falling back to plain events if capture fails."""
    if graph:
        try:
            return time_fn(fn, reps=reps, warmup=warmup, graph=True)
        except RuntimeError as exc:
            print(f"[bench] CUDA graph capture failed ({str(exc)[:120]}); timing without it",
                  file=sys.stderr, flush=True)
    return time_fn(fn, reps=reps, warmup=warmup, graph=False)


def _measure(fn, args, ref_TH, case: Case, floor: float, bytes_moved: int, *, graph: bool, reps: int,
             warmup: int) -> dict:
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
        timing = _time(lambda: fn(*args), graph=graph, reps=reps, warmup=warmup)
    sec = timing.median_ms * 1e-3
    entry.update(ok=True, ms=timing.median_ms, timing=timing.as_dict(), pct_sol=floor / timing.median_ms * 100,
                 tflops=case.flops / sec / 1e12, tbps=bytes_moved / sec / 1e12, sm_clock_mhz=clock.summary())
    return entry


def _bench_case(fused_experts, case, w13_EnH, w2_EHI, ceilings, peers, reps, warmup) -> dict:
    """One row: reference, experts touched, floor, then ours and each peer checked and timed."""
    x_TH, w_TK, ids_TK = make_tokens(case, target.device())
    args = (x_TH, w13_EnH, w2_EHI, w_TK, ids_TK)
    ref_TH = moe_reference(*args)
    touched = experts_touched(ids_TK, case.shape.E)
    floor, nbytes = floor_ms(case, touched, ceilings), case.bytes_moved(touched)
    row = {"key": case.key, "case": case.as_dict(), "T": case.T, "experts_touched": touched,
           "bytes": nbytes, "flops": case.flops, "floor_ms": floor}
    measure = lambda fn, graph: _measure(fn, args, ref_TH, case, floor, nbytes, graph=graph, reps=reps,
                                         warmup=warmup)
    row["ours"] = measure(fused_experts, True)
    row["peers"] = {}
    for peer in peers:
        entry = measure(peer.fn, peer.graph_safe)
        ours_ms = row["ours"]["ms"]
        entry["speedup"] = entry["ms"] / ours_ms if entry["ms"] and ours_ms else None
        row["peers"][peer.name] = entry
    if row["ours"]["ok"]:
        # Profiled last, so the profiler cannot disturb any timing above.
        row["ours"]["kernels"] = kernel_breakdown(lambda: fused_experts(*args))
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
        clock = entry.get("sm_clock_mhz")
        return f"{entry['ms']:.4g} ms" + (f" (SM {clock['first']}->{clock['last']} MHz)" if clock else "")
    parts = [f"[bench] {i}/{n} {row['key']}: floor {row['floor_ms']:.4g} ms, ours {say(row['ours'])}"]
    parts += [f"{name} {say(e)}" for name, e in row["peers"].items()]
    print(", ".join(parts), file=sys.stderr, flush=True)


def run_bench(fused_experts, cases: list[Case], *, peers: bool = True, ceilings: Ceilings | None = None,
              reps: int = 20, warmup: int = 3) -> dict:
    """Benchmark `fused_experts` (the op's signature) on `cases` against the floor and the peers.

    Weights: make_weights(shape, device, seed=0), once per Shape; tokens: make_tokens(case). Every
    output is checked against moe_reference before it is timed. Returns a JSON-serialisable dict:
    fingerprint, date, ceilings, peers, one row per case, and means over the cases.
    """
    ceilings = ceilings or measure_ceilings(reps=reps)
    used = PEERS if peers else ()
    rows = []
    for shape in dict.fromkeys(c.shape for c in cases):
        w13_EnH, w2_EHI = make_weights(shape, target.device(), seed=0)
        for case in (c for c in cases if c.shape == shape):
            rows.append(_bench_case(fused_experts, case, w13_EnH, w2_EHI, ceilings, used, reps, warmup))
            _progress(len(rows), len(cases), rows[-1])
        del w13_EnH, w2_EHI
        _free_gpu_memory()
    return {
        "fingerprint": target.fingerprint().as_dict(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "ceilings": ceilings.as_dict(),
        "peers": [{"name": p.name, "label": p.label, "short": p.short} for p in used],
        "cases": rows,
        "mean": _means(rows, used),
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
