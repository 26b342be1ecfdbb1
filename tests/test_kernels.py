"""Every template form against the reference (interpreter on the CPU: fp16/fp32, tiny odd shapes),
the dispatch outputs exactly against torch, and the edge cases of REFERENCE.md."""

import dataclasses
import functools

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, DTYPES, FORMS, small_variant

from autotune import render
from autotune.reference import BAR, error_stats, moe_reference
from autotune.workloads import Case, Shape, make_tokens, make_weights


def inputs(E=8, H=64, I=48, k=2, T=5, dtype=torch.float16, seed=0, routing="uniform"):  # noqa: E741
    shape = Shape(E, H, I, k, {torch.float16: "float16", torch.float32: "float32",
                               torch.bfloat16: "bfloat16"}[dtype])
    w13, w2 = make_weights(shape, DEVICE, seed=seed)
    x, w, ids = make_tokens(Case(shape, T, routing, seed=seed + T), DEVICE)
    return x, w13, w2, w, ids


def assert_matches(module, x, w13, w2, w, ids):
    out = module.fused_experts(x, w13, w2, w, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    stats = error_stats(out, moe_reference(x, w13, w2, w, ids))
    assert not stats.failures(BAR), stats
    return out


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H, I", [(1, 64, 48), (37, 80, 40)])  # 80 and 40: no power of two, K tails
def test_forms_match_reference(form_modules, form, dtype, T, H, I):  # noqa: E741
    assert_matches(form_modules[form], *inputs(H=H, I=I, T=T, dtype=dtype))


@pytest.mark.parametrize("form", [f for f in FORMS if f[4:5] == (True,)])
def test_half_tail_mixes_full_and_half_blocks(form_modules, form):
    """~35 rows per expert in 32-row blocks: full blocks, tails over half a block (full tile, masked)
    and tails of at most half (half-height tile) in one launch."""
    assert_matches(form_modules[form], *inputs(E=4, T=70, dtype=DTYPES[0]))


def torch_dispatch(ids, E, block_m):
    """Stable sort of slots by expert, each expert padded to block_m: the spec of the dispatch kernels."""
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    slots = torch.arange(flat.numel())[valid.cpu()]
    order = torch.sort(flat[valid].cpu(), stable=True)
    expert_blocks, block_rows, sorted_slots = [], [], []
    for e in range(E):
        mine = slots[order.indices[order.values == e]]
        for b in range(0, mine.numel(), block_m):
            chunk = mine[b:b + block_m]
            expert_blocks.append(e)
            block_rows.append(chunk.numel())
            sorted_slots.append(chunk)
    return torch.tensor(expert_blocks, dtype=torch.int32), torch.tensor(block_rows, dtype=torch.int32), sorted_slots


@pytest.mark.parametrize("E, T, k, block_m", [(8, 1, 2, 16), (5, 300, 3, 16), (64, 70, 4, 32), (3, 50, 2, 128),
                                              (40, 3000, 3, 16), (300, 100, 4, 16)])
def test_dispatch_exact(form_modules, E, T, k, block_m):
    """Integers compare exactly: block -> expert map, rows per block, and the slots in stable order.
    T=300 x k=3 spans several 128-slot chunks, so the cross-chunk prefix is exercised; T=3000 x k=3
    spans several scan steps and scan programs; E=300 needs more block-map programs than chunks."""
    gen = torch.Generator().manual_seed(E * T)
    ids = torch.randint(-1, E + 2, (T, k), generator=gen)  # includes -1 and out-of-range ids
    ids[0, 0] = 2**32 + 1  # must not wrap around to expert 1 when narrowed
    module = form_modules[("fused", "fused", False, False)]
    sorted_slots, block_expert, block_rows, num_blocks = module.dispatch(ids.to(DEVICE), E, block_m)
    want_expert, want_rows, want_slots = torch_dispatch(ids, E, block_m)
    n = want_expert.numel()
    assert int(num_blocks) == n
    assert torch.equal(block_expert[:n].cpu(), want_expert)
    assert torch.equal(block_rows[:n].cpu(), want_rows)
    assert (block_expert[n:] == -1).all() and (block_rows[n:] == 0).all()
    for b, want in enumerate(want_slots):
        got = sorted_slots[b * block_m: b * block_m + want.numel()].cpu().long()
        assert torch.equal(got, want), f"block {b}"


@pytest.fixture(scope="module")
def sorted_out_module():
    """A module rendered with g2_sorted_out (a Gluon GEMM2, which only compiles here): its dispatch
    and combine are triton and run under the interpreter."""
    v = dataclasses.replace(small_variant("split", tma=True, persistent=True, block_m=64), g2_gluon=True,
                            g2_sorted_out=True)
    return render.load_source(render.render_variant(v))


@pytest.mark.parametrize("E, T, k, block_m", [(8, 1, 2, 16), (5, 300, 3, 32), (40, 3000, 3, 64)])
def test_dispatch_writes_each_slots_sorted_position(sorted_out_module, E, T, k, block_m):
    """slot_pos inverts sorted_slots on every routed slot (one chunk and many), and is left alone on
    slots with an id outside [0, E)."""
    gen = torch.Generator().manual_seed(E * T + 2)
    ids = torch.randint(-1, E + 2, (T, k), generator=gen)
    slot_pos = torch.full((T * k,), -7, dtype=torch.int32, device=DEVICE)
    sorted_slots, *_ = sorted_out_module.dispatch(ids.to(DEVICE), E, block_m, slot_pos=slot_pos)
    routed = ((ids >= 0) & (ids < E)).view(-1)
    pos = slot_pos.cpu().long()
    assert (pos[~routed] == -7).all()
    slots = torch.arange(T * k)[routed]
    assert torch.equal(sorted_slots.cpu().long()[pos[routed]], slots)


def test_combine_reads_expert_ordered_rows_through_slot_pos(sorted_out_module):
    """With SORTED the combine sums y[slot_pos[t*k + j]] over routed j, in j order: the same numbers
    as the slot-order combine over the same rows."""
    T, k, E, H = 7, 3, 4, 96
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(-1, E, (T, k), generator=gen).to(DEVICE)
    y_slots = torch.randn(T * k, H, generator=gen).to(DEVICE, torch.float16)
    perm = torch.randperm(T * k + 5, generator=gen)[:T * k].to(DEVICE)  # padded, shuffled positions
    y_sorted = torch.full((T * k + 5, H), float("nan"), dtype=torch.float16, device=DEVICE)
    y_sorted[perm] = y_slots
    outs = []
    for y, pos, sorted_ in ((y_slots, y_slots, False), (y_sorted, perm.to(torch.int32), True)):
        out = torch.empty(T, H, dtype=torch.float16, device=DEVICE)
        sorted_out_module._combine_kernel[(T, 1)](y, ids.view(-1), out, H, E, y.stride(0), out.stride(0), TOP_K=k,
                                                  BLOCK_H=128, PDL=False, slot_pos_ptr=pos, SORTED=sorted_)
        outs.append(out)
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("E, T, k, block_m", [(8, 1, 2, 32), (5, 300, 3, 32), (64, 70, 4, 32), (40, 3000, 3, 64)])
def test_dispatch_walk_lists(form_modules, E, T, k, block_m):
    """The tail walk's lists: every used block once, in block order, an expert's last block holding
    1 to block_m/2 rows in the tail list and every other block in the full list."""
    gen = torch.Generator().manual_seed(E * T + 1)
    ids = torch.randint(-1, E + 2, (T, k), generator=gen)
    module = form_modules[("split", "fused", True, True, True, True)]
    lists = tuple(torch.full((module._max_blocks(T * k, E, block_m),), -7, dtype=torch.int32, device=DEVICE)
                  for _ in range(2))
    _, block_expert, block_rows, num_blocks = module.dispatch(ids.to(DEVICE), E, block_m, walk_lists=lists)
    want_expert, want_rows, _ = torch_dispatch(ids, E, block_m)
    last = torch.ones_like(want_expert, dtype=torch.bool)
    last[:-1] = want_expert[1:] != want_expert[:-1]
    half = last & (want_rows <= block_m // 2)
    blocks = torch.arange(want_expert.numel(), dtype=torch.int32)
    want_full, want_tail = blocks[~half], blocks[half]
    assert num_blocks.cpu().tolist() == [want_expert.numel(), want_full.numel(), want_tail.numel()]
    full, tail = (t.cpu() for t in lists)
    assert torch.equal(full[:want_full.numel()], want_full)
    assert torch.equal(tail[:want_tail.numel()], want_tail)


# group_by_expert over the GEMM forms it applies to (not direct, tail walks or pairs): plain and
# persistent walks, pointer and TMA rows, with and without half tails, each with groups of one block and
# of up to four within an expert.
EXPERT_GROUP_FORMS = [("fused", "fused", False, False), ("fused", "split", False, True),
                      ("split", "fused", True, True), ("split", "split", True, False),
                      ("fused", "split", False, False, True), ("split", "fused", True, True, True)]


@functools.cache
def expert_group_module(form, group_m):
    v = dataclasses.replace(small_variant(*form, group_m=group_m), group_by_expert=True)
    return render.load_source(render.render_variant(v))


_walk_module = None  # the module whose _expert_coords _expert_walk_kernel calls


@pytest.mark.parametrize("E, T, k, block_m", [(8, 1, 2, 16), (5, 300, 3, 16), (40, 3000, 3, 64), (300, 100, 4, 16)])
def test_dispatch_writes_each_blocks_expert_span(E, T, k, block_m):
    """With spans, num_blocks[4 + 2b] and [5 + 2b] hold block b's expert's first block and block count;
    a block past the last used one spans itself alone."""
    gen = torch.Generator().manual_seed(E * T + 3)
    ids = torch.randint(-1, E + 2, (T, k), generator=gen)
    module = expert_group_module(EXPERT_GROUP_FORMS[0], 4)
    _, block_expert, _, num_blocks = module.dispatch(ids.to(DEVICE), E, block_m, spans=True)
    want_expert, _, _ = torch_dispatch(ids, E, block_m)
    n, max_blocks = want_expert.numel(), block_expert.numel()
    spans = num_blocks.cpu()[4:4 + 2 * max_blocks].view(-1, 2)
    assert int(num_blocks[0]) == n and spans.shape[0] == max_blocks
    for b in range(max_blocks):
        if b < n:
            mine = (want_expert == want_expert[b]).nonzero().view(-1)
            assert spans[b].tolist() == [int(mine[0]), mine.numel()], f"block {b}"
        else:
            assert spans[b].tolist() == [b, 1], f"block {b}"


@triton.jit
def _expert_walk_kernel(num_blocks_ptr, out_ptr, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Each tile's (row block, column tile) under the walk of the module under test (_walk_module)."""
    tile = tl.program_id(0)
    pid_m, pid_n = _walk_module._expert_coords(tile, num_pid_m, num_pid_n, num_blocks_ptr, GROUP_M)
    tl.store(out_ptr + 2 * tile, pid_m)
    tl.store(out_ptr + 2 * tile + 1, pid_n)


@pytest.mark.parametrize("group_m", [1, 4])
def test_expert_walk_groups_each_experts_blocks_and_visits_every_tile_once(group_m):
    """Walk order, exactly: expert after expert; within one, groups of up to group_m of its blocks, each
    group down every column tile in turn, as _tile_coords walks a whole matrix."""
    global _walk_module
    _walk_module = expert_group_module(EXPERT_GROUP_FORMS[0], group_m)
    E, T, k, block_m, num_pid_n = 6, 200, 2, 16, 3
    ids = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(11))
    _, block_expert, _, num_blocks = _walk_module.dispatch(ids.to(DEVICE), E, block_m, spans=True)
    n = int(num_blocks[0])
    out = torch.full((n * num_pid_n, 2), -1, dtype=torch.int32, device=DEVICE)
    _expert_walk_kernel[(n * num_pid_n,)](num_blocks, out, n, num_pid_n, GROUP_M=-group_m)
    experts = block_expert[:n].cpu().tolist()
    want = []
    for e in sorted(set(experts)):
        first, count = experts.index(e), experts.count(e)
        for g0 in range(0, count, group_m):
            want += [(m, c) for c in range(num_pid_n) for m in range(first + g0, first + min(g0 + group_m, count))]
    assert max(experts.count(e) for e in experts) > group_m  # some expert spans several groups
    assert [tuple(c) for c in out.cpu().tolist()] == want


@pytest.mark.parametrize("form", EXPERT_GROUP_FORMS)
@pytest.mark.parametrize("group_m", [1, 4])
def test_expert_groups_match_reference(form, group_m):
    """Experts of several row blocks (E=4, 70 tokens x 2: ~35 rows, in 16-row blocks, or with half tails a
    32-row block and a half tail) and a one-token call."""
    module = expert_group_module(form, group_m)
    assert_matches(module, *inputs(E=4, T=70, dtype=DTYPES[0]))
    assert_matches(module, *inputs(T=1, dtype=DTYPES[0]))


class TestEdgeCases:
    # The sorted dispatch, and the direct one that reads topk_ids in the GEMMs themselves.
    @pytest.fixture(params=[("fused", "fused", False, False), ("direct", "fused", False, False),
                            ("split", "fused", True, True, True), ("split", "fused", True, True, True, True),
                            ("fused", "fused", False, False, True, False, True),
                            ("split", "fused", False, False, False, False, False, True)],
                    ids=["sorted", "direct", "half_tail", "tail_walk", "pair_tail", "by_token"])
    def module(self, form_modules, request):
        return form_modules[request.param]

    def test_zero_tokens_launches_nothing(self, module):
        x, w13, w2, w, ids = inputs(T=1)
        out = module.fused_experts(x[:0], w13, w2, w[:0], ids[:0])
        assert out.shape == (0, x.shape[1])

    def test_one_hot_expert_and_empty_experts(self, module):
        x, w13, w2, w, ids = inputs(T=40)
        ids[:, 0] = 3  # every token on expert 3; most experts get nothing from slot 0
        ids[:, 1] = 5
        assert_matches(module, x, w13, w2, w, ids)

    def test_invalid_and_duplicate_ids(self, module):
        x, w13, w2, w, ids = inputs(T=6)
        ids[0, 0] = -1
        ids[1, :] = -1  # a token with no expert here: zero output row
        ids[2, 1] = 1000  # garbage from a padded CUDA-graph row
        ids[3, 1] = ids[3, 0]  # the same expert twice counts twice
        ids[4, 0] = -7
        ids[5, 0] = 2**32 + 1  # an int64 id that narrowing to int32 would turn into expert 1
        out = assert_matches(module, x, w13, w2, w, ids)
        assert torch.equal(out[1], torch.zeros_like(out[1]))

    def test_int32_ids_and_bf16_weights_input(self, module):
        x, w13, w2, w, ids = inputs(T=9)
        assert_matches(module, x, w13, w2, w.to(torch.bfloat16), ids.to(torch.int32))

    def test_non_contiguous_views(self, module):
        x, w13, w2, w, ids = inputs(T=12)
        x_wide = torch.zeros(12, 2 * x.shape[1], dtype=x.dtype, device=x.device)
        x_wide[:, ::2] = x
        strided = x_wide[:, ::2]  # last-dim stride 2: copied before launch
        row_view = x_wide[:, : x.shape[1]]  # row stride 2H: used in place
        row_view.copy_(x)
        ids_t = ids.t().contiguous().t()  # column-major ids
        assert_matches(module, strided, w13, w2, w, ids_t)
        assert_matches(module, row_view, w13, w2, w, ids)

    def test_nan_token_stays_in_its_row(self, module):
        x, w13, w2, w, ids = inputs(T=20)
        x[7, 3] = float("nan")
        out = module.fused_experts(x, w13, w2, w, ids)
        assert torch.isnan(out[7]).any()
        keep = torch.ones(20, dtype=torch.bool)
        keep[7] = False
        ref = moe_reference(x[keep], w13, w2, w[keep], ids[keep])
        assert not error_stats(out[keep], ref).failures()

    def test_out_argument_and_determinism(self, module):
        x, w13, w2, w, ids = inputs(T=15)
        out = torch.full_like(x, float("nan"))
        first = module.fused_experts(x, w13, w2, w, ids, out=out)
        assert first is out
        assert torch.equal(first, module.fused_experts(x, w13, w2, w, ids))

    def test_validate_names_first_bad_slot(self, module):
        x, w13, w2, w, ids = inputs(T=4)
        ids[2, 1] = 8  # E = 8
        with pytest.raises(ValueError, match=r"topk_ids\[2, 1\] = 8"):
            module.fused_experts(x, w13, w2, w, ids, validate=True)
        ids[2, 1] = -1
        module.fused_experts(x, w13, w2, w, ids, validate=True)

    @pytest.mark.parametrize("arg, make, error, match", [
        ("hidden_states", lambda a: a[0].to(torch.int32), TypeError, "hidden_states must be bf16"),
        ("w13", lambda a: a[1][:, :-1], ValueError, "w13 must be"),
        ("w2", lambda a: a[2].double(), TypeError, "w2 must have the dtype"),
        ("w2", lambda a: a[2][:, :, :-1], ValueError, "w2 must be"),
        ("topk_weights", lambda a: a[3][:-1], ValueError, "topk_weights must be"),
        ("topk_weights", lambda a: a[3].to(torch.int64), TypeError, "topk_weights must be"),
        ("topk_ids", lambda a: a[4].float(), TypeError, "topk_ids must be int32 or int64"),
        ("topk_ids", lambda a: a[4][:, None], ValueError, "topk_ids must have 2 dimensions"),
        ("w13", lambda a: a[1].transpose(1, 2).contiguous().transpose(1, 2), ValueError, "w13 must be contiguous"),
        ("hidden_states", lambda a: a[0].tolist(), TypeError, "hidden_states must be a torch.Tensor"),
    ])
    def test_bad_arguments_raise_before_launch(self, module, arg, make, error, match):
        args = list(inputs(T=3))
        names = ["hidden_states", "w13", "w2", "topk_weights", "topk_ids"]
        args[names.index(arg)] = make(args)
        with pytest.raises(error, match=match):
            module.fused_experts(*args)

    def test_bad_out_and_device(self, module):
        x, w13, w2, w, ids = inputs(T=3)
        with pytest.raises(ValueError, match="out must be"):
            module.fused_experts(x, w13, w2, w, ids, out=torch.empty(3, 5, dtype=x.dtype, device=x.device))
        with pytest.raises(ValueError, match="meta"):
            module.fused_experts(x, w13.to("meta"), w2, w, ids)


@pytest.mark.parametrize("which", [1, 2])
def test_one_gemm_pairs_its_tails(which):
    """g1_pair_tail and g2_pair_tail are separate choices (a pair stages more rows per program, which can
    cost one GEMM its second resident program): each alone matches the reference."""
    v = dataclasses.replace(small_variant("split", tma=True, half_tail=True), **{f"g{which}_pair_tail": True})
    module = render.load_source(render.render_variant(v))
    assert [getattr(module.VARIANTS[0], f"g{w}_pair_tail", False) for w in (1, 2)] == [which == 1, which == 2]
    assert_matches(module, *inputs(E=4, T=70, dtype=DTYPES[0]))


@pytest.mark.parametrize("form", [("fused", "fused", False, False), ("split", "fused", True, False),
                                  ("fused", "split", True, True)])
def test_swapped_tails_are_the_narrow_side_of_their_dot(form):
    """g1/g2_swap_tail: ~70-80 rows per expert in 64-row blocks, so each expert gets a full block and a
    paired tail (here of 4-21 rows); tails of at most 16 run as a [weight rows, 16] dot (transposed epilogue
    and scatter), longer ones as the half-height pair. Pointer rows, TMA rows and persistent forms."""
    v = dataclasses.replace(small_variant(*form, half_tail=True, pair_tail=True, block_m=64), g1_swap_tail=16,
                            g2_swap_tail=16)
    module = render.load_source(render.render_variant(v))
    assert (module.VARIANTS[0].g1_swap_tail, module.VARIANTS[0].g2_swap_tail) == (16, 16)
    for T in (140, 160):
        assert_matches(module, *inputs(E=4, T=T, dtype=DTYPES[0]))
