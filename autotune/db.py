"""The tuning database: runs (with the hardware and software they ran on) and every trial.

Any SQLAlchemy URL works; the default is the embedded SQLite file under db/. Optuna keeps its own
tables (studies, trials, ...) in the same database; ours are prefixed `mt_`.
"""

from __future__ import annotations

import importlib.util
import socket
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

import optuna
from sqlalchemy import JSON, Boolean, DateTime, Float, ForeignKey, Integer, String, Text, create_engine, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from . import __version__
from .target import Fingerprint

DB_DIR = Path(__file__).resolve().parent.parent / "db"
GPU_PATH = DB_DIR / "moe_tune.sqlite3"
GPU_URL = f"sqlite:///{GPU_PATH}"
# The machine whose runs that database holds, and whose module kernels_generated/ ships.
COMMITTED_FINGERPRINT = "H200-sm90-triton3.6.0"
# CPU demo runs go to their own file so they never mix into the committed GPU database.
DEMO_URL = f"sqlite:///{DB_DIR / 'demo.sqlite3'}"

STATUSES = ("ok", "rejected", "compile_error", "runtime_error", "wrong", "timeout", "crashed")
# Outcomes the same code gives again on the same case and machine: reused, never re-run.
SETTLED = ("ok", "compile_error", "wrong")
# Failures that may be the machine's rather than the code's (another process's memory, a driver that
# hung, a worker killed from outside): such a source is run again until it has failed this often.
TRANSIENT_TRIES = 2


def _now() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class Run(Base):
    """One `moe-tune tune` invocation and the machine it ran on."""

    __tablename__ = "mt_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[datetime] = mapped_column(DateTime, default=_now)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    host: Mapped[str] = mapped_column(String(255))
    command: Mapped[str] = mapped_column(Text)
    moe_tune: Mapped[str] = mapped_column(String(32))
    fingerprint: Mapped[str] = mapped_column(String(255), index=True)
    gpu: Mapped[str] = mapped_column(String(255))
    capability: Mapped[str] = mapped_column(String(32))
    driver: Mapped[str] = mapped_column(String(64))
    cuda: Mapped[str] = mapped_column(String(64))
    torch: Mapped[str] = mapped_column(String(64))
    triton: Mapped[str] = mapped_column(String(64))
    interpreter: Mapped[bool] = mapped_column(Boolean)
    # Ceilings measured at the start of the run, in the worker that times the trials.
    read_bytes_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    matmul_flops_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)


class Trial(Base):
    """One variant tried on one case: what ran, whether it was right, and how long it took."""

    __tablename__ = "mt_trials"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("mt_runs.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=_now)
    study: Mapped[str] = mapped_column(String(255), index=True)
    fingerprint: Mapped[str] = mapped_column(String(255), index=True)
    case_key: Mapped[str] = mapped_column(String(255), index=True)
    case: Mapped[dict] = mapped_column(JSON)
    optuna_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    params: Mapped[dict] = mapped_column(JSON)
    label: Mapped[str] = mapped_column(Text)
    source_hash: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    status: Mapped[str] = mapped_column(String(32), index=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    global_rel_l2: Mapped[float | None] = mapped_column(Float, nullable=True)
    worst_token_rel_l2: Mapped[float | None] = mapped_column(Float, nullable=True)
    rms_ratio: Mapped[float | None] = mapped_column(Float, nullable=True)
    compile_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    median_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    p10_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    p90_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    mean_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    std_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    reps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    timing_method: Mapped[str | None] = mapped_column(String(32), nullable=True)
    samples_ms: Mapped[list | None] = mapped_column(JSON, nullable=True)
    experts_touched: Mapped[int | None] = mapped_column(Integer, nullable=True)
    floor_ms: Mapped[float | None] = mapped_column(Float, nullable=True)


def default_url(gpu: bool) -> str:
    return GPU_URL if gpu else DEMO_URL


_T = TypeVar("_T")
SCHEMA_ATTEMPTS = 6


def _racing_schema(make: Callable[[], _T]) -> _T:
    """`make` (which creates tables where missing) again after a failure: workers started together on an
    empty database race to create the schema, and the loser's CREATE or version insert fails (or finds
    SQLite locked); by the next attempt the winner has made it."""
    for attempt in range(SCHEMA_ATTEMPTS - 1):
        try:
            return make()
        except (IntegrityError, OperationalError, ProgrammingError):
            time.sleep(0.25 * (attempt + 1))
    return make()  # the last attempt's failure is the caller's


def with_driver(url: str) -> str:
    """`url` with a PostgreSQL driver SQLAlchemy can load: a plain postgresql:// (or postgres://) URL
    names psycopg2 to it, so where only psycopg 3 is installed (the [postgres] extra) the URL names
    that one. Other URLs, and ones naming a driver, are left as they are."""
    scheme, sep, rest = url.partition("://")
    if scheme not in ("postgresql", "postgres") or not sep:
        return url
    psycopg3_only = importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None
    return f"postgresql{'+psycopg' if psycopg3_only else ''}://{rest}"


def connect(url: str, create: bool = True) -> Engine:
    """An engine on `url` with our tables created (SQLite's folder too). ValueError, naming the URL, where
    it names no dialect or driver installed here, or a database that cannot be opened; and, unless
    `create`, an SQLite file that does not exist (a command that only reads must not leave an empty
    database behind a mistyped path)."""
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        if not create and not path.is_file():
            raise ValueError(f"database {url!r}: no such file")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a plain file where a folder must be
            raise ValueError(f"database {url!r}: {exc}") from exc
    try:
        engine = create_engine(with_driver(url))
        _racing_schema(lambda: Base.metadata.create_all(engine))
    except (SQLAlchemyError, ImportError) as exc:
        raise ValueError(f"database {url!r}: {str(exc).splitlines()[0]}") from exc
    return engine


def optuna_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's storage on `url` (its tables beside ours), made once per run."""
    return _racing_schema(lambda: optuna.storages.RDBStorage(with_driver(url)))


def start_run(session: Session, fp: Fingerprint, command: str, ceilings: dict | None) -> Run:
    ceilings = ceilings or {}
    run = Run(
        host=socket.gethostname(), command=command, moe_tune=__version__, fingerprint=fp.key,
        gpu=fp.gpu, capability=fp.capability, driver=fp.driver, cuda=fp.cuda, torch=fp.torch,
        triton=fp.triton, interpreter=fp.interpreter,
        read_bytes_per_s=ceilings.get("read_bytes_per_s"),
        matmul_flops_per_s=ceilings.get("matmul_flops_per_s"),
    )
    session.add(run)
    session.commit()
    return run


def finish_run(session: Session, run: Run) -> None:
    run.finished_at = _now()
    session.commit()


def record_trial(session: Session, **fields) -> Trial:
    trial = Trial(**fields)
    if trial.status not in STATUSES:
        raise ValueError(f"unknown trial status {trial.status!r}")
    session.add(trial)
    session.commit()
    return trial


def cached_result(session: Session, fingerprint: str, case_key: str, source_hash: str) -> Trial | None:
    """The latest trial of the same source on the same case and machine, where its outcome stands: a
    settled one (a time, a compile error, a wrong answer), or a failure of another kind met in each of
    its latest TRANSIENT_TRIES trials. None where the source is to be run (again)."""
    latest = list(session.scalars(
        select(Trial).where(Trial.fingerprint == fingerprint, Trial.case_key == case_key,
                            Trial.source_hash == source_hash, Trial.status != "rejected")
        .order_by(Trial.id.desc()).limit(TRANSIENT_TRIES)
    ))
    if latest and (latest[0].status in SETTLED
                   or (len(latest) == TRANSIENT_TRIES and all(t.status not in SETTLED for t in latest))):
        return latest[0]
    return None


def _latest_per_source(trials) -> list[Trial]:
    """One trial per measured source and case, its latest (`tune --retime` times a source again so that
    the contenders compare on one state of the GPU: the newer timing is the one that counts). A source
    is the same module at every T, so its timings on two cases are two results, not one."""
    latest: dict[tuple[str, str], Trial] = {}
    for t in sorted(trials, key=lambda t: t.id):
        latest[t.case_key, t.source_hash or f"#{t.id}"] = t
    return list(latest.values())


def verified_trials(session: Session, fingerprint: str, case_key: str) -> list[Trial]:
    """Every verified trial of one case on this fingerprint, in the order they were recorded."""
    return list(session.scalars(
        select(Trial).where(Trial.fingerprint == fingerprint, Trial.case_key == case_key, Trial.status == "ok")
        .order_by(Trial.id)
    ))


def ranked_trials(session: Session, fingerprint: str, case_key: str) -> list[Trial]:
    """Verified trials of one case on this fingerprint, fastest first, each source by its latest timing."""
    return sorted(_latest_per_source(verified_trials(session, fingerprint, case_key)), key=lambda t: t.median_ms)


def best_trials(session: Session, fingerprint: str, case_keys: list[str] | None = None) -> dict[str, Trial]:
    """Fastest verified trial per case on this fingerprint (never another GPU's or Triton's), each
    source by its latest timing."""
    query = select(Trial).where(Trial.fingerprint == fingerprint, Trial.status == "ok")
    if case_keys is not None:
        query = query.where(Trial.case_key.in_(case_keys))
    best: dict[str, Trial] = {}
    for t in _latest_per_source(session.scalars(query)):
        if t.case_key not in best or t.median_ms < best[t.case_key].median_ms:
            best[t.case_key] = t
    return best


def tuned_cases(session: Session, fingerprint: str) -> list[dict]:
    """The case of every study on this fingerprint with a verified trial (each case's dict once)."""
    first = (select(func.min(Trial.id)).where(Trial.fingerprint == fingerprint, Trial.status == "ok")
             .group_by(Trial.case_key))
    return list(session.scalars(select(Trial.case).where(Trial.id.in_(first))))


def history(session: Session, case_key: str | None = None, limit: int = 50) -> list[Trial]:
    query = select(Trial).order_by(Trial.id.desc()).limit(limit)
    if case_key is not None:
        query = query.where(Trial.case_key == case_key)
    return list(session.scalars(query))


def fingerprints(session: Session) -> list[str]:
    return sorted(set(session.scalars(select(Run.fingerprint))))


def run_of(session: Session, run_id: int) -> Run:
    return session.get(Run, run_id)


