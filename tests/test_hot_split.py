"""Routing-adaptive rows (a table row with a `hot` variant): each side's dispatch places exactly its own
experts' slots, and the two sides together match the reference under uniform and hot-expert routing,
with invalid ids. Interpreter on the CPU; the GPU forms run in test_gpu.py."""

import dataclasses
import math

import pytest
import torch
from conftest import DEVICE, DTYPES, small_variant
from test_kernels import assert_matches, inputs, torch_dispatch

from autotune import render, space
from autotune.render import Row
from autotune.workloads import Shape

COLD = small_variant("fused", "fused")  # 16-row blocks, rows gathered by GEMM1
HOT = small_variant("split", "fused", block_m=64)  # 64-row blocks of permuted rows
HOT_ROWS = 32


@pytest.fixture(scope="module")
def hot_module():
    return render.load_source(render.render_module([Row(math.inf, COLD, HOT, HOT_ROWS)], "hot split", []))


def _routing(E: int, T: int, k: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(E * T + 5)
    ids = torch.randint(-1, E + 2, (T, k), generator=gen)
    ids[: T // 2, 0] = 1  # one expert routed T/2 rows: hot at every T here
    return ids


@pytest.mark.parametrize("shared", [False, True], ids=["own count", "shared count"])
@pytest.mark.parametrize("E, ids", [(8, _routing(8, 40, 2)), (5, _routing(5, 300, 3)), (40, _routing(40, 3000, 3)),
                                    # 64 experts of exactly hot_rows rows: the hot side's block bound is tight
                                    (64, torch.arange(64).repeat_interleave(HOT_ROWS).view(-1, 2))])
def test_each_side_places_its_own_experts(hot_module, E, ids, shared):
    """The cold side's dispatch is the full dispatch of the experts routed fewer than hot_rows rows,
    the hot side's that of the rest, integers exact; one chunk and many, ids out of range included;
    each side counting the slots itself or both sharing one count (_count_slots), as a call does."""
    counts = torch.bincount(ids[(ids >= 0) & (ids < E)], minlength=E)
    shared_counts = hot_module._count_slots(ids.to(DEVICE), E, False) if shared else None
    for side, block_m, keep in (("cold", COLD.block_m, counts < HOT_ROWS), ("hot", HOT.block_m, counts >= HOT_ROWS)):
        sorted_slots, block_expert, block_rows, num_blocks = hot_module.dispatch(
            ids.to(DEVICE), E, block_m, hot=hot_module._Side(HOT_ROWS, side, shared_counts))
        mine = torch.where((ids >= 0) & (ids < E) & keep[ids.clamp(0, E - 1)], ids, -1)
        want_expert, want_rows, want_slots = torch_dispatch(mine, E, block_m)
        n = want_expert.numel()
        assert int(num_blocks) == n, side
        if E == 64 and side == "hot":
            assert block_expert.numel() == n  # the bound is exact: no grid wider than the worst case
        assert torch.equal(block_expert[:n].cpu(), want_expert) and torch.equal(block_rows[:n].cpu(), want_rows)
        assert (block_rows[n:] == 0).all()
        for b, want in enumerate(want_slots):
            assert torch.equal(sorted_slots[b * block_m: b * block_m + want.numel()].cpu().long(), want), side


def test_the_hot_sides_bound_never_empties_a_grid(hot_module):
    """With fewer slots than hot_rows no expert can be hot, yet the hot side's grids need a program:
    a grid of none fails to launch on the GPU (the interpreter runs it as nothing)."""
    side = hot_module._Side(HOT_ROWS, "hot")
    for n_slots in range(1, 4 * HOT_ROWS):
        assert hot_module._max_blocks(n_slots, 64, HOT.block_m, side) == max(1, n_slots // HOT_ROWS)


@pytest.mark.parametrize("routing", ["uniform", "zipf"])
@pytest.mark.parametrize("T", [1, 40, 150])
def test_hot_split_matches_reference(hot_module, routing, T):
    """Under uniform routing most experts stay cold; under zipf a few take most rows and run hot."""
    assert_matches(hot_module, *inputs(T=T, dtype=DTYPES[0], seed=1, routing=routing))


def test_hot_split_skips_invalid_ids(hot_module):
    x, w13, w2, w, ids = inputs(T=90, dtype=DTYPES[0], seed=2, routing="zipf")
    ids[::4, 0] = -1
    ids[1::4, 1] = 8
    assert_matches(hot_module, x, w13, w2, w, ids)


def test_rows_computed_counts_each_side_on_its_experts(hot_module):
    """The bench's padding count of a routing-adaptive row: cold experts in 16-row blocks, hot ones in 64."""
    ids = torch.tensor([0] * 40 + [1] * 3 + [2] * 17)
    row = hot_module.select_variant(1)
    assert space.rows_computed(row, ids, 4) == (64 + 16 + 32,) * 2


def test_sides_that_cannot_share_a_call_are_named():
    assert space.hot_split_violations(COLD, HOT) == []
    assert any("larger" in why for why in space.hot_split_violations(HOT, COLD))
    assert any("second pipeline" in why for why in space.hot_split_violations(COLD, small_variant(block_m=32)))
    direct = small_variant("direct")
    assert any("direct dispatch" in why for why in space.hot_split_violations(direct, HOT))
    sorted_out = dataclasses.replace(HOT, g2_gluon=True, g2_sorted_out=True)
    assert any("g2_sorted_out" in why for why in space.hot_split_violations(COLD, sorted_out))


def test_emit_pairs_a_row_with_its_hot_routing_leader(tmp_path):
    """`emit --hot-routing zipf`: a case whose zipf leader can share a call becomes a routing-adaptive
    row (hot_rows half the hot variant's block); one whose zipf leader cannot stays one variant."""
    from sqlalchemy.orm import Session

    from autotune import db, emit, target
    from autotune.workloads import suite

    shape = Shape(4, 32, 32, 2, "float16")
    fp = target.fingerprint()
    cases = suite(shape, (1, 9))
    with Session(db.connect(f"sqlite:///{tmp_path / 'hot.sqlite3'}")) as s:
        run = db.start_run(s, fp, "test", None)
        for case, cold, hot in ((cases[0], COLD, COLD), (cases[1], COLD, HOT)):
            for c, v in ((case, cold), (dataclasses.replace(case, routing="zipf"), hot)):
                db.record_trial(s, run_id=run.id, study="t", fingerprint=fp.key, case_key=c.key, case=c.as_dict(),
                                params=v.as_dict(), label=v.label, source_hash=render.variant_hash(v), status="ok",
                                median_ms=1.0)
        plain = emit.emit(s, fp.key, cases, "plain", tmp_path).read_text()
        path = emit.emit(s, fp.key, cases, "adaptive", tmp_path, hot_routing="zipf")
    assert "hot=_Variant(" not in plain
    module = render.load_path(path)
    assert module.select_variant(1).hot is None
    row = module.select_variant(9)
    assert row.hot.block_m == HOT.block_m and row.hot_rows == HOT.block_m // 2
    assert "zipf, experts >= 32 rows: " in path.read_text()


def test_emit_names_rows_whose_hot_leader_is_in_another_layout(tmp_path):
    """A module reads one weight layout, so a case whose zipf leader reads another stays one variant,
    and emit says which cases lost their hot side that way and how to give them one."""
    from sqlalchemy.orm import Session

    from autotune import db, emit, target
    from autotune.workloads import suite

    shape = Shape(4, 64, 64, 2, "float16")
    fp = target.fingerprint()
    (case,) = suite(shape, (9,))
    said = []
    with Session(db.connect(f"sqlite:///{tmp_path / 'hot.sqlite3'}")) as s:
        run = db.start_run(s, fp, "test", None)
        for c, v in ((case, dataclasses.replace(COLD, weight_layout="k64")),
                     (dataclasses.replace(case, routing="zipf"), HOT)):
            db.record_trial(s, run_id=run.id, study="t", fingerprint=fp.key, case_key=c.key, case=c.as_dict(),
                            params=v.as_dict(), label=v.label, source_hash=render.variant_hash(v), status="ok",
                            median_ms=1.0)
        path = emit.emit(s, fp.key, [case], "one_layout", tmp_path, hot_routing="zipf", log=said.append)
    assert getattr(render.load_path(path).select_variant(9), "hot", None) is None  # no routing-adaptive row
    assert any("T = 9 have a zipf leader only in another weight layout than this module's k64" in m
               and "--probe weight_layout=k64" in m for m in said), said


@pytest.mark.parametrize("grouped", ["hot", "cold", "both"])
def test_a_side_grouped_within_experts_walks_its_own_spans(grouped):
    """group_by_expert on either side of a routing-adaptive row: each side's dispatch writes the spans
    its own GEMMs walk (a hot expert holds several 64-row blocks, so groups of 1 step within it)."""
    hot = dataclasses.replace(HOT, g1_group_m=1, g2_group_m=1, group_by_expert=grouped in ("hot", "both"))
    cold = dataclasses.replace(COLD, group_by_expert=grouped in ("cold", "both"))
    module = render.load_source(render.render_module([Row(math.inf, cold, hot, HOT_ROWS)], "hot split", []))
    assert_matches(module, *inputs(T=150, dtype=DTYPES[0], seed=1, routing="zipf"))
    assert_matches(module, *inputs(T=40, dtype=DTYPES[0], seed=1, routing="uniform"))
