"""The cache manifest: the one source of truth for what a cache holds.

`manifest.json` at a cache's root lists every shard with its status and the checksum of each of its files. A shard
that is not listed as committed does not exist, whatever files lie around. Writes are temp → fsync → rename, and
every read-modify-write of the manifest happens under a lock file created with O_EXCL (works on local disks and on
shared filesystems where flock does not), so several processes — ranks of one job, or machines sharing a
filesystem — can commit shards into one cache at once. Claims (`claims/shard-NNNNN.json`) with a lease let workers
split the shards without computing one twice; a dead worker's claim expires and a successor takes it over.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
import uuid
from pathlib import Path

MANIFEST_VERSION = 1
MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """The manifest is missing, corrupt, or does not fit what the caller expects."""


# --- hashing and atomic files --------------------------------------------------------------------------------


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def hash_obj(obj) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def sha256_file(path: str | Path, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(final: Path) -> Path:
    """A unique temp name beside `final` (same directory, so the rename is atomic)."""
    return final.with_name(f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def publish(tmp: Path, final: Path) -> None:
    """fsync a finished temp file, rename it over `final`, fsync the directory."""
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


def write_json_atomic(path: Path, obj, durable: bool = True) -> None:
    """Readers see the old or the new file, never a partial one. `durable=False` skips the fsyncs: for files that
    only report (a status snapshot), where an fsync can wait behind gigabytes another thread is flushing."""
    tmp = temp_path(path)
    tmp.write_text(json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n")
    if durable:
        publish(tmp, path)
    else:
        os.replace(tmp, path)


# --- the lock ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(cache: Path, stale_s: float = 60.0, timeout_s: float = 120.0):
    """Hold `<cache>/.lock` for a short read-modify-write. A lock older than `stale_s` is broken (its holder died)."""
    lock = cache / ".lock"
    deadline = time.monotonic() + timeout_s
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            os.write(fd, token.encode())
            os.close(fd)
            break
        except FileExistsError:
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                continue
            if age > stale_s:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
                continue
            if time.monotonic() > deadline:
                raise ManifestError(
                    f"{lock} has been held for {age:.0f}s; if no process is writing this cache, delete it"
                ) from None
            time.sleep(0.01)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            if lock.read_text() == token:
                os.unlink(lock)


# --- read / create / merge -----------------------------------------------------------------------------------


def read_manifest(cache: str | Path) -> dict:
    path = Path(cache) / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{path} not found: {cache} is not a cache (run `make tokenize` / `make extract`)")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: corrupt JSON ({e}); restore it or rebuild the cache") from None
    if m.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"{path}: manifest version {m.get('version')!r}, this code reads {MANIFEST_VERSION}")
    return m


def open_cache(cache: Path, kind: str, key: str, producer: dict, config: dict, num_shards: int | None) -> dict:
    """Create the cache's manifest, or check that an existing one has the same key (never overwrite another)."""
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "claims").mkdir(exist_ok=True)
    with locked(cache):
        if (cache / MANIFEST).exists():
            m = read_manifest(cache)
            if m["key"] != key or m["kind"] != kind:
                diff = diff_producers(m.get("producer", {}), producer)
                raise ManifestError(
                    f"{cache} already holds a different {m['kind']} cache (key {m['key'][:12]} ≠ {key[:12]}; "
                    f"differs in: {', '.join(diff) or 'code format'}). Use another CACHE= or delete it deliberately."
                )
            return m
        m = {
            "version": MANIFEST_VERSION,
            "kind": kind,
            "key": key,
            "producer": producer,
            "config": config,
            "num_shards": num_shards,
            "shards": [],
            "summary": {},
            "created_at": time.time(),
        }
        write_json_atomic(cache / MANIFEST, m)
        return m


def diff_producers(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Names of the producer fields that differ (nested dicts flattened with dots)."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += diff_producers(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out


def merge_shard(m: dict, entry: dict, redo: bool = False) -> dict:
    """Pure: return `m` with `entry` committed. Committing a shard twice with other bytes raises, unless `redo`."""
    index = entry["index"]
    if m.get("num_shards") is not None and not 0 <= index < m["num_shards"]:
        raise ManifestError(f"shard {index} is outside 0..{m['num_shards'] - 1}")
    shards = [s for s in m["shards"] if s["index"] != index]
    old = [s for s in m["shards"] if s["index"] == index]
    if old and not redo and old[0]["status"] == "committed" and old[0]["files"] != entry["files"]:
        raise ManifestError(
            f"shard {index} is already committed with other bytes: refusing to overwrite it (use SHARD={index} to redo)"
        )
    shards.append(dict(entry, status="committed"))
    shards.sort(key=lambda s: s["index"])
    return dict(m, shards=shards)


def commit_shard(cache: Path, entry: dict, redo: bool = False, summary: dict | None = None) -> dict:
    """Add one shard's entry (files already published) to the manifest under the lock."""
    with locked(cache):
        m = merge_shard(read_manifest(cache), entry, redo=redo)
        if summary is not None:
            m["summary"] = summary
        write_json_atomic(cache / MANIFEST, m)
    return m


def update_manifest(cache: Path, **fields) -> dict:
    with locked(cache):
        m = read_manifest(cache)
        m.update(fields)
        write_json_atomic(cache / MANIFEST, m)
    return m


def committed(m: dict) -> dict[int, dict]:
    return {s["index"]: s for s in m["shards"] if s["status"] == "committed"}


# --- claims: split shards between workers without doing one twice --------------------------------------------


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _claim_path(cache: Path, index: int) -> Path:
    return cache / "claims" / f"shard-{index:05d}.json"


def try_claim(cache: Path, index: int, lease_s: float, redo: bool = False) -> bool:
    """Claim shard `index` unless it is committed (and not being redone) or someone holds a live lease on it."""
    with locked(cache):
        if index in committed(read_manifest(cache)) and not redo:
            return False
        path = _claim_path(cache, index)
        if path.exists():
            try:
                held = json.loads(path.read_text())
            except (json.JSONDecodeError, FileNotFoundError):
                held = {"expires": 0}
            if held.get("expires", 0) > time.time() and held.get("worker") != worker_id() and alive(held):
                return False
        write_json_atomic(path, {"worker": worker_id(), "expires": time.time() + lease_s, "index": index})
        return True


def alive(claim: dict) -> bool:
    """False only when the claim's worker ran on this host and its process is gone (no need to wait for the lease)."""
    host, _, pid = str(claim.get("worker", "")).rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another machine: only its lease tells
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def renew_claim(cache: Path, index: int, lease_s: float) -> None:
    path = _claim_path(cache, index)
    with locked(cache):
        write_json_atomic(path, {"worker": worker_id(), "expires": time.time() + lease_s, "index": index})


def release_claim(cache: Path, index: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_claim_path(cache, index))
