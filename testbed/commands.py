"""The stage CLIs the testbed runs (`python -m stages.<name>`: `stage`), each in a process of its own or in a
long-lived worker process (`testbed/worker.py`): the caches' extraction (`extract`), one drafter's training
(`train_export`: an invocation's trainings in `TRAIN_WORKERS` unless `train_worker` is off) and export (CPU work, in
this process), its evaluation (`evaluate`: all of an invocation's in `EVAL_WORKER` unless `eval_worker` is off); what
a drafter is made from (`Job`, `job_identity`: RUN/testbed-job.json) and the removal of a run made from anything else
(`fresh_run`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_offline import derive
from dflash_offline.cache.fsio import sha256_file
from dflash_offline.cache.manifest import has_manifest, read_manifest

from .config import TestbedConfig
from .runs import Paths, drafter_code_digest, stale_job
from .trainworker import RESIDENT
from .worker import Worker, Workers, run_child, start_child, stop_process

STARTED = time.monotonic()  # (this invocation's start, for --stop_after_s)


class Stopped(Exception):
    """The invocation stopped before the end because its time (`--stop_after_s`) would not hold the next drafter."""


def log(msg: str) -> None:
    print(f"[testbed {time.strftime('%H:%M:%S')}] {msg}", flush=True)


EVAL_WORKER = Worker("testbed.evalworker")  # the evaluations of this invocation, one after another in one process
TRAIN_WORKERS = Workers("testbed.trainworker")  # its trainings: a process per training at once and per environment


def stage(module: str, *args: str, log_file: Path | None = None, ok=(0,), env: dict | None = None,
          worker: Worker | Workers | None = None) -> float:
    """Run `python -m module args` (its output streamed, or into `log_file`; `env` added to this environment), or
    the same in one of `worker`'s processes (`testbed/worker.py`: streamed output goes to this process's stderr);
    returns seconds; an exit status not in `ok` stops here (evaluation exits 1 when the lossless check fails:
    recorded in its JSON, not fatal here)."""
    cmd, t0 = [sys.executable, "-m", module, *args], time.perf_counter()
    if log_file is None:
        log(" ".join(cmd[2:]))
    else:
        log_file.parent.mkdir(parents=True, exist_ok=True)
    if worker is not None:
        rc = worker.run(list(args), log_file, env)
    elif log_file is None:
        rc = run_child(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    else:
        with open(log_file, "w") as f:
            rc = run_child(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, stdout=f,
                           stderr=subprocess.STDOUT)
    if rc not in ok:
        where = f" (log: {log_file})" if log_file else ""
        raise RuntimeError(f"{' '.join(cmd[2:4])} ... failed with exit status {rc}{where}")
    return time.perf_counter() - t0


class Background:
    """`stage` in the background: `python -m module args` started now, its output in `log_file`, its end recorded
    when it comes (`ended`, `seconds`: a thread waits on it); `wait` returns its seconds or raises as `stage` does,
    `stop` ends it (the caller failed or was interrupted)."""

    def __init__(self, module: str, *args: str, log_file: Path, env: dict | None = None):
        import threading

        log(f"{' '.join([module, *args])} (beside; log: {log_file})")
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self.module, self.log_file, self.started, self.t0 = module, log_file, time.time(), time.perf_counter()
        self.ended, self.seconds = None, None
        with open(log_file, "w") as f:
            self.proc = start_child([sys.executable, "-m", module, *args], stdout=f, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.reaper = threading.Thread(target=self._reap, daemon=True)
        self.reaper.start()

    def _reap(self) -> None:
        self.proc.wait()
        self.ended, self.seconds = time.time(), time.perf_counter() - self.t0

    def wait(self, timeout: float | None = None) -> float:
        self.reaper.join(timeout)
        if self.reaper.is_alive():
            raise RuntimeError(f"{self.module} ... still running after {timeout:g}s (log: {self.log_file})")
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.module} ... failed with exit status {self.proc.returncode} (log: "
                               f"{self.log_file})")
        return self.seconds

    def stop(self) -> None:
        stop_process(self.proc, 30)
        self.reaper.join()


@dataclass
class Job:
    arm: str  # its settings as given ('' = the recipe as it is)
    run: Path
    cache: Path
    seed: int
    settings: dict  # its [train] settings


def extract(cfg: TestbedConfig, p: Paths, settings: dict, name: str, dev: str, log_file: Path | None = None) -> float:
    """Token cache (shared) + hidden cache DIR/cache/hidden[-name] with the recipe and `settings` ([extract]); an
    arm's cache that only encodes or projects the base cache's states (`derived`) is, with `--derive_caches=1`,
    derived from them, with no target forward (`dflash_offline.derive`: the key a direct extraction gets)."""
    args = extract_args(cfg, p, p.regen, p.tokens, p.hidden(name), dev)
    if name and cfg.derive_caches and derived(settings) and has_manifest(p.hidden()) \
            and derive.exact_states(read_manifest(p.hidden()).get("producer") or {}):
        args.append(f"--from_cache={p.hidden()}")
    return stage("stages.extract", *args, *(f"--{k}={v}" for k, v in settings.items()), log_file=log_file)


def extract_args(cfg: TestbedConfig, p: Paths, corpus: Path, tokens: Path, cache: Path, dev: str) -> list[str]:
    """stages.extract's arguments for the recipe's extraction of `corpus` by the testbed's target."""
    args = [f"--recipe={cfg.drafter_recipe}", f"--corpus={corpus}", f"--tokenizer={p.target}", f"--target={p.target}",
            f"--tokens={tokens}", f"--cache={cache}", f"--device={dev}"]
    return args + ([f"--seq_len={cfg.recipe_seq_len}"] if cfg.recipe_seq_len else [])


def kernels_ahead(cfg: TestbedConfig, p: Paths, dev: str) -> Background:
    """The extraction's kernel check run ahead, beside the regeneration (`--kernels_ahead`): `stages.extract
    --dry_run=1` of the recipe on a few of the regeneration's prompts (DIR/logs/kernels-ahead.jsonl) checks the
    kernels on a small random model of the target's widths and times one batch of the recipe's rows — the same
    kernels and shapes as the real extraction's check, whatever the corpus — and writes nothing; its compiled kernels
    land in the invocation's Triton cache, where the extraction then finds them (its check took 29 s of a 60 s phase
    on an H100 host at `01f126a`, the arms' extractions' ≈ 2 s)."""
    few = p.root / "logs" / "kernels-ahead.jsonl"
    few.parent.mkdir(parents=True, exist_ok=True)
    with open(p.train_prompts, encoding="utf-8") as f:
        few.write_text("".join(line for _, line in zip(range(16), f, strict=False)))
    scratch = p.root / "logs" / "kernels-ahead"  # (named, never written: a dry run writes nothing)
    return Background("stages.extract", *extract_args(cfg, p, few, scratch / "tokens", scratch / "hidden", dev),
                      "--dry_run=1", log_file=p.root / "logs" / "kernels-ahead.log")


def derived(settings: dict) -> bool:
    """Whether an arm's cache is the base cache's states in another encoding or projected (and nothing else)."""
    return set(settings) <= {"quant", "project_dims", "project_rows"} and (
        settings.get("quant", "bf16") != "bf16" or str(settings.get("project_dims", "0")) != "0")


def train_args(cfg: TestbedConfig, run: Path, cache: Path, seed: int, settings: dict) -> list[str]:
    """stages.train's arguments for one drafter (but --resume)."""
    args = [f"--recipe={cfg.drafter_recipe}", f"--cache={cache}", f"--run={run}", f"--seed={seed}"]
    if cfg.train_steps:
        args.append(f"--steps={cfg.train_steps}")
    return args + [f"--{kv}" for kv in cfg.train_args.split()] + [f"--{k}={v}" for k, v in sorted(settings.items())]


def job_identity(cfg: TestbedConfig, p: Paths, j: Job) -> dict:
    """What a drafter is made from: its training arguments and recipe, its cache (key), the evaluation's prompts and
    budget, the drafter code (`RUN/testbed-job.json`; a run made from anything else is stale)."""
    return {"train": train_args(cfg, j.run, j.cache, j.seed, j.settings),
            "recipe_sha256": sha256_file(cfg.drafter_recipe),
            "cache_key": read_manifest(j.cache)["key"] if has_manifest(j.cache) else None,
            "eval": {"prompts_sha256": sha256_file(p.eval_prompts) if p.eval_prompts.is_file() else None,
                     "num_prompts": cfg.eval_prompts, "max_new_tokens": cfg.eval_tokens},
            "code_sha256": drafter_code_digest()}


def fresh_run(cfg: TestbedConfig, p: Paths, j: Job) -> bool:
    """Whether `j.run` holds a drafter made from what `j` asks (True also when it holds none yet); a run made from
    anything else is removed (it is the testbed's own output, under DIR/runs) and said so."""
    why = stale_job(j.run, job_identity(cfg, p, j))
    if why:
        log(f"{j.run}: {why}; made again")
        shutil.rmtree(j.run)
    return not why


def train_export(cfg: TestbedConfig, run: Path, cache: Path, seed: int, settings: dict, env: dict,
                 log_dir: Path | None) -> dict:
    """Train (resumed where it stopped) and export one drafter; returns seconds per phase."""
    logf = (lambda name: log_dir / f"{name}.log") if log_dir else (lambda name: None)
    args = train_args(cfg, run, cache, seed, settings) + [f"--resume={int((run / 'checkpoints').is_dir())}"]
    if cfg.resident:  # (not in the job's identity: the same batches, so the same drafter)
        args.append(RESIDENT)
    train = stage("stages.train", *args, log_file=logf("train"), env=env,
                  worker=TRAIN_WORKERS if cfg.train_worker else None)
    return {"train": train, "export": export_here(run, logf("export"))}


def export_here(run: Path, log_file: Path | None) -> float:
    """`stages.export --run=RUN --export=RUN/export --force=1` in this process (CPU work: the weights read, cast and
    written; a process of its own paid 10–15 s of start and imports a drafter on the H200 host); returns seconds."""
    from dflash_offline.export import export

    t0, msg = time.perf_counter(), f"export of {run} stopped"
    try:
        out = export(run, run / "export", force=True)
        msg = f"exported {run} -> {out} ({time.perf_counter() - t0:.1f}s)"
    except Exception as e:
        msg = f"export of {run} failed: {type(e).__name__}: {e}"
        raise RuntimeError(msg + (f" (log: {log_file})" if log_file else "")) from e
    finally:
        if log_file is not None:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            log_file.write_text(msg + "\n")
        else:
            log(msg)
    return time.perf_counter() - t0


THINKING = "on"  # the regenerations' --thinking (the corpus's answers, so the evaluation prompts, render with it)


def template(cfg: TestbedConfig) -> dict:
    """The chat template settings the corpus, so the evaluation prompts, are rendered with: the recipe's [tokenize]
    template_kwargs with the enable_thinking the regenerations answered under (`THINKING`)."""
    import tomllib

    from dflash_offline.chat import parse_settings

    given = tomllib.loads(Path(cfg.drafter_recipe).read_text()).get("tokenize", {}).get("template_kwargs", "")
    base = parse_settings(given if isinstance(given, str) else json.dumps(given), "tokenize.template_kwargs")
    return {**base, "enable_thinking": THINKING == "on"}


def decodes_args(cfg: TestbedConfig, p: Paths, dev: str) -> list[str]:
    """What every stages.evaluate of the testbed decodes, and how: its prompts, budget, exact mode, device and the
    target-alone decodes' file (DIR/baseline-<tokens>.json)."""
    return [f"--prompts={p.eval_prompts}", f"--num_prompts={cfg.eval_prompts}", "--dtype=float32", f"--device={dev}",
            f"--max_new_tokens={cfg.eval_tokens}", f"--baseline={p.baseline(cfg.eval_tokens)}"]


def replayed(cfg: TestbedConfig) -> bool:
    """Whether the evaluations replay (`--replay` in an A/B) rather than decode every prompt for real."""
    return cfg.replay and bool(cfg.arms or cfg.sweep)


def timed_prompts(cfg: TestbedConfig) -> int:
    """The evaluation prompts whose target-alone decode the baseline holds token by token (timed): in a replayed A/B
    the check prompts, which each arm's first decodes for real against them; else the untrained drafter's, which it
    decodes for real (a testbed's drafter decodes them all: the others again)."""
    return cfg.check_prompts if replayed(cfg) else cfg.untrained_prompts or cfg.eval_prompts


def baseline_args(cfg: TestbedConfig, p: Paths, dev: str) -> list[str]:
    """stages.evaluate's arguments that make the baseline (`--baseline_only`: no drafter, no run yet) as the untrained
    evaluation would make it, the prompts rendered as the corpus was (`template`): it then reuses it."""
    return [f"--target={p.target}", *decodes_args(cfg, p, dev), "--baseline_only=1",
            f"--timed_alone={timed_prompts(cfg)}", f"--template_kwargs={json.dumps(template(cfg))}"]


def evaluate_args(cfg: TestbedConfig, p: Paths, run: Path, dev: str, untrained: bool, check: int = 0) -> list[str]:
    """stages.evaluate's arguments for `run`'s drafter (its untrained one: `untrained`), `check` prompts decoded for
    real beside the replay."""
    args = [f"--run={run}", *decodes_args(cfg, p, dev), "--tf_batches=2"]
    if replay := replayed(cfg):
        args += ["--replay=1", f"--check_prompts={check}", f"--replay_batch={cfg.replay_batch}"]
    # (the untrained drafter replays or decodes `untrained_prompts` prompts: τ ≈ 1, so each takes a step per token —
    # 64 prompts replayed took 62 s of the GPU beside the first drafter's training on an H100; the baseline it makes
    # still holds every prompt, the check prompts' decoded token by token: each arm's first drafter decodes them for
    # real against those, where it decoded them again itself — ≈ 9 s an arm on the H100 at `4327e15`)
    if not untrained:
        return args + [f"--export={run / 'export'}"]
    timed = [f"--timed_alone={cfg.check_prompts}"] if replay and cfg.check_prompts else []
    return args + ["--untrained=1", f"--spec_prompts={cfg.untrained_prompts}", *timed]


def evaluations_ahead(cfg: TestbedConfig, env: dict) -> None:
    """`EVAL_WORKER` started now with the environment `evaluate` will be given (`env`), unless `eval_worker` is off:
    its imports (torch, transformers, the evaluation's code: `testbed.evalworker`) then run beside the first training
    instead of before the first evaluation (≈ 14 s of a resumed call's on an H100 host)."""
    if cfg.eval_worker:
        EVAL_WORKER.start(env)


def evaluate(cfg: TestbedConfig, p: Paths, run: Path, dev: str, untrained: bool, log_file: Path | None,
             env: dict, check: int = 0) -> float:
    """Speculative decoding of `eval_prompts` held-out prompts in exact mode (exit 1 = not lossless: recorded in the
    run's eval JSON, not fatal here) — in an A/B with `replay`, τ replayed on the target-alone decodes, `check`
    prompts also decoded for real; in `EVAL_WORKER` unless `eval_worker` is off."""
    args = evaluate_args(cfg, p, run, dev, untrained, check)
    out = run / ("eval-untrained.json" if untrained else "eval.json")
    out.unlink(missing_ok=True)  # exit status 1 is "not lossless" and also an uncaught error: the JSON tells them apart
    secs = stage("stages.evaluate", *args, log_file=log_file, env=env, ok=(0, 1),
                 worker=EVAL_WORKER if cfg.eval_worker else None)
    if not out.is_file():
        raise RuntimeError(f"stages.evaluate ... failed without writing {out}" + (f" (log: {log_file})" if log_file else ""))
    return secs
