"""The GPU quality yardstick: a realistic target trained from real text, the whole pipeline, real τ as the measure.

    python -m stages.testbed [--dir=build/testbed] [--from_phase=train]          (make testbed [TESTBED_FROM=train])
    python -m stages.testbed --arms="gamma=5;num_anchors=256" --seeds=2           (make testbed-ab ARGS_A= ARGS_B=)
    python -m stages.testbed --sweep=options[,encodings,fp8]                      (make testbed-sweep [SWEEP=])

Phases, each skipped when already done (a rerun resumes; `--from_phase` redoes that phase and every later one):
1. `target`: the Python sources of this interpreter and its packages (`dflash_offline.pysource`: deterministic
   selection, held-out files disjoint by name hash, the file list's digest part of the testbed's identity), a BPE
   tokenizer trained on them and a ~120M-parameter Qwen3.5-architecture target trained from scratch for
   `target_s` seconds (`dflash_offline.testbed`), written to DIR/target like a real checkpoint.
2. `regen`: "continue this file" prompts (a training file's first lines) answered by the target (make regen:
   greedy, batched).
3. `extract`: token cache + hidden cache of the regenerated corpus (manifests/testbed.toml).
4. `train` → `export` → `eval`: the drafter (the recipe's [train], compiled flex on CUDA), its z-lab export, and
   real speculative decoding on `eval_prompts` held-out prompts in exact mode (float32: any difference from the
   target's greedy output fails); an untrained drafter of the same shape is evaluated on the same prompts while
   the drafter trains (it needs only the run's config).
The target-alone decodes are made once, by that untrained evaluation (DIR/baseline-<tokens>.json), and reused by
every evaluation against the same target.
Result: DIR/testbed.json and a table (target loss, regen tokens, extraction tok/s, drafter steps and tok/s, τ
trained and untrained, acceptance per position, lossless, wall time per phase).

A/B (`--arms`, `;`-separated arms of space-separated `key=value` settings, "" = the recipe as it is): the phases
above run first where not done yet, then each arm's drafter is trained with `--seeds` seeds on the testbed's cache (a setting of [extract], e.g. `quant=fp8`, gives the
arm its own cache extracted from the same target and corpus), exported and evaluated on the same prompts;
reported: τ per seed, τ with the seeds pooled, spread (max − min), final loss, lossless, each arm's difference of
pooled τ to the first arm's and its 95 % interval by a paired bootstrap over the prompts (every seed's tokens and steps
pooled per prompt). A run made from other settings, cache, prompts or drafter code than asked is made again. `--sweep=` runs
the arms of one or more presets (`SWEEPS`): `options`, the existing options (γ, anchors per row, noise, D-PACE, fp8
cache); `encodings`, the cache encodings (fp8, fp4, projected taps alone and with fp8); `fp8`, float8 training
(linears, lm_head, both; the float8 linears on a GPU only). Jobs run `--parallel` at a time, each compiling with its share of the CPUs (their timings then overlap;
τ does not depend on it). Results in DIR/ab/<label>.json (with each job's seconds per phase) and DIR/testbed.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_offline.cache.fsio import atomic_dir, sha256_file, write_json_atomic
from dflash_offline.config import ConfigError, as_dict, check_choice, config_from_argv
from dflash_offline.testbed_ab import (
    ab_table,
    arm_rows,
    check_arms,
    eval_record,
    failed_runs,
    heartbeat,
    judge,
    sweep_results,
)
from dflash_offline.testbed_runs import (
    JOB_FILE,
    PHASES,
    Paths,
    cache_complete,
    choose_eval_prompts,
    drafter_code_digest,
    eval_looping_share,
    eval_summary,
    forget_from,
    looping_share,
    parse_arm,
    read_state,
    result,
    run_metrics,
    slug,
    stale_job,
    table,
    write_state,
)

SWEEPS = {  # --sweep=NAME[,NAME…]: the union of their arms, the recipe first
    "options": ["", "gamma=5", "gamma=inf", "num_anchors=256", "num_anchors=1024", "noise_std=0.05",
                "weighting=dpace", "quant=fp8"],
    "encodings": ["", "quant=fp8", "quant=fp4", "project_dims=384", "project_dims=384 quant=fp8",
                  "project_dims=192 quant=fp8"],
    "fp8": ["", "precision=fp8", "loss_logits=fp8", "precision=fp8 loss_logits=fp8"],
}
JOB_GB = 12  # GPU memory one drafter job of the testbed recipe may take (training, then evaluation)
WARM_WAIT_S = 900  # how long the other drafters wait for the first one's compiled first step at most
PRESETS = {  # sizes: full (make testbed), short (the GPU test, ≤ 2 min), micro (the CPU test: the pipeline's logic)
    "full": {},
    "short": {"source_mb": 16, "tokenizer_mb": 4, "target_s": 25, "regen_docs": 512, "train_steps": 80, "eval_prompts": 16, "eval_tokens": 48},
    "micro": {"packages": [], "source_mb": 2, "tokenizer_mb": 1, "vocab": 1024, "dims": "tiny", "target_rows": 128,
              "target_batch": 4, "target_s": 5, "target_steps": 8, "regen_docs": 12, "regen_tokens": 24,
              "regen_batch": 12, "train_steps": 6, "eval_prompts": 3, "untrained_prompts": 2, "check_prompts": 2, "eval_tokens": 12,
              "recipe_seq_len": 256,
              "train_args": "num_layers=2 num_heads=4 num_kv_heads=2 head_dim=16 num_anchors=16 batch_rows=2 "
                            "log_every=2"},
}


@dataclass
class TestbedConfig:
    dir: str = "build/testbed"  # everything goes here (target, corpora, caches, runs, results)
    from_phase: str = ""  # redo this phase and the later ones: target | regen | extract | train | export | eval
    preset: str = "full"  # full (make testbed) | short (GPU test, ≤ 2 min) | micro (CPU test of the logic)
    drafter_recipe: str = "manifests/testbed.toml"  # tokenize/extract/train settings of the drafter part
    train_args: str = ""  # extra train settings for every drafter (space-separated key=value)
    packages: list[str] = field(default_factory=lambda: ["torch", "transformers", "numpy", "huggingface_hub",
                                                         "accelerate", "pyarrow", "jinja2", "safetensors", "triton"])  # packages whose sources join the standard library's
    source_mb: int = 96  # training source text taken (MB, in name-hash order)
    heldout_every: int = 32  # one file in this many is held out (by name hash)
    tokenizer_mb: int = 24  # source text the BPE is trained on
    vocab: int = 16384  # tokenizer size (BPE + added tokens)
    dims: str = "testbed"  # target shape: testbed (hidden 768, 12 layers) | tiny (the embedded demo's)
    target_rows: int = 1024  # target training row length (tokens)
    target_batch: int = 64  # target training rows per step
    target_lr: float = 1e-3  # target peak learning rate
    target_s: float = 150.0  # target training time budget (seconds; the step count is fitted to it)
    target_steps: int = 4000  # target training steps at most
    regen_docs: int = 4000  # prompts the target answers (the drafter's corpus)
    regen_tokens: int = 192  # new tokens per answer
    regen_batch: int = 512  # prompts per generate call
    regen_temperature: float = 0.8  # the corpus's answers are sampled at this temperature (0 = greedy: a small target's greedy answers loop)
    regen_top_p: float = 0.95  # nucleus mass of that sampling
    eval_candidates: int = 4  # held-out prompts answered greedily per evaluation prompt; the non-looping ones are chosen
    train_steps: int = 0  # drafter steps; 0 = the recipe's
    eval_prompts: int = 64  # held-out prompts evaluated
    eval_tokens: int = 64  # new tokens per prompt
    untrained_prompts: int = 16  # prompts the untrained drafter decodes (τ ≈ 1: every token a verify step); all of them make the baseline
    recipe_seq_len: int = 0  # token row length for the drafter's cache; 0 = the recipe's
    device: str = "auto"  # auto | cuda | cpu
    seed: int = 0  # target build and the first drafter seed
    arms: str = ""  # A/B: arms separated by ';', each space-separated key=value settings ('' = the recipe)
    sweep: str = ""  # A/B presets, comma-separated: options (γ, anchors, noise, D-PACE, fp8 cache) | encodings | fp8
    seeds: int = 2  # A/B: drafter seeds per arm
    parallel: int = 0  # A/B: drafter jobs at once; 0 = 1 (on one GPU, processes take turns: two at once were slower)
    label: str = ""  # A/B: result name (DIR/ab/<label>.json); empty = sweep name or 'ab'
    replay: bool = True  # A/B: τ replayed on the target's greedy outputs (one target forward per prompt, not one or two per step: the same steps); each arm's first drafter also decodes check_prompts for real
    check_prompts: int = 8  # A/B with replay: prompts each arm's first drafter also decodes for real (lossless check, replay = decode checked)
    checks: bool = True  # A/B: add the null arm (the recipe under other seeds) and the known-bad arm (¼ of the steps); rank arms only when both behave
    summarize: bool = False  # A/B: train and evaluate nothing; rank the arms whose every seed is evaluated already (a stopped sweep's) and write the results
    results: str = ""  # A/B: also write the sweep's verdicts here (e.g. bench/results/testbed-sweep-h200.json)

    def resolve(self) -> TestbedConfig:
        check_choice("testbed.preset", self.preset, tuple(PRESETS))
        if self.from_phase:
            check_choice("testbed.from_phase", self.from_phase, PHASES)
        check_choice("testbed.dims", self.dims, ("testbed", "tiny"))
        if self.sweep:
            for name in self.sweep.split(","):
                check_choice("testbed.sweep", name, tuple(SWEEPS))
        if self.seeds < 1 or self.eval_prompts < 1 or self.regen_docs < 1 or self.eval_candidates < 1:
            raise ConfigError("testbed.seeds, eval_prompts, eval_candidates and regen_docs must be >= 1")
        return self


def apply_preset(cfg: TestbedConfig, argv: list[str]) -> TestbedConfig:
    """The preset's values for every field the command line did not set."""
    given = {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}
    for k, v in PRESETS[cfg.preset].items():
        if k not in given:
            setattr(cfg, k, v)
    return cfg


# --- running the stages ----------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[testbed {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stage(module: str, *args: str, log_file: Path | None = None, ok=(0,), env: dict | None = None) -> float:
    """Run `python -m module args` (its output streamed, or into `log_file`; `env` added to this environment);
    returns seconds; an exit status not in `ok` stops here (evaluation exits 1 when the lossless check fails:
    recorded in its JSON, not fatal here)."""
    cmd = [sys.executable, "-m", module, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    t0 = time.perf_counter()
    if log_file is None:
        log(" ".join(cmd[2:]))
        rc = subprocess.call(cmd, env=env)
    else:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "w") as f:
            rc = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if rc not in ok:
        where = f" (log: {log_file})" if log_file else ""
        raise RuntimeError(f"{' '.join(cmd[2:4])} ... failed with exit status {rc}{where}")
    return time.perf_counter() - t0


def free_device_memory() -> None:
    """Give back what this process's in-process phases cached on the GPU (the drafters' processes need it), and say
    what stays held here."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        log(f"GPU memory this process still holds: {torch.cuda.memory_reserved() / 2**30:.2f} GB reserved")


# --- the phases ------------------------------------------------------------------------------------------------


def build(cfg: TestbedConfig, p: Paths, device) -> dict:
    """Phase 1: sources → corpora, tokenizer, trained target (into a temporary sibling, renamed when complete)."""
    from dflash_offline import pysource, testbed, tiny

    files = pysource.select(cfg.packages, cfg.source_mb << 20, cfg.heldout_every)
    s = files.summary()
    log(f"sources: {s['train_files']} training files ({s['train_bytes'] / 1e6:.1f} MB), {s['heldout_files']} "
        f"held out; file list {files.digest[:12]}")
    by_hash = sorted(files.train, key=lambda f: pysource.name_hash(f.name))
    n = pysource.write_jsonl(p.train_prompts, pysource.records(by_hash[: cfg.regen_docs * 2], first_only=True))
    held = sorted(files.heldout, key=lambda f: pysource.name_hash(f.name))
    m = pysource.write_jsonl(p.eval_candidates, pysource.records(held, first_only=True))
    if m < cfg.eval_prompts:
        raise ValueError(f"only {m} held-out prompts for eval_prompts={cfg.eval_prompts}: lower heldout_every")
    dims = tiny.TINY_DIMS if cfg.dims == "tiny" else testbed.DIMS
    with atomic_dir(p.target) as tmp:
        rec = testbed.build_target(tmp, files, dims=dims, vocab=cfg.vocab, tokenizer_bytes=cfg.tokenizer_mb << 20,
                                   seq_len=cfg.target_rows, batch=cfg.target_batch, lr=cfg.target_lr,
                                   budget_s=cfg.target_s, max_steps=cfg.target_steps, seed=cfg.seed, device=device,
                                   log=log)
        (tmp / "files.json").write_text(json.dumps({**s, "files": [[f.name, f.sha256] for f in files.train + files.heldout]}))
    return {**rec, "sources": {k: v for k, v in s.items() if k != "roots"}, "regen_prompts": n, "eval_prompts": m}


def choose_prompts(cfg: TestbedConfig, p: Paths, dev: str) -> dict:
    """The evaluation prompts: the first `eval_candidates` × `eval_prompts` held-out openings answered greedily by
    the target (the evaluation's budget of new tokens), the first `eval_prompts` whose answer does not loop taken
    (`choose_eval_prompts`)."""
    n = cfg.eval_candidates * cfg.eval_prompts
    stage("stages.regen", f"--target={p.target}", f"--corpus={p.eval_candidates}", f"--out={p.eval_greedy}",
          f"--num_docs={n}", f"--max_new_tokens={cfg.eval_tokens}", f"--batch_size={cfg.regen_batch}",
          "--thinking=on", "--on_empty=keep", f"--device={dev}", "--progress=0")
    chosen = choose_eval_prompts(p.eval_candidates, p.eval_greedy, p.eval_prompts, cfg.eval_prompts, cfg.eval_tokens)
    log(f"evaluation prompts: {chosen['chosen']} of {chosen['candidates']} held-out openings, whose greedy answers "
        f"loop in {100 * chosen['candidates_looping']:.0f} % and stop short in {100 * chosen['candidates_short']:.0f} % "
        f"({chosen['chosen_looping']} looping and {chosen['chosen_short']} short among those chosen)")
    return chosen


def extract(cfg: TestbedConfig, p: Paths, settings: dict, name: str, dev: str, log_file: Path | None = None) -> float:
    """Token cache (shared) + hidden cache DIR/cache/hidden[-name] with the recipe and `settings` ([extract])."""
    args = [f"--recipe={cfg.drafter_recipe}", f"--corpus={p.regen}", f"--tokenizer={p.target}", f"--target={p.target}",
            f"--out={p.tokens}",
            f"--hidden_out={p.hidden(name)}", f"--device={dev}"]
    if cfg.recipe_seq_len:
        args.append(f"--seq_len={cfg.recipe_seq_len}")
    return stage("stages.extract", *args, *(f"--{k}={v}" for k, v in settings.items()), log_file=log_file)


def train_args(cfg: TestbedConfig, run: Path, cache: Path, seed: int, settings: dict) -> list[str]:
    """stages.train's arguments for one drafter (but --resume)."""
    args = [f"--recipe={cfg.drafter_recipe}", f"--cache={cache}", f"--run={run}", f"--seed={seed}"]
    if cfg.train_steps:
        args.append(f"--steps={cfg.train_steps}")
    return args + [f"--{kv}" for kv in cfg.train_args.split()] + [f"--{k}={v}" for k, v in settings.items()]


def job_identity(cfg: TestbedConfig, p: Paths, j: Job) -> dict:
    """What a drafter is made from: its training arguments and recipe, its cache (key), the evaluation's prompts and
    budget, the drafter code (`RUN/testbed-job.json`; a run made from anything else is stale)."""
    manifest = j.cache / "manifest.json"
    return {"train": train_args(cfg, j.run, j.cache, j.seed, j.settings),
            "recipe_sha256": sha256_file(cfg.drafter_recipe),
            "cache_key": json.loads(manifest.read_text())["key"] if manifest.is_file() else None,
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
    train = stage("stages.train", *args, log_file=logf("train"), env=env)
    export = stage("stages.export", f"--run={run}", f"--out={run / 'export'}", "--force=1", log_file=logf("export"),
                   env=env)
    return {"train": train, "export": export}


def evaluate(cfg: TestbedConfig, p: Paths, run: Path, dev: str, untrained: bool, log_file: Path | None,
             env: dict, check: int = 0) -> float:
    """Speculative decoding of `eval_prompts` held-out prompts in exact mode (exit 1 = not lossless: recorded in the
    run's eval JSON, not fatal here) — in an A/B with `replay`, τ replayed on the target-alone decodes, `check`
    prompts also decoded for real."""
    args = [f"--run={run}", f"--prompts={p.eval_prompts}", f"--num_prompts={cfg.eval_prompts}", "--dtype=float32",
            f"--device={dev}", "--tf_batches=2", f"--max_new_tokens={cfg.eval_tokens}",
            f"--baseline={p.baseline(cfg.eval_tokens)}"]
    replay = cfg.replay and bool(cfg.arms or cfg.sweep)
    if replay:  # the untrained drafter then replays every prompt too
        args += ["--replay=1", f"--check_prompts={check}"]
    args += (["--untrained=1"] + ([] if replay else [f"--spec_prompts={cfg.untrained_prompts}"]) if untrained
             else [f"--export={run / 'export'}"])
    out = run / ("eval-untrained.json" if untrained else "eval.json")
    out.unlink(missing_ok=True)  # exit status 1 is "not lossless" and also an uncaught error: the JSON tells them apart
    secs = stage("stages.evaluate", *args, log_file=log_file, env=env, ok=(0, 1))
    if not out.is_file():
        raise RuntimeError(f"stages.evaluate ... failed without writing {out}" + (f" (log: {log_file})" if log_file else ""))
    return secs


@dataclass
class Job:
    arm: str  # its settings as given ('' = the recipe as it is)
    run: Path
    cache: Path
    seed: int
    settings: dict  # its [train] settings


class Drafters:
    """What `run_drafters` shares between its threads: the settings, the events (the untrained evaluation done or
    failed, each arm cache made), and per run its seconds per phase or its error."""

    def __init__(self, cfg: TestbedConfig, p: Paths, dev: str, jobs: list[Job], parallel: int, base: Path | None,
                 stream: bool, caches: dict | None):
        import threading

        self.cfg, self.p, self.dev, self.base, self.stream, self.caches = cfg, p, dev, base, stream, caches or {}
        self.env = {}
        if parallel > 1 and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
            self.env["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, (os.cpu_count() or 1) // parallel))
        self.ready, self.failed, self.warm = threading.Event(), threading.Event(), threading.Event()
        # the first job compiles alone (all the CPUs), the others start once its first step ran: the same graphs then
        # load from the compile caches it filled instead of 8 processes compiling them at once
        firsts = {}
        for j in jobs:  # each arm's first drafter (the null arm's: the first arm's settings) also decodes for real
            firsts.setdefault(json.dumps(j.settings, sort_keys=True) + str(j.cache), j.run)
        self.checked = set(firsts.values())
        self.leader = jobs[0].run if parallel > 1 and len(jobs) > 1 else None
        if self.leader is None:
            self.warm.set()
        self.times, self.errors, self.retry = {job.run: {} for job in jobs}, {}, []
        self.untrained_log = base / "logs" / "eval-untrained.log" if base else None
        self.made, self.broken = {c: threading.Event() for c in self.caches}, {}

    def untrained(self) -> None:
        """The base run's untrained drafter, evaluated as soon as that run's config.json exists (it makes the
        target-alone decodes every trained evaluation waits for)."""
        base = self.base
        try:
            if base is None or (base / "eval-untrained.json").is_file() and self.p.baseline(
                    self.cfg.eval_tokens).is_file():
                return
            while not (base / "config.json").is_file():  # written when the base run's training starts
                if self.failed.is_set():
                    return
                time.sleep(1)
            log(f"untrained drafter: evaluating (log: {self.untrained_log})")
            self.times[base]["untrained"] = evaluate(self.cfg, self.p, base, self.dev, True, self.untrained_log,
                                                     self.env)
            log(f"untrained drafter: τ {eval_summary(base / 'eval-untrained.json')['tau_mean']:.3f} "
                f"({self.times[base]['untrained']:.0f}s)")
        except BaseException:
            self.failed.set()
            raise
        finally:
            self.ready.set()

    def extract_caches(self) -> None:
        """The arms' caches, one after another; a cache that cannot be made is recorded for its jobs."""
        for c, settings in self.caches.items():
            try:
                if not cache_complete(c):
                    logf = self.p.root / "logs" / f"extract-{c.name}.log"
                    log(f"extracting the cache {c.name} ({' '.join(f'{k}={v}' for k, v in settings.items())}; "
                        f"log: {logf})")
                    secs = extract(self.cfg, self.p, settings, c.name.removeprefix("hidden-"), self.dev, logf)
                    log(f"cache {c.name} extracted ({secs:.0f}s)")
            except Exception as e:  # noqa: BLE001
                self.broken[c] = f"its cache {c} could not be extracted: {e}"
            finally:
                self.made[c].set()

    def job(self, j: Job) -> None:
        """`run_job`; the leading job opens the gate for the others however it ends."""
        try:
            self.run_job(j)
        finally:
            if j.run == self.leader:
                self.warm.set()

    def run_job(self, j: Job) -> None:
        """One drafter: wait for its cache, train and export it, wait for the target-alone decodes, evaluate it —
        unless its run already holds an evaluated drafter made from the same settings, cache, prompts and code."""
        if j.cache in self.made:
            self.made[j.cache].wait()
            if j.cache in self.broken:
                raise RuntimeError(self.broken[j.cache])
        fresh_run(self.cfg, self.p, j)
        if (j.run / "eval.json").is_file():
            self.times[j.run]["reused"] = 1.0
            return
        if j.run != self.leader and not self.warm.is_set():
            t0 = time.perf_counter()
            while not self.warm.wait(1) and not self.failed.is_set() and time.perf_counter() - t0 < WARM_WAIT_S:
                pass
            self.warm.set()  # (after a time-out, the others do not wait again)
            self.times[j.run]["wait_warm"] = time.perf_counter() - t0
        if self.failed.is_set():
            raise RuntimeError("not started: the base drafter or the untrained evaluation failed")
        j.run.mkdir(parents=True, exist_ok=True)
        write_json_atomic(j.run / JOB_FILE, job_identity(self.cfg, self.p, j))
        logs = None if self.stream and j.run == self.base else j.run / "logs"
        log(f"{j.arm or '(recipe)'} seed {j.seed}: training on {j.cache.name}" + (f" (logs: {logs})" if logs else ""))
        env = self.env
        if j.run == self.leader:
            (j.run / "status-rank0.json").unlink(missing_ok=True)  # (a killed run's says it stepped already)
            self.watch_warm_up(j.run)
            env = {**env, **({} if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ else
                             {"TORCHINDUCTOR_COMPILE_THREADS": str(os.cpu_count() or 1)})}
        try:
            self.times[j.run].update(train_export(self.cfg, j.run, j.cache, j.seed, j.settings, env, logs))
        except BaseException:
            if j.run == self.base:
                self.failed.set()
            raise
        finally:
            if j.run == self.leader:
                self.warm.set()  # (the first step never ran, or the training is over)
        t0 = time.perf_counter()
        self.ready.wait()
        if self.failed.is_set():
            raise RuntimeError(f"the untrained drafter's evaluation, which makes the target-alone decodes, failed "
                               f"(log: {self.untrained_log})")
        t = self.times[j.run]
        t["eval"] = evaluate(self.cfg, self.p, j.run, self.dev, False, (logs or j.run / "logs") / "eval.log", self.env,
                             self.cfg.check_prompts if j.run in self.checked else 0)
        t["eval_wall"] = time.perf_counter() - t0  # waiting for the baseline included
        log(f"{j.arm or '(recipe)'} seed {j.seed}: τ {eval_summary(j.run / 'eval.json')['tau_mean']:.3f} ("
            + ", ".join(f"{k} {v:.0f}s" for k, v in t.items()) + ")")

    def watch_warm_up(self, run: Path) -> None:
        """Set `warm` once the leading job's training has taken its first step (its status file says so)."""
        import threading

        t0 = time.time()

        def watch():
            while not self.warm.is_set():
                try:
                    st = json.loads((run / "status-rank0.json").read_text())
                    if st.get("done", 0) >= 1 and st.get("updated_at", 0) >= t0:
                        log(f"{run}: first step compiled; the other drafters start")
                        self.warm.set()
                except (OSError, ValueError):
                    pass
                time.sleep(1)

        threading.Thread(target=watch, daemon=True).start()

    def guarded(self, j: Job, last: bool = False) -> None:
        """`job`, its failure reported while the others go on (one out of GPU memory queued for `retry`)."""
        try:
            self.job(j)
            self.errors.pop(j.run, None)
        except Exception as e:  # noqa: BLE001
            self.errors[j.run] = str(e)
            oom = not last and not self.failed.is_set() and out_of_memory(j.run / "logs")
            if oom:
                self.retry.append(j)
            log(f"{j.arm or '(recipe)'} seed {j.seed}: {'out of GPU memory, tried again later' if oom else 'FAILED'}: {e}")


def run_drafters(cfg: TestbedConfig, p: Paths, dev: str, jobs: list[Job], parallel: int, base: Path | None,
                 stream: bool = False, caches: dict | None = None) -> dict:
    """Train, export and evaluate `jobs` (each skipped when its eval.json exists), `parallel` at a time, while the
    untrained drafter of run `base` (one of them, or None) is evaluated alongside: it waits only for that run's
    config.json, and its decodes of the target alone (DIR/baseline-<tokens>.json) are reused by every trained
    drafter's evaluation, which waits for them. `stream`: the first job's training prints here (else every stage logs
    into RUN/logs/). On a GPU shared by several jobs, each compiles with its share of the CPUs
    (TORCHINDUCTOR_COMPILE_THREADS, unless set). `caches` ({path: [extract] settings}) are extracted one after
    another beside the drafters, each job on one of them waiting for it. A drafter that fails (or whose cache does)
    is logged and recorded (`error`) while the others go on, except that one which ran out of GPU memory is tried
    once more after the others, half as many at a time; when the base run or the untrained evaluation fails, no
    further job starts and that failure raises.
    Returns {run: seconds per phase (train, export, eval, and untrained for `base`), or its error}."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    for j in jobs:  # runs made from other settings or code go before anything reads them (the untrained evaluation
        if j.run == base or cache_complete(j.cache):  # reads the base run's): the others' caches may come later
            fresh_run(cfg, p, j)
    d = Drafters(cfg, p, dev, jobs, parallel, base, stream, caches)
    side = threading.Thread(target=d.untrained, daemon=True)
    side.start()
    threading.Thread(target=d.extract_caches, daemon=True).start()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(d.guarded, jobs))
    if d.retry and not d.failed.is_set():
        log(f"trying again {len(d.retry)} drafter(s) that ran out of GPU memory, {max(1, parallel // 2)} at a time")
        with ThreadPoolExecutor(max(1, parallel // 2)) as pool:
            list(pool.map(lambda j: d.guarded(j, last=True), d.retry))
    side.join()
    if d.failed.is_set() or base in d.errors:
        raise RuntimeError(d.errors.get(base) or f"the untrained drafter's evaluation failed (log: {d.untrained_log})")
    for run, e in d.errors.items():
        d.times[run]["error"] = e
    return d.times


def out_of_memory(logs: Path) -> bool:
    """Whether a stage's log in `logs` ends in a GPU out-of-memory error."""
    return any("out of memory" in f.read_text(errors="replace")[-20000:].lower() for f in logs.glob("*.log"))


GPU_JOBS = 1  # drafter jobs sharing one GPU (see default_parallel)


def default_parallel(device) -> int:
    """Drafter jobs at once on this machine: `GPU_JOBS` per GPU, fewer where CPUs (two per job) or GPU memory (`JOB_GB`
    per job) are short. Processes on one GPU take turns on it (time slices), they do not run side by side, and the
    turns cost: on an H200 (commit 7fd43ec) two drafters training at once ran at ≈ 30K context tok/s each (60K together,
    one alone ≈ 150K; 8 at once: 7.5K each), while one job at a time took ≈ 100 s per drafter from start to its
    evaluation (train, export, replayed evaluation). The arms' cache extraction and the untrained evaluation still run
    beside the first drafter."""
    if device.type != "cuda":
        return 1
    import torch

    return max(1, min(GPU_JOBS, (os.cpu_count() or 2) // 2,
                      int(torch.cuda.get_device_properties(device).total_memory / 2**30 // JOB_GB)))


def projection_summary(cache: Path) -> dict:
    """Per k: the least energy a top-k projection keeps, and the most it loses on held-out rows, over the taps
    (`bench.projection`, two calibration shards, the last shard held out)."""
    from bench import projection

    r = projection.main([f"--cache={cache}", "--ks=16,32,64,128,256", "--calib_shards=2", "--max_rows=64"])
    layers = list(r["layers"].values())
    return {k: {"kept_min": min(x["retained"][k] for x in layers),
                "heldout_lost_max": max(x["heldout_loss"].get(k, 0.0) for x in layers)} for k in layers[0]["retained"]}


def testbed(cfg: TestbedConfig, p: Paths, dev: str, device, more: list[Job] = (), parallel: int = 1,
            caches: dict | None = None) -> tuple[dict, dict]:
    """Phases 1–6, each skipped when state.json says it is done; `more` drafters (A/B arms, on caches extracted
    first: `caches` = {name: [extract] settings}) train beside the base one. Returns (result record, {run: seconds
    per phase})."""
    st = read_state(p)
    if cfg.from_phase:
        forget_from(p, st, cfg.from_phase)
    ph = st["phases"]
    run = p.run("", cfg.seed)
    if earlier := [n for n in PHASES if n in ph]:
        log(f"done earlier ({p.state}): {', '.join(earlier)}; --from_phase= (TESTBED_FROM=) redoes one and the later")

    def done(name: str, record: dict) -> None:
        ph[name] = record
        write_state(p, st)
        log(f"phase {name} done in {record.get('seconds', 0):.0f}s")

    if "target" not in ph:
        t0 = time.perf_counter()
        rec = build(cfg, p, device)
        free_device_memory()  # (the drafters' processes need what the target's training held in this one)
        done("target", {**rec, "seconds": time.perf_counter() - t0})
    if "regen" not in ph:
        secs = stage("stages.regen", f"--target={p.target}", f"--corpus={p.train_prompts}", f"--out={p.regen}",
                     f"--num_docs={cfg.regen_docs}", f"--max_new_tokens={cfg.regen_tokens}",
                     f"--batch_size={cfg.regen_batch}", "--thinking=on", f"--device={dev}",
                     f"--temperature={cfg.regen_temperature}", f"--top_p={cfg.regen_top_p}", f"--seed={cfg.seed}")
        stats = json.loads(Path(str(p.regen) + ".stats.json").read_text())
        t0 = time.perf_counter()
        chosen = choose_prompts(cfg, p, dev)
        done("regen", {"seconds": secs + time.perf_counter() - t0, "corpus_seconds": secs,
                       **{k: stats.get(k) for k in ("written", "new_tokens", "truncated")},
                       "looping_frac": looping_share(p.regen), "sampling": stats["config"].get("sampling"),
                       "eval_prompts": chosen})
    if "extract" not in ph:
        secs = extract(cfg, p, {}, "", dev)
        m = json.loads((p.hidden() / "manifest.json").read_text())
        rows = sum(s["rows"] for s in m["shards"])
        seq = m["producer"]["tokens"]["producer"]["seq_len"]
        done("extract", {"seconds": secs, "rows": rows, "tokens": rows * seq, "tok_per_s_wall": rows * seq / secs,
                         "layer_ids": m["config"].get("layer_ids"), "projection": projection_summary(p.hidden())})
        free_device_memory()
    base = Job("", run, p.hidden(), cfg.seed, {})
    if "eval" in ph and (why := stale_job(run, job_identity(cfg, p, base))):  # other settings or code since
        log(f"the testbed's drafter {run}: {why}: trained again")
        for name in ("train", "export", "eval"):
            ph.pop(name, None)
        write_state(p, st)
    jobs = ([] if "eval" in ph else [base]) + \
        [j for j in more if j.run != run or "eval" in ph]
    times = {}
    if jobs:
        times = run_drafters(cfg, p, dev, jobs, parallel, None if "eval" in ph else run, stream=not more,
                             caches={p.hidden(name): settings for name, settings in (caches or {}).items()})
        if "eval" not in ph:  # (a rerun after an interruption finds the base drafter done: its seconds unknown)
            t, m = times[run], run_metrics(run)
            ph["train"] = {"seconds": t.get("train", 0.0), "steps": m.get("step"), "loss": m.get("loss"),
                           "tok_per_s": m.get("tok_per_s"), "acc": m.get("acc")}
            ph["export"] = {"seconds": t.get("export", 0.0)}
            done("eval", {"seconds": t.get("eval_wall", 0.0),
                          "untrained_seconds": t.get("untrained"), "trained": eval_summary(run / "eval.json"),
                          "untrained": eval_summary(run / "eval-untrained.json")})
    return result(cfg, p, st), times


# --- A/B -------------------------------------------------------------------------------------------------------


def sweep_arms(names: str, cuda: bool) -> list[str]:
    """The arms of the comma-separated presets `names`, each once, in order (the recipe first); without CUDA, not the
    float8 linears (torchao's float8 training needs CUDA)."""
    arms = list(dict.fromkeys(a for name in names.split(",") for a in SWEEPS[name]))
    return arms if cuda else [a for a in arms if "precision=fp8" not in a]


def summary_record(cfg: TestbedConfig, p: Paths) -> tuple[dict, dict]:
    """`--summarize`: the testbed record from what its phases recorded (DIR/state.json), nothing run."""
    ph = read_state(p)["phases"]
    if not ph:
        raise ConfigError(f"testbed.summarize: {p.state} records no phase: nothing to summarize under {p.root}")
    looping = (eval_looping_share(p.baseline(cfg.eval_tokens), p.target) if (p.target / "tokenizer.json").is_file()
               else None)
    base = p.run("", cfg.seed)
    tau = {k: eval_summary(base / f).get("tau_mean") if (base / f).is_file() else None
           for k, f in (("tau_trained", "eval.json"), ("tau_untrained", "eval-untrained.json"))}
    return {"regen": ph.get("regen"), "looping_frac_eval": looping, **tau,
            "seconds": {k: round(v.get("seconds", 0), 1) for k, v in ph.items()}}, {}


def ab(cfg: TestbedConfig, p: Paths, dev: str, device) -> tuple[dict, dict]:
    """Every arm × seed trained, exported and evaluated on the testbed's target and prompts, beside the testbed's own
    phases where they are not done yet (see the module doc); with `checks`, also the null arm (the recipe under the
    next `seeds` seeds) and the known-bad arm (a quarter of the steps), which decide whether the arms are ranked
    (`judge`). Returns (A/B record, testbed record)."""
    arms = sweep_arms(cfg.sweep, device.type == "cuda" or cfg.summarize) if cfg.sweep else [a.strip() for a in cfg.arms.split(";")]
    null, bad = check_arms(cfg, arms[0]) if cfg.checks else (None, None)
    if bad and bad not in arms:
        arms.append(bad)
    parsed = [parse_arm(a) for a in arms]  # every arm checked before anything runs
    if len({slug(a) for a in arms}) < len(arms):
        same = [a or '""' for a in arms if [slug(b) for b in arms].count(slug(a)) > 1]
        raise ConfigError(f"testbed.arms: {', '.join(dict.fromkeys(same))} given twice (the same settings train the "
                          f"same drafters: they would share their runs); to see the noise of one arm, give it more "
                          f"--seeds (SEEDS=) and read its spread")
    key = lambda ext: " ".join(f"{k}={v}" for k, v in sorted(ext.items()))  # noqa: E731
    caches = {slug(key(ext)): ext for ext, _ in parsed if ext}
    seeds = range(cfg.seed, cfg.seed + cfg.seeds)
    jobs = [Job(arm, p.run(slug(arm) if arm else "", seed), p.hidden(slug(key(ext))) if ext else p.hidden(), seed,
                train) for arm, (ext, train) in zip(arms, parsed, strict=True) for seed in seeds]
    if cfg.checks:  # the first arm again, under seeds no arm uses: its runs sit beside that arm's
        first = jobs[0]
        null_jobs = [Job(null, p.run(slug(arms[0]) if arms[0] else "", seed), first.cache, seed, first.settings)
                     for seed in range(cfg.seed + cfg.seeds, cfg.seed + 2 * cfg.seeds)]
        bad_jobs = [j for j in jobs if j.arm == bad]
        # arm-major, the checks right after the first arm: a sweep stopped early has whole arms and its checks (the
        # first arm's cache meanwhile serves while the other arms' caches are extracted)
        jobs = jobs[: cfg.seeds] + null_jobs + bad_jobs + [j for j in jobs[cfg.seeds:] if j.arm != bad]
        arms.append(null)
    parallel = cfg.parallel or default_parallel(device)
    log(f"{len(arms)} arms × {cfg.seeds} seeds = {len(jobs)} drafters, {parallel} at a time"
        + (f" (checks: the null arm {null}, the known-bad arm {bad})" if cfg.checks else ""))
    t0 = time.perf_counter()
    tb, times = summary_record(cfg, p) if cfg.summarize else testbed(cfg, p, dev, device, jobs, parallel, caches)
    complete = [a for a in arms if all((j.run / "eval.json").is_file() for j in jobs if j.arm == a)]
    incomplete = {a or "(recipe)": f"{sum((j.run / 'eval.json').is_file() for j in jobs if j.arm == a)} of "
                  f"{sum(j.arm == a for j in jobs)} drafters evaluated" for a in arms if a not in complete}
    for a, why in incomplete.items():
        log(f"{a}: not ranked, {why}")
    if arms[0] not in complete:
        raise RuntimeError(f"the first arm ({arms[0] or '(recipe)'}) has no evaluation for every seed: nothing to "
                           f"compare with; see the logs under {p.root / 'runs'}")
    rows = arm_rows(complete, {a: [(eval_record(j.run / "eval.json"), run_metrics(j.run).get("loss"))
                                   for j in jobs if j.arm == a] for a in complete})
    judgement = judge(rows, null, bad) if cfg.checks else None
    failed = failed_runs(p.root, times, [j.run for j in jobs if j.arm in complete])
    return {"testbed": str(p.root), "seeds": cfg.seeds, "arms": rows, "judgement": judgement, "failed": failed,
            "incomplete": incomplete,
            "recipe": cfg.drafter_recipe, "seconds": round(time.perf_counter() - t0, 1), "parallel": parallel,
            "job_seconds": {str(r.relative_to(p.root)): {k: v if isinstance(v, str) else round(v, 1)
                                                          for k, v in t.items()} for r, t in times.items()},
            "config": as_dict(cfg), "time": time.time()}, tb


# --- the stage -------------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    from dflash_offline.devices import pick_device

    cfg = apply_preset(config_from_argv(TestbedConfig, "testbed", argv, __doc__), argv).resolve()
    device = pick_device(cfg.device, "testbed.device")
    dev = device.type
    if dev == "cpu" and cfg.preset != "micro" and not cfg.summarize:
        raise ConfigError(f"the {cfg.preset} testbed trains a 124M-parameter target and runs every phase on a GPU; "
                          "this machine has none (--preset=micro runs the phases' logic at toy sizes on a CPU)")
    p = Paths(cfg.dir)
    p.root.mkdir(parents=True, exist_ok=True)
    if cfg.from_phase == "target":
        p.wall.unlink(missing_ok=True)
    if not cfg.summarize:
        heartbeat(p)
    log(f"testbed {p.root} on {device} (preset {cfg.preset}): {json.dumps(asdict(cfg))}")
    if cfg.arms or cfg.sweep:
        r, tb = ab(cfg, p, dev, device)
        out = p.root / "ab" / f"{cfg.label or cfg.sweep.replace(',', '+') or 'ab'}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out, r)
    else:
        tb, _ = testbed(cfg, p, dev, device)
    if not cfg.summarize:
        write_json_atomic(p.root / "testbed.json", tb)
        print(table(tb))
    if cfg.arms or cfg.sweep:
        if cfg.results:
            Path(cfg.results).parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(Path(cfg.results), sweep_results(r, tb, p))
        print(ab_table(r))
        for run, e in r["failed"].items():
            print(f"FAILED {run}: {e}")
        print(out)
        if cfg.results:
            print(cfg.results)
    if not cfg.summarize:
        print(p.root / "testbed.json")
    unranked = (cfg.arms or cfg.sweep) and r["judgement"] is not None and not r["judgement"]["discriminating"]
    return 1 if (cfg.arms or cfg.sweep) and r["failed"] or unranked else 0


if __name__ == "__main__":
    from dflash_offline.progress import run_cli

    run_cli(main)
