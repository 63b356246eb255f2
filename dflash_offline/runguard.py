"""A training run is owned by one trainer and stops cleanly when asked.

Ownership: `owned(run_dir)` holds `RUN/.run.lock` while a run trains, created with O_EXCL (local disks and shared
filesystems alike) and holding its holder's host, pid and start time. A second trainer on the same run is refused
at once with one line naming the holder. A lock whose holder ran on this host and is gone (killed, crashed) is
broken with a message, as the cache's lock is (`cache.fsio.pid_alive`). The holder touches the lock every
`HEARTBEAT_S`; one from another host (a job restarted on another machine of a shared filesystem) is broken once it
has not been touched for `OTHER_HOST_STALE_S`, the only sign of life visible from here. Rank 0 alone holds it for a
multi-process run.

Stopping: `StopSignals` turns SIGTERM and SIGINT into a request the loop reads between steps (the step in flight
finishes, a final checkpoint is written, the status file says `interrupted`); a second signal (more than `REPEAT_S` after
the first: launchers forward the scheduler's SIGTERM), or a stop that has not finished within its grace, exits at once without a final checkpoint (the previous one stays whole). The exit
status is 128 + the signal: 130 for SIGINT, 143 for SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from .cache.fsio import boot_id, pid_alive
from .cache.manifest import MANIFEST, cache_kind

LOCK = ".run.lock"
HEARTBEAT_S = 60.0  # the holder touches its lock this often
OTHER_HOST_STALE_S = 600.0  # a lock from another host untouched this long is a dead holder's
REPEAT_S = 5.0  # a signal this soon after the first is the same request (forwarded by a launcher), not a second one


# --- ownership -------------------------------------------------------------------------------------------------


def check_run_dir(run_dir: Path, field: str = "--run (make RUN=)") -> None:
    """Refuse an empty run name and a run directory inside a cache (a directory holding a cache's manifest.json):
    its checkpoints would become files the cache's sweep and verify do not know."""
    if not str(run_dir) or str(run_dir) == ".":
        raise ValueError(f"{field} is empty: name the run's directory, e.g. --run=runs/my-run (make RUN=runs/my-run)")
    for d in (run_dir.resolve(), *run_dir.resolve().parents):
        if kind := cache_kind(d):
            raise ValueError(f"{field} {run_dir} is inside the {kind} cache {d} ({d / MANIFEST}): put runs outside caches, "
                             f"e.g. --run=runs/<name>")


def holder_line(info: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info.get("started", 0)))
    job = f", job {info['job']}" if info.get("job") else ""
    return f"{info.get('host', '?')} pid {info.get('pid', '?')} (since {started}{job})"


def _read_lock(lock: Path) -> dict | None:
    try:
        return json.loads(lock.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # being written this instant, or damaged: treated as held by an unknown holder


BREAK_S = 30.0  # a break marker older than this was left by a breaker that died mid-way
EMPTY_S = 30.0  # a lock file without a readable holder this old was left by a writer that died (older code)


def acquire(run_dir: Path) -> None:
    """Create RUN/.run.lock or refuse with one line naming its holder (`acquire_file`)."""
    acquire_file(run_dir / LOCK, lambda held, lock: (
        f"{run_dir} is being trained by {holder_line(held)} ({lock}): wait for it or stop it (kill -TERM writes a "
        f"checkpoint), or choose another --run (RUN=); if no such process runs (another machine that crashed), "
        f"delete {lock}"))


def acquire_file(lock: Path, refusal) -> None:
    """Create `lock` or raise ValueError(`refusal(holder, lock)`): one line naming the live holder. The record is
    written to a temp file and linked into place, so a lock never exists without its holder; a stale lock is broken
    under a break marker (O_EXCL), after checking that it still holds the record judged stale, so two processes
    breaking one dead holder's lock cannot both own it."""
    info = {"host": socket.gethostname(), "pid": os.getpid(), "boot": boot_id(), "started": time.time(),
            "argv": sys.argv, "job": job_id()}
    tmp = lock.with_name(f"{lock.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(info, sort_keys=True))
    try:
        while True:
            try:
                os.link(tmp, lock)
                return
            except FileExistsError:
                pass
            held = _read_lock(lock)
            if held is None:
                continue  # released meanwhile
            if why := stale(lock, held):
                if break_lock(lock, held, why):
                    continue
                time.sleep(0.05)  # another trainer is breaking it: look again
                continue
            raise ValueError(refusal(held, lock)) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def break_lock(lock: Path, held: dict, why: str) -> bool:
    """Remove `lock` if it still holds `held` (judged stale), under the break marker; False when another process is
    breaking it (the caller looks again)."""
    marker = lock.with_name(lock.name + ".break")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        with contextlib.suppress(FileNotFoundError):
            if time.time() - marker.stat().st_mtime > BREAK_S:
                marker.unlink()
        return False
    try:
        if _read_lock(lock) == held:
            print(f"breaking the stale {_what(lock)} {lock} left by {holder_line(held)}: {why}", flush=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()


def _what(lock: Path) -> str:
    return "run lock" if lock.name == LOCK else "lock"


def job_id() -> str:
    """The scheduler's job this trainer belongs to, for the holder line ('' outside one)."""
    env = os.environ
    return next((f"{k}={env[k]}" for k in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "JOB_ID") if env.get(k)), "")


def stale(lock: Path, held: dict) -> str | None:
    """Why the lock's holder is surely gone (None: it may be alive)."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if not held:
        return f"it names no holder and is {age:.0f}s old" if age > EMPTY_S else None
    if not pid_alive(held.get("host", ""), held.get("pid", ""), held.get("boot")):
        return "that process is gone"
    if not mine(held, pid=False) and age > OTHER_HOST_STALE_S:
        return f"not touched for {age:.0f}s (its holder touches it every {HEARTBEAT_S:g}s)"
    return None


def mine(held: dict, pid: bool = True) -> bool:
    """Whether the lock record `held` is this process's (`pid` False: this machine's pid space, i.e. its liveness
    can be judged here; a record without a boot id, from older code, counts by hostname)."""
    return (held.get("host") == socket.gethostname() and held.get("boot", boot_id()) == boot_id()
            and (not pid or held.get("pid") == os.getpid()))


def heartbeat(lock: Path, done: threading.Event, lost=None) -> None:
    """Touch `lock` every HEARTBEAT_S until `done` (a daemon thread: it ends with the process); if the lock is no
    longer this process's (broken by another trainer that judged it stale: a suspended machine, skewed clocks), say
    so and call `lost(holder)` once instead."""
    while not done.wait(HEARTBEAT_S):
        held = _read_lock(lock)
        if held is not None and held and not mine(held):
            print(f"the {_what(lock)} {lock} is now held by {holder_line(held)}"
                  + (": this process stops" if lost is not None else ""), file=sys.stderr, flush=True)
            if lost is not None:
                lost(held)
            return
        with contextlib.suppress(OSError):
            os.utime(lock)


def release(run_dir: Path) -> None:
    """Remove the run's lock if this process holds it (also from a timer thread ending the process)."""
    release_file(run_dir / LOCK)


def release_file(lock: Path) -> None:
    """Remove `lock` if this process holds it."""
    held = _read_lock(lock) or {}
    if mine(held):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)


@contextlib.contextmanager
def owned(run_dir: Path, rank: int, lost=None):
    """Hold the run's lock (rank 0; other ranks hold nothing) for the body; `lost(holder)` is called if another
    trainer takes it meanwhile (see `heartbeat`)."""
    if rank != 0:
        yield
        return
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        acquire(run_dir)
        with _beating(run_dir / LOCK, lost):
            yield
    finally:
        if created:  # a run refused before it wrote anything leaves nothing behind (rmdir: only when empty)
            with contextlib.suppress(OSError):
                run_dir.rmdir()


@contextlib.contextmanager
def holding(lock: Path, refusal):
    """Hold `lock` for the body (`acquire_file`, touched every HEARTBEAT_S, removed after): one writer of an output
    that is appended to, e.g. a regeneration's (`regenrun.run`). Where another process takes it meanwhile (it judged
    this one gone: a suspended machine), this process ends at once (exit status 1): two would append to one output;
    what it committed stays."""
    acquire_file(lock, refusal)
    with _beating(lock, lambda held: os._exit(1)):
        yield


@contextlib.contextmanager
def _beating(lock: Path, lost=None):
    """The held `lock` touched by a heartbeat thread during the body, released after it."""
    done = threading.Event()
    threading.Thread(target=heartbeat, args=(lock, done, lost), name="lock-heartbeat", daemon=True).start()
    try:
        yield
    finally:
        done.set()
        release_file(lock)


# --- stopping --------------------------------------------------------------------------------------------------


class Interrupted(Exception):
    """The run stopped on a signal: `line` says where, `code` is the exit status (128 + signal)."""

    def __init__(self, signum: int, line: str):
        super().__init__(line)
        self.signum, self.line, self.code = signum, line, 128 + signum


class StopSignals:
    """SIGTERM/SIGINT → `requested` (the signal number, 0 before any), read by the loop between steps. The handlers
    are installed for the body of `with` on the main thread only (elsewhere signals cannot be caught) and put back
    after. `on_timeout` runs from a timer thread when a requested stop has not ended within `grace_s`; it must end
    the process."""

    def __init__(self, grace_s: float, on_timeout):
        self.grace_s, self.on_timeout, self.requested = grace_s, on_timeout, 0
        self._old: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second signal: no final checkpoint — unless it is the first one again, forwarded
            if time.monotonic() - self._at > REPEAT_S:  # (Slurm signals every process, torchrun forwards it too)
                self.on_timeout(signum, "a second signal")
            return
        self.requested, self._at = signum, time.monotonic()
        with contextlib.suppress(OSError):  # (stderr a pipe whose reader is gone: the stop goes on)
            os.write(2, (f"{signal.Signals(signum).name}: stopping after this step (a final checkpoint within "
                         f"{self.grace_s:g}s; signal again after {REPEAT_S:g}s to stop at once without one)\n").encode())
        self._timer = threading.Timer(self.grace_s, self.on_timeout, (signum, f"the {self.grace_s:g}s stop grace"))
        self._timer.daemon = True
        self._timer.start()


def ender(run_dir: Path, rank: int):
    """StopSignals' `on_timeout` for a run: mark this rank's status file `interrupted`, release the run's lock, say
    so in one line and end the process at once (128 + the signal); the last checkpoint written stays whole (a save
    in progress is a temp directory the next run removes)."""

    def end(signum: int, why: str) -> None:
        from .cache.fsio import write_json_atomic

        status = run_dir / f"status-rank{rank}.json"
        with contextlib.suppress(OSError, ValueError):
            write_json_atomic(status, {**json.loads(status.read_text()), "state": "interrupted"}, durable=False)
        release(run_dir)
        print(f"stopped on {signal.Signals(signum).name}: {why} ended the run before a final checkpoint; "
              f"continue it from its last checkpoint with --resume=1 (make RESUME=1)", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    return end


class StopVote:
    """The stop signal every process acts on, and at which step: one process alone must not stop, or the others would
    wait for it in their next collective. Each step every process casts its request (the largest wins, an all-reduce
    queued behind the step's work) and reads the vote cast one step earlier, which the device has finished by the
    time the next step is queued: no stall. One process: its own request, at once."""

    def __init__(self, acc):
        self.acc, self.pending = acc, None

    def __call__(self, requested: int) -> int:
        if self.acc.num_processes == 1:
            return requested
        import torch
        import torch.distributed as dist

        flag = torch.full((1,), requested, dtype=torch.int32, device=self.acc.device)  # a fill kernel: no sync
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        event = None
        if flag.is_cuda:
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flag = host
        last, self.pending = self.pending, (flag, event)
        if last is None:
            return 0
        if last[1] is not None:
            last[1].synchronize()
        return int(last[0].item())
