"""Interrupted runs and many workers on one study: which RUNNING trials a starting worker closes as
abandoned (and queues again), and which it leaves to the live workers that own them."""

import os
import socket
import subprocess
import sys

import optuna
from sqlalchemy import create_engine, text
from test_tuner import CASES

from autotune import db, space, target, tuner
from autotune.tuner import TuneConfig, tune


def _exited_pid() -> int:
    """The pid of a process of this host that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_trial_another_worker_is_running_is_left_to_it(tmp_path):
    """Many tuners on one study: a starting worker fails only the RUNNING trials whose worker is gone
    (a process of this host that has exited, a trial that names no worker, or one of another host
    running past the trial timeout), not those of live workers; a worker whose trial was closed so
    logs it and goes on."""
    url = f"sqlite:///{tmp_path / 'workers.sqlite3'}"
    study = optuna.create_study(study_name="workers", storage=url, direction="minimize")
    here, elsewhere = socket.gethostname(), socket.gethostname() + "-other"
    owners = {"mine": {"host": here, "pid": os.getpid()}, "exited": {"host": here, "pid": _exited_pid()},
              "unnamed": None, "other host": {"host": elsewhere, "pid": 1},
              "other host, hung": {"host": elsewhere, "pid": 1}}
    trials = {}
    for name, owner in owners.items():
        trials[name] = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
        if owner is not None:
            trials[name].set_user_attr("owner", owner)
    with create_engine(url).begin() as c:  # started long before the trial timeout
        c.execute(text("UPDATE trials SET datetime_start = '2000-01-01 00:00:00' WHERE number = :n"),
                  {"n": trials["other host, hung"].number})
    tuner._fail_stale(study, timeout_s=60)
    state = {name: study.trials[t.number].state.name for name, t in trials.items()}
    assert state == {"mine": "RUNNING", "exited": "FAIL", "unnamed": "FAIL", "other host": "RUNNING",
                     "other host, hung": "FAIL"}
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
    point = space.suggest(cut_off, case).as_dict()
    tune([case], TuneConfig(storage_url=url, trials=1, isolate=False, reps=1), log=lambda m: None)
    trials = optuna.load_study(study_name=study.study_name, storage=url).trials
    assert [t.state for t in trials].count(optuna.trial.TrialState.RUNNING) == 0
    assert trials[0].user_attrs.get("interrupted") is True
    # The cut-off point is run again (a trial records only the parameters it was asked).
    retried = [t for t in trials[1:] if space.Variant.from_dict(t.params).as_dict() == point]
    assert retried and retried[0].state != optuna.trial.TrialState.RUNNING
