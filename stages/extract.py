"""Stage 1b: run the frozen target once over the packed token shards and commit hidden-state shards.

    python -m stages.extract --recipe=manifests/demo.toml [--target=DIR] [--cache=DIR] [--tokens=DIR] [--shards=3,5-7] ...
    accelerate launch --num_processes N -m stages.extract ...     (one process per GPU; NPROC=N in make)

Order of work: validate the config and the device, read the target's config.json, estimate bytes and refuse if the
disk lacks room (`--allow_overfill=1` starts anyway), check the kernels and time one batch on a small random model of
the target's real widths — all in seconds, before any weight loads (`--dry_run=1` stops there: it prints the storage
plan of `storage.py` — size per encoding, free space, training's read bandwidth, GPU-hours — and a one-line
summary, or the refusal a real run would meet; `extract_plan.py` builds that plan, an `ExtractPlan`) — then load only the
needed layers and extract (`extraction.py`). Every process claims a shard (with a lease) before computing it, so
ranks and machines sharing the cache never compute one twice (`cache/claims.py`); each shard is written temp → fsync → rename and committed to the manifest in the background while the
next one computes (`cache/writer.py`). Rerun = every uncommitted shard; `--shards=` (make SHARD=) redoes exactly those.

The cache is trusted, so a run starts by making it honest: it removes what dead writers left (temp files, claims),
and a committed shard whose file is missing or resized goes back to "to do". `--cache=DIR` of an existing cache
without `--recipe` reruns it from the inputs its manifest records (the repair command that training and verify
print). A run that ends with shards still claimed by another live process says so and exits non-zero, unless
`--wait_claims=1` (ranks of one job always wait for each other); a dead process's shards are taken over. A failed
write (full disk, I/O error) stops the run with one line; committed shards stay, and nothing is left behind. SIGTERM
(preemption: Slurm, Kubernetes, spot machines) and SIGINT stop it the same way within seconds: the shard being computed
is dropped (it has no file yet) and its claim released, shards already handed to the writer are committed, the status
file says `interrupted`, one line, exit status 143 / 130; a rerun finishes the cache.

Projected taps (`--project_dims=k`, `dflash_offline/projection.py`): once the weights are loaded and before any
shard, a calibration pass runs the same forward on the token cache's first `project_rows` rows, accumulates
E[h hᵀ] of each tapped layer over their real tokens in fp64, and writes its top-k eigenvectors P to
CACHE/projection.safetensors, recorded (SHA-256, retained energy) in the manifest's `projection` block under the
cache's lock: the first process to record one makes it the cache's, and every later run, rank and machine reads that
file (checked) instead of computing its own; other ranks of a job wait for rank 0's. Shards then store h @ P.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from dflash_offline.cache.claims import sweep
from dflash_offline.cache.manifest import open_cache, requeue_missing
from dflash_offline.cli import private_compile_caches, run_cli, unbuffered
from dflash_offline.config import ExtractConfig, TokenizeConfig, as_dict, configs_from_argv, parse_overrides
from dflash_offline.devices import cpu_threads, dist_env, pick_device
from dflash_offline.extract_plan import OVERFILL, ExtractPlan, check_named_corpus, plan_run, recorded_config
from dflash_offline.progress import log
from dflash_offline.storage import plan_lines, recipe_train

# --- config --------------------------------------------------------------------------------------------------


def tokenizer_default(argv: list[str], why: dict):
    """The configs' hook by which the tokenizer follows the target (`targetid.tokenizer_for`): `--tokenizer=` on the
    command line (make ARGS=--tokenizer=DIR) wins; else the target's own, when it holds one; else the recipe's. Why
    goes into `why["tokenizer"]`. (The command line is read when a config is filled, after --help is answered.)"""

    def fill(section: str, values: dict, earlier: dict) -> None:
        from dflash_offline.targetid import tokenizer_for

        given = parse_overrides(argv)[1]
        if section == "tokenize" and not given.get("tokenizer"):
            values["tokenizer"], why["tokenizer"] = tokenizer_for(earlier["extract"].target, values.get("tokenizer", ""),
                                                                  bool(given.get("target")))
    return fill


# --- the run -------------------------------------------------------------------------------------------------


def run(cfg: ExtractConfig, tok_cfg: TokenizeConfig, rank: int = 0, world: int = 1, local_rank: int = 0,
        train=None):
    """Extract every shard to do into the cache; returns its directory (None for a dry run). `train`: the recipe's
    [train] table (a TrainConfig), for the dry run's storage plan (epochs, drafter shape)."""
    import torch

    from dflash_offline import target as tgt
    from dflash_offline.extraction import extract_shards
    from dflash_offline.projection import projection_for

    p = plan_run(cfg, tok_cfg, rank, world, local_rank)
    if cfg.dry_run:
        dry_run_verdict(cfg, p, rank, train)
        return None
    open_cache(p.cache, "hidden", p.key, p.producer,
               {"extract": {**as_dict(cfg), "target": recorded_target(cfg.target),
                            "from_cache": str(Path(cfg.from_cache).resolve()) if cfg.from_cache else ""},
                "tokens_dir": os.path.relpath(p.tokens_dir.resolve(), p.cache.resolve()),
                "mask_token_id": p.mask_token_id, "layer_ids": p.layer_ids},
               num_shards=p.num_shards)
    sweep(p.cache, log=log)
    for b in requeue_missing(p.cache):
        log(f"{p.cache}: shard {b['shard']} was committed but {b['reason']}: it goes back to to-do")
    if not p.todo:
        log(f"{p.cache}: all {p.num_shards} shards already committed and on disk; nothing to do")
        return p.cache
    if cfg.from_cache:  # the states of a bf16 cache of this target and tokens, read instead of computed
        from dflash_offline.derive import CacheStates

        model = CacheStates(cfg.from_cache, p, log)
    else:
        model = tgt.load_target(p.ckpt, p.layer_ids, device=p.device, dtype=getattr(torch, cfg.dtype), mode=cfg.mode)
        log(f"[rank {rank}] weights loaded in {time.time() - p.t0:.1f}s")
    try:
        projection = projection_for(cfg, p, model, rank) if cfg.project_dims else None
        extract_shards(cfg, p, model, rank, world, projection)
    finally:
        if cfg.from_cache:
            model.close()
    return p.cache


def dry_run_verdict(cfg: ExtractConfig, p: ExtractPlan, rank: int, train) -> None:
    """The storage plan (rank 0), then the refusal a real run would meet, or one line: what it would do."""
    for line in plan_lines(cfg, p, train) if rank == 0 else []:
        log(line)
    if p.refusal and not cfg.allow_overfill:
        raise ValueError(f"dry run: a real run would be refused: {p.refusal}; {OVERFILL}")
    eta = "" if p.minutes is None else f"~{p.minutes:.1f} min for this process, "
    log(f"[rank {rank}] dry run ok: {len(p.todo)}/{p.num_shards} shards to do, {p.need / 1e9:.2f} GB, "
        f"{eta}kernels {p.kernels}; no weights loaded, nothing written")




# --- command line --------------------------------------------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """SIGTERM (Slurm, Kubernetes, spot preemption) or SIGINT (Ctrl-C) arrived: the run stops, keeping what it
    committed and releasing what it claimed (a KeyboardInterrupt, so that no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def recorded_target(target: str) -> str:
    """The target as the manifest records it for training, verify and the repair command: a local directory by its
    absolute path (a relative one would name another directory, or none, from elsewhere); a hub id as given."""
    return str(Path(target).resolve()) if target and Path(target).is_dir() else target


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM and SIGINT raise `Interrupted` in the main thread; later ones are only logged, so that the cleanup
    they started (writes drained, claims released, status written) is not cut short."""

    def stopping(signum, frame):  # (os.write: a print here could re-enter a print the signal interrupted)
        with contextlib.suppress(OSError):  # (stderr a pipe whose reader is gone: the stop goes on)
            os.write(2, f"{signal.Signals(signum).name}: already stopping (releasing claims, finishing shard "
                        f"writes)\n".encode())

    def stop(signum, frame):
        for s in old:
            signal.signal(s, stopping)
        raise Interrupted(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def main(argv: list[str]) -> int:
    """The command line; on SIGTERM / SIGINT one line and exit status 143 / 130 (128 + the signal)."""
    try:
        with stop_on_signals():
            extract_main(argv)
    except Interrupted as e:
        print(f"error: stopped by {e}: committed shards are kept, the shard in progress was dropped (no partial "
              f"file) and its claim released; rerun the same command to finish the cache", file=sys.stderr, flush=True)
        return 128 + e.signum
    return 0


def extract_main(argv: list[str]) -> None:
    rank, world, local_rank = dist_env()
    private_compile_caches(rank)
    unbuffered()
    recorded, train, why = recorded_config(argv), None, {}
    if recorded is not None:
        cfg, tok_cfg = recorded, None
        log(f"{cfg.cache}: an existing cache and no recipe: rerunning it with the inputs its manifest records "
            f"(target {cfg.target}, tokens {cfg.tokens})")
    else:
        cfg, tok_cfg = configs_from_argv([(ExtractConfig, "extract"), (TokenizeConfig, "tokenize")], argv, __doc__,
                                         defaults=tokenizer_default(argv, why))
        train = recipe_train(parse_overrides(argv)[0]) if cfg.dry_run else None
        if cfg.tokens and any(a.startswith("--corpus=") and a != "--corpus=" for a in argv):
            check_named_corpus(Path(cfg.tokens), tok_cfg)
        if not cfg.tokens and rank == 0:
            log(f"tokenizer: {tok_cfg.tokenizer} ({why.get('tokenizer', 'named by --tokenizer')})")
    cpu_threads(pick_device(cfg.device, "extract.device", local_rank), log=log)
    out = run(cfg, tok_cfg, rank, world, local_rank, train)
    if out is not None and rank == 0:
        print(out)


if __name__ == "__main__":
    run_cli(main)
