"""A warp-specialised cooperative GEMM for Hopper, in Gluon: C[M, N] = A[M, K] @ B[N, K]^T, bf16 in,
fp32 accumulation, C in bf16.

Why it exists: triton's `tl.dot` pipeline runs one instruction stream per program, so on sm_90 a
tile's epilogue and the next tile's pipeline fill sit between its main loops, and the shorter K is,
the more that costs (NOTES.md 13: 812 TFLOP/s at K=8192, 737 at K=2048 for the same tile);
`tl.range(warp_specialize=True)` does not run on sm_90 in triton 3.6. Gluon
(`triton.experimental.gluon`, part of triton) exposes TMA, mbarriers, async wgmma and warp
specialisation directly. Here each persistent program has two partitions over one ring of STAGES
shared-memory stages:

- a one-warp loader that issues every TMA copy, running ahead across tiles;
- one 8-warp consumer on a 128x256 tile (each warpgroup 64 rows, m64n256k16), whose epilogue
  stores through shared memory by TMA and leaves the store in flight while the next tile's wgmma run.

Two consumers on their own 128x128 tiles (a ping-pong) overlap the epilogue with wgmma as well, but
each needs ~160 B/clk of shared memory per SM against ~128: measured at 571 TFLOP/s (NOTES.md 11).

The bench measures it as a third matrix-ceiling candidate beside torch.matmul and our triton GEMM;
the Gluon GEMM forms in templates/gemm_gluon.py.j2 share its structure. Gluon does not run under
the interpreter: without a GPU this module only compiles (`compile_report`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import target


@dataclass(frozen=True)
class GluonTiles:
    """Tile, ring depth and tile swizzle; consumer warps (a warpgroup per 64 rows); the loader's
    register budget (setmaxnreg; the consumer takes the rest)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 3
    group_m: int = 8
    consumer_warps: int = 8
    loader_regs: int = 40

    def as_dict(self) -> dict:
        return asdict(self)


TILES = GluonTiles()


@gluon.jit
def tile_offsets(tile, num_pid_m, num_pid_n, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """Grouped tile order: GROUP_M row tiles share each column of B while it is in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    return (first_m + (tile % in_group) % rows) * BM, ((tile % in_group) // rows) * BN


@gluon.jit
def walk(M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """This program's share of the persistent walk, the same in both partitions: (first tile, stride,
    row tiles, column tiles, k-steps per tile, tiles of this program)."""
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    num_pid_m, num_pid_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    return pid, nprog, num_pid_m, num_pid_n, gl.cdiv(K, BK), (num_pid_m * num_pid_n - pid + nprog - 1) // nprog


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """The ring's barriers, one of each per stage: `ready` (the loader's TMA bytes have landed) and
    `empty` (each of the CONSUMERS partitions has released the stage); fenced for the async proxy."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    fence_async_shared()
    return ready, empty


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
            BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Every TMA copy of this program's tiles, in order; step i of the program goes to stage i % STAGES."""
    pid, nprog, num_pid_m, num_pid_n, k_steps, my_tiles = walk(M, N, K, BM, BN, BK)
    for j in range(my_tiles):
        off_m, off_n = tile_offsets(pid + j * nprog, num_pid_m, num_pid_n, BM, BN, GROUP_M)
        for kk in range(k_steps):
            step = j * k_steps + kk
            s = step % STAGES
            # Parity 1 on a fresh barrier passes at once: the ring's first lap is free.
            mbarrier.wait(empty.index(s), (step // STAGES) & 1 ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_n, kk * BK], ready.index(s), b_bufs.index(s))


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, WARPS: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Each tile: wgmma with one group in flight, stages handed back as soon as the next group is
    issued; then the tile goes out by TMA store, which completes while the next tile runs."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BN, 16])
    pid, nprog, num_pid_m, num_pid_n, k_steps, my_tiles = walk(M, N, K, BM, BN, BK)
    for j in range(my_tiles):
        off_m, off_n = tile_offsets(pid + j * nprog, num_pid_m, num_pid_n, BM, BN, GROUP_M)
        acc = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
        acc = consume_tile(a_bufs, b_bufs, ready, empty, acc, j, k_steps, STAGES, 1, 0, 1, 0)
        store_tile(acc, c_desc, c_smem, off_m, off_n)
    tma.store_wait(0)


@gluon.jit
def consume_tile(a_bufs, b_bufs, ready, empty, acc, j, k_steps, STAGES: gl.constexpr, A_STEP: gl.constexpr,
                 A_AT: gl.constexpr, B_STEP: gl.constexpr, B_AT: gl.constexpr):
    """The main loop of this program's j-th tile: at each k-step, wgmma on the stage's A box
    A_STEP * stage + A_AT and B box B_STEP * stage + B_AT (one box a stage: 1, 0), one group in flight,
    each stage handed back as soon as the next group is issued. Returns the accumulator."""
    for kk in range(k_steps):
        step = j * k_steps + kk
        s = step % STAGES
        mbarrier.wait(ready.index(s), (step // STAGES) & 1)
        a = a_bufs.index(A_STEP * s + A_AT)
        b = b_bufs.index(B_STEP * s + B_AT)
        acc = warpgroup_mma(a, b.permute((1, 0)), acc, use_acc=kk > 0, is_async=True)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, b))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=kk > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((j * k_steps + k_steps - 1) % STAGES))
    return acc


@gluon.jit
def store_tile(acc, c_desc, c_smem, off_m, off_n):
    """The tile out through c_smem by TMA store, left in flight (the caller waits before its last
    return); the previous tile's store must have left c_smem first."""
    tma.store_wait(0)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def ws_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                   LOADER_REGS: gl.constexpr):
    """C = A @ B^T for A [M, K], B [N, K] and C [M, N] by TMA descriptors ([BM, BK], [BN, BK] and
    [BM, BN] boxes); one program per SM over the grouped tile order. Launch with BM / 16 warps."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    WARPS: gl.constexpr = gl.num_warps()
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
    ready, empty = ring_barriers(STAGES, 1)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, WARPS, BM, BN, BK, STAGES, GROUP_M)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BM, BN, BK, STAGES, GROUP_M)),
    ], [1], [LOADER_REGS])


def launcher(a_MK: torch.Tensor, b_NK: torch.Tensor, c_MN: torch.Tensor, tiles: GluonTiles = TILES):
    """A no-argument launcher of C = A @ B^T into c_MN (bf16, GPU); descriptors are built once, here."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .sm90 import gluon_smem_layout

    if not (a_MK.dtype == b_NK.dtype == c_MN.dtype == torch.bfloat16):
        raise TypeError(f"the Gluon GEMM is bf16 only, got {a_MK.dtype}, {b_NK.dtype}, {c_MN.dtype}")
    (M, K), N = a_MK.shape, b_NK.shape[0]
    boxes = ([tiles.block_m, tiles.block_k], [tiles.block_n, tiles.block_k], [tiles.block_m, tiles.block_n])
    a_desc, b_desc, c_desc = (TensorDescriptor.from_tensor(t, box, gluon_smem_layout("bfloat16", box))
                              for t, box in zip((a_MK, b_NK, c_MN), boxes, strict=True))
    n_tiles = -(-M // tiles.block_m) * -(-N // tiles.block_n)
    grid = (min(target.sm_count(), n_tiles),)
    return lambda: ws_gemm_kernel[grid](
        a_desc, b_desc, c_desc, M, N, K, STAGES=tiles.stages, GROUP_M=tiles.group_m, LOADER_REGS=tiles.loader_regs,
        num_warps=tiles.consumer_warps,
    )


def measure(n: int, reps: int, *, timeout: float = 300) -> dict:
    """Relative L2 against torch.matmul and FLOP/s of the kernel on bf16 n x n x n (2n^3 FLOPs), in a
    child process: a kernel that hangs or faults cannot take the caller with it. The inputs are the
    bench's (seed 0); raises RuntimeError or subprocess.TimeoutExpired on failure."""
    from .sm90 import in_child_process

    return in_child_process("autotune.wsgemm:_measure_here", n, reps, timeout=timeout)


def _measure_here(n: int, reps: int) -> dict:
    from .reference import rel_l2
    from .timing import time_fn

    gen = torch.Generator(device="cuda").manual_seed(0)
    a_MK = torch.randn(n, n, generator=gen, device="cuda").to(torch.bfloat16)
    b_NK = torch.randn(n, n, generator=gen, device="cuda").to(torch.bfloat16)
    c_ref = torch.matmul(a_MK, b_NK.T)
    c_MN = torch.empty_like(c_ref)
    launch = launcher(a_MK, b_NK, c_MN)
    launch()
    rel = rel_l2(c_MN, c_ref)
    return {"rel_l2": rel, "flops_per_s": 2 * n**3 / (time_fn(launch, reps=reps).median_ms * 1e-3)}


def compile_report(tiles: GluonTiles = TILES) -> dict:
    """Compile the kernel for sm_90 here, GPU or not (a child process: the interpreter must be off);
    shared memory, registers and spills, and the instructions that show it is what it claims."""
    from .sm90 import in_child_process

    return in_child_process("autotune.wsgemm:_compile_here", tiles.as_dict())


def _compile_here(tiles: dict) -> dict:
    from .sm90 import compile_gluon_sm90, gluon_descriptor_type, resource_usage, wgmma_shapes

    t = GluonTiles(**tiles)
    signature = {
        "a_desc": gluon_descriptor_type("bfloat16", [t.block_m, t.block_k]),
        "b_desc": gluon_descriptor_type("bfloat16", [t.block_n, t.block_k]),
        "c_desc": gluon_descriptor_type("bfloat16", [t.block_m, t.block_n]),
        "M": "i32", "N": "i32", "K": "i32", "STAGES": "constexpr", "GROUP_M": "constexpr", "LOADER_REGS": "constexpr",
    }
    constexprs = {"STAGES": t.stages, "GROUP_M": t.group_m, "LOADER_REGS": t.loader_regs}
    compiled = compile_gluon_sm90(ws_gemm_kernel, signature, constexprs, {}, num_warps=t.consumer_warps)
    ptx = compiled.asm["ptx"]
    registers, spill = resource_usage(compiled.asm["cubin"])
    return {
        "shared_bytes": compiled.metadata.shared,
        "smem_limit_bytes": target.HOPPER_SMEM_BYTES,
        "warps": compiled.metadata.num_warps,
        "registers": registers,
        "spill_bytes": spill,
        "wgmma": ptx.count("wgmma.mma_async"),
        "wgmma_shapes": list(wgmma_shapes(ptx)),
        "tma_loads": ptx.count("cp.async.bulk.tensor"),
        "setmaxnreg": sorted({line.strip().rstrip(";") for line in ptx.splitlines() if "setmaxnreg" in line}),
    }
