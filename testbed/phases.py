"""The testbed's phases (`testbed`, see `testbed.cli`): target, regen, extract, then train, export and eval of the
testbed's own drafter (in an A/B, its first drafter: `own_drafter`; the arms' drafters beside it: `testbed.scheduler`),
each skipped when DIR/state.json records it done."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dflash_offline.cache.fsio import atomic_dir
from dflash_offline.cache.manifest import read_manifest

from .commands import THINKING, Background, Job, Stopped, extract, job_identity, kernels_ahead, log, stage
from .config import TestbedConfig
from .precompile import Precompile
from .runs import (
    PHASES,
    Paths,
    choose_eval_prompts,
    eval_summary,
    forget_from,
    looping_share,
    read_state,
    recorded_seconds,
    result,
    run_metrics,
    stale_job,
    write_state,
)
from .scheduler import Ahead, run_drafters

KERNELS_WAIT_S = 180  # how long the extraction waits at most for the kernel check run ahead (≈ 45 s cold)


def free_device_memory() -> None:
    """Give back what this process's in-process phases cached on the GPU (the drafters' processes need it), and say
    what stays held here."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        log(f"GPU memory this process still holds: {torch.cuda.memory_reserved() / 2**30:.2f} GB reserved")


def build(cfg: TestbedConfig, p: Paths, device, planned=None) -> dict:
    """Phase 1: sources → corpora, tokenizer, trained target (into a temporary sibling, renamed when complete);
    `planned` as `target.build_target`'s."""
    from fixtures import tiny

    from . import sources, target

    files = sources.select(cfg.packages, cfg.source_mb << 20, cfg.heldout_every)
    s = files.summary()
    log(f"sources: {s['train_files']} training files ({s['train_bytes'] / 1e6:.1f} MB), {s['heldout_files']} "
        f"held out; file list {files.digest[:12]}")
    by_hash = sorted(files.train, key=lambda f: sources.name_hash(f.name))
    n = sources.write_jsonl(p.train_prompts, sources.records(by_hash[: cfg.regen_docs * 2], first_only=True))
    held = sorted(files.heldout, key=lambda f: sources.name_hash(f.name))
    m = sources.write_jsonl(p.eval_candidates, sources.records(held, first_only=True))
    if m < cfg.eval_prompts:
        raise ValueError(f"only {m} held-out prompts for eval_prompts={cfg.eval_prompts}: lower heldout_every")
    dims = tiny.TINY_DIMS if cfg.dims == "tiny" else target.DIMS
    with atomic_dir(p.target) as tmp:  # published onto DIR/target when complete, removed when not
        rec = target.build_target(tmp, files, dims=dims, vocab=cfg.vocab, tokenizer_bytes=cfg.tokenizer_mb << 20,
                                  seq_len=cfg.target_rows, batch=cfg.target_batch,
                                  micro_batch=cfg.target_micro_batch, lr=cfg.target_lr,
                                  budget_s=cfg.target_s, max_steps=cfg.target_steps, seed=cfg.seed, device=device,
                                  log=log, planned=planned)
        (tmp / "files.json").write_text(json.dumps({**s, "files": [[f.name, f.sha256]
                                                                  for f in files.train + files.heldout]}))
    return {**rec, "sources": {k: v for k, v in s.items() if k != "roots"}, "regen_prompts": n, "eval_prompts": m}


def answer_candidates(cfg: TestbedConfig, p: Paths, dev: str) -> Background:
    """The evaluation prompts' candidates answered, started beside the corpus's regeneration (`chosen_prompts` waits
    for it): the first `eval_candidates` × `eval_prompts` held-out openings answered greedily by the target (the
    evaluation's budget of new tokens). A process of its own, so that its start and the target's loading (≈ 20 s of
    an H100 host after the corpus's, `4327e15`) and its decoding run beside the corpus's (not timed on a GPU yet)."""
    n = cfg.eval_candidates * cfg.eval_prompts
    return Background("stages.regen", f"--target={p.target}", f"--corpus={p.eval_candidates}", f"--out={p.eval_greedy}",
                      f"--num_docs={n}", f"--max_new_tokens={cfg.eval_tokens}", f"--batch_size={cfg.regen_batch}",
                      f"--thinking={THINKING}", "--on_empty=keep", f"--device={dev}", "--progress=0",
                      log_file=p.root / "logs" / "regen-eval-candidates.log")


def chosen_prompts(cfg: TestbedConfig, p: Paths, greedy: Background) -> dict:
    """Once `greedy` (`answer_candidates`) ended, the first `eval_prompts` candidates whose answer does not loop, taken
    (`choose_eval_prompts`); with that regeneration's timeline."""
    secs = greedy.wait()
    chosen = choose_eval_prompts(p.eval_candidates, p.eval_greedy, p.eval_prompts, cfg.eval_prompts, cfg.eval_tokens,
                                 cfg.untrained_prompts)
    log(f"evaluation prompts: {chosen['chosen']} of {chosen['candidates']} held-out openings, whose greedy answers "
        f"loop in {100 * chosen['candidates_looping']:.0f} % and stop short in {100 * chosen['candidates_short']:.0f} % "
        f"({chosen['chosen_looping']} looping and {chosen['chosen_short']} short among those chosen; their "
        f"regeneration took {secs:.0f}s beside the corpus's)")
    return {**chosen, "seconds": round(secs, 1), "start": greedy.started, "end": greedy.ended}


def projection_summary(cache: Path) -> dict:
    """Per k: the least energy a top-k projection keeps, and the most it loses on held-out rows, over the taps
    (`projection.measure_taps`, as `bench.projection` reports it: two calibration shards, the last shard held out)."""
    from dflash_offline.dataset import open_hidden_cache
    from dflash_offline.projection import measure_taps

    info = open_hidden_cache(cache, read_manifest(cache)["producer"]["layer_ids"])
    r = measure_taps(info, [16, 32, 64, 128, 256], calib_shards=2, max_rows=64)
    layers = list(r["layers"].values())
    return {k: {"kept_min": min(x["retained"][k] for x in layers),
                "heldout_lost_max": max(x["heldout_loss"].get(k, 0.0) for x in layers)} for k in layers[0]["retained"]}


def recipe_job(cfg: TestbedConfig, p: Paths) -> Job:
    """The recipe's drafter of the testbed's seed on its cache (`runs/base/seed<seed>`)."""
    return Job("", p.run("", cfg.seed), p.hidden(), cfg.seed, {})


def own_drafter(cfg: TestbedConfig, p: Paths, more: list[Job]) -> Job:
    """The drafter the testbed's train/export/eval phases stand for when they are still to do: in an A/B, its first
    drafter (the first arm's first seed, `ab.arm_seeds`) — on the first arm's cache, the testbed's or one of its
    own — so that none trains for the testbed alone; else the recipe's."""
    return more[0] if more else recipe_job(cfg, p)


def recorded_job(cfg: TestbedConfig, p: Paths, ph: dict) -> Job:
    """The drafter the recorded eval phase stands for (`own_drafter`'s job, as `testbed` recorded it, on the cache it
    records — the testbed's where it names none; the recipe's where the record names no job)."""
    rec = ph.get("eval", {})
    if "job" not in rec:
        return recipe_job(cfg, p)
    j = rec["job"]
    cache = p.root / j["cache"] if "cache" in j else p.hidden()
    return Job(j["arm"], p.root / rec["run"], cache, j["seed"], j["settings"])


def recorded_stale(cfg: TestbedConfig, p: Paths, job: Job, more: list[Job]) -> str | None:
    """Why the testbed's recorded drafter (`job`) no longer stands for this invocation: its run is gone, it is an A/B
    arm's while no arm is asked for (a testbed alone reports the recipe's drafter), or it was made from other
    settings, cache, prompts or code than its job asks now; None when it still stands."""
    if not job.run.is_dir():
        return "its run is gone"
    if job.arm and not more:
        return f"it is the A/B arm {job.arm}'s and a testbed without arms reports the recipe's"
    return stale_job(job.run, job_identity(cfg, p, job))


def testbed(cfg: TestbedConfig, p: Paths, dev: str, device, more: list[Job] = (), parallel: int = 1,
            caches: dict | None = None) -> tuple[dict, dict]:
    """Phases 1–6, each skipped when state.json says it is done; `more` drafters (A/B arms, on caches extracted
    first: `caches` = {name: [extract] settings}) train beside the base one; with `precompile`, their graphs compile
    on stand-ins beside the phases (`testbed.precompile`). Returns (result record, {run: seconds per phase})."""
    st = read_state(p)
    if cfg.from_phase:
        forget_from(p, st, cfg.from_phase)
    ph = st["phases"]
    if earlier := [n for n in PHASES if n in ph]:
        log(f"done earlier ({p.state}): {', '.join(earlier)}; --from_phase= (TESTBED_FROM=) redoes one and the later")

    pre = None
    args = cfg.train_args.split()
    compiled = "compile=on" in args or getattr(device, "type", None) == "cuda" and "compile=off" not in args
    if (cfg.precompile == "on" or cfg.precompile == "auto" and compiled) and \
            not ("eval" in ph and all((j.run / "eval.json").is_file() for j in more)):
        pre = Precompile(cfg, p, [own_drafter(cfg, p, list(more)), *more],
                         {p.hidden(name): settings for name, settings in (caches or {}).items()})
        if "target" in ph:  # (its config and mask token are the trained target's)
            pre.start_from(p.target)
    try:
        return phases(cfg, p, dev, device, st, more, parallel, caches, pre)
    finally:
        if pre is not None:
            pre.stop()


def phases(cfg: TestbedConfig, p: Paths, dev: str, device, st: dict, more: list[Job], parallel: int,
           caches: dict | None, pre: Precompile | None) -> tuple[dict, dict]:
    """`testbed`'s phases from `st` (DIR/state.json) on, the stand-ins of `pre` compiling beside them."""
    ph = st["phases"]

    def done(name: str, record: dict) -> None:
        ph[name] = record
        write_state(p, st)
        log(f"phase {name} done in {record.get('seconds', 0):.0f}s")

    if "target" not in ph:
        t0 = time.perf_counter()
        rec = build(cfg, p, device, pre and pre.start)
        free_device_memory()  # (the drafters' processes need what the target's training held in this one)
        done("target", {**rec, "seconds": time.perf_counter() - t0})
    kernels = None
    if "regen" not in ph:
        t0, greedy = time.perf_counter(), answer_candidates(cfg, p, dev)
        if cfg.kernels_ahead == "on" or cfg.kernels_ahead == "auto" and dev == "cuda":
            kernels = kernels_ahead(cfg, p, dev)
        try:
            start = time.time()
            secs = stage("stages.regen", f"--target={p.target}", f"--corpus={p.train_prompts}", f"--out={p.regen}",
                         f"--num_docs={cfg.regen_docs}", f"--max_new_tokens={cfg.regen_tokens}",
                         f"--batch_size={cfg.regen_batch}", f"--thinking={THINKING}", f"--device={dev}",
                         f"--temperature={cfg.regen_temperature}", f"--top_p={cfg.regen_top_p}", f"--seed={cfg.seed}")
            corpus = {"start": start, "end": time.time()}
            chosen = chosen_prompts(cfg, p, greedy)
            stats = json.loads(Path(str(p.regen) + ".stats.json").read_text())
            done("regen", {"seconds": time.perf_counter() - t0, "corpus_seconds": secs, "corpus": corpus,
                           **{k: stats.get(k) for k in ("written", "new_tokens", "truncated")},
                           "looping_frac": looping_share(p.regen), "sampling": stats["config"].get("sampling"),
                           "eval_prompts": chosen})
        except BaseException:
            if kernels is not None:
                kernels.stop()
            raise
        finally:
            greedy.stop()  # (the corpus's regeneration failed or was interrupted: the other ends with it)
    if kernels is not None:
        kernel_check_ahead(kernels)
    ahead = Ahead(cfg, p, dev, parallel) if cfg.ahead and "extract" not in ph else None
    try:
        return drafters(cfg, p, dev, st, more, parallel, caches, pre, ahead, done)
    finally:
        if ahead is not None:
            ahead.stop()  # (the workers, and the target-alone decodes, where the extraction or a drafter failed)


def kernel_check_ahead(kernels: Background) -> None:
    """Wait for the kernel check run ahead (`commands.kernels_ahead`) before the extraction's own, which then finds its
    kernels compiled; one that failed or hangs costs only time (its log says why)."""
    try:
        kernels.wait(timeout=KERNELS_WAIT_S)
        log(f"kernel check ahead: done in {kernels.seconds:.0f}s, beside the regeneration (log: {kernels.log_file})")
    except Exception as e:  # noqa: BLE001
        kernels.stop()
        log(f"kernel check ahead: {e}; the extraction checks its kernels itself")


def drafters(cfg: TestbedConfig, p: Paths, dev: str, st: dict, more: list[Job], parallel: int, caches: dict | None,
             pre: Precompile | None, ahead: Ahead | None, done) -> tuple[dict, dict]:
    """`phases` from the extraction on: the testbed's cache, then its drafter and `more` (the A/B's), `ahead` (the
    workers and the target-alone decodes, started beside the extraction) handed to them."""
    ph = st["phases"]
    if "extract" not in ph:
        start = time.time()
        secs = extract(cfg, p, {}, "", dev)
        m = read_manifest(p.hidden())
        rows = sum(s["rows"] for s in m["shards"])
        seq = m["producer"]["tokens"]["producer"]["seq_len"]
        done("extract", {"seconds": secs, "rows": rows, "tokens": rows * seq, "tok_per_s_wall": rows * seq / secs,
                         "layer_ids": m["config"].get("layer_ids"), "projection": projection_summary(p.hidden()),
                         "start": start, "end": time.time()})
        free_device_memory()
    if "eval" in ph and (why := recorded_stale(cfg, p, recorded := recorded_job(cfg, p, ph), list(more))):
        log(f"the testbed's drafter {recorded.run}: {why}: its phases are done again")
        for name in ("train", "export", "eval"):
            ph.pop(name, None)
        write_state(p, st)
    base = own_drafter(cfg, p, list(more))
    run = base.run
    jobs = ([] if "eval" in ph else [base]) + \
        [j for j in more if j.run != run or "eval" in ph]
    times = {}
    if jobs:
        times = run_drafters(cfg, p, dev, jobs, parallel, None if "eval" in ph else run, stream=not more,
                             caches={p.hidden(name): settings for name, settings in (caches or {}).items()},
                             precompile=pre, ahead=ahead)
        if "eval" not in ph and "deferred" in times.get(run, {}):
            raise Stopped(f"stopped before the testbed's drafter ({run}): --stop_after_s={cfg.stop_after_s:g} would "
                          f"end before it; a rerun resumes")
        if "eval" not in ph:  # (a rerun after an interruption finds the base drafter done: its recorded seconds)
            t, m = {**recorded_seconds(run), **times[run]}, run_metrics(run)
            ph["train"] = {"seconds": t.get("train", 0.0), "steps": m.get("step"), "loss": m.get("loss"),
                           "tok_per_s": m.get("tok_per_s"), "acc": m.get("acc")}
            ph["export"] = {"seconds": t.get("export", 0.0)}
            done("eval", {"seconds": t.get("eval_wall", 0.0), "run": str(run.relative_to(p.root)),
                          "job": {"arm": base.arm, "seed": base.seed, "settings": base.settings,
                                  "cache": str(base.cache.relative_to(p.root))},
                          "untrained_seconds": t.get("untrained"),
                          "baseline_ahead": ahead.timeline() if ahead is not None else None,
                          "trained": eval_summary(run / "eval.json"),
                          "untrained": eval_summary(run / "eval-untrained.json")})
    return result(cfg, p, st), times
