"""What a run prints: its own progress lines and errors, without the libraries' chatter.

    quiet_libraries(cfg.cluster.verbose)      # driver (cluster/train.py) and each worker
    quiet_ray_worker(cfg.cluster.verbose)     # each worker (cluster/worker.py)
    quiet_ray_driver(cfg.cluster.verbose)     # the driver, before ray.init
    plain_ray_console()                       # the driver, before ray.init: no colour in a pipe
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
- The lines of Ray Train's PlacementGroupCleaner actor (a detached helper that polls the State
  API every second and warns whenever it cannot): they stay in Ray's session logs
  (<ray temp dir>/session_latest/logs/worker-*.err).
- Ray's "INFO worker.py -- Started a local Ray instance" record: the driver says it in its own
  words once Ray is up (cluster/launch.py, `ray: started a local Ray ...`).
- The "(RayTrainWorker pid=...)" prefix Ray puts before every line it forwards from a worker:
  the step lines are rank 0's own, and say so. Lines of other actors keep their prefix.

When stdout is not a terminal (a pipe, a file, `ray job submit`'s log) nothing carries ANSI
colour codes: Ray's "(RayTrainWorker pid=...)" prefixes (RAY_COLOR_PREFIX=0), its "Started a
local Ray instance" line, Ray Data's progress bars (RAY_DATA_DISABLE_PROGRESS_BARS=1). A user's
own setting of either variable stands.
"""

from __future__ import annotations

import contextlib
import logging
import os
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
    """Before ray.init in the driver: leave out Ray's note that it enabled token auth, and the
    PlacementGroupCleaner's lines Ray forwards from its actor (`Tee`)."""
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    started = logging.getLogger(RAY_STARTED_LOGGER)
    if verbose:
        logger.removeFilter(TOKEN_AUTH_NOTE)
        started.removeFilter(RAY_STARTED_NOTE)
    else:
        logger.addFilter(TOKEN_AUTH_NOTE)
        started.addFilter(RAY_STARTED_NOTE)
    _Hidden.helpers = () if verbose else HIDDEN_HELPERS
    _Hidden.worker_prefix = None if verbose else WORKER_PREFIX


class PlainText(logging.Filter):
    """Takes the ANSI colour codes out of a record's message (Ray colours its dashboard URL)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "\x1b[" in message:
            record.msg, record.args = ANSI.sub("", message), None
        return True


PLAIN_TEXT = PlainText()
RAY_STARTED_LOGGER = "ray._private.worker"  # "Started a local Ray instance. View the dashboard"


class _Without(logging.Filter):
    """Leaves out the records whose message starts with `start`."""

    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


RAY_STARTED_NOTE = _Without("Started a local Ray instance")
WORKER_PREFIX = re.compile(
    r"^(\x1b\[[0-9;]*m)?\(RayTrainWorker pid=\d+(, ip=[^)]*)?\)(\x1b\[0m)? ", re.M
)
"""Ray's prefix of a line forwarded from a Ray Train worker (coloured on a terminal)."""


def plain_ray_console(stream: Optional[TextIO] = None) -> bool:
    """Before ray.init in the driver: no ANSI colour codes in what Ray prints when `stream`
    (stdout) is not a terminal. Returns whether colours were turned off."""
    stream = stream or sys.stdout
    if stream.isatty():
        return False
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # ray/_private/worker.py print_worker_logs
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")  # ray/data/context.py
    logger = logging.getLogger(RAY_STARTED_LOGGER)
    if PLAIN_TEXT not in logger.filters:
        logger.addFilter(PLAIN_TEXT)
    return True


# ---- the workers' lines, all of them, before the driver goes on ------------------------------

NEVER_DEDUP = r"(step \d+/\d+ \| |start-up |elastic: |elastic-fsdp: end of output)"
"""Ray's driver folds lines that are equal once their numbers are removed and that come from
different processes within 5 s into one "[repeated Nx]" line: every step line looks alike, so
the first steps after a restart, or of a sweep's next job, were dropped. These lines are never
folded (RAY_DEDUP_LOGS_ALLOW_REGEX, set before Ray is imported; a user's own setting stands)."""

END_OF_OUTPUT = "elastic-fsdp: end of output "
"""Rank 0's last line (followed by the launch id): Ray forwards the workers' output to the
driver asynchronously, so their last lines can arrive after fit() returned, after the closing
note or inside a sweep's next job. The driver waits for this line (`wait_for_workers_output`),
which its console stream swallows."""


class _Ends:
    seen: set[str] = set()
    arrived = threading.Condition()


HIDDEN_HELPERS = ("(PlacementGroupCleaner pid=",)
"""Ray helper actors whose forwarded lines a quiet run leaves out of the console (the module's
docstring says why)."""


class _Hidden:
    helpers: tuple[str, ...] = HIDDEN_HELPERS
    worker_prefix: Optional[re.Pattern] = WORKER_PREFIX


def _hidden_helper(text: str) -> bool:
    """Whether `text` is a line Ray forwarded from a hidden helper actor."""
    return bool(_Hidden.helpers) and ANSI.sub("", text).startswith(_Hidden.helpers)


def end_of_output(launch_id: str) -> str:
    """The line rank 0 prints last (cluster/worker.py)."""
    return END_OF_OUTPUT + launch_id


def wait_for_workers_output(launch_id: str, timeout_s: float = 10.0) -> bool:
    """In the driver, once fit() returned: wait until rank 0's last line has been printed here
    (True), or `timeout_s` (False: a rank 0 that died prints none)."""
    with _Ends.arrived:
        return _Ends.arrived.wait_for(lambda: launch_id in _Ends.seen, timeout_s)


def _saw_end(text: str) -> bool:
    """Whether `text` carries the end-of-output line (it is then not shown)."""
    at = text.find(END_OF_OUTPUT)
    if at < 0:
        return False
    launch_id = (text[at + len(END_OF_OUTPUT) :].split() or [""])[0]
    with _Ends.arrived:
        _Ends.seen.add(launch_id)
        _Ends.arrived.notify_all()
    return True


# ---- the driver's console in Hydra's job log -----------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Tee:
    """A text stream that writes to the console and appends, colours stripped, to a file; each
    line starts with `prefix` (a sweep's '[job 3/4 sharding=no_shard] ') in both.

    The step lines reach the driver as Ray forwards the workers' output, on Ray's log thread:
    writes are serialized and flushed line by line, so the file interleaves whole lines with
    the log records Hydra's own file handler appends to the same file. The console and the file
    are one Tee's each for stdout and stderr, sharing `at_line_start`, so a line written in
    pieces gets one prefix."""

    def __init__(
        self,
        console: TextIO,
        file: Optional[TextIO],
        lock: threading.Lock,
        prefix: str = "",
        at_line_start: Optional[list[bool]] = None,
    ):
        self.console, self.file, self.lock, self.prefix = console, file, lock, prefix
        self.at_line_start = at_line_start if at_line_start is not None else [True]
        self.skip_newline = False

    def write(self, text: str) -> int:
        with self.lock:
            if _saw_end(text) or _hidden_helper(text):  # noted (the end) or left out: not shown
                self.skip_newline = not text.endswith("\n")  # print() writes its end apart
                return len(text)
            if self.skip_newline:
                self.skip_newline = False
                if text == "\n":
                    return 1
            text = self._unprefixed(text)
            shown = self._prefixed(text) if self.prefix else text
            if not self.prefix:
                self.at_line_start[0] = text.endswith(("\n", "\r"))
            self.console.write(shown)
            if self.file is not None:
                self.file.write(ANSI.sub("", shown))
                if "\n" in text:
                    self.file.flush()
        return len(text)

    def _unprefixed(self, text: str) -> str:
        """`text` without Ray's "(RayTrainWorker pid=...)" at the start of its lines (a quiet
        run), the first piece only when it starts a line."""
        pattern = _Hidden.worker_prefix
        if pattern is None:
            return text
        if self.at_line_start[0]:
            return pattern.sub("", text)
        head, newline, rest = text.partition("\n")
        return head + newline + pattern.sub("", rest) if newline else text

    def _prefixed(self, text: str) -> str:
        out = []
        for piece in text.splitlines(keepends=True):
            if self.at_line_start[0]:
                out.append(self.prefix)
            out.append(piece)
            self.at_line_start[0] = piece.endswith(("\n", "\r"))
        return "".join(out)

    def flush(self) -> None:
        with self.lock:
            self.console.flush()
            if self.file is not None:
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
def tee_to_job_log(prefix: str = "") -> Iterator[None]:
    """While the job runs, what the driver prints (its own lines and the workers' Ray forwards)
    also goes to Hydra's job log, which otherwise holds only `logging` records; every line
    starts with `prefix` (a sweep job's), on the console and in the file. The workers'
    end-of-output line is taken out here (`wait_for_workers_output`)."""
    path = job_log_path()
    out, err = sys.stdout, sys.stderr
    lock, at_line_start = threading.Lock(), [True]
    with open(path, "a", encoding="utf-8") if path else contextlib.nullcontext() as file:
        sys.stdout = Tee(out, file, lock, prefix, at_line_start)
        sys.stderr = Tee(err, file, lock, prefix, at_line_start)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = out, err
