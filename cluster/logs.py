"""What a run prints: its own progress lines and errors, without the libraries' chatter.

    quiet_libraries(cfg.cluster.verbose)      # driver (cluster/train.py) and each worker
    quiet_ray_worker(cfg.cluster.verbose)     # each worker (cluster/worker.py)
    quiet_ray_driver(cfg.cluster.verbose)     # the driver, before ray.init
    RunConfig(logging_config=ray_train_logging(verbose))
    with tee_to_job_log():                    # the driver: the console also lands in Hydra's log

A healthy run shows the step lines (rank 0), the data, MLflow and `== done ==` notes, and any
warning or error. What it leaves out unless `cluster.verbose=true`:

- Ray Train's INFO lines ("Requesting resources", "Started training worker group", "Setting up
  process group"), through the supported knob, RunConfig's LoggingConfig; and its "Reporting
  training result 1: ... from rank 0", one per ray.train.report per rank, which that knob misses
  (`quiet_ray_worker`). Ray Train's warnings and errors still show.
- Ray's "Token authentication is enabled for this Ray cluster" note on a local start (the
  default it announces stays in force).
- INFO from MLflow's system-metrics monitor and database set-up, and matplotlib's font manager.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
from typing import Iterator, Optional, TextIO

QUIET_LOGGERS = {
    "mlflow.system_metrics": logging.WARNING,  # started/stopped monitoring, no GPU metrics
    "mlflow.store.db.utils": logging.WARNING,  # creating the database tables (first run)
    "alembic": logging.WARNING,  # MLflow's schema migrations (first run)
    "matplotlib": logging.ERROR,  # font manager: font lists, building the font cache
}
"""Library loggers turned down in a quiet run, to these levels."""


def quiet_libraries(verbose: bool) -> None:
    """Turn the chatty library loggers down (or leave them as they are when verbose). Runs in
    the driver and in each worker process: a logger's level is per process."""
    if verbose:
        return
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)


def quiet_ray_worker(verbose: bool) -> None:
    """In each worker: leave out Ray Train's "Reporting training result N: ... from rank R" line.
    Ray (2.60) logs it on a logger named after its file path (context.py: getLogger(__file__)),
    outside `ray.train`, so its LoggingConfig does not reach it; that logger is turned down."""
    if verbose:
        return
    try:  # Ray's internals, probed: where they moved, the line stays
        from ray.train.v2._internal.execution import context  # noqa: PLC0415 -- in workers
    except ImportError:
        return
    context.logger.setLevel(logging.WARNING)


def ray_train_logging(verbose: bool):
    """Ray Train's LoggingConfig: its `ray.train` INFO lines on the console only when verbose.
    Ray applies it to the controller and to every worker (its TrainLogLevelFilter)."""
    import ray.train  # noqa: PLC0415 -- ray: seconds to import, only to run a job

    return ray.train.LoggingConfig(log_level="INFO" if verbose else "WARNING")


class DropMessage(logging.Filter):
    """Drops the records whose message starts with `prefix`."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


TOKEN_AUTH_NOTE = DropMessage("Token authentication is enabled for this Ray cluster.")
"""Ray (2.60) warns on every local start that it enabled token auth, its default; the run's
Ray is the launching user's own. Its warning that token auth is disabled is kept."""


def quiet_ray_driver(verbose: bool) -> None:
    """Before ray.init in the driver: leave out Ray's note that it enabled token auth."""
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if verbose:
        logger.removeFilter(TOKEN_AUTH_NOTE)
    else:
        logger.addFilter(TOKEN_AUTH_NOTE)


# ---- the driver's console in Hydra's job log -----------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Tee:
    """A text stream that writes to the console and appends, colours stripped, to a file.

    The step lines reach the driver as Ray forwards the workers' output, on Ray's log thread:
    writes are serialized and flushed line by line, so the file interleaves whole lines with
    the log records Hydra's own file handler appends to the same file."""

    def __init__(self, console: TextIO, file: TextIO, lock: threading.Lock):
        self.console, self.file, self.lock = console, file, lock

    def write(self, text: str) -> int:
        with self.lock:
            n = self.console.write(text)
            self.file.write(ANSI.sub("", text))
            if "\n" in text:
                self.file.flush()
        return n

    def flush(self) -> None:
        with self.lock:
            self.console.flush()
            self.file.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding...: the console's
        return getattr(self.console, name)


def job_log_path() -> Optional[str]:
    """The file of Hydra's job logging (<output dir>/<job name>.log); None when disabled."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None


@contextlib.contextmanager
def tee_to_job_log() -> Iterator[None]:
    """While the job runs, what the driver prints (its own lines and the workers' Ray forwards)
    also goes to Hydra's job log, which otherwise holds only `logging` records."""
    path = job_log_path()
    if path is None:
        yield
        return
    out, err = sys.stdout, sys.stderr
    lock = threading.Lock()
    with open(path, "a", encoding="utf-8") as file:
        sys.stdout, sys.stderr = Tee(out, file, lock), Tee(err, file, lock)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = out, err
