"""A run is owned by one trainer (RUN/.run.lock) and stops cleanly on SIGTERM/SIGINT: a final checkpoint, the status
file `interrupted`, the lock released, one line, exit status 128 + the signal; `--resume=1` continues it."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_train import REPO, WORKER, cfg, cli_args, free_port

from dflash_offline import runguard
from dflash_offline.cache import fsio
from dflash_offline.trainer import Trainer
from stages import train


def wait_for(what, timeout_s=120.0, proc=None):
    """Poll `what()` until it is truthy (a process that ends meanwhile fails the test with its stderr)."""
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the trainer ended ({proc.returncode}) first: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return got


def status(run: Path) -> dict:
    try:
        return json.loads((run / "status-rank0.json").read_text())
    except (OSError, ValueError):
        return {}


def test_sigterm_stops_with_a_checkpoint_and_a_resume_continues(tmp_path, hidden_cache):
    """A trainer with (practically) endless steps: while it trains, a second trainer on its run is refused naming it;
    SIGTERM after its first steps ends it within seconds with exit 143, one line, a checkpoint of the step it
    reached, status `interrupted` and no lock; `--resume=1` continues from that checkpoint."""
    run = tmp_path / "run"
    env = {**os.environ, "DFLASH_NO_BAR": "1"}
    args = cli_args(hidden_cache, run, steps=100_000, ckpt_every=100_000)
    proc = subprocess.Popen([sys.executable, "-m", "stages.train", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: status(run).get("done", 0) >= 1, proc=proc)
        with pytest.raises(ValueError, match=rf"^{run} is being trained by \S+ pid {proc.pid} \(since .*\) "
                                             rf"\({run / '.run.lock'}\): wait for it or stop it .*choose another "
                                             rf"--run"):
            train.run(cfg(hidden_cache, run, resume=True))
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and time.monotonic() - t < 30, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    step = int(last.split(" at step ")[1].split()[0])
    ckpt = run / "checkpoints" / f"step-{step:08d}"
    assert step >= 1 and last == (f"stopped on SIGTERM at step {step} of 100000: checkpoint {ckpt}; continue with "
                                  f"--resume=1 (make RESUME=1); exit status 143")
    assert (run / "checkpoints" / "latest").read_text().strip() == ckpt.name
    assert status(run)["state"] == "interrupted" and not (run / ".run.lock").exists()
    train.run(cfg(hidden_cache, run, steps=step + 2, resume=True))
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == step + 2
    assert status(run)["state"] == "done" and not (run / ".run.lock").exists()


def test_two_processes_stop_together_when_one_is_signalled(tmp_path, hidden_cache):
    """A signal to one rank only (a launcher may forward it to all, or not): both ranks stop at the same step with
    one checkpoint, exit 143, and neither waits for the other in a collective."""
    run, port, procs = tmp_path / "run", str(free_port()), []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DFLASH_NO_BAR="1", PYTHONPATH=str(REPO),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, *cli_args(hidden_cache, run, steps=100_000,
                                                                                ckpt_every=100_000)],
                                      cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        wait_for(lambda: status(run).get("done", 0) >= 1, proc=procs[0])
        procs[1].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [143, 143], [err[-2000:] for _, err in outs]
    step = int(outs[0][1].strip().splitlines()[-1].split(" at step ")[1].split()[0])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", f"step-{step:08d}"]
    assert status(run)["state"] == "interrupted" and not (run / ".run.lock").exists()


def sigint_in_step(monkeypatch, n: int) -> list:
    """Ctrl-C inside the `n`-th optimizer step (its update still runs); returns the list of steps taken."""
    real = Trainer.optimizer_step
    calls = []

    def interrupted_step(*a, **k):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(Trainer, "optimizer_step", interrupted_step)
    return calls


def test_sigint_stops_after_the_step_in_flight_with_one_line_and_exit_130(tmp_path, hidden_cache, monkeypatch,
                                                                           capsys):
    """Ctrl-C mid-step (here: inside step 2's optimizer update) is no KeyboardInterrupt: step 2 finishes, is
    checkpointed, and `main` returns 130 after one line on stderr."""
    calls = sigint_in_step(monkeypatch, 2)
    run = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)  # (default_int_handler; SIG_IGN in a pytest-xdist worker)
    assert train.main(cli_args(hidden_cache, run, steps=50, ckpt_every=50)) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"stopped on SIGINT at step 2 of 50: checkpoint {run / 'checkpoints' / 'step-00000002'}; "
                       f"continue with --resume=1 (make RESUME=1); exit status 130")
    assert len(calls) == 2 and status(run)["state"] == "interrupted" and not (run / ".run.lock").exists()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are put back


def test_a_bench_run_stopped_at_its_last_step_writes_no_checkpoint_and_says_so(tmp_path, hidden_cache, monkeypatch):
    """bench.train's runs write no final checkpoint (`BenchSwitches.final_checkpoint=False`), also when a time limit's
    SIGTERM/SIGINT lands in the last step: the stop names no checkpoint, and the last window is recorded."""
    from dflash_offline.trainrun import run as train_run
    from dflash_offline.trainsetup import BenchSwitches

    sigint_in_step(monkeypatch, 3)
    run = tmp_path / "run"
    with pytest.raises(runguard.Interrupted, match="at step 3 of 3: its steps all done, no checkpoint"):
        train_run(cfg(hidden_cache, run, steps=3, ckpt_every=10**9, log_every=2), BenchSwitches(final_checkpoint=False))
    assert not list(run.glob("checkpoints/step-*"))
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [2, 3]


@pytest.mark.parametrize("log_every", [1, 2])
def test_a_stop_between_checkpoints_writes_its_steps_metrics_and_a_resume_matches_an_uninterrupted_run(
        tmp_path, hidden_cache, monkeypatch, log_every):
    """SIGINT in step 3 of 5 (no checkpoint step, and with log_every=2 no log step): metrics.jsonl gets step 3's
    record before the stop's checkpoint, so `--resume=1` from step 3 leaves every step's record — once — with the
    losses of an uninterrupted run (with log_every=1, record for record; the loss is the mean over a window, so with
    2 the stop's extra window boundary changes the windows but still no step goes missing)."""
    real, calls = Trainer.optimizer_step, []

    def interrupted_step(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    run, clean = tmp_path / "run", tmp_path / "clean"
    args = dict(steps=5, ckpt_every=50, log_every=log_every)
    with monkeypatch.context() as m:
        m.setattr(Trainer, "optimizer_step", interrupted_step)
        assert train.main(cli_args(hidden_cache, run, **args)) == 130
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == ([1, 2, 3] if log_every == 1 else [2, 3])
    assert train.main(cli_args(hidden_cache, run, resume=1, **args)) == 0
    assert train.main(cli_args(hidden_cache, clean, **args)) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    if log_every == 1:
        want = [json.loads(line) for line in (clean / "metrics.jsonl").read_text().splitlines()]
        assert [(r["step"], r["loss"]) for r in records] == [(r["step"], r["loss"]) for r in want]
    else:
        assert [r["step"] for r in records] == [2, 3, 4, 5]


def test_a_stop_that_outlasts_its_grace_ends_the_process_marked_interrupted(tmp_path):
    """A step or a checkpoint stuck past `stop_grace_s` (or a second signal): the process ends at once, 128 + the
    signal, with its status `interrupted`, its lock released and one line."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "status-rank0.json").write_text(json.dumps({"state": "running", "done": 3}))
    script = ("import time, sys; from pathlib import Path; from dflash_offline import runguard as g\n"
              "run = Path(sys.argv[1]); g.acquire(run)\n"
              "with g.StopSignals(0.2, g.ender(run, 0)) as s:\n"
              "    print('ready', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(run)], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout.readline() == "ready\n"
    assert (run / ".run.lock").exists()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == (
        "stopped on SIGTERM: the 0.2s stop grace ended the run before a final checkpoint; continue it from its last "
        "checkpoint with --resume=1 (make RESUME=1)")
    assert status(run) == {"state": "interrupted", "done": 3} and not (run / ".run.lock").exists()


def test_a_second_signal_stops_at_once_but_a_forwarded_one_is_the_same_request(monkeypatch):
    """Slurm signals every process of a step and torchrun forwards the signal again: a repeat within REPEAT_S is the
    first request (the final checkpoint is still written); a later one ends the run at once."""
    monkeypatch.setattr(runguard, "REPEAT_S", 0.5)
    ended = threading.Event()
    got = []
    with runguard.StopSignals(60, lambda sig, why: (got.append((sig, why)), ended.set())) as s:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: s.requested)
        os.kill(os.getpid(), signal.SIGTERM)  # (forwarded)
        assert not ended.wait(0.2) and not got
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        assert ended.wait(5) and got == [(signal.SIGTERM, "a second signal")]


def test_two_trainers_breaking_one_stale_lock_do_not_both_own_the_run(tmp_path, monkeypatch):
    """Both judge the dead holder's lock stale at the same moment; the break marker and the check that the lock still
    holds what was judged stale leave exactly one owner."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / ".run.lock"
    lock.write_text(json.dumps({"host": os.uname().nodename, "pid": dead.pid, "started": 0}))
    slow_stale = runguard.stale

    def stale(path, held):  # both threads judge before either breaks
        why = slow_stale(path, held)
        time.sleep(0.3)
        return why

    monkeypatch.setattr(runguard, "stale", stale)
    monkeypatch.setattr(runguard, "pid_alive", lambda host, pid, boot=None: int(pid) != dead.pid)
    owners, refused = [], []

    def take():
        try:
            runguard.acquire(tmp_path)
            owners.append(json.loads(lock.read_text()))
        except ValueError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=take) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(owners) == 1 and len(refused) == 1 and "is being trained by" in refused[0]
    assert not list(tmp_path.glob(".run.lock.*"))  # no temp record or break marker left


def test_a_lock_left_by_a_dead_trainer_is_broken_with_a_message(tmp_path, hidden_cache, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "run"
    run.mkdir()
    (run / ".run.lock").write_text(json.dumps({"host": os.uname().nodename, "pid": dead.pid, "started": 0}))
    train.run(cfg(hidden_cache, run, steps=1))
    assert (f"breaking the stale run lock {run / '.run.lock'} left by {os.uname().nodename} pid {dead.pid} (since "
            f"1970-01-01 00:00:00 UTC): that process is gone") in capsys.readouterr().out
    assert not (run / ".run.lock").exists() and (run / "checkpoints" / "step-00000001").is_dir()


def test_no_run_name_and_a_run_inside_a_cache_are_refused(tmp_path, hidden_cache):
    with pytest.raises(ValueError, match=r"^--run \(make RUN=\) is empty: name the run's directory"):
        train.run(cfg(hidden_cache, ""))
    inside = hidden_cache / "runs" / "x"
    with pytest.raises(ValueError, match=rf"^--run \(make RUN=\) {inside} is inside the hidden cache {hidden_cache} "):
        train.run(cfg(hidden_cache, inside))
    assert not (hidden_cache / "runs").exists()


def test_a_lock_from_another_host_is_broken_only_once_its_heartbeat_stops(tmp_path, monkeypatch, capsys):
    """Another host's holder cannot be asked whether it lives: its lock counts while it is touched (every
    HEARTBEAT_S), and is broken once untouched for OTHER_HOST_STALE_S (a job restarted on another machine)."""
    lock = tmp_path / ".run.lock"
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": 0}))
    with pytest.raises(ValueError, match=r"is being trained by elsewhere pid 1 .*delete .*\.run\.lock$"):
        runguard.acquire(tmp_path)
    old = time.time() - runguard.OTHER_HOST_STALE_S - 5
    os.utime(lock, (old, old))
    runguard.acquire(tmp_path)
    assert "left by elsewhere pid 1 (since 1970-01-01 00:00:00 UTC): not touched for 60" in capsys.readouterr().out
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    monkeypatch.setattr(runguard, "HEARTBEAT_S", 0.01)
    os.utime(lock, (old, old))
    done = threading.Event()
    beat = threading.Thread(target=runguard.heartbeat, args=(lock, done), daemon=True)
    beat.start()
    try:
        wait_for(lambda: time.time() - lock.stat().st_mtime < 5, timeout_s=10)
    finally:
        done.set()
        beat.join()
    runguard.release(tmp_path)
    assert not lock.exists()

    # a container with this hostname in another pid space (boot id): its pid means nothing here, so a dead-looking pid
    # does not break its lock; only the stopped heartbeat does
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"host": os.uname().nodename, "pid": dead.pid, "boot": "other-boot", "started": 0}))
    with pytest.raises(ValueError, match=rf"is being trained by {os.uname().nodename} pid {dead.pid} "):
        runguard.acquire(tmp_path)
    os.utime(lock, (old, old))
    runguard.acquire(tmp_path)
    assert json.loads(lock.read_text())["boot"] == fsio.boot_id()
    runguard.release(tmp_path)


def test_a_writer_whose_lock_another_process_took_ends_at_once(tmp_path):
    """`runguard.holding` (one writer of an appended output, e.g. a regeneration's OUT): where another process takes
    the lock meanwhile (it judged this one gone: a machine suspended past the stale age), this one ends at once,
    exit status 1, in one line naming the new holder — two would append to one output."""
    lock = tmp_path / "out.jsonl.lock"
    proc = subprocess.Popen([sys.executable, "-c", (
        "import time; from pathlib import Path; from dflash_offline import runguard; runguard.HEARTBEAT_S = 0.1\n"
        f"with runguard.holding(Path({str(lock)!r}), lambda h, l: 'held'):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(60)\n"
        "print('went on', flush=True)\n")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    other = {"host": "elsewhere", "pid": 4242, "boot": "x", "started": time.time()}
    lock.write_text(json.dumps(other))  # (as a breaker on another host leaves it)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "went on" not in out
    assert f"the lock {lock} is now held by elsewhere pid 4242" in err and "this process stops" in err
    assert lock.is_file() and json.loads(lock.read_text()) == other  # (the new holder's, left to it)
