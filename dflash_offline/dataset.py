"""Streaming a hidden-state cache into fixed-shape training batches, split across ranks by the stream itself.

Shape legend: B rows per batch on one rank, W ranks, G = B·W rows per global batch, S seq_len, k tapped layers,
H values stored per token and tap (the hidden size; project_dims for a projected cache, `projection.py`).

Order — a pure function of the manifest, the seed and the epoch, so every rank computes it alone, without talking:
epoch e visits the shards in a permutation drawn from (seed, e) and each shard's rows in a permutation drawn from
(seed, e, shard). That one sequence of rows is cut into global batches of G rows and rank r takes rows
[r·B, (r+1)·B) of each: no row twice, none missing across ranks, and 1 process with B·W rows sees exactly the
concatenation of the W processes' batches. The last, partial global batch of an epoch (< G rows) is dropped to keep
shapes fixed; the order changes every epoch, so a different tail is dropped each time.

I/O — no DataLoader workers. A background thread reads the next `prefetch` batches (`reader_threads` of them read
several at once, each with its own open files: a benchmark switch so far, `bench.train --reader_threads`) — safetensors
slices of only the requested layers, in their stored encoding (FP8 and FP4 stay encoded: a half and ~0.28 of bf16's
bytes), and the Arrow token rows — into pinned host buffers. The calling thread copies them to the device
(`non_blocking`) and decodes FP8 / FP4 there, one layer at a time; on CUDA it does so one batch ahead on a side
stream, so the copy of batch n+1 overlaps step n (the step waits on an event, not on the copy engine). The reader
thread does file reads and memcpy only (no compute, no CUDA kernels). Workers would add process start-up, a second
copy through shared memory and per-worker resume state, for work that is a few large contiguous reads per batch.

Integrity — every shard the stream opens is checked against the manifest (`cache.shards.HiddenShardFile`): the file's size
and header checksum on open, then an xxh3 digest of every row as the reader thread reads it; token shards are read
whole and checked against the SHA-256 the hidden manifest recorded for them. A mismatch stops training with one
line naming the shard and the command that redoes it. Start-up reads the manifest and checks every shard's size and header (~20 µs a
shard, no data read): a missing, resized or swapped shard, or a hand-edited manifest that contradicts its shards,
is refused before anything is written. Resume: `state_dict()` is the position of the next batch handed out (not of the prefetch);
`load_state_dict` restores it so that the next batches are `torch.equal` to an uninterrupted run's.
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .cache.encodings import ENCODINGS
from .cache.manifest import (
    MANIFEST,
    ManifestError,
    committed,
    hidden_num_shards,
    missing_files,
    not_covered,
    projection_problem,
    read_manifest,
    require,
    shard_list,
    token_cache,
    verdict_now,
)
from .cache.shards import (
    SAFETENSORS_DTYPES,
    HiddenShardFile,
    ShardError,
    hidden_shard_name,
    read_token_shard,
    token_shard_name,
)
from .devices import usable_cpus

STATE_VERSION = 1
TOKEN_KEYS = ("input_ids", "loss_mask", "position_ids", "doc_ids")



# --- the cache, from its manifest alone --------------------------------------------------------------------


@dataclass(frozen=True)
class CacheInfo:
    cache_dir: Path
    tokens_dir: Path
    key: str  # the hidden cache's key
    tokens_key: str  # the token cache's key
    layer_ids: tuple[int, ...]  # the layers to read, in this order (columns of `hidden`)
    cache_layer_ids: tuple[int, ...]  # what the cache holds (a superset)
    quant: str  # the encoding's name (`cache.encodings.ENCODINGS`: "bf16", "fp8", "fp4", …)
    hidden_size: int  # the target's
    seq_len: int
    shard_rows: tuple[int, ...]  # rows of shard i
    shard_files: tuple[dict, ...] = ()  # manifest record ({"bytes", "sha256", "header_sha256"}) of shard i's file
    tokens_sha256: tuple[str, ...] = ()  # SHA-256 of the token shard that shard i was computed from
    width: int = 0  # values stored per token and tap: hidden_size, or project_dims (a projected cache)
    projection: dict | None = None  # a projected cache: the manifest's `projection` record (dims, file sha256, ...)

    @property
    def num_rows(self) -> int:
        return sum(self.shard_rows)

    def repair(self, shards) -> str:
        """The command that redoes these shards of this cache (it reads its inputs from the manifest)."""
        return f"make extract CACHE={self.cache_dir} SHARD={shard_list(shards)}"


# what reading a hidden cache uses of its manifest (type-checked by `read_manifest`; here they must also be there)
HIDDEN_NEEDS = ("config.tokens_dir", "producer.layer_ids", "producer.quant", "producer.target.hidden_size",
                "producer.tokens.key", "producer.tokens.producer.seq_len")


def open_hidden_cache(cache_dir, layer_ids, hidden_size: int | None = None, seq_len: int | None = None,
                      require_verified: bool = False) -> CacheInfo:
    """Check that a hidden cache fits the drafter, reading only `manifest.json`; refusals name the field. Reads,
    never writes: a read-only cache (a shared one) trains as well."""
    cache = Path(cache_dir)
    m = read_manifest(cache, kind="hidden")
    where = cache / MANIFEST
    prod = require(m, where, HIDDEN_NEEDS)["producer"]
    have, want = [int(i) for i in prod["layer_ids"]], [int(i) for i in layer_ids]
    if not want or len(set(want)) != len(want):
        raise ManifestError(f"layer_ids {want}: need one or more distinct target layer ids")
    if missing := [i for i in want if i not in have]:
        raise ManifestError(f"{where}: producer.layer_ids {have} lacks {missing} that the drafter taps ({want}); "
                            f"extract a cache with those layers (make extract with layer_ids covering them)")
    _check_equal(where, "producer.target.hidden_size", prod["target"]["hidden_size"], hidden_size)
    _check_equal(where, "producer.tokens.producer.seq_len", prod["tokens"]["producer"]["seq_len"], seq_len)
    tokens_dir, tokens_m = token_cache(cache, m)
    done, n = committed(m), hidden_num_shards(cache, m, tokens_m)  # (bounded by the token cache before any range)
    if missing := [i for i in range(n) if i not in done]:
        raise ManifestError(f"{where}: incomplete cache, shards {shard_list(missing)} of {n} "
                            f"are not committed; finish it with `make extract CACHE={cache}`")
    if bad := next(((i, why) for i in range(n) if (why := entry_error(done[i], i))), None):
        raise ManifestError(f"{where}: shards[{bad[0]}] {bad[1]}: the manifest was edited or damaged; restore it, or "
                            f"redo the shard with `make extract CACHE={cache} SHARD={bad[0]}`")
    _check_verdict(cache, m, require_verified)
    width = stored_width(prod)
    enc = ENCODINGS.get(prod.get("quant"))
    if enc is None or width % enc.align:
        fits = "; ".join(f"{e.name} at a width that is a multiple of {e.align}" for e in ENCODINGS.values() if e.align > 1)
        raise ManifestError(f"{where}: producer.quant {prod.get('quant')!r} at width {width} is not an encoding this "
                            f"code reads ({', '.join(ENCODINGS)}{'; ' + fits if fits else ''}): "
                            f"extract the cache again with this code")
    projection = m.get("projection") if prod.get("projection") else None
    if prod.get("projection"):  # a projection file that is not the one the shards were computed with: refused now
        from .cache.projection_file import read_projection

        read_projection(cache, want, projection)
    info = cache_info(cache, m, want, n)
    if bad := missing_files(cache, m):
        raise ManifestError(f"{where}: {len(bad)} committed shard(s) are damaged on disk ({bad[0]['reason']}"
                            f"{' …' if len(bad) > 1 else ''}); redo them with "
                            f"`{info.repair(b['shard'] for b in bad)}`")
    if bad := missing_files(tokens_dir, tokens_m):
        raise ManifestError(f"{tokens_dir}: the token cache this cache was extracted from is damaged on disk "
                            f"({bad[0]['reason']}); restore it (rebuild it with the recipe and corpus it was made "
                            f"from)")
    for i in range(n):  # headers only (~20 µs a shard): a manifest that contradicts its shards stops here
        open_shard(info, i).close()
    return info


def stored_width(producer: dict) -> int:
    """Values stored per token and tap: the target's hidden size, or project_dims for a projected cache."""
    return int((producer.get("projection") or {}).get("dims") or producer["target"]["hidden_size"])


_KEPT = {"on": False, "key": None, "held": None, "first": None}  # resident rows kept past their stream


def keep_resident_rows(on: bool = True) -> None:
    """In this process, a resident stream (`HiddenStream(resident=True)`) leaves the rows it read on its device for
    the next resident stream on the same cache (`CacheInfo`: the same files by their digests, the same layers) and
    device, which then reads none: the testbed's training worker, whose drafters of an arm (its seeds, the null arm,
    the known-bad arm) train one after another on one cache (≈ 3 s a drafter for the testbed's ≈ 8 GB on an H100).
    The rows served are the ones read and checked against their digests the first time (a shard damaged on disk
    since is found by the next read, not by these). Reading another cache gives them back first; `on=False` gives
    them back now."""
    _KEPT["on"] = on
    if not on:
        release_kept_rows()


def release_kept_rows() -> None:
    """The rows `keep_resident_rows` kept, given back (with the CUDA allocator's cached blocks, for other
    processes and for a free-memory check)."""
    if _KEPT["held"] is None:
        return
    _KEPT.update(key=None, held=None, first=None)
    if torch.cuda.is_initialized():
        import gc

        gc.collect()  # (a stream still holding them, in a cycle)
        torch.cuda.empty_cache()


def resident_bytes(info: CacheInfo) -> int:
    """Bytes a stream with `resident=True` holds on its device for `info`: every row of the layers read, in their
    stored encoding, and the token rows (int64 ids, positions and documents, a bool mask)."""
    enc, S, k = ENCODINGS[info.quant], info.seq_len, len(info.layer_ids)
    per_token = k * sum(width(info.width) * dtype.itemsize for dtype, width in enc.tensors.values())
    return info.num_rows * S * (per_token + 3 * 8 + 1)


HOLD_CHUNK_BYTES = 64 << 20  # a resident read's host buffer, per thread (whole rows; at least one)
HOLD_THREADS = 8  # a resident read's threads at most (one shard each; no more than the shards nor this rank's CPUs)


def row_bytes(info: CacheInfo) -> int:
    """Bytes one row of the layers read takes in the cache's stored encoding (hidden states only)."""
    enc, S, k = ENCODINGS[info.quant], info.seq_len, len(info.layer_ids)
    return S * k * sum(width(info.width) * dtype.itemsize for dtype, width in enc.tensors.values())


def hold_threads(shards: int) -> int:
    """Threads a resident read uses for `shards` shards with rows: HOLD_THREADS, this process's share of the CPUs it
    may run on (`usable_cpus` for the LOCAL_WORLD_SIZE ranks on this host: affinity and cgroup quota) and the
    shards, whichever is fewest (at least one)."""
    try:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        ranks = 1
    return max(1, min(HOLD_THREADS, usable_cpus(ranks), shards))


def stored_buffers(info: CacheInfo, rows: int, **where) -> dict[str, torch.Tensor]:
    """One empty tensor per tensor the encoding stores for a layer, [rows, S, k, width] each (bf16: `hidden`
    [rows, S, k, H]), for the layers read; `where`: torch.empty's device / pin_memory."""
    S, k = info.seq_len, len(info.layer_ids)
    return {name: torch.empty((rows, S, k, width(info.width)), dtype=dtype, **where)
            for name, (dtype, width) in ENCODINGS[info.quant].tensors.items()}


def cache_info(cache: Path, m: dict, layer_ids, n: int) -> CacheInfo:
    """The `CacheInfo` of a hidden cache of `n` shards (its manifest checked by `open_hidden_cache`; `make verify`
    builds one for the shards that are committed: the others get 0 rows and no file record)."""
    prod, done = m["producer"], committed(m)
    return CacheInfo(
        cache_dir=cache, tokens_dir=token_cache(cache, m)[0], key=m["key"], tokens_key=prod["tokens"]["key"],
        layer_ids=tuple(layer_ids), cache_layer_ids=tuple(int(i) for i in prod["layer_ids"]), quant=prod["quant"],
        hidden_size=int(prod["target"]["hidden_size"]), seq_len=int(prod["tokens"]["producer"]["seq_len"]),
        shard_rows=tuple(done[i]["rows"] if i in done else 0 for i in range(n)),
        shard_files=tuple(done[i]["files"].get(hidden_shard_name(i), {}) if i in done else {} for i in range(n)),
        tokens_sha256=tuple(done[i].get("tokens_sha256", "") if i in done else "" for i in range(n)),
        width=stored_width(prod), projection=m.get("projection") if prod.get("projection") else None,
    )


def entry_error(entry: dict, index: int) -> str | None:
    """Why a committed hidden shard's entry is not one training can read, or None: it must list exactly the file
    training opens (`hidden-NNNNN.safetensors`: a checksum recorded under another name checks nothing training
    reads) and the SHA-256 of the token shard it was computed from."""
    name = hidden_shard_name(index)
    if list(entry["files"]) != [name]:
        return (f"lists the files {sorted(entry['files'])}, but shard {index} is the one file {name} (what training "
                f"reads)")
    if "tokens_sha256" not in entry:
        return "has no tokens_sha256 (the token shard it was computed from)"
    return None


def open_shard(info: CacheInfo, shard: int) -> HiddenShardFile:
    """Shard `shard`'s file opened and checked against the manifest: size, header checksum, and what the header
    says it is (cache key, index, quantization, rows, layers and, projected, the projection's SHA-256)."""
    f = HiddenShardFile(info.cache_dir / hidden_shard_name(shard), info.shard_files[shard], info.repair([shard]))
    try:
        first = next(iter(ENCODINGS[info.quant].tensors))  # (every tensor of the shard holds its rows)
        meta, rows = f.meta, f.rows(f"{first}.L{info.layer_ids[0]}")
        want = (info.key, str(shard), info.quant, info.shard_rows[shard], list(info.cache_layer_ids))
        have = (meta.get("key"), meta.get("shard"), meta.get("quant"), rows, json.loads(meta.get("layer_ids", "[]")))
        if have != want:
            raise f._bad(f"holds (key, shard, quant, rows, layer_ids) = {have} but the manifest says {want}")
        if info.projection and meta.get("projection") != info.projection["sha256"]:
            raise f._bad(f"was projected with projection {str(meta.get('projection'))[:12]}…, the cache records "
                         f"{info.projection['sha256'][:12]}… (a shard of another extraction with the same key: each "
                         f"calibrates its own P)")
        if why := layout_error(f, info, rows):
            raise f._bad(why)
    except BaseException:
        f.close()
        raise
    return f


def layout_error(f: HiddenShardFile, info: CacheInfo, rows: int) -> str | None:
    """Where the header's tensor table disagrees with the manifest and the file: every tensor of every cached layer
    (the encoding's `tensors`) must be there, [rows, seq_len, width] of its dtype, its bytes inside the
    file. (A header that passes its checksum may still be crafted: a 0-row tensor, or offsets past the end.)"""
    data = os.fstat(f.fd).st_size - f.data_start
    for lid in info.cache_layer_ids:
        for name, (dtype, width) in ENCODINGS[info.quant].tensors.items():
            t = f.header.get(f"{name}.L{lid}")
            shape = [rows, info.seq_len, width(info.width)]
            if not isinstance(t, dict) or t.get("dtype") != SAFETENSORS_DTYPES[dtype] or t.get("shape") != shape:
                return f"has {name}.L{lid} = {t!r} in its header, expected {SAFETENSORS_DTYPES[dtype]} {shape}"
            offsets, nbytes = t.get("data_offsets"), math.prod(shape) * dtype.itemsize
            if not (isinstance(offsets, list) and len(offsets) == 2 and isinstance(offsets[0], int)
                    and 0 <= offsets[0] and offsets[1] == offsets[0] + nbytes <= data):
                return f"has {name}.L{lid} at bytes {offsets} of its {data} data bytes, expected {nbytes} bytes"
    return None


def _check_equal(where, field: str, have, want) -> None:
    if want is not None and int(have) != int(want):
        raise ManifestError(f"{where}: {field} is {have} but the drafter expects {want}; use a cache built for it")


def _check_verdict(cache: Path, m: dict, require: bool) -> None:
    """The recorded verdict judged against the shards as they are now (`verdict_now`): refused where it found the
    projection not the cache's, or shards bad that are still as it saw them (naming the `SHARD=` that redoes them);
    with `require`, also where there is none, or it does not cover every shard (some (re)committed since it was
    taken, a repair among them): then only `make verify` is asked for, never a redo of work already done."""
    v = verdict_now(m)
    if v is None:
        if require:
            raise ManifestError(f"{cache}/manifest.json: verified is absent (never verified); "
                                f"run `make verify CACHE={cache}` first")
        return
    if not v.get("ok") and v.get("projection"):  # every shard depends on it: none to redo alone
        if projection_problem(cache, m, check_sha=True) is None:  # the file put back since: only verify is asked for
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(v.get("at", 0)))
            raise ManifestError(f"{cache}/manifest.json: verified (at {when}) found the projection file bad "
                                f"({v['projection'].split(';')[0]}); it matches the manifest now: run "
                                f"`make verify CACHE={cache}`")
        raise ManifestError(f"{cache}/manifest.json: verified.ok is false: {v['projection']}")
    if bad := v["bad"]:
        shards = shard_list({b["shard"] for b in bad if "shard" in b})
        why = "; ".join(f"shard {b.get('shard')}: {b.get('reason')}" for b in bad[:5])
        also = f"; {not_covered(v)}" if v["since"] else ""
        raise ManifestError(f"{cache}/manifest.json: verified.ok is false ({why}{' …' if len(bad) > 5 else ''}{also}); "
                            f"redo them with `make extract CACHE={cache} SHARD={shards}`, then `make verify`")
    if require and (v["since"] or not v.get("ok")):
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(v.get("at", 0)))
        raise ManifestError(f"{cache}/manifest.json: verified (at {when}) does not cover the cache as it is now: "
                            f"{not_covered(v)}; nothing to redo: run `make verify CACHE={cache}` (require_verified=1 "
                            f"trains only on what a verdict covers)")


# --- the order of an epoch (pure functions) ----------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def epoch_plan(shard_rows: tuple[int, ...], seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(shard order, start of each visited shard in the epoch's row sequence, with the total appended)."""
    order = np.random.default_rng([seed, epoch, 1]).permutation(len(shard_rows))
    starts = np.concatenate([[0], np.cumsum(np.asarray(shard_rows, dtype=np.int64)[order])])
    return order, starts


@functools.lru_cache(maxsize=64)
def row_order(rows: int, seed: int, epoch: int, shard: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 2, shard]).permutation(rows)


def locate(shard_rows: tuple[int, ...], seed: int, epoch: int, start: int, stop: int) -> list[tuple[int, int]]:
    """(shard, row) of the epoch's row sequence positions start..stop-1."""
    order, starts = epoch_plan(shard_rows, seed, epoch)
    pos = np.arange(start, stop)
    visit = np.searchsorted(starts, pos, side="right") - 1
    out = []
    for p, v in zip(pos.tolist(), visit.tolist(), strict=True):
        shard = int(order[v])
        out.append((shard, int(row_order(shard_rows[shard], seed, epoch, shard)[p - starts[v]])))
    return out


# --- the stream --------------------------------------------------------------------------------------------


class HiddenStream:
    """Endless iterator of fixed-shape batches for one rank (epochs follow each other).

    Each batch: `hidden` [B, S, k·H] bf16 (layers in `info.layer_ids` order), `input_ids`, `position_ids`,
    `doc_ids` [B, S] int64 and `loss_mask` [B, S] bool, all on `device`. `last_wait_s` is the time the last
    `next()` blocked for data (reads not hidden by the prefetch, plus queuing the copies); `total_wait_s` sums it.
    """

    def __init__(self, info: CacheInfo, batch_rows: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 device="cpu", prefetch: int = 2, resident: bool = False, reader_threads: int = 1):
        if batch_rows < 1 or world_size < 1 or not 0 <= rank < world_size or prefetch < 0 or reader_threads < 1:
            raise ValueError(f"need batch_rows >= 1, 0 <= rank < world_size, prefetch >= 0, reader_threads >= 1; got "
                             f"batch_rows={batch_rows} rank={rank} world_size={world_size} prefetch={prefetch} "
                             f"reader_threads={reader_threads}")
        self.info, self.B, self.rank, self.W, self.seed = info, batch_rows, rank, world_size, seed
        self.G = batch_rows * world_size
        self.batches_per_epoch = info.num_rows // self.G
        if self.batches_per_epoch == 0:
            raise ValueError(f"{info.cache_dir} holds {info.num_rows} rows, fewer than one global batch of "
                             f"{self.G} (batch_rows {batch_rows} × world_size {world_size}): extract more rows, "
                             f"{fewer_rows(info.num_rows, world_size)}")
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.prefetch = prefetch
        # reader threads reading the next batches at once (each its own open files; batches still handed out in
        # order); 1 = one reader (BenchSwitches.reader_threads: a benchmark switch, not a trainer option)
        self.reader_threads = reader_threads
        self.epoch, self.batch = 0, 0  # position of the next batch handed out
        self.last_wait_s, self.total_wait_s = 0.0, 0.0
        self._pending: deque = deque()  # futures of the batches after the position, in order
        self._ahead = (0, 0)  # position of the next batch to submit to the reader
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()  # a reading thread's open shard files and token arrays (`_caches`)
        self._opened: list[OrderedDict] = []  # every thread's open files, closed by `close`
        self._opened_lock = threading.Lock()
        self._staged = None  # CUDA: (next batch on the device, its copy event), copied one step ahead
        self._unstaged = None  # CUDA: the next batch's host tensors, when copying it ahead failed (done in its turn)
        self._copy_stream = None
        self.resident = resident
        self._held: dict[str, torch.Tensor] | None = None  # resident: every row of the cache on `device`
        self._first_row: np.ndarray | None = None  # resident: shard i's first row in `_held`
        if resident and _KEPT["key"] == self._kept_key():  # the last stream's rows (`keep_resident_rows`)
            self._held, self._first_row = _KEPT["held"], _KEPT["first"]
        self.rows_kept = self._held is not None  # resident: the rows were held already, none is read again
        self.held_read: dict | None = None  # resident: the read onto the device (bytes, seconds, alloc_s, copy_s, threads)

    # -- iteration --

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        if self.resident:
            batch = self._gather(self.epoch, self.batch)
        elif self.pin and self.prefetch > 0:  # CUDA: this batch was copied during the previous step
            if self._staged is None:
                host, self._unstaged = self._unstaged if self._unstaged is not None else self._take(), None
                self._staged = self._stage(host)
            batch, ready = self._staged
            torch.cuda.current_stream(self.device).wait_event(ready)
            self._staged = None
            nxt = self._pending[0] if self._pending else None
            if nxt is not None and nxt.done() and nxt.exception() is None:  # never wait (or fail) here for batch n+1
                host = self._take()
                try:
                    self._staged = self._stage(host)  # its copies overlap this step's compute
                except Exception:  # noqa: BLE001 - (out of memory while decoding, …) raised in its own turn, not now
                    self._unstaged = host
        else:
            batch = self._to_device(self._take())
        self.epoch, self.batch = self._after(self.epoch, self.batch)
        self.last_wait_s = time.perf_counter() - t0
        self.total_wait_s += self.last_wait_s
        return batch

    def _after(self, epoch: int, batch: int) -> tuple[int, int]:
        return (epoch, batch + 1) if batch + 1 < self.batches_per_epoch else (epoch + 1, 0)

    def _take(self) -> dict[str, torch.Tensor]:
        if self.prefetch == 0:
            return self._read(self.epoch, self.batch)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.reader_threads, thread_name_prefix="hidden-reader")
            self._ahead = (self.epoch, self.batch)
        while len(self._pending) < max(self.prefetch + 1, self.reader_threads):  # (every reader busy)
            self._pending.append(self._pool.submit(self._read, *self._ahead))
            self._ahead = self._after(*self._ahead)
        host = self._pending[0].result()  # (a failed read stays first: `next` raises again rather than skip it)
        self._pending.popleft()
        return host

    def _stage(self, host: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        """Copy (and decode) a batch on the side stream; (tensors, event the consumer waits on)."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        consumer = torch.cuda.current_stream(self.device)
        # start after the work already queued (the previous step), so the copy overlaps the step about to be queued
        # instead of competing with the previous one's tail (the allocator needs no such ordering: record_stream)
        self._copy_stream.wait_stream(consumer)
        with torch.cuda.stream(self._copy_stream):
            batch = self._to_device(host)
            ready = torch.cuda.Event()
            ready.record()
        for t in batch.values():
            t.record_stream(consumer)  # the allocator must not reuse them before the consumer is done
        return batch, ready

    def close(self) -> None:
        """Stop the reader (pending reads are dropped); iterating again restarts it at the current position. A
        resident stream keeps the rows it holds (a resume, `load_state_dict`, reads nothing again) until it is
        dropped (and past it, for the next stream on the same cache, where the process keeps them:
        `keep_resident_rows`)."""
        self._staged = self._unstaged = None
        for f in self._pending:
            f.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pending.clear()
        self._pool = None
        with self._opened_lock:
            for files in self._opened:
                while files:
                    files.popitem()[1].close()
            self._opened.clear()
        self._local = threading.local()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- reading (reader thread: file reads and copies into pinned buffers only) --

    def rows_of(self, epoch: int, batch: int) -> list[tuple[int, int]]:
        """(shard, row) of this rank's batch `batch` of `epoch`."""
        a = batch * self.G + self.rank * self.B
        return locate(self.info.shard_rows, self.seed, epoch, a, a + self.B)

    def _read(self, epoch: int, batch: int) -> dict[str, torch.Tensor]:
        info, B = self.info, self.B
        host = stored_buffers(info, B, pin_memory=self.pin)
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for slot, (shard, row) in enumerate(self.rows_of(epoch, batch)):
            by_shard.setdefault(shard, []).append((row, slot))
        tokens = {name: [None] * B for name in TOKEN_KEYS}
        for shard, picks in by_shard.items():
            picks.sort()
            self._read_hidden_rows(shard, picks, host)
            arrays = self._token_arrays(shard)
            for name in TOKEN_KEYS:
                for row, slot in picks:
                    tokens[name][slot] = arrays[name][row]
        for name in TOKEN_KEYS:
            host[name] = torch.from_numpy(np.stack(tokens[name]))
            if self.pin:
                host[name] = host[name].pin_memory()
        return host

    def _read_hidden_rows(self, shard: int, picks: list[tuple[int, int]], host: dict,
                          f: HiddenShardFile | None = None) -> None:
        f = f or self._hidden_file(shard)
        for j, lid in enumerate(self.info.layer_ids):
            for dst in ENCODINGS[self.info.quant].tensors:
                for row, slot in picks:
                    f.read_row(f"{dst}.L{lid}", row, host[dst][slot, :, j])

    def _caches(self) -> tuple[OrderedDict, OrderedDict]:
        """This thread's (shard → open HiddenShardFile, shard → token arrays): a file's read buffer is its own."""
        local = self._local
        if not hasattr(local, "files"):
            local.files, local.tokens = OrderedDict(), OrderedDict()
            with self._opened_lock:
                self._opened.append(local.files)
        return local.files, local.tokens

    def _hidden_file(self, shard: int) -> HiddenShardFile:
        """The shard's file, opened and checked against the manifest (the last two stay open)."""
        files = self._caches()[0]
        if shard in files:
            files.move_to_end(shard)
            return files[shard]
        f = files[shard] = open_shard(self.info, shard)
        while len(files) > 2:
            files.popitem(last=False)[1].close()
        return f

    def _token_arrays(self, shard: int) -> dict:
        tokens = self._caches()[1]
        if shard not in tokens:
            tokens[shard] = self._read_token_arrays(shard)
            while len(tokens) > 2:
                tokens.popitem(last=False)
        return tokens[shard]

    def _read_token_arrays(self, shard: int) -> dict:
        """Token shard `shard`, read whole and checked (its SHA-256, key, shard and rows)."""
        path = self.info.tokens_dir / token_shard_name(shard)
        redo = (f"it is not the token shard the hidden states were computed from; restore the token cache "
                f"{self.info.tokens_dir} (rebuild it with the recipe and corpus it was made from)")
        arrays = read_token_shard(path, sha256=self.info.tokens_sha256[shard], redo=redo)
        meta, rows = arrays["metadata"], arrays["input_ids"].shape[0]
        if (meta.get("key"), meta.get("shard"), rows) != (self.info.tokens_key, str(shard),
                                                           self.info.shard_rows[shard]):
            raise ShardError(f"{path}: not token shard {shard} of the cache's token cache "
                             f"{self.info.tokens_key[:12]} with {self.info.shard_rows[shard]} rows")
        return arrays

    # -- resident: the whole cache on the device, read once --
    # (in a process that asks for it, `keep_resident_rows`, read once for every stream of that process on that cache)

    def _kept_key(self) -> tuple:
        """What kept rows must match to serve this stream: the cache (its files by their digests, the layers read)
        and the device."""
        return self.info, str(self.device)

    def _gather(self, epoch: int, batch: int) -> dict[str, torch.Tensor]:
        """The batch `_read` + `_to_device` would make, taken from the rows held on the device."""
        if self._held is None:
            self._held = self._hold()
        rows = [int(self._first_row[shard]) + row for shard, row in self.rows_of(epoch, batch)]
        idx = torch.tensor(rows, dtype=torch.long)
        idx = idx.pin_memory().to(self.device, non_blocking=True) if self.pin else idx.to(self.device)
        picked = {name: t.index_select(0, idx) for name, t in self._held.items()}
        return self._to_device(picked, non_blocking=False)

    def _hold(self) -> dict[str, torch.Tensor]:
        """Every row of the cache (the layers read, in their stored encoding; the token rows, as `_to_device` makes
        them) read once — each row checked against its digest as a streamed read is — into tensors on the device:
        a shard a thread, `hold_threads` at once, each through a host buffer of its own of ≈ HOLD_CHUNK_BYTES (whole
        rows, at least one; the reads and digests release the GIL: one thread read 0.1–0.7 GB/s on an H100 host
        beside an evaluation). The first failure, or an interrupt, stops every thread before its next chunk and drops
        the shards not begun."""
        info = self.info
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # (the work queued before is not this read's)
        t0 = time.perf_counter()
        release_kept_rows()  # (another cache's, given back before these are read)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if resident_bytes(info) > free // 2:
                raise ValueError(f"{info.cache_dir}: holding the cache on {self.device} takes "
                                 f"{resident_bytes(info) / 1e9:.1f} GB, more than half of its {free / 1e9:.1f} GB "
                                 f"free: stream it (resident off)")
        held = stored_buffers(info, info.num_rows, device=self.device)
        first = np.concatenate([[0], np.cumsum(np.asarray(info.shard_rows, dtype=np.int64))])
        allocating = time.perf_counter() - t0  # (freeing kept rows, the free-memory check, the device's buffers)
        chunk = max(1, min(max(info.shard_rows, default=1), HOLD_CHUNK_BYTES // max(1, row_bytes(info))))
        copying = [0.0] * len(info.shard_rows)

        stop = threading.Event()  # (the first failure, or an interrupt: every thread stops before its next chunk)

        def one_shard(shard: int) -> dict | None:
            rows, host = info.shard_rows[shard], stored_buffers(info, chunk)
            f = open_shard(info, shard)
            try:
                for a in range(0, rows, chunk):
                    if stop.is_set():
                        return None
                    n = min(chunk, rows - a)
                    self._read_hidden_rows(shard, [(a + i, i) for i in range(n)], host, f)
                    t1 = time.perf_counter()
                    for name, t in host.items():  # (a blocking copy_: the stream synchronized before it returns)
                        held[name][first[shard] + a:first[shard] + a + n].copy_(t[:n])
                    copying[shard] += time.perf_counter() - t1
            finally:
                f.close()
            return self._read_token_arrays(shard)

        threads = hold_threads(sum(1 for r in info.shard_rows if r))
        pool = ThreadPoolExecutor(threads, thread_name_prefix="hold")
        futures = [pool.submit(one_shard, shard) for shard in range(len(info.shard_rows))]
        try:
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f.exception() for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                raise failed
            arrays = [f.result() for f in futures]
        except BaseException:
            stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # (the reads not begun dropped, the others stop at a chunk)
            futures = done = failed = None  # (a failure's traceback would otherwise hold `held` until a gc pass)
        t1 = time.perf_counter()
        for name in TOKEN_KEYS:
            t = torch.from_numpy(np.concatenate([np.asarray(a[name]) for a in arrays]))
            held[name] = (t.bool() if name == "loss_mask" else t.long()).to(self.device)
        self.held_read = {"bytes": resident_bytes(info), "seconds": time.perf_counter() - t0, "alloc_s": allocating,
                          "copy_s": sum(copying) / threads + time.perf_counter() - t1, "threads": threads}
        self._first_row = first
        if _KEPT["on"]:
            _KEPT.update(key=self._kept_key(), held=held, first=first)
        return held

    # -- to the device (calling thread) --

    def _to_device(self, host: dict[str, torch.Tensor], non_blocking: bool | None = None) -> dict[str, torch.Tensor]:
        dev, enc = self.device, ENCODINGS[self.info.quant]
        nb = self.pin if non_blocking is None else non_blocking
        (B, S), k, H = host["input_ids"].shape, len(self.info.layer_ids), self.info.width
        hidden_BSkH = enc.to_device({name: host[name] for name in enc.tensors}, H, dev, nb)
        out = {"hidden": hidden_BSkH.view(B, S, k * H)}
        for name in ("input_ids", "position_ids", "doc_ids"):
            out[name] = host[name].to(dev, non_blocking=nb).long()
        out["loss_mask"] = host["loss_mask"].to(dev, non_blocking=nb).bool()
        return out

    # -- resume --

    def state_dict(self) -> dict:
        """Small JSON-able position: the next batch handed out is batch `batch` of epoch `epoch`."""
        return {
            "version": STATE_VERSION, "seed": self.seed, "epoch": self.epoch, "batch": self.batch,
            "batches_per_epoch": self.batches_per_epoch, "world_size": self.W, "batch_rows": self.B,
            "global_batch_rows": self.G, "samples": (self.epoch * self.batches_per_epoch + self.batch) * self.G,
            "cache_key": self.info.key,
        }

    def load_state_dict(self, d: dict) -> None:
        """Continue from `d`. Another world_size × batch_rows split of the same global batch is equivalent."""
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"data state version {d.get('version')!r}, this code reads {STATE_VERSION}")
        if d["cache_key"] != self.info.key:
            raise ValueError(f"the run's data state is for cache key {d['cache_key'][:12]}, but {self.info.cache_dir} "
                             f"holds key {self.info.key[:12]}: resume on the cache the run trained on (CACHE= as its "
                             f"config.json records it, or leave CACHE= empty), or train a new RUN= on this one")
        if d["seed"] != self.seed:
            raise ValueError(f"data state has seed {d['seed']}, this stream {self.seed}: resume with seed={d['seed']}")
        if d["global_batch_rows"] != self.G:
            raise ValueError(
                f"data state has global batches of {d['global_batch_rows']} rows (world_size {d['world_size']} × "
                f"batch_rows {d['batch_rows']}), this stream {self.G} ({self.W} × {self.B}): the order would "
                f"differ; resume with world_size × batch_rows = {d['global_batch_rows']}")
        self.close()
        self.epoch, self.batch = int(d["epoch"]), int(d["batch"])


def fewer_rows(rows: int, world: int) -> str:
    """The other way out of a cache with fewer rows than one global batch, in make terms."""
    if rows >= world:
        return (f"or pass --batch_rows of at most {rows // world} (make train ARGS=--batch_rows=N; the recipe's "
                f"global batch must still divide by it)")
    return f"or train on at most {rows} processes (NPROC=)"
