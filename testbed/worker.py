"""Long-lived processes that run one stage's `main(argv)` for request after request, so that an invocation of the
testbed pays Python's, torch's, transformers' and CUDA's start-up once per process rather than once per drafter: the
evaluations (`testbed/evalworker.py`) and the trainings (`testbed/trainworker.py`). The worker's side is `serve`, the
testbed's `Worker` (one process, its requests one at a time) and `Workers` (one process per request in flight).

Protocol: one JSON object a line on the worker's stdin, `{"argv": [the stage's arguments], "log": PATH or null}`; the
stage's output (file descriptors 1 and 2: Python's, the libraries' and C's alike) goes into PATH (null: the worker's
stderr), and the answer is one line `{"rc": N, "fatal": false}` on the worker's original stdout, N as
`python -m stages.<name>` would exit: what `main` returns, 2 for a refused input (a bad flag, a ValueError, a failed
write: `cli.refusal`'s one line in the log). An unexpected error is written into the log as a traceback and answered
`{"rc": 1, "fatal": true}`; the worker then exits (its CUDA state may be broken), and the caller starts a new one for
the next request. After each other request the worker runs its stage's `between` (at least: the memory the request
held, given back) before it answers.
A worker's environment is fixed at its start: `Worker` starts another for a request with another environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

_CHILDREN: set = set()  # the processes this one started (workers, stages, stand-ins): ended with it (`end_children`)
_CHILDREN_LOCK = threading.Lock()
_ENDING = threading.Event()  # set by `end_children`: nothing more is started


def start_child(cmd: list[str], **popen) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **popen)`, remembered so that `end_children` ends it with this process; refused once
    `end_children` began (a thread that saw its last child end would start the next: a stand-in, a worker)."""
    if _ENDING.is_set():
        raise RuntimeError(f"not started ({' '.join(cmd[1:4])} ...): this process is ending")
    proc = subprocess.Popen(cmd, **popen)
    with _CHILDREN_LOCK:
        for done in [c for c in _CHILDREN if c.poll() is not None]:
            _CHILDREN.discard(done)
        _CHILDREN.add(proc)
    if _ENDING.is_set():  # (started while `end_children` ran: it may have read the set before)
        proc.kill()
    return proc


def run_child(cmd: list[str], **popen) -> int:
    """`start_child`, waited for: its exit status (as `subprocess.call`, which kills the child when the wait is
    interrupted)."""
    proc = start_child(cmd, **popen)
    try:
        return proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def end_children(timeout: float = 5.0) -> int:
    """SIGTERM to every process `start_child` started that still runs, SIGKILL to those not ended `timeout` seconds
    later: a testbed stopped by SIGTERM leaves no stage, worker or stand-in on the GPU behind it (they would go on
    for their request, a training or a regeneration, minutes of a rented GPU). Returns how many were running. Safe
    in a signal handler: it waits at most a second for the lock a thread, or the interrupted code, may hold."""
    import time

    _ENDING.set()
    running = _running()
    for c in running:
        c.terminate()
    deadline = time.monotonic() + timeout
    while any(not _ended(c) for c in running) and time.monotonic() < deadline:
        time.sleep(0.05)
    for c in {*running, *_running()}:  # (and any a thread started before it saw `_ENDING`)
        if not _ended(c):
            c.kill()
    return len(running)


def _running() -> list[subprocess.Popen]:
    """The children `start_child` started that run (taking its lock for a second at most: a signal handler may have
    interrupted the code that holds it)."""
    got = _CHILDREN_LOCK.acquire(timeout=1.0)
    try:
        for _ in range(10):
            try:
                return [c for c in list(_CHILDREN) if c.poll() is None]
            except RuntimeError:  # (the set changed meanwhile, the lock not had)
                continue
        return []
    finally:
        if got:
            _CHILDREN_LOCK.release()


def _ended(proc: subprocess.Popen) -> bool:
    """Whether `proc` ended, without waiting for it: from a signal handler that interrupted a wait for it, whose lock
    `poll` then cannot take, its state in /proc says it (a zombie: ended, not yet reaped)."""
    if proc.poll() is not None:
        return True
    try:
        return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(") ", 1)[1][:1] == "Z"
    except (OSError, IndexError):
        return False


def end_process(proc: subprocess.Popen, timeout: float) -> None:
    """Wait up to `timeout` seconds for `proc` to end, then kill it."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """`proc` asked to end now (SIGTERM), killed if it has not `timeout` seconds later (a no-op where it ended)."""
    if proc.poll() is None:
        proc.terminate()
        end_process(proc, timeout)


def import_ahead(*modules: str) -> None:
    """Import `modules` now, quietly and at best, and start CUDA where torch sees a GPU: what a worker's first request
    would otherwise pay before its first line, paid while the worker waits for it (a worker started ahead:
    `Worker.start`). The libraries' import-time warnings are no request's, so they go nowhere; a module that fails
    to import here fails again in the request that needs it, whose log then holds why."""
    import importlib

    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 (see the doc)
                pass
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.init()
    except Exception:  # noqa: BLE001 (CUDA that fails to start fails again, and is reported, in the request)
        pass
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


DIED = 70  # what a request answers when its worker died without answering, having exited 0 or 1 (EX_SOFTWARE)


def run_one(main, argv: list[str], log: str | None, err_fd: int) -> tuple[int, bool]:
    """(exit status, fatal) of `main(argv)` with fds 1 and 2 in `log` (or `err_fd`)."""
    from dflash_offline.cli import refusal

    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if log else os.dup(err_fd)
    saved = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    rc, fatal = 1, False
    try:
        rc = main(argv) or 0
    except SystemExit as e:  # (the config parser's exit on a bad flag)
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001
        line = refusal(e)
        if line is None:
            traceback.print_exc()
            rc, fatal = 1, True
        else:  # as run_cli: one line
            print(line, file=sys.stderr)
            rc = 2
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    return rc, fatal


def free_memory() -> None:
    """What the request just ended held, given back (other processes share the GPU; the training worker keeps a
    resident cache's rows on purpose: `testbed.trainworker`)."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def serve(load: Callable[[], Callable], between: Callable[[], None] = free_memory) -> None:
    """A worker's `main`: answer the requests on stdin (see the module doc) with the stage's main function, which
    `load()` imports once the file descriptors are set (an import's output never reaches the answers); `between()`
    after each request that was not fatal."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)  # the answers; fd 1 itself goes to the logs from now on
    err_fd = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # (a stray print between requests never reaches the answer channel)
    os.close(null)
    from dflash_offline.autotune import from_env

    from_env()  # (what run_cli does before a stage's main)
    main = load()
    for line in sys.stdin:
        job = json.loads(line)
        rc, fatal = run_one(main, job["argv"], job.get("log"), err_fd)
        if not fatal:  # (a fatal one's process ends here)
            between()
        reply.write(json.dumps({"rc": rc, "fatal": fatal}) + "\n")
        if fatal:
            break


class Worker:
    """One process of `python -m module` (a `serve` loop) answering requests one at a time (callers on several
    threads queue), started ahead (`start`) or at the first request, and again after one that died or for a request
    with another environment."""

    def __init__(self, module: str):
        self.module, self.proc, self.env, self.lock, self.asked = module, None, {}, threading.Lock(), False

    def run(self, args: list[str], log_file: Path | None, env: dict | None = None) -> int:
        """`python -m stages.<name> args`'s exit status, its output in `log_file` (None: this process's stderr), `env`
        added to this process's environment."""
        with self.lock:
            self._ready(env)
            if log_file is not None:
                log_file.parent.mkdir(parents=True, exist_ok=True)
            self.asked = True
            try:
                self.proc.stdin.write(json.dumps({"argv": args, "log": str(log_file) if log_file else None}) + "\n")
                self.proc.stdin.flush()
                line = self.proc.stdout.readline()
            except BrokenPipeError:
                line = ""
            if not line:  # it died (killed, out of memory): the next request starts another
                rc = self.proc.wait()
                self.proc = None
                return rc if rc not in (0, 1) else DIED  # (a failure, whatever the status it died with)
            answer = json.loads(line)
            if answer.get("fatal"):  # it ends now: wait for that, so that the next request starts a new one
                self._end()
            return answer["rc"]

    def start(self, env: dict | None = None) -> None:
        """Start the process now, for requests with `env` to come (its start-up, the worker's `load`, then runs
        beside what the caller does meanwhile); one already running with `env` is kept, and one serving a request
        now is left to it (its next request restarts it where `env` differs): a start never waits."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            self._ready(env)
        finally:
            self.lock.release()

    def _ready(self, env: dict | None) -> None:
        if self.proc is not None and (self.proc.poll() is not None or (env or {}) != self.env):
            self._end()
        if self.proc is None:
            self.env, self.asked = dict(env or {}), False
            self.proc = start_child([sys.executable, "-m", self.module], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})

    def _end(self) -> None:
        self.proc.stdin.close()
        if not self.asked:  # (started ahead and never asked: not worth waiting for its imports to end)
            self.proc.terminate()
        end_process(self.proc, 60)
        self.proc = None

    def close(self) -> None:
        """Ends the process (at the end of the drafters)."""
        with self.lock:
            if self.proc is not None:
                self._end()

    def terminate(self) -> None:
        """Ends the process now, a request in flight included (it answers the signal's exit status; the next request
        starts another): what the caller asked for is no longer wanted (a phase failed, or was interrupted)."""
        if (proc := self.proc) is not None:
            stop_process(proc, 30)


class Workers:
    """`Worker`s of one module, as many as requests in flight: a request takes an idle one started with its
    environment, or a new one; no two requests share one at a time."""

    def __init__(self, module: str):
        self.module, self.idle, self.lock = module, [], threading.Lock()

    def run(self, args: list[str], log_file: Path | None, env: dict | None = None) -> int:
        """As `Worker.run`."""
        with self.lock:
            same = [w for w in self.idle if w.env == (env or {})]
            w = same[0] if same else Worker(self.module)
            if same:
                self.idle.remove(w)
        try:
            return w.run(args, log_file, env)
        finally:
            with self.lock:
                self.idle.append(w)

    def start(self, env: dict | None = None) -> None:
        """An idle process for requests with `env`, started now (`Worker.start`), unless one is there already."""
        with self.lock:
            if any(w.env == (env or {}) for w in self.idle):
                return
            w = Worker(self.module)
            self.idle.append(w)
        w.start(env)

    def discard(self, env: dict | None) -> None:
        """Ends the idle processes started with `env` (one no later request asks for: their GPU context and compile
        workers given back)."""
        with self.lock:
            gone = [w for w in self.idle if w.env == (env or {})]
            self.idle = [w for w in self.idle if w not in gone]
        for w in gone:
            w.close()

    def close(self) -> None:
        """Ends every process (at the end of the drafters, and before jobs that ran out of GPU memory are tried
        again)."""
        with self.lock:
            idle, self.idle = self.idle, []
        for w in idle:
            w.close()
