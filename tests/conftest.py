"""Test set-up: without a GPU every kernel runs through Triton's interpreter (set before any import)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from autotune import render, target  # noqa: E402
from autotune.space import Variant  # noqa: E402

GPU = target.has_gpu()
DEVICE = target.device()
# The interpreter cannot do bf16 tl.dot; on the GPU bf16 is the dtype that matters.
DTYPES = (torch.bfloat16,) if GPU else (torch.float16, torch.float32)


def small_variant(dispatch="fused", activation="fused", tma=False, persistent=False, half_tail=False,
                  tail_walk=False, pair_tail=False, by_token=False, block_m=None, bn=32, bk=32, group_m=4,
                  pdl=False) -> Variant:
    """pair_tail pairs half tails in both GEMMs; by_token permutes split dispatch's rows by token."""
    direct = dispatch == "direct"
    # A half-height tail tile needs 32-row blocks (half is the smallest dot); otherwise the smallest.
    block_m = block_m or (32 if half_tail else 16)
    return Variant("fused" if direct else dispatch, activation, block_m, bn, bk, group_m, 4, 2, bn, bk, group_m, 4, 2,
                   tma, tma, persistent, persistent, pdl, direct, half_tail, tail_walk,
                   g1_pair_tail=pair_tail, g2_pair_tail=pair_tail, permute_by_token=by_token)


# Every structural form: (dispatch, activation, TMA descriptors, persistent GEMMs[, half tails, tail walk,
# pair tiles, permutation by token]). With TMA, fused
# SwiGLU runs one dot over a joint gate/up box, and split dispatch reads its rows by TMA as well.
FORMS = [("fused", "fused", False, False), ("fused", "split", False, False), ("split", "fused", False, False),
         ("split", "split", False, False), ("fused", "fused", True, False), ("split", "split", True, False),
         ("split", "fused", True, False), ("fused", "fused", False, True), ("fused", "split", True, True),
         ("split", "fused", True, True), ("direct", "fused", False, False), ("direct", "split", True, False),
         ("fused", "split", False, False, True), ("split", "fused", True, True, True),
         ("split", "fused", True, True, True, True), ("fused", "split", False, True, True, True),
         # Pair tiles: an expert's last full block and its half tail in one program.
         ("fused", "fused", False, False, True, False, True), ("split", "split", True, True, True, False, True),
         # Split dispatch's permutation by token, on pointer rows and on TMA rows with pairs.
         ("split", "fused", False, False, False, False, False, True),
         ("split", "split", True, True, True, False, True, True)]


@pytest.fixture(scope="session")
def form_modules():
    """One rendered, imported module per structural form."""
    return {f: render.load_source(render.render_variant(small_variant(*f))) for f in FORMS}


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip)
