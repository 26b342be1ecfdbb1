"""How fast a GEMM's weight operand streams from DRAM, by TMA box shape and K walk, with no MMA.

    python tools/weight_stream.py [BOXES]        e.g. 256x64,128x128,64x256,128x64 (the default)

A TMA GEMM reads its weight tile as [BLOCK_N, BLOCK_K] boxes walked along K: for seed16's w13 with
BLOCK_K=64 that is 128 bytes of each of BLOCK_N rows 8 KB apart, per box. Here each program reads
one [BLOCK_N, K] slab of a 4 GiB [R, 4096] bf16 matrix (far past L2) in exactly those boxes and sums
it, three ways (WALKS):
- "row-major": the matrix as the op takes it, every program walking K from 0;
- "rotated": the same, program p starting at box 7p (mod the walk's length), so that the programs
  in flight together read different columns;
- "k-blocked": the same bytes stored as [K / BLOCK_K, R, BLOCK_K] (a one-time re-layout a
  `prepare_weights` step could make), so that every box is one contiguous run of BLOCK_N * BLOCK_K
  elements.
Each is set against the read ceiling of `moe-tune bench` (a contiguous read,
`ceilings.measure_read_bandwidth`), timed the same way in the same process. Every program's sum is
checked (the matrix is all ones). If a box shape or walk streams faster than the GEMMs' [*, 64]
boxes of the row-major matrix, the TMA GEMMs of the weight-bound cases (T=1024-8192) have that much
to gain. GPU only; prints one row per box and walk.
"""

import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from autotune import ceilings, target
from autotune.timing import time_fn

DEFAULT_BOXES = ((256, 64), (128, 128), (64, 256), (128, 64))
# About as many bytes in flight per program as the GEMMs' rings hold for their weights (3-4 stages
# of a [256, 64] bf16 box).
_BYTES_IN_FLIGHT = 128 * 1024


WALKS = ("row-major", "rotated", "k-blocked")


@triton.jit
def _slab_sum_kernel(w_desc, partial_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROTATE: tl.constexpr,
                     K_BLOCKED: tl.constexpr, STAGES: tl.constexpr):
    """partial[p] = fp32 sum of rows [p * BLOCK_N, (p + 1) * BLOCK_N) of w, read in [BLOCK_N, BLOCK_K]
    boxes along K as a GEMM reads its weight tile. With ROTATE, program p starts at box 7p mod the
    walk's length (7 is odd, so neighbouring programs start far apart on a power-of-two walk). With
    K_BLOCKED, w_desc views the matrix as [K / BLOCK_K, R, BLOCK_K] and box i is [i, rows, :]."""
    pid = tl.program_id(0)
    k_steps = K // BLOCK_K
    start = 0
    if ROTATE:
        start = (pid * 7) % k_steps
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in tl.range(0, k_steps, num_stages=STAGES):
        if K_BLOCKED:
            box = w_desc.load([(i + start) % k_steps, pid * BLOCK_N, 0]).reshape(BLOCK_N, BLOCK_K)
        else:
            box = w_desc.load([pid * BLOCK_N, ((i + start) % k_steps) * BLOCK_K])
        acc += box.to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def parse_boxes(text: str) -> list[tuple[int, int]]:
    """"256x64,128x128" -> [(256, 64), (128, 128)]; ValueError naming a box that is not NxK."""
    boxes = []
    for item in text.split(","):
        n, sep, k = item.strip().partition("x")
        if not (sep and n.isdigit() and k.isdigit()):
            raise ValueError(f"box {item!r}: expected BLOCK_NxBLOCK_K, e.g. 256x64")
        boxes.append((int(n), int(k)))
    return boxes


def slab_sums(w_RK: torch.Tensor, box: tuple[int, int], walk: str):
    """(launch, partial): a launcher of `_slab_sum_kernel` over all of w_RK's storage in `box` boxes
    along `walk` (one of WALKS; "k-blocked" reads the storage as [K / BLOCK_K, R, BLOCK_K]), and the
    [R / BLOCK_N] fp32 tensor it fills with each slab's sum."""
    if walk not in WALKS:
        raise ValueError(f"walk {walk!r}: expected one of {WALKS}")
    R, K = w_RK.shape
    block_n, block_k = box
    if R % block_n or K % block_k:
        raise ValueError(f"box {block_n}x{block_k} does not tile the [{R}, {K}] matrix")
    stages = max(2, min(8, _BYTES_IN_FLIGHT // (block_n * block_k * w_RK.element_size())))
    if walk == "k-blocked":
        desc = TensorDescriptor(w_RK, [K // block_k, R, block_k], [R * block_k, block_k, 1], [1, block_n, block_k])
    else:
        desc = TensorDescriptor(w_RK, [R, K], [K, 1], [block_n, block_k])
    partial = torch.empty(R // block_n, dtype=torch.float32, device=w_RK.device)
    launch = lambda: _slab_sum_kernel[(R // block_n,)](desc, partial, K, BLOCK_N=block_n, BLOCK_K=block_k,
                                                       ROTATE=walk == "rotated", K_BLOCKED=walk == "k-blocked",
                                                       STAGES=stages, num_warps=8)
    return launch, partial


def stream(w_RK: torch.Tensor, box: tuple[int, int], walk: str, reps: int = 20) -> float:
    """Bytes/s of `_slab_sum_kernel` over all of w_RK (which must be all ones) in `box` boxes along
    `walk`; RuntimeError if a slab's sum is wrong."""
    launch, partial = slab_sums(w_RK, box, walk)
    launch()
    if not bool((partial == box[0] * w_RK.shape[1]).all()):
        raise RuntimeError(f"box {box[0]}x{box[1]}: a slab's sum is wrong (the kernel did not read what it claims)")
    return w_RK.numel() * w_RK.element_size() / (time_fn(launch, reps=reps).median_ms * 1e-3)


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not target.has_gpu():
        print("tools/weight_stream.py times on the GPU; there is none here")
        return 1
    boxes = parse_boxes(argv[0]) if argv else list(DEFAULT_BOXES)
    ceiling = ceilings.measure_read_bandwidth()
    print(f"{torch.cuda.get_device_name()}: read ceiling {ceiling / 1e12:.3f} TB/s (contiguous)")
    ceilings.free_gpu_memory()
    K = 4096  # seed16's H: w13's rows are 8 KB
    w_RK = torch.ones(4 * 2**30 // (K * 2), K, dtype=torch.bfloat16, device="cuda")
    for box in boxes:
        for walk in WALKS:
            rate = stream(w_RK, box, walk)
            print(f"box [{box[0]:3d}, {box[1]:3d}] ({box[1] * 2:3d} B a row), {walk:9s}: "
                  f"{rate / 1e12:.3f} TB/s  x{rate / ceiling:.3f} of the ceiling", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
