"""Interrupted runs and many workers on one study: which RUNNING trials a starting worker closes as
abandoned (and queues again), and which it leaves to the live workers that own them."""

import os
import socket
import subprocess
import sys

import optuna
import pytest
from conftest import GPU
from sqlalchemy import create_engine, text
from test_tuner import CASES

from autotune import db, search, space, target, tuner
from autotune.tuner import TuneConfig, tune
from autotune.workloads import Shape, suite


def _exited_pid() -> int:
    """The pid of a process of this host that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_trial_another_worker_is_running_is_left_to_it(tmp_path):
    """Many tuners on one study: a starting worker fails only the RUNNING trials whose worker is gone
    (a process of this host that has exited, a trial that has named no worker for a minute, or one of
    another host running past the trial timeout), not those of live workers (one that has just asked
    and not yet named itself included); a worker whose trial was closed so logs it and goes on."""
    url = f"sqlite:///{tmp_path / 'workers.sqlite3'}"
    study = optuna.create_study(study_name="workers", storage=url, direction="minimize")
    here, elsewhere = socket.gethostname(), socket.gethostname() + "-other"
    owners = {"mine": {"host": here, "pid": os.getpid()}, "exited": {"host": here, "pid": _exited_pid()},
              "unnamed, just asked": None, "unnamed, old": None, "other host": {"host": elsewhere, "pid": 1},
              "other host, hung": {"host": elsewhere, "pid": 1}}
    trials = {}
    for name, owner in owners.items():
        trials[name] = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
        if owner is not None:
            trials[name].set_user_attr("owner", owner)
    with create_engine(url).begin() as c:  # started long before the trial timeout
        for name in ("unnamed, old", "other host, hung"):
            c.execute(text("UPDATE trials SET datetime_start = '2000-01-01 00:00:00' WHERE number = :n"),
                      {"n": trials[name].number})
    tuner._fail_stale(study, timeout_s=60)
    state = {name: study.trials[t.number].state.name for name, t in trials.items()}
    assert state == {"mine": "RUNNING", "exited": "FAIL", "unnamed, just asked": "RUNNING", "unnamed, old": "FAIL",
                     "other host": "RUNNING", "other host, hung": "FAIL"}
    assert len(study.get_trials(states=(optuna.trial.TrialState.WAITING,))) == 3  # their points, queued again
    said = []
    tuner._tell(study, trials["exited"], 1.0, log=said.append)  # its worker was slow, not gone
    assert len(said) == 1 and "closed by another worker" in said[0]


def test_interrupted_trial_is_failed_and_the_study_goes_on(tmp_path):
    """A run killed mid-trial leaves it RUNNING in the database; the next run marks it failed and
    still reaches its target."""
    url = f"sqlite:///{tmp_path / 'interrupted.sqlite3'}"
    case = CASES[0]
    db.connect(url)
    study = optuna.create_study(study_name=tuner.study_name(case, target.fingerprint()), storage=url,
                                direction="minimize")
    cut_off = study.ask()  # the trial the "killed" run was in the middle of
    cut_off.set_user_attr("owner", {"host": socket.gethostname(), "pid": _exited_pid()})
    point = search.suggest(cut_off, case).as_dict()
    tune([case], TuneConfig(storage_url=url, trials=1, isolate=False, reps=1), log=lambda m: None)
    trials = optuna.load_study(study_name=study.study_name, storage=url).trials
    assert [t.state for t in trials].count(optuna.trial.TrialState.RUNNING) == 0
    assert trials[0].user_attrs.get("interrupted") is True
    # The cut-off point is run again (a trial records only the parameters it was asked), queued behind
    # the run's re-timings (its place in the queue closed as interrupted, with no parameters).
    asked = [t for t in trials[1:] if not t.user_attrs.get("interrupted")]
    retried = [t for t in asked if space.Variant.from_dict(t.params).as_dict() == point]
    assert retried and retried[0].state != optuna.trial.TrialState.RUNNING


# A PostgreSQL server to run the two-worker test against too, as a libpq URL to a database the test
# may create others from (e.g. postgresql://moe@127.0.0.1:5432/postgres); unset, only SQLite runs.
PG_ADMIN = os.environ.get("MOE_TUNE_TEST_POSTGRES")


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_url(request, tmp_path):
    """An empty database for two workers: a SQLite file, or a fresh database on the PostgreSQL server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'shared.sqlite3'}"
        return
    if not PG_ADMIN:
        pytest.skip("MOE_TUNE_TEST_POSTGRES names no PostgreSQL server")
    psycopg = pytest.importorskip("psycopg")
    name = f"moetune_test_{os.getpid()}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}"')
        c.execute(f'CREATE DATABASE "{name}"')
    yield f"{PG_ADMIN.rsplit('/', 1)[0]}/{name}"  # no driver named: db.with_driver picks psycopg
    with psycopg.connect(PG_ADMIN, autocommit=True) as c:
        c.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def test_two_tuners_on_one_database(shared_url):
    """Two `moe-tune tune` processes started together on one database both finish, each running its
    own trials of the shared studies, and leave no trial RUNNING (README: many workers)."""
    shape = Shape(E=4, H=32, I=32, k=2, dtype="bfloat16" if GPU else "float16")
    cmd = [sys.executable, "-m", "autotune.cli", "tune", "--shape", "4,32,32,2", "--tokens", "1,9", "--dtype",
           shape.dtype, "--more", "2", "--db", shared_url, "--in-process"]
    workers = [subprocess.Popen([*cmd, "--seed", str(i)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i in range(2)]
    logs = [w.communicate(timeout=900)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], logs
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    summaries = optuna.get_all_study_summaries(shared_url)
    assert {s.study_name.split("@")[0] for s in summaries} == {c.key for c in suite(shape, (1, 9))}
    for s in summaries:
        trials = optuna.load_study(study_name=s.study_name, storage=shared_url).trials
        assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
        owners = {t.user_attrs["owner"]["pid"] for t in trials if "owner" in t.user_attrs}
        assert owners == {w.pid for w in workers}, s.study_name


@pytest.mark.parametrize("installed, url, want", [
    ({"psycopg"}, "postgresql://u@h/db", "postgresql+psycopg://u@h/db"),
    ({"psycopg"}, "postgres://u@h/db", "postgresql+psycopg://u@h/db"),
    ({"psycopg", "psycopg2"}, "postgresql://u@h/db", "postgresql://u@h/db"),
    ({"psycopg2"}, "postgres://u@h/db", "postgresql://u@h/db"),
    ({"psycopg"}, "postgresql+pg8000://u@h/db", "postgresql+pg8000://u@h/db"),
    ({"psycopg"}, "sqlite:////tmp/x.sqlite3", "sqlite:////tmp/x.sqlite3"),
])
def test_a_postgresql_url_gets_the_installed_driver(monkeypatch, installed, url, want):
    monkeypatch.setattr(db.importlib.util, "find_spec", lambda name: object() if name in installed else None)
    assert db.with_driver(url) == want
