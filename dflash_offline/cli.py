"""A stage's command-line runtime: what every `python -m stages.<name>` does around its `main(argv)`.

`run_cli(main)` turns a ValueError (config, corpus, manifest, shard and target errors carry their own advice) or a
failed write into one line `error: ...` and exit status 2 (`refusal`: that line, for a caller that runs a stage's `main`
itself); `unbuffered()` makes logs appear as they happen; `private_compile_caches()` gives each process rank its own
Triton and Inductor caches. The settings themselves are parsed by `config.configs_from_argv`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
from pathlib import Path


def unbuffered() -> None:
    """Line-buffer stdout/stderr so logs appear as they happen, also when piped to a file."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except AttributeError:
            pass


def private_compile_caches(rank: int | None = None) -> dict[str, str]:
    """One Triton and one Inductor cache directory per process rank, persistent across runs (a re-run on the same
    machine skips the compilation): concurrent autotuning must not race on shared cache files. Call it before
    anything compiles; explicit TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR settings win."""
    for k, v in compile_cache_dirs(rank).items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}


def compile_cache_dirs(rank: int | None = None) -> dict[str, str]:
    """The compile cache directories `private_compile_caches` gives process rank `rank` (from RANK / LOCAL_RANK
    when None) in this environment, nothing set."""
    if rank is None:
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    base = Path(os.environ.get("DFLASH_COMPILE_CACHE", Path.home() / ".cache" / "dflash_offline"))
    return {k: os.environ.get(k, str(base / f"{name}-rank{rank}"))
            for k, name in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"))}


DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG}


UNDER_LAUNCH = "DFLASH_UNDER_LAUNCH"  # set by `launch.py` for the processes it starts


class QuietOnClosedPipe:
    """A text stream whose writes never raise OSError: a worker whose stderr is a pipe read by `launch.py` keeps
    training — and stops cleanly on the SIGTERM that follows — when that process was killed (its reader gone)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError, ValueError):
            return self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, spot preemption, `kill`) in a stage that does not stop between steps itself: the
    same unwinding as Ctrl-C (a KeyboardInterrupt, which no `except Exception` swallows)."""


def _terminate(signum, frame):
    for sig in (signal.SIGTERM, signal.SIGINT):  # (a later one, or Ctrl-C, must not cut the unwinding short)
        signal.signal(sig, _stopping)
    raise Terminated()


def _stopping(signum, frame):  # (os.write: a print here could re-enter a print the signal interrupted)
    with contextlib.suppress(OSError):
        os.write(2, f"{signal.Signals(signum).name}: already stopping\n".encode())


def run_cli(main, stop_on_sigterm: bool = True) -> None:
    """A stage's `__main__`: run `main(argv)`; a refused input or a failed write (`refusal`) becomes one line and exit
    status 2 instead of a traceback, Ctrl-C one line and 130, SIGTERM one line and 143 (a stage's own handlers, such
    as training's stop between steps, replace this one while they run; `stop_on_sigterm=False`: SIGTERM ends the
    process at once, as for the testbed, whose reruns resume and whose unwinding would wait for a drafter in
    flight); an int result is the exit code. Triton autotuner choices are recorded or pinned first when the
    environment asks (`dflash_offline.autotune`)."""
    if os.environ.get(UNDER_LAUNCH):  # a worker of `launch.py`: its stderr is that process's pipe
        sys.stderr = QuietOnClosedPipe(sys.stderr)
    if (stop_on_sigterm and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _terminate)
    try:
        _run(main)
    finally:
        exiting()


def exiting() -> None:
    """The process is ending: a SIGTERM while the atexit handlers run (or the interpreter waits for a thread) is said
    in one line instead of being raised inside one of them; a second one ends the process at once (143)."""
    if signal.getsignal(signal.SIGTERM) is _terminate:
        signal.signal(signal.SIGTERM, _exit_on_second)


def _exit_on_second(signum, frame):
    if getattr(_exit_on_second, "seen", False):
        os._exit(128 + signum)
    _exit_on_second.seen = True
    with contextlib.suppress(OSError):
        os.write(2, f"{signal.Signals(signum).name}: already exiting (a second one ends it at once)\n".encode())


def _run(main) -> None:
    from .autotune import from_env

    try:
        from_env()  # (inside: a SIGTERM while it imports torch is a stop too)
        code = main(sys.argv[1:])
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM in a stage that does not stop between steps itself (regen...)
        name, status = ("SIGTERM", 143) if isinstance(e, Terminated) else ("SIGINT", 130)
        print(f"stopped on {name}: nothing it committed is lost; rerun the same command", file=sys.stderr)
        exit_now(status)
    except BrokenPipeError:  # `| head`: the reader has what it wanted; no traceback, the shell's status for SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush would raise again)
        sys.exit(141)
    except (ValueError, OSError) as e:
        line = refusal(e)
        if line is None:
            raise
        print(line, file=sys.stderr)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


def exit_now(status: int) -> None:
    """Exit after a stop without waiting for threads still blocked (regen's requests in flight to an engine: up to
    --timeout_s each; the interpreter would join them first): `atexit` handlers run, then the process ends."""
    if not any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        sys.exit(status)
    import atexit

    exiting()  # (its atexit handlers run here, before run_cli's own `finally`)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


def refusal(e: BaseException) -> str | None:
    """The one line a stage ends with, exit status 2, for `e`: a ValueError (config, corpus, manifest, shard and target
    errors all carry their own advice) or a failed write (full disk, I/O error); None for any other error."""
    if isinstance(e, ValueError):
        return f"error: {e}"
    if isinstance(e, OSError) and e.errno in DISK_ERRORS:
        return (f"error: writing {e.filename or 'a file'} failed: {e.strerror} (errno {e.errno}). Everything "
                f"committed before it is kept and nothing half-written is left: fix the disk, then rerun the same "
                f"command")
    return None
