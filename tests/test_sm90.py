"""Compiling for Hopper without a GPU: what the H200 would run, checked on the CPU."""

from conftest import small_variant

from autotune import sm90
from autotune.workloads import SEED16_SHAPE, Case


def test_large_tile_gemms_use_wgmma_and_fit_shared_memory():
    """128-row tiles must build on wgmma; weights by TMA must show bulk tensor copies."""
    v = small_variant(tma=True, block_m=128, bn=128, bk=64)
    reports = sm90.gemm_reports(v, Case(SEED16_SHAPE, 4096))
    assert [r.name for r in reports] == ["_gemm1_gather_swiglu_tma", "_gemm2_weighted_tma"]
    for r in reports:
        assert r.wgmma > 0 and r.tma_copies > 0
        assert 0 < r.shared_bytes <= 227 * 1024
        assert r.spill_bytes in (0, None)
