"""The k-blocked weight layout (weight_layout=k64): every GEMM form reads the prepared copy and computes
exactly what it computes on the row-major weights; a module of that layout refuses any other."""

import dataclasses
import math

import pytest
import torch
from conftest import DEVICE, DTYPES, FORMS, small_variant

from autotune import render, space
from autotune.reference import BAR, error_stats, moe_reference
from autotune.runner import CaseState
from autotune.workloads import Case, Shape, make_tokens, make_weights

# H and I multiples of the layout's 64-column block; T gives most experts a block and a tail.
SHAPE = Shape(4, 128, 64, 2, str(DTYPES[0]).removeprefix("torch."))


def _k64(v):
    return dataclasses.replace(v, weight_layout="k64")


@pytest.fixture(scope="module")
def weights():
    return make_weights(SHAPE, DEVICE, seed=2)


def _assert_reads_the_copy_exactly(v, case, weights):
    """v's k64 form, on the copy prepare_weights makes, gives v's row-major output bit for bit (a kernel
    that read a wrong element of the copy could not match it), and within the bar."""
    assert not space.violations(_k64(v), case)
    rows, blocked = (render.load_source(render.render_variant(x)) for x in (v, _k64(v)))
    x, w, ids = make_tokens(case, DEVICE)
    out = blocked.fused_experts(x, *blocked.prepare_weights(*weights), w, ids)
    assert torch.equal(out, rows.fused_experts(x, *weights, w, ids))
    assert not error_stats(out, moe_reference(x, *weights, w, ids)).failures(BAR)


@pytest.mark.parametrize("form", FORMS)
def test_every_form_reads_the_k_blocked_copy_exactly(form, weights):
    """Same tiles, same order along K, other addresses: the row-major output, bit for bit."""
    v = small_variant(*form, bk=64)
    case = Case(SHAPE, 3 if form[0] == "direct" else 37, seed=5)
    _assert_reads_the_copy_exactly(v, case, weights)


@pytest.fixture(scope="module")
def blocked_module():
    return render.load_source(render.render_variant(_k64(small_variant(tma=True, bk=64))))


def test_prepare_weights_blocks_k(blocked_module, weights):
    w13, w2 = weights
    p13, p2 = blocked_module.prepare_weights(w13, w2)
    assert p13.shape == (4, 128 // 64, 128, 64) and p2.shape == (4, 64 // 64, 128, 64)
    assert p13.is_contiguous() and p2.is_contiguous()
    assert torch.equal(p13[1, 1, 5], w13[1, 5, 64:128])  # expert 1, K block 1, row 5
    assert torch.equal(p2[3, 0, 100], w2[3, 100, :64])


def test_prepare_weights_in_place_rewrites_the_storage(blocked_module, weights):
    """in_place: the same k-blocked tensors as the copy, in the inputs' own storage; a strided input
    is refused by name before anything is written."""
    copy13, copy2 = blocked_module.prepare_weights(*weights)
    w13, w2 = (w.clone() for w in weights)
    ptrs = (w13.data_ptr(), w2.data_ptr())
    p13, p2 = blocked_module.prepare_weights(w13, w2, in_place=True)
    assert torch.equal(p13, copy13) and torch.equal(p2, copy2) and p13.is_contiguous()
    assert (p13.data_ptr(), p2.data_ptr()) == ptrs
    x, w, ids = make_tokens(Case(SHAPE, 9, seed=4), DEVICE)
    assert torch.equal(blocked_module.fused_experts(x, p13, p2, w, ids),
                       blocked_module.fused_experts(x, copy13, copy2, w, ids))
    params = [torch.nn.Parameter(w.clone()) for w in weights]  # as a model holds them: requiring grad
    p13, p2 = blocked_module.prepare_weights(*params, in_place=True)
    assert torch.equal(p13, copy13) and not p13.requires_grad
    strided13 = weights[0].clone().transpose(1, 2).contiguous().transpose(1, 2)
    before = strided13.clone()
    with pytest.raises(ValueError, match="w13: in_place rewrites a contiguous tensor"):
        blocked_module.prepare_weights(strided13, weights[1].clone(), in_place=True)
    assert torch.equal(strided13, before)


def test_a_k_blocked_module_refuses_other_weights_by_name(blocked_module, weights):
    x, w, ids = make_tokens(Case(SHAPE, 5), DEVICE)
    with pytest.raises(ValueError, match=r"w13 is \[E, N, K\].*prepare_weights"):
        blocked_module.fused_experts(x, *weights, w, ids)
    p13, p2 = blocked_module.prepare_weights(*weights)
    with pytest.raises(ValueError, match="w2 must be the k-blocked"):
        blocked_module.fused_experts(x, p13, p13, w, ids)
    with pytest.raises(ValueError, match="w13 must be contiguous"):
        blocked_module.fused_experts(x, p13.transpose(2, 3).contiguous().transpose(2, 3), p2, w, ids)
    odd13, odd2 = (torch.zeros(*shape, dtype=weights[0].dtype, device=DEVICE) for shape in ((4, 128, 96), (4, 96, 64)))
    with pytest.raises(ValueError, match="w13: its last dimension \\(96\\) must be a multiple of 64"):
        blocked_module.prepare_weights(odd13, odd2)
    with pytest.raises(ValueError, match="must be \\[E, 2I, H\\] and \\[E, H, I\\]"):
        blocked_module.prepare_weights(weights[0], weights[0])


@pytest.mark.parametrize("form", [("fused", "fused", False, False), ("split", "split", False, True)])
def test_pointer_loads_step_two_blocks_at_a_time(form):
    """BLOCK_K = 128 on the k-blocked copy: each step's tile spans two blocks of K."""
    shape = Shape(4, 256, 128, 2, SHAPE.dtype)
    v = small_variant(*form, bk=128)
    case = Case(shape, 21, seed=1)
    _assert_reads_the_copy_exactly(v, case, make_weights(shape, DEVICE, seed=3))


@pytest.mark.parametrize("form", [("fused", "fused", False, False), ("split", "fused", True, False),
                                  ("fused", "split", True, True)])
def test_swapped_tails_read_the_k_blocked_copy_exactly(form, weights):
    """g1/g2_swap_tail on the copy: a paired tail of at most 16 rows runs as a [weight rows, 16] dot
    whose weight operand is the full block's tile (here every expert has a 64-row block and a tail of
    3-10 rows); pointer rows, TMA rows and persistent forms, bit for bit the row-major output."""
    v = dataclasses.replace(small_variant(*form, half_tail=True, pair_tail=True, block_m=64, bk=64),
                            g1_swap_tail=16, g2_swap_tail=16)
    case = Case(SHAPE, 140, seed=140)
    _assert_reads_the_copy_exactly(v, case, weights)


def test_the_space_keeps_k64_to_whole_blocks():
    case = Case(SHAPE, 37)
    tma128 = space.violations(_k64(small_variant(tma=True, bk=128)), Case(Shape(4, 256, 128, 2, SHAPE.dtype), 37))
    assert any("g1_block_k must be 64" in r for r in tma128) and any("g2_block_k must be 64" in r for r in tma128)
    assert any("multiple of 64" in r for r in space.violations(_k64(small_variant(bk=32)), case))
    odd = Case(Shape(4, 96, 64, 2, SHAPE.dtype), 37)
    assert any("H=96 and I=64 must be multiples of 64" in r for r in space.violations(_k64(small_variant(bk=64)), odd))
    when = space.PARAM_BY_NAME["weight_layout"].when
    assert when(small_variant(bk=64).as_dict(), case) and not when(small_variant(bk=64).as_dict(), odd)


def test_a_module_reads_one_layout():
    rows = [render.Row(8, small_variant(bk=64)), render.Row(math.inf, _k64(small_variant(bk=64)))]
    with pytest.raises(ValueError, match="one layout"):
        render.render_module(rows, "mixed", [])


def test_trials_of_a_k_blocked_variant_run_on_prepared_copies_made_once(blocked_module):
    state = CaseState()
    state.prepare(Case(SHAPE, 5))
    rows_module = render.load_source(render.render_variant(small_variant(bk=64)))
    assert state.weights_for(rows_module) == (state.weights, state.verify_weights)
    timed, verify = state.weights_for(blocked_module)
    assert timed[0].dim() == 4 and torch.equal(timed[0], blocked_module.prepare_weights(*state.weights)[0])
    assert torch.equal(verify[1], blocked_module.prepare_weights(*state.verify_weights)[1])
    assert state.weights_for(blocked_module)[0][0] is timed[0]


def _record(s, run, fp, case, v, ms, floor=1.0):
    from autotune import db

    db.record_trial(s, run_id=run.id, study="t", fingerprint=fp.key, case_key=case.key, case=case.as_dict(),
                    params=v.as_dict(), label=v.label, source_hash=render.variant_hash(v), status="ok",
                    median_ms=ms, floor_ms=floor)


def test_emit_takes_every_row_from_one_layout(tmp_path):
    """auto: the layout whose leaders have the higher mean %SOL, of those tuned on every case; a case
    with no k64 trial keeps the module on rows; a named layout is taken as asked. The k64 module holds
    prepare_weights and `check`'s path through it passes."""
    from sqlalchemy.orm import Session

    from autotune import bench, db, emit, target
    from autotune.workloads import suite

    fp = target.fingerprint()
    cases = suite(SHAPE, (3, 37))
    rows_v, k64_v = small_variant(bk=64), _k64(small_variant(bk=64, group_m=1))
    said = []
    with Session(db.connect(f"sqlite:///{tmp_path / 'layout.sqlite3'}")) as s:
        run = db.start_run(s, fp, "test", None)
        _record(s, run, fp, cases[0], rows_v, 1.0)
        _record(s, run, fp, cases[0], k64_v, 0.9)
        _record(s, run, fp, cases[1], rows_v, 2.0)
        assert emit.choose_layout(s, fp.key, cases)[0] == "rows"  # T=37 has no k64 trial
        _record(s, run, fp, cases[1], k64_v, 2.1)  # mean SOL: rows (1 + 0.5) / 2, k64 (1/0.9 + 1/2.1) / 2
        layout, best, why = emit.choose_layout(s, fp.key, cases, log=said.append)
        assert layout == "k64" and {t.label for t in best.values()} == {k64_v.label}
        assert why == ("Chosen by mean %SOL at tuning time over 2 cases: rows 75.0%, k64 79.4%. The rows "
                       "layout's leader was faster at T = 37 (x0.952 of the time).") and why in said[0]
        forced = emit.emit(s, fp.key, cases, "forced_rows", tmp_path, weight_layout="rows").read_text()
        path = emit.emit(s, fp.key, cases, "auto_k64", tmp_path)
        with pytest.raises(ValueError, match="weight_layout must be one of auto, rows, k64"):
            emit.emit(s, fp.key, cases, "bad", tmp_path, weight_layout="k128")
    assert "def prepare_weights" not in forced
    text = path.read_text()
    assert "Weight layout: k64" in text and "def prepare_weights" in text
    assert "layout's leader was faster at T = 37" in " ".join(text.split())  # what one layout a module cost
    assert "Chosen by mean %SOL" not in forced  # a named layout weighs nothing
    module = render.load_path(path)
    result = bench.run_bench(module.fused_experts, cases[:1], peers=False, reps=1, warmup=0,
                             prepare_weights=module.prepare_weights,
                             ceilings=bench.Ceilings(1e12, 1e14, 1e14, None))
    assert result["cases"][0]["ours"]["ok"] and result["prepare_weights"][0]["shape"] == SHAPE.key
    assert "prepare_weights, once per model" in bench.format_table(result)
    from autotune import cli

    assert cli.main(["check", "--shape", "4,128,64,2", "--dtype", "float16", "--tokens", "3,37",
                     "--module", str(path)]) == 0


def test_a_routing_adaptive_row_reads_one_layout_on_both_sides(weights):
    """Both sides of a hot-split row read the prepared copy: bit for bit the row-major module's output."""
    cold, hot = small_variant(bk=64), small_variant("split", block_m=64, bk=64)
    rows = render.load_source(render.render_module([render.Row(math.inf, cold, hot, 32)], "hot split", []))
    blocked = render.load_source(render.render_module([render.Row(math.inf, _k64(cold), _k64(hot), 32)],
                                                      "hot split k64", []))
    x, w, ids = make_tokens(Case(SHAPE, 60, seed=9), DEVICE)
    ids[:40, 0] = 1  # one expert routed 40 rows: the hot side runs it
    out = blocked.fused_experts(x, *blocked.prepare_weights(*weights), w, ids)
    assert torch.equal(out, rows.fused_experts(x, *weights, w, ids))
    with pytest.raises(ValueError, match="one layout"):
        render.render_module([render.Row(math.inf, cold, _k64(hot), 32)], "mixed", [])


def test_torch_compile_passes_the_prepared_weights_through(weights):
    """Under torch.compile the k64 module is one opaque operator; its traced check accepts the
    prepared copy (fake tensors) and the result is the eager call's."""
    module = render.load_source(render.render_module([render.Row(math.inf, _k64(small_variant(bk=64)))],
                                                     "compile k64", [], op_name="compile_k64_test"))
    prepared = module.prepare_weights(*weights)
    x, w, ids = make_tokens(Case(SHAPE, 5, seed=3), DEVICE)
    layer = lambda x: module.fused_experts(x * 2, *prepared, w, ids) + x  # noqa: E731
    assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), layer(x))
