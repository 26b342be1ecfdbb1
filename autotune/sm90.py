"""Compile a variant's GEMM kernels for Hopper (sm_90) on any machine, GPU or not.

Uses the compiler and the ptxas/cuobjdump that ship inside the triton wheel, so a CPU-only session
can see what the H200 would run: shared memory, registers, spills, and whether the main loop is
built from wgmma with TMA or cp.async copies. The figures are the compiler's, not timings.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import render
from .space import Variant
from .workloads import Case

_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# Pointer arguments that are not activations, by name.
_INDEX_POINTERS = {"sorted_slots_ptr", "block_expert_ptr", "block_rows_ptr", "num_blocks_ptr", "walk_blocks_ptr",
                   "walk_count_ptr", "tile_counter_ptr"}
# Router weights.
_FP32_POINTERS = {"topk_weights_ptr"}


# Every compile here targets Hopper, warp size 32, whatever GPU (or none) this machine has.
SM90 = GPUTarget("cuda", 90, 32)


def _pointer_type(arg: str, dt: str) -> str:
    """The element type of pointer argument `arg` in a kernel whose activations are `dt`."""
    return "*i32" if arg in _INDEX_POINTERS else "*fp32" if arg in _FP32_POINTERS else f"*{dt}"


@dataclass(frozen=True)
class KernelReport:
    name: str
    shared_bytes: int
    registers: int | None
    spill_bytes: int | None  # local-memory bytes per thread (stack frame and spills)
    wgmma: int  # wgmma instructions in the PTX
    tma_copies: int  # cp.async.bulk.tensor in the PTX
    async_copies: int  # cp.async (non-bulk) in the PTX
    wgmma_shapes: tuple[str, ...] = ()  # the wgmma instruction shapes, e.g. "m64n256k16"

    def as_dict(self) -> dict:
        return asdict(self)


def _signature(fn, case: Case, v: Variant, which: int) -> tuple[dict, dict, dict]:
    """Argument types, constexprs and divisibility hints as the JIT would specialise them at launch."""
    dt = _TRITON_TYPES[case.shape.dtype]
    g = v.gemm(which)
    n, k = v.gemm_dims(which, case.shape)
    constexprs = {"BLOCK_M": v.block_m, "BLOCK_N": g["BLOCK_N"], "BLOCK_K": g["BLOCK_K"],
                  "GROUP_M": g["GROUP_M"], "EVEN_K": k % g["BLOCK_K"] == 0, "PDL": v.pdl}
    if "TOP_K" in fn.arg_names:
        constexprs["TOP_K"] = case.shape.k
    if "HALF_TAIL" in fn.arg_names:
        constexprs["HALF_TAIL"] = v.half_tail
    if "PAIR_TAIL" in fn.arg_names:
        constexprs["PAIR_TAIL"] = getattr(v, f"g{which}_pair_tail")
    if "SWAP_TAIL" in fn.arg_names:
        constexprs["SWAP_TAIL"] = getattr(v, f"g{which}_swap_tail")
    if "WALK" in fn.arg_names:
        # The tail walk's first launch (full-height blocks) stands for the pair.
        constexprs["WALK"] = v.tail_walk and g["persistent"]
        constexprs["WALK_M"] = v.block_m
    # A kernel gets the constexprs it declares, each of them.
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for its constexpr(s) {', '.join(missing)}")
    rows_tma = "a_desc" in fn.arg_names or "h_desc" in fn.arg_names
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg == "w_desc":
            joint = which == 1 and v.activation == "fused"
            # k-blocked weights have one more leading dimension, the block of K.
            box = ("1, 1" if v.weight_layout == "k64" else "1") + (", 2" if joint else "") \
                + f", {g['BLOCK_N']}, {g['BLOCK_K']}"
            signature[arg] = f"tensordesc<{dt}[{box}]>"
        elif arg in ("a_desc", "h_desc"):
            signature[arg] = f"tensordesc<{dt}[{v.block_m}, {g['BLOCK_K']}]>"
        elif arg in ("a_half_desc", "h_half_desc"):
            # The half-height tail tiles' row box; the rows tensor itself when rows come by pointer.
            half = v.block_m // 2 if v.half_tail else v.block_m
            signature[arg] = f"tensordesc<{dt}[{half}, {g['BLOCK_K']}]>" if rows_tma else f"*{dt}"
        elif arg in ("a_swap_desc", "h_swap_desc"):
            # A swapped tail's row box (the launcher's stand-in box where the variant swaps none).
            swap = getattr(v, f"g{which}_swap_tail") or v.block_m
            signature[arg] = f"tensordesc<{dt}[{swap}, {g['BLOCK_K']}]>" if rows_tma else f"*{dt}"
        elif arg.endswith("_ptr"):
            signature[arg] = _pointer_type(arg, dt)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "i32"
            # Strides of seed16-like shapes are multiples of 16.
            value = {"N": n, "K": k, "H": case.shape.H, "I": case.shape.I}.get(arg, 16)
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def compile_sm90(fn, signature: dict, constexprs: dict, attrs: dict | None = None, *, num_warps: int,
                 num_stages: int):
    """triton.compile of a JIT function for sm_90 (warp size 32), whatever GPU this machine has."""
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=SM90,
        options={"num_warps": num_warps, "num_stages": num_stages},
    )


def resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, local-memory bytes) from cuobjdump's resource usage, if the tool is there."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                 timeout=60, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None
    reg = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (int(reg.group(1)) if reg else None), (int(stack.group(1)) if stack else None)


def in_child_process(function: str, *args, timeout: float = 600):
    """Call `function` ("module:name", JSON arguments and result) in a child Python with the
    interpreter off; RuntimeError with its stderr if it fails, subprocess.TimeoutExpired past
    `timeout` seconds. Where TRITON_INTERPRET=1 was set before triton was imported, even triton's own
    library functions are interpreter objects, and nothing compiles in that process; and a kernel
    that hangs or poisons the CUDA context takes only the child with it."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-m", "autotune.sm90", function, json.dumps(args)],
                         capture_output=True, text=True, env=env, timeout=timeout,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if out.returncode != 0:
        raise RuntimeError(f"{function} failed in a child process:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def gluon_smem_layout(dtype: str, block: list[int]):
    """The shared-memory layout a launcher builds for a `dtype` ("bfloat16"/"float16") tile of `block`
    (NVMMASharedLayout.get_default_for): what wgmma and TMA read."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(block, {"bfloat16": gl.bfloat16, "float16": gl.float16}[dtype])


def gluon_descriptor_type(dtype: str, block: list[int]) -> str:
    """The signature type of a Gluon TMA descriptor over `dtype` in `block` boxes, with the
    shared-memory layout its launcher builds."""
    return f"tensordesc<{_TRITON_TYPES[dtype]}[{block[0]}, {block[1]}],{gluon_smem_layout(dtype, block)!r}>"


def wgmma_shapes(ptx: str) -> tuple[str, ...]:
    """The wgmma instruction shapes in `ptx`, e.g. ("m64n256k16",)."""
    return tuple(sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))))


def compile_gluon_sm90(fn, signature: dict, constexprs: dict, attrs: dict | None = None, *, num_warps: int):
    """triton.compile of a Gluon kernel for sm_90 (warp size 32), whatever GPU this machine has."""
    from triton.experimental.gluon._runtime import GluonASTSource

    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=SM90,
                          options={"num_warps": num_warps})


def _compile_gluon(fn, module, case: Case, v: Variant, which: int):
    """The warp-specialised Gluon GEMM `which` of `v` compiled for sm_90, as its launcher would launch it."""
    dt = _TRITON_TYPES[case.shape.dtype]
    g = v.gemm(which)
    constexprs = {"STAGES": g["num_stages"], "GROUP_M": g["GROUP_M"], "LOADER_REGS": module._GLUON_LOADER_REGS}
    row_box, w_box = [v.block_m, g["BLOCK_K"]], [g["BLOCK_N"], g["BLOCK_K"]]
    signature = {}
    # An output written by TMA store is a descriptor of [BLOCK_M, BLOCK_N] boxes, not a pointer.
    for flag, arg, on in (("TMA_STORE", "out_ptr", v.g1_tma_store), ("SORTED_OUT", "y_ptr", v.g2_sorted_out)):
        if flag in fn.arg_names:
            constexprs[flag] = on
            if on:
                signature[arg] = gluon_descriptor_type(case.shape.dtype, [v.block_m, g["BLOCK_N"]])
    if "HALF_TAIL" in fn.arg_names:
        constexprs["HALF_TAIL"] = v.half_tail
    if "DYNAMIC" in fn.arg_names:
        constexprs["DYNAMIC"] = v.dynamic_walk
    if "w_half_desc" in fn.arg_names:  # GEMM1's half tails: gate and up in half-width boxes
        signature["w_half_desc"] = gluon_descriptor_type(case.shape.dtype, [g["BLOCK_N"] // 2, g["BLOCK_K"]])
    if "PAIR_TAIL" in fn.arg_names:  # GEMM1's pair tiles: a half tail's rows in half-height boxes
        constexprs["PAIR_TAIL"] = v.g1_pair_tail
        signature["a_half_desc"] = gluon_descriptor_type(case.shape.dtype, [v.block_m // 2, g["BLOCK_K"]])
    if fn.__name__ == "_gemm1_gluon_gather_kernel":  # rows gathered by pointer, weights by TMA
        constexprs.update(TOP_K=case.shape.k, A_LAYOUT=gluon_smem_layout(case.shape.dtype, row_box),
                          BLOCK_M=v.block_m, LOADER_WARPS=module._GATHER_LOADER_WARPS,
                          LOADER_REGS=module._GATHER_LOADER_REGS)
        signature["w_desc"] = gluon_descriptor_type(case.shape.dtype, w_box)
    else:
        rows_desc, w_desc = fn.arg_names[:2]
        signature[rows_desc] = gluon_descriptor_type(case.shape.dtype, row_box)
        signature[w_desc] = gluon_descriptor_type(case.shape.dtype, w_box)
    for arg in fn.arg_names:
        signature.setdefault(arg, "constexpr" if arg in constexprs else _pointer_type(arg, dt)
                             if arg.endswith("_ptr") else "i32")
    signature = {arg: signature[arg] for arg in fn.arg_names}
    # What the JIT would assume at launch: 16-aligned pointers, and integers it sees divisible by 16.
    s = case.shape
    n, k = v.gemm_dims(which, s)
    ints = {"N": n, "K": k, "stride_xm": s.H, "stride_om": s.I, "stride_ym": s.H}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
             if arg.endswith("_ptr") or ints.get(arg, 1) % 16 == 0}
    return compile_gluon_sm90(fn, signature, constexprs, attrs, num_warps=g["num_warps"])


def gemm_reports(v: Variant, case: Case) -> list[KernelReport]:
    """Compile GEMM1 and GEMM2 of `v` for sm_90 as they would launch on `case`."""
    return [KernelReport(**r) for r in in_child_process("autotune.sm90:_compile_here", v.as_dict(), case.as_dict())]


def compile_triton(fn, case: Case, v: Variant, which: int):
    """GEMM `which`'s triton kernel `fn` of variant `v` compiled for sm_90 as it would launch on `case`."""
    g = v.gemm(which)
    return compile_sm90(fn, *_signature(fn, case, v, which), num_warps=g["num_warps"], num_stages=g["num_stages"])


def _compile_here(v: dict, case: dict) -> list[dict]:
    v, case = Variant.from_dict(v), Case.from_dict(case)
    module = render.load_source(render.render_variant(v))
    kernels = (
        (1, (module._gemm1_gluon_gather_kernel if v.dispatch == "fused" else module._gemm1_gluon_kernel) if v.g1_gluon
         else module._GEMM1[v.triton_form(1)]),
        (2, module._gemm2_gluon_kernel if v.g2_gluon else module._GEMM2[v.triton_form(2)]),
    )
    reports = []
    for which, fn in kernels:
        if getattr(v, f"g{which}_gluon"):
            compiled = _compile_gluon(fn, module, case, v, which)
        else:
            compiled = compile_triton(fn, case, v, which)
        ptx = compiled.asm["ptx"]
        registers, spill = resource_usage(compiled.asm["cubin"])
        reports.append(KernelReport(
            name=fn.__name__, shared_bytes=compiled.metadata.shared, registers=registers, spill_bytes=spill,
            wgmma=ptx.count("wgmma.mma_async"), tma_copies=ptx.count("cp.async.bulk.tensor"),
            async_copies=len(re.findall(r"cp\.async\.c[ag]", ptx)),
            wgmma_shapes=wgmma_shapes(ptx),
        ).as_dict())
    return reports


def dispatch_kernels_compiled(v: Variant) -> list[str]:
    """Compile the dispatch kernels of `v`'s module for sm_90, with every optional map they can write
    switched on (the interpreter runs these kernels, but it does not check what only the compiler
    rejects); the names of the kernels compiled."""
    return in_child_process("autotune.sm90:_compile_dispatch_here", v.as_dict())


def _compile_dispatch_here(v: dict) -> list[str]:
    module = render.load_source(render.render_variant(Variant.from_dict(v)))
    constexprs = {"CHUNK": module._DISPATCH_CHUNK, "E_POW2": 256, "BLOCK_M": v["block_m"],
                  "MAP_BLOCKS": module._MAP_BLOCKS, "PDL": True, "SPANS": True, "WALK_LISTS": True,
                  "INVERSE": True, "HOT": 1}
    names = []
    for name in ("_dispatch_single_kernel", "_dispatch_place_kernel"):
        fn = getattr(module, name)
        given = {p.name: constexprs[p.name] for p in fn.params if p.is_constexpr}
        signature = {arg: "constexpr" if arg in given else "*i32" if arg.endswith("_ptr") else "i32"
                     for arg in fn.arg_names}
        compile_sm90(fn, signature, given, num_warps=4, num_stages=1)
        names.append(name)
    return names


if __name__ == "__main__":
    module_name, function_name = sys.argv[1].split(":")
    result = getattr(importlib.import_module(module_name), function_name)(*json.loads(sys.argv[2]))
    print(json.dumps(result))
