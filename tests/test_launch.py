"""`make ... NPROC=2` (dflash_offline/launch.py): a stop or a rank's error ends as one process's would — its exit
status, its one line — not in the launcher's traceback; the launcher's stderr otherwise passes through as it comes."""

import contextlib
import io
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from test_run_guard import status, wait_for
from test_train import REPO, cli_args

from dflash_offline.launch import LauncherFilter, help_asked, outcome

FRAMES = ('  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py", line 923, in x\n'
          "    time.sleep(monitor_interval)\n"
          "             ^^^^^^^^^^^^^^^^^^\n")
SIGNALLED = ("Traceback (most recent call last):\n" + FRAMES +
             "torch.distributed.elastic.multiprocessing.api.SignalException: Process 5983 got signal: 15\n")
FAILED = ("Traceback (most recent call last):\n" + FRAMES +
          "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n" + "=" * 60 + "\nstages.train FAILED\n"
          "Failures:\n[1]:\n  time      : 2026-12-05_05:26:19\n  rank      : 1 (local_rank: 1)\n"
          "  exitcode  : -9 (pid: 6068) \n  error_file: <N/A>\n" + "-" * 60 + "\nRoot Cause (first observed failure):\n"
          "[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 2 (pid: 6067) \n" + "=" * 60 + "\n")
WORKER = ('Traceback (most recent call last):\n  File "stages/train.py", line 3, in main\n    go()\n'
          "ZeroDivisionError: division by zero\n")
KEPT = "[05:25:24] step 45: loss 7.33\n\rtrain:  10%|█ | 1/10\rtrain:  20%|██| 2/10\n" + WORKER + "W1205 shutting down\n"


def filtered(text: str, chunk: int) -> tuple[str, LauncherFilter]:
    out = io.BytesIO()
    f = LauncherFilter(out)
    data = text.encode()
    for i in range(0, len(data), chunk):
        f.feed(data[i:i + chunk])
    f.close()
    return out.getvalue().decode(), f


@pytest.mark.parametrize("chunk", [1, 7, 1 << 16])
def test_the_launchers_tracebacks_are_dropped_and_read_and_the_rest_passes_whole(chunk):
    out, f = filtered(KEPT + SIGNALLED + KEPT, chunk)  # (workers still writing after it: passed on)
    assert out == KEPT + KEPT and f.signal == 15 and not f.failures
    assert outcome(1, 0, f) == (143, None)
    out, f = filtered(KEPT + FAILED + KEPT, chunk)
    assert out == KEPT + KEPT and f.root == (0, 2)
    out, f = filtered(KEPT + FAILED, chunk)
    assert out == KEPT and f.failures == [(1, -9), (0, 2)] and f.root == (0, 2)
    code, line = outcome(1, 0, f)
    assert code == 2 and line.startswith("error: rank 0 ended with exit status 2 (its message is above)")


def test_a_progress_bar_goes_through_before_its_line_ends_and_a_traceback_is_held_until_its_exception():
    out = io.BytesIO()
    f = LauncherFilter(out)
    f.feed(b"\rtrain:  10%|")
    assert out.getvalue() == b"\rtrain:  10%|"  # not held for a newline that comes at the bar's end
    f.feed(b"\nTraceback (most recent call last):\n" + FRAMES.encode())
    assert out.getvalue() == b"\rtrain:  10%|\n"  # held: the launcher's or a worker's, its last line says
    f.feed(b"ValueError: bad\n")
    assert out.getvalue().endswith(b"^^^^^^\nValueError: bad\n")


def test_a_rank_killed_by_a_signal_or_stopped_gives_one_process_status():
    _, f = filtered(FAILED.replace("exitcode  : 2", "exitcode  : -9"), 1 << 16)
    code, line = outcome(1, 0, f)
    assert code == 137 and "rank 0 was killed by SIGKILL (out of memory?)" in line
    _, f = filtered(FAILED.replace("exitcode  : 2", "exitcode  : 143"), 1 << 16)
    assert outcome(1, 0, f) == (143, None)
    assert outcome(1, signal.SIGINT, LauncherFilter(io.BytesIO())) == (130, None)  # this process forwarded Ctrl-C
    assert outcome(0, 0, LauncherFilter(io.BytesIO())) == (0, None)


def test_a_rank_that_fails_during_a_stop_gives_its_failure_not_the_stops_status():
    """Ctrl-C, then a rank fails writing its final checkpoint (disk full: its exit status 1) or is killed (out of
    memory) while the others stop: the run did not stop cleanly, and a script reading 130 would take it for a stop
    to resume."""
    box = FAILED.replace("exitcode  : -9", "exitcode  : 130")  # rank 1 stopped; rank 0, the root cause, failed
    _, f = filtered(box.replace("exitcode  : 2", "exitcode  : 1"), 1 << 16)
    code, line = outcome(1, signal.SIGINT, f)
    assert code == 1 and line.startswith("error: rank 0 ended with exit status 1 (its message is above)")
    _, f = filtered(box.replace("exitcode  : 2", "exitcode  : -9"), 1 << 16)
    code, line = outcome(1, signal.SIGTERM, f)
    assert code == 137 and "rank 0 was killed by SIGKILL" in line
    _, f = filtered(box.replace("exitcode  : 2", "exitcode  : 130"), 1 << 16)  # every rank stopped: the stop's status
    assert outcome(1, signal.SIGINT, f) == (130, None)


def make_train(cache, run, *extra, **kw) -> subprocess.Popen:
    args = " ".join(a for a in cli_args(cache, run, **kw) if not a.startswith(("--cache=", "--run=")))
    return subprocess.Popen(["make", "--no-print-directory", "-o", ".venv/.installed", "train", "NPROC=2", "RECIPE=",
                             f"CACHE={cache}", f"RUN={run}", f"ARGS={args}", *extra,
                             "LAUNCH_ARGS=--num_machines 1 --mixed_precision no --dynamo_backend no"],
                            cwd=REPO, env=dict(os.environ, DFLASH_NO_BAR="1", OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_make_train_nproc_2_stopped_by_sigterm_ends_like_one_process_and_resumes(tmp_path, hidden_cache):
    """SIGTERM to the job (the process group, as Slurm or Ctrl-C send it): one stop line and `Error 143`, no
    launcher traceback; the checkpoint it names continues with RESUME=1. A refused input on the ranks: their line,
    one line naming the rank, the rank's exit status, no traceback."""
    run = tmp_path / "run"
    p = make_train(hidden_cache, run, steps=100_000, ckpt_every=100_000)
    try:
        wait_for(lambda: status(run).get("done", 0) >= 1, proc=p)
        os.killpg(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    stop = [line for line in err.splitlines() if line.startswith("stopped on SIGTERM at step ")]
    assert len(stop) == 1 and re.search(r"make(\[\d+\])?: \*\*\* \[Makefile.*Error 143", err), err[-3000:]
    step = int(stop[0].split(" at step ")[1].split()[0])
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{step:08d}"
    p = make_train(hidden_cache, run, "RESUME=1", steps=step + 2, ckpt_every=100_000)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    assert status(run)["state"] == "done" and (run / "checkpoints" / "latest").read_text().strip() == \
        f"step-{step + 2:08d}"

    p = make_train(Path(tmp_path / "no-cache"), tmp_path / "run2")
    _, err = p.communicate(timeout=120)
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    assert "no-cache/manifest.json not found" in err and "ended with exit status 2 (its message is above)" in err
    assert "Error 2" in err


def test_a_worker_whose_stderr_reader_is_gone_writes_on():
    from dflash_offline.cli import QuietOnClosedPipe

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    quiet = QuietOnClosedPipe(Closed())
    assert quiet.write("step 3\n") == 7
    quiet.flush()


def test_the_run_stops_with_a_checkpoint_when_the_launch_process_is_killed(tmp_path, hidden_cache):
    """SIGKILL of `dflash_offline.launch` (or the terminal closing on it): the launcher gets SIGTERM, the workers
    stop after their step with a checkpoint — not `failed` on writing their stop line to the dead process's pipe."""
    import json
    import sys
    import time

    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "dflash_offline.launch", "--num_processes", "2", "--num_machines", "1",
                          "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "stages.train",
                          *cli_args(hidden_cache, run, steps=100_000, ckpt_every=100_000)],
                         cwd=REPO, env=dict(os.environ, DFLASH_NO_BAR="0", OMP_NUM_THREADS="1"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: status(run).get("done", 0) >= 1, proc=p)
        p.kill()
        p.wait(timeout=10)
        states = lambda: [json.loads(f.read_text()).get("state") for f in sorted(run.glob("status-rank*.json"))]  # noqa: E731
        deadline = time.monotonic() + 60  # (rank 0 marks its status, then unwinds and releases the lock on its way out)
        while time.monotonic() < deadline and (any(s == "running" for s in states()) or (run / ".run.lock").exists()):
            time.sleep(0.2)
        assert states() == ["interrupted", "interrupted"], states()
        assert (run / "checkpoints" / "latest").is_file() and not (run / ".run.lock").exists()
    finally:
        for f in run.glob("status-rank*.json"):  # (workers left behind by a failure here)
            with contextlib.suppress(OSError, ValueError, ProcessLookupError):
                os.kill(int(json.loads(f.read_text())["pid"]), signal.SIGKILL)


def test_a_stages_help_under_nproc_2_is_printed_once_by_one_process():
    """`make train NPROC=2 ARGS=--help` printed the stage's help once per rank, after accelerate's defaults warning."""
    import sys

    assert help_asked(["--num_processes", "2", "-m", "stages.extract", "--cache=x", "-h"]) == [
        sys.executable, "-m", "stages.extract", "--cache=x", "-h"]
    assert help_asked(["--num_processes", "2", "-m", "stages.train", "--cache=x"]) is None
    assert help_asked(["--help"]) is None  # (the launcher's own help: accelerate's)
    r = subprocess.run([sys.executable, "-m", "dflash_offline.launch", "--num_processes", "2", "-m", "stages.train",
                        "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("Stage 2: train") == 1 and "accelerate launch" not in r.stderr
