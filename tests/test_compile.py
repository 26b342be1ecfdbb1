"""torch.compile over an emitted module: the op is one custom operator the compiler keeps opaque."""

import math

import pytest
import torch
from conftest import DEVICE, DTYPES, small_variant

from autotune import render
from autotune.reference import error_stats, moe_reference
from autotune.workloads import Case, Shape, make_tokens, make_weights

SHAPE = Shape(8, 64, 32, 2, str(DTYPES[0]).removeprefix("torch."))


@pytest.fixture(scope="module")
def compiled_module():
    return render.load_source(render.render_module([render.Row(math.inf, small_variant())], "compile test", [],
                                                   op_name="compile_test"))


@pytest.fixture(scope="module")
def inputs():
    w13, w2 = make_weights(SHAPE, DEVICE, seed=1)
    x, w, ids = make_tokens(Case(SHAPE, 5, seed=3), DEVICE)
    return x, w13, w2, w, ids


def test_the_compiler_sees_one_opaque_operator(compiled_module, inputs):
    module = compiled_module
    x, w13, w2, w, ids = inputs
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(x):
        return module.fused_experts(x * 2, w13, w2, w, ids) + x

    out = torch.compile(layer, fullgraph=True, backend=backend)(x)
    (graph,) = graphs
    ops = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert torch.ops.moe_tune.compile_test.default in ops
    assert not any("triton" in str(op) for op in ops), ops  # no kernel of the module was traced into
    assert torch.equal(out, layer(x))


@pytest.mark.parametrize("into_out", [False, True])
def test_compiled_calls_match_eager_ones(compiled_module, inputs, into_out):
    """aot_eager functionalises the operator's write into `out`; the result is the eager call's, bit
    for bit, and within the bar of the fp32 reference."""
    module = compiled_module
    x, w13, w2, w, ids = inputs

    def layer(x, out):
        return module.fused_experts(x, w13, w2, w, ids, out=out) * 1

    out = torch.zeros_like(x) if into_out else None
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, out)
    assert torch.equal(got, module.fused_experts(x, w13, w2, w, ids))
    if into_out:
        assert torch.equal(out, got)
    assert not error_stats(got, moe_reference(x, w13, w2, w, ids)).failures()


def test_bad_input_is_refused_while_the_graph_is_traced(compiled_module, inputs):
    module = compiled_module
    x, w13, w2, w, ids = inputs

    def layer(x):
        return module.fused_experts(x, w13, w2[:, :, :-1], w, ids)

    with pytest.raises(RuntimeError, match=r"w2 must be \[E, H, I\]"):
        torch.compile(layer, fullgraph=True, backend="aot_eager")(x)


def test_a_module_imported_again_uses_the_operator_it_defined(compiled_module, inputs):
    """A process defines moe_tune::NAME once: a second import of the module reuses it."""
    again = render.load_path(compiled_module.__file__, "compile_test_again")
    assert again._fused_experts_op == torch.ops.moe_tune.compile_test.default
    x, w13, w2, w, ids = inputs
    out = torch.compile(lambda x: again.fused_experts(x, w13, w2, w, ids), fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(out, again.fused_experts(x, w13, w2, w, ids))


def test_op_names_must_be_identifiers():
    with pytest.raises(ValueError, match="op_name must be a Python identifier"):
        render.render_module([render.Row(math.inf, small_variant())], "t", [], op_name="a-b")


def test_a_symbolic_token_count_matches_the_eager_call(compiled_module):
    """T symbolic (dynamic=True): the operator's fake body checks symbolic shapes; every count, zero
    included, gives the eager call's result."""
    module = compiled_module
    w13, w2 = make_weights(SHAPE, DEVICE, seed=1)
    layer = torch.compile(lambda x, w, ids: module.fused_experts(x, w13, w2, w, ids) * 1, fullgraph=True,
                          backend="aot_eager", dynamic=True)
    for T in (3, 17, 0):
        x, w, ids = make_tokens(Case(SHAPE, T, seed=T), DEVICE)
        assert torch.equal(layer(x, w, ids), module.fused_experts(x, w13, w2, w, ids)), T
