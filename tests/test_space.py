"""The declared space: one Param per Variant field, per-case caps, pruning rules, old rows."""

import dataclasses

import pytest
import torch
from conftest import small_variant

from autotune import cli, search, space, target
from autotune.workloads import SEED16_SHAPE, Case, Shape


def test_every_variant_field_is_declared_once():
    assert {p.name for p in space.PARAMS} == {f.name for f in dataclasses.fields(space.Variant)}
    assert len(space.PARAMS) == len(space.PARAM_BY_NAME)


def test_choices_are_capped_by_the_case():
    tiny = Case(Shape(E=4, H=32, I=16, k=2, dtype="float16"), T=3)
    caps = {p.name: space.choices(p, tiny) for p in space.PARAMS}
    assert caps["block_m"] == (16,)  # 6 slots: no tile taller than 16 rows is useful
    assert caps["g1_block_k"] == (32,) and caps["g2_block_k"] == (32,)  # K = 32 and 16 -> the smallest
    assert caps["dispatch"] == ("fused", "split")
    big = Case(SEED16_SHAPE, T=32768)
    assert all(space.choices(p, big) == p.choices for p in space.PARAMS)


def test_violations_name_the_reason():
    case = Case(SEED16_SHAPE, T=4096)
    fat = dataclasses.replace(small_variant(block_m=128, bn=256, bk=256), g1_num_stages=5)
    reasons = " ".join(space.violations(fat, case))
    assert "shared memory" in reasons and "accumulators per thread" in reasons
    tma_wide = small_variant(tma=True, bk=128)
    assert any("TMA box row" in r for r in space.violations(tma_wide, case))
    assert not space.violations(small_variant(), case)


def test_starting_points_are_inside_the_space():
    for T in (1, 64, 32768):
        case = Case(SEED16_SHAPE, T)
        points = search.starting_points(case)
        assert points
        for v in points:
            assert not space.violations(v, case)
            assert all(getattr(v, p.name) in space.choices(p, case) for p in space.PARAMS)


def test_rows_recorded_before_a_parameter_existed_read_with_its_default():
    old = {k: v for k, v in small_variant().as_dict().items() if k not in ("g1_persistent", "g2_weight_tma")}
    v = space.Variant.from_dict(old)
    assert v.g1_persistent is False and v.g2_weight_tma is False


def test_rows_of_a_withdrawn_parameter_read_only_at_its_remaining_value():
    """A trial recorded while a withdrawn parameter existed reads as today's variant where it held the
    value every variant now has, and refuses to read as a different kernel where it did not."""
    name, value = next(iter(space.WITHDRAWN.items()))
    assert name not in space.PARAM_BY_NAME
    v = small_variant()
    assert space.Variant.from_dict({**v.as_dict(), name: value}) == v
    with pytest.raises(ValueError, match=name):
        space.Variant.from_dict({**v.as_dict(), name: not value})


def test_cli_space_lists_every_parameter(capsys):
    assert cli.main(["space"]) == 0
    out = capsys.readouterr().out
    assert all(p.name in out for p in space.PARAMS)


def test_token_counts_are_each_tuned_once():
    from autotune.workloads import parse_tokens

    assert parse_tokens("9,1,9,") == (1, 9)


def test_parse_assignments_names_the_bad_part():
    assert space.parse_assignments("g1_weight_tma=True, dispatch=split,block_m=64") == {
        "g1_weight_tma": True, "dispatch": "split", "block_m": 64}
    assert space.parse_assignments("G1_Weight_TMA=true,dispatch=SPLIT") == {"g1_weight_tma": True, "dispatch": "split"}
    with pytest.raises(ValueError, match="'block_m': no value"):
        space.parse_assignments("block_m")
    with pytest.raises(ValueError, match="no parameter 'blockm'"):
        space.parse_assignments("blockm=64")
    with pytest.raises(ValueError, match="block_m takes one of 16, 32, 64, 128"):
        space.parse_assignments("block_m=48")


def test_direct_dispatch_only_where_it_can_pay():
    tiny, wide = Case(SEED16_SHAPE, 1), Case(SEED16_SHAPE, 64)
    assert space.violations(small_variant("direct", block_m=16), tiny) == []
    assert any("T*k <= " in r for r in space.violations(small_variant("direct"), wide))
    assert any("block_m must be 16" in r for r in space.violations(small_variant("direct", block_m=32), tiny))
    assert any("persistent" in r for r in space.violations(small_variant("direct", persistent=True), tiny))
    split = dataclasses.replace(small_variant("direct"), dispatch="split")
    assert any("dispatch=fused" in r for r in space.violations(split, tiny))


def test_gluon_gemm2_says_what_it_is():
    """The Gluon GEMM2 is TMA-fed, persistent, a warpgroup per 64 rows and full height: the flags
    must agree, and without a GPU it cannot run at all."""
    case = Case(SEED16_SHAPE, T=8192)
    ok = dataclasses.replace(small_variant(tma=True, persistent=True, block_m=128, bn=128, bk=64), g1_num_warps=8,
                             g2_num_warps=8, g2_block_n=256, g2_num_stages=3, g2_gluon=True)
    assert [r for r in space.violations(ok, case) if "need a GPU" not in r] == []
    for change, words in (({"g2_persistent": False}, "persistent"), ({"g2_num_warps": 4}, "g2_num_warps must be 8"),
                          ({"block_m": 32}, "64 or 128 rows"),
                          ({"block_m": 64, "g2_num_warps": 4, "half_tail": True}, "half_tail needs block_m=128"),
                          ({"half_tail": True, "tail_walk": True}, "tail_walk must be off"),
                          ({"g2_num_stages": 4}, "shared memory")):
        assert any(words in r for r in space.violations(dataclasses.replace(ok, **change), case)), change
    fp32 = Case(dataclasses.replace(SEED16_SHAPE, dtype="float32"), T=8192)
    assert any("16-bit" in r for r in space.violations(ok, fp32))


def test_gluon_gemms_take_half_tails_at_128_rows():
    """A Gluon GEMM runs a half tail as one 64-row tile (its two warpgroups split the columns), so
    half_tail goes with the Gluon GEMMs at block_m=128, and the sampler may ask for both."""
    case = Case(SEED16_SHAPE, T=8192)
    v = dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128, bn=128, bk=64),
                            g1_num_warps=8, g2_num_warps=8, g2_block_n=256, g2_num_stages=3, g1_gluon=True,
                            g2_gluon=True, half_tail=True)
    assert [r for r in space.violations(v, case) if "need a GPU" not in r] == []
    answers = {**v.as_dict(), "direct": False, "tail_walk": False}
    assert space.PARAM_BY_NAME["g1_gluon"].when(answers, case) == target.has_gpu()
    assert not space.PARAM_BY_NAME["g1_gluon"].when({**answers, "tail_walk": True}, case)


def test_dynamic_walk_is_the_gluon_gemms():
    case = Case(SEED16_SHAPE, T=8192)
    v = dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128, bn=128, bk=64),
                            g1_num_warps=8, g2_num_warps=8, g1_gluon=True, dynamic_walk=True)
    assert [r for r in space.violations(v, case) if "need a GPU" not in r] == []
    assert any("needs g1_gluon or g2_gluon" in r
               for r in space.violations(dataclasses.replace(v, g1_gluon=False), case))
    assert "dynamic-walk" in v.label and "dynamic-walk" not in dataclasses.replace(v, dynamic_walk=False).label


def test_gluon_gemm1_says_what_it_is():
    case = Case(SEED16_SHAPE, T=8192)
    ok = dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128, bn=128, bk=64),
                             g1_num_warps=8, g2_num_warps=8, g1_gluon=True)
    assert [r for r in space.violations(ok, case) if "need a GPU" not in r] == []
    # With fused dispatch its loader gathers the rows itself.
    assert [r for r in space.violations(dataclasses.replace(ok, dispatch="fused"), case) if "need a GPU" not in r] == []
    for change, words in (({"activation": "split"}, "activation=fused"),
                          ({"g1_block_n": 256}, "wider than one wgmma"), ({"g1_weight_tma": False}, "g1_weight_tma")):
        assert any(words in r for r in space.violations(dataclasses.replace(ok, **change), case)), change


def test_sampler_is_asked_only_what_can_take_effect():
    """Conditional parameters are asked only where they can run, so random points on a small case
    mostly pass the rules (each unconditional binary rule would otherwise halve the yield)."""
    import optuna

    from autotune.workloads import DEMO_SHAPE

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for T in (1, 33):
        case = Case(DEMO_SHAPE, T)
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=T))
        valid = 0
        for _ in range(100):
            trial = study.ask()
            v = search.suggest(trial, case)
            valid += not space.violations(v, case)
            assert space.Variant.from_dict(trial.params) == v  # what a trial records rebuilds its variant
            study.tell(trial, 1.0)
        assert valid >= 50, (T, valid)


def test_swapped_tails_are_asked_only_with_pairs_of_at_least_64_row_blocks():
    case = Case(SEED16_SHAPE, T=4096)
    answers = {**small_variant(half_tail=True, block_m=64).as_dict(), "g1_gluon": False, "g2_gluon": False}
    for which in (1, 2):
        when = space.PARAM_BY_NAME[f"g{which}_swap_tail"].when
        assert not when(answers, case)
        assert when({**answers, f"g{which}_pair_tail": True}, case)
        assert not when({**answers, f"g{which}_pair_tail": True, "block_m": 32}, case)
    v = dataclasses.replace(small_variant(half_tail=True, pair_tail=True, block_m=64), g2_swap_tail=16)
    assert " s2 pair swap16" in v.label and not space.violations(v, case)
    assert any("needs g2_pair_tail" in r for r in space.violations(dataclasses.replace(v, g2_pair_tail=False), case))
    # A swap as wide as the half tail would leave the half-height pair unreachable.
    wide = dataclasses.replace(v, g2_swap_tail=32)
    assert any("fewer rows than block_m/2" in r for r in space.violations(wide, case))


def test_pair_tiles_are_asked_only_with_half_tails():
    case = Case(SEED16_SHAPE, T=4096)
    answers = {**small_variant(half_tail=True).as_dict(), "g1_gluon": False, "g2_gluon": False}
    for which in (1, 2):
        when = space.PARAM_BY_NAME[f"g{which}_pair_tail"].when
        assert when(answers, case)
        assert not when({**answers, "half_tail": False}, case)
        assert not when({**answers, "tail_walk": True}, case)
        assert not when({**answers, f"g{which}_gluon": True}, case)
    v = dataclasses.replace(small_variant(half_tail=True), g1_pair_tail=True)
    assert " s2 pair g2 " in v.label
    small = Case(Shape(8, 64, 48, 2, "float16"), 37)
    assert not space.violations(v, small)
    assert any("needs half_tail" in r for r in space.violations(dataclasses.replace(v, half_tail=False), small))


def test_permutation_by_token_is_split_dispatchs():
    case = Case(SEED16_SHAPE, T=4096)
    when = space.PARAM_BY_NAME["permute_by_token"].when
    answers = small_variant("split").as_dict()
    assert when(answers, case) and not when({**answers, "dispatch": "fused"}, case)
    v = small_variant("split", by_token=True)
    assert v.label.startswith("split-by-token/") and not space.violations(v, case)
    assert any("needs dispatch=split" in r for r in space.violations(dataclasses.replace(v, dispatch="fused"), case))


def test_neighbours_move_one_parameter_one_step():
    """search.neighbours: each neighbour differs from the variant in one parameter, by one place among
    that parameter's choices for the case where they are numbers, to any other value where they are
    flags or names, and in its GEMM's pipeline depth only where the move fits no other way; every
    neighbour can run the case, and none is the variant itself."""
    case = Case(SEED16_SHAPE, 2048)
    v = dataclasses.replace(small_variant(block_m=64, bn=64, bk=64), g1_num_stages=5, g2_num_stages=3)
    assert not space.violations(v, case)
    found = search.neighbours(v, case)
    assert found and v not in found and len(set(found)) == len(found)
    moved = set()
    for n in found:
        changed = [p.name for p in space.PARAMS if getattr(n, p.name) != getattr(v, p.name)]
        name = changed[0]
        options = space.choices(space.PARAM_BY_NAME[name], case)
        old, new = getattr(v, name), getattr(n, name)
        if isinstance(old, int) and not isinstance(old, bool):
            assert abs(options.index(new) - options.index(old)) == 1, name
        if len(changed) > 1:  # a larger tile, with the most stages that fit
            assert changed[1:] == ["g1_num_stages"] and n.g1_num_stages < v.g1_num_stages, changed
            assert space.violations(dataclasses.replace(n, g1_num_stages=n.g1_num_stages + 1), case)
        assert not space.violations(n, case)
        moved.add(name)
    assert {"g1_num_stages", "g1_block_n", "pdl"} <= moved
    # Both sides of a numeric choice where both can run: 3 stages has 2 and 4 beside it.
    assert {n.g2_num_stages for n in found if n.g2_num_stages != v.g2_num_stages} == {2, 4}
    # GEMM1's K step doubled needs more shared memory than 5 stages give: it comes with fewer.
    (wider,) = [n for n in found if n.g1_block_k == 128]
    assert 2 <= wider.g1_num_stages < 5


def test_neighbours_of_a_gluon_leader_are_listed_on_a_gpu(monkeypatch):
    """A Gluon variant can run only on a GPU, so on the CPU its neighbours are none (every one needs a
    GPU); with one they are its stage, tile order, walk and epilogue moves (NOTES 45)."""
    case = Case(SEED16_SHAPE, 16384)
    v = dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=128, bn=64, bk=64),
                            g1_num_warps=8, g2_block_n=256, g2_num_warps=8, g1_num_stages=4, g2_num_stages=3,
                            g1_group_m=8, g2_group_m=16, g1_gluon=True, g2_gluon=True, g1_tma_store=True,
                            g2_sorted_out=True)
    monkeypatch.setattr(space.target, "has_gpu", lambda: True)
    monkeypatch.setattr(space.target, "smem_bytes", lambda: space.target.DEFAULT_SMEM_BYTES)  # Hopper's
    assert not space.violations(v, case)
    moved = {p.name for n in search.neighbours(v, case) for p in space.PARAMS
             if getattr(n, p.name) != getattr(v, p.name)}
    assert {"g1_num_stages", "g2_group_m", "dynamic_walk", "g1_tma_store", "g2_sorted_out"} <= moved
    monkeypatch.setattr(space.target, "has_gpu", lambda: False)
    assert search.neighbours(v, case) == []


def test_rows_computed_counts_each_gemms_padded_rows():
    """Whole blocks per expert; a half tail at half height; a paired tail under a swap at the swap's
    width (only behind a full block); the direct route a block per routed slot. Out-of-range ids count
    for nothing."""
    ids = torch.tensor([0] * 10 + [1] * 7 + [2] * 2 + [-1, 9])
    # blocks of 4: expert 0 4 + 4 + a tail of 2, expert 1 4 + a tail of 3, expert 2 one tail of 2.
    assert space.rows_computed(small_variant(block_m=4), ids, 3) == (24, 24)
    half = small_variant(block_m=4, half_tail=True)
    assert space.rows_computed(half, ids, 3) == (20, 20)  # tails of 2 at height 2
    swapped = dataclasses.replace(small_variant(block_m=8, half_tail=True, pair_tail=True), g1_swap_tail=2)
    # blocks of 8: expert 0 8 + a paired tail of 2 (GEMM1: the swap's 2; GEMM2: half height, 4),
    # expert 1 one block of 7 (8), expert 2 a lone tail of 2 (4 either way: no block to pair with).
    assert space.rows_computed(swapped, ids, 3) == (22, 24)
    assert space.rows_computed(small_variant("direct"), ids, 3) == (19 * 16, 19 * 16)
    balanced = torch.arange(96 * 8).view(96, 8) % 256  # 3 slots per expert
    assert space.rows_computed(small_variant(block_m=4), balanced, 256)[0] == 1024
