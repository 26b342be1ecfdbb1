"""A case's FLOPs as plain dense GEMMs, timed the way `moe-tune bench` times the case: what %SOL a
kernel doing no MoE work at all reaches on this card, beside the emitted module.

    python tools/dense_bound.py 8192,16384,32768 [MODULE.py]

For each T the case's T*k routed rows (the tokens, each repeated k times) go through ONE expert's
weights as two dense GEMMs: rows [T*k, H] @ w13[0]^T -> [T*k, 2I], then a fixed [T*k, I] activation
@ w2[0]^T -> [T*k, H]. That is exactly the case's 6*T*k*H*I FLOPs with none of the MoE work: no
gather, no padded rows, no SwiGLU, no combine, and weights that stay in L2. Each GEMM the bench's
matrix ceiling is chosen from (torch.matmul, our persistent TMA GEMM, our Gluon GEMM) runs the
chain; ours count only if GEMM1's output matches torch.matmul's within GEMM_REL_L2_BAR. Every party,
the emitted module on the case's own inputs included, is timed as bench times a case: right after
the case's fp32 reference has run, by bench's CUDA-graph timing with its reps and warm-up, against
the floor from ceilings measured in this process; each party's kernels are named (which cuBLAS
kernel torch.matmul chose) with their profiled time per call. Then all parties again in ROUNDS
(default 2; 0 skips) interleaved rounds, each timing after the tuner's settle, with the SM clock at
each one's end: the parties compared in one capped state rather than in their turn's. At a
compute-bound T, the best chain's %SOL is what a kernel built on that GEMM could reach at most
(NOTES 75). JSON=path writes the rows.
"""

import functools
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from autotune import bench, ceilings, emit, render, target, wsgemm
from autotune.reference import moe_reference, rel_l2
from autotune.timing import SETTLE_MS, SmClockSampler, kernel_breakdown, time_fn, turns
from autotune.workloads import SEED16_SHAPE, experts_touched, make_tokens, make_weights, suite


def _torch_gemm(a_MK, b_NK, c_MN):
    return lambda: torch.matmul(a_MK, b_NK.T, out=c_MN)


GEMMS = {
    "torch.matmul": _torch_gemm,
    "triton TMA GEMM": lambda a, b, c: ceilings._gemm_launcher(a, b, c, ceilings.GPU_TILES),
    "gluon GEMM": wsgemm.launcher,
}


def gemm1_and_activation(rows_RH, w1_NH, inter: int):
    """torch.matmul's GEMM1 of the rows [R, 2I] (what each chain's GEMM1 is checked against) and its
    SwiGLU [R, I], the fixed input of every chain's GEMM2."""
    ref_RN = rows_RH @ w1_NH.T
    act_RI = (torch.nn.functional.silu(ref_RN[:, :inter].float()) * ref_RN[:, inter:2 * inter].float())
    return ref_RN, act_RI.to(rows_RH.dtype)


def dense_chain(rows_RH, w1_NH, act_RI, w2_HI, gemm):
    """A no-argument call of the two GEMMs (`gemm(a_MK, b_NK, c_MN)` gives a launcher of C = A @ B^T)
    and its GEMM1 output: rows @ w1^T into g [R, N], then the fixed activation @ w2^T into y [R, H]."""
    R = rows_RH.shape[0]
    g_RN = torch.empty(R, w1_NH.shape[0], dtype=rows_RH.dtype, device=rows_RH.device)
    y_RH = torch.empty(R, w2_HI.shape[0], dtype=rows_RH.dtype, device=rows_RH.device)
    first, second = gemm(rows_RH, w1_NH, g_RN), gemm(act_RI, w2_HI, y_RH)

    def call():
        first()
        second()
    return call, g_RN


def _timed(fn, heat, floor: float, flops: int) -> dict:
    """bench's timing of `fn` right after `heat()` (the case's reference, as bench runs it first)."""
    heat()
    with SmClockSampler() as clock:
        ms = bench._time(fn, graph=True, reps=20, warmup=3).median_ms
    return {"ms": ms, "pct_sol": 100 * floor / ms, "tflops": flops / ms / 1e9, "sm_clock_mhz": clock.summary(),
            "board_power_w": clock.power_summary()}


def _settled(calls: dict, rounds: int) -> dict:
    """Each call timed after the tuner's settle, in `rounds` interleaved rounds: every party in the
    capped state, none favoured by its turn. Per party: the rounds' medians, the SM clock at the end of
    each round and the board's median power in each."""
    res = {name: {"settled_ms": [], "settled_sm_clock_last": [], "settled_power_w": []} for name in calls}
    for r in range(rounds):
        for name in turns(list(calls), r):
            with SmClockSampler() as clock:
                res[name]["settled_ms"].append(time_fn(calls[name], reps=10, settle_ms=SETTLE_MS).median_ms)
            res[name]["settled_sm_clock_last"].append((clock.summary() or {}).get("last"))
            res[name]["settled_power_w"].append((clock.power_summary() or {}).get("median"))
    return res


def _chains(case, w13, w2, x) -> tuple[dict, dict]:
    """The dense chain of each GEMM in GEMMS on the case's rows, its GEMM1 checked against
    torch.matmul's: ({name: call}, {name: why it is out}). One activation serves every chain."""
    rows = x.repeat_interleave(case.shape.k, dim=0)
    ref, act = gemm1_and_activation(rows, w13[0], case.shape.I)
    calls, failed = {}, {}
    for name, gemm in GEMMS.items():
        try:
            call, g = dense_chain(rows, w13[0], act, w2[0], gemm)
            call()
            rel = rel_l2(g, ref)
            if rel <= ceilings.GEMM_REL_L2_BAR:
                calls[name] = call
            else:
                failed[name] = f"relative L2 {rel:.2e} against torch.matmul"
        except Exception as exc:  # noqa: BLE001 - one GEMM failing leaves the others' figures
            failed[name] = f"{type(exc).__name__}: {exc}"[:300]
    return calls, failed


def _case_row(case, module, w13, w2, ceil, rounds: int) -> dict:
    """The module and each dense chain on `case`: timed as bench times it, their kernels named, then
    (rounds > 0) in interleaved settled rounds; printed and returned."""
    x, w, ids = make_tokens(case, target.device())
    floor = ceilings.floor_ms(case, experts_touched(ids, case.shape.E), ceil)
    heat = functools.partial(moe_reference, x, w13, w2, w, ids)  # bench runs it before timing ours
    calls, failed = _chains(case, w13, w2, x)
    module_weights = render.weights_for(module, w13, w2)  # a k64 module's own copy; the chains take w13, w2
    calls = {"module": functools.partial(module.fused_experts, x, *module_weights, w, ids), **calls}
    parties = {}
    for name, call in calls.items():
        parties[name] = _timed(call, heat, floor, case.flops)
        parties[name]["kernels"] = (kernel_breakdown(call, calls=2) or [])[:3]
    for name, res in (_settled(calls, rounds) if rounds else {}).items():
        parties[name].update(res, settled_median_ms=statistics.median(res["settled_ms"]))
    for name, p in parties.items():
        kernels = ", ".join(f"{q['name'][:90]} {q['us']:.0f} us" for q in p["kernels"])
        last = (p["sm_clock_mhz"] or {}).get("last")
        watts = (p["board_power_w"] or {}).get("median")
        settled = (f" | settled {p['settled_median_ms']:.4f} ms, SM at the rounds' ends "
                   f"{p['settled_sm_clock_last']} MHz, {p['settled_power_w']} W" if rounds else "")
        print(f"T={case.T:<6} floor {floor:.4f} ms  {name:16s} {p['ms']:.4f} ms  {p['pct_sol']:5.1f}% SOL  "
              f"{p['tflops']:.0f} TFLOP/s  SM at the end {last} MHz, {watts} W{settled}\n"
              f"{'':8}kernels: {kernels}", flush=True)
    for name, why in failed.items():
        print(f"T={case.T:<6} {name}: {why}", flush=True)
        parties[name] = {"failed": why}
    ceilings.free_gpu_memory()
    return {"T": case.T, "floor_ms": floor, "parties": parties}


def main(argv: list[str]) -> int:
    if argv[:1] in ([], ["-h"], ["--help"]):
        print(__doc__)
        return 0 if argv else 2
    if not target.has_gpu():
        print("tools/dense_bound.py times on the GPU; there is none here")
        return 1
    shape = SEED16_SHAPE
    module = render.load_path(Path(argv[1]) if len(argv) > 1 else emit.this_machine_module_path(shape.key))
    ceil = ceilings.measure_ceilings()
    print(f"ceilings: {ceil.read_bytes_per_s / 1e12:.2f} TB/s, {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s "
          f"(torch {ceil.torch_matmul_flops_per_s / 1e12:.0f}); sustained "
          f"{(ceil.sustained_matmul_flops_per_s or 0) / 1e12:.0f}")
    w13, w2 = make_weights(shape, target.device())
    rounds = int(os.environ.get("ROUNDS", 2))
    out = [_case_row(suite(shape, [int(t)])[0], module, w13, w2, ceil, rounds) for t in argv[0].split(",")]
    if os.environ.get("JSON"):
        Path(os.environ["JSON"]).write_text(json.dumps({"ceilings": ceil.as_dict(), "cases": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
