"""Compiling the drafters' graphs while the testbed's own phases run (`--precompile=1`, a bench switch).

A drafter's first training step compiles its graphs (on a cold H200 ≈ 85 s for the recipe's 7, as long again for each
arm whose settings change them), and nothing else needs the 16 CPUs of the GPU host while the target trains,
regenerates its corpus and is extracted (≈ 360 s). So, once the target's training has fixed its number of steps
(contention after that costs the phase time, not the target's quality), each distinct compiled-graph setting of the
invocation's drafters (`Variant`: an arm's [train] settings but its steps, and its cache's encoding) trains
`WARMUP_STEPS` steps on a **stand-in** of the same shapes: the target's config.json with a random embedding and
lm_head (all the trainer reads of a target) and a fake hidden cache of the arm's encoding, bound to that stand-in
with the real tokenizer's mask token (a constant of the graphs). Inductor's and Triton's on-disk caches, which every
training of the machine shares (`cli.private_compile_caches`), then hold the graphs: the real drafter loads them
(Inductor's graph cache hits, which its training log counts) instead of compiling them. Graphs are keyed on the code,
shapes, dtypes and constants, not on the weights or the data: the CPU test's drafter took 41 s cold, 6 s after a
stand-in of other weights, data, seed and steps.

The variants go in the order the drafters need them, `PARALLEL` at a time, each in a process of its own
(`python -m testbed.precompile`: the training worker's `main`). Those not done when the phases end go on beside the
drafters (on CPUs the training leaves idle; some GPU memory and time): when a drafter is about to train (`before`),
its variant still queued is dropped (the drafter compiles its own graphs), and one being compiled is waited for
(compiling it twice at once would take longer), `WAIT_S` at most. A stand-in that fails, or a start that does, is
logged (DIR/logs/precompile-*.log) and changes nothing but the time. An invocation skips the variants an earlier one
compiled from the same inputs into the same caches in this boot of the machine (`where_compiled`, DIR/precompile/
done.json). The record of what each variant did is
DIR/logs/precompile.json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_offline.cache.fsio import atomic_dir, write_json_atomic
from dflash_offline.devices import usable_cpus

from .commands import Job, log, train_args
from .config import TestbedConfig
from .runs import Paths, slug
from .trainworker import RESIDENT
from .worker import start_child

WARMUP_STEPS = 2  # a stand-in's steps: the first compiles the training's graphs, the second runs them (guards)
WAIT_S = 300.0  # a drafter waits at most this long for its stand-in (a cold compile took 108 s beside the target)
PARALLEL = 2  # stand-ins compiling at once (each with its share of the CPUs but `SPARE_CPUS`)
SPARE_CPUS = 4  # CPUs left to the phase running beside them (the target's training, regeneration, extraction)
STANDIN_SHARDS, STANDIN_ROWS = 2, 4  # a stand-in cache's shards and rows a shard (a drafter step reads batch_rows)
ENCODING_KEYS = ("quant", "project_dims", "layer_ids", "num_draft_layers", "mask_token_id")  # [extract] settings a drafter's graphs see


@dataclass
class Variant:
    """One compiled-graph setting of the invocation's drafters: `train` ([train] settings but steps), `cache` (the
    [extract] settings of its cache that shape what the drafter reads), the runs it is compiled for."""

    key: str
    train: dict
    cache: dict
    runs: list[Path] = field(default_factory=list)
    state: str = "queued"  # queued → running → done | failed; queued → dropped (its drafter came
    # first); earlier: done by an earlier invocation into the same compile caches (`where_compiled`)
    seconds: float = 0.0


def where_compiled(cfg: TestbedConfig, config_text: str, mask_token_id: int) -> dict:
    """What a stand-in was compiled from and into, which an earlier invocation's must match to be skipped: this
    boot of the machine and the compile caches the drafters read (`cli.compile_cache_dirs`; still there), torch's
    version, the drafter code (`drafter_code_digest`), the recipe, the train arguments, row length and residency of
    every drafter, the target's config and mask token (what the graphs are keyed on besides a variant's settings)."""
    import hashlib

    import torch

    from dflash_offline.cache.fsio import sha256_file
    from dflash_offline.cli import compile_cache_dirs

    from .runs import drafter_code_digest

    boot = Path("/proc/sys/kernel/random/boot_id")
    caches = compile_cache_dirs(0)
    text = json.loads(config_text)
    text = text.get("text_config", text)  # (the shapes a stand-in takes from it: its dtype field changes on saving)
    shape = {k: text.get(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers")}
    inputs = json.dumps([sha256_file(cfg.drafter_recipe), cfg.train_args, cfg.recipe_seq_len, cfg.train_steps,
                         cfg.resident, shape, mask_token_id], sort_keys=True)
    return {"boot": boot.read_text().strip() if boot.is_file() else "", "caches": caches, "torch": torch.__version__,
            "code": drafter_code_digest(), "inputs": hashlib.sha256(inputs.encode()).hexdigest()}


def variant_key(train: dict, cache: dict) -> str:
    return json.dumps({"train": {k: v for k, v in train.items() if k != "steps"}, "cache": cache}, sort_keys=True)


def plan(jobs: list[Job], caches: dict[Path, dict]) -> list[Variant]:
    """The distinct variants of `jobs` not yet evaluated, in the order of their first job (`caches`: the arms' caches'
    [extract] settings by path; any other cache is the recipe's)."""
    out: dict[str, Variant] = {}
    for j in jobs:
        if (j.run / "eval.json").is_file():
            continue
        cache = {k: v for k, v in caches.get(j.cache, {}).items() if k in ENCODING_KEYS}
        train = {k: v for k, v in j.settings.items() if k != "steps"}
        key = variant_key(train, cache)
        v = out.setdefault(key, Variant(key, train, cache))
        if j.run not in v.runs:  # (the testbed's own drafter is also an A/B's first)
            v.runs.append(j.run)
    return list(out.values())


class Precompile:
    """The stand-ins of `plan(jobs, caches)`; `start` once the target's config and mask token are known, `before`
    each drafter's training, `stop` when the drafters are done."""

    def __init__(self, cfg: TestbedConfig, p: Paths, jobs: list[Job], caches: dict[Path, dict]):
        self.cfg, self.p, self.root = cfg, p, p.root / "precompile"
        self.variants = plan(jobs, caches)
        self.stamp, self.done_file = {}, self.root / "done.json"
        self.by_run = {r: v for v in self.variants for r in v.runs}
        self.cond, self.done_lock = threading.Condition(), threading.Lock()  # (done.json: one writer at a time)
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping, self.threads, self.cache_locks = False, [], {}
        self.record = p.root / "logs" / "precompile.json"

    def start(self, write_config, mask_token_id: int) -> None:
        """Begin: `write_config(dir)` writes the target's config.json into the stand-in target's directory. Whatever
        goes wrong here is logged and leaves the drafters to compile their own graphs (the testbed goes on)."""
        try:
            self.begin(write_config, mask_token_id)
        except Exception as e:  # noqa: BLE001
            self.not_started(e)

    def start_from(self, target: Path) -> None:
        """`start` with a trained target's config.json and mask token (its phase done by an earlier invocation)."""
        from fixtures import tiny

        try:
            mask = json.loads((target / tiny.SIDECAR).read_text())["mask_token_id"]
        except (OSError, ValueError, KeyError) as e:
            self.not_started(e)
            return
        self.start(lambda d: shutil.copy(target / "config.json", d / "config.json"), mask)

    def not_started(self, e: Exception) -> None:
        log(f"precompile: not started ({type(e).__name__}: {e}); the drafters compile their own graphs")
        with self.cond:
            self.stopping = True

    def done(self) -> dict:
        """{variant key: where it was compiled} of the earlier invocations (none where the record is unreadable)."""
        try:
            return json.loads(self.done_file.read_text()) if self.done_file.is_file() else {}
        except (OSError, ValueError):
            return {}

    def begin(self, write_config, mask_token_id: int) -> None:
        from dflash_offline.config import read_recipe
        from fixtures.fake_cache import fake_target

        config = self.root / "config.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        write_config(self.root)  # (the target's config: part of what a stand-in was compiled from)
        self.stamp = where_compiled(self.cfg, config.read_text(), mask_token_id)
        done = self.done() if Path(self.stamp["caches"]["TORCHINDUCTOR_CACHE_DIR"]).is_dir() else {}
        for v in self.variants:  # (compiled by an earlier invocation into the caches this one's drafters read)
            if done.get(v.key) == self.stamp and v.state == "queued":
                v.state = "earlier"
        if not any(v.state == "queued" for v in self.variants):
            return
        for d in ("target", "caches", "runs"):
            shutil.rmtree(self.root / d, ignore_errors=True)
        target = self.root / "target"
        target.mkdir(parents=True)
        shutil.copy(config, target / "config.json")
        text = json.loads((target / "config.json").read_text())
        text = text.get("text_config", text)
        fake_target(target, text["vocab_size"], text["hidden_size"])
        recipe = read_recipe(self.cfg.drafter_recipe)
        shape = {"target": target, "text": text, "mask": mask_token_id, "extract": recipe.get("extract", {}),
                 "seq_len": self.cfg.recipe_seq_len or int(recipe.get("tokenize", {}).get("seq_len", 2048))}
        queued = sum(v.state == "queued" for v in self.variants)
        log(f"precompiling {queued} drafter graph setting(s) on stand-ins, {PARALLEL} at a time "
            f"(logs: {self.p.root / 'logs'}/precompile-*.log)")
        for _ in range(min(PARALLEL, queued)):
            t = threading.Thread(target=self.serve, args=(shape,), daemon=True)
            t.start()
            self.threads.append(t)

    def take(self) -> Variant | None:
        with self.cond:
            v = next((v for v in self.variants if v.state == "queued"), None)
            if v is None or self.stopping:
                return None
            v.state = "running"
            return v

    def serve(self, shape: dict) -> None:
        while (v := self.take()) is not None:
            t0 = time.perf_counter()
            try:
                ok = self.compile(v, shape)
            except Exception as e:  # noqa: BLE001  (a stand-in changes nothing but the time)
                log(f"precompile {self.label(v)}: failed ({type(e).__name__}: {e})")
                ok = False
            if ok:  # (recorded before it is said done, outside the lock: an fsync)
                try:
                    with self.done_lock:
                        write_json_atomic(self.done_file, {**self.done(), v.key: self.stamp})
                except OSError as e:  # (a later invocation compiles it again: time, not the result)
                    log(f"precompile {self.label(v)}: not recorded in {self.done_file} ({e})")
            with self.cond:
                v.state = "done" if ok else "stopped" if self.stopping else "failed"
                v.seconds = time.perf_counter() - t0
                self.cond.notify_all()
            log(f"precompile {self.label(v)}: {v.state} in {v.seconds:.0f}s")
            self.write()

    def label(self, v: Variant) -> str:
        s = " ".join(f"{k}={x}" for k, x in {**v.cache, **v.train}.items())
        return s or "(recipe)"

    def compile(self, v: Variant, shape: dict) -> bool:
        """One stand-in: its cache (made once per encoding), then `WARMUP_STEPS` steps of the variant's training."""
        ext = {**shape["extract"], **v.cache}
        name = slug(" ".join(f"{k}={x}" for k, x in sorted(v.cache.items()))) or "recipe"
        cache = self.root / "caches" / name
        with self.cond:
            lock = self.cache_locks.setdefault(name, threading.Lock())
        with lock:  # (two variants on one encoding: one makes it, the other waits)
            self.standin_cache(cache, ext, shape)
        run = self.root / "runs" / str(self.variants.index(v))
        shutil.rmtree(run, ignore_errors=True)
        args = [a for a in train_args(self.cfg, run, cache, self.cfg.seed, v.train) if not a.startswith("--steps=")]
        args += [f"--steps={WARMUP_STEPS}", "--resume=0"] + ([RESIDENT] if self.cfg.resident else [])
        threads = max(1, (usable_cpus() - SPARE_CPUS) // PARALLEL)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_COMPILE_THREADS": str(threads)}
        logf = self.p.root / "logs" / f"precompile-{self.variants.index(v)}.log"
        logf.parent.mkdir(parents=True, exist_ok=True)
        with open(logf, "w") as f:
            f.write(f"# {self.label(v)}\n")
            f.flush()
            with self.cond:
                if self.stopping:
                    return False
                proc = self.procs[v.key] = start_child([sys.executable, "-m", "testbed.precompile", *args],
                                                       env=env, stdout=f, stderr=subprocess.STDOUT)
            rc = proc.wait()
        shutil.rmtree(run, ignore_errors=True)  # (its checkpoint: nothing reads it)
        return rc == 0

    def standin_cache(self, cache: Path, ext: dict, shape: dict) -> None:
        """A fake hidden cache of the encoding `ext` ([extract] settings) at the testbed's shapes, bound to the
        stand-in target, unless made already."""
        from dflash_offline.target import default_layer_ids
        from fixtures.fake_cache import bind_to_target, make_fake_cache

        if (cache / "manifest.json").is_file():
            return
        text = shape["text"]
        layers = ext.get("layer_ids") or default_layer_ids(text["num_hidden_layers"],
                                                           int(ext.get("num_draft_layers", 5)))
        if isinstance(layers, str):
            layers = [int(x) for x in layers.split(",")]
        with atomic_dir(cache) as tmp:  # (published when complete: a stand-in cache is complete or absent)
            make_fake_cache(tmp, STANDIN_SHARDS, STANDIN_ROWS, shape["seq_len"], text["hidden_size"], layers,
                            quant=ext.get("quant", "bf16"), project_dims=int(ext.get("project_dims", 0)))
            bind_to_target(tmp, shape["target"], text["num_hidden_layers"], text["vocab_size"],
                           int(ext.get("mask_token_id", shape["mask"])))

    def compiled(self, run: Path) -> bool:
        """Whether `run`'s graphs are in the compile caches: its stand-in done, here or by an earlier invocation."""
        with self.cond:
            v = self.by_run.get(run)
            return v is not None and v.state in ("done", "earlier")

    def before(self, run: Path) -> float:
        """Before `run`'s drafter trains: drop its variant if still queued, wait for it while it compiles; returns
        the seconds waited."""
        v, t0 = self.by_run.get(run), time.perf_counter()
        if v is None:
            return 0.0
        with self.cond:
            if v.state == "queued":
                v.state = "dropped"
            while v.state == "running" and time.perf_counter() - t0 < WAIT_S:
                self.cond.wait(1.0)
            if v.state == "running":  # (hung, or far slower than a compile: the drafter compiles its own)
                log(f"precompile {self.label(v)}: still compiling after {WAIT_S:.0f}s; stopped, its drafter compiles")
                if (proc := self.procs.get(v.key)) is not None and proc.poll() is None:
                    proc.terminate()
        return time.perf_counter() - t0

    def stop(self) -> None:
        """No further stand-in; the running ones ended (their graphs are no drafter's any more)."""
        with self.cond:
            self.stopping = True
            for v in self.variants:
                if v.state == "queued":
                    v.state = "dropped"
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.terminate()
        for t in self.threads:
            t.join(timeout=30)
        self.write()

    def write(self) -> None:
        with self.cond:
            rec = [{"variant": self.label(v), "state": v.state, "seconds": round(v.seconds, 1),
                    "runs": [str(r.relative_to(self.p.root)) for r in v.runs]} for v in self.variants]
        self.record.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.record, rec)


if __name__ == "__main__":  # one stand-in's training: stages.train's main as the training worker runs it
    from .trainworker import load

    sys.exit(load()(sys.argv[1:]))
