"""The operation's contract and its fp32 reference: the spec every kernel is checked against.

    out[t] = sum_j  w[t, j] * w2[e] @ ( silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]) ),  e = ids[t, j]

Legend (token order unless said otherwise):
    x_TH     hidden_states [T, H]           bf16, fp16 or fp32
    w13_EnH  gate rows 0..I-1 then up rows I..2I-1 of each expert, [E, 2I, H]
    w2_EHI   down projection [E, H, I]
    w_TK     router weights [T, k], fp32 or bf16, already normalised by the caller
    ids_TK   expert ids [T, k], int32 or int64; an id outside [0, E) (-1 = not on this device) adds nothing

This file is the spec: it is never edited to make a kernel pass.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@contextlib.contextmanager
def _exact_fp32():
    """fp32 matmuls in full precision: TF32 would make the reference the least accurate party."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def moe_reference(
    x_TH: torch.Tensor,
    w13_EnH: torch.Tensor,
    w2_EHI: torch.Tensor,
    w_TK: torch.Tensor,
    ids_TK: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The routed-experts op computed expert by expert in `dtype` (fp32 by default), in token order.

    Inputs are used as given (already rounded to their storage dtype); every product and sum runs in
    `dtype`. Returns [T, H] in `dtype`. Synchronises the device (it looks up each expert's tokens).
    """
    T, H = x_TH.shape
    E, two_i, _ = w13_EnH.shape
    I = two_i // 2  # noqa: E741 - the model's name for the intermediate size
    out_TH = torch.zeros(T, H, dtype=dtype, device=x_TH.device)
    x = x_TH.to(dtype)
    with _exact_fp32():
        for e in range(E):
            tok, slot = torch.nonzero(ids_TK == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            gate_up = x[tok] @ w13_EnH[e].to(dtype).T
            h = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]
            y = (h @ w2_EHI[e].to(dtype).T) * w_TK[tok, slot].to(dtype)[:, None]
            out_TH.index_add_(0, tok, y)
    return out_TH


@dataclass(frozen=True)
class Tolerance:
    """The bf16 correctness bar of REFERENCE.md; a correct bf16 pipeline lands near 4e-3 global."""

    global_rel_l2: float = 8e-3
    token_rel_l2: float = 1.5e-2
    rms_ratio: float = 0.02


BAR = Tolerance()


@dataclass(frozen=True)
class ErrorStats:
    finite: bool
    global_rel_l2: float
    worst_token_rel_l2: float
    rms_ratio: float  # |rms(out) / rms(ref) - 1|

    def failures(self, bar: Tolerance = BAR) -> list[str]:
        """What breaks the bar, in words; empty when the output passes."""
        bad = []
        if not self.finite:
            bad.append("non-finite values in the output")
        if not self.global_rel_l2 <= bar.global_rel_l2:
            bad.append(f"global relative L2 {self.global_rel_l2:.3e} > {bar.global_rel_l2:.1e}")
        if not self.worst_token_rel_l2 <= bar.token_rel_l2:
            bad.append(f"worst token relative L2 {self.worst_token_rel_l2:.3e} > {bar.token_rel_l2:.1e}")
        if not self.rms_ratio <= bar.rms_ratio:
            bad.append(f"output RMS off by {self.rms_ratio:.2%} > {bar.rms_ratio:.0%}")
        return bad


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over the whole tensor, in fp32: a GEMM's result against torch.matmul's
    (NaN where `out` holds one, so `not rel <= bar` rejects it)."""
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def error_stats(out_TH: torch.Tensor, ref_TH: torch.Tensor) -> ErrorStats:
    """Relative errors of `out_TH` against the reference, in float64.

    A token whose reference row is zero (all its ids invalid) is measured against the mean row norm,
    so an exact zero passes and anything else is measured on the output's own scale.
    """
    out = out_TH.double()
    ref = ref_TH.double()
    if ref.numel() == 0:
        return ErrorStats(bool(torch.isfinite(out).all()), 0.0, 0.0, 0.0)
    diff = out - ref
    ref_norm = ref.norm()
    tiny = torch.finfo(torch.float64).tiny
    global_rel = float(diff.norm() / ref_norm.clamp_min(tiny))
    row_ref = ref.norm(dim=1)
    row_floor = (ref_norm / ref.shape[0] ** 0.5).clamp_min(tiny)
    token_rel = diff.norm(dim=1) / torch.maximum(row_ref, row_floor)
    rms_out = out.pow(2).mean().sqrt()
    rms_ref = ref.pow(2).mean().sqrt().clamp_min(tiny)
    return ErrorStats(
        finite=bool(torch.isfinite(out).all()),
        global_rel_l2=global_rel,
        worst_token_rel_l2=float(token_rel.max()),
        rms_ratio=float((rms_out / rms_ref - 1).abs()),
    )
