"""File helpers of the cache (and of every other writer in the project): hashing, atomic writes, the cache lock,
process liveness and the debris of dead writers.

Writes are temp → fsync → rename (`publish`, `atomic_path`, `write_json_atomic`, `write_text_atomic`, `atomic_dir`):
readers see the old or the new file, never a partial one; a directory is renamed away before it is deleted
(`remove_dir`). Every temp name carries its writer's host, pid and pid space (`temp_path`), so that
`remove_dead_temps` can tell a dead writer's debris from a live writer's work.

The lock (`locked`) lives here, not in the manifest module: it is a plain cross-process lock on a directory, taken
by the manifest's read-modify-writes and by the claims alike (both of which import this module, never each other's
lock), and it is made of this module's own pieces — a temp file hard-linked into place, liveness by host, pid and pid
space. It is created with O_EXCL semantics (works on local disks and on shared filesystems where flock does not). A
lock whose holder is gone (same host and pid space) is broken at once, with a message; any other when it is older
than `stale_s`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import hashlib
import json
import os
import shutil
import socket
import stat
import time
import uuid
from pathlib import Path


class ManifestError(ValueError):
    """The manifest (or the lock that guards it) is missing, corrupt, or does not fit what the caller expects.
    Defined here because the lock raises it; callers import it from `manifest`."""


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
    remove_dead_temps(final.parent, final.name)  # a killed writer's, of this name (unique names are never reused)
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


def remove_dir(path: Path) -> None:
    """Delete a directory without ever leaving half of it under its name: renamed to a temp name first (a kill
    mid-delete leaves debris named for its writer, which `remove_dead_temps` sweeps), then deleted."""
    shutil.rmtree(path.rename(temp_path(path)), ignore_errors=True)


@contextlib.contextmanager
def atomic_path(final: Path, durable: bool = True):
    """Write one file atomically by any means (a stream of records, a copy, a library's save): yields a temp path
    beside `final`, named for its writer; when the body returns, the file there is published over `final` (fsync,
    rename, fsync of the directory; `durable=False`: the rename alone); when it fails, it is removed. A killed
    writer's temp file of the same name is removed first."""
    remove_dead_temps(final.parent, final.name)
    tmp = temp_path(final)
    try:
        yield tmp
        if durable:
            publish(tmp, final)
        else:
            os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj, durable: bool = True) -> None:
    """Readers see the old or the new file, never a partial one. `durable=False` skips the fsyncs: for files that
    only report (a status snapshot), where an fsync can wait behind gigabytes another thread is flushing. A failed
    write removes its temp file."""
    write_text_atomic(path, json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n", durable)


def write_text_atomic(path: Path, text: str, durable: bool = True) -> None:
    """`write_json_atomic` for any text (UTF-8)."""
    with atomic_path(path, durable) as tmp:
        tmp.write_text(text, encoding="utf-8")


# --- the lock ------------------------------------------------------------------------------------------------


LOCK_SAY_AFTER_S = 3.0  # a wait for the cache lock longer than this says whose lock it is


@contextlib.contextmanager
def locked(cache: Path, stale_s: float = 60.0, timeout_s: float = 120.0):
    """Hold `<cache>/.lock` for a short read-modify-write. A lock whose holder is gone is broken: at once when the
    holder ran in this host's pid space (same host and `boot_id`, its pid is not alive), after `stale_s` otherwise;
    both say so. Every wait ends by `timeout_s`; a `.lock` that is not a file this code writes (a symlink, a
    directory) is refused at once."""
    lock = cache / ".lock"
    start = time.monotonic()
    deadline, said = start + timeout_s, False
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}:{boot_id()}"
    while not _try_lock(lock, token):
        holder = _lock_holder(lock)
        if holder is not None and _break_if_stale(lock, *holder, stale_s):
            continue
        if holder is not None and not said and time.monotonic() - start > LOCK_SAY_AFTER_S:  # (a wait is ms)
            said = True
            print(f"waiting for {lock}, held by {holder[0]}:{holder[1]} for {holder[3]:.0f}s (a lock is held for "
                  f"milliseconds: its holder is stuck, or gone on a host or container whose processes cannot be seen "
                  f"from here); it is broken once {stale_s:.0f}s old", flush=True)
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


# --- liveness: who a writer is, whether it is alive ------------------------------------------------------


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


# --- debris of dead writers ----------------------------------------------------------------------------------

OTHER_HOST_TEMP_AGE_S = 86400.0  # a temp file from another host untouched this long belongs to a dead writer


def remove_dead_temps(d: Path, name: str = "", dry: bool = False) -> tuple[int, int]:
    """Remove the temp files and directories in `d` (not below; `name`: only those of that final name) whose writer
    is dead: same host and pid space, its pid is gone; another host or pid space (a container with this hostname),
    untouched for a day. (count, bytes) removed (`dry`: counted, left in place)."""
    count, nbytes, now = 0, 0, time.time()
    for p in d.glob(f".{glob.escape(name) if name else '*'}{TEMP_MARK}*") if d.is_dir() else []:
        host, pid, tag = temp_writer(p) or ("", "", None)
        here = host == socket.gethostname() and tag in (None, boot_tag())  # pids of this pid space
        with contextlib.suppress(FileNotFoundError):
            st = p.stat()
            if pid_alive(host, pid) if here else now - st.st_mtime <= OTHER_HOST_TEMP_AGE_S:
                continue
            count += 1
            if p.is_dir():
                nbytes += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                if not dry:
                    shutil.rmtree(p, ignore_errors=True)
            else:
                nbytes += st.st_size
                if not dry:
                    p.unlink()
    return count, nbytes


def free_space(path: Path) -> int:
    """Free bytes on the filesystem `path` goes to (it may not exist yet: the nearest existing folder's)."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


def size(n: float) -> str:
    """Bytes in decimal units: '81.9 TB', '3.40 GB', '512 kB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.{1 if v >= 10 else 2}f} {unit}"
    return f"{n:.0f} B"
