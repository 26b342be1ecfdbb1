"""The two ceilings a case's floor divides by, measured now, in this process, and the floor itself.

shared/REFERENCE.md: the read ceiling is a read-only streaming kernel; the matrix ceiling is the best
of torch.matmul and our own GEMMs on a large bf16 problem, timed exactly like the cases. Both drift
between runs and with how long the GPU has been loaded, so they are measured beside the timings they
judge. Also here, as information beside the floor: the matrix rate under a load as long as the
largest cases'.

    floor_ms = max(bytes_moved / read bandwidth, flops / matrix rate)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from . import target
from .reference import rel_l2
from .timing import SmClockSampler, time_fn
from .workloads import Case

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
        rel = rel_l2(c_ours, c_ref)
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

    return in_child_process("autotune.ceilings:_gemm_sm90_compile_here", asdict(tiles))


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
    free_gpu_memory()
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


def free_gpu_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
