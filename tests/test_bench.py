"""Benchmark pieces: peers against the reference, the floor's arithmetic, ceilings, report formats.

On a CPU machine the kernels run under the Triton interpreter (conftest sets it); tests marked `gpu`
need CUDA and time real sizes.
"""

import dataclasses
import json

import pytest
import torch
from conftest import small_variant

from autotune import bench, ceilings, peers, space, target, timing, wsgemm
from autotune.reference import error_stats, moe_reference, rel_l2
from autotune.workloads import DEMO_SHAPE, SEED16_SHAPE, Case, Shape, make_tokens, make_weights

gpu = pytest.mark.gpu

TINY_FP32 = Shape(E=8, H=64, I=32, k=2, dtype="float32")
# Numbers REFERENCE.md's seed16 table used for its SOL column.
REF_CEILINGS = ceilings.Ceilings(read_bytes_per_s=4.47e12, matmul_flops_per_s=643e12,
                              torch_matmul_flops_per_s=643e12, triton_gemm_flops_per_s=None)


def _inputs(shape: Shape, T: int, edit=None):
    w13, w2 = make_weights(shape, "cpu", seed=0)
    x, w, ids = make_tokens(Case(shape, T, seed=T), "cpu")
    if edit:
        edit(ids)
    return x, w13, w2, w, ids


def _bad_ids(ids):
    ids[0, 0] = -1  # expert-parallel "not on this device"
    ids[1, 1] = 8  # id >= E: garbage from a padded row
    ids[2, 1] = -7
    ids[3, :] = 3  # the same expert twice in one row


def _one_hot_expert(ids):
    ids[:] = 5  # every pair on one expert, the other seven empty


# Why each case: T=0 (empty), T=1 (decode), odd T, ids outside [0, E) and a repeated expert, one hot expert.
PEER_CASES = {
    "T0": (0, None), "T1": (1, None), "T37": (37, None), "bad-ids": (37, _bad_ids), "one-hot": (19, _one_hot_expert),
}


def _check_peer(fn, T, edit):
    args = _inputs(TINY_FP32, T, edit)
    out = fn(*args)
    ref = moe_reference(*args)
    assert out.shape == ref.shape and out.dtype == args[0].dtype
    assert not error_stats(out, ref).failures()
    if T:
        assert float(ref.norm()) > 0  # a zero reference would make the comparison empty


@pytest.mark.parametrize("case", list(PEER_CASES))
@pytest.mark.parametrize("peer", peers.PEERS, ids=lambda p: p.name)
def test_peer_matches_reference(peer, case):
    if peer.name == "grouped_mm" and not peers.grouped_mm_supported("cpu", torch.float32):
        pytest.skip("torch._grouped_mm has no CPU kernel in this torch (< 2.9): the fallback test covers the peer")
    _check_peer(peer.fn, *PEER_CASES[case])


@pytest.mark.parametrize("case", list(PEER_CASES))
def test_grouped_mm_fallback_matches_reference(case, monkeypatch):
    """The per-group loop used where torch._grouped_mm has no kernel (e.g. fp32 on CUDA, old CPU torch)."""
    monkeypatch.setattr(peers, "grouped_mm_supported", lambda device_type, dtype: False)
    _check_peer(peers.grouped_mm_pipeline, *PEER_CASES[case])


def test_nan_in_one_token_stays_there():
    x, w13, w2, w, ids = _inputs(TINY_FP32, 9)
    x[4, 0] = float("nan")
    for peer in peers.PEERS:
        out = peer.fn(x, w13, w2, w, ids)
        assert torch.isnan(out[4]).any() and torch.isfinite(out[torch.arange(9) != 4]).all(), peer.name


def test_floor_on_seed16_numbers():
    """REFERENCE.md: 0.090 ms at T=1 (8 experts), 2.88 ms once every weight is read, 20.51 ms at T=32768."""
    floor = lambda T, touched: ceilings.floor_ms(Case(SEED16_SHAPE, T), touched, REF_CEILINGS)
    assert floor(1, 8) == pytest.approx(0.0901, rel=2e-3)
    assert floor(1, 8) == pytest.approx((8 * 50_331_648 + 2 * 4096 * 2) / 4.47e12 * 1e3, rel=1e-12)
    assert floor(512, 256) == pytest.approx(2.881, rel=2e-3)
    assert floor(32768, 256) == pytest.approx(20.51, rel=2e-3)  # compute-bound: 13.2 TFLOP / 643 TFLOP/s


def test_read_bandwidth_kernel_runs():
    assert ceilings.measure_read_bandwidth(reps=2) > 0


def test_matmul_rate_checks_our_gemm():
    rates = ceilings.measure_matmul_rate(reps=2)
    assert rates.torch_flops_per_s > 0
    assert rates.triton_flops_per_s is not None, rates.notes  # the TMA GEMM ran and matched torch.matmul
    assert rates.best == max(rates.torch_flops_per_s, rates.triton_flops_per_s)


def test_measure_ceilings():
    c = ceilings.measure_ceilings(reps=2)
    assert c.read_bytes_per_s > 0 and c.matmul_flops_per_s == max(c.torch_matmul_flops_per_s,
                                                                  c.triton_gemm_flops_per_s or 0,
                                                                  c.gluon_gemm_flops_per_s or 0)
    assert (c.sustained_matmul_flops_per_s is None) == (not target.has_gpu())  # measured on a GPU only
    reloaded = ceilings.Ceilings(**json.loads(json.dumps(c.as_dict())))  # as the tuner reads a run's row
    assert dataclasses.replace(reloaded, notes=tuple(reloaded.notes)) == c


def test_gemm_compiles_for_sm90_with_tma_and_wgmma():
    """Compiled here for sm_90 (no GPU needed): fits Hopper's shared memory, loads through TMA, uses wgmma."""
    report = ceilings.gemm_sm90_compile_report()
    assert report["shared_bytes"] <= report["smem_limit_bytes"]
    assert report["tma_loads"] > 0 and report["wgmma"] > 0


def test_ws_gemm_compiles_for_sm90_warp_specialised():
    """The Gluon GEMM compiled here for sm_90: fits shared memory without spills, a consumer of two
    warpgroups on m64n256k16 and a loader warp with its own register budget, fed by TMA."""
    report = wsgemm.compile_report()
    assert report["shared_bytes"] <= report["smem_limit_bytes"] and report["spill_bytes"] in (0, None)
    # The loader's one warp is padded to a warpgroup.
    assert report["warps"] == wsgemm.TILES.consumer_warps + 4 and report["tma_loads"] > 0
    assert report["wgmma_shapes"] == ["m64n256k16"]
    budgets = {int(line.split()[-1]) for line in report["setmaxnreg"]}
    assert wsgemm.TILES.loader_regs in budgets


def _tiny_bench(fn):
    cases = [Case(DEMO_SHAPE, T, seed=T) for T in (1, 5, 33)]
    return bench.run_bench(fn, cases, ceilings=REF_CEILINGS, reps=2, warmup=1)


def test_run_bench_table_and_json(tmp_path):
    result = _tiny_bench(peers.grouped_mm_pipeline)
    rows = result["cases"]
    assert [r["T"] for r in rows] == [1, 5, 33]
    for r in rows:
        assert r["ours"]["ok"] and r["ours"]["ms"] > 0
        assert r["ours"]["pct_sol"] == pytest.approx(r["floor_ms"] / r["ours"]["ms"] * 100)
        assert 1 <= r["experts_touched"] <= DEMO_SHAPE.E
        for name in ("grouped_mm", "torch_loop"):
            e = r["peers"][name]
            assert e["ok"] and e["speedup"] == pytest.approx(e["ms"] / r["ours"]["ms"])
    assert result["mean"]["ours"]["ms"] == pytest.approx(sum(r["ours"]["ms"] for r in rows) / 3)

    table = bench.format_table(result).splitlines()
    assert table[0] == ("| T | ms | floor ms | %SOL | TFLOP/s | TB/s | grouped_mm ms | speed-up vs grouped_mm"
                        " | torch loop ms | speed-up vs loop |")
    assert len(table) == 2 + 3 + 1 and table[-1].startswith("| **mean** |")

    path = tmp_path / "bench.json"
    bench.write_json(result, path)
    loaded = json.loads(path.read_text())
    assert loaded["fingerprint"] == target.fingerprint().as_dict()
    assert loaded["cases"][2]["ours"]["ms"] == rows[2]["ours"]["ms"]

    pytest.importorskip("matplotlib")
    bench.write_png(result, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_every_entry_is_timed_after_the_bench_settle(monkeypatch):
    """Ours and each peer: time_fn is asked for BENCH_SETTLE_MS of untimed calls (NOTES 95)."""
    asked = []
    real = bench.time_fn
    monkeypatch.setattr(bench, "time_fn", lambda fn, **kw: asked.append(kw["settle_ms"]) or real(fn, **kw))
    result = _tiny_bench(peers.grouped_mm_pipeline)
    assert len(asked) == 3 * len(result["cases"]) and set(asked) == {bench.BENCH_SETTLE_MS}


def test_wrong_output_is_flagged_not_timed(tmp_path):
    zeros = lambda x, w13, w2, w, ids: torch.zeros_like(x)
    result = _tiny_bench(zeros)
    for r in result["cases"]:
        assert not r["ours"]["ok"] and r["ours"]["ms"] is None and r["ours"]["failures"]
        assert r["peers"]["torch_loop"]["speedup"] is None
    assert result["mean"]["ours"]["ms"] is None and result["mean"]["ours"]["failed"] == 3
    assert "| 1 | FAIL |" in bench.format_table(result)
    bench.write_json(result, tmp_path / "bench.json")  # NaN-free: error stats of a zero output are finite


@gpu
def test_gpu_ceilings_and_gemm():
    c = ceilings.measure_ceilings()
    assert c.triton_gemm_flops_per_s is not None, c.notes
    assert c.read_bytes_per_s > 1e12 and c.matmul_flops_per_s > 1e14  # any datacenter GPU of this decade
    # Under a ~20 ms load the card may lower its clock, never raise it past the burst's rate by much.
    assert c.sustained_matmul_flops_per_s is not None and c.sustained_sm_clock_mhz is not None
    assert 0.3 * c.matmul_flops_per_s < c.sustained_matmul_flops_per_s < 1.1 * c.matmul_flops_per_s


@gpu
def test_gpu_peers_bf16():
    shape = Shape(E=16, H=512, I=256, k=4, dtype="bfloat16")
    w13, w2 = make_weights(shape, "cuda", seed=0)
    for T in (1, 37, 1000):
        x, w, ids = make_tokens(Case(shape, T, seed=T), "cuda")
        ids[0, 0] = -1
        ref = moe_reference(x, w13, w2, w, ids)
        for peer in peers.PEERS:
            assert not error_stats(peer.fn(x, w13, w2, w, ids), ref).failures(), (peer.name, T)


def test_per_kernel_sums_names_over_calls():
    events = [("gemm1", 10.0), ("gemm2", 4.0), ("dispatch", 1.0), ("gemm1", 12.0), ("gemm2", 6.0), ("dispatch", 1.0),
              ("dispatch", 0.5), ("dispatch", 0.5)]
    assert timing.per_kernel(events, calls=2) == [
        {"name": "gemm1", "us": 11.0, "launches": 1.0},
        {"name": "gemm2", "us": 5.0, "launches": 1.0},
        {"name": "dispatch", "us": 1.5, "launches": 2.0},
    ]


def test_format_kernels_shows_the_split_per_case():
    row = {"T": 8, "ours": {"ms": 0.05, "kernels": [
        {"name": "_gemm1_gather_swiglu", "us": 30.0, "launches": 1.0},
        {"name": "_dispatch_count_kernel", "us": 2.0, "launches": 2.0},
        {"name": "_combine_kernel", "us": 1.0, "launches": 1.0}]}}
    text = bench.format_kernels({"cases": [row, {"T": 16, "ours": {"ms": None}}]}, top=2)
    assert text == ("T=8      kernels      33.0 us (graph      50.0): "
                    "gemm1_gather_swiglu 30.0, dispatch_count 2.0 (x2), other 1.0")


def test_format_sustained_reads_the_compute_bound_cases_against_the_sustained_rate():
    measured = {"read_bytes_per_s": 4e12, "matmul_flops_per_s": 800e12, "sustained_matmul_flops_per_s": 680e12,
                "sustained_sm_clock_mhz": {"first": 1980, "last": 1470}}
    small = {"T": 64, "flops": 1e9, "bytes": 1e10, "ours": {"ok": True, "tflops": 10.0}}  # bandwidth-bound
    large = {"T": 32768, "flops": 1.3e13, "bytes": 1.3e10, "ours": {"ok": True, "tflops": 578.0}}
    text = bench.format_sustained({"ceilings": measured, "cases": [small, large]})
    assert "680 TFLOP/s" in text and "1980 -> 1470 MHz" in text and "ceiling's 800" in text
    assert text.endswith("against it: T=32768 85.0%.")
    assert bench.format_sustained({"ceilings": {**measured, "sustained_matmul_flops_per_s": None}, "cases": []}) == ""


def test_format_gemm_rates_splits_padding_from_the_kernel():
    """T=8192 of seed16 as benched at 21:22 (NOTES 47): 65536 rows needed, 82048 computed."""
    case = Case(SEED16_SHAPE, 8192).as_dict()
    kernels = [{"name": "_gemm1_grouped_swiglu_tma", "us": 4166.0, "launches": 1.0},
               {"name": "_gemm2_weighted_tma_persistent", "us": 2059.0, "launches": 1.0},
               {"name": "_permute_rows_kernel", "us": 167.0, "launches": 1.0}]
    row = {"T": 8192, "case": case, "ours": {"kernels": kernels, "rows_computed": [82048, 82048]}}
    text = bench.format_gemm_rates({"cases": [row, {"T": 1, "case": case, "ours": {"kernels": None}}]})
    assert text == ("T=8192   rows x1.252 / x1.252  GEMM1 4166 us 661 TFLOP/s (528)  "
                    "GEMM2 2059 us 669 TFLOP/s (534)")


def test_bench_records_the_rows_each_gemm_computes():
    """Given the serving variant per T, each row records space.rows_computed on the case's own routing."""
    v = small_variant(block_m=16)
    result = bench.run_bench(peers.grouped_mm_pipeline, [Case(DEMO_SHAPE, 33, seed=33)], peers=False,
                             ceilings=REF_CEILINGS, reps=1, warmup=0, variant_for=lambda T: v)
    _, _, ids = make_tokens(Case(DEMO_SHAPE, 33, seed=33), target.device())
    assert result["cases"][0]["ours"]["rows_computed"] == list(space.rows_computed(v, ids, DEMO_SHAPE.E))
    assert result["cases"][0]["ours"]["rows_computed"][0] >= 33 * DEMO_SHAPE.k


@gpu
def test_gpu_kernel_breakdown_names_every_kernel():
    shape = Shape(E=16, H=512, I=256, k=4, dtype="bfloat16")
    w13, w2 = make_weights(shape, "cuda", seed=0)
    x, w, ids = make_tokens(Case(shape, 64, seed=1), "cuda")
    kernels = timing.kernel_breakdown(lambda: peers.grouped_mm_pipeline(x, w13, w2, w, ids))
    assert kernels and all(k["us"] > 0 and k["launches"] > 0 for k in kernels)


def test_own_launches_holds_a_launch_hook_only_inside():
    """The hook an emitted module sets its planned launches and its own graphs aside for
    (_launch_hooked), installed inside own_launches and removed after it, an exception included."""
    import triton

    from kernels_generated import h200_sm90_e128_h2048_i768_k8_bfloat16 as module

    hooks = triton.knobs.runtime.launch_enter_hook
    before = list(hooks.calls)
    assert not module._launch_hooked()
    with pytest.raises(KeyError), timing.own_launches():
        assert module._launch_hooked() and len(hooks.calls) == len(before) + 1
        raise KeyError("inside")
    assert list(hooks.calls) == before and not module._launch_hooked()


def test_wall_clock_timing_times_one_call_a_sample():
    if target.has_gpu():
        pytest.skip("the GPU path replays several calls a sample (test_gpu_time_fn_...)")
    t = timing.time_fn(lambda: sum(range(100)), reps=4, warmup=1)
    assert t.method == "wall-clock" and t.calls_per_sample == 1 and len(t.samples_ms) == 4


@pytest.mark.parametrize("run_ms", [0.5, 4.0])
def test_the_settle_lasts_its_time_whatever_one_run_takes(monkeypatch, run_ms):
    """time_fn's settle runs for settle_ms by the clock, however long a run is, and not much longer
    (NOTES 98: counted from a slow lone call, it had shrunk to a few runs)."""
    import time

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    runs = []
    start = time.perf_counter()
    timing._settle(lambda: (runs.append(1), time.sleep(run_ms / 1e3)), 40.0)
    spent_ms = (time.perf_counter() - start) * 1e3
    assert 40.0 <= spent_ms < 80.0 and len(runs) > 1


@gpu
def test_gpu_time_fn_sizes_its_replays_past_one_slow_call():
    """A call that waits on the host once after the warm-up (as an emitted module's does while it
    captures its own graph) must not make every replay one call long (NOTES 93)."""
    import time

    a = torch.randn(256, 256, device="cuda")
    out = torch.empty_like(a)
    calls = []

    def fn():
        calls.append(1)
        if len(calls) == 4:  # the first call on the caller's stream after 3 warm-up calls
            time.sleep(0.02)
        torch.matmul(a, a, out=out)

    t = timing.time_fn(fn, reps=3, warmup=3)
    assert t.calls_per_sample > 1, t


@gpu
@pytest.mark.parametrize("M, N, K", [(1000, 384, 200), (256, 4096, 4096), (4096, 4096, 1024)])
def test_gpu_ws_gemm_matches_torch(M, N, K):
    """Partial tiles in M and N (clipped TMA stores) and K (TMA zero fill), one tile per program or
    several (the ring's stages in both parities)."""
    gen = torch.Generator(device="cuda").manual_seed(M + N + K)
    a = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    b = torch.randn(N, K, generator=gen, device="cuda").to(torch.bfloat16)
    c = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    wsgemm.launcher(a, b, c)()
    ref = torch.matmul(a, b.T)
    assert rel_l2(c, ref) < ceilings.GEMM_REL_L2_BAR


def test_sm_clock_sampler_says_nothing_without_a_gpu_and_never_fails():
    """Without a GPU (or nvidia-smi) the sampler records nothing and the block runs as usual."""
    from autotune.timing import SmClockSampler

    ran = []
    with SmClockSampler() as clock:
        ran.append(True)
    assert ran == [True]
    if not target.has_gpu():
        assert clock.summary() is None
    else:
        summary = clock.summary()
        assert summary is None or 0 < summary["min"] <= summary["median"] <= summary["max"]


def test_smi_lines_give_clocks_and_watts_and_skip_what_the_card_cannot_read():
    """`clocks.sm, power.draw` samples: a card without a power reading still gives its clocks, and a
    line torn by the sampler's termination is dropped rather than failing the timing."""
    from autotune.timing import _parse_smi

    assert _parse_smi("1980, 412.31\n1755, 699.02\n") == ([1980, 1755], [412.31, 699.02])
    assert _parse_smi("1980, [N/A]\n1980, [N/A]\n") == ([1980, 1980], [])
    assert _parse_smi("1410, 700.10\n1410, 69") == ([1410], [700.10])
    assert _parse_smi("") == ([], [])
