"""The alternatives the benchmark compares against, written as a user without our kernels would.

Each peer has the op's signature and contract (autotune/reference.py):

    peer(x_TH, w13_EnH, w2_EHI, w_TK, ids_TK) -> out_TH in x's dtype

matmuls in the input dtype, the k contributions of a token summed in fp32, and ids outside [0, E)
contributing nothing. Legend: M = T·k (token, slot) pairs; "flat order" is row-major (token, slot),
"expert order" is those pairs sorted by expert.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _expert_order(ids_TK: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the M = T·k (token, slot) pairs by expert, without a host sync.

    Returns (order_M, counts_E1, valid_M): order_M[i] is the flat index t·k + j of the i-th pair in
    expert order; counts_E1[e] pairs go to expert e, and counts_E1[E] counts the invalid ids, which
    sort last; valid_M says which sorted pairs have an id in [0, E).
    """
    ids_M = ids_TK.reshape(-1).long()
    valid_flat_M = (ids_M >= 0) & (ids_M < E)
    key_M = torch.where(valid_flat_M, ids_M, E)
    order_M = torch.argsort(key_M, stable=True)
    # index_add_ rather than bincount: bincount reads its maximum back to the host on CUDA.
    counts_E1 = torch.zeros(E + 1, dtype=torch.int64, device=ids_TK.device)
    counts_E1.index_add_(0, key_M, torch.ones_like(key_M))
    return order_M, counts_E1, valid_flat_M[order_M]


def torch_loop(x_TH, w13_EnH, w2_EHI, w_TK, ids_TK):
    """Plain PyTorch: one pass per expert that has tokens, matmuls in x's dtype, fp32 index_add back.

    Synchronises once (the per-expert counts go to the host to slice the sorted pairs).
    """
    T, H = x_TH.shape
    E, I, k = w13_EnH.shape[0], w2_EHI.shape[2], ids_TK.shape[1]  # noqa: E741
    out_TH = torch.zeros(T, H, dtype=torch.float32, device=x_TH.device)
    order_M, counts_E1, _ = _expert_order(ids_TK, E)
    w_M = w_TK.reshape(-1).float()
    start = 0
    for e, n in enumerate(counts_E1[:E].tolist()):
        if n == 0:
            continue
        flat = order_M[start:start + n]
        start += n
        tok = flat // k
        gate_up = x_TH[tok] @ w13_EnH[e].T
        h = F.silu(gate_up[:, :I]) * gate_up[:, I:]
        y = (h @ w2_EHI[e].T).float() * w_M[flat, None]
        out_TH.index_add_(0, tok, y)
    return out_TH.to(x_TH.dtype)


@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for (device, dtype) here, found by trying a tiny aligned problem.

    CUDA wants bf16 (and sm_80+); CPU kernels exist from torch 2.9 on. Shapes are 16-byte aligned so
    the probe fails only for a missing kernel, never for a bad layout.
    """
    a = torch.ones(4, 8, dtype=dtype, device=device_type)
    b = torch.ones(2, 8, 8, dtype=dtype, device=device_type)
    offs = torch.tensor([1, 4], dtype=torch.int32, device=device_type)
    try:
        torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _grouped_mm(a_MK: torch.Tensor, b_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """rows offs[e-1]:offs[e] of a times b[e]; rows past offs[-1] are left undefined, as torch's are.

    Falls back to a per-group loop (which synchronises) where torch._grouped_mm has no kernel.
    """
    if grouped_mm_supported(a_MK.device.type, a_MK.dtype):
        return torch._grouped_mm(a_MK, b_EKN, offs=offs_E)
    out_MN = torch.zeros(a_MK.shape[0], b_EKN.shape[2], dtype=a_MK.dtype, device=a_MK.device)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        out_MN[start:end] = a_MK[start:end] @ b_EKN[e]
        start = end
    return out_MN


def grouped_mm_pipeline(x_TH, w13_EnH, w2_EHI, w_TK, ids_TK):
    """Sort pairs by expert, gather rows, two torch._grouped_mm calls, SwiGLU between, fp32 index_add.

    Host-sync free where torch._grouped_mm has a kernel (CUDA bf16; CPU from torch 2.9), so it can be
    captured in a CUDA graph. Invalid ids sort past offs[-1]; their undefined rows are added into a
    spare row T that is dropped, so even NaN garbage there reaches no token.
    """
    T, H = x_TH.shape
    E, I, k = w13_EnH.shape[0], w2_EHI.shape[2], ids_TK.shape[1]  # noqa: E741
    order_M, counts_E1, valid_M = _expert_order(ids_TK, E)
    # int32 cumulative ends per expert: the offs layout torch._grouped_mm takes.
    offs_E = counts_E1[:E].cumsum(0).to(torch.int32)
    tok_M = order_M // k
    a_MH = x_TH[tok_M]
    gate_up_M2I = _grouped_mm(a_MH, w13_EnH.transpose(-2, -1), offs_E)
    h_MI = F.silu(gate_up_M2I[:, :I]) * gate_up_M2I[:, I:]
    y_MH = _grouped_mm(h_MI, w2_EHI.transpose(-2, -1), offs_E)
    scale_M = w_TK.reshape(-1)[order_M].float()
    dest_M = torch.where(valid_M, tok_M, T)
    out_T1H = torch.zeros(T + 1, H, dtype=torch.float32, device=x_TH.device)
    out_T1H.index_add_(0, dest_M, y_MH.float() * scale_M[:, None])
    return out_T1H[:T].to(x_TH.dtype)


@dataclass(frozen=True)
class Peer:
    """A peer and how to time it: `graph_safe` peers never synchronise, so a CUDA graph can hold them."""

    name: str
    label: str  # the peer in a table header
    short: str  # the same in "speed-up vs ..."
    fn: Callable
    graph_safe: bool


PEERS: tuple[Peer, ...] = (
    Peer("grouped_mm", "grouped_mm", "grouped_mm", grouped_mm_pipeline, graph_safe=True),
    Peer("torch_loop", "torch loop", "loop", torch_loop, graph_safe=False),
)
