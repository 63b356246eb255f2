"""Visible progress: a progress bar with tokens/s and ETA, plus a status JSON others can read; `log`, a timed line.

`status.json` (in the cache or run directory) is rewritten atomically at most every `every_s` seconds with the
stage, counts, rates, ETA and reserved GPU memory; `make status` prints it while a job runs. The writes happen on
a background thread: `update` runs on the thread that feeds the GPU, and a file write there can stall for most of a
second while the disk flushes shards or checkpoints (the kernel throttles writers), long enough to idle the GPU.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from .cache.fsio import write_json_atomic

HOST = socket.gethostname()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def warn(msg: str) -> None:
    """`msg` in the log and on stderr (what a user must not miss in a long run's output); once where both are the
    same terminal or file."""
    log(msg)
    try:  # (a rank of launch.py: its stderr is the launcher's pipe, forwarded where its stdout goes)
        same = os.environ.get("DFLASH_UNDER_LAUNCH") or os.path.sameopenfile(sys.stdout.fileno(), sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # (a stream without a file: pytest's capture, a StringIO)
        same = False
    if not same:
        print(msg, file=sys.stderr, flush=True)


class Progress:
    """`update(n, tokens=...)` advances the bar; `status_path` gets a JSON snapshot every `every_s` seconds."""

    def __init__(self, stage: str, total: float | None, unit: str, status_path: Path | None, every_s: float = 2.0,
                 disable: bool | None = None):
        self.stage, self.status_path, self.every_s = stage, status_path, every_s
        if disable is None:
            disable = os.environ.get("DFLASH_NO_BAR") == "1"
        self.bar = tqdm(total=total, unit=unit, desc=stage, dynamic_ncols=True, mininterval=1.0, disable=disable,
                        file=sys.stderr, unit_scale=True)
        self.t0 = time.time()
        self.total = total
        self.done = 0  # counted here: a disabled tqdm bar (DFLASH_NO_BAR, other ranks) does not count
        self.tokens = 0
        self.extra: dict = {}
        self.last_write = 0.0
        self._io: ThreadPoolExecutor | None = None  # the status writer thread (started on the first write)
        self._pending: Future | None = None

    def update(self, n: float = 1, tokens: int = 0, **extra) -> None:
        self.tokens += tokens
        self.done += n
        self.extra.update(extra)
        self.bar.update(n)
        elapsed = max(time.time() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
        if self.status_path is not None and time.time() - self.last_write >= self.every_s:
            self.write_status("running")

    def snapshot(self, state: str) -> dict:
        elapsed = time.time() - self.t0
        done, total = self.done, self.total
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if total and rate > 0 else None
        snap = {
            "stage": self.stage,
            "state": state,
            "host": HOST,
            "pid": os.getpid(),
            "done": done,
            "total": total,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / elapsed if elapsed > 0 else 0.0,
            "elapsed_s": elapsed,
            "eta_s": eta,
            "updated_at": time.time(),
        }
        snap.update(self.extra)
        return snap

    def write_status(self, state: str) -> None:
        """Hand a snapshot to the writer thread; skipped while the previous one is still being written."""
        self.last_write = time.time()
        if self._pending is not None and not self._pending.done():
            return
        if self._io is None:
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="status-writer")
        self._pending = self._io.submit(self._write, self.snapshot(state))

    def _write(self, snap: dict) -> None:
        try:  # atomic (readers see a whole file), not fsynced: a report, not a record
            write_json_atomic(self.status_path, snap, durable=False)
        except (OSError, TypeError, ValueError) as e:  # best-effort: the manifest is the record
            print(f"warning: status {self.status_path} not written: {e!r}", file=sys.stderr)

    def close(self, state: str = "done") -> dict:
        """Final snapshot, written before returning (after any write still in flight)."""
        self.bar.close()
        snap = self.snapshot(state)
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io, self._pending = None, None
        if self.status_path is not None:
            self._write(snap)
        return snap
