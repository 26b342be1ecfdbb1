"""The same checks on the GPU, in bf16 at seed16 sizes (marked `gpu`; skipped without CUDA)."""

import pytest
import torch

from autotune import render, target
from autotune.reference import BAR, error_stats, moe_reference
from autotune.space import Variant
from autotune.workloads import SEED16_SHAPE, Case, Shape, make_tokens, make_weights

pytestmark = pytest.mark.gpu

VARIANTS = {
    "fused/fused small": Variant("fused", "fused", 16, 64, 128, 1, 4, 4, 64, 128, 1, 4, 4),
    "fused/fused large": Variant("fused", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3),
    "split/split": Variant("split", "split", 64, 128, 64, 8, 4, 3, 128, 64, 8, 4, 3),
    "fused/fused tma": Variant("fused", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3, True, True),
    "split/split tma": Variant("split", "split", 16, 64, 64, 1, 4, 4, 64, 64, 1, 4, 4, True, True),
    "fused/fused persistent": Variant("fused", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                      False, False, True, True),
    "fused/fused tma persistent": Variant("fused", "fused", 64, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                          True, True, True, True),
    "split/fused tma pdl": Variant("split", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                   True, True, False, True, True),
    "split/fused tma persistent": Variant("split", "fused", 64, 128, 64, 8, 4, 4, 128, 64, 8, 4, 4,
                                          True, True, True, True),
    "fused/fused small pdl": Variant("fused", "fused", 16, 64, 128, 1, 4, 4, 64, 128, 1, 4, 4, pdl=True),
    "split/split pdl": Variant("split", "split", 64, 128, 64, 8, 4, 3, 128, 64, 8, 4, 3, pdl=True),
    # Half-height tails: 64-row wgmma tiles beside 128-row ones (TMA rows), and 32-row mma tiles.
    "split/fused tma persistent half": Variant("split", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                               True, True, True, True, half_tail=True),
    "fused/fused half": Variant("fused", "fused", 64, 128, 64, 8, 4, 4, 128, 64, 8, 4, 4, half_tail=True),
    # The tail walk: persistent GEMMs over dispatch's full-block list, then its half-tail list.
    "split/fused tma persistent half walk": Variant("split", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                                    True, True, True, True, half_tail=True, tail_walk=True),
    "fused/fused tma persistent half walk": Variant("fused", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                                    True, True, True, False, half_tail=True, tail_walk=True),
    # The Gluon GEMMs (a loader warp, a warpgroup per 64 rows): 128-row tiles, and 64-row tiles.
    "fused/fused gluon g2": Variant("fused", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                    True, True, False, True, g2_gluon=True),
    "split/fused gluon g2 M64": Variant("split", "fused", 64, 128, 64, 8, 4, 4, 256, 64, 8, 4, 3,
                                        True, True, True, True, g2_gluon=True),
    "split/fused gluon g1 g2": Variant("split", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                       True, True, True, True, g1_gluon=True, g2_gluon=True),
    "split/fused gluon g1 M64": Variant("split", "fused", 64, 64, 64, 8, 4, 4, 128, 64, 8, 8, 3,
                                        True, True, True, False, g1_gluon=True),
    # The Gluon GEMM1 gathering rows itself (fused dispatch): cp.async loader warpgroup, TMA weights.
    "fused/fused gluon g1 gather g2": Variant("fused", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                              True, True, True, True, g1_gluon=True, g2_gluon=True),
    "fused/fused gluon g1 gather M64": Variant("fused", "fused", 64, 64, 64, 8, 4, 4, 128, 64, 8, 8, 3,
                                               True, True, True, False, g1_gluon=True),
    # The Gluon GEMM1's h tiles out by TMA store, on both row routes.
    "split/fused gluon g1 tma-store": Variant("split", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                              True, True, True, True, g1_gluon=True, g1_tma_store=True),
    "fused/fused gluon g1 gather tma-store": Variant("fused", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                                     True, True, True, True, g1_gluon=True, g2_gluon=True,
                                                     g1_tma_store=True),
    # The Gluon GEMM2 writing y in expert order by TMA store; the combine reads through slot_pos.
    "split/fused gluon g1 g2 tma-store sorted-out": Variant("split", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                                            True, True, True, True, g1_gluon=True, g2_gluon=True,
                                                            g1_tma_store=True, g2_sorted_out=True),
    "fused/fused gluon g2 sorted-out M64": Variant("fused", "fused", 64, 128, 64, 8, 4, 4, 256, 64, 8, 4, 3,
                                                   True, True, False, True, g2_gluon=True, g2_sorted_out=True),
    # Half tails in the Gluon GEMMs: a block of at most 64 rows as one 64-row tile, columns split.
    "split/fused gluon g1 g2 half": Variant("split", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                            True, True, True, True, half_tail=True, g1_gluon=True, g2_gluon=True),
    "fused/fused gluon g1 gather g2 half tma-store sorted-out": Variant(
        "fused", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3, True, True, True, True, half_tail=True,
        g1_gluon=True, g2_gluon=True, g1_tma_store=True, g2_sorted_out=True),
    "split/fused triton g1 gluon g2 half": Variant("split", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                                   True, True, True, True, half_tail=True, g2_gluon=True),
    # Dynamic walks: each loader claims its next tile from a counter and posts it to its consumer.
    "split/fused gluon g1 g2 dynamic": Variant("split", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                               True, True, True, True, g1_gluon=True, g2_gluon=True, dynamic_walk=True),
    "fused/fused gluon g1 gather g2 half dynamic tma-store sorted-out": Variant(
        "fused", "fused", 128, 128, 64, 8, 8, 4, 256, 64, 8, 8, 3, True, True, True, True, half_tail=True,
        g1_gluon=True, g2_gluon=True, g1_tma_store=True, g2_sorted_out=True, dynamic_walk=True),
    "split/fused gluon g1 half dynamic, triton g2": Variant("split", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                                            True, True, True, False, half_tail=True, g1_gluon=True,
                                                            dynamic_walk=True),
    # The Gluon GEMM1's pair tiles: the tail's rows staged beside the full block's, one weight stream.
    "split/fused gluon g1 g2 half pair dynamic": Variant("split", "fused", 128, 128, 64, 8, 8, 3, 256, 64, 8, 8, 3,
                                                         True, True, True, True, half_tail=True, g1_gluon=True,
                                                         g2_gluon=True, dynamic_walk=True, g1_pair_tail=True),
    "split/fused gluon g1 half pair dynamic tma-store, triton g2": Variant(
        "split", "fused", 128, 64, 64, 8, 8, 4, 256, 64, 8, 8, 3, True, True, True, True, half_tail=True,
        g1_gluon=True, dynamic_walk=True, g1_pair_tail=True, g1_tma_store=True),
    # Pair tiles: an expert's last full block and its half tail in one program (T=4096: ~half the experts).
    "split/fused tma half pair": Variant("split", "fused", 128, 128, 64, 1, 8, 4, 128, 64, 1, 8, 3, True, True,
                                         pdl=True, half_tail=True, g1_pair_tail=True),
    "fused/fused half pair persistent": Variant("fused", "fused", 128, 64, 64, 8, 8, 3, 128, 64, 8, 8, 3,
                                                False, True, False, True, half_tail=True, g1_pair_tail=True,
                                                g2_pair_tail=True),
    # Swapped tails: a paired tail of at most 16 or 32 rows as the N side of a wgmma over the weight rows.
    "split/fused tma half pair swap": Variant("split", "fused", 128, 128, 64, 1, 8, 4, 256, 64, 1, 8, 3, True, True,
                                              pdl=True, half_tail=True, g1_pair_tail=True, g2_pair_tail=True,
                                              g1_swap_tail=32, g2_swap_tail=16),
    "fused/fused half pair swap persistent": Variant("fused", "fused", 128, 64, 64, 8, 8, 3, 128, 64, 8, 8, 3,
                                                     False, True, False, True, half_tail=True, g1_pair_tail=True,
                                                     g2_pair_tail=True, g1_swap_tail=16, g2_swap_tail=32),
    # Split dispatch's permutation by token: alone, and sharing slot_pos with the sorted-out Gluon GEMM2.
    "split/fused tma half pair by-token": Variant("split", "fused", 128, 128, 64, 1, 8, 4, 256, 64, 1, 8, 4, True, True,
                                                  half_tail=True, g1_pair_tail=True, g2_pair_tail=True,
                                                  permute_by_token=True),
    "split/fused gluon g1 g2 tma-store sorted-out by-token": Variant(
        "split", "fused", 128, 128, 64, 8, 8, 4, 256, 64, 8, 8, 3, True, True, True, True, g1_gluon=True,
        g2_gluon=True, g1_tma_store=True, g2_sorted_out=True, permute_by_token=True),
}


@pytest.fixture(scope="module")
def seed16_weights():
    return make_weights(SEED16_SHAPE, target.device(), seed=3)


# Direct dispatch reads each expert once per slot: meant for tiny T, far too slow at T=4096.
TINY_T_ONLY = {
    "direct/fused": Variant("fused", "fused", 16, 64, 128, 1, 4, 4, 64, 128, 1, 4, 4, direct=True),
    "direct/split tma pdl": Variant("fused", "split", 16, 64, 64, 1, 4, 4, 64, 64, 1, 4, 4, True, True, pdl=True,
                                    direct=True),
}
CASES = [(name, T) for name in VARIANTS for T in (1, 7, 300, 4096)] + [(n, T) for n in TINY_T_ONLY for T in (1, 2, 7)]


@pytest.mark.parametrize("name, T", CASES)  # T < 16: one-program dispatch
def test_seed16_bf16_matches_reference(seed16_weights, name, T):
    variant = VARIANTS.get(name) or TINY_T_ONLY[name]
    module = render.load_source(render.render_variant(variant))
    x, w, ids = make_tokens(Case(SEED16_SHAPE, T, seed=T), target.device())
    out = module.fused_experts(x, *seed16_weights, w, ids)
    stats = error_stats(out, moe_reference(x, *seed16_weights, w, ids))
    print(name, T, stats)
    assert not stats.failures(BAR), stats
    again = module.fused_experts(x, *seed16_weights, w, ids)
    assert torch.equal(out, again), "not bitwise deterministic"


# weight_layout=k64 on the GPU: the pointer, triton TMA and Gluon forms (the Gluon loaders have no
# interpreter) on a k-blocked copy compute the row-major output bit for bit.
K64_FORMS = ["fused/fused small", "fused/fused tma", "split/fused tma persistent half",
             "split/fused tma half pair swap", "split/fused gluon g1 g2 half pair dynamic",
             "fused/fused gluon g1 gather g2 half tma-store sorted-out",
             "split/fused gluon g1 half pair dynamic tma-store, triton g2"]


@pytest.fixture(scope="module")
def seed16_k64_weights(seed16_weights):
    import dataclasses

    any_k64 = render.load_source(render.render_variant(dataclasses.replace(VARIANTS["fused/fused small"],
                                                                           weight_layout="k64")))
    return any_k64.prepare_weights(*seed16_weights)


@pytest.mark.parametrize("T", [7, 4096])
@pytest.mark.parametrize("name", K64_FORMS)
def test_k_blocked_weights_compute_the_same_output(seed16_weights, seed16_k64_weights, name, T):
    import dataclasses

    variant = VARIANTS[name]
    rows, blocked = (render.load_source(render.render_variant(v))
                     for v in (variant, dataclasses.replace(variant, weight_layout="k64")))
    x, w, ids = make_tokens(Case(SEED16_SHAPE, T, seed=T), target.device())
    out = blocked.fused_experts(x, *seed16_k64_weights, w, ids)
    assert torch.equal(out, rows.fused_experts(x, *seed16_weights, w, ids))
    assert not error_stats(out, moe_reference(x, *seed16_weights, w, ids)).failures(BAR)


# An awkward shape for every form: H and I multiples of 16 bytes (what TMA asks) but of no tile size,
# so every K loop, column tile and TMA box ends part-way; 12 experts, k=3. (The forms' own rules may
# refuse some variants here, e.g. a BLOCK_K wider than K: those skip, naming the rule.)
ODD_SHAPE = Shape(E=12, H=208, I=120, k=3, dtype="bfloat16")
ODD_CASES = [Case(ODD_SHAPE, 1, seed=1), Case(ODD_SHAPE, 7, seed=7), Case(ODD_SHAPE, 333, seed=333),
             Case(ODD_SHAPE, 600, seed=600),  # ~150 rows an expert: a full block and a short tail (pairs)
             Case(ODD_SHAPE, 1500, routing="zipf", seed=1500)]  # zipf: one hot expert, some idle ones


def _odd_shape_form(name: str, case: Case):
    """Form `name`'s one-variant module and ODD_SHAPE's weights, or a skip naming the space's rules
    that refuse the form on `case`."""
    from autotune.space import violations

    variant = VARIANTS.get(name) or TINY_T_ONLY[name]
    bad = violations(variant, case)
    if bad:
        pytest.skip("; ".join(bad))
    return render.load_source(render.render_variant(variant)), *make_weights(ODD_SHAPE, target.device(), seed=11)


@pytest.mark.parametrize("case", ODD_CASES, ids=lambda c: f"T{c.T}-{c.routing}")
@pytest.mark.parametrize("name", list(VARIANTS) + list(TINY_T_ONLY))
def test_odd_shape_bf16_matches_reference(name, case):
    """Seed16's forms are not seed16-only: each runs a shape no tile divides, or its rules say why not."""
    if name in TINY_T_ONLY and case.T > 16:
        pytest.skip("direct dispatch is for tiny T")
    module, w13, w2 = _odd_shape_form(name, case)
    x, w, ids = make_tokens(case, target.device())
    out = module.fused_experts(x, w13, w2, w, ids)
    stats = error_stats(out, moe_reference(x, w13, w2, w, ids))
    print(name, case.T, case.routing, stats)
    assert not stats.failures(BAR), stats


@pytest.mark.parametrize("name", list(VARIANTS) + list(TINY_T_ONLY))
def test_invalid_ids_on_every_form(name):
    """Ids outside [0, E) (-1 for a dropped slot, garbage in a captured graph's padding rows) add
    nothing on every GPU form, the same expert twice counts twice, and a batch with no valid id (no
    block to walk) returns zeros."""
    case = Case(ODD_SHAPE, 7 if name in TINY_T_ONLY else 333, seed=41)
    module, w13, w2 = _odd_shape_form(name, case)
    x, w, ids = make_tokens(case, target.device())
    gen = torch.Generator(device=ids.device).manual_seed(5)
    dropped = torch.rand(ids.shape, generator=gen, device=ids.device) < 0.25
    minus_one = torch.rand(ids.shape, generator=gen, device=ids.device) < 0.5
    ids = ids.masked_fill(dropped & minus_one, -1).masked_fill(dropped & ~minus_one, ODD_SHAPE.E + 3)
    ids[0, 1] = ids[0, 0] = 2
    out = module.fused_experts(x, w13, w2, w, ids)
    stats = error_stats(out, moe_reference(x, w13, w2, w, ids))
    assert not stats.failures(BAR), stats
    none = module.fused_experts(x, w13, w2, w, torch.full_like(ids, -1))
    assert torch.equal(none, torch.zeros_like(x))


def test_offsets_past_2_pow_31():
    """T*k*H > 2**31: slot-order rows of y must use 64-bit offsets (a known crash in two peers)."""
    shape = Shape(E=8, H=4096, I=128, k=8, dtype="bfloat16")
    T = 2**31 // (shape.k * shape.H) + 1000
    module = render.load_source(render.render_variant(VARIANTS["fused/fused large"]))
    w13, w2 = make_weights(shape, target.device(), seed=5)
    x, w, ids = make_tokens(Case(shape, T, seed=9), target.device())
    out = module.fused_experts(x, w13, w2, w, ids)
    stats = error_stats(out[-4096:], moe_reference(x[-4096:], w13, w2, w[-4096:], ids[-4096:]))
    assert not stats.failures(BAR), stats


@pytest.mark.parametrize("name", ["fused/fused small", "fused/fused small pdl", "split/fused tma pdl", "direct/fused",
                                  "split/fused gluon g1 g2 dynamic"])
def test_cuda_graph_capture(name):
    """The op never synchronises the host: it can be captured and replayed (with PDL edges too, and
    with the dynamic walks' tile counters, which every replay must zero again)."""
    shape = Shape(E=16, H=512, I=256, k=4, dtype="bfloat16")
    module = render.load_source(render.render_variant(VARIANTS.get(name) or TINY_T_ONLY[name]))
    w13, w2 = make_weights(shape, target.device(), seed=5)
    x, w, ids = make_tokens(Case(shape, 64, seed=9), target.device())
    out = torch.empty_like(x)
    module.fused_experts(x, w13, w2, w, ids, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        module.fused_experts(x, w13, w2, w, ids, out=out)
    reference = moe_reference(x, w13, w2, w, ids)
    for _ in range(2):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert not error_stats(out, reference).failures(BAR)


def test_settle_runs_the_call_before_its_timing():
    """time_fn's settle runs `fn` for about settle_ms before the timed calls, and says so."""
    from autotune.timing import time_fn

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    calls = []

    def fn():
        torch.matmul(a, a, out=out)
        calls.append(1)

    plain = time_fn(fn, reps=3, graph=False)
    plain_calls = len(calls)
    calls.clear()
    settled = time_fn(fn, reps=3, graph=False, settle_ms=50)
    # A 2048^3 matmul takes ~25 us: 50 ms of settle is hundreds of calls more.
    assert plain.method == "cuda-events" and settled.method == "cuda-events, settled 50 ms"
    assert len(calls) > plain_calls + 100


# A routing-adaptive row at seed16: 16-row blocks for the experts routed few rows, TMA 128-row blocks
# with PDL for the hot ones (zipf routes most rows to a dozen experts).
HOT_ROW = render.Row(float("inf"), VARIANTS["fused/fused small pdl"], VARIANTS["split/fused tma pdl"], 64)


@pytest.mark.parametrize("routing", ["uniform", "zipf"])
@pytest.mark.parametrize("T", [7, 300, 1500])
def test_hot_split_bf16_matches_reference(seed16_weights, routing, T):
    module = render.load_source(render.render_module([HOT_ROW], "hot split", []))
    x, w, ids = make_tokens(Case(SEED16_SHAPE, T, routing, seed=T), target.device())
    out = module.fused_experts(x, *seed16_weights, w, ids)
    stats = error_stats(out, moe_reference(x, *seed16_weights, w, ids))
    assert not stats.failures(BAR), stats
    assert torch.equal(out, module.fused_experts(x, *seed16_weights, w, ids)), "not bitwise deterministic"


def test_hot_split_in_a_cuda_graph(seed16_weights):
    """A routing-adaptive call forks its cold side onto a second stream and joins it before the
    combine: a CUDA graph captures both, and replays match the reference under both routings."""
    module = render.load_source(render.render_module([HOT_ROW], "hot split", []))
    for routing in ("uniform", "zipf"):
        x, w, ids = make_tokens(Case(SEED16_SHAPE, 300, routing, seed=11), target.device())
        out = torch.empty_like(x)
        module.fused_experts(x, *seed16_weights, w, ids, out=out)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            module.fused_experts(x, *seed16_weights, w, ids, out=out)
        reference = moe_reference(x, *seed16_weights, w, ids)
        for _ in range(2):
            out.zero_()
            g.replay()
            torch.cuda.synchronize()
            assert not error_stats(out, reference).failures(BAR), routing


def test_a_module_tuned_on_another_architecture_refuses_before_any_launch(seed16_weights):
    """The module of another GPU raises, naming this one, and leaves `out` untouched; the same rows
    rendered for this GPU run."""
    row = render.Row(float("inf"), VARIANTS["fused/fused small pdl"])
    x, w, ids = make_tokens(Case(SEED16_SHAPE, 4, "uniform", seed=4), target.device())
    major, minor = torch.cuda.get_device_capability()
    other = render.TunedGpu("a GPU of another architecture", (major + 1, minor), "--shape 256,4096,2048,8")
    module = render.load_source(render.render_module([row], "another GPU's", [], other))
    out = torch.full_like(x, 7.0)
    with pytest.raises(ValueError, match=rf"compute capability {major}\.{minor}; this module was tuned"):
        module.fused_experts(x, *seed16_weights, w, ids, out=out)
    torch.cuda.synchronize()
    assert bool((out == 7.0).all()), "a kernel ran before the refusal"
    here = render.TunedGpu(torch.cuda.get_device_name(), (major, minor), "--shape 256,4096,2048,8")
    module = render.load_source(render.render_module([row], "this GPU's", [], here))
    stats = error_stats(module.fused_experts(x, *seed16_weights, w, ids), moe_reference(x, *seed16_weights, w, ids))
    assert not stats.failures(BAR), stats


# A module of several forms (direct, fused, a routing-adaptive pair, Gluon with the sorted-out GEMM2)
# with the planned launches of emitted modules (templates/fast_launch.py.j2).
PLANNED_ROWS = [
    render.Row(2, TINY_T_ONLY["direct/split tma pdl"]),
    render.Row(10, VARIANTS["fused/fused small pdl"]),
    render.Row(600, VARIANTS["fused/fused small pdl"], VARIANTS["split/fused tma pdl"], 64),
    render.Row(float("inf"), VARIANTS["split/fused gluon g1 g2 tma-store sorted-out by-token"]),
]


def test_planned_launches_match_tritons_launches(seed16_weights):
    """Calls of one key (after the first, taken from its plan) and of keys that differ in alignment,
    dtype and stride, interleaved: bitwise what triton's own launches give, and inside the bar."""
    module = render.load_source(render.render_module(PLANNED_ROWS, "planned", [], fast_launch=True))
    assert module._FAST_LAUNCH
    dev = target.device()
    H = SEED16_SHAPE.H
    for T in (1, 2, 7, 300, 1500):
        x, w, ids = make_tokens(Case(SEED16_SHAPE, T, "zipf" if T == 300 else "uniform", seed=T), dev)
        shifted = torch.cat([x.new_zeros(8), x.flatten()])[8:].view(x.shape)  # 16-byte aligned, another buffer
        odd = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape)  # 2-byte aligned
        calls = [(x, w, ids, None), (shifted, w.bfloat16(), ids.long(), None), (x, w, ids, 8), (odd, w, ids, None)]
        for x_, w_, ids_, pad in calls * 2:
            outs = []
            for planned in (True, True, False):
                module._FAST_LAUNCH = planned
                out = torch.full((T, H + (pad or 0)), 7.0, dtype=x.dtype, device=dev)[:, :H]
                try:
                    module.fused_experts(x_, *seed16_weights, w_, ids_, out=out)
                except ValueError as e:  # refused before any launch, as triton's path refuses it
                    outs.append(str(e))
                    continue
                outs.append(out.clone())
            if isinstance(outs[0], str):
                assert outs == [outs[0]] * 3, (T, outs)
                continue
            assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2]), (T, x_.data_ptr() % 16, pad)
        stats = error_stats(module.fused_experts(x, *seed16_weights, w, ids), moe_reference(x, *seed16_weights, w, ids))
        assert not stats.failures(BAR), stats
    module._FAST_LAUNCH = True
    assert module._PLANS, "no call was planned"
    # Inside a CUDA graph the planned launches are captured like triton's.
    x, w, ids = make_tokens(Case(SEED16_SHAPE, 300, "zipf", seed=5), dev)
    out = torch.empty_like(x)
    module.fused_experts(x, *seed16_weights, w, ids, out=out)
    expected = out.clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        module.fused_experts(x, *seed16_weights, w, ids, out=out)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_planned_launches_give_way_to_a_launch_hook(seed16_weights):
    """With a triton launch hook installed (profilers), every launch goes through triton and is seen."""
    import triton

    module = render.load_source(render.render_module(PLANNED_ROWS[:2], "planned", [], fast_launch=True))
    x, w, ids = make_tokens(Case(SEED16_SHAPE, 1, "uniform", seed=1), target.device())
    module.fused_experts(x, *seed16_weights, w, ids)  # planned from here on
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        module.fused_experts(x, *seed16_weights, w, ids)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(seen) >= 3, seen


# Eager calls of few tokens through the module's own CUDA graphs (templates/graph_replay.py.j2), on
# Qwen3-30B-A3B's smaller experts, where a graph matters most.
QWEN = Shape(E=128, H=2048, I=768, k=8)


def _graph_module(max_tokens: int = 8):
    rows = PLANNED_ROWS[:3]
    return render.load_source(render.render_module(rows, "graphed", [], fast_launch=True, graph_max_tokens=max_tokens))


def _graphs(module) -> int:
    return sum(isinstance(g, module._Graph) for g in module._GRAPHS.values())


def _launched(module, *args):
    """The call by the module's launches (no graph of its own), the module's setting restored."""
    setting, module._GRAPH_MAX_TOKENS = module._GRAPH_MAX_TOKENS, 0
    try:
        return module.fused_experts(*args)
    finally:
        module._GRAPH_MAX_TOKENS = setting


def test_graph_replays_match_launches():
    """Per token count: the first call eager, the second captured and replayed, later ones replayed,
    each on new inputs: bitwise what the module's launches give, into a strided out= and from a dense
    and a row-strided hidden_states, per weight pair and per stream; above _GRAPH_MAX_TOKENS no graph."""
    module = _graph_module()
    dev = target.device()
    weights = [make_weights(QWEN, dev, seed=s) for s in (3, 4)]
    side = torch.cuda.Stream()

    for T in (1, 2, 7, 8, 9):
        for call in range(4):
            for w13, w2 in weights:
                for stream in (torch.cuda.current_stream(), side):
                    with torch.cuda.stream(stream):
                        x, w, ids = make_tokens(Case(QWEN, T, "uniform", seed=10 * T + call), dev)
                        if call % 2:  # dense inputs stage as one byte copy, a row-strided x one by one
                            wide = torch.zeros((T, 2 * QWEN.H), dtype=x.dtype, device=dev)
                            wide[:, :QWEN.H] = x
                            x = wide[:, :QWEN.H]  # rows 2H apart
                        out = torch.full((T, QWEN.H + 8), 7.0, dtype=x.dtype, device=dev)
                        module.fused_experts(x, w13, w2, w, ids, out=out[:, :QWEN.H])
                        expected = _launched(module, x, w13, w2, w, ids)
                        stats = error_stats(out[:, :QWEN.H], moe_reference(x, w13, w2, w, ids))
                    torch.cuda.synchronize()
                    assert torch.equal(out[:, :QWEN.H], expected), (T, call)
                    assert bool((out[:, QWEN.H:] == 7.0).all()), "written past out's columns"
                    assert not stats.failures(BAR), stats
        # Two weight pairs x two streams: four graphs per token count up to the limit, none beyond.
        assert _graphs(module) == 4 * len([t for t in (1, 2, 7, 8) if t <= T]), (T, _graphs(module))


def _replaying(T: int):
    """A graph module and Qwen inputs of T tokens whose key has run eagerly, been captured and replayed:
    its next call replays."""
    module = _graph_module()
    dev = target.device()
    w13, w2 = make_weights(QWEN, dev, seed=3)
    x, w, ids = make_tokens(Case(QWEN, T, "uniform", seed=1), dev)
    for _ in range(3):  # eager, captured, replayed
        module.fused_experts(x, w13, w2, w, ids)
    torch.cuda.synchronize()
    assert _graphs(module) == 1
    return module, (x, w13, w2, w, ids)


def test_a_replay_of_dense_inputs_runs_two_kernels_beside_its_graph():
    """A replayed call of dense inputs stages all three in one byte copy and copies the output out:
    two kernels of torch's besides the graph's own (triton's, named after the module's functions)."""
    from torch.profiler import ProfilerActivity, profile

    module, (x, w13, w2, w, ids) = _replaying(2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        module.fused_experts(x, w13, w2, w, ids)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    torch_kernels = [name for name in kernels if not name.startswith("_")]
    assert len(torch_kernels) == 2 and len(kernels) > 2, kernels


def test_kernel_breakdown_profiles_a_replaying_call_by_its_launches():
    """A call the module would replay from its own graph: the bench's breakdown shows its kernels
    launched one by one (timing.own_launches), not the replay's copies (torch's kernels) nor kernels
    whose time counts a PDL wait (NOTES 93)."""
    from autotune import timing

    module, (x, w13, w2, w, ids) = _replaying(1)
    kernels = timing.kernel_breakdown(lambda: module.fused_experts(x, w13, w2, w, ids))
    assert kernels and all(k["name"].startswith("_") for k in kernels), kernels


def test_graph_replays_serve_threads_and_step_aside_in_a_capture():
    """Threads calling one key on one stream (one graph's buffers) each get their own result; inside
    the caller's CUDA graph capture the module's kernels are captured, not its graph replayed."""
    import threading

    module = _graph_module()
    dev = target.device()
    w13, w2 = make_weights(QWEN, dev, seed=3)
    inputs = [make_tokens(Case(QWEN, 4, "uniform", seed=s), dev) for s in range(4)]
    expected = []
    for x, w, ids in inputs:
        expected.append(_launched(module, x, w13, w2, w, ids))
    results = {}

    def work(i):
        x, w, ids = inputs[i]
        results[i] = [module.fused_experts(x, w13, w2, w, ids) for _ in range(30)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert _graphs(module) == 1
    for i in range(4):
        assert all(torch.equal(r, expected[i]) for r in results[i]), i
    # The caller's capture: the graph replayed later computes what the module computes eagerly.
    x, w, ids = inputs[0]
    out = torch.empty_like(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        module.fused_experts(x, w13, w2, w, ids, out=out)
    for i in range(1, 4):
        for captured, new in zip((x, w, ids), inputs[i], strict=True):
            captured.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected[i]), i
    assert _graphs(module) == 1


def test_graph_replays_give_way_to_a_launch_hook():
    """With a triton launch hook installed, a call that would replay a graph launches its kernels."""
    import triton

    module = _graph_module()
    dev = target.device()
    w13, w2 = make_weights(QWEN, dev, seed=3)
    x, w, ids = make_tokens(Case(QWEN, 1, "uniform", seed=1), dev)
    for _ in range(3):
        module.fused_experts(x, w13, w2, w, ids)
    assert _graphs(module) == 1
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        module.fused_experts(x, w13, w2, w, ids)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(seen) >= 3, seen


def test_graph_replays_stay_out_of_torch_compile():
    """A compiled caller (mode="reduce-overhead": torch's own CUDA graphs, warm-up runs included)
    gets the module's kernels, bitwise the eager call's output, and no graph of the module's."""
    module = render.load_source(render.render_module(PLANNED_ROWS[:3], "graphed", [], op_name="graphed_gpu_test",
                                                     fast_launch=True, graph_max_tokens=8))
    dev = target.device()
    w13, w2 = make_weights(QWEN, dev, seed=3)
    layer = torch.compile(lambda x, w, ids: module.fused_experts(x, w13, w2, w, ids) * 2, mode="reduce-overhead",
                          fullgraph=True)
    for call in range(6):
        x, w, ids = make_tokens(Case(QWEN, 1, "uniform", seed=call), dev)
        got = layer(x, w, ids).clone()
        expected = _launched(module, x, w13, w2, w, ids) * 2
        torch.cuda.synchronize()
        assert torch.equal(got, expected), call
    assert _graphs(module) == 0


def test_a_graph_that_cannot_be_captured_leaves_its_calls_eager():
    """A capture that fails warns once and leaves its key eager, with the right output; past
    _MAX_GRAPHS keys, calls run eagerly too."""
    module = _graph_module()
    dev = target.device()
    w13, w2 = make_weights(QWEN, dev, seed=3)
    run = module._run_planned

    def uncapturable(*args):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed while capturing: the capture fails
        run(*args)

    module._run_planned = uncapturable
    x, w, ids = make_tokens(Case(QWEN, 2, "uniform", seed=1), dev)
    expected = module.fused_experts(x, w13, w2, w, ids)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        got = module.fused_experts(x, w13, w2, w, ids)
    assert torch.equal(got, expected) and _graphs(module) == 0
    assert torch.equal(module.fused_experts(x, w13, w2, w, ids), expected)  # no second try, no warning
    module._run_planned, module._MAX_GRAPHS = run, 2  # the failed key holds one of the two
    for T in (1, 4):
        x, w, ids = make_tokens(Case(QWEN, T, "uniform", seed=T), dev)
        outs = [module.fused_experts(x, w13, w2, w, ids) for _ in range(3)]
        assert all(torch.equal(o, outs[0]) for o in outs)
    assert _graphs(module) == 1 and len(module._GRAPHS) == 2
