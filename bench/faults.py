"""Randomized kill -9 of stages 1b and 2, each followed by a rerun, compared with clean runs (CPU, minutes).

    python -m bench.faults [--kills=50] [--seed=0] [--out=build/faults]          (make faults ARGS=...)

The contract under test: after any `kill -9` and a rerun of the same command,
1. extraction: the token and hidden caches have the clean run's keys and committed shards — same files, same bytes,
   same SHA-256 in the manifests;
2. training resumed with `--resume=1`: the same kept checkpoints (model and optimizer tensors `torch.equal`) and the
   same `metrics.jsonl` losses as an uninterrupted run with the same config;
3. no debris: no temp files or directories (`.tmp~`, older code `.tmp-`), no claims, no `.lock`, nothing starting
   with `.` in `<run>/checkpoints/`, no `step-*` directory lacking a file its `meta.json` lists (or meta.json);
and every rerun that is not killed exits 0.

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

Trials that pass are deleted; a failing one stays in `<out>/trials/` with the log of every run.
"""

from __future__ import annotations

import argparse
import hashlib
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

from dflash_offline.manifest import TEMP_MARK

REPO = Path(__file__).resolve().parents[1]
TEMP_MARKS = (TEMP_MARK, ".tmp-")  # the current temp-name mark and the older code's
EXTRACT = dict(seq_len=128, rows_per_shard=2, max_docs=40, num_draft_layers=3, device="cpu", batch_rows=2,
               workers=1)
TRAIN = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, batch_rows=2, log_every=1,
             trackers="none", lr=3e-3, warmup_steps=1, steps=12, ckpt_every=2)
# (phase, regex of the log line that starts it — None: the process start —, share of the kills)
PHASES = {
    "extract": [("start-up", None, 0.2), ("tokenize", r"tokenizing \d+ file|token cache .* reusing", 0.2),
                ("load", r"shards to do", 0.1), ("shards", r"weights loaded", 0.4), ("exit", r"\] done: ", 0.1)],
    "train": [("start-up", None, 0.25), ("steps", r"ready in", 0.5), ("last save", rf"step {TRAIN['steps']}: ", 0.15),
              ("exit", r"^/\S+$", 0.1)],  # the last step's metrics come before its checkpoint; then the run's path
}
KILLS_PER_TRIAL = ([1, 2, 3], [0.6, 0.25, 0.15])


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

    def kill_at(self, t: float) -> bool:
        """SIGKILL the whole group `t` s after the start; True if it was still running then."""
        try:
            self.proc.wait(max(0.0, self.t0 + t - time.time()))
            return False
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.finish(60) == -signal.SIGKILL

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


def train_args(cache: Path, run: Path, resume: bool) -> list[str]:
    opts = {**TRAIN, "cache": cache, "run": run, "resume": int(resume)}
    return [sys.executable, "-m", "stages.train"] + [f"--{k}={v}" for k, v in opts.items()]


# --- what a run left ---------------------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def caches(root: Path) -> dict[str, Path]:
    """{"tokens": dir, "hidden": dir} of the caches under a cache root (those that exist)."""
    return {p.name.split("-")[0]: p for p in sorted(root.glob("*-*")) if p.is_dir()} if root.is_dir() else {}


def committed_files(cache: Path) -> dict[int, dict]:
    m = read_json(cache / "manifest.json") or {}
    return {s["index"]: s["files"] for s in m.get("shards", []) if s.get("status") == "committed"}


def cache_debris(root: Path) -> list[str]:
    """Temp files and directories, claims, locks under a cache root."""
    left = [p for p in root.rglob("*") if any(m in p.name for m in TEMP_MARKS)] if root.is_dir() else []
    for cache in caches(root).values():
        left += list((cache / "claims").glob("*")) + [p for p in [cache / ".lock"] if p.exists()]
    return sorted(str(p.relative_to(root)) for p in left)


def run_debris(run: Path) -> list[str]:
    """Temp files, anything hidden in checkpoints/ (temp or replaced checkpoints), step-* directories that lack a
    file their meta.json lists (or meta.json itself)."""
    ck = run / "checkpoints"
    left = [p for p in run.rglob("*") if any(m in p.name for m in TEMP_MARKS)] if run.is_dir() else []
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
        m = read_json(cache / "manifest.json") or {}
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
        m, mref = read_json(cache / "manifest.json") or {}, read_json(ref[kind] / "manifest.json")
        if m.get("key") != mref["key"] or m.get("num_shards") != mref["num_shards"]:
            v.mismatches.append(f"{cache.name}: key/num_shards {m.get('key')}/{m.get('num_shards')} ≠ clean")
        files, want = committed_files(cache), committed_files(ref[kind])
        if files.keys() != want.keys():
            v.mismatches.append(f"{cache.name}: committed shards {sorted(set(want) - set(files))} missing, "
                                f"{sorted(set(files) - set(want))} extra")
        for i in sorted(files.keys() & want.keys()):
            names = [n for n in files[i] if (cache / n).is_file() and sha256(cache / n) == files[i][n]["sha256"]]
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


def compare_train(run: Path, ref: Path) -> Verdict:
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
    ck, ckref = checkpoints(run), checkpoints(ref)
    if ck.keys() != ckref.keys():
        v.mismatches.append(f"checkpoints {sorted(ck)} ≠ clean {sorted(ckref)}")
    latest, ref_latest = (read_text(r / "checkpoints" / "latest") for r in (run, ref))
    if latest != ref_latest:
        v.mismatches.append(f"checkpoints/latest names {latest!r}, clean {ref_latest!r}")
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
    phases: dict  # kind → [(phase, pattern, weight, duration s)]
    seconds: dict  # kind → wall time of the clean run


def phase_table(kind: str, run: Run) -> list[tuple]:
    starts = run.phase_starts(kind) + [run.lines[-1][0]]
    return [(*PHASES[kind][i], max(0.05, starts[i + 1] - starts[i])) for i in range(len(PHASES[kind]))]


def build_references(out: Path, log) -> Reference:
    from dflash_offline import democorpus, tiny

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
    return Reference(target, corpus, ref / "cache", ref / "run", phases, seconds)


@dataclass
class Tally:
    kills: dict = field(default_factory=lambda: {"extract": 0, "train": 0})
    phases: dict = field(default_factory=dict)  # "kind phase" → kills that landed in it
    missed: int = 0  # runs that ended before their kill
    shards: int = 0
    ckpts: int = 0
    debris: int = 0
    mismatches: int = 0


def trial(kind: str, n_kills: int, d: Path, ref: Reference, rng: random.Random, tally: Tally, label, log) -> bool:
    """Kill one run up to `n_kills` times, rerun it to completion, compare; True when it matches the clean run."""
    wq = rng.randint(1, 3)

    def args() -> list[str]:
        if kind == "extract":
            return extract_args(ref.target, ref.corpus, d / "cache", wq)
        return train_args(caches(ref.extract_root)["hidden"], d / "run", (d / "run" / "checkpoints").is_dir())

    state = (lambda: extract_state(d / "cache")) if kind == "extract" else (lambda: train_state(d / "run"))
    timeout = max(120.0, 10 * ref.seconds[kind])
    pending, problems = None, []  # the last kill's line, waiting for what its rerun found
    for attempt in range(n_kills + 1):
        cmd = args()
        run = Run(cmd, d / f"run-{attempt}.log")
        if attempt < n_kills:
            phase, pattern, _, dur = rng.choices(ref.phases[kind], weights=[w for _, _, w, _ in ref.phases[kind]])[0]
            delay = rng.uniform(0, dur)
            t = run.wait_line(pattern, timeout)
            if t is not None and run.kill_at(t + delay):
                if pending:
                    log(pending + " → rerun killed too")
                tally.kills[kind] += 1
                tally.phases[f"{kind} {phase}"] = tally.phases.get(f"{kind} {phase}", 0) + 1
                pending = (f"{label()} {kind} {d.name} kill {attempt + 1}/{n_kills} at {t + delay:.2f}s ({phase} "
                           f"+{delay:.2f}s{f', write_queue {wq}' if kind == 'extract' else ''}"
                           f"{', resume=1' if '--resume=1' in cmd else ''}): {state()}")
                continue
            tally.missed += 1  # the run ended before its kill: it is the completing rerun
        rc = run.finish(timeout)
        if rc != 0:
            problems.append(f"run-{attempt} ({cmd[2]}{' --resume=1' if '--resume=1' in cmd else ''}) "
                            f"{f'exited {rc}' if rc is not None else 'hung'}: {run.tail()}")
        break
    if problems:  # what a failed rerun left differs from the clean run in every way: report the failure alone
        v = Verdict(debris=cache_debris(d / "cache") if kind == "extract" else run_debris(d / "run"))
    elif kind == "extract":
        v = compare_extract(d / "cache", ref.extract_root)
    else:
        v = compare_train(d / "run", ref.train_run)
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
    p.add_argument("--kills", type=int, default=50, help="kill -9s in all, extraction and training (50)")
    p.add_argument("--seed", type=int, default=0, help="seeds the choice of stage, kill counts and kill times (0)")
    p.add_argument("--out", type=Path, default=REPO / "build" / "faults",
                   help="target, clean runs, failing trials (build/faults)")
    a = p.parse_args(argv)
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
        trial(kind, k, d, ref, rng, tally, lambda: f"[{sum(tally.kills.values()):2d}/{a.kills}]", log)
        n += 1
    print("kills by phase: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.phases.items())) +
          f"; {tally.missed} run(s) ended before their kill", flush=True)
    ke, kt = tally.kills["extract"], tally.kills["train"]
    print(f"faults: {ke + kt} kills ({ke} extract, {kt} train), {tally.shards} shards (byte-for-byte) + {tally.ckpts} "
          f"checkpoints (tensor-for-tensor) compared with a clean run, {tally.debris} debris, {tally.mismatches} "
          f"mismatches ({time.time() - t0:.0f} s)", flush=True)
    return 1 if tally.debris or tally.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
