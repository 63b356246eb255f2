"""Stage 1b: run the frozen target once over the packed token shards and commit hidden-state shards.

    python -m stages.extract --recipe=manifests/demo.toml [--target=DIR] [--shards=3,5-7] [--dry_run=1] ...
    accelerate launch --num_processes N -m stages.extract ...     (one process per GPU; NPROC=N in make)

Order of work: validate the config and the device, read the target's config.json, estimate bytes and refuse if the
disk lacks room (`--allow_overfill=1` starts anyway), check the kernels and time one batch on a small random model of
the target's real widths — all in seconds, before any weight loads (`--dry_run=1` stops there: it prints the storage
plan of `storage.py` — size per encoding, free space, training's read bandwidth, GPU-hours — and a one-line
summary, or the refusal a real run would meet) — then load only the needed layers and extract. Every process
claims a shard (with a lease) before computing it, so ranks and machines sharing the cache never compute one twice
(`cache/claims.py`); each shard is written temp → fsync → rename and committed to the manifest in the background while the
next one computes (`cache/writer.py`). Rerun = every uncommitted shard; `--shards=` (make SHARD=) redoes exactly those.

The cache is trusted, so a run starts by making it honest: it removes what dead writers left (temp files, claims),
and a committed shard whose file is missing or resized goes back to "to do". `--hidden_out=DIR` of an existing cache
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
import gc
import os
import signal
import socket
import sys
import time
from pathlib import Path

from dflash_offline.cache.claims import claimed_shards, release_held, sweep
from dflash_offline.cache.fsio import worker_info
from dflash_offline.cache.manifest import (
    committed,
    has_manifest,
    missing_files,
    open_cache,
    read_manifest,
    record_once,
    requeue_missing,
)
from dflash_offline.config import (
    ExtractConfig,
    TokenizeConfig,
    as_dict,
    configs_from_argv,
    parse_overrides,
    parse_shard_list,
)
from dflash_offline.devices import cpu_threads, dist_env, pick_device
from dflash_offline.plan import OVERFILL, disk_refusal, free_space, make_plan, recorded_config, target_needs
from dflash_offline.progress import Progress, log, private_compile_caches, run_cli, unbuffered
from dflash_offline.storage import plan_lines, recipe_train, token_bytes_per_token

PROJECTION_WAIT_S = 1800.0  # how long ranks > 0 wait for rank 0 to record the cache's projection

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


# --- plan: everything that can fail, before any weight loads --------------------------------------------------


def token_cache(cfg: ExtractConfig, tok_cfg: TokenizeConfig, rank: int) -> Path | dict:
    """The token cache: given, or made/reused by stage 1a (rank 0 writes it; other ranks wait for it). A dry run
    writes nothing: it gets the manifest stage 1a would leave (read from disk when that cache is complete)."""
    from dflash_offline import tokenization as tokenize

    if cfg.tokens:
        return Path(cfg.tokens)
    if cfg.dry_run:
        return tokenize.dry_run(tok_cfg)
    if rank == 0:
        return tokenize.run(tok_cfg)
    out = tokenize.identify(tok_cfg)[-1]
    while not (has_manifest(out) and read_manifest(out).get("complete")):
        time.sleep(2)
    return out


def check_tokens_fit(ckpt: Path, tokens: Path | dict, rank: int) -> None:
    """Refuse a token cache whose rows are longer than the target's positions or whose ids mean other tokens to the
    target's tokenizer (`targetid`); say what could not be checked. Seconds, before the fingerprint and the weights."""
    from dflash_offline.targetid import check_seq_len, check_tokenizer_fits

    tm = tokens if isinstance(tokens, dict) else read_manifest(tokens)
    label = "(in memory)" if isinstance(tokens, dict) else str(tokens)
    check_seq_len(tm["producer"]["seq_len"], ckpt, f"token cache {label}: seq_len")
    rec = tm.get("tokenizer_vocab")
    if note := check_tokenizer_fits(ckpt, label, rec, (rec or {}).get("path") or tm["config"].get("tokenizer", "?")):
        log(f"[rank {rank}] warning: {note}")


def continued_legacy_cache(cfg: ExtractConfig, plan: dict, rank: int) -> dict:
    """`plan`, or, when the cache this run would go on with was made before weights were hashed in full (its key
    holds the sampled fingerprint, `targetid`), the plan under that cache's key: its shards are kept, not redone in a
    new directory. A cache of the new key, or none of either, leaves the plan as it is."""
    from dflash_offline.cache.fsio import hash_obj
    from dflash_offline.targetid import target_fingerprint

    ours = cache_dir(cfg, plan["key"])
    if not plan["weights"] or has_manifest(ours) and read_manifest(ours)["key"] == plan["key"]:
        return plan
    target = {k: v for k, v in plan["producer"]["target"].items() if k != "weights_hash"}
    target.update(target_fingerprint(plan["ckpt"], scheme="sampled"))
    producer = dict(plan["producer"], target=target)
    key, cache = hash_obj(producer), cache_dir(cfg, hash_obj(producer))
    if not has_manifest(cache) or read_manifest(cache)["key"] != key:
        return plan
    log(f"[rank {rank}] {cache} was made before targets were hashed in full (its key holds the sampled fingerprint of "
        f"the weights): continuing it under that key. Its weights are known by 16 samples a file; extract into a new "
        f"cache (another CACHE=) to have them checked byte for byte")
    return dict(plan, producer=producer, key=key)


def cache_dir(cfg: ExtractConfig, key: str) -> Path:
    return Path(cfg.hidden_out) if cfg.hidden_out else Path(cfg.cache_root) / f"hidden-{key[:12]}"


def plan_run(cfg: ExtractConfig, tok_cfg: TokenizeConfig, rank: int, world: int, local_rank: int) -> dict:
    """The plan plus this run's cache, device, shards to do and the kernel check: everything that can fail before the
    weights load, in seconds (stage 1a runs first when the token cache is not there yet)."""
    import torch

    from dflash_offline import target as tgt
    from dflash_offline.targetid import check_seq_len, resolve_checkpoint

    t0 = time.time()
    ckpt = resolve_checkpoint(cfg.target, target_needs(cfg), "extract.target")  # a wrong path fails before stage 1a
    device = pick_device(cfg.device, "extract.device", local_rank)
    if tok_cfg is not None and not cfg.tokens:
        check_seq_len(tok_cfg.seq_len, ckpt)
    tokens_dir = token_cache(cfg, tok_cfg, rank)
    check_tokens_fit(ckpt, tokens_dir, rank)
    plan = continued_legacy_cache(cfg, make_plan(cfg, tokens_dir), rank)
    cache = cache_dir(cfg, plan["key"])
    redo = parse_shard_list(cfg.shards)
    if any(i >= plan["num_shards"] for i in redo):
        raise ValueError(f"SHARD={cfg.shards}: the cache has shards 0..{plan['num_shards'] - 1}")
    existing = read_manifest(cache) if has_manifest(cache) else None
    done = committed(existing) if existing and existing["key"] == plan["key"] else {}
    damaged = {b["shard"]: b["reason"] for b in missing_files(cache, existing)} if done else {}
    todo = redo or [i for i in range(plan["num_shards"]) if i not in done or i in damaged]
    shard_rows = {s["index"]: s["rows"] for s in plan["tokens_manifest"]["shards"]}
    todo_rows = sum(shard_rows[i] for i in todo)
    need = todo_rows * plan["seq_len"] * plan["bytes_per_token"]
    # a dry run's token cache is in memory: the real run writes it first, mostly on the same filesystem
    token_bytes = sum(shard_rows.values()) * plan["seq_len"] * token_bytes_per_token() if plan[
        "tokens_manifest"].get("dry_run") else 0
    need += token_bytes
    free = free_space(cache)
    refusal = disk_refusal(cache, need, free, cfg.min_free_gb)  # a dry run says so at its end, after its plan
    if refusal and not cfg.dry_run:
        if not cfg.allow_overfill:
            raise ValueError(f"{refusal}; {OVERFILL}")
        log(f"[rank {rank}] warning: {refusal}; starting anyway (allow_overfill=1)")
    log(f"[rank {rank}/{world}] {plan['info'].arch} target {plan['ckpt']} taps {plan['layer_ids']} "
        f"({plan['bytes_per_token']} B/token {cfg.quant}"
        f"{f', projected to {cfg.project_dims} dims a tap' if cfg.project_dims else ''}); "
        f"{len(todo)}/{plan['num_shards']} shards to do, "
        f"{need / 1e9:.2f} GB; device {device}")
    if cfg.dry_run and not plan["weights"]:
        log(f"[rank {rank}] dry run without weights ({plan['ckpt']} holds no *.safetensors): the cache's key, and "
            f"so its directory and the shards already done, are the real run's only once the weights are there")
    est, kernels = None, "not checked here"
    if cfg.dry_run and device.type == "cpu" and cfg.device == "auto":  # planning from a machine without a GPU
        log(f"[rank {rank}] no GPU here: kernels and timing not checked (the real run checks them before loading "
            f"weights); the plan takes its rates from H200 measurements")
    else:
        probe = tgt.probe(plan["info"], plan["layer_ids"], device, getattr(torch, cfg.dtype), plan["seq_len"],
                          cfg.batch_rows, cfg.mode)
        est, kernels = probe["seconds_per_row"] * todo_rows / max(world, 1), f"ok ({probe['mode']})"
        log(f"[rank {rank}] kernels ok ({probe['mode']}, max rel err {probe['max_rel_err']:.2e} vs per-document); "
            f"estimated {probe['seconds_per_row']:.3f} s/row → {est / 60:.1f} min for this process "
            f"(checked in {time.time() - t0:.1f}s, before loading weights)")
    return dict(plan, cache=cache, device=device, tokens_dir=tokens_dir, todo=todo, redo=bool(redo), need=need,
                todo_rows=todo_rows, token_bytes=token_bytes, free=free, refusal=refusal,
                minutes=None if est is None else est / 60, kernels=kernels, t0=t0)


# --- the run -------------------------------------------------------------------------------------------------


def run(cfg: ExtractConfig, tok_cfg: TokenizeConfig, rank: int = 0, world: int = 1, local_rank: int = 0,
        train=None):
    """Extract every shard to do into the cache; returns its directory (None for a dry run). `train`: the recipe's
    [train] table (a TrainConfig), for the dry run's storage plan (epochs, drafter shape)."""
    import torch

    from dflash_offline import target as tgt

    p = plan_run(cfg, tok_cfg, rank, world, local_rank)
    cache, todo = p["cache"], p["todo"]
    if cfg.dry_run:
        for line in plan_lines(cfg, p, train) if rank == 0 else []:
            log(line)
        if p["refusal"] and not cfg.allow_overfill:
            raise ValueError(f"dry run: a real run would be refused: {p['refusal']}; {OVERFILL}")
        eta = "" if p["minutes"] is None else f"~{p['minutes']:.1f} min for this process, "
        log(f"[rank {rank}] dry run ok: {len(todo)}/{p['num_shards']} shards to do, {p['need'] / 1e9:.2f} GB, "
            f"{eta}kernels {p['kernels']}; no weights loaded, nothing written")
        return None
    open_cache(cache, "hidden", p["key"], p["producer"],
               {"extract": {**as_dict(cfg), "target": recorded_target(cfg.target)},
                "tokens_dir": os.path.relpath(p["tokens_dir"].resolve(), cache.resolve()),
                "mask_token_id": p["mask_token_id"], "layer_ids": p["layer_ids"]},
               num_shards=p["num_shards"])
    sweep(cache, log=log)
    for b in requeue_missing(cache):
        log(f"{cache}: shard {b['shard']} was committed but {b['reason']}: it goes back to to-do")
    if not todo:
        log(f"{cache}: all {p['num_shards']} shards already committed and on disk; nothing to do")
        return cache
    model = tgt.load_target(p["ckpt"], p["layer_ids"], device=p["device"], dtype=getattr(torch, cfg.dtype),
                            mode=cfg.mode)
    log(f"[rank {rank}] weights loaded in {time.time() - p['t0']:.1f}s")
    projection = projection_for(cfg, p, model, cache, rank, world) if cfg.project_dims else None
    extract_shards(cfg, p, model, cache, p["tokens_dir"], todo, rank, world, p["device"], p["redo"], projection)
    return cache


# --- projected taps: the calibration pass ---------------------------------------------------------------------


def projection_for(cfg, plan, model, cache: Path, rank: int, world: int) -> dict:
    """{"P": layer id → P [H, k] float32 on the device, "sha256": its file's}: the projection the manifest records (its
    file checked), else the calibration's, recorded first (rank 0 of a job calibrates, the other ranks wait for its
    record)."""
    from dflash_offline.projection import read_projection

    rec = read_manifest(cache).get("projection")
    if rec is None and rank == 0:
        rec = calibrate(cfg, plan, model, cache)
    t = time.time()
    while rec is None:
        if time.time() - t > PROJECTION_WAIT_S:
            raise ValueError(f"[rank {rank}] waited {PROJECTION_WAIT_S:.0f}s for rank 0 to record {cache}/"
                             f"projection.safetensors in the manifest: rank 0 failed or is stuck (see its log); "
                             f"run the extraction again")
        time.sleep(1)
        rec = read_manifest(cache).get("projection")
    Ps = read_projection(cache, plan["layer_ids"], rec)
    log(f"[rank {rank}] projection {rec['sha256'][:12]}: {rec['dims']} of {plan['info'].hidden_size} dims a tap, "
        f"retained energy " + ", ".join(f"L{lid} {rec['retained'][str(lid)]:.4f}" for lid in plan["layer_ids"]))
    return {"P": {lid: P.to(plan["device"]) for lid, P in zip(plan["layer_ids"], Ps, strict=True)},
            "sha256": rec["sha256"]}


def calibration_batches(cfg, plan):
    """The token cache's first `project_rows` rows (shard order, row order), as (padded batch, real rows) of the
    extraction's `batch_rows`."""
    import numpy as np
    import torch

    from dflash_offline.cache.shards import ROW_FILL, read_token_shard, token_shard_name

    entries, want, taken = committed(plan["tokens_manifest"]), cfg.project_rows, []
    for i in sorted(entries):
        if sum(len(t["doc_ids"]) for t in taken) >= want:
            break
        sha = entries[i]["files"][token_shard_name(i)]["sha256"]
        rows = read_token_shard(plan["tokens_dir"] / token_shard_name(i), sha, "the token cache is corrupt: rebuild it")
        taken.append({k: rows[k] for k, _ in ROW_FILL})
    rows = {k: np.concatenate([t[k] for t in taken])[:want] for k, _ in ROW_FILL}
    n = len(rows["doc_ids"])
    for r0 in range(0, n, cfg.batch_rows):
        real = min(cfg.batch_rows, n - r0)
        yield [torch.from_numpy(pad_rows(rows[k][r0:r0 + real], cfg.batch_rows, f)) for k, f in ROW_FILL], real


def calibrate(cfg, plan, model, cache: Path) -> dict:
    """Estimate E[h hᵀ] of each tapped layer over the real tokens of the calibration rows (fp64), write its top-k
    eigenvectors to CACHE/projection.safetensors and record them in the manifest; returns the record (another
    process's, when one recorded first)."""
    import torch

    from dflash_offline.projection import PROJECTION_FILE, SecondMoment, top_k, write_projection

    t0, ids, H, k = time.time(), plan["layer_ids"], plan["info"].hidden_size, cfg.project_dims
    moments, rows = {lid: SecondMoment(H, plan["device"]) for lid in ids}, 0
    with torch.inference_mode():
        for batch, real in calibration_batches(cfg, plan):
            keep = (batch[2][:real] >= 0).to(plan["device"])  # doc_ids: the real tokens
            for lid, x in zip(ids, model.tapped_layers(*batch), strict=True):
                moments[lid].add(x[:real][keep])
            rows += real
    if moments[ids[0]].n < k:  # fewer samples than directions: P's last columns would be arbitrary
        raise ValueError(f"extract.project_rows={cfg.project_rows}: the calibration rows hold {moments[ids[0]].n} real "
                         f"tokens, fewer than project_dims={k}: raise project_rows (nothing was written)")
    tops = {lid: top_k(moments[lid], k) for lid in ids}
    meta = {"dims": k, "rows": rows, "tokens": moments[ids[0]].n, "layer_ids": sorted(ids),
            "retained": {str(lid): tops[lid][1] for lid in ids}}

    def record() -> dict:  # (another process may have recorded the cache's projection first: that one it is)
        rec = write_projection(cache, {lid: tops[lid][0] for lid in ids}, meta)
        return dict(meta, file=PROJECTION_FILE, bytes=rec["bytes"], sha256=rec["sha256"])

    projection = record_once(cache, "projection", record)
    log(f"projection: {k} of {H} dims a tap from {rows} rows ({meta['tokens']:,} tokens) in {time.time() - t0:.1f}s")
    return projection


def extract_shards(cfg, plan, model, cache: Path, tokens_dir: Path, todo, rank, world, device, redo: bool,
                   projection: dict | None = None) -> dict:
    """Compute the shards of `todo` this worker claims; each is written and committed in the background while the
    next one computes (`projection`: `projection_for`'s, for a projected cache). The run's stats
    (bench.extract reads them)."""
    import torch

    from dflash_offline.cache.shards import ROW_FILL, read_token_shard, token_shard_name
    from dflash_offline.cache.writer import HiddenShardWriter

    tok_entries, b, cuda = committed(plan["tokens_manifest"]), cfg.batch_rows, device.type == "cuda"
    fix = f"the token cache is corrupt: rebuild it (delete {tokens_dir} and run make tokenize)"
    for i, e in tok_entries.items():  # (the name the reader opens; a manifest naming another file is not this cache)
        if token_shard_name(i) not in e["files"]:
            raise ValueError(f"{tokens_dir}/manifest.json: shard {i} lists {sorted(e['files'])}, not "
                             f"{token_shard_name(i)}: {fix}")
    tok_sha = {i: e["files"][token_shard_name(i)]["sha256"] for i, e in tok_entries.items()}
    who = worker_info()
    progress = Progress(f"extract[{rank}]", sum(tok_entries[i]["rows"] for i in todo), "row",
                        cache / f"status-{who['host']}-{who['pid']}.json")
    progress.extra.update(who, lease_s=cfg.lease_s)
    writer = HiddenShardWriter(cache, plan["key"], cfg.quant, plan["layer_ids"], cfg.write_queue, redo, rank, device,
                               projection)
    shards = claimed_shards(cache, todo, lambda i: read_token_shard(tokens_dir / token_shard_name(i), tok_sha[i], fix),
                            rank=rank, world=world, lease_s=cfg.lease_s, redo=redo, wait_claims=cfg.wait_claims)
    froze = gc.get_freeze_count() == 0  # (a caller's own frozen objects are left as they are)
    reserved, current = [], None  # current: the claim of the shard being computed, until the writer has it
    try:
        for n, (current, rows) in enumerate(shards):
            index, shard = current.index, writer.start(rows["input_ids"].shape[0])
            for r0 in range(0, shard.rows, b):
                current.keep()  # renews the lease of a long shard
                # rows stay on the host: the target cuts segments there and copies without a device sync
                batch = [torch.from_numpy(pad_rows(rows[k][r0:r0 + b], b, fill)) for k, fill in ROW_FILL]
                real = min(b, shard.rows - r0)
                shard.add(r0, model.tapped_layers(*batch), real)  # on CUDA: copies overlap the next forward
                progress.update(real, tokens=int((rows["doc_ids"][r0:r0 + real] >= 0).sum()))
            reserved += [torch.cuda.memory_reserved(device)] if cuda else []
            writer.submit(index, shard, {"index": index, "rows": shard.rows, "tokens": tok_entries[index]["tokens"],
                                         "tokens_sha256": tok_sha[index], "worker": f"{socket.gethostname()} rank {rank}",
                                         "reserved_gpu_bytes": reserved[-1] if reserved else 0})
            current = None
            if n == 0 and froze:  # the model and the compiled pieces exist now and live until the end: keep them
                gc.freeze()  # out of the cyclic GC's full passes, which would walk them on this thread
            progress.extra.update(reserved_gpu_gb=(reserved[-1] / 2**30) if reserved else 0.0, last_shard=index)
    except BaseException as e:  # a failure, or a stop (SIGTERM, SIGINT: `Interrupted`)
        if current is not None:  # its compute failed or was stopped: another run (or worker) may take it at once
            current.release()
        shards.close()  # releases the shard claimed ahead
        writer.abort()  # finished shards still being written are kept, then the original error goes on
        release_held(cache)  # what a stop between two statements left claimed
        progress.close("interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
        raise
    finally:
        try:
            shards.close()
        finally:
            if froze and gc.get_freeze_count():
                gc.unfreeze()
    timings = writer.drain()
    return report(progress, writer.waited_s, timings, reserved, rank, cuda)


def pad_rows(x, b: int, fill: int):
    import numpy as np

    if x.shape[0] == b:
        return np.array(x)  # a writable copy of the memory-mapped rows
    out = np.full((b, *x.shape[1:]), fill, dtype=x.dtype)
    out[: x.shape[0]] = x
    return out


def report(progress, io_wait: float, timings: list, reserved: list, rank: int, cuda: bool) -> dict:
    progress.extra.update(io_wait_s=io_wait)
    snap = progress.close("done")
    if reserved:
        log(f"[rank {rank}] reserved GPU memory per shard (GB): "
            f"{', '.join(f'{r / 2**30:.2f}' for r in reserved[:8])}{' …' if len(reserved) > 8 else ''}")
    compute_s, write_s = sum(t[0] for t in timings), sum(t[1] for t in timings)
    busy = compute_s / max(snap["elapsed_s"], 1e-9)
    log(f"[rank {rank}] done: {snap['tokens']:,} tokens in {snap['elapsed_s']:.1f}s "
        f"({snap['tokens_per_s']:,.0f} tok/s including writes); {'device' if cuda else 'compute'} busy "
        f"{100 * busy:.0f}% of the time; writes {write_s:.1f}s in the background, {io_wait:.1f}s of them waited for")
    return dict(snap, reserved_bytes=reserved, compute_s=compute_s, write_s=write_s, busy_frac=busy,
                shard_timings=timings)


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
        os.write(2, f"{signal.Signals(signum).name}: already stopping (releasing claims, finishing shard writes)\n"
                 .encode())

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
        log(f"{cfg.hidden_out}: an existing cache and no recipe: rerunning it with the inputs its manifest records "
            f"(target {cfg.target}, tokens {cfg.tokens})")
    else:
        cfg, tok_cfg = configs_from_argv([(ExtractConfig, "extract"), (TokenizeConfig, "tokenize")], argv, __doc__,
                                         defaults=tokenizer_default(argv, why))
        train = recipe_train(parse_overrides(argv)[0]) if cfg.dry_run else None
        if not cfg.tokens and rank == 0:
            log(f"tokenizer: {tok_cfg.tokenizer} ({why.get('tokenizer', 'named by --tokenizer')})")
    cpu_threads(pick_device(cfg.device, "extract.device", local_rank), log=log)
    out = run(cfg, tok_cfg, rank, world, local_rank, train)
    if out is not None and rank == 0:
        print(out)


if __name__ == "__main__":
    run_cli(main)
