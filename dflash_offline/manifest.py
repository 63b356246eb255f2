"""The cache manifest: the one source of truth for what a cache holds.

`manifest.json` at a cache's root lists every shard with its status and the checksum of each of its files. A shard
that is not listed as committed does not exist, whatever files lie around. Writes are temp → fsync → rename, and
every read-modify-write of the manifest happens under a lock file created with O_EXCL (works on local disks and on
shared filesystems where flock does not), so several processes — ranks of one job, or machines sharing a
filesystem — can commit shards into one cache at once. Claims (`claims/shard-NNNNN.json`) with a lease let workers
split the shards without computing one twice; a dead worker's claim expires and a successor takes it over.

Crashes leave nothing that blocks or grows: the lock, every temp file and every claim carry their writer's host and
pid (the lock and claims also its pid space, `boot_id`). A lock whose holder is gone (same host and pid space) is
broken at once, with a message; any other when it is older than `stale_s`.

The manifest is untrusted input: `read_manifest` type-checks every field the code reads before any is used, keeps
shard file names inside the cache, and bounds counts by what the manifest lists (`schema_error`). `sweep()` — run by every writer at start — removes temp files and claims of dead writers (same
host: the pid is gone; other hosts: the lease has expired, or the temp file has not changed for a day).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import stat
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


HASH_THREADS = 8  # files make verify hashes at once: enough to keep a disk (or a network filesystem) busy, bounded memory


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


TEMP_MARK = ".tmp~"  # temp names: .<final name>.tmp~<host>~<pid>~<pid space tag>~<random> (older: no tag)


def temp_path(final: Path) -> Path:
    """A unique temp name beside `final` (same directory, so the rename is atomic), naming its writer."""
    return final.with_name(f".{final.name}{TEMP_MARK}{socket.gethostname()}~{os.getpid()}~{boot_tag()}~"
                           f"{uuid.uuid4().hex[:8]}")


def temp_writer(path: Path) -> tuple[str, int, str | None] | None:
    """(host, pid, pid space tag or None for older names) of the process writing temp file `path`; None when `path`
    is not one of ours."""
    parts = path.name.split(TEMP_MARK, 1)[-1].split("~") if TEMP_MARK in path.name else []
    if len(parts) not in (3, 4) or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2] if len(parts) == 4 else None


def publish(tmp: Path, final: Path) -> None:
    """fsync a finished temp file, rename it over `final`, fsync the directory."""
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


@contextlib.contextmanager
def atomic_dir(final: Path):
    """Write a directory atomically (checkpoints, exports): yields a temp directory beside `final`, named for its
    writer so that a killed writer's is removed by the next run (`remove_dead_temps`); when the body returns, every
    file in it is fsynced and it is renamed into place, replacing an existing `final` (moved to a temp name first, then
    deleted); when the body fails, it is removed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(final)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                fsync_path(f)
        fsync_path(tmp)
        old = final.rename(temp_path(final)) if final.exists() else None
        os.rename(tmp, final)
        fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_json_atomic(path: Path, obj, durable: bool = True) -> None:
    """Readers see the old or the new file, never a partial one. `durable=False` skips the fsyncs: for files that
    only report (a status snapshot), where an fsync can wait behind gigabytes another thread is flushing. A failed
    write removes its temp file."""
    write_text_atomic(path, json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n", durable)


def write_text_atomic(path: Path, text: str, durable: bool = True) -> None:
    """`write_json_atomic` for any text."""
    tmp = temp_path(path)
    try:
        tmp.write_text(text)
        if durable:
            publish(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --- the lock ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(cache: Path, stale_s: float = 60.0, timeout_s: float = 120.0):
    """Hold `<cache>/.lock` for a short read-modify-write. A lock whose holder is gone is broken: at once when the
    holder ran in this host's pid space (same host and `boot_id`, its pid is not alive), after `stale_s` otherwise;
    both say so. Every wait ends by `timeout_s`; a `.lock` that is not a file this code writes (a symlink, a
    directory) is refused at once."""
    lock = cache / ".lock"
    deadline = time.monotonic() + timeout_s
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}:{boot_id()}"
    while not _try_lock(lock, token):
        holder = _lock_holder(lock)
        if holder is not None and _break_if_stale(lock, *holder, stale_s):
            continue
        if time.monotonic() > deadline:
            who, age = (f"{holder[0]}:{holder[1]}", holder[3]) if holder else ("a process that keeps replacing it", 0)
            raise ManifestError(f"{lock} has been held by {who} for {age:.0f}s; if no process is writing this cache, "
                                f"delete it")
        time.sleep(0.01)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            if lock.read_text() == token:
                os.unlink(lock)


def _try_lock(lock: Path, token: str) -> bool:
    """Create `lock` holding `token`; False if it exists. The token is written to a temp file and hard-linked into
    place (one winner, on local and shared filesystems), so a lock never exists without its holder: a signal or a
    full disk between creating and writing it would leave an empty lock every writer waits `stale_s` on. Where the
    filesystem has no hard links, O_EXCL and a write."""
    tmp = temp_path(lock)
    try:
        tmp.write_text(token)
        os.link(tmp, lock)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return True


def _lock_holder(lock: Path) -> tuple[str, str, str | None, float] | None:
    """(host, pid, boot id or None for a lock written without one, age in s) of the lock's holder; None when it
    vanished meanwhile. A `.lock` that is not a regular file is refused: it is not a lock, and a dangling symlink
    would look held forever."""
    try:
        st = os.lstat(lock)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"{lock} is not a lock file this code writes (a symlink or a directory): it would "
                                f"block every writer of {lock.parent}; delete it")
        text = lock.read_text()
    except FileNotFoundError:
        return None
    parts = text.split(":")  # host:pid:token:boot (older writers: host:pid:token)
    host, pid = (parts + ["", ""])[:2]
    return host, pid, parts[3] if len(parts) >= 4 else None, time.time() - st.st_mtime


def _break_if_stale(lock: Path, host: str, pid: str, boot: str | None, age: float, stale_s: float) -> bool:
    """Remove a lock whose holder is gone (its pid, in this pid space) or that is older than `stale_s`, saying so."""
    if not (age > 0.2 and not pid_alive(host, pid, boot) or age > stale_s):
        return False
    why = f"pid {pid} is gone" if age <= stale_s else f"{age:.0f}s old"
    print(f"breaking the stale lock {lock} left by {host}:{pid} ({why})", flush=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock)
    return True


# --- read / create / merge -----------------------------------------------------------------------------------


def read_manifest(cache: str | Path, need: tuple[str, ...] = ()) -> dict:
    """The manifest of `cache`, every field it has checked for type (`schema_error`) before any is used: a hand-edited
    or damaged one is one error naming the file, the field, what was found and what to do. `need`: dotted fields
    (`OPTIONAL_FIELDS`) the caller reads, refused when absent."""
    path = Path(cache) / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{path} not found: {cache} is not a cache (run `make tokenize` / `make extract`)")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: corrupt JSON ({e}); restore it or rebuild the cache") from None
    if not isinstance(m, dict) or m.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"{path}: manifest version {m.get('version') if isinstance(m, dict) else m!r}, this code "
                            f"reads {MANIFEST_VERSION}")
    if bad := schema_error(m):
        raise ManifestError(f"{path}: {bad}: the manifest was edited or damaged; restore it (or rebuild the cache)")
    return require(m, path, need)


def require(m: dict, path: Path, need: tuple[str, ...]) -> dict:
    """`m` if it has every dotted field of `need` (`OPTIONAL_FIELDS`, already type-checked); else one error naming
    the first missing one."""
    if missing := [f for f in need if field(m, f) is _ABSENT]:
        raise ManifestError(f"{path}: {missing[0]} is missing (expected {OPTIONAL_FIELDS[missing[0]][1]}): the "
                            f"manifest was edited or damaged; restore it (or rebuild the cache)")
    return m


def _is_int(v, least: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_ints(v) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


def _is_sha(v) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def is_file_name(name: str) -> bool:
    """A shard file name a manifest may list: a plain name inside the cache directory (letters, digits, `._-`, not
    starting with a dot: no separators, no `..`, no absolute path, none of the hidden temp and lock files)."""
    return isinstance(name, str) and bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}", name))


_OBJ = (lambda v: isinstance(v, dict), "an object")
_STR = (lambda v: isinstance(v, str) and v != "", "a non-empty string")
# field → (check, what it must be); shards[] entries and their files are checked by `schema_error` below
TOP_FIELDS = {"kind": (lambda v: v in ("tokens", "hidden"), "'tokens' or 'hidden'"), "key": _STR,
              "producer": _OBJ, "config": _OBJ,
              "num_shards": (lambda v: v is None or _is_int(v), "an integer ≥ 0 or null"),
              "shards": (lambda v: isinstance(v, list) and all(isinstance(s, dict) for s in v), "a list of objects")}
SHARD_FIELDS = {"index": (_is_int, "an integer ≥ 0"), "status": (lambda v: isinstance(v, str), "a string")}
COMMITTED_FIELDS = {"rows": (lambda v: _is_int(v, 1), "an integer ≥ 1 (a committed shard holds rows)"),
                    "files": _OBJ}
FILE_FIELDS = {"bytes": (_is_int, "an integer ≥ 0"), "sha256": (_is_sha, "a 64-character hex digest")}
# fields the code reads where they exist, checked when present (dotted: nested objects); `need=` makes them required
OPTIONAL_FIELDS = {
    "complete": (lambda v: isinstance(v, bool), "true or false"), "summary": _OBJ,
    "verified": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "verified.ok": (lambda v: isinstance(v, bool), "true or false"),
    "verified.bad": (lambda v: isinstance(v, list) and all(isinstance(b, dict) and _is_int(b.get("shard", 0))
                                                           and isinstance(b.get("reason", ""), str) for b in v),
                     "a list of {shard, reason} objects"),
    "verified.at": (_is_num, "a number"),
    "verified.max_rel_err": (lambda v: v is None or _is_num(v), "a number or null"),
    "verified.projection": (lambda v: isinstance(v, str), "a string"),
    "projection": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "projection.sha256": (_is_sha, "a 64-character hex digest"),
    "projection.dims": (lambda v: _is_int(v, 1), "an integer ≥ 1"),
    "projection.retained": (lambda v: isinstance(v, dict) and all(map(_is_num, v.values())),
                            "an object of numbers"),
    "config.tokens_dir": _STR, "config.layer_ids": (_is_ints, "a list of integers ≥ 0"),
    "config.mask_token_id": (lambda v: v is None or _is_int(v), "an integer ≥ 0 or null (no mask token chosen)"),
    "tokenizer_vocab": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "tokenizer_vocab.vocab_sha256": (_is_sha, "a 64-character hex digest"),
    "tokenizer_vocab.vocab_size": (lambda v: _is_int(v, 1), "an integer ≥ 1"), "config.extract": _OBJ, "config.extract.target": _STR,
    "config.extract.batch_rows": (lambda v: _is_int(v, 1), "an integer ≥ 1"),
    "producer.quant": _STR, "producer.layer_ids": (_is_ints, "a list of integers ≥ 0"), "producer.target": _OBJ,
    "producer.target.hidden_size": (lambda v: _is_int(v, 1), "an integer ≥ 1"),
    "producer.target.num_layers": (lambda v: _is_int(v, 1), "an integer ≥ 1"),
    "producer.target.vocab_size": (lambda v: _is_int(v, 1), "an integer ≥ 1"),
    "producer.tokens": _OBJ, "producer.tokens.key": _STR, "producer.tokens.producer": _OBJ,
    "producer.tokens.producer.seq_len": (lambda v: _is_int(v, 1), "an integer ≥ 1"),
    "producer.projection": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "producer.projection.dims": (lambda v: _is_int(v, 1), "an integer ≥ 1"),
}
SHARD_OPTIONAL = {"tokens": (_is_int, "an integer ≥ 0"), "tokens_sha256": (_is_sha, "a 64-character hex digest"),
                  "reason": (lambda v: isinstance(v, str), "a string"),
                  **{k: (_is_num, "a number") for k in ("seconds", "compute_seconds", "write_seconds")}}
_ABSENT = object()


def field(m: dict, dotted: str):
    """`m["a"]["b"]` for "a.b"; `_ABSENT` where a level is missing or not an object."""
    for name in dotted.split("."):
        if not isinstance(m, dict) or name not in m:
            return _ABSENT
        m = m[name]
    return m


def schema_error(m: dict) -> str | None:
    """The first field of a manifest that is missing or of the wrong type, said as `field is X, expected Y`; then
    the counts: a committed shard's index inside `num_shards`, and a complete token cache's `num_shards` at most its
    entries (so that nothing sized by a count can be larger than what the manifest lists; a hidden cache's count is
    held to its token cache's by `hidden_num_shards`; an incomplete token cache's count is not used).
    """
    def check(where: str, obj: dict, fields: dict, required: bool = True) -> str | None:
        for name, (ok, what) in fields.items():
            v = field(obj, name)
            if v is _ABSENT:
                if required:
                    return f"{where}{name} is missing (expected {what})"
            elif not ok(v):
                return f"{where}{name} is {v!r}, expected {what}"
        return None

    if bad := check("", m, TOP_FIELDS) or check("", m, OPTIONAL_FIELDS, required=False):
        return bad
    for i, s in enumerate(m["shards"]):
        where = f"shards[{i}]."
        if bad := check(where, s, SHARD_FIELDS) or check(where, s, SHARD_OPTIONAL, required=False):
            return bad
        if s["status"] == "committed" and (bad := check(where, s, COMMITTED_FIELDS)):
            return bad
        for name, rec in s.get("files", {}).items() if isinstance(s.get("files"), dict) else ():
            if not is_file_name(name):
                return (f"{where}files names {name!r}, expected a plain file name inside the cache (letters, digits, "
                        f"'._-'; no '/', no '..', no absolute path)")
            if not isinstance(rec, dict) or (bad := check(f"{where}files[{name!r}].", rec, FILE_FIELDS)):
                return bad or f"{where}files[{name!r}] is {rec!r}, expected an object"
        if m["num_shards"] is not None and s["status"] == "committed" and s["index"] >= m["num_shards"]:
            return f"{where}index is {s['index']}, outside num_shards {m['num_shards']}"
    n = m["num_shards"]
    if m["kind"] == "tokens" and m.get("complete") and n is not None and n > len(m["shards"]):
        return f"num_shards is {m['num_shards']}, but the complete token cache lists {len(m['shards'])} shards"
    return None


def token_cache(cache: Path, m: dict) -> tuple[Path, dict]:
    """A hidden cache's token cache: its directory (`config.tokens_dir`, relative to the cache) and its manifest."""
    require(m, Path(cache) / MANIFEST, ("config.tokens_dir",))
    tokens_dir = (Path(cache) / m["config"]["tokens_dir"]).resolve()
    return tokens_dir, read_manifest(tokens_dir)


def hidden_num_shards(cache: Path, m: dict, tokens_m: dict) -> int:
    """A hidden cache's `num_shards`, held to its token cache's (hidden shard k holds token shard k's rows; a token
    cache's count is at most the entries its manifest lists): a count edited into the manifest is refused before
    anything is sized by it."""
    n, want = m["num_shards"], tokens_m["num_shards"]
    if n is None or n != want:
        raise ManifestError(f"{Path(cache) / MANIFEST}: num_shards is {n}, but its token cache "
                            f"({m['config']['tokens_dir']}) has {want} shards and hidden shard k holds token shard k's "
                            f"rows: the manifest was edited or damaged; restore it (or extract the cache again)")
    return n


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


def missing_files(cache: Path, m: dict) -> list[dict]:
    """Committed shards whose files are missing or not the size the manifest says: [{"shard", "reason"}]. Stats
    only (milliseconds for thousands of shards); contents are checked where they are read."""
    bad = []
    for i, s in sorted(committed(m).items()):
        if not s["files"]:
            bad.append({"shard": i, "reason": "its entry lists no file"})
        for name, rec in s["files"].items():
            try:
                size = (cache / name).stat().st_size
            except FileNotFoundError:
                bad.append({"shard": i, "reason": f"{name} is missing"})
                continue
            if size != rec["bytes"]:
                bad.append({"shard": i, "reason": f"{name} is {size} bytes, the manifest says {rec['bytes']}"})
    return bad


def requeue_missing(cache: Path) -> list[dict]:
    """Under the lock, mark committed shards whose files are missing or resized as `missing` (to do again)."""
    with locked(cache):
        m = read_manifest(cache)
        bad = missing_files(cache, m)
        if bad:
            why = {b["shard"]: b["reason"] for b in bad}
            shards = [dict(s, status="missing", reason=why[s["index"]]) if s["index"] in why else s for s in m["shards"]]
            write_json_atomic(cache / MANIFEST, dict(m, shards=shards))
    return bad


# --- claims: split shards between workers without doing one twice --------------------------------------------


def worker_id() -> str:
    """This process among all writers: host, pid and its pid space (`boot_tag`) — two containers with one hostname
    and the same pid (new pid namespaces start alike) are two workers, whose claims neither takes nor releases."""
    return f"{socket.gethostname()}:{os.getpid()}:{boot_tag()}"


@functools.cache
def boot_id() -> str:
    """Which pid space this process's pid belongs to: the kernel's boot id plus this process's pid namespace
    (`/proc/sys/kernel/random/boot_id`, `/proc/self/ns/pid`). Two containers with one hostname, on two machines or on
    one, differ here, so neither judges the other's live lock or claim dead by a local pid. "" where /proc has
    neither (liveness then falls back to host + pid)."""
    parts = []
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid").removeprefix("pid:").strip("[]"))
    return "/".join(parts)


def boot_tag() -> str:
    """`boot_id` in 8 characters, for temp file names ("nobootid" where there is none)."""
    return hashlib.sha256(boot_id().encode()).hexdigest()[:8] if boot_id() else "nobootid"


def worker_info() -> dict:
    """Who this process is, for claims and status files: host, pid, rank/world of its job (0/1 alone) and the job's
    id (the launcher's rendezvous; empty alone), so that ranks of one job can tell each other from other jobs."""
    env = os.environ
    job = env.get("TORCHELASTIC_RUN_ID", "") + "@" + env.get("MASTER_ADDR", "") + ":" + env.get("MASTER_PORT", "")
    return {"worker": worker_id(), "host": socket.gethostname(), "pid": os.getpid(), "boot": boot_id(),
            "rank": int(env.get("RANK", 0)),
            "world": int(env.get("WORLD_SIZE", 1)), "job": job if int(env.get("WORLD_SIZE", 1)) > 1 else ""}


def _claim_path(cache: Path, index: int) -> Path:
    return cache / "claims" / f"shard-{index:05d}.json"


def read_claim(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, FileNotFoundError):
        return None


def _write_claim(cache: Path, index: int, lease_s: float) -> None:
    now = time.time()
    write_json_atomic(_claim_path(cache, index), {**worker_info(), "index": index, "expires": now + lease_s,
                                                  "lease_s": lease_s, "renewed_at": now})


def claim_state(claim: dict | None) -> str:
    """"live", "dead" (its process is gone: same host) or "expired" (its lease ran out)."""
    if claim is None:
        return "expired"
    if not alive(claim):
        return "dead"
    return "live" if claim.get("expires", 0) > time.time() else "expired"


def try_claim(cache: Path, index: int, lease_s: float, redo: bool = False) -> bool:
    """Claim shard `index` unless it is committed (and not being redone) or someone holds a live lease on it."""
    with locked(cache):
        if index in committed(read_manifest(cache)) and not redo:
            return False
        held = read_claim(_claim_path(cache, index))
        if held is not None and held.get("worker") != worker_id() and claim_state(held) == "live":
            return False
        _write_claim(cache, index, lease_s)
        return True


def holders(cache: Path, indices) -> dict[int, dict]:
    """The live claims on these shards by other processes: index → claim."""
    out = {}
    for i in indices:
        c = read_claim(_claim_path(cache, i))
        if c is not None and c.get("worker") != worker_id() and claim_state(c) == "live":
            out[i] = c
    return out


def alive(claim: dict) -> bool:
    """False only when the claim's worker ran on this host and its process is gone (no need to wait for the lease)."""
    host, pid = (str(claim.get("worker", "")).split(":") + [""])[:2]  # host:pid[:pid space tag]
    return pid_alive(host, pid, claim.get("boot"))


def pid_alive(host: str, pid, boot: str | None = None) -> bool:
    """False only when `host` is this host, `boot` (the writer's `boot_id`, None when it recorded none) is this
    process's, and no process `pid` exists. Another host, or another boot or pid namespace under the same hostname
    (a container): unknown, so True — only a lease or an age tells."""
    if host != socket.gethostname() or not str(pid).isdigit() or (boot is not None and boot != boot_id()):
        return True  # another machine or pid namespace: only its lease tells
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def renew_claim(cache: Path, index: int, lease_s: float) -> None:
    with locked(cache):
        _write_claim(cache, index, lease_s)


def release_claim(cache: Path, index: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_claim_path(cache, index))


# --- debris of dead writers ----------------------------------------------------------------------------------

OTHER_HOST_TEMP_AGE_S = 86400.0  # a temp file from another host untouched this long belongs to a dead writer


def remove_dead_temps(d: Path) -> tuple[int, int]:
    """Remove the temp files and directories in `d` (not below) whose writer is dead: same host and pid space, its
    pid is gone; another host or pid space (a container with this hostname), untouched for a day. (count, bytes)
    removed."""
    count, nbytes, now = 0, 0, time.time()
    for p in d.glob(f".*{TEMP_MARK}*") if d.is_dir() else []:
        host, pid, tag = temp_writer(p) or ("", "", None)
        here = host == socket.gethostname() and tag in (None, boot_tag())  # pids of this pid space
        with contextlib.suppress(FileNotFoundError):
            st = p.stat()
            if pid_alive(host, pid) if here else now - st.st_mtime <= OTHER_HOST_TEMP_AGE_S:
                continue
            if p.is_dir():
                nbytes += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                shutil.rmtree(p, ignore_errors=True)
            else:
                nbytes += st.st_size
                p.unlink()
            count += 1
    return count, nbytes


def sweep(cache: Path, log=print) -> dict:
    """Remove what dead writers left in `cache`: temp files (same host: pid gone; other hosts: untouched for a day),
    claims whose worker is dead or whose lease expired, and status files of dead same-host processes that never
    finished. Returns counts; logs one line when it removed anything."""
    removed = {"temp_files": 0, "temp_bytes": 0, "claims": 0}
    for d in (cache, cache / "claims"):
        n, nbytes = remove_dead_temps(d)
        removed["temp_files"] += n
        removed["temp_bytes"] += nbytes
    with locked(cache):  # a claim is taken over under the lock: never remove a successor's fresh claim
        for p in sorted((cache / "claims").glob("shard-*.json")) if (cache / "claims").is_dir() else []:
            if claim_state(read_claim(p)) != "live":
                p.unlink(missing_ok=True)
                removed["claims"] += 1
    if removed["temp_files"] or removed["claims"]:
        log(f"{cache}: removed what dead writers left: {removed['temp_files']} temp file(s) "
            f"({removed['temp_bytes'] / 1e6:.1f} MB), {removed['claims']} expired or dead claim(s)")
    return removed
