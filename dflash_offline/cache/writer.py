"""Hidden-state shards written in the background while the device computes the next ones: `HiddenShardWriter`.

The extraction hands each computed shard over (`submit`) and goes on. Up to `depth` shards are written at once, each
by its own thread (file I/O and hashing only, both release the GIL; never compute): a disk write as slow as a shard's
compute, or one slow fsync, does not stall the device. One write is: wait for the shard's device→host copies (its end
event, on CUDA), `shards.write_hidden_shard` (the one owner of the file format: temp → fsync → rename), the manifest
commit, then the release of the shard's claim — committed or failed, the shard is no longer this worker's.

Host memory is bounded: a shard's tensors are copied into a set of host buffers (`ShardCopy`, pinned on CUDA), and
`depth + 1` sets are reused in a ring. Shard j fills set j % (depth + 1) while the sets of shards j - 1 .. j - depth
may still be going to disk: the write of shard j - depth - 1, the last user of that set, finished before shard j - 1
was handed over (`submit` lets at most `depth` writes be in flight).

A failed write (a full disk, an I/O error) stops the run at the next `submit`, not after every shard is computed;
`drain` waits for every write (a failed write never keeps the others from committing), logs each failure and raises
the first.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import torch

from . import shards
from .claims import release_claim
from .encodings import encode_layer
from .manifest import commit_shard


class ShardCopy:
    """One shard on its way from the device to the host: each batch's tapped layers are encoded (`encodings.encode_layer`)
    and copied into host buffers, [rows, ...] per tensor (pinned on CUDA), allocated on first use or reused from the
    writer's ring. On CUDA the encode and the copies run on a side stream that overlaps the next batch's forward, and
    nothing synchronizes: the write waits for the shard's end event. `projection` (a projected cache): layer id → P
    [H, k] float32 on the device; each layer's states are stored as h @ P, computed in fp32, then encoded."""

    def __init__(self, rows: int, quant: str, layer_ids: list[int], stream, projection: dict | None = None):
        self.rows, self.quant, self.layer_ids, self.stream = rows, quant, layer_ids, stream
        self.projection = projection
        self.tensors: dict[str, torch.Tensor] = {}
        # per row and tapped layer, the tokens whose state holds an inf or NaN (checked before the shard is written)
        self.nonfinite = torch.zeros((rows, len(layer_ids)), dtype=torch.int32, pin_memory=stream is not None)
        self.events = None  # (start, end) CUDA events of the shard's device work
        self.t0 = 0.0

    def start(self) -> ShardCopy:
        self.t0 = time.time()
        if self.stream is not None:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        return self

    def add(self, r0: int, taps: list[torch.Tensor], real: int) -> None:
        """Rows r0 .. r0 + real of the shard: the first `real` rows of each tapped layer's [B, S, H] output."""
        cuda = self.stream is not None
        if cuda:  # the copies start once this batch's forward is done, and overlap the next one
            ready = torch.cuda.Event()
            ready.record()
            self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream) if cuda else nullcontext():
            for j, (lid, x) in enumerate(zip(self.layer_ids, taps, strict=True)):
                if cuda:
                    x.record_stream(self.stream)  # not reused by the next forward before this stream is done
                bad = (~torch.isfinite(x[:real])).any(dim=-1).sum(dim=-1, dtype=torch.int32)
                self.nonfinite[r0:r0 + real, j].copy_(bad, non_blocking=cuda)
                x = x[:real] if self.projection is None else x[:real].float() @ self.projection["P"][lid]
                for name, v in encode_layer(x, lid, self.quant).items():
                    if name not in self.tensors:
                        self.tensors[name] = torch.empty((self.rows, *v.shape[1:]), dtype=v.dtype, pin_memory=cuda)
                    self.tensors[name][r0:r0 + real].copy_(v, non_blocking=cuda)

    def end(self) -> float:
        """Marks the end of the shard's device work; the host seconds since `start` (on CUDA the writer replaces
        them with the device time between the events)."""
        if self.events is not None:
            self.events[1].record(self.stream)
        return time.time() - self.t0


class HiddenShardWriter:
    """Writes and commits the shards of one cache, `depth` at once, on background threads."""

    def __init__(self, cache: Path, key: str, quant: str, layer_ids: list[int], depth: int, redo: bool, rank: int,
                 device: torch.device, projection: dict | None = None, log=print):
        self.log = log  # a line per committed shard and per failed write
        self.cache, self.key, self.quant, self.layer_ids = cache, key, quant, layer_ids
        # a projected cache: {"P": layer id → P [H, k] on the device, "sha256": its file's}, recorded in every shard
        self.projection = projection
        self.depth, self.redo, self.rank = depth, redo, rank
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # device→host copies
        self.io = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="shard-writer")
        self.pending: list[Future] = []
        self.ring: list[ShardCopy | None] = [None] * (depth + 1)
        self.submitted = 0
        self.timings: list[tuple[float, float, float]] = []  # (compute s, write s, computed at) per written shard
        self.waited_s = 0.0  # time the caller spent waiting for writes

    def start(self, rows: int) -> ShardCopy:
        """The next shard's copy, started; its host buffers are the ring's set unless that holds another row count
        (the last shard)."""
        shard = ShardCopy(rows, self.quant, self.layer_ids, self.stream, self.projection)
        used = self.ring[self.submitted % len(self.ring)]
        if used is not None and used.rows == rows:
            shard.tensors = used.tensors
        return shard.start()

    def submit(self, index: int, shard: ShardCopy, entry: dict) -> None:
        """Hand shard `index` over once its last batch is added: written, committed with `entry` (plus its files and
        timings) and its claim released in the background. Waits while `depth` writes are in flight; raises the error
        of a write that failed."""
        entry = dict(entry, compute_seconds=shard.end())
        self.ring[self.submitted % len(self.ring)] = shard
        self.submitted += 1
        tensors = dict(shard.tensors)
        t = time.time()
        while len(self.pending) >= self.depth:
            oldest = self.pending[0]
            try:
                self.timings.append(oldest.result())
            finally:  # a failed write leaves with its error; one a stop (a signal) cut the wait for stays for `drain`
                if oldest.done():
                    self.pending.pop(0)
        self.waited_s += time.time() - t
        for f in self.pending:  # a failed write (a full disk) stops the run now
            if f.done() and f.exception() is not None:
                raise f.exception()
        self.pending.append(self.io.submit(self._write, index, tensors, entry, shard.events, shard.nonfinite))

    def drain(self) -> list[tuple[float, float, float]]:
        """Wait for every write; the timings of all. Every failure is logged; the first is raised once all are done."""
        t, errors = time.time(), []
        for f in self.pending:
            try:
                self.timings.append(f.result())
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                self.log(f"[rank {self.rank}] a shard write failed: {e!r}")
        self.pending.clear()
        self.io.shutdown()
        self.waited_s += time.time() - t
        if errors:
            raise errors[0]
        return self.timings

    def abort(self) -> None:
        """After a failure elsewhere: finished shards still being written are kept (their errors only logged)."""
        try:
            self.drain()
        except Exception:  # noqa: BLE001 - logged there
            pass

    def nonfinite_error(self, index: int, nonfinite: torch.Tensor) -> shards.ShardError:
        rows, layers = (nonfinite > 0).nonzero(as_tuple=True)
        where = ", ".join(f"row {r} layer {self.layer_ids[j]}" for r, j in zip(rows[:4].tolist(), layers[:4].tolist(),
                                                                                strict=True))
        return shards.ShardError(
            f"shard {index}: the target's tapped states hold inf or NaN ({int(nonfinite.sum())} token-layers; "
            f"{where}{' …' if len(rows) > 4 else ''}); the shard was not written (a cache must not train on them): the "
            f"target overflows in its dtype or its weights are damaged — check it with a plain forward on that row, "
            f"extract with --dtype=float32, or drop those records from the corpus; shards already committed are kept")

    def shard_metadata(self, index: int) -> dict:
        return shards.hidden_shard_metadata(index, self.key, self.projection and self.projection["sha256"])

    def _write(self, index: int, tensors: dict, entry: dict, events, nonfinite) -> tuple[float, float, float]:
        if events is not None:  # the shard's device→host copies are done once its end event is
            events[1].synchronize()
            entry = dict(entry, compute_seconds=events[0].elapsed_time(events[1]) / 1000)
        t = computed_at = time.time()
        name = shards.hidden_shard_name(index)
        try:
            if nonfinite.any():
                raise self.nonfinite_error(index, nonfinite)
            tmp, rec = shards.stage_hidden_shard(self.cache / name, tensors, self.quant, self.layer_ids,
                                                 self.shard_metadata(index))
            files = {name: rec}  # published with its entry, under the lock (`commit_shard`)
            commit_shard(self.cache, dict(entry, files=files, write_seconds=time.time() - t, committed_at=time.time()),
                         redo=self.redo, staged={name: tmp})
        finally:  # committed or failed, the shard is no longer this worker's
            release_claim(self.cache, index)
        write_s = time.time() - t
        self.log(f"[rank {self.rank}] shard {index} committed ({files[name]['bytes'] / 1e6:.1f} MB, "
            f"{entry['compute_seconds']:.1f}s compute, {write_s:.1f}s write)")
        return entry["compute_seconds"], write_s, computed_at
