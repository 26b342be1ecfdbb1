"""A warp-specialised ping-pong GEMM for Hopper, in Gluon: C[M, N] = A[M, K] @ B[N, K]^T, bf16 in,
fp32 accumulation, C in bf16.

Why it exists: triton's `tl.dot` pipeline runs one instruction stream per program, so on sm_90 a
tile's epilogue and the next tile's pipeline fill stall the tensor cores (NOTES.md, "Compiler view
of the large-T main loop"); `tl.range(warp_specialize=True)` does not run on sm_90 in triton 3.6.
Gluon (`triton.experimental.gluon`, part of triton) exposes TMA, mbarriers, async wgmma and warp
specialisation directly. Here each program has three partitions:

- a one-warp loader that issues every TMA copy;
- two consumer warpgroups, each with its own ring of STAGES shared-memory stages, taking every other
  output tile of the program. The loader fills the rings in tile order, so the consumers' main
  loops take turns and one's epilogue runs while the other's wgmma run.

Each ring has its own barriers, so a waiter is never more than one phase from its barrier (one
ring shared by both consumers would alias mbarrier parities across a whole tile).

The bench measures it as a third matrix-ceiling candidate beside torch.matmul and our triton GEMM;
it is also the pattern for warp-specialised grouped GEMMs. Gluon does not run under the
interpreter: without a GPU this module only compiles (`compile_report`).
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
class PingPongTiles:
    """Tile of one consumer warpgroup, stages per consumer ring, tile swizzle, register split."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 3
    group_m: int = 8
    # setmaxnreg budgets: a warpgroup per partition (the loader's warp is padded to one), 64K
    # registers per SM: 2 x 128 x 232 + 128 x 40 = 64512.
    consumer_regs: int = 232
    loader_regs: int = 40

    def as_dict(self) -> dict:
        return asdict(self)


TILES = PingPongTiles()
CONSUMER_WARPS = gl.constexpr(4)  # one warpgroup: the unit wgmma runs on


@gluon.jit
def _tile_offsets(tile, num_pid_m, num_pid_n, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """Grouped tile order: GROUP_M row tiles share each column of B while it is in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    return (first_m + (tile % in_group) % rows) * BM, ((tile % in_group) // rows) * BN


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
            BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Issue the TMA copies of this program's tiles in order: tile j into ring j % 2."""
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    num_pid_m, num_pid_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    my_tiles = (num_pid_m * num_pid_n - pid + nprog - 1) // nprog
    k_steps = gl.cdiv(K, BK)
    for j in range(my_tiles):
        off_m, off_n = _tile_offsets(pid + j * nprog, num_pid_m, num_pid_n, BM, BN, GROUP_M)
        ring = (j % 2) * STAGES
        first = (j // 2) * k_steps  # this ring's step count before tile j
        for kk in range(k_steps):
            step = first + kk
            s = ring + step % STAGES
            # Parity 1 on a fresh barrier passes at once: the first lap of the ring is free.
            mbarrier.wait(empty.index(s), (step // STAGES) & 1 ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_n, kk * BK], ready.index(s), b_bufs.index(s))


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, CONSUMER: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Tiles CONSUMER, CONSUMER + 2, ... of this program: wgmma from ring CONSUMER, then the epilogue."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    num_pid_m, num_pid_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    my_tiles = (num_pid_m * num_pid_n - pid + nprog - 1) // nprog
    k_steps = gl.cdiv(K, BK)
    ring = CONSUMER * STAGES
    for j in range(CONSUMER, my_tiles, 2):
        off_m, off_n = _tile_offsets(pid + j * nprog, num_pid_m, num_pid_n, BM, BN, GROUP_M)
        first = (j // 2) * k_steps
        acc = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
        for kk in range(k_steps):
            step = first + kk
            s = ring + step % STAGES
            mbarrier.wait(ready.index(s), (step // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=kk > 0,
                                is_async=True)
            # At most one wgmma in flight: the previous step's is done, so its stage goes back.
            acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_bufs.index(s), b_bufs.index(s)))
            mbarrier.arrive(empty.index(ring + (step + STAGES - 1) % STAGES), pred=kk > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(ring + (first + k_steps - 1) % STAGES))
        c = gl.convert_layout(acc.to(gl.bfloat16), out_layout)
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
        cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
        ptrs = c_ptr + gl.expand_dims(rows, 1).to(gl.int64) * stride_cm + gl.expand_dims(cols, 0)
        gl.store(ptrs, c, mask=(gl.expand_dims(rows, 1) < M) & (gl.expand_dims(cols, 0) < N))


@gluon.jit
def pingpong_gemm_kernel(a_desc, b_desc, c_ptr, stride_cm, M, N, K, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """C = A @ B^T for A [M, K] and B [N, K] by TMA descriptors ([BM, BK] and [BN, BK] boxes), C by
    pointer; one program per SM over the grouped tile order. Launch with num_warps=4 (consumer 0)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [2 * STAGES, BN, BK], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, 0, BM, BN, BK, STAGES, GROUP_M)),
        (_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, 1, BM, BN, BK, STAGES, GROUP_M)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BM, BN, BK, STAGES, GROUP_M)),
    ], [CONSUMER_WARPS, 1], [CONSUMER_REGS, LOADER_REGS])


def _shared_layout(block: list[int]):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def launcher(a_MK: torch.Tensor, b_NK: torch.Tensor, c_MN: torch.Tensor, tiles: PingPongTiles = TILES):
    """A no-argument launcher of C = A @ B^T into c_MN (bf16, GPU); descriptors are built once, here."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if not (a_MK.dtype == b_NK.dtype == c_MN.dtype == torch.bfloat16):
        raise TypeError(f"the ping-pong GEMM is bf16 only, got {a_MK.dtype}, {b_NK.dtype}, {c_MN.dtype}")
    (M, K), N = a_MK.shape, b_NK.shape[0]
    a_box, b_box = [tiles.block_m, tiles.block_k], [tiles.block_n, tiles.block_k]
    a_desc = TensorDescriptor.from_tensor(a_MK, a_box, _shared_layout(a_box))
    b_desc = TensorDescriptor.from_tensor(b_NK, b_box, _shared_layout(b_box))
    n_tiles = -(-M // tiles.block_m) * -(-N // tiles.block_n)
    grid = (min(target.sm_count(), n_tiles),)
    return lambda: pingpong_gemm_kernel[grid](
        a_desc, b_desc, c_MN, c_MN.stride(0), M, N, K, STAGES=tiles.stages, GROUP_M=tiles.group_m,
        CONSUMER_REGS=tiles.consumer_regs, LOADER_REGS=tiles.loader_regs, num_warps=CONSUMER_WARPS,
    )


def measure(n: int, reps: int, *, timeout: float = 300) -> dict:
    """Relative L2 against torch.matmul and FLOP/s of the kernel on bf16 n x n x n (2n^3 FLOPs), in a
    child process: a kernel that hangs or faults cannot take the caller with it. The inputs are the
    bench's (seed 0); raises RuntimeError or subprocess.TimeoutExpired on failure."""
    from .sm90 import in_child_process

    return in_child_process("autotune.pingpong:_measure_here", n, reps, timeout=timeout)


def _measure_here(n: int, reps: int) -> dict:
    from .timing import time_fn

    gen = torch.Generator(device="cuda").manual_seed(0)
    a_MK = torch.randn(n, n, generator=gen, device="cuda").to(torch.bfloat16)
    b_NK = torch.randn(n, n, generator=gen, device="cuda").to(torch.bfloat16)
    c_ref = torch.matmul(a_MK, b_NK.T)
    c_MN = torch.empty_like(c_ref)
    launch = launcher(a_MK, b_NK, c_MN)
    launch()
    rel = float((c_MN.float() - c_ref.float()).norm() / c_ref.float().norm())
    return {"rel_l2": rel, "flops_per_s": 2 * n**3 / (time_fn(launch, reps=reps).median_ms * 1e-3)}


def compile_report(tiles: PingPongTiles = TILES) -> dict:
    """Compile the kernel for sm_90 here, GPU or not (a child process: the interpreter must be off);
    shared memory, registers and spills, and the instructions that show it is what it claims."""
    from .sm90 import in_child_process

    return in_child_process("autotune.pingpong:_compile_here", tiles.as_dict())


def _compile_here(tiles: dict) -> dict:
    from .sm90 import _resource_usage, compile_gluon_sm90, gluon_descriptor_type

    t = PingPongTiles(**tiles)
    signature = {
        "a_desc": gluon_descriptor_type("bfloat16", [t.block_m, t.block_k]),
        "b_desc": gluon_descriptor_type("bfloat16", [t.block_n, t.block_k]),
        "c_ptr": "*bf16", "stride_cm": "i32", "M": "i32", "N": "i32", "K": "i32",
        "STAGES": "constexpr", "GROUP_M": "constexpr", "CONSUMER_REGS": "constexpr", "LOADER_REGS": "constexpr",
    }
    constexprs = {"STAGES": t.stages, "GROUP_M": t.group_m, "CONSUMER_REGS": t.consumer_regs,
                  "LOADER_REGS": t.loader_regs}
    # What the JIT would assume at launch for 16-aligned pointers and strides.
    attrs = {(2,): [["tt.divisibility", 16]], (3,): [["tt.divisibility", 16]]}
    compiled = compile_gluon_sm90(pingpong_gemm_kernel, signature, constexprs, attrs, num_warps=CONSUMER_WARPS)
    ptx = compiled.asm["ptx"]
    registers, spill = _resource_usage(compiled.asm["cubin"])
    return {
        "shared_bytes": compiled.metadata.shared,
        "smem_limit_bytes": target.HOPPER_SMEM_BYTES,
        "warps": compiled.metadata.num_warps,
        "registers": registers,
        "spill_bytes": spill,
        "wgmma": ptx.count("wgmma.mma_async"),
        "tma_loads": ptx.count("cp.async.bulk.tensor"),
        "setmaxnreg": sorted({line.strip().rstrip(";") for line in ptx.splitlines() if "setmaxnreg" in line}),
    }
