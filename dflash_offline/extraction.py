"""Stage 1b's extraction loop: the frozen target over the token shards of a plan, hidden-state shards committed.

`extract_shards` takes an `ExtractPlan` (`extract_plan.py`: the cache, its key and taps, the shards to do, the device) and
the loaded target, claims each shard before computing it (`cache/claims.py`: ranks and machines sharing the cache
never compute one twice), runs the target's packed forward over `batch_rows` rows at a time (rows padded to that one
shape, `pad_rows`) and hands each finished shard to the background writer (`cache/writer.py`: temp → fsync → rename,
manifest commit) while the next one computes. A failure or a stop (SIGTERM, SIGINT) drops the shard in progress and
releases its claim and the one claimed ahead; shards already handed to the writer are committed. `report` logs and
returns the run's stats (bench.extract reads them). `stages/extract.py` plans, loads the weights and calls it.
"""

from __future__ import annotations

import gc
import socket

from .cache.claims import claimed_shards, release_held
from .cache.fsio import worker_info
from .cache.manifest import committed
from .cache.shards import ROW_FILL, pad_rows, read_token_shard, token_shard_name
from .config import ExtractConfig
from .extract_plan import ExtractPlan
from .metrics import only_interpreter_frozen
from .progress import Progress, log


def extract_shards(cfg: ExtractConfig, plan: ExtractPlan, model, rank: int, world: int,
                   projection: dict | None = None) -> dict:
    """Compute the shards of `plan.todo` this worker claims; each is written and committed in the background while
    the next one computes (`projection`: `projection.projection_for`'s, for a projected cache). The run's stats
    (bench.extract reads them)."""
    import torch

    from .cache.writer import HiddenShardWriter

    cache, tokens_dir, device, todo, redo = plan.cache, plan.tokens_dir, plan.device, plan.todo, plan.redo
    tok_entries, b, cuda = committed(plan.tokens_manifest), cfg.batch_rows, device.type == "cuda"
    fix = f"the token cache is corrupt: rebuild it (delete {tokens_dir} and run make tokenize)"
    tok_sha = token_checksums(tok_entries, tokens_dir, fix)
    who = worker_info()
    progress = Progress(f"extract[{rank}]", sum(tok_entries[i]["rows"] for i in todo), "row",
                        cache / f"status-{who['host']}-{who['pid']}.json")
    progress.extra.update(who, lease_s=cfg.lease_s)
    writer = HiddenShardWriter(cache, plan.key, cfg.quant, plan.layer_ids, cfg.write_queue, redo, rank, device,
                               projection, log)
    shards = claimed_shards(cache, todo, lambda i: read_token_shard(tokens_dir / token_shard_name(i), tok_sha[i], fix),
                            rank=rank, world=world, lease_s=cfg.lease_s, redo=redo, wait_claims=cfg.wait_claims,
                            log=log)
    froze = only_interpreter_frozen()  # (a caller's own frozen objects are left as they are)
    reserved, current = [], None  # current: the claim of the shard being computed, until the writer has it
    try:
        for n, (current, rows) in enumerate(shards):
            index, shard = current.index, writer.start(rows["input_ids"].shape[0])
            if begin := getattr(model, "begin_shard", None):  # (a derivation's source: where to look for the rows)
                begin(index)
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
            if froze and not only_interpreter_frozen():
                gc.unfreeze()
    timings = writer.drain()
    return report(progress, writer.waited_s, timings, reserved, rank, cuda)


def token_checksums(entries: dict, tokens_dir, fix: str) -> dict[int, str]:
    """Token shard index → the SHA-256 its manifest entry records for the file the reader opens; a manifest naming
    another file is not this cache (refused, saying `fix`)."""
    for i, e in entries.items():
        if token_shard_name(i) not in e["files"]:
            raise ValueError(f"{tokens_dir}/manifest.json: shard {i} lists {sorted(e['files'])}, not "
                             f"{token_shard_name(i)}: {fix}")
    return {i: e["files"][token_shard_name(i)]["sha256"] for i, e in entries.items()}


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
