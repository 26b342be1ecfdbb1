"""The reference against an independent float64 per-token loop, and the error measure itself."""

import torch

from autotune.reference import BAR, error_stats, moe_reference
from autotune.workloads import Case, Shape, make_tokens, make_weights


def per_token_float64(x, w13, w2, w, ids):
    """The formula read literally: one token, one slot at a time, in float64."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            gate = w13[e, :inter].double() @ x[t].double()
            up = w13[e, inter:].double() @ x[t].double()
            out[t] += float(w[t, j]) * (w2[e].double() @ (gate * torch.sigmoid(gate) * up))
    return out


def test_reference_matches_float64_loop():
    shape = Shape(E=6, H=48, I=40, k=3, dtype="float32")
    w13, w2 = make_weights(shape, "cpu", seed=1)
    x, w, ids = make_tokens(Case(shape, 9, seed=2), "cpu")
    ids[0, 1] = -1  # not on this device: contributes nothing
    ids[1, 2] = ids[1, 0]  # the same expert twice counts twice
    ids[2, 0] = 99  # out of range: contributes nothing
    ref = moe_reference(x, w13, w2, w, ids)
    exact = per_token_float64(x, w13, w2, w, ids)
    assert error_stats(ref, exact).global_rel_l2 < 1e-6


def test_error_stats_flags_each_failure():
    ref = torch.randn(8, 16, dtype=torch.float64)
    assert not error_stats(ref.clone(), ref).failures()
    noisy = ref + 0.05 * torch.randn_like(ref)
    assert any("global" in f for f in error_stats(noisy, ref).failures())
    one_bad = ref.clone()
    one_bad[3] *= 1.1  # a single wrong token is invisible globally but not per token
    stats = error_stats(one_bad, ref)
    assert stats.global_rel_l2 < BAR.global_rel_l2 * 10 and stats.failures()
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert "non-finite values in the output" in error_stats(nan, ref).failures()


def test_error_stats_zero_token_rows():
    """A token with no valid expert has a zero reference row: exact zero passes, anything else fails."""
    ref = torch.randn(4, 8, dtype=torch.float64)
    ref[2] = 0
    assert not error_stats(ref.clone(), ref).failures()
    off = ref.clone()
    off[2] = 0.5
    assert error_stats(off, ref).failures()
