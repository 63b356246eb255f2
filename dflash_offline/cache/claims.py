"""Which shards this worker computes: each is claimed (a lease in the cache, `try_claim`) before it is
computed, so ranks of one job and machines sharing the cache never compute a shard twice.

`claimed_shards` yields the shards this worker gets: each rank starts on its own stripe, then helps with the rest,
a shard a process at a time from the end of the list, planned again from the manifest each time. A shard is claimed
and its input loaded one shard ahead, on a thread of its own: a claim is fsynced, and an fsync can wait behind a shard write's flush — the thread that feeds the device must not.
After a pass, the shards still not committed are looked at again (`unfinished`): a dead holder's or an expired lease's
are taken over; those that other live processes hold are waited for when they belong to this job (its ranks) or with
`wait_claims`, and otherwise end the run with an error (`IncompleteRun`) that names them and their holders.

Each shard comes with its `Claim`: the computing thread keeps the lease alive (`keep` renews it once a third of it has
passed) and releases it if the compute fails; the shard writer releases it once the shard is committed (or its write
failed). A shard claimed here and never handed out (the run stopped: an error, an interrupt) is released, and so is
one whose input failed to load: another run or worker may take it at once. A stop by a signal can come between any
two statements, so a stopped worker ends with `release_held`: every claim it still holds in the cache, once its
writes are done.

A claim is `claims/shard-NNNNN.json` in the cache, naming its worker (host, pid, pid space: `fsio.worker_info`) and
its lease; it is taken, renewed and judged under the cache's lock. A dead worker's claim (same host and pid space,
its pid gone) is taken over at once, any other once its lease has expired. `sweep()` — run by every writer at start —
removes what dead writers left: temp files (same host: the pid is gone; other hosts: untouched for a day) and claims
whose worker is dead or whose lease expired.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import fsio
from .fsio import locked, pid_alive, remove_dead_temps, write_json_atomic
from .manifest import committed, read_manifest, shard_list

# --- one claim -----------------------------------------------------------------------------------------------


def _claim_path(cache: Path, index: int) -> Path:
    return cache / "claims" / f"shard-{index:05d}.json"


def read_claim(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, FileNotFoundError):
        return None


def _write_claim(cache: Path, index: int, lease_s: float) -> None:
    now = time.time()
    write_json_atomic(_claim_path(cache, index), {**fsio.worker_info(), "index": index, "expires": now + lease_s,
                                                  "lease_s": lease_s, "renewed_at": now})


def claim_state(claim: dict | None) -> str:
    """"live", "dead" (its process is gone: same host) or "expired" (its lease ran out)."""
    if claim is None:
        return "expired"
    if not alive(claim):
        return "dead"
    return "live" if claim.get("expires", 0) > time.time() else "expired"


def try_claim(cache: Path, index: int, lease_s: float, redo: bool = False) -> bool:
    """Claim shard `index` unless it is committed (and not being redone) or someone holds a live lease on it. A shard
    committed already costs no lock (the manifest is read before it is taken); the decision is made on a read under
    the lock (a file's attributes can be cached on a shared filesystem: only its contents tell)."""
    if not redo and index in committed(read_manifest(cache)):
        return False
    with locked(cache):
        if not redo and index in committed(read_manifest(cache)):
            return False
        held = read_claim(_claim_path(cache, index))
        if held is not None and held.get("worker") != fsio.worker_id() and claim_state(held) == "live":
            return False
        _write_claim(cache, index, lease_s)
        return True


def holders(cache: Path, indices) -> dict[int, dict]:
    """The live claims on these shards by other processes: index → claim."""
    out = {}
    for i in indices:
        c = read_claim(_claim_path(cache, i))
        if c is not None and c.get("worker") != fsio.worker_id() and claim_state(c) == "live":
            out[i] = c
    return out


def alive(claim: dict) -> bool:
    """False only when the claim's worker ran on this host and its process is gone (no need to wait for the lease)."""
    host, pid = (str(claim.get("worker", "")).split(":") + [""])[:2]  # host:pid[:pid space tag]
    return pid_alive(host, pid, claim.get("boot"))


def renew_claim(cache: Path, index: int, lease_s: float) -> None:
    with locked(cache):
        _write_claim(cache, index, lease_s)


def release_claim(cache: Path, index: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_claim_path(cache, index))


def sweep(cache: Path, log=print) -> dict:
    """Remove what dead writers left in `cache`: temp files (same host: pid gone; other hosts: untouched for a day),
    claims whose worker is dead or whose lease expired, and status files of dead same-host processes that never
    finished. Returns counts; logs one line when it removed anything."""
    removed = {"temp_files": 0, "temp_bytes": 0, "claims": 0, "status_files": 0}
    for d in (cache, cache / "claims"):
        n, nbytes = remove_dead_temps(d)
        removed["temp_files"] += n
        removed["temp_bytes"] += nbytes
    with locked(cache):  # a claim is taken over under the lock: never remove a successor's fresh claim
        for p in sorted((cache / "claims").glob("shard-*.json")) if (cache / "claims").is_dir() else []:
            if claim_state(read_claim(p)) != "live":
                p.unlink(missing_ok=True)
                removed["claims"] += 1
    for p in sorted(cache.glob("status-*.json")):  # `make status` would show them as dead writers for good
        with contextlib.suppress(OSError, ValueError):
            st = json.loads(p.read_text())
            if st.get("state") == "running" and not pid_alive(st.get("host", ""), st.get("pid", ""), st.get("boot")):
                p.unlink(missing_ok=True)
                removed["status_files"] += 1
    if any(removed[k] for k in ("temp_files", "claims", "status_files")):
        log(f"{cache}: removed what dead writers left: {removed['temp_files']} temp file(s) "
            f"({removed['temp_bytes'] / 1e6:.1f} MB), {removed['claims']} expired or dead claim(s), "
            f"{removed['status_files']} status file(s)")
    return removed


# --- the shards this worker computes --------------------------------------------------------------------


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
        if claim is not None and claim.get("worker") == fsio.worker_id():
            release_claim(cache, claim["index"])
            released.append(claim["index"])
    return released


def shard_order(todo: list[int], rank: int, world: int) -> list[int]:
    """A rank's own stripe: where it starts (then it helps with the rest, `claimed_shards`)."""
    return [i for i in todo if i % world == rank]


def claimed_shards(cache: Path, todo: list[int], load: Callable[[int], object], *, rank: int, world: int,
                   lease_s: float, redo: bool, wait_claims: bool, log=print) -> Iterator[tuple[Claim, object]]:
    """(claim, `load(index)`) of each shard of `todo` this worker gets, until every one is committed or (unless
    waiting) held by another live process. `redo`: committed shards are claimed (and redone) too. The caller keeps
    (`Claim.keep`) and releases each claim, or hands it to whoever does (the shard writer). `log` says what is
    waited for."""

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

    def rest() -> list[int]:
        """The shards left, `world` at a time from the end of the list (the stripes' owners work from their starts),
        planned again from the manifest each time: a plan made once would walk thousands of shards other ranks have
        committed since."""
        left = unfinished(cache, [i for i in todo if i not in handed], rank, lease_s, wait_claims, log)
        return left[: -max(2, world) - 1: -1]

    handed = set()  # shards this worker computed (their writes may still be in flight)
    order = shard_order(todo, rank, world) or rest()  # (an empty stripe: a rerun whose shards were one rank's)
    ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-claim")  # claims and input reads only
    waiting = None  # (index, future) not handed out
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
            order = rest()
    finally:  # done, or stopped (an error, an interrupt): a shard claimed here and never handed out is released
        if waiting is not None:
            try:
                got = waiting[1].result()
            except BaseException:  # noqa: BLE001 - its own failure released it
                got = None
            if got is not None:
                got[0].release()
        ahead.shutdown()


def unfinished(cache: Path, todo: list[int], rank: int, lease_s: float, wait_claims: bool, log=print) -> list[int]:
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
        job = fsio.worker_info()["job"]
        if not (wait_claims or all(job and c.get("job") == job for c in held.values())):
            who = sorted({f"{c.get('worker')} (rank {c.get('rank', '?')})" for c in held.values()})
            until = max(c["expires"] for c in held.values())
            raise IncompleteRun(
                f"{cache}: this process finished its shards, but {shard_list(held)} are still claimed by "
                f"{', '.join(who)} (leases until {time.strftime('%H:%M:%S', time.localtime(until))}): the cache "
                f"is not complete. Rerun `make extract CACHE={cache}` when they end (a dead holder's shards are "
                f"taken over), or pass --wait_claims=1 (make extract ARGS=--wait_claims=1) to wait for them")
        log(f"[rank {rank}] waiting for shards {sorted(held)} held by other live processes")
        time.sleep(min(5.0, lease_s / 4))
