"""Stage 1b: run the frozen target once over the packed token shards and commit hidden-state shards.

    python -m stages.extract --recipe=manifests/demo.toml [--target=DIR] [--shards=3,5-7] [--dry_run=1] ...
    accelerate launch --num_processes N -m stages.extract ...     (one process per GPU; NPROC=N in make)

Order of work: validate the config, read the target's config.json, estimate bytes and refuse if the disk lacks room,
check the kernels and time one batch on a small random model of the target's real widths — all in seconds, before
any weight loads (`--dry_run=1` stops there) — then load only the needed layers and extract. Every process claims a
shard (with a lease) before computing it, so ranks and machines sharing the cache never compute one twice; each
shard is written temp → fsync → rename and then committed to the manifest. Rerun = every uncommitted shard;
`--shards=` (make SHARD=) redoes exactly those. Device→host copies and disk writes overlap the next forward.

The cache is trusted, so a run starts by making it honest: it removes what dead writers left (temp files, claims),
and a committed shard whose file is missing or resized goes back to "to do". `--hidden_out=DIR` of an existing cache
without `--recipe` reruns it from the inputs its manifest records (the repair command that training and verify
print). A run that ends with shards still claimed by another live process says so and exits non-zero, unless
`--wait_claims=1` (ranks of one job always wait for each other); a dead process's shards are taken over. A failed
write (full disk, I/O error) stops the run with one line; committed shards stay, and nothing is left behind.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

from dflash_offline.config import (
    ConfigError,
    ExtractConfig,
    TokenizeConfig,
    as_dict,
    configs_from_argv,
    load_config,
    parse_overrides,
    parse_shard_list,
)
from dflash_offline.manifest import (
    MANIFEST,
    commit_shard,
    committed,
    hash_obj,
    holders,
    missing_files,
    open_cache,
    read_manifest,
    release_claim,
    renew_claim,
    requeue_missing,
    sweep,
    try_claim,
    worker_info,
)
from dflash_offline.progress import Progress, log, private_compile_caches, run_cli, unbuffered

# --- config --------------------------------------------------------------------------------------------------


def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from accelerate/torchrun's environment; (0, 1, 0) when run alone."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def tokenizer_default(section: str, values: dict, earlier: dict) -> None:
    """The tokenizer defaults to the target checkpoint."""
    if section == "tokenize" and not values.get("tokenizer"):
        values["tokenizer"] = earlier["extract"].target


def token_cache(cfg: ExtractConfig, tok_cfg: TokenizeConfig, rank: int) -> Path | dict:
    """The token cache: given, or made/reused by stage 1a (rank 0 writes it; other ranks wait for it). A dry run
    writes nothing: it gets the manifest stage 1a would leave (read from disk when that cache is complete)."""
    from stages import tokenize

    if cfg.tokens:
        return Path(cfg.tokens)
    if cfg.dry_run:
        return tokenize.dry_run(tok_cfg)
    if rank == 0:
        return tokenize.run(tok_cfg)
    from transformers import AutoTokenizer

    from dflash_offline.corpus import expand_paths

    tok = AutoTokenizer.from_pretrained(tok_cfg.tokenizer)
    key = hash_obj(tokenize.producer_for(tok_cfg, tok, expand_paths(tok_cfg.corpus)))
    out = tokenize.cache_dir_for(tok_cfg, key)
    while not ((out / "manifest.json").exists() and read_manifest(out).get("complete")):
        time.sleep(2)
    return out


# --- plan: everything that can fail, before any weight loads --------------------------------------------------


def make_plan(cfg: ExtractConfig, tokens: Path | dict) -> dict:
    """`tokens`: the token cache's directory, or (dry run) the manifest stage 1a would write."""
    from dflash_offline.shards import HIDDEN_LAYOUT_VERSION, ShardError
    from dflash_offline.target import default_layer_ids, read_target_info
    from dflash_offline.targetid import resolve_checkpoint, target_fingerprint

    tm = tokens if isinstance(tokens, dict) else read_manifest(tokens)
    if tm["kind"] != "tokens" or not tm.get("complete"):
        raise ShardError(f"{tokens} is not a complete token cache: run `make tokenize` (or extract) again")
    ckpt = resolve_checkpoint(cfg.target)
    info = read_target_info(ckpt)
    layer_ids = list(cfg.layer_ids) or default_layer_ids(info.num_layers, cfg.num_draft_layers)
    bad = [i for i in layer_ids if not 0 <= i < info.num_layers]
    if bad:
        raise ValueError(f"extract.layer_ids {bad} out of range: {ckpt} has layers 0..{info.num_layers - 1}")
    seq_len = tm["producer"]["seq_len"]
    vocab = tm["producer"]["tokenizer"]["vocab_size"]
    mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else sidecar_mask_token(ckpt)
    if mask_id is not None:
        eos = info.eos_token_id if isinstance(info.eos_token_id, list) else [info.eos_token_id]
        specials = {info.pad_token_id, *eos, tm["producer"]["tokenizer"]["pad_id"]} - {None}
        if not 0 <= mask_id < info.vocab_size or mask_id in specials:
            raise ValueError(
                f"extract.mask_token_id={mask_id} must be a real embedding row in [0, {info.vocab_size}) that is "
                f"not pad/eos ({sorted(specials)}); Qwen3 uses 151669, Qwen3.5/3.6 use 248070"
            )
    if vocab > info.vocab_size:
        raise ValueError(f"tokenizer has {vocab} tokens but {ckpt} embeds only {info.vocab_size}: wrong tokenizer?")
    k, hidden = len(layer_ids), info.hidden_size
    bytes_per_token = k * hidden * 2 if cfg.quant == "bf16" else k * (hidden + 4)
    num_shards = tm["num_shards"]
    rows = sum(s["rows"] for s in tm["shards"])
    producer = {
        "stage": "extract",
        "tokens": {"key": tm["key"], "producer": tm["producer"]},
        "target": {"arch": info.arch, "num_layers": info.num_layers, "hidden_size": hidden,
                   "vocab_size": info.vocab_size, **target_fingerprint(ckpt)},
        "layer_ids": sorted(layer_ids),
        "quant": cfg.quant,
        "dtype": cfg.dtype,
        "format_version": HIDDEN_LAYOUT_VERSION,
    }
    return {
        "ckpt": ckpt, "info": info, "layer_ids": layer_ids, "seq_len": seq_len, "mask_token_id": mask_id,
        "num_shards": num_shards, "rows": rows, "bytes_per_token": bytes_per_token,
        "total_bytes": rows * seq_len * bytes_per_token, "tokens_manifest": tm, "producer": producer,
        "key": hash_obj(producer),
    }


def sidecar_mask_token(ckpt: Path) -> int | None:
    import json

    p = ckpt / "dflash_target.json"
    return json.loads(p.read_text()).get("mask_token_id") if p.is_file() else None


def check_disk(cache: Path, need_bytes: int, min_free_gb: float) -> None:
    where = cache
    while not where.exists() and where != where.parent:  # a dry run creates nothing: the nearest existing folder
        where = where.parent
    free = shutil.disk_usage(where).free
    if free - need_bytes < min_free_gb * 1e9:
        raise ValueError(
            f"{cache}: the remaining shards need {need_bytes / 1e9:.1f} GB but the filesystem has {free / 1e9:.1f} GB "
            f"free (keeping {min_free_gb} GB): free space, use CACHE= elsewhere, quant=fp8, or fewer layers"
        )


def pick_device(cfg: ExtractConfig, local_rank: int):
    import torch

    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("extract.device=cuda but CUDA is not available (use device=cpu for tiny targets)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


# --- the run -------------------------------------------------------------------------------------------------


def run(cfg: ExtractConfig, tok_cfg: TokenizeConfig, rank: int = 0, world: int = 1, local_rank: int = 0):
    import torch

    from dflash_offline import target as tgt
    from dflash_offline.targetid import resolve_checkpoint

    t0 = time.time()
    resolve_checkpoint(cfg.target, field="extract.target")  # a wrong path fails here, before stage 1a runs
    tokens_dir = token_cache(cfg, tok_cfg, rank)
    plan = make_plan(cfg, tokens_dir)
    cache = Path(cfg.hidden_out) if cfg.hidden_out else Path(cfg.cache_root) / f"hidden-{plan['key'][:12]}"
    device = pick_device(cfg, local_rank)
    dtype = getattr(torch, cfg.dtype)
    redo = parse_shard_list(cfg.shards)
    if any(i >= plan["num_shards"] for i in redo):
        raise ValueError(f"SHARD={cfg.shards}: the cache has shards 0..{plan['num_shards'] - 1}")
    existing = read_manifest(cache) if (cache / "manifest.json").exists() else None
    done = committed(existing) if existing and existing["key"] == plan["key"] else {}
    damaged = {b["shard"]: b["reason"] for b in missing_files(cache, existing)} if done else {}
    todo = redo or [i for i in range(plan["num_shards"]) if i not in done or i in damaged]
    shard_rows = {s["index"]: s["rows"] for s in plan["tokens_manifest"]["shards"]}
    need = sum(shard_rows[i] for i in todo) * plan["seq_len"] * plan["bytes_per_token"]
    check_disk(cache, need, cfg.min_free_gb)
    log(f"[rank {rank}/{world}] {plan['info'].arch} target {plan['ckpt']} taps {plan['layer_ids']} "
        f"({plan['bytes_per_token']} B/token {cfg.quant}); {len(todo)}/{plan['num_shards']} shards to do, "
        f"{need / 1e9:.2f} GB; device {device}")
    probe = tgt.probe(plan["info"], plan["layer_ids"], device, dtype, plan["seq_len"], cfg.batch_rows, cfg.mode)
    est = probe["seconds_per_row"] * sum(shard_rows[i] for i in todo) / max(world, 1)
    log(f"[rank {rank}] kernels ok ({probe['mode']}, max rel err {probe['max_rel_err']:.2e} vs per-document); "
        f"estimated {probe['seconds_per_row']:.3f} s/row → {est / 60:.1f} min for this process "
        f"(checked in {time.time() - t0:.1f}s, before loading weights)")
    if cfg.dry_run:
        log(f"[rank {rank}] dry run: stopping before the weights load; nothing was written")
        return None
    open_cache(cache, "hidden", plan["key"], plan["producer"],
               {"extract": as_dict(cfg), "tokens_dir": os.path.relpath(tokens_dir.resolve(), cache.resolve()),
                "mask_token_id": plan["mask_token_id"], "layer_ids": plan["layer_ids"]},
               num_shards=plan["num_shards"])
    sweep(cache, log=log)
    for b in requeue_missing(cache):
        log(f"{cache}: shard {b['shard']} was committed but {b['reason']}: it goes back to to-do")
    if not todo:
        log(f"{cache}: all {plan['num_shards']} shards already committed and on disk; nothing to do")
        return cache
    model = tgt.load_target(plan["ckpt"], plan["layer_ids"], device=device, dtype=dtype, mode=cfg.mode)
    log(f"[rank {rank}] weights loaded in {time.time() - t0:.1f}s")
    extract_shards(cfg, plan, model, cache, tokens_dir, todo, rank, world, device, bool(redo))
    return cache


def shard_order(todo: list[int], rank: int, world: int) -> list[int]:
    """Each rank starts on its own stripe, then helps with the rest (claims prevent double work)."""
    mine = [i for i in todo if i % world == rank]
    return mine + [i for i in todo if i % world != rank]


def extract_shards(cfg, plan, model, cache: Path, tokens_dir: Path, todo, rank, world, device, redo: bool) -> None:
    import torch

    from dflash_offline.manifest import sha256_file
    from dflash_offline.shards import (
        ShardError,
        encode_layer,
        hidden_shard_name,
        read_token_shard,
        token_shard_name,
        write_hidden_shard,
    )

    tm, layer_ids, b = plan["tokens_manifest"], plan["layer_ids"], cfg.batch_rows
    tok_entries = committed(tm)
    rows_total = sum(tok_entries[i]["rows"] for i in todo)
    who = worker_info()
    progress = Progress(f"extract[{rank}]", rows_total, "row", cache / f"status-{who['host']}-{who['pid']}.json")
    progress.extra.update(who, lease_s=cfg.lease_s)
    # Up to `write_queue` shards are written at once, each by its own thread (file I/O and hashing only, both
    # release the GIL; never compute): a disk write as slow as a shard's compute, or one slow fsync, does not stall
    # the device. Sets of pinned host buffers are reused in a ring of write_queue + 1: shard j fills set
    # j % ring while the sets of shards j - 1 .. j - write_queue may still be going to disk (the write of shard
    # j - ring, the last user of set j % ring, finished before shard j - 1 was handed over).
    depth = cfg.write_queue
    io = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="shard-writer")
    pending = []
    cuda = device.type == "cuda"
    reserved, io_wait, timings = [], 0.0, []
    buffers: list[dict | None] = [None] * (depth + 1)
    copy_stream = torch.cuda.Stream(device) if cuda else None
    done_shards = 0

    def prepare(index: int):
        """(claim time, token rows) of shard `index`, claimed for this worker; None when it is committed or another
        live worker holds it. Runs one shard ahead on its own thread: a claim is fsynced, and an fsync can wait
        behind a shard write's flush — the thread that feeds the device must not."""
        if not try_claim(cache, index, cfg.lease_s, redo=redo):
            return None
        claimed_at = time.time()
        try:
            name = token_shard_name(index)
            if sha256_file(tokens_dir / name) != tok_entries[index]["files"][name]["sha256"]:
                raise ShardError(f"{tokens_dir / name} does not match its manifest checksum: the token cache is "
                                 f"corrupt; rebuild it (delete {tokens_dir} and run make tokenize)")
            return claimed_at, read_token_shard(tokens_dir / name)
        except BaseException:
            release_claim(cache, index)
            raise

    def claimed_shards():
        """(index, claim time, token rows) of each shard this worker gets, prepared one shard ahead; in passes, until
        every shard of `todo` is committed or (unless waiting) held by another live process."""
        order = shard_order(todo, rank, world)
        ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-claim")  # claims and token reads only
        waiting = None  # (index, future) not handed out
        handed = set()  # shards this worker computed (their writes may still be in flight)
        try:
            while order:
                waiting = (order[0], ahead.submit(prepare, order[0]))
                for pos in range(len(order)):
                    index, fut = waiting
                    got = fut.result()  # (prepare releases its own claim when it fails)
                    waiting = (order[pos + 1], ahead.submit(prepare, order[pos + 1])) if pos + 1 < len(order) else None
                    if got is not None:
                        handed.add(index)
                        yield index, *got
                order = unfinished(cache, [i for i in todo if i not in handed], cfg, rank)
        finally:  # done, or stopped (an error, an interrupt): a shard claimed here and never handed out is released
            if waiting is not None:
                try:
                    got = waiting[1].result()
                except BaseException:  # noqa: BLE001 - its own failure released it
                    got = None
                if got is not None:
                    release_claim(cache, waiting[0])
            ahead.shutdown()

    shards = claimed_shards()
    froze = gc.get_freeze_count() == 0  # (a caller's own frozen objects are left as they are)
    current = None  # the shard being computed, until it is handed to a writer (which releases its claim)
    try:
        for index, claimed_at, rows in shards:
            current = index
            t_shard = time.time()
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
            if events:
                events[0].record()
            name = token_shard_name(index)
            n = rows["input_ids"].shape[0]
            host = buffers[done_shards % (depth + 1)]
            if host is not None and next(iter(host.values())).shape[0] != n:
                host = None  # a shard of another row count (the last one): fresh buffers
            fresh = host is None
            host = host or {}
            for r0 in range(0, n, b):
                if time.time() - claimed_at > cfg.lease_s / 3:  # a long shard, or claimed ahead a while ago
                    renew_claim(cache, index, cfg.lease_s)
                    claimed_at = time.time()
                # rows stay on the host: the target cuts segments there and copies without a device sync
                batch = {k: torch.from_numpy(pad_rows(rows[k][r0:r0 + b], b, fill))
                         for k, fill in (("input_ids", 0), ("position_ids", 0), ("doc_ids", -1))}
                taps = model.tapped_layers(batch["input_ids"], batch["position_ids"], batch["doc_ids"])
                real = min(b, n - r0)
                if cuda:  # encode + device→host copies on a side stream, overlapping the next batch's forward
                    ready = torch.cuda.Event()
                    ready.record()
                    copy_stream.wait_event(ready)
                with torch.cuda.stream(copy_stream) if cuda else nullcontext():
                    for lid, x in zip(layer_ids, taps, strict=True):
                        if cuda:
                            x.record_stream(copy_stream)  # not reused by the next forward before this stream is done
                        for k, v in encode_layer(x[:real], lid, cfg.quant).items():
                            if fresh and k not in host:
                                host[k] = torch.empty((n, *v.shape[1:]), dtype=v.dtype, pin_memory=cuda)
                            host[k][r0:r0 + real].copy_(v, non_blocking=cuda)
                del taps
                progress.update(real, tokens=int((rows["doc_ids"][r0:r0 + real] >= 0).sum()))
            if cuda:  # no synchronization here: the writer waits for this event, the device goes on with the next shard
                events[1].record(copy_stream)
                reserved.append(torch.cuda.memory_reserved(device))
            compute_s = time.time() - t_shard  # host time; on CUDA the writer replaces it with the device time
            buffers[done_shards % (depth + 1)] = host
            done_shards += 1
            if done_shards == 1 and froze:  # the model and the compiled pieces exist now and live until the end:
                gc.freeze()  # keep them out of the cyclic GC's full passes, which would walk them on this thread
            tensors = dict(host)
            entry = {"index": index, "rows": n, "tokens": tok_entries[index]["tokens"], "compute_seconds": compute_s,
                     "tokens_sha256": tok_entries[index]["files"][name]["sha256"], "worker": f"rank{rank}",
                     "reserved_gpu_bytes": reserved[-1] if reserved else 0}
            # at most `depth` writes in flight (bounded host memory: depth + 1 shards of buffers)
            t_wait = time.time()
            while len(pending) >= depth:
                timings.append(pending.pop(0).result())
            io_wait += time.time() - t_wait
            for f in pending:  # a failed write (a full disk) stops the run now, not after every shard is computed
                if f.done() and f.exception() is not None:
                    raise f.exception()
            pending.append(io.submit(write_and_commit, cache, index, tensors, cfg.quant, layer_ids, plan["key"], entry,
                                     redo, write_hidden_shard, hidden_shard_name, events))
            current = None
            progress.extra.update(reserved_gpu_gb=(reserved[-1] / 2**30) if reserved else 0.0, last_shard=index)
    except BaseException:
        if current is not None:  # its compute failed: another run (or worker) may take it at once
            release_claim(cache, current)
        try:  # finished shards still being written are kept, then the original error goes on
            drain_writes(pending, io, rank)
        except Exception:  # noqa: BLE001 - logged there
            pass
        progress.close("failed")
        raise
    finally:
        try:
            shards.close()
        finally:
            if froze and gc.get_freeze_count():
                gc.unfreeze()
    t_wait = time.time()
    timings += drain_writes(pending, io, rank)
    io_wait += time.time() - t_wait
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


def unfinished(cache: Path, todo: list[int], cfg, rank: int) -> list[int]:
    """The shards of `todo` still not committed that this worker can take now (their holder died or its lease
    expired). Shards that other live processes hold are waited for when they belong to this job (its ranks) or
    with `wait_claims`; otherwise the run stops with an error naming them and their holders."""
    while True:
        done = committed(read_manifest(cache))
        left = [i for i in todo if i not in done]
        held = holders(cache, left)
        if free := [i for i in left if i not in held]:
            return free
        if not held:
            return []
        job = worker_info()["job"]
        if not (cfg.wait_claims or all(job and c.get("job") == job for c in held.values())):
            from dflash_offline.dataset import shard_list

            who = sorted({f"{c.get('worker')} (rank {c.get('rank', '?')})" for c in held.values()})
            until = max(c["expires"] for c in held.values())
            raise IncompleteRun(
                f"{cache}: this process finished its shards, but {shard_list(held)} are still claimed by "
                f"{', '.join(who)} (leases until {time.strftime('%H:%M:%S', time.localtime(until))}): the cache "
                f"is not complete. Rerun `make extract CACHE={cache}` when they end (a dead holder's shards are "
                f"taken over), or pass --wait_claims=1 to wait for them")
        log(f"[rank {rank}] waiting for shards {sorted(held)} held by other live processes")
        time.sleep(min(5.0, cfg.lease_s / 4))


class IncompleteRun(ValueError):
    """The run did its part, but shards that others hold are not committed yet."""


def drain_writes(pending: list, io, rank: int) -> list:
    """Wait for every background shard write; their timings. Every failure is logged; the first is raised once all
    writes are done (a failed write never keeps the others from committing)."""
    timings, errors = [], []
    for f in pending:
        try:
            timings.append(f.result())
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            log(f"[rank {rank}] a shard write failed: {e!r}")
    pending.clear()
    io.shutdown()
    if errors:
        raise errors[0]
    return timings


def pad_rows(x, b: int, fill: int):
    import numpy as np

    if x.shape[0] == b:
        return np.array(x)  # a writable copy of the memory-mapped rows
    out = np.full((b, *x.shape[1:]), fill, dtype=x.dtype)
    out[: x.shape[0]] = x
    return out


def write_and_commit(cache, index, tensors, quant, layer_ids, key, entry, redo, write_fn, name_fn,
                     events=None) -> tuple[float, float]:
    if events is not None:  # the shard's device→host copies are done once its end event is
        events[1].synchronize()
        entry = dict(entry, compute_seconds=events[0].elapsed_time(events[1]) / 1000)
    t = computed_at = time.time()
    name = name_fn(index)
    try:
        files = {name: write_fn(cache / name, tensors, quant, layer_ids, {"shard": index, "key": key})}
        commit_shard(cache, dict(entry, files=files, write_seconds=time.time() - t, committed_at=time.time()),
                     redo=redo)
    finally:  # committed or failed, the shard is no longer this worker's
        release_claim(cache, index)
    write_s = time.time() - t
    log(f"[{entry['worker']}] shard {index} committed ({files[name]['bytes'] / 1e6:.1f} MB, "
        f"{entry['compute_seconds']:.1f}s compute, {write_s:.1f}s write)")
    return entry["compute_seconds"], write_s, computed_at


def recorded_config(argv: list[str]) -> ExtractConfig | None:
    """For `--hidden_out=DIR` naming an existing hidden cache and no `--recipe`: the ExtractConfig its manifest
    recorded (reading the token cache it was made from), with the command line's non-empty settings on top, so that
    `make extract CACHE=DIR SHARD=k` works as printed. None otherwise."""
    if any(a in ("-h", "--help") for a in argv):
        return None
    recipe, overrides = parse_overrides(argv)
    out = overrides.get("hidden_out", "")
    if recipe or not out or not (Path(out) / MANIFEST).is_file():
        return None
    m = read_manifest(out)
    if m.get("kind") != "hidden":
        raise ConfigError(f"{out} holds a {m.get('kind')} cache; hidden_out (CACHE= for make extract) names a "
                          f"hidden-state cache")
    unknown = sorted(set(overrides) - set(ExtractConfig.__dataclass_fields__) - set(TokenizeConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; see --help")
    values = {**m["config"]["extract"], "shards": "", "dry_run": False, "hidden_out": out,
              "tokens": str((Path(out) / m["config"]["tokens_dir"]).resolve())}
    values.update({k: v for k, v in overrides.items() if k in ExtractConfig.__dataclass_fields__ and v != ""})
    return load_config(ExtractConfig, "extract", None, {}, values)


def main(argv: list[str]) -> None:
    rank, world, local_rank = dist_env()
    private_compile_caches(rank)
    unbuffered()
    recorded = recorded_config(argv)
    if recorded is not None:
        cfg, tok_cfg = recorded, None
        log(f"{cfg.hidden_out}: an existing cache and no recipe: rerunning it with the inputs its manifest records "
            f"(target {cfg.target}, tokens {cfg.tokens})")
    else:
        cfg, tok_cfg = configs_from_argv(
            [(ExtractConfig, "extract"), (TokenizeConfig, "tokenize")], argv, __doc__, defaults=tokenizer_default
        )
    out = run(cfg, tok_cfg, rank, world, local_rank)
    if out is not None and rank == 0:
        print(out)


if __name__ == "__main__":
    run_cli(main)
