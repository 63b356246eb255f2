"""Which shards this worker computes: each is claimed (a lease in the cache, `manifest.try_claim`) before it is
computed, so ranks of one job and machines sharing the cache never compute a shard twice.

`claimed_shards` yields the shards this worker gets, in passes over the to-do list: each rank starts on its own
stripe, then helps with the rest. A shard is claimed and its input loaded one shard ahead, on a thread of its own: a
claim is fsynced, and an fsync can wait behind a shard write's flush — the thread that feeds the device must not.
After a pass, the shards still not committed are looked at again (`unfinished`): a dead holder's or an expired lease's
are taken over; those that other live processes hold are waited for when they belong to this job (its ranks) or with
`wait_claims`, and otherwise end the run with an error (`IncompleteRun`) that names them and their holders.

Each shard comes with its `Claim`: the computing thread keeps the lease alive (`keep` renews it once a third of it has
passed) and releases it if the compute fails; the shard writer releases it once the shard is committed (or its write
failed). A shard claimed here and never handed out (the run stopped: an error, an interrupt) is released, and so is
one whose input failed to load: another run or worker may take it at once. A stop by a signal can come between any
two statements, so a stopped worker ends with `release_held`: every claim it still holds in the cache, once its
writes are done.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .manifest import (
    committed,
    holders,
    read_claim,
    read_manifest,
    release_claim,
    renew_claim,
    try_claim,
    worker_id,
    worker_info,
)
from .progress import log


class IncompleteRun(ValueError):
    """The run did its part, but shards that others hold are not committed yet."""


class Claim:
    """This worker's lease on shard `index`, taken at `at`."""

    def __init__(self, cache: Path, index: int, lease_s: float, at: float):
        self.cache, self.index, self.lease_s, self.at = cache, index, lease_s, at

    def keep(self) -> None:
        """Renew the lease once a third of it has passed (a long shard, or one claimed ahead a while ago)."""
        if time.time() - self.at > self.lease_s / 3:
            renew_claim(self.cache, self.index, self.lease_s)
            self.at = time.time()

    def release(self) -> None:
        release_claim(self.cache, self.index)


def release_held(cache: Path) -> list[int]:
    """Release every claim this process still holds in `cache` (call it once its shard writes are drained and it
    claims nothing more): the shards a stop left claimed, whatever statement it came at. Their indices."""
    released = []
    for p in sorted((cache / "claims").glob("shard-*.json")) if (cache / "claims").is_dir() else []:
        claim = read_claim(p)
        if claim is not None and claim.get("worker") == worker_id():
            release_claim(cache, claim["index"])
            released.append(claim["index"])
    return released


def shard_order(todo: list[int], rank: int, world: int) -> list[int]:
    """Each rank starts on its own stripe, then helps with the rest (claims prevent double work)."""
    mine = [i for i in todo if i % world == rank]
    return mine + [i for i in todo if i % world != rank]


def claimed_shards(cache: Path, todo: list[int], load: Callable[[int], object], *, rank: int, world: int,
                   lease_s: float, redo: bool, wait_claims: bool) -> Iterator[tuple[Claim, object]]:
    """(claim, `load(index)`) of each shard of `todo` this worker gets, until every one is committed or (unless
    waiting) held by another live process. `redo`: committed shards are claimed (and redone) too. The caller keeps
    (`Claim.keep`) and releases each claim, or hands it to whoever does (the shard writer)."""

    def prepare(index: int):
        """(claim, loaded input) of shard `index`, claimed for this worker; None when it is committed or another live
        worker holds it."""
        if not try_claim(cache, index, lease_s, redo=redo):
            return None
        claim = Claim(cache, index, lease_s, time.time())
        try:
            return claim, load(index)
        except BaseException:
            claim.release()
            raise

    order = shard_order(todo, rank, world)
    ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-claim")  # claims and input reads only
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
                    yield got
            order = unfinished(cache, [i for i in todo if i not in handed], rank, lease_s, wait_claims)
    finally:  # done, or stopped (an error, an interrupt): a shard claimed here and never handed out is released
        if waiting is not None:
            try:
                got = waiting[1].result()
            except BaseException:  # noqa: BLE001 - its own failure released it
                got = None
            if got is not None:
                got[0].release()
        ahead.shutdown()


def unfinished(cache: Path, todo: list[int], rank: int, lease_s: float, wait_claims: bool) -> list[int]:
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
        if not (wait_claims or all(job and c.get("job") == job for c in held.values())):
            from .config import shard_list

            who = sorted({f"{c.get('worker')} (rank {c.get('rank', '?')})" for c in held.values()})
            until = max(c["expires"] for c in held.values())
            raise IncompleteRun(
                f"{cache}: this process finished its shards, but {shard_list(held)} are still claimed by "
                f"{', '.join(who)} (leases until {time.strftime('%H:%M:%S', time.localtime(until))}): the cache "
                f"is not complete. Rerun `make extract CACHE={cache}` when they end (a dead holder's shards are "
                f"taken over), or pass --wait_claims=1 to wait for them")
        log(f"[rank {rank}] waiting for shards {sorted(held)} held by other live processes")
        time.sleep(min(5.0, lease_s / 4))
