"""Can the two warpgroups of a 128-row Gluon tile each take a weight tile of their own? A dense probe.

    python tools/twin_gemm.py                # on a Hopper GPU: verify, then time every form
    python tools/twin_gemm.py --compile      # anywhere: each form compiled for sm_90, its resources

Why (NOTES 99): padding each expert's rows to 64 instead of 128 and packing two 64-row blocks into
one 128-row tile would cut seed16's computed rows at T=8192 from 1.25 to 1.13 per routed row with
every tile the same length. Where a tile's halves belong to two experts, each warpgroup multiplies
its half by its own expert's weight tile: two weight tiles a stage instead of one. Whether that
costs more than the rows it saves depends on the shared-memory traffic of the second tile (NOTES
11: a Hopper SM feeds its tensor cores from ~128 B/clk of shared memory), which this probe measures
on a dense C = A @ B^T, before any grouped kernel is built.

Forms, all C = A @ B^T in bf16, persistent, one TMA loader warp running ahead over one ring:
- `coop`: autotune/wsgemm.py's kernel, one 8-warp consumer on the [128, BN] tile, one B box a stage;
- `twin`: two 4-warp consumers, each on its 64 rows of the tile, both reading the stage's one B box;
- `twin own-B`: the same with two B boxes a stage, one per consumer (both of the same columns here,
  so the product is still A @ B^T: the traffic of a mixed tile, the result of a plain one).
Each form is checked against torch.matmul (relative L2 within ceilings.GEMM_REL_L2_BAR) before it is
timed; then ROUNDS (default 3) interleaved rounds whose order rotates, each after the tuner's settle.
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from autotune import ceilings, sm90, target, wsgemm
from autotune.reference import rel_l2
from autotune.timing import SETTLE_MS, time_fn, turns
from autotune.wsgemm import consume_tile, ring_barriers, store_tile, tile_offsets, walk

HALF_M = 64  # one warpgroup's rows: wgmma's M
BLOCK_K = 64
LOADER_REGS = 40
CONSUMER_REGS = 232


class Form(NamedTuple):
    name: str
    block_n: int
    stages: int
    b_copies: int  # 0: the cooperative wsgemm kernel; 1: twin consumers on one B box; 2: a box each


FORMS = (
    Form("coop 128x256", 256, 3, 0),
    Form("twin 128x256", 256, 3, 1),
    Form("twin own-B 128x256", 256, 2, 2),
    Form("coop 128x128", 128, 4, 0),
    Form("twin 128x128", 128, 4, 1),
    Form("twin own-B 128x128", 128, 4, 2),
)
SHAPES = ((65536, 4096, 4096), (65536, 4096, 2048), (8192, 8192, 8192))  # (M, N, K): seed16's GEMM1 and
# GEMM2 at T=8192 without the grouping, and the bench's ceiling cube


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BN: gl.constexpr, BK: gl.constexpr,
            STAGES: gl.constexpr, GROUP_M: gl.constexpr, B_COPIES: gl.constexpr):
    """Per stage: the tile's two 64-row A boxes, and its B box once or twice (one per consumer)."""
    HM: gl.constexpr = a_desc.block_type.shape[0]
    pid, nprog, num_pid_m, num_pid_n, k_steps, my_tiles = walk(M, N, K, 2 * HM, BN, BK)
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + B_COPIES * b_desc.block_type.nbytes
    for j in range(my_tiles):
        off_m, off_n = tile_offsets(pid + j * nprog, num_pid_m, num_pid_n, 2 * HM, BN, GROUP_M)
        for kk in range(k_steps):
            step = j * k_steps + kk
            s = step % STAGES
            mbarrier.wait(empty.index(s), (step // STAGES) & 1 ^ 1)  # a fresh barrier: the first lap is free
            mbarrier.expect(ready.index(s), nbytes)
            for h in gl.static_range(2):
                tma.async_copy_global_to_shared(a_desc, [off_m + h * HM, kk * BK], ready.index(s),
                                                a_bufs.index(2 * s + h))
            for c in gl.static_range(B_COPIES):
                tma.async_copy_global_to_shared(b_desc, [off_n, kk * BK], ready.index(s),
                                                b_bufs.index(B_COPIES * s + c))


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr, B_COPIES: gl.constexpr, HALF: gl.constexpr):
    """Rows HALF * 64 .. + 64 of each tile, on B box HALF % B_COPIES of each stage; both consumers
    release a stage (the empty barriers count two arrivals)."""
    HM: gl.constexpr = c_desc.block_type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    pid, nprog, num_pid_m, num_pid_n, k_steps, my_tiles = walk(M, N, K, 2 * HM, BN, BK)
    for j in range(my_tiles):
        off_m, off_n = tile_offsets(pid + j * nprog, num_pid_m, num_pid_n, 2 * HM, BN, GROUP_M)
        acc = gl.zeros([HM, BN], gl.float32, layout=acc_layout)
        acc = consume_tile(a_bufs, b_bufs, ready, empty, acc, j, k_steps, STAGES, 2, HALF, B_COPIES,
                           HALF % B_COPIES)
        store_tile(acc, c_desc, c_smem, off_m + HALF * HM, off_n)
    tma.store_wait(0)


@gluon.jit
def twin_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                     B_COPIES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """C = A @ B^T by [64, BK] A boxes, [BN, BK] B boxes and [64, BN] C boxes; one program per SM over
    the grouped order of 128-row tiles. Launch with 4 warps (the first consumer); the second consumer
    and the loader are worker partitions."""
    HM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [B_COPIES * STAGES, BN, BK], b_desc.layout)
    c0 = gl.allocate_shared_memory(c_desc.dtype, [HM, BN], c_desc.layout)
    c1 = gl.allocate_shared_memory(c_desc.dtype, [HM, BN], c_desc.layout)
    ready, empty = ring_barriers(STAGES, 2)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, c_desc, c0, M, N, K, BN, BK, STAGES, GROUP_M, B_COPIES, 0)),
        (_consumer, (a_bufs, b_bufs, ready, empty, c_desc, c1, M, N, K, BN, BK, STAGES, GROUP_M, B_COPIES, 1)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BN, BK, STAGES, GROUP_M, B_COPIES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _constexprs(form: Form) -> dict:
    return {"STAGES": form.stages, "GROUP_M": 8, "B_COPIES": form.b_copies, "CONSUMER_REGS": CONSUMER_REGS,
            "LOADER_REGS": LOADER_REGS}


def launcher(form: Form, a_MK: torch.Tensor, b_NK: torch.Tensor, c_MN: torch.Tensor):
    """A no-argument launcher of `form`'s C = A @ B^T into c_MN (bf16, on a Hopper GPU)."""
    if not form.b_copies:
        tiles = wsgemm.GluonTiles(block_n=form.block_n, stages=form.stages)
        return wsgemm.launcher(a_MK, b_NK, c_MN, tiles)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    (M, K), N = a_MK.shape, b_NK.shape[0]
    boxes = ([HALF_M, BLOCK_K], [form.block_n, BLOCK_K], [HALF_M, form.block_n])
    a_desc, b_desc, c_desc = (TensorDescriptor.from_tensor(t, box, sm90.gluon_smem_layout("bfloat16", box))
                              for t, box in zip((a_MK, b_NK, c_MN), boxes, strict=True))
    grid = (min(target.sm_count(), -(-M // (2 * HALF_M)) * -(-N // form.block_n)),)
    return lambda: twin_gemm_kernel[grid](a_desc, b_desc, c_desc, M, N, K, **_constexprs(form), num_warps=4)


def compile_report(form: Form) -> dict:
    """`form`'s twin kernel compiled for sm_90 here, GPU or not (a child process, the interpreter off)."""
    return sm90.in_child_process("tools.twin_gemm:_compile_here", form.block_n, form.stages, form.b_copies)


def _compile_here(block_n: int, stages: int, b_copies: int) -> dict:
    signature = {
        "a_desc": sm90.gluon_descriptor_type("bfloat16", [HALF_M, BLOCK_K]),
        "b_desc": sm90.gluon_descriptor_type("bfloat16", [block_n, BLOCK_K]),
        "c_desc": sm90.gluon_descriptor_type("bfloat16", [HALF_M, block_n]),
        "M": "i32", "N": "i32", "K": "i32",
        **dict.fromkeys(("STAGES", "GROUP_M", "B_COPIES", "CONSUMER_REGS", "LOADER_REGS"), "constexpr"),
    }
    constexprs = _constexprs(Form("", block_n, stages, b_copies))
    compiled = sm90.compile_gluon_sm90(twin_gemm_kernel, signature, constexprs, {}, num_warps=4)
    ptx = compiled.asm["ptx"]
    registers, spill = sm90.resource_usage(compiled.asm["cubin"])
    return {"shared_bytes": compiled.metadata.shared, "registers": registers, "spill_bytes": spill,
            "wgmma_shapes": list(sm90.wgmma_shapes(ptx)), "tma_loads": ptx.count("cp.async.bulk.tensor"),
            "setmaxnreg": sorted({line.strip().rstrip(";") for line in ptx.splitlines() if "setmaxnreg" in line})}


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if argv[:1] == ["--compile"]:
        for form in FORMS:
            if form.b_copies:
                print(form.name, compile_report(form))
        return 0
    if not target.has_gpu():
        print("tools/twin_gemm.py times on the GPU; there is none here (--compile runs anywhere)")
        return 1
    rounds = int(os.environ.get("ROUNDS", 3))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for M, N, K in SHAPES:
        a = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
        b = torch.randn(N, K, generator=gen, device="cuda").to(torch.bfloat16)
        ref = torch.matmul(a, b.T)
        calls = {}
        for form in FORMS:
            c = torch.full_like(ref, float("nan"))
            call = launcher(form, a, b, c)
            call()
            rel = rel_l2(c, ref)
            if not rel <= ceilings.GEMM_REL_L2_BAR:
                print(f"{M}x{N}x{K} {form.name}: relative L2 {rel:.2e} against torch.matmul, not timed")
                continue
            calls[form.name] = call
        samples = {name: [] for name in calls}
        for r in range(rounds):
            for name in turns(list(calls), r):
                samples[name].append(time_fn(calls[name], reps=10, settle_ms=SETTLE_MS).median_ms)
        for name, s in samples.items():
            ms = statistics.median(s)
            print(f"{M}x{N}x{K} {name:20s} {ms:8.4f} ms {2 * M * N * K / ms / 1e9:6.0f} TFLOP/s  "
                  f"rounds {[round(v, 4) for v in s]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
