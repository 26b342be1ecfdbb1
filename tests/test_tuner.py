"""A tuning run on a tiny case into a temporary SQLite file: resumed, emitted, imported, checked;
the database rows, `show`, the CLI, and trial isolation (a crashing or hanging variant)."""

import contextlib
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, GPU, small_variant
from sqlalchemy import inspect, select
from sqlalchemy.orm import Session

from autotune import cli, db, emit, render, search, target
from autotune.reference import error_stats, moe_reference
from autotune.runner import Runner
from autotune.tuner import TuneConfig, tune
from autotune.workloads import SEED16_SHAPE, SEED16_TOKENS, Case, Shape, make_tokens, make_weights, suite

# The H200 module kernels_generated/ ships, emitted from db/moe_tune.sqlite3 (db.GPU_PATH).
COMMITTED_MODULE = emit.module_path(db.COMMITTED_FINGERPRINT, SEED16_SHAPE.key)

SHAPE = Shape(E=4, H=32, I=32, k=2, dtype="bfloat16" if GPU else "float16")
CASES = suite(SHAPE, (1, 9))


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'tune.sqlite3'}"
    cfg = TuneConfig(storage_url=url, trials=2, isolate=False, reps=1)
    first = tune(CASES, cfg, log=lambda m: None)
    cfg.trials = 3  # resume: only the missing trial of each study runs
    second = tune(CASES, cfg, log=lambda m: None)
    return url, first, second


def test_tune_records_and_resumes(tuned_db):
    url, first, second = tuned_db
    assert all(math.isfinite(ms) for ms in [*first.values(), *second.values()])
    with Session(db.connect(url)) as s:
        runs = s.scalars(select(db.Run)).all()
        assert len(runs) == 2 and all(r.finished_at is not None for r in runs)
        measured = s.scalars(select(db.Trial).where(db.Trial.status != "rejected")).all()
        by_case = {c.key: [t for t in measured if t.case_key == c.key] for c in CASES}
        # Two trials, then the resumed run's one missing trial (a repeated point is answered from the
        # database, not re-run) with the leader and runner-up re-timed before it and the leader after.
        assert all(1 <= len([t for t in ts if t.run_id == runs[0].id]) <= 2 for ts in by_case.values())
        assert all(len([t for t in ts if t.run_id == runs[1].id]) <= 4 for ts in by_case.values())
        ok = [t for t in measured if t.status == "ok"]
        assert ok and all(t.median_ms > 0 and t.source_hash and t.global_rel_l2 < 8e-3 for t in ok)
        assert all(t.fingerprint == target.fingerprint().key for t in measured)
        assert {"mt_runs", "mt_trials", "studies", "trials"} <= set(inspect(s.get_bind()).get_table_names())


def test_emit_import_and_check(tuned_db, tmp_path):
    url, _, _ = tuned_db
    with Session(db.connect(url)) as s:
        path = emit.emit(s, target.fingerprint().key, CASES, "tiny", tmp_path)
    source = path.read_text()
    assert "import torch" in source and "import triton" in source
    assert "autotune" not in source.split('"""', 2)[2]  # the module stands alone
    assert ("_check_gpu" in source) == target.has_gpu()  # a module tuned on a GPU refuses other architectures
    module = render.load_path(path)
    assert [row.max_tokens for row in module.VARIANTS] == [3, math.inf]  # floor(sqrt(1 * 9)) = 3
    w13, w2 = make_weights(SHAPE, DEVICE, seed=4)
    for T in (1, 3, 4, 20):  # tuned, on a threshold, between and beyond the tuned cases
        x, w, ids = make_tokens(Case(SHAPE, T, seed=77), DEVICE)
        stats = error_stats(module.fused_experts(x, w13, w2, w, ids), moe_reference(x, w13, w2, w, ids))
        assert not stats.failures(), (T, stats)
    # Inference only: no autograd history, even from an input that requires grad.
    assert not module.fused_experts(x.requires_grad_(), w13, w2, w, ids).requires_grad
    x.requires_grad_(False)
    # The emitted contract's own wording (trial sources keep theirs: their hashes key the database).
    with pytest.raises(ValueError, match=r"w13 and w2 must hold the same number of experts, got 4 in w13 .* and 3"):
        module.fused_experts(x, w13, w2[:3], w, ids)
    with pytest.raises(TypeError, match="topk_weights must be bf16, fp16 or fp32, got torch.int32"):
        module.fused_experts(x, w13, w2, w.to(torch.int32), ids)
    with pytest.raises(ValueError, match="w13 must hold at least one expert"):
        module.fused_experts(x, w13[:0], w2[:0], w, ids)
    with pytest.raises(ValueError, match=r"hidden_states must have at least one column \(H >= 1\)"):
        module.fused_experts(x[:, :0], w13[:, :, :0], w2[:, :0], w, ids)


def test_results_of_another_fingerprint_are_not_reused(tuned_db, tmp_path):
    url, _, _ = tuned_db
    with Session(db.connect(url)) as s, pytest.raises(LookupError, match="no verified trial"):
        emit.emit(s, "H100-sm90-triton9.9.9", CASES, "other", tmp_path)


def test_cli_show_emit_check(tuned_db, tmp_path, capsys):
    url, _, _ = tuned_db
    args = ["--shape", "4,32,32,2", "--tokens", "1,9", "--db", url, "--dtype", SHAPE.dtype]
    assert cli.main(["show", "--db", url, "--history", "5"]) == 0
    shown = capsys.readouterr().out
    assert CASES[0].key in shown and "last 5 trials" in shown
    assert cli.main(["show", "--db", url.removeprefix("sqlite:///")]) == 0  # a plain SQLite path works too
    assert CASES[1].key in capsys.readouterr().out
    # --hill: each run's contest for one case, the first run leading.
    assert cli.main(["show", "--db", url, "--hill", "--case-key", CASES[0].key]) == 0
    hill = capsys.readouterr().out.split(f"== {CASES[0].key}: the leader run by run")[1].splitlines()[1:]
    assert len(hill) == 2 and "leads (the first run)" in hill[0] and hill[1].startswith("run "), hill
    # A token count the database has no trial of is served by the nearest row, and emit says so.
    assert cli.main(["emit", *args[:3], "1,9,100", *args[4:], "--name", "cli_tiny", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    path = out.out.strip()
    assert path.endswith("cli_tiny.py") and "not tuned on" in out.err and "T = 100" in out.err
    # No zipf study here: emit says no row became routing-adaptive.
    assert cli.main(["emit", *args, "--name", "cli_hot", "--out-dir", str(tmp_path), "--hot-routing", "zipf"]) == 0
    assert "--hot-routing zipf: routing-adaptive rows T = none" in capsys.readouterr().err
    assert cli.main(["show", "--db", url, "--case-key", "E9-nothing"]) == 0
    assert "no verified trial of case 'E9-nothing'" in capsys.readouterr().out
    assert cli.main(["check", *args[:-4], "--dtype", SHAPE.dtype, "--module", path]) == 0
    assert "2 of 2 cases pass" in capsys.readouterr().out


def test_a_source_measured_on_two_cases_counts_for_each(tuned_db, tmp_path):
    """One variant is one source at every T: its timing on one case must not hide its timing on
    another (`show` once dropped every case whose leader another case then measured)."""
    url = _copy_of(tuned_db[0], tmp_path)
    fp = target.fingerprint().key
    with Session(db.connect(url)) as s:
        before = db.best_trials(s, fp)
        lead, other = before[CASES[0].key], before[CASES[1].key]
        # CASES[0]'s leader measured on CASES[1] afterwards, slower than CASES[1]'s own leader.
        db.record_trial(s, run_id=lead.run_id, study=other.study, fingerprint=fp, case_key=other.case_key,
                        case=other.case, params=lead.params, label=lead.label, source_hash=lead.source_hash,
                        status="ok", median_ms=other.median_ms * 10)
        after = db.best_trials(s, fp)
    assert {key: t.id for key, t in after.items()} == {key: t.id for key, t in before.items()}


def test_an_emitted_module_refuses_what_the_interpreter_cannot_run(tuned_db, tmp_path):
    """Under TRITON_INTERPRET=1 a bf16 tl.dot returns wrong values and a Gluon kernel cannot run at all:
    an emitted module refuses both before any launch and says why (it once returned bf16 results off
    by 1e11, and failed inside triton with "0 active drivers" on a Gluon row)."""
    if GPU:
        pytest.skip("the interpreter's limits; kernels here run on the GPU")
    with Session(db.connect(tuned_db[0])) as s:
        module = render.load_path(emit.emit(s, target.fingerprint().key, CASES, "tiny_interpreted", tmp_path))
    bf16 = Shape(SHAPE.E, SHAPE.H, SHAPE.I, SHAPE.k, "bfloat16")
    x, w, ids = make_tokens(Case(bf16, 3), DEVICE)
    with pytest.raises(TypeError, match="hidden_states is bf16"):
        module.fused_experts(x, *make_weights(bf16, DEVICE), w, ids)
    # The committed seed16 module's first Gluon row, on small fp16 weights (the contract takes any shape;
    # H and I multiples of 64 where the module reads its own weight layout, made by prepare_weights).
    committed = render.load_path(COMMITTED_MODULE)
    T = next(2**i for i in range(16) if getattr(committed.select_variant(2**i), "g1_gluon", False)
             or getattr(committed.select_variant(2**i), "g2_gluon", False))
    small = Shape(E=4, H=64, I=64, k=2, dtype="float16")
    weights = render.weights_for(committed, *make_weights(small, DEVICE))
    x, w, ids = make_tokens(Case(small, T), DEVICE)
    with pytest.raises(RuntimeError, match=f"T={T} is served by a variant with a Gluon GEMM"):
        committed.fused_experts(x, *weights, w, ids)


def test_cli_rejects_bad_shape(capsys):
    assert cli.main(["emit", "--shape", "4,32,32"]) == 2
    assert "four positive integers" in capsys.readouterr().err


def test_cli_refuses_what_would_fail_every_trial_and_unknown_databases(monkeypatch, capsys, tmp_path):
    """0 repeats or a 0 s timeout would record every trial as failed, and a negative count or budget
    means nothing; a URL of no installed dialect, a database path under a plain file, and a missing
    file for a command that only reads are each one line, exit code 2, not a traceback (nor an empty
    database left behind)."""
    for bad, said in ((["--reps", "0"], "must be above 0"), (["--timeout", "0"], "must be above 0"),
                      (["--trials", "0"], "must be above 0"), (["--time-budget", "-5"], "must be above 0"),
                      (["--more", "-1"], "must be at least 0"), (["--retime", "-2"], "must be at least 0"),
                      (["--reps", "many"], "invalid int value")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["tune", "--db", f"sqlite:///{tmp_path / 'x.sqlite3'}", *bad])
        assert exit_.value.code == 2 and said in capsys.readouterr().err, bad
    assert cli.main(["show", "--db", "foo://bar"]) == 2
    assert "error: database 'foo://bar'" in capsys.readouterr().err
    (tmp_path / "plain").write_text("")
    assert cli.main(["tune", "--db", str(tmp_path / "plain" / "t.sqlite3"), "--tokens", "1"]) == 2
    assert "error: database" in capsys.readouterr().err
    for command in (["show"], ["emit", "--tokens", "1"], ["sm90", "--tokens", "1"]):
        assert cli.main([*command, "--db", str(tmp_path / "typo.sqlite3")]) == 2
        assert "no such file" in capsys.readouterr().err and not (tmp_path / "typo.sqlite3").exists(), command
    monkeypatch.setattr(db, "DEMO_URL", f"sqlite:///{tmp_path / 'demo.sqlite3'}")  # this machine's default
    monkeypatch.setattr(db, "GPU_URL", f"sqlite:///{tmp_path / 'gpu.sqlite3'}")
    assert cli.main(["show"]) == 0
    assert "holds no runs yet" in capsys.readouterr().out and not list(tmp_path.glob("*.sqlite3"))


def test_cli_tune_fails_where_no_variant_passed_and_says_how_to_resume(monkeypatch, capsys, tmp_path):
    """A case no variant could run is an exit code of 1 naming the case, not "leader nan ms" and 0; an
    interrupted run ends in one line saying the finished trials are kept (130, as a shell's ^C)."""
    from autotune import tuner

    seen = {}

    def fake_tune(cases, cfg, log=None):
        seen["seed"] = cfg.seed
        return {cases[0].key: 0.5, cases[1].key: math.nan}

    monkeypatch.setattr(tuner, "tune", fake_tune)
    args = ["tune", "--db", str(tmp_path / "t.sqlite3"), "--shape", "4,32,32,2", "--dtype", "float16",
            "--tokens", "1,9"]
    assert cli.main(args) == 1
    out = capsys.readouterr().out
    assert f"{CASES[0].key.replace(SHAPE.dtype, 'float16')}: leader 0.5000 ms" in out
    assert "no variant passed" in out and "nan" not in out
    assert seen["seed"] is None  # each worker draws its own (tuner._worker_seed)

    def interrupted(cases, cfg, log=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(tuner, "tune", interrupted)
    assert cli.main(args) == 130
    assert "the same command resumes" in capsys.readouterr().err


def test_workers_without_a_seed_sample_apart():
    """TuneConfig(seed=None), the CLI's default, seeds each worker's sampler from its host and process:
    two workers started together on one study would otherwise sample the same points."""
    import multiprocessing

    from autotune import tuner

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        other = pool.apply(tuner._worker_seed)
    assert other != tuner._worker_seed()
    assert tuner.sampler_seed(TuneConfig("sqlite://", seed=None)) == tuner._worker_seed()
    assert tuner.sampler_seed(TuneConfig("sqlite://", seed=7)) == 7


def test_isolated_worker_survives_crash_and_hang():
    case = CASES[0]
    good = render.render_variant(next(iter(search.starting_points(case)), None)
                                 or small_variant())
    with Runner(isolate=True, timeout_s=60, reps=1) as runner:
        crashed = runner.evaluate(case, "import os\nos._exit(3)\n")
        assert crashed.status == "crashed"
        runner.timeout_s = 5
        hung = runner.evaluate(case, "import time\ntime.sleep(600)\n")
        assert hung.status == "timeout"
        runner.timeout_s = 120
        broken = runner.evaluate(case, "raise RuntimeError('bad variant')\n")
        assert broken.status == "runtime_error" and "bad variant" in broken.error
        ok = runner.evaluate(case, good)
        assert ok.status == "ok", ok.error


def test_wrong_variant_is_recorded_not_timed(tmp_path):
    """A kernel that computes the wrong thing fails verification and gets no timing."""
    case = CASES[1]
    source = render.render_variant(small_variant()).replace(
        "acc = acc_gate * tl.sigmoid(acc_gate) * acc_up", "acc = acc_gate * acc_up")
    result = Runner(isolate=False, reps=1).evaluate(case, source)
    assert result.status == "wrong" and "relative L2" in result.error and not result.timing


def test_bf16_refused_without_gpu(capsys):
    if GPU:
        pytest.skip("bf16 runs on the GPU")
    assert torch.cuda.is_available() is False
    assert cli.main(["tune", "--shape", "4,32,32,2", "--tokens", "1"]) == 2
    assert "bf16 cannot run here" in capsys.readouterr().err


def test_an_emitted_modules_operator_is_its_own(tuned_db, tmp_path):
    """A process defines a torch operator once, so two modules of one file name (an older emission
    beside a newer, one --name for two shapes) each name theirs by a digest of their code: compiled
    code never runs another module's table. The same code emitted again keeps its name."""
    url, _, _ = tuned_db
    with Session(db.connect(url)) as s:
        both = render.load_path(emit.emit(s, target.fingerprint().key, CASES, "same", tmp_path / "a"), "op_a")
        again = render.load_path(emit.emit(s, target.fingerprint().key, CASES, "same", tmp_path / "b"), "op_b")
        one = render.load_path(emit.emit(s, target.fingerprint().key, CASES[:1], "same", tmp_path / "c"), "op_c")
    assert both._OP_NAME == again._OP_NAME != one._OP_NAME
    assert both._OP_NAME.startswith("moe_tune::same_") and one._OP_NAME.startswith("moe_tune::same_")
    assert [row.max_tokens for row in one.VARIANTS] == [math.inf]


def test_cli_one_line_errors_before_any_work(tuned_db, tmp_path, capsys):
    """Each of these is refused before anything runs, with exit code 2 and the option named: a shape no
    variant of the space can run, an empty or in-memory --db, an --name that cannot be imported, a
    --module that is no emitted module, a --json that cannot be written, a --probe without a value."""
    url, _, _ = tuned_db
    dt = ["--dtype", SHAPE.dtype]
    (tmp_path / "plain").write_text("")
    (tmp_path / "other.py").write_text("x = 1\n")
    (tmp_path / "broken.py").write_text("def (\n")
    with Session(db.connect(url)) as s:
        module = emit.emit(s, target.fingerprint().key, CASES, "for_bench", tmp_path)
    cases = [
        (["tune", "--shape", "4,16,64,2", *dt, "--db", str(tmp_path / "t.sqlite3")],
         "H=16: the smallest reduction step"),
        (["tune", "--shape", "4,32,32,2", *dt, "--db", ""], "--db is empty"),
        (["tune", "--shape", "4,32,32,2", *dt, "--db", "sqlite://"], "in-memory database"),
        (["emit", "--shape", "4,32,32,2", *dt, "--db", url, "--name", "a.py"], "--name must be a Python identifier"),
        (["check", "--shape", "4,32,32,2", *dt, "--module", str(tmp_path / "nothing.py")], "no such file"),
        (["check", "--shape", "4,32,32,2", *dt, "--module", str(tmp_path / "other.py")], "defines no fused_experts"),
        (["check", "--shape", "4,32,32,2", *dt, "--module", str(tmp_path / "broken.py")], "cannot import it"),
        (["bench", "--shape", "4,32,32,2", *dt, "--module", str(module), "--json",
          str(tmp_path / "plain" / "x.json")], "--json"),
        (["tune", "--shape", "4,32,32,2", *dt, "--db", str(tmp_path / "t.sqlite3"), "--probe", "block_m"],
         "'block_m': no value"),
    ]
    for argv, said in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "t.sqlite3").exists()


def test_check_reports_a_refused_case_and_goes_on(capsys):
    """A case the module refuses (here the committed module's Gluon row under the interpreter) fails that
    case with its reason; the others are still checked."""
    if GPU or not COMMITTED_MODULE.exists():
        pytest.skip("the interpreter's refusal of a Gluon row")
    assert cli.main(["check", "--module", str(COMMITTED_MODULE), "--shape", "4,64,64,2", "--dtype", "float16",
                     "--tokens", "1,6000"]) == 1
    out = capsys.readouterr().out
    assert "T=6000   FAIL: RuntimeError: T=6000 is served by a variant with a Gluon GEMM" in out
    assert "T=1 " in out and "1 of 2 cases pass" in out


def test_a_term_signal_unwinds_like_ctrl_c(monkeypatch, capsys, tmp_path):
    """A TERM (a scheduler's stop) ends tune as Ctrl-C does (so the worker process is killed on the
    way out), and main gives the process's handler back."""
    import os
    import signal

    from autotune import tuner

    def stopped(cases, cfg, log=None):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal did not stop the run")

    monkeypatch.setattr(tuner, "tune", stopped)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["tune", "--shape", "4,32,32,2", "--dtype", "float16", "--tokens", "1",
                     "--db", str(tmp_path / "t.sqlite3")]) == 130
    assert "the same command resumes" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_trial_worker_leaves_ctrl_c_to_the_tuner():
    """Ctrl-C reaches the worker process too: it ignores it (the tuner kills it on the way out), so it
    neither dies mid-trial on its own nor prints a traceback."""
    import os
    import signal

    case = CASES[0]
    with Runner(isolate=True, timeout_s=120, reps=1) as runner:
        assert runner.evaluate(case, "raise RuntimeError('up')\n").status == "runtime_error"  # it is running
        os.kill(runner._proc.pid, signal.SIGINT)
        assert runner.evaluate(case, render.render_variant(small_variant())).status == "ok"


def test_bf16_emitted_without_gpu(tmp_path, capsys):
    """Emitting runs no kernel: a GPU's bf16 results render into a module on a machine without one."""
    if not db.GPU_PATH.exists():
        pytest.skip("no committed H200 database")
    assert cli.main(["emit", "--db", db.GPU_URL, "--fingerprint", db.COMMITTED_FINGERPRINT, "--shape",
                     "256,4096,2048,8", "--tokens", "1,32768", "--out-dir", str(tmp_path)]) == 0
    path = tmp_path / COMMITTED_MODULE.name
    assert capsys.readouterr().out.strip() == str(path) and "def fused_experts(" in path.read_text()


@contextlib.contextmanager
def _extra_trial(s: Session, like, case: Case, **fields):
    """A verified trial recorded beside `like` (its run and study) for the length of the block."""
    row = db.record_trial(s, run_id=like.run_id, study=like.study, fingerprint=like.fingerprint, case_key=case.key,
                          case=case.as_dict(), status="ok", **fields)
    try:
        yield row
    finally:
        s.delete(row)
        s.commit()


def test_trials_of_older_templates_are_not_shipped(tuned_db):
    """A trial whose recorded source differs from today's rendering measured other code: emit skips
    it and the tuner queues it for re-timing."""
    url, _, _ = tuned_db
    case = CASES[0]
    with Session(db.connect(url)) as s:
        current = emit.leader(s, target.fingerprint().key, case)
        with _extra_trial(s, current, case, params=current.params, label=current.label, source_hash="0" * 16,
                          median_ms=current.median_ms / 100):
            assert emit.leader(s, target.fingerprint().key, case).id == current.id
            assert emit.stale_leaders(s, target.fingerprint().key, case, 3) == []  # today's code is measured


def test_new_parameters_are_probed_from_the_leader(tuned_db):
    """A leader measured before a parameter existed is re-tried with that parameter's other values."""
    from autotune import space, tuner

    url, _, _ = tuned_db
    case = CASES[1]
    with Session(db.connect(url)) as s:
        current = emit.leader(s, target.fingerprint().key, case)
        # A leader that predates `pdl`: a known-good point without it. (Not the tuned leader: which
        # parameters it holds at their defaults depends on timing. Nor whatever emit.leader makes of
        # it: with one timed repeat a trial, the tuned leader's re-timings can spread wider than any
        # challenger's margin, and who leads is the hill's test, not this one.)
        old_params = {k: v for k, v in small_variant().as_dict().items() if k != "pdl"}
        with _extra_trial(s, current, case, params=old_params, label=current.label,
                          source_hash=render.variant_hash(space.Variant.from_dict(old_params)),
                          median_ms=current.median_ms / 100) as old_leader:
            probes = tuner._new_dimension_probes(s, target.fingerprint(), case, old_leader)
            assert probes == [space.Variant.from_dict({**old_params, "pdl": True}).as_dict()]


def test_leader_probes_apply_each_assignment_once(tuned_db):
    """--probe tries the leader with the given parameters set, skipping what is measured or cannot run."""
    from autotune import space, tuner

    url, _, _ = tuned_db
    case = CASES[1]
    with Session(db.connect(url)) as s:
        leader = emit.leader(s, target.fingerprint().key, case)
        change = {f"g{i}_group_m": next(g for g in (1, 4, 8, 16) if g != leader.params[f"g{i}_group_m"])
                  for i in (1, 2)}
        probe = space.Variant.from_dict({**leader.params, **change})
        assert db.cached_result(s, target.fingerprint().key, case.key, render.variant_hash(probe)) is None
        # A faster trial of code the templates no longer render is no base for probes.
        with _extra_trial(s, leader, case, params=small_variant(bn=64).as_dict(), label="stale",
                          source_hash="2" * 16, median_ms=leader.median_ms / 100):
            base = emit.leader(s, target.fingerprint().key, case)  # not the faster stale trial
            said = []
            probes = tuner._leader_probes(s, target.fingerprint(), case, base, [
                change, change, {"block_m": leader.params["block_m"]},  # a repeat; the leader itself
                {"g1_block_k": 256},  # exceeds the case's H: cannot run it, and the log says why
            ], said.append)
    assert probes == [probe.as_dict()]
    assert len(said) == 1 and "--probe g1_block_k=256 on the leader cannot run: g1_block_k=256" in said[0]
    # At T=1 (2 slots) the study asks block_m from (16,) alone: a point with 32 would abort the run
    # (optuna refuses a queued value outside a parameter's choices), so it is reported, not queued.
    with Session(db.connect(url)) as s:
        said = []
        lead = emit.leader(s, target.fingerprint().key, CASES[0])
        assert tuner._leader_probes(s, target.fingerprint(), CASES[0], lead, [{"block_m": 32}], said.append) == []
        new = tuner._new_dimension_probes(s, target.fingerprint(), CASES[0], lead)
        assert all(space.in_space(space.Variant.from_dict(p), CASES[0]) for p in new)
    assert len(said) == 1 and "block_m=32 is not among this case's choices (16)" in said[0]


def _copy_of(url: str, tmp_path: Path) -> str:
    """A tuned database to change freely (the module's fixture is shared by the other tests)."""
    copy = tmp_path / "copy.sqlite3"
    shutil.copy(url.removeprefix("sqlite:///"), copy)
    return f"sqlite:///{copy}"


def _last_run_ok(s: Session) -> list:
    """The verified trials of the latest run."""
    run = max(r.id for r in s.scalars(select(db.Run)))
    return s.scalars(select(db.Trial).where(db.Trial.run_id == run, db.Trial.status == "ok")).all()


def test_retime_times_the_contenders_again_and_their_latest_timing_counts(tuned_db, tmp_path):
    """--retime N re-measures each case's N fastest variants in the new run (no cached answer), the
    leader last once more (its runner-up challenges it: the leader's spread is the margin), and
    ranking then counts each source once, by its latest timing."""
    url = _copy_of(tuned_db[0], tmp_path)
    case, fp = CASES[1], target.fingerprint().key
    with Session(db.connect(url)) as s:
        before = [t.source_hash for t in emit.contenders(s, fp, case, 2)]
    assert len(before) == 2
    tune([case], TuneConfig(storage_url=url, more=0, isolate=False, reps=1, retime=2), log=lambda m: None)
    with Session(db.connect(url)) as s:
        again = sorted(_last_run_ok(s), key=lambda t: t.id)
        assert [t.source_hash for t in again] == [*before, before[0]]
        ranked = db.ranked_trials(s, fp, case.key)
        assert len({t.source_hash for t in ranked}) == len(ranked)
        latest = {t.source_hash: t.id for t in again}  # the leader's closing timing, not its first
        assert set(latest.values()) <= {t.id for t in ranked}
        assert db.best_trials(s, fp, [case.key])[case.key].id == ranked[0].id


def test_a_probed_case_has_its_leaders_retimed_beside_the_probe(tuned_db, tmp_path):
    """A run that measures a challenger (here a --probe) also re-times the case's leader and runner-up,
    so that they compare on one state of the GPU."""
    from autotune import space, tuner

    url = _copy_of(tuned_db[0], tmp_path)
    case, fp = CASES[1], target.fingerprint().key
    with Session(db.connect(url)) as s:
        leaders = emit.contenders(s, fp, case, tuner.AUTO_RETIME)
        # A group size the leader has not been measured with (the probe must be new to be timed).
        def measured(g: int) -> bool:
            v = space.Variant.from_dict({**leaders[0].params, "g1_group_m": g})
            return db.cached_result(s, fp, case.key, render.variant_hash(v)) is not None

        change = {"g1_group_m": next(g for g in (1, 4, 8, 16) if not measured(g))}
    tune([case], TuneConfig(storage_url=url, more=0, isolate=False, reps=1, probes=(change,)), log=lambda m: None)
    with Session(db.connect(url)) as s:
        timed = _last_run_ok(s)
    assert len(timed) == len(leaders) + 2  # the probe, and the leader timed again after it
    assert {t.source_hash for t in leaders} < {t.source_hash for t in timed}
    assert any(t.params["g1_group_m"] == change["g1_group_m"] for t in timed)


def test_neighbours_of_the_leader_are_each_measured_once(tuned_db, tmp_path):
    """--neighbours queues the leader's unmeasured one-step neighbours (search.neighbours); after the run
    every one of them has a result, and a second run finds none left to queue."""
    from autotune import space, tuner

    url = _copy_of(tuned_db[0], tmp_path)
    case, fp = CASES[1], target.fingerprint()
    with Session(db.connect(url)) as s:
        leader = emit.leader(s, fp.key, case)
        queued = tuner._neighbour_probes(s, fp, case, leader)
        assert queued and all(space.violations(space.Variant.from_dict(q), case) == [] for q in queued)
        assert len(queued) == len({render.variant_hash(space.Variant.from_dict(q)) for q in queued})
    tune([case], TuneConfig(storage_url=url, more=0, isolate=False, reps=1, neighbours=True), log=lambda m: None)
    with Session(db.connect(url)) as s:
        for q in queued:
            assert db.cached_result(s, fp.key, case.key, render.variant_hash(space.Variant.from_dict(q))), q
        # Whatever leads now, the neighbours of the leader that was measured are all measured.
        assert tuner._neighbour_probes(s, fp, case, leader) == []


def test_points_an_earlier_run_queued_do_not_take_this_runs_places(tuned_db, tmp_path):
    """A point left waiting in a study's queue (an earlier run's time budget ran out) is counted as owed
    work, so this run's own re-timings (the leader and runner-up, as the run has a challenger, and the
    leader again last) still all run."""
    import optuna

    from autotune import tuner

    url = _copy_of(tuned_db[0], tmp_path)
    case, fp = CASES[1], target.fingerprint()
    with Session(db.connect(url)) as s:
        leader = emit.leader(s, fp.key, case)
        contenders = sorted(t.source_hash for t in emit.contenders(s, fp.key, case, tuner.AUTO_RETIME))
    study = optuna.load_study(study_name=tuner.study_name(case, fp), storage=url)
    study.enqueue_trial(leader.params)  # measured before: answered from the database when asked
    tune([case], TuneConfig(storage_url=url, more=0, isolate=False, reps=1, retime=1), log=lambda m: None)
    study = optuna.load_study(study_name=tuner.study_name(case, fp), storage=url)
    assert not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    with Session(db.connect(url)) as s:
        again = [t.source_hash for t in _last_run_ok(s)]
        assert sorted(set(again)) == contenders and again.count(leader.source_hash) == 2  # before and after


def test_a_run_cut_short_times_the_leader_before_an_earlier_runs_queued_points(tuned_db, tmp_path):
    """Points an earlier run left queued go behind this run's re-timing of the leader: a run whose time
    budget ends after one trial times the leader, not a challenger that would then meet the leader's
    figure from another run; the point stays queued for the next run."""
    import optuna

    from autotune import space, tuner

    url = _copy_of(tuned_db[0], tmp_path)
    case, fp = CASES[1], target.fingerprint()
    with Session(db.connect(url)) as s:
        leader = emit.leader(s, fp.key, case)
        point = tuner._neighbour_probes(s, fp, case, leader)[0]
    study = optuna.load_study(study_name=tuner.study_name(case, fp), storage=url)
    study.enqueue_trial(point)
    tune([case], TuneConfig(storage_url=url, more=0, isolate=False, reps=1, time_budget_s=1e-6), log=lambda m: None)
    with Session(db.connect(url)) as s:
        assert [t.source_hash for t in _last_run_ok(s)] == [leader.source_hash]
    study = optuna.load_study(study_name=tuner.study_name(case, fp), storage=url)
    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    assert space.Variant.from_dict(point).as_dict() in [t.system_attrs["fixed_params"] for t in waiting]


def test_a_failure_that_may_be_the_machines_is_tried_again_once(tmp_path):
    """A time, a compile error or a wrong answer is the code's and is reused; a timeout, a crash or a
    runtime error may be the machine's, so the source runs again, and only a second such failure in a
    row is taken as its answer."""
    fp, case = target.fingerprint(), CASES[0]
    v = small_variant()
    with Session(db.connect(f"sqlite:///{tmp_path / 'cache.sqlite3'}")) as s:
        run = db.start_run(s, fp, "cache", None)

        def fail(status):
            return db.record_trial(s, run_id=run.id, study="c", fingerprint=fp.key, case_key=case.key,
                                   case=case.as_dict(), params=v.as_dict(), label=v.label, source_hash="h",
                                   status=status)

        def cached():
            t = db.cached_result(s, fp.key, case.key, "h")
            return t and t.status

        assert cached() is None
        for status in ("timeout", "crashed", "runtime_error"):
            fail(status)
            assert cached() == (None if status == "timeout" else status), status  # the second in a row stands
        fail("wrong")
        assert cached() == "wrong"
        fail("timeout")
        assert cached() is None  # after a settled answer, a first timeout is tried again
        fail("compile_error")
        assert cached() == "compile_error"


# Each committed H200 module: its cases, and the routing its adaptive rows were emitted with.
COMMITTED_MODULES = [
    (SEED16_SHAPE, SEED16_TOKENS, "zipf"),
    (Shape(E=128, H=2048, I=768, k=8), (1, 4, 16, 64, 256, 1024, 4096, 16384), None),  # Qwen3-30B-A3B's
]


@pytest.mark.parametrize("shape, tokens, hot_routing", COMMITTED_MODULES, ids=lambda x: getattr(x, "key", ""))
def test_committed_module_is_what_the_committed_database_emits(tmp_path, shape, tokens, hot_routing):
    """What is shipped is what was timed: re-emitting from db/moe_tune.sqlite3 renders the committed
    module line for line (but the emission time), so every kernel in it was measured as rendered."""
    committed = emit.module_path(db.COMMITTED_FINGERPRINT, shape.key)
    if not committed.exists() or not db.GPU_PATH.exists():
        pytest.skip("no committed H200 module or database")
    with Session(db.connect(db.GPU_URL)) as s:
        fresh = emit.emit(s, db.COMMITTED_FINGERPRINT, suite(shape, tokens), committed.stem, tmp_path,
                          hot_routing=hot_routing)
    strip = lambda text: [line for line in text.splitlines() if " emitted " not in line]  # noqa: E731
    assert strip(fresh.read_text()) == strip(committed.read_text())


def test_committed_studies_accept_todays_space(tmp_path):
    """Optuna fixes each parameter's choices per study: today's space must ask every committed study
    for the same choices, or resuming it fails ("CategoricalDistribution does not support dynamic value
    space"). A new value belongs in a new parameter."""
    import optuna

    from autotune import space

    if not db.GPU_PATH.exists():
        pytest.skip("no committed GPU database")
    copy = tmp_path / "db.sqlite3"
    shutil.copy(db.GPU_PATH, copy)
    url = f"sqlite:///{copy}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with Session(db.connect(url)) as s:
        for summary in optuna.get_all_study_summaries(url):
            row = s.scalars(select(db.Trial).where(db.Trial.study == summary.study_name).limit(1)).first()
            if row is None:
                continue
            case = Case.from_dict(row.case)
            seen = {}
            for t in optuna.load_study(study_name=summary.study_name, storage=url).get_trials(deepcopy=False):
                seen.update(t.distributions)
            for name, dist in seen.items():
                if name in space.WITHDRAWN:  # never asked again: the sampler leaves it be
                    continue
                assert tuple(dist.choices) == space.choices(space.PARAM_BY_NAME[name], case), \
                    (summary.study_name, name)


def test_queued_retimings_and_probes_run_on_top_of_the_budget():
    """A run asked for `--more 2` with three stale leaders and two probes queued runs all seven: the
    owed work must not eat the sampled trials (nor `--probe` go unrun, as it once did on the GPU)."""
    from autotune.tuner import trial_target

    more, total = TuneConfig("sqlite://", more=2), TuneConfig("sqlite://", trials=30)
    assert trial_target(done=100, queued=5, cfg=more) == 107
    assert trial_target(done=100, queued=0, cfg=more) == 102
    assert trial_target(done=10, queued=3, cfg=total) == 30
    assert trial_target(done=40, queued=3, cfg=total) == 43


def _record(s: Session, run, case: Case, v, ms: float):
    return db.record_trial(s, run_id=run.id, study="hill", fingerprint=run.fingerprint, case_key=case.key,
                           case=case.as_dict(), params=v.as_dict(), label=v.label,
                           source_hash=render.variant_hash(v), status="ok", median_ms=ms)


def test_a_challenger_leads_only_by_beating_the_leader_in_its_own_run(tmp_path):
    """King of the hill across runs: the first run's fastest leads; a later run's challenger takes
    over only by beating the leader timed in that run; a run without the leader is set against the
    leader's latest timing. Ranking by each source's latest timing would have shipped b below, timed
    once on a fast card and never again."""
    fp, case = target.fingerprint(), CASES[0]
    a, b, c, d, e = (small_variant(bn=bn, bk=bk) for bn, bk in ((16, 16), (32, 16), (16, 32), (32, 32), (64, 16)))
    with Session(db.connect(f"sqlite:///{tmp_path / 'hill.sqlite3'}")) as s:
        def run(name, *timed):
            r = db.start_run(s, fp, name, None)
            for v, ms in timed:
                _record(s, r, case, v, ms)
            return emit.leader(s, fp.key, case).params

        assert run("run 1", (a, 1.00), (b, 1.02)) == a.as_dict()
        assert run("run 2: a slower card; c beats a where both ran", (a, 1.10), (c, 1.08)) == c.as_dict()
        assert db.ranked_trials(s, fp.key, case.key)[0].params == b.as_dict()  # the latest-timing ranking
        assert run("run 3: the leader re-timed, a challenger slower beside it", (c, 0.95), (b, 0.97)) == c.as_dict()
        # Without the leader: set against its latest timing, 0.95.
        assert run("run 4", (e, 0.96)) == c.as_dict()
        assert run("run 5", (d, 0.94)) == d.as_dict()
        assert [t.params for t in emit.contenders(s, fp.key, case, 3)] == [d.as_dict(), c.as_dict(), e.as_dict()]
        # The leader timed twice, 0.90 and 0.94: the card drifted by 0.04, so a challenger must beat
        # 0.90 by more than that.
        assert run("run 6: within the leader's spread", (d, 0.90), (a, 0.87), (d, 0.94)) == d.as_dict()
        assert run("run 7: beyond it", (d, 0.90), (a, 0.85), (d, 0.94)) == a.as_dict()


def test_a_search_run_times_the_leader_beside_its_challengers(tuned_db, tmp_path):
    """`--more 1` samples one new point; the run also re-times the leader and its runner-up first and
    the leader last, so that the new point can only take the lead by beating them in the same run, by
    more than the leader's own drift."""
    from autotune import tuner

    url = _copy_of(tuned_db[0], tmp_path)
    case, fp = CASES[1], target.fingerprint().key
    with Session(db.connect(url)) as s:
        leaders = {t.source_hash for t in emit.contenders(s, fp, case, tuner.AUTO_RETIME)}
        lead = emit.leader(s, fp, case).source_hash
    tune([case], TuneConfig(storage_url=url, more=1, isolate=False, reps=1), log=lambda m: None)
    with Session(db.connect(url)) as s:
        timed = [t.source_hash for t in sorted(_last_run_ok(s), key=lambda t: t.id)]
    assert leaders <= set(timed)
    # The leader again as the run's last trial: the spread of its two timings is the run's noise.
    assert timed.count(lead) == 2 and timed[-1] == lead


def test_trials_are_timed_after_the_tuners_settle(monkeypatch, tmp_path):
    """Every trial's timing asks time_fn for the tuning run's settle (default timing.SETTLE_MS): tune
    hands it to the runner, and the runner to time_fn."""
    from autotune import runner, timing, tuner

    asked, made = [], []
    real_time, real_runner = runner.time_fn, tuner.Runner
    monkeypatch.setattr(runner, "time_fn", lambda fn, **kw: asked.append(kw["settle_ms"]) or real_time(fn, **kw))
    monkeypatch.setattr(tuner, "Runner", lambda *a: made.append(a) or real_runner(*a))
    result = Runner(isolate=False, reps=1, settle_ms=123.0).evaluate(CASES[1], render.render_variant(small_variant()))
    assert result.status == "ok" and asked == [123.0]
    assert TuneConfig(storage_url="sqlite://").settle_ms == timing.SETTLE_MS > 0
    url = f"sqlite:///{tmp_path / 'settle.sqlite3'}"
    tune([CASES[0]], TuneConfig(storage_url=url, trials=1, isolate=False, reps=1, settle_ms=7.0),
         log=lambda m: None)
    assert made and made[0][-1] == 7.0 and asked[1:] and set(asked[1:]) == {7.0}


def test_hill_marks_the_runs_timed_settled(tmp_path, capsys):
    """`show --hill` says which runs timed their contest after the tuner's settle."""
    fp, case = target.fingerprint(), CASES[0]
    a, b = small_variant(bn=16), small_variant(bn=32)
    with Session(db.connect(f"sqlite:///{tmp_path / 'hill.sqlite3'}")) as s:
        for name, method in (("run 1", None), ("run 2", None), ("run 3", "cuda-graph, settled 400 ms")):
            r = db.start_run(s, fp, name, None)
            for v, ms in ((a, 1.0), (b, 1.1)):
                _record(s, r, case, v, ms).timing_method = method
            s.commit()
        cli._print_hill(emit.hill(s, fp.key, case), case.key)
    lines = capsys.readouterr().out.splitlines()[1:]
    assert ["settled" in line for line in lines] == [False, False, True], lines


def test_a_new_shape_is_probed_with_its_neighbours_leaders(tmp_path):
    """Transfer: a case's study tries the leaders of other shapes' cases nearest it in rows per
    expert (one either side), once, where they fit its space; other dtypes and routings are not
    neighbours, and its own shape's studies are not others."""
    from autotune import space, tuner

    fp = target.fingerprint()
    other = Shape(E=8, H=64, I=64, k=2, dtype=SHAPE.dtype)
    low, mid, high = suite(other, (2, 16, 64))  # 0.5, 4 and 16 rows per expert
    case = Case(SHAPE, 9)  # 4.5 rows per expert: between mid and high
    lead_mid, lead_high, slower = small_variant(group_m=1), small_variant(group_m=8), small_variant(pdl=True)
    too_wide = small_variant(bk=64)  # its 64-wide K tile exceeds this case's H=32 choices
    fp32 = Case(Shape(E=8, H=64, I=64, k=2, dtype="float32"), 16)
    with Session(db.connect(f"sqlite:///{tmp_path / 'transfer.sqlite3'}")) as s:
        r = db.start_run(s, fp, "test", None)
        for c, v, ms in ((low, small_variant(group_m=16), 1.0), (mid, lead_mid, 1.0), (mid, slower, 2.0),
                         (high, lead_high, 1.0), (fp32, small_variant(block_m=32), 1.0),
                         (Case(SHAPE, 1), small_variant(block_m=64), 1.0)):
            _record(s, r, c, v, ms)
        assert tuner._transfer_probes(s, fp, case) == [lead_mid.as_dict(), lead_high.as_dict()]
        _record(s, r, case, lead_mid, 1.0)  # measured on this case: not again
        assert tuner._transfer_probes(s, fp, case) == [lead_high.as_dict()]
        _record(s, r, high, too_wide, 0.5)
        assert not space.in_space(too_wide, case)
        s.query(db.Trial).filter(db.Trial.params == lead_high.as_dict()).delete()  # too_wide now leads high
        assert tuner._transfer_probes(s, fp, case) == []


def test_graph_tokens_covers_the_leading_rows_tuned_under_the_bound():
    """Eager calls replay a CUDA graph up to the tokens served by the leading rows tuned under
    emit.GRAPH_BELOW_MS: never past a slower row, the last fast row only up to its tuned T."""
    fast, slow = emit.GRAPH_BELOW_MS / 2, emit.GRAPH_BELOW_MS
    assert emit.graph_tokens([(1, 2, fast), (4, 8, fast), (16, 32, slow), (64, math.inf, fast)])[0] == 4
    assert emit.graph_tokens([(1, 2, fast), (4, 8, slow)])[0] == 1
    assert emit.graph_tokens([(1, 1, slow), (2, 2, fast), (4, math.inf, fast)]) == (
        0, f"no row tuned under {emit.GRAPH_BELOW_MS} ms (emit.GRAPH_BELOW_MS)")
    assert emit.graph_tokens([(1, 2, fast), (4, math.inf, fast)])[0] == 4
    assert emit.graph_tokens([(1, 2, fast), (2, 5, fast), (8, math.inf, fast)])[0] == 8
    # The committed modules say how far their graphs reach, and why.
    for shape, _, _ in COMMITTED_MODULES:
        path = emit.module_path(db.COMMITTED_FINGERPRINT, shape.key)
        if path.exists():
            assert "_GRAPH_MAX_TOKENS = " in path.read_text()
