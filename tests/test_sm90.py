"""Compiling for Hopper without a GPU: what the H200 would run, checked on the CPU."""

import dataclasses

import pytest
from conftest import small_variant

from autotune import sm90, space, target
from autotune.workloads import SEED16_SHAPE, Case


def test_large_tile_gemms_use_wgmma_and_fit_shared_memory():
    """128-row tiles must build on wgmma; weights by TMA must show bulk tensor copies; a variant the
    space accepts must compile without spilling."""
    case = Case(SEED16_SHAPE, 4096)
    v = dataclasses.replace(small_variant(tma=True, block_m=128, bn=128, bk=64), g1_num_warps=8, g2_num_warps=8)
    assert not space.violations(v, case)
    reports = sm90.gemm_reports(v, case)
    assert [r.name for r in reports] == ["_gemm1_gather_swiglu_tma", "_gemm2_weighted_tma"]
    for r in reports:
        assert r.wgmma > 0 and r.tma_copies > 0
        assert 0 < r.shared_bytes <= target.HOPPER_SMEM_BYTES
        assert r.spill_bytes == 0


def test_the_accumulator_rule_matches_the_compiler():
    """The space rejects 256 accumulators per thread; the compiler agrees: that tile spills."""
    case = Case(SEED16_SHAPE, 4096)
    v = small_variant(block_m=128, bn=128, bk=64)  # 4 warps: 2 x 128 x 128 accumulators / 128 threads
    assert any("accumulators per thread" in r for r in space.violations(v, case))
    gemm1 = sm90.gemm_reports(v, case)[0]
    assert gemm1.spill_bytes > 0


def _gluon_report(v, case, which: int):
    """GEMM `which` of a Gluon variant compiled for sm_90, after the checks every Gluon form owes: the
    rules accept it (bar needing a GPU), and it fits shared memory without spilling."""
    assert [r for r in space.violations(v, case) if "need a GPU" not in r] == []
    report = sm90.gemm_reports(v, case)[which - 1]
    assert report.spill_bytes == 0
    assert 0 < report.shared_bytes <= target.HOPPER_SMEM_BYTES
    return report


def test_gluon_gemm2_compiles_warp_specialised():
    """The Gluon GEMM2 (no interpreter: this compile is its CPU check) fits shared memory with its
    ring and epilogue, does not spill, and runs on m64n256k16 wgmma fed by TMA."""
    case = Case(SEED16_SHAPE, 32768)
    v = dataclasses.replace(small_variant(tma=True, persistent=True, block_m=128, bn=128, bk=64), g1_num_warps=8,
                            g2_block_n=256, g2_num_warps=8, g2_num_stages=3, g2_gluon=True)
    gemm2 = _gluon_report(v, case, 2)
    assert gemm2.name == "_gemm2_gluon_kernel"
    assert gemm2.wgmma > 0 and gemm2.tma_copies > 0
    assert "m64n256k16" in gemm2.wgmma_shapes


def test_gluon_gemm1_compiles_warp_specialised():
    """The Gluon GEMM1: gate and up stacked in one [BLOCK_M, 2 * BLOCK_N] wgmma tile, no spills, fed by TMA."""
    case = Case(SEED16_SHAPE, 32768)
    v = dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128, bn=128, bk=64),
                            g1_num_warps=8, g1_num_stages=3, g2_num_warps=8, g1_gluon=True)
    gemm1 = _gluon_report(v, case, 1)
    assert gemm1.name == "_gemm1_gluon_kernel"
    assert gemm1.wgmma > 0 and gemm1.tma_copies > 0
    assert "m64n256k16" in gemm1.wgmma_shapes


def test_gluon_gemm1_gathering_rows_compiles_warp_specialised():
    """With fused dispatch the Gluon GEMM1's loader warpgroup gathers rows by cp.async beside the
    weights' TMA copies; the consumer is unchanged (m64n256k16), nothing spills."""
    case = Case(SEED16_SHAPE, 32768)
    v = dataclasses.replace(small_variant("fused", tma=True, persistent=True, block_m=128, bn=128, bk=64),
                            g1_num_warps=8, g1_num_stages=3, g2_num_warps=8, g1_gluon=True)
    gemm1 = _gluon_report(v, case, 1)
    assert gemm1.name == "_gemm1_gluon_gather_kernel"
    assert gemm1.async_copies > 0 and gemm1.tma_copies > 0
    assert list(gemm1.wgmma_shapes) == ["m64n256k16"]


@pytest.mark.parametrize("dispatch", ["split", "fused"])
def test_gluon_gemm1_tma_store_compiles(dispatch):
    """g1_tma_store: the Gluon GEMM1's h tile leaves by TMA store (both row routes), within shared
    memory, without spills."""
    case = Case(SEED16_SHAPE, 32768)
    v = dataclasses.replace(small_variant(dispatch, tma=True, persistent=True, block_m=128, bn=128, bk=64),
                            g1_num_warps=8, g1_num_stages=3, g2_num_warps=8, g1_gluon=True, g1_tma_store=True)
    gemm1 = _gluon_report(v, case, 1)
    assert gemm1.tma_copies >= 3  # two weight loads (+ rows) and the store
    assert any("needs g1_gluon" in r for r in space.violations(dataclasses.replace(v, g1_gluon=False), case))


def test_gluon_gemm2_sorted_out_compiles():
    """g2_sorted_out: the Gluon GEMM2 stores whole y tiles in expert order by TMA, within shared
    memory, without spills; it is the Gluon GEMM2's epilogue and nothing else's."""
    case = Case(SEED16_SHAPE, 32768)
    v = dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128, bn=128, bk=64),
                            g1_num_warps=8, g2_block_n=256, g2_num_warps=8, g2_num_stages=3, g2_gluon=True,
                            g2_sorted_out=True)
    gemm2 = _gluon_report(v, case, 2)
    assert gemm2.name == "_gemm2_gluon_kernel"
    assert gemm2.tma_copies >= 3  # rows, weights and the store
    assert any("needs g2_gluon" in r for r in space.violations(dataclasses.replace(v, g2_gluon=False), case))



@pytest.mark.parametrize("dispatch,extra", [("split", {}), ("fused", {"g1_tma_store": True, "g2_sorted_out": True})])
def test_gluon_half_tails_compile(dispatch, extra):
    """half_tail with the Gluon GEMMs: each also runs a 64-row tile whose columns its two warpgroups
    split (m64n128k16 beside the full tile's m64n256k16), in the same shared memory, without spills."""
    case = Case(SEED16_SHAPE, 8192)
    v = dataclasses.replace(small_variant(dispatch, tma=True, persistent=True, block_m=128, bn=128, bk=64),
                            g1_num_warps=8, g1_num_stages=3, g2_block_n=256, g2_num_warps=8, g2_num_stages=3,
                            g1_gluon=True, g2_gluon=True, half_tail=True, **extra)
    for which in (1, 2):
        full = _gluon_report(dataclasses.replace(v, half_tail=False), case, which)
        half = _gluon_report(v, case, which)
        assert set(half.wgmma_shapes) == {"m64n128k16", "m64n256k16"}, half.wgmma_shapes
        assert half.shared_bytes == full.shared_bytes


@pytest.mark.parametrize("dispatch", ["split", "fused"])
def test_gluon_dynamic_walk_compiles(dispatch):
    """dynamic_walk: the Gluon GEMMs' loaders claim tiles from a counter and post them to the
    consumers through a few bytes of shared memory (a slot per ring stage), without spills and
    with the same wgmma tile."""
    case = Case(SEED16_SHAPE, 32768)
    v = dataclasses.replace(small_variant(dispatch, tma=True, persistent=True, block_m=128, bn=128, bk=64),
                            g1_num_warps=8, g1_num_stages=3, g2_block_n=256, g2_num_warps=8, g2_num_stages=3,
                            g1_gluon=True, g2_gluon=True, dynamic_walk=True)
    for which in (1, 2):
        static = _gluon_report(dataclasses.replace(v, dynamic_walk=False), case, which)
        dynamic = _gluon_report(v, case, which)
        assert 0 < dynamic.shared_bytes - static.shared_bytes <= 256
        assert dynamic.wgmma_shapes == static.wgmma_shapes


def test_pair_tiles_compile_without_spills():
    """Pair tiles at T=4096's shipped shape (128x128 joint gate/up tiles, 8 warps): the full block's
    and the tail's accumulators (128 + 64 per thread) fit without spilling, in the shared memory the
    space counts for a pair (the tail's rows staged beside the full block's)."""
    case = Case(SEED16_SHAPE, 4096)
    v = dataclasses.replace(small_variant("split", tma=True, half_tail=True, pair_tail=True, block_m=128, bn=128,
                                          bk=64, group_m=1), g1_num_warps=8, g1_num_stages=4, g2_num_warps=8,
                            g2_num_stages=3, pdl=True)
    assert not space.violations(v, case)
    unpaired = sm90.gemm_reports(dataclasses.replace(v, g1_pair_tail=False, g2_pair_tail=False), case)
    for pair, plain in zip(sm90.gemm_reports(v, case), unpaired, strict=True):
        assert pair.spill_bytes == 0, pair
        assert pair.shared_bytes > plain.shared_bytes and pair.shared_bytes <= target.HOPPER_SMEM_BYTES
    assert any("needs half_tail" in r for r in space.violations(dataclasses.replace(v, half_tail=False), case))


def test_gluon_pair_tiles_compile_without_spills():
    """g1_pair_tail with the Gluon GEMM1 (split dispatch, dynamic walk): a second wgmma group on the
    tail's rows, staged in their own buffers, whose shared memory the space counts (3 stages fit at
    T=16384's tile, 4 do not); it pairs only expert-ordered rows on the dynamic walk."""
    case = Case(SEED16_SHAPE, 16384)
    v = dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128, bn=128, bk=64),
                            g1_num_warps=8, g1_num_stages=3, g2_block_n=256, g2_num_warps=8, g2_num_stages=3,
                            g1_gluon=True, g2_gluon=True, half_tail=True, dynamic_walk=True, g1_tma_store=True)
    half = _gluon_report(v, case, 1)
    pair = _gluon_report(dataclasses.replace(v, g1_pair_tail=True), case, 1)
    assert set(pair.wgmma_shapes) == {"m64n128k16", "m64n256k16"}
    tail_buffers = 3 * 64 * 64 * 2  # a [64, BLOCK_K] tail buffer a stage
    assert tail_buffers <= pair.shared_bytes - half.shared_bytes < tail_buffers + 1024
    assert pair.wgmma > half.wgmma and pair.tma_copies > half.tma_copies
    deeper = dataclasses.replace(v, g1_pair_tail=True, g1_num_stages=4)
    assert any("shared memory" in r for r in space.violations(deeper, case))
    for other in ({"dispatch": "fused"}, {"dynamic_walk": False}):
        bad = space.violations(dataclasses.replace(v, g1_pair_tail=True, **other), case)
        assert any("pair_tail" in r for r in bad), bad


@pytest.mark.parametrize("swap", [16, 32])
def test_swapped_tails_are_wgmma_without_spills(swap):
    """T=4096's shipped shape (GEMM1 128x128 joint gate/up, GEMM2 256 wide, pairs in both, 8 warps)
    with swapped tails: the tail's dot is a wgmma of N = swap over the stage's weight rows, and
    neither GEMM spills or takes more shared memory than the pair."""
    case = Case(SEED16_SHAPE, 4096)
    v = dataclasses.replace(small_variant("split", tma=True, half_tail=True, pair_tail=True, block_m=128, bn=128,
                                          bk=64, group_m=1), g1_num_warps=8, g1_num_stages=4, g2_block_n=256,
                            g2_num_warps=8, g2_num_stages=3, pdl=True, g1_swap_tail=swap, g2_swap_tail=swap)
    assert not space.violations(v, case) and f" pair swap{swap} g2 " in v.label
    paired = sm90.gemm_reports(dataclasses.replace(v, g1_swap_tail=0, g2_swap_tail=0), case)
    for swapped, pair in zip(sm90.gemm_reports(v, case), paired, strict=True):
        assert swapped.spill_bytes == 0, swapped
        assert any(s.startswith("m64n") and s[4:].split("k")[0] == str(swap) for s in swapped.wgmma_shapes), swapped
        assert swapped.shared_bytes == pair.shared_bytes  # the tail's rows fit in the half tail's stages
    assert any("needs g1_pair_tail" in r for r in space.violations(dataclasses.replace(v, g1_pair_tail=False), case))


@pytest.mark.parametrize("gluon", [False, True])
def test_k_blocked_weights_compile_to_the_same_kernels(gluon):
    """weight_layout=k64 changes only the weight boxes' coordinates: the same TMA copies, shared
    memory, registers and wgmma tiles as the row-major form, without spills (the Gluon loaders have no
    interpreter, so this is their CPU check; the GPU tests run them)."""
    case = Case(SEED16_SHAPE, 8192)
    v = dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128, bn=128, bk=64),
                            g1_num_warps=8, g1_num_stages=3, g2_block_n=256, g2_num_warps=8, g2_num_stages=3,
                            g1_gluon=gluon, g2_gluon=gluon, half_tail=True)
    k64 = dataclasses.replace(v, weight_layout="k64")
    assert [r for r in space.violations(k64, case) if "need a GPU" not in r] == []
    for rows, blocked in zip(sm90.gemm_reports(v, case), sm90.gemm_reports(k64, case), strict=True):
        assert blocked.spill_bytes == 0
        assert (blocked.name, blocked.shared_bytes, blocked.tma_copies, blocked.wgmma_shapes) == \
            (rows.name, rows.shared_bytes, rows.tma_copies, rows.wgmma_shapes)


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("gluon1", [False, True])
def test_expert_groups_compile_to_the_same_tiles(gluon1, half):
    """group_by_expert at the large-T leaders' forms (T=8192: a persistent triton GEMM1 and a Gluon
    GEMM2 writing expert order; T>=16384: both Gluon, dynamic walk), also with half tails: the walk's
    two loads of a block's span change neither the wgmma tile nor the shared memory, and nothing spills."""
    case = Case(SEED16_SHAPE, 8192)
    v = dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128, bn=128, bk=64, group_m=8),
                            g1_num_warps=8, g1_num_stages=3, g2_block_n=256, g2_num_warps=8, g2_num_stages=3,
                            g2_gluon=True, g2_sorted_out=True, g1_gluon=gluon1, g1_tma_store=gluon1,
                            dynamic_walk=gluon1, half_tail=half)
    grouped = dataclasses.replace(v, group_by_expert=True)
    assert "E8" in grouped.label and "G8" not in grouped.label
    for which in (1, 2):
        plain = _gluon_report(v, case, which) if (which == 2 or gluon1) else sm90.gemm_reports(v, case)[0]
        ours = _gluon_report(grouped, case, which) if (which == 2 or gluon1) else sm90.gemm_reports(grouped, case)[0]
        assert ours.name == plain.name and ours.wgmma_shapes == plain.wgmma_shapes
        assert ours.shared_bytes == plain.shared_bytes and ours.spill_bytes == 0


@pytest.mark.parametrize("v", [
    small_variant(dispatch="split", tma=True, persistent=True, half_tail=True, tail_walk=True, block_m=64, bn=64,
                  bk=64),
    dataclasses.replace(small_variant(block_m=64, bn=64, bk=64), group_by_expert=True),
    small_variant(dispatch="split", by_token=True, block_m=64, bn=64, bk=64),
], ids=["tail-walk lists", "expert spans", "slot positions"])
def test_dispatch_kernels_compile_for_sm90_with_each_optional_map(v):
    """Each optional map dispatch writes (the walk lists, the expert spans, each slot's position)
    compiles for Hopper, not only under the interpreter."""
    assert sm90.dispatch_kernels_compiled(v) == ["_dispatch_single_kernel", "_dispatch_place_kernel"]
