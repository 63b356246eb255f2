"""Randomized kill -9 / SIGTERM of stages 1b and 2, each followed by a rerun, compared with clean runs (CPU, minutes).

    python -m bench.faults [--kills=50] [--signals=kill,term] [--seed=0] [--out=build/faults]   (make faults ARGS=...)

The contract under test: after any `kill -9` or SIGTERM and a rerun of the same command,
1. extraction: the token and hidden caches have the clean run's keys and committed shards — same files, same bytes,
   same SHA-256 in the manifests;
2. training resumed with `--resume=1`: the same kept checkpoints (model and optimizer tensors `torch.equal`) and the
   same `metrics.jsonl` losses as an uninterrupted run with the same config;
3. no debris: no temp files or directories (`.tmp~`, older code `.tmp-`), no claims, no `.lock`, nothing starting
   with `.` in `<run>/checkpoints/`, no `step-*` directory lacking a file its `meta.json` lists (or meta.json);
and every rerun that is not killed exits 0.

Each kill draws its signal from `--signals` (SIGKILL or SIGTERM, evenly). A SIGTERM'd run must in addition exit
within TERM_BOUND_S of the signal with 143 and its one line (extraction: `error: stopped by SIGTERM`, the status file
of this process `interrupted`; training: `stopped on SIGTERM`, `status-rank0.json` `interrupted`, `RUN/.run.lock`
released) — or with 0 when it finished before the signal landed, or as killed by SIGTERM (-15) when the signal came
before the stage installed its handler or after it put the default back (interpreter start-up, shutdown): then it is
the same as a kill -9 with nothing in flight. A training run stopped at step N writes a checkpoint of step N besides
the regular ones, so the kept checkpoints are the newest `keep_last` of the regular steps and those stop steps (not
the clean run's set when a stop step is among the newest); each kept one is compared tensor-for-tensor with a clean
run that saved every step (itself checked equal to the clean run on the steps both keep), and `metrics.jsonl` must
still equal the clean run's record for record (no step twice).

Second trainer: in every training trial's completing run, once it logged `ready in` (it holds `RUN/.run.lock`), the
harness pauses it (SIGSTOP: a live holder, whatever the speed of the tiny run), starts a second `stages.train` with
the same arguments on the same run, which must be refused within REFUSAL_BOUND_S (exit 2, one line `is being trained
by`), resumes the first (SIGCONT), and the trial's comparison must still pass.

The clean references (the tiny Qwen3.5 target, one extraction, one training run) are built first in `--out`; each
trial then runs the stage with the reference's arguments into its own directory (extraction: a fresh cache root,
`write_queue` drawn from 1..3, which changes no byte; training: a fresh run directory on the reference cache),
kills it, possibly kills the rerun too (1-3 kills per trial), and reruns it to completion. A training rerun passes
`--resume=1` once the run has a `checkpoints/` directory, as the trainer's refusal asks.

Kill timing: the reference runs are cut into phases by their log lines (extraction: start-up | tokenize | kernel
check + weight load | shards | exit; training: start-up | steps | last checkpoint save | exit). A kill picks a phase
(`PHASES`: 60-70 % go to the work phases, which are short next to the start-up), waits for that phase's first log
line in the run it kills, then sleeps a time drawn uniformly over the phase's duration in the reference. Anchoring
on the run's own log line keeps the draw inside the phase whatever the start-up jitter of a loaded machine; uniform
within the phase lands kills mid-shard / mid-step as well as inside shard writes, claims, commits and checkpoint
saves. A run that ends before its kill is not counted as a kill: it is the completing rerun.

Trials that pass are deleted; a failing one stays in `<out>/trials/` with the log of every run. The last line sums
up kills per stage and per signal, second trainers refused, shards and checkpoints compared, debris and mismatches;
`<out>/faults.json` holds the whole tally (also SIGTERM exit statuses and the slowest SIGTERM exit and refusal).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_offline.cache.fsio import TEMP_MARK, sha256_file
from dflash_offline.cache.manifest import ManifestError, read_manifest

REPO = Path(__file__).resolve().parents[1]
TEMP_MARKS = (TEMP_MARK, ".tmp-")  # the current temp-name mark and the older code's
EXTRACT = dict(seq_len=128, rows_per_shard=2, max_docs=40, num_draft_layers=3, device="cpu", batch_rows=2,
               workers=1)
TRAIN = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, batch_rows=2, log_every=1,
             trackers="none", lr=3e-3, warmup_steps=1, steps=12, ckpt_every=2, keep_last=3)
# (phase, regex of the log line that starts it — None: the process start —, share of the kills)
PHASES = {
    "extract": [("start-up", None, 0.2), ("tokenize", r"tokenizing \d+ file|token cache .* reusing", 0.2),
                ("load", r"shards to do", 0.1), ("shards", r"weights loaded", 0.4), ("exit", r"\] done: ", 0.1)],
    "train": [("start-up", None, 0.25), ("steps", r"ready in", 0.5), ("last save", rf"step {TRAIN['steps']}: ", 0.15),
              ("exit", r"^/\S+$", 0.1)],  # the last step's metrics come before its checkpoint; then the run's path
}
KILLS_PER_TRIAL = ([1, 2, 3], [0.6, 0.25, 0.15])
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
TERM_BOUND_S = 30.0  # a SIGTERM'd run exits this soon after the signal (training's stop grace is 25 s)
REFUSAL_BOUND_S = 20.0  # a second trainer on a held run is refused this soon after its start (a loaded 2-core CPU)


# --- running and killing a stage ---------------------------------------------------------------------------------


class Run:
    """A stage in its own process group; its output goes to `log` and is watched line by line (time, text)."""

    def __init__(self, args: list[str], log: Path):
        env = dict(os.environ, DFLASH_NO_BAR="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.t0, self.lines, self.cond = time.time(), [], threading.Condition()
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self.reader.start()

    def _read(self, log: Path) -> None:
        with open(log, "w") as f:
            for line in self.proc.stdout:
                f.write(line)
                with self.cond:
                    self.lines.append((time.time() - self.t0, line))
                    self.cond.notify_all()
        with self.cond:
            self.lines.append((time.time() - self.t0, None))  # end of output
            self.cond.notify_all()

    def wait_line(self, pattern: str | None, timeout: float) -> float | None:
        """Seconds from the start to the first line matching `pattern` (0 for None); None if the run ends first."""
        if pattern is None:
            return 0.0
        seen, deadline = 0, time.time() + timeout
        with self.cond:
            while time.time() < deadline:
                for t, line in self.lines[seen:]:
                    if line is None:
                        return None
                    if re.search(pattern, line):
                        return t
                seen = len(self.lines)
                self.cond.wait(deadline - time.time())
        return None

    def signal_at(self, t: float, sig: int, bound: float) -> tuple[bool, int | None, float]:
        """Send `sig` to the whole group `t` s after the start: (sent — False if the run had ended —, exit status —
        None if it outlived `bound` s after the signal, then killed —, seconds from the signal to the exit)."""
        try:
            self.proc.wait(max(0.0, self.t0 + t - time.time()))
            return False, self.proc.returncode, 0.0
        except subprocess.TimeoutExpired:
            sent = time.time()
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:  # ended (and reaped) this instant
                return False, self.proc.wait(), 0.0
        rc = self.finish(bound)
        return True, rc, time.time() - sent

    def finish(self, timeout: float) -> int | None:
        """The exit status, or None after killing a run that hangs past `timeout`."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            rc = None
        self.reader.join(10)
        return rc

    def tail(self, n: int = 3) -> str:
        return " | ".join(line.strip() for _, line in self.lines[-n - 1:] if line)

    def phase_starts(self, kind: str) -> list[float]:
        return [next((t for t, line in self.lines if line and re.search(p, line)), 0.0) if p else 0.0
                for _, p, _ in PHASES[kind]]


def extract_args(target: Path, corpus: Path, cache_root: Path, write_queue: int) -> list[str]:
    opts = {**EXTRACT, "target": target, "corpus": corpus, "cache_root": cache_root, "write_queue": write_queue}
    return [sys.executable, "-m", "stages.extract"] + [f"--{k}={v}" for k, v in opts.items()]


def train_args(cache: Path, run: Path, resume: bool, **over) -> list[str]:
    opts = {**TRAIN, **over, "cache": cache, "run": run, "resume": int(resume)}
    return [sys.executable, "-m", "stages.train"] + [f"--{k}={v}" for k, v in opts.items()]


# --- what a run left ---------------------------------------------------------------------------------------------


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def caches(root: Path) -> dict[str, Path]:
    """{"tokens": dir, "hidden": dir} of the caches under a cache root (those that exist)."""
    return {p.name.split("-")[0]: p for p in sorted(root.glob("*-*")) if p.is_dir()} if root.is_dir() else {}


def manifest_or_empty(cache: Path) -> dict:
    """A cache's manifest, {} when it has none (yet) or it cannot be read (a mismatch, not a crash of the harness)."""
    try:
        return read_manifest(cache)
    except ManifestError:
        return {}


def committed_files(cache: Path) -> dict[int, dict]:
    m = manifest_or_empty(cache)
    return {s["index"]: s["files"] for s in m.get("shards", []) if s.get("status") == "committed"}


def cache_debris(root: Path) -> list[str]:
    """Temp files and directories, claims, locks under a cache root."""
    left = [p for p in root.rglob("*") if any(m in p.name for m in TEMP_MARKS)] if root.is_dir() else []
    for cache in caches(root).values():
        left += list((cache / "claims").glob("*")) + [p for p in [cache / ".lock"] if p.exists()]
    return sorted(str(p.relative_to(root)) for p in left)


def run_debris(run: Path) -> list[str]:
    """Temp files, the run lock (and its temp or break marker), anything hidden in checkpoints/ (temp or replaced
    checkpoints), step-* directories that lack a file their meta.json lists (or meta.json itself)."""
    ck = run / "checkpoints"
    left = [p for p in run.rglob("*") if any(m in p.name for m in TEMP_MARKS)] if run.is_dir() else []
    left += list(run.glob(".run.lock*")) if run.is_dir() else []
    left += [p for p in ck.iterdir() if p.name.startswith(".")] if ck.is_dir() else []
    left += [p for p in ck.glob("step-*") if not complete(p)]
    return sorted({str(p.relative_to(run)) for p in left})


def complete(step_dir: Path) -> bool:
    """Every file `meta.json` lists is there with its size (what a half-written or half-pruned one lacks)."""
    meta = read_json(step_dir / "meta.json") or {}
    files = meta.get("files") or {}
    return bool(files) and all((step_dir / n).is_file() and (step_dir / n).stat().st_size == b for n, b in files.items())


def extract_state(root: Path) -> str:
    """One phrase: how far the killed run got and what it left."""
    done = []
    for kind, cache in caches(root).items():
        m = manifest_or_empty(cache)
        total = m.get("num_shards") or "?"
        done.append(f"{kind} {len(committed_files(cache))}/{total}")
    return (", ".join(done) or "no cache yet") + left_phrase(cache_debris(root))


def train_state(run: Path) -> str:
    latest = run / "checkpoints" / "latest"
    ck = f"latest {latest.read_text().strip()}" if latest.is_file() else "no checkpoint"
    metrics = run / "metrics.jsonl"
    steps = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    return f"{ck}, {steps} metrics lines" + left_phrase(run_debris(run))


def left_phrase(debris: list[str]) -> str:
    return f"; left {len(debris)}: {', '.join(Path(d).name for d in debris)}" if debris else "; left nothing"


# --- comparisons with the clean run ------------------------------------------------------------------------------


@dataclass
class Verdict:
    compared: int = 0  # shards or checkpoints found equal
    debris: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


def compare_extract(root: Path, ref_root: Path) -> Verdict:
    v, got, ref = Verdict(debris=cache_debris(root)), caches(root), caches(ref_root)
    if sorted(p.name for p in got.values()) != sorted(p.name for p in ref.values()):
        v.mismatches.append(f"caches {sorted(p.name for p in got.values())} ≠ clean "
                            f"{sorted(p.name for p in ref.values())}")
        return v
    for kind, cache in got.items():
        m, mref = manifest_or_empty(cache), read_manifest(ref[kind])
        if m.get("key") != mref["key"] or m.get("num_shards") != mref["num_shards"]:
            v.mismatches.append(f"{cache.name}: key/num_shards {m.get('key')}/{m.get('num_shards')} ≠ clean")
        files, want = committed_files(cache), committed_files(ref[kind])
        if files.keys() != want.keys():
            v.mismatches.append(f"{cache.name}: committed shards {sorted(set(want) - set(files))} missing, "
                                f"{sorted(set(files) - set(want))} extra")
        for i in sorted(files.keys() & want.keys()):
            names = [n for n in files[i] if (cache / n).is_file() and sha256_file(cache / n) == files[i][n]["sha256"]]
            if files[i] != want[i] or len(names) != len(files[i]):
                v.mismatches.append(f"{cache.name}: shard {i} differs from the clean run's (manifest or bytes)")
            else:
                v.compared += 1
        listed = {n for f in files.values() for n in f}
        stray = sorted(p.name for p in cache.glob(f"{kind}-*") if p.name not in listed)
        v.debris += [f"{cache.name}/{n} (not in the manifest)" for n in stray]
    return v


def losses(run: Path) -> list[tuple[int, float]]:
    path = run / "metrics.jsonl"
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())] if path.is_file() else []


def checkpoints(run: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted((run / "checkpoints").glob("step-*")) if complete(p)}


def kept_steps(stops: list[int] = ()) -> list[str]:
    """The checkpoints a run keeps: the newest `keep_last` of the regular steps and the steps SIGTERM stopped at."""
    n, every = TRAIN["steps"], TRAIN["ckpt_every"]
    saved = sorted({*range(every, n + 1, every), n, *stops})
    return [f"step-{s:08d}" for s in saved[-TRAIN["keep_last"]:]]


def compare_train(run: Path, ref: Path, stops: list[int] = (), every: Path | None = None) -> Verdict:
    """`run` against the clean run `ref`: metrics record for record, `latest`, the kept checkpoints (those of `ref`
    with no stop among the newest; else `kept_steps(stops)`), each equal to `every`'s (a clean run that kept every
    step; `ref` when None)."""
    import torch
    from safetensors.torch import load_file

    v = Verdict(debris=run_debris(run))
    got, want = losses(run), losses(ref)
    if got != want:
        steps = [s for s, _ in got]
        dup = sorted({s for s in steps if steps.count(s) > 1})
        diff = [s for s, x in dict(got).items() if dict(want).get(s) != x]
        v.mismatches.append(f"metrics.jsonl: {len(got)} records for {len(want)} clean ones; steps recorded more than "
                            f"once {dup}; steps whose loss differs {diff}")
    ck, ckref = checkpoints(run), checkpoints(every or ref)
    want_kept = kept_steps(stops) if stops else sorted(checkpoints(ref))
    if sorted(ck) != want_kept:
        v.mismatches.append(f"checkpoints {sorted(ck)} ≠ {want_kept} (clean {sorted(checkpoints(ref))}"
                            f"{f', stops at steps {sorted(stops)}' if stops else ''})")
    latest, ref_latest = (read_text(r / "checkpoints" / "latest") for r in (run, ref))
    if latest != ref_latest:
        v.mismatches.append(f"checkpoints/latest names {latest!r}, clean {ref_latest!r}")
    for name in sorted(ck.keys() - ckref.keys()):
        v.mismatches.append(f"{name}: no clean checkpoint to compare it with")
    for name in sorted(ck.keys() & ckref.keys()):
        bad = [f for f in ("model.safetensors", "optimizer.safetensors")
               if not tensors_equal(load_file(str(ck[name] / f)), load_file(str(ckref[name] / f)), torch)]
        if bad:
            v.mismatches.append(f"{name}: {', '.join(bad)} differ from the clean run's")
        else:
            v.compared += 1
    return v


def read_text(path: Path) -> str | None:
    return path.read_text().strip() if path.is_file() else None


def tensors_equal(a: dict, b: dict, torch) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- trials ------------------------------------------------------------------------------------------------------


@dataclass
class Reference:
    target: Path
    corpus: Path
    extract_root: Path
    train_run: Path
    every_run: Path  # the clean training run with a checkpoint of every step, all kept
    phases: dict  # kind → [(phase, pattern, weight, duration s)]
    seconds: dict  # kind → wall time of the clean run


def phase_table(kind: str, run: Run) -> list[tuple]:
    starts = run.phase_starts(kind) + [run.lines[-1][0]]
    return [(*PHASES[kind][i], max(0.05, starts[i + 1] - starts[i])) for i in range(len(PHASES[kind]))]


def build_references(out: Path, log) -> Reference:
    from fixtures import democorpus, tiny

    target, ref = out / "target", out / "clean"
    sidecar = read_json(target / "dflash_target.json") or {}
    if sidecar.get("params") != tiny.build_params("qwen3_5"):
        from transformers.utils import logging

        logging.disable_progress_bar()
        shutil.rmtree(target, ignore_errors=True)
        tiny.build_target(target, "qwen3_5", log=lambda m: None)
    shutil.rmtree(ref, ignore_errors=True)
    ref.mkdir(parents=True)
    corpus = democorpus.write_jsonl(out / "corpus.jsonl", 300, seed=1)
    phases, seconds = {}, {}
    for kind in ("extract", "train"):
        args = (extract_args(target, corpus, ref / "cache", 2) if kind == "extract" else
                train_args(caches(ref / "cache")["hidden"], ref / "run", False))
        run = Run(args, ref / f"{kind}.log")
        if run.finish(600) != 0:
            raise SystemExit(f"faults: the clean {kind} run failed: {run.tail(5)} (log {ref / kind}.log)")
        phases[kind], seconds[kind] = phase_table(kind, run), run.lines[-1][0]
        log(f"clean {kind}: {seconds[kind]:.1f}s; phases " +
            ", ".join(f"{name} {d:.2f}s" for name, _, _, d in phases[kind]))
    # what a SIGTERM'd run's stop checkpoint is compared with: the same run saving (and keeping) every step
    run = Run(train_args(caches(ref / "cache")["hidden"], ref / "run-every", False, ckpt_every=1, keep_last=0),
              ref / "train-every.log")
    if run.finish(600) != 0:
        raise SystemExit(f"faults: the clean train run with every step kept failed: {run.tail(5)}")
    v = compare_train(ref / "run", ref / "run", every=ref / "run-every")
    if v.mismatches or v.compared != len(checkpoints(ref / "run")):
        raise SystemExit(f"faults: the clean run keeping every step differs from the clean run: {v.mismatches}")
    return Reference(target, corpus, ref / "cache", ref / "run", ref / "run-every", phases, seconds)


@dataclass
class Tally:
    kills: dict = field(default_factory=lambda: {"extract": 0, "train": 0})
    signals: dict = field(default_factory=lambda: {"kill": 0, "term": 0})  # kills by signal
    phases: dict = field(default_factory=dict)  # "kind phase" → kills that landed in it
    term_exits: dict = field(default_factory=dict)  # "kind rc" → SIGTERM'd runs (143; -15: outside the handler)
    term_finished: int = 0  # runs that finished (exit 0) although SIGTERM was sent: the completing run
    term_max_s: float = 0.0  # the longest time from a SIGTERM to the exit
    stop_checkpoints: int = 0  # training runs stopped at a step with a final checkpoint
    refused: int = 0  # second trainers refused as they should be
    refusal_max_s: float = 0.0
    missed: int = 0  # runs that ended before their kill
    shards: int = 0
    ckpts: int = 0
    debris: int = 0
    mismatches: int = 0


def term_checks(kind: str, run: Run, rc: int, d: Path) -> tuple[list[str], int | None]:
    """What a SIGTERM'd run must have done besides leaving no debris: (problems, the step a training run stopped at
    with a checkpoint, None for none)."""
    text = [line.rstrip("\n") for _, line in run.lines if line]
    problems, step = [], None
    if rc == -signal.SIGTERM:  # the default action: before the handler was installed or after it was put back
        lines = [x for x in text if re.match(r"(error: )?stopped (by|on) SIGTERM|SIGTERM: ", x)]
        if lines:
            problems.append(f"killed by SIGTERM's default action although it logged {lines[0]!r}")
    elif kind == "extract":
        lines = [x for x in text if x.startswith("error: stopped by SIGTERM")]
        if len(lines) != 1:
            problems.append(f"{len(lines)} lines 'error: stopped by SIGTERM' (one wanted)")
        mine = [p for p in (d / "cache").glob("*/status*.json") if (read_json(p) or {}).get("pid") == run.proc.pid]
        states = {p.parent.name.split("-")[0] + "/" + p.name: (read_json(p) or {}).get("state") for p in mine}
        hidden = {k: x for k, x in states.items() if k.startswith("hidden/")}
        pending = hidden or {k: x for k, x in states.items() if x != "done"}  # the stage it was in, if it had one
        if any(x != "interrupted" for x in pending.values()):
            problems.append(f"status files {pending} (interrupted wanted)")
    else:
        lines = [x for x in text if x.startswith("stopped on SIGTERM")]
        if len(lines) != 1:
            problems.append(f"{len(lines)} lines 'stopped on SIGTERM' (one wanted)")
        elif m := re.match(r"stopped on SIGTERM at step (\d+) of ", lines[0]):
            step = int(m.group(1))
        status = read_json(d / "run" / "status-rank0.json")
        if (status is not None or step is not None) and (status or {}).get("state") != "interrupted":
            problems.append(f"status-rank0.json state {(status or {}).get('state')!r} (interrupted wanted)")
    if kind == "train" and (d / "run" / ".run.lock").exists():
        problems.append("RUN/.run.lock not released")
    return problems, step


def second_trainer(run: Run, cmd: list[str], d: Path, tally: Tally) -> str | None:
    """Once `run` holds its run's lock, pause it, start a second trainer on the run, resume it; a problem or None."""
    if run.wait_line(r"ready in", 120) is None:
        return None  # (ended first: the comparison says the rest)
    try:
        os.killpg(run.proc.pid, signal.SIGSTOP)  # a live holder for as long as the second trainer takes
    except ProcessLookupError:
        return None
    try:
        t = time.time()
        env = dict(os.environ, DFLASH_NO_BAR="1", PYTHONPATH=str(REPO),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        try:
            res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=REFUSAL_BOUND_S)
        except subprocess.TimeoutExpired:
            return f"a second trainer on the run was not refused within {REFUSAL_BOUND_S:g}s"
        secs = time.time() - t
        (d / "second-trainer.log").write_text(res.stdout + res.stderr)
        said = [x for x in (res.stdout + res.stderr).splitlines() if x.strip()]
        if res.returncode != 2 or len(said) != 1 or "is being trained by" not in said[0]:
            return f"a second trainer exited {res.returncode} saying {said[-3:]} (2 and 'is being trained by' wanted)"
        tally.refused += 1
        tally.refusal_max_s = max(tally.refusal_max_s, secs)
        return None
    finally:
        os.killpg(run.proc.pid, signal.SIGCONT)


def trial(kind: str, n_kills: int, d: Path, ref: Reference, rng: random.Random, tally: Tally, label, log,
          signals: list[str] = ("kill",)) -> bool:
    """Kill one run up to `n_kills` times, rerun it to completion, compare; True when it matches the clean run."""
    wq = rng.randint(1, 3)

    def args() -> list[str]:
        if kind == "extract":
            return extract_args(ref.target, ref.corpus, d / "cache", wq)
        return train_args(caches(ref.extract_root)["hidden"], d / "run", (d / "run" / "checkpoints").is_dir())

    state = (lambda: extract_state(d / "cache")) if kind == "extract" else (lambda: train_state(d / "run"))
    timeout = max(120.0, 10 * ref.seconds[kind])
    pending, problems, stops = None, [], []  # pending: the last kill's line, waiting for what its rerun found
    for attempt in range(n_kills + 1):
        cmd = args()
        run = Run(cmd, d / f"run-{attempt}.log")
        if attempt < n_kills:
            phase, pattern, _, dur = rng.choices(ref.phases[kind], weights=[w for _, _, w, _ in ref.phases[kind]])[0]
            delay, sig = rng.uniform(0, dur), rng.choice(signals)
            t = run.wait_line(pattern, timeout)
            sent, rc, secs = run.signal_at(t + delay, SIGNALS[sig], 60 if sig == "kill" else TERM_BOUND_S) \
                if t is not None else (False, None, 0.0)
            if sent and rc in ((-signal.SIGKILL,) if sig == "kill" else (128 + signal.SIGTERM, -signal.SIGTERM)):
                if pending:
                    log(pending + " → rerun killed too")
                tally.kills[kind] += 1
                tally.signals[sig] += 1
                tally.phases[f"{kind} {phase}"] = tally.phases.get(f"{kind} {phase}", 0) + 1
                how, then = ("kill" if sig == "kill" else "SIGTERM"), ""
                if sig == "term":
                    tally.term_exits[f"{kind} {rc}"] = tally.term_exits.get(f"{kind} {rc}", 0) + 1
                    tally.term_max_s = max(tally.term_max_s, secs)
                    found, step = term_checks(kind, run, rc, d)
                    problems += [f"run-{attempt} SIGTERM'd: {x}" for x in found]
                    if step is not None:
                        stops.append(step)
                        tally.stop_checkpoints += 1
                    then = f" exit {rc} in {secs:.1f}s{f', stopped at step {step}' if step is not None else ''};"
                pending = (f"{label()} {kind} {d.name} {how} {attempt + 1}/{n_kills} at {t + delay:.2f}s ({phase} "
                           f"+{delay:.2f}s{f', write_queue {wq}' if kind == 'extract' else ''}"
                           f"{', resume=1' if '--resume=1' in cmd else ''}):{then} {state()}")
                continue
            if sent and sig == "term" and rc == 0:
                tally.term_finished += 1  # finished before the signal landed: it is the completing run
            elif sent and rc != 0:
                problems.append(f"run-{attempt} ({cmd[2]}) {'SIGTERM' if sig == 'term' else 'kill -9'} → "
                                f"{f'exit {rc}' if rc is not None else f'still running {secs:.0f}s after it'}: "
                                f"{run.tail()}")
                break
            else:
                tally.missed += 1  # the run ended before its kill: it is the completing rerun
        elif kind == "train" and (why := second_trainer(run, cmd, d, tally)):
            problems.append(f"run-{attempt}: {why}")
        rc = run.finish(timeout)
        if rc != 0:
            problems.append(f"run-{attempt} ({cmd[2]}{' --resume=1' if '--resume=1' in cmd else ''}) "
                            f"{f'exited {rc}' if rc is not None else 'hung'}: {run.tail()}")
        break
    if rc != 0:  # what a failed rerun left differs from the clean run in every way: report the failure alone
        v = Verdict(debris=cache_debris(d / "cache") if kind == "extract" else run_debris(d / "run"))
    elif kind == "extract":
        v = compare_extract(d / "cache", ref.extract_root)
    else:
        v = compare_train(d / "run", ref.train_run, stops, ref.every_run)
    problems += v.mismatches
    tally.debris += len(v.debris)
    tally.mismatches += len(problems)
    if kind == "extract":
        tally.shards += v.compared
    else:
        tally.ckpts += v.compared
    what = "shards" if kind == "extract" else "checkpoints"
    found = (f"rerun rc {rc} in {run.lines[-1][0]:.1f}s: {v.compared} {what} == clean, {len(v.debris)} debris"
             + (f" {v.debris}" if v.debris else "") + (f", MISMATCH: {'; '.join(problems)}" if problems else ""))
    log(f"{pending} → {found}" if pending else f"{label()} {kind} {d.name} ran to the end before its kill → {found}")
    ok = not problems and not v.debris
    if ok:
        shutil.rmtree(d)
    else:
        log(f"    kept {d} (logs run-*.log)")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=50, help="kills in all, extraction and training (50)")
    p.add_argument("--signals", default="kill,term",
                   help="the signals a kill draws from, evenly: kill (SIGKILL), term (SIGTERM) (kill,term)")
    p.add_argument("--seed", type=int, default=0, help="seeds the choice of stage, kill counts and kill times (0)")
    p.add_argument("--out", type=Path, default=REPO / "build" / "faults",
                   help="target, clean runs, failing trials (build/faults)")
    a = p.parse_args(argv)
    signals = [x.strip() for x in a.signals.split(",") if x.strip()]
    if not signals or set(signals) - set(SIGNALS):
        p.error(f"--signals={a.signals}: a comma-separated list of {', '.join(SIGNALS)}")
    a.out = a.out.resolve()  # the trainer's last line is this absolute path: the "exit" phase's anchor
    t0, rng, tally = time.time(), random.Random(a.seed), Tally()

    def log(msg: str) -> None:
        print(msg, flush=True)

    a.out.mkdir(parents=True, exist_ok=True)
    ref = build_references(a.out, log)
    shutil.rmtree(a.out / "trials", ignore_errors=True)
    n = 0
    while (done := sum(tally.kills.values())) < a.kills:
        if tally.missed > max(5, a.kills):
            raise SystemExit(f"faults: {tally.missed} runs ended before their kill: do the phase patterns in "
                             f"bench/faults.py PHASES still match the stages' log lines?")
        left, missing = a.kills - done, [k for k, v in tally.kills.items() if not v]
        kind = missing[0] if a.kills > 1 and len(missing) == left else rng.choice(sorted(tally.kills))
        reserve = len(set(missing) - {kind}) if a.kills > 1 else 0  # kills kept for a kind not killed yet
        k = max(1, min(left - reserve, rng.choices(*KILLS_PER_TRIAL)[0]))
        d = a.out / "trials" / f"{n:03d}-{kind}"
        d.mkdir(parents=True)
        trial(kind, k, d, ref, rng, tally, lambda: f"[{sum(tally.kills.values()):2d}/{a.kills}]", log, signals)
        n += 1
    print("kills by phase: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.phases.items())) +
          f"; {tally.missed} run(s) ended before their kill", flush=True)
    print("SIGTERM exits: " + (", ".join(f"{k} {v}" for k, v in sorted(tally.term_exits.items())) or "none") +
          f" (slowest {tally.term_max_s:.1f}s); {tally.stop_checkpoints} training stop(s) with a checkpoint; "
          f"{tally.term_finished} run(s) finished before their SIGTERM; second trainers refused within "
          f"{tally.refusal_max_s:.1f}s", flush=True)
    ke, kt = tally.kills["extract"], tally.kills["train"]
    summary = (f"faults: {ke + kt} kills ({ke} extract, {kt} train; {tally.signals['kill']} SIGKILL, "
               f"{tally.signals['term']} SIGTERM), {tally.refused} second trainers refused, {tally.shards} shards "
               f"(byte-for-byte) + {tally.ckpts} checkpoints (tensor-for-tensor) compared with a clean run, "
               f"{tally.debris} debris, {tally.mismatches} mismatches ({time.time() - t0:.0f} s)")
    from dataclasses import asdict

    write = {**asdict(tally), "kills_total": ke + kt, "signals_drawn_from": signals, "seed": a.seed,
             "seconds": round(time.time() - t0, 1), "summary": summary}
    (a.out / "faults.json").write_text(json.dumps(write, indent=1, sort_keys=True) + "\n")
    print(summary, flush=True)
    return 1 if tally.debris or tally.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
