"""`NPROC>1` in the Makefile: `python -m dflash_offline.launch ARGS` runs `accelerate launch --multi_gpu ARGS` and
makes its end read like one process's.

Without it, a stop (SIGTERM from a scheduler, Ctrl-C) ended in the launcher's ~20-frame `SignalException` traceback and
exit status 1 after the workers' own one line, and a rank's one-line error in a `ChildFailedError` traceback and a
box of its exit codes. Here:
- the launcher runs in a process group of its own, so that a signal reaches it once: SIGTERM and SIGINT sent to this
  process (or to its group: Ctrl-C) are forwarded to the launcher, which forwards them to the workers (they finish
  the step in flight and checkpoint, `runguard`) — a repeat within `runguard.REPEAT_S` is not (torch's launcher
  stops waiting for its workers on a third), a later one is (a stop at once); SIGHUP (the terminal closed) is
  forwarded as SIGTERM; were this process killed, the launcher gets SIGTERM (Linux's parent-death signal), and the
  workers, whose stderr was this process's pipe, write on (`cli.QuietOnClosedPipe`) and stop with a checkpoint;
- its stderr passes through as it comes (progress bars included), but for tracebacks, held until their exception
  line: the launcher's own (`SignalException`, `ChildFailedError` and its box) are dropped, and their exit codes
  read; any other traceback (a worker's) is passed on whole; it is read until every writer closed it (≤ 35 s after
  the launcher: a worker ending its stop);
- the exit status is one process's: 128 + the signal after a stop (143, 130), a failed rank's own status (2 for a
  refused input) with one line naming the rank where its status is not a stop's, 128 + N for a rank killed by
  signal N (out of memory: SIGKILL) — a rank that failed so during a stop too: its failure, not the stop's status;
- a stage's `--help` is printed by one process, once (`help_asked`), not by every rank after the launcher's warning.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

TRACEBACK = b"Traceback (most recent call last):"
READ_AFTER_S = 35.0  # how long the launcher's stderr is read after it exits (a worker ending its stop: ≤ 30 s)
LAUNCHER_ERRORS = ("SignalException", "ChildFailedError")  # torch.distributed.elastic's, raised by the launcher


class LauncherFilter:
    """The launcher's stderr, fed in chunks (`feed`), written to `out` (a binary stream) as it comes except for
    tracebacks, held until their exception line; the launcher's own are dropped with everything after them, and what
    they say is kept: `signal` (the launcher's stop), `failures` [(rank, exit code)] with `root` the first
    observed failure's."""

    def __init__(self, out):
        self.out, self.pending, self.held, self.dropping, self.line_start = out, b"", None, False, True
        self.signal, self.failures, self.root, self._rank, self._is_root = None, [], None, None, False
        self._rules = 0  # the ==== lines of ChildFailedError's box seen: it ends at the second

    def feed(self, data: bytes) -> None:
        buf, self.pending = self.pending + data, b""
        while buf:
            nl = buf.find(b"\n")
            if nl < 0:  # a partial line: through at once (a progress bar), unless it may open a traceback
                if self.dropping or self.held is not None or (self.line_start and (
                        TRACEBACK.startswith(buf) or buf.startswith(TRACEBACK))):
                    self.pending = buf
                else:
                    self.write(buf)
                    self.line_start = False
                return
            self.line(buf[:nl + 1])
            buf = buf[nl + 1:]

    def close(self) -> None:
        if self.pending:
            self.line(self.pending)
        if self.held:
            self.write(b"".join(self.held))
        self.held, self.pending = None, b""

    def write(self, data: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.out.write(data)
            self.out.flush()

    def line(self, line: bytes) -> None:
        if not self.line_start:  # the rest of a line whose start went through
            self.line_start = True
            return self.write(line)
        text = line.decode(errors="replace").rstrip("\r\n")
        if self.dropping:  # ChildFailedError's box, up to its closing rule; then lines pass again
            self.parse(text)
            if text.startswith("=" * 20):
                self._rules += 1
                self.dropping = self._rules < 2
            return
        if self.held is None:
            if line.startswith(TRACEBACK):
                self.held = [line]
            else:
                self.write(line)
            return
        self.held.append(line)
        if not text or text[0] in " \t":  # a frame, its source, its carets
            return
        name = text.split(":", 1)[0]
        if name.startswith("torch.distributed.elastic.") and name.rsplit(".", 1)[-1] in LAUNCHER_ERRORS:
            self.held, self.dropping, self._rules = None, name.endswith("ChildFailedError"), 0
            self.parse(text)
        else:  # a worker's traceback (or a line between the frames): passed on whole
            self.write(b"".join(self.held))
            self.held = None

    def parse(self, text: str) -> None:
        if m := re.search(r"got signal: (\d+)", text):
            self.signal = int(m[1])
        elif text.startswith("Root Cause"):
            self._is_root = True
        elif m := re.match(r"\s*rank\s*:\s*(\d+)", text):
            self._rank = int(m[1])
        elif (m := re.match(r"\s*exitcode\s*:\s*(-?\d+)", text)) and self._rank is not None:
            self.failures.append((self._rank, int(m[1])))
            if self._is_root:
                self.root, self._is_root = (self._rank, int(m[1])), False


def signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def outcome(rc: int, stopped: int, f: LauncherFilter) -> tuple[int, str | None]:
    """(exit status, the line to print or None) for a launcher that exited `rc`, this process having forwarded
    signal `stopped` (0: none)."""
    if rc == 0:
        return 0, None
    # the first observed failure (the others' may be the launcher stopping them after it), during a stop too
    rank, code = f.root or (f.failures[0] if f.failures else (None, None))
    if code is not None and code not in (128 + signal.SIGTERM, 128 + signal.SIGINT):
        if code < 0:
            return 128 - code, (f"error: rank {rank} was killed by {signal_name(-code)}"
                                f"{' (out of memory?)' if code == -signal.SIGKILL else ''}; the other ranks were "
                                f"stopped")
        return code, f"error: rank {rank} ended with exit status {code} (its message is above); the other ranks were stopped"
    if stopped or f.signal:  # a stop: the workers said where they stopped and how to continue
        return 128 + (stopped or f.signal), None
    return (rc if code is None else code), None


def parent_death_signal() -> None:
    """In the launcher, before it runs: its own process group, and SIGTERM should this process die (Linux)."""
    os.setpgrp()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # (ignored here while it started: not inherited)
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def help_asked(argv: list[str]) -> list[str] | None:
    """`python -m MODULE ARGS` where the stage's ARGS (after `-m MODULE`, the Makefile's form) ask for its help: one
    process prints it once, where N ranks printed it N times after the launcher's defaults warning."""
    i = next((k for k, a in enumerate(argv) if a in ("-m", "--module")), None)
    if i is None or i + 1 >= len(argv) or not {"-h", "--help"} & set(argv[i + 2:]):
        return None
    return [sys.executable, "-m", *argv[i + 1:]]


def main(argv: list[str]) -> int:
    from .cli import UNDER_LAUNCH
    from .runguard import REPEAT_S

    if one := help_asked(argv):
        return subprocess.run(one).returncode
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", *argv]
    stopped, first_at = 0, 0.0
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, preexec_fn=parent_death_signal,  # noqa: PLW1509
                            env=dict(os.environ, **{UNDER_LAUNCH: "1"}))

    def forward(signum, frame) -> None:
        """To the launcher: the first signal, and a later one (a stop at once); not a repeat within REPEAT_S of the
        first (a group's Ctrl-C or a scheduler signalling every process), which would make torch's launcher give up
        waiting for its workers. SIGHUP (the terminal closed) is a SIGTERM: the workers stop with a checkpoint."""
        nonlocal stopped, first_at
        signum = signal.SIGTERM if signum == signal.SIGHUP else signum
        if stopped and time.monotonic() - first_at <= REPEAT_S:
            return
        stopped, first_at = stopped or signum, first_at or time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)

    for sig in old:  # (ignored from before the launcher started: no window where a signal kills this process alone)
        signal.signal(sig, forward)
    f = LauncherFilter(sys.stderr.buffer)

    def pump() -> None:
        while data := os.read(proc.stderr.fileno(), 65536):
            f.feed(data)

    reader = threading.Thread(target=pump, name="launcher-stderr", daemon=True)
    reader.start()
    while True:
        try:
            rc = proc.wait()
            break
        except InterruptedError:  # (a forwarded signal during the wait)
            continue
    reader.join(timeout=READ_AFTER_S)  # (EOF at once, unless a worker outlived the launcher)
    f.close()
    code, line = outcome(rc, stopped, f)
    if line:
        f.write(f"{line}\n".encode())
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
