"""The cache manifest: the one source of truth for what a cache holds, and the only code that reads `manifest.json`
(everything else asks `read_manifest` or `has_manifest`).

`manifest.json` at a cache's root lists every shard with its status and the checksum of each of its files. A shard
that is not listed as committed does not exist, whatever files lie around. Writes are temp → fsync → rename, and
every read-modify-write of the manifest happens under the cache's lock (`fsio.locked`), so several processes — ranks
of one job, or machines sharing a filesystem — can commit shards into one cache at once. Claims (`claims.py`) let
workers split the shards without computing one twice.

The manifest is untrusted input: `read_manifest` type-checks every field the code reads before any is used, keeps
shard file names inside the cache, and bounds counts by what the manifest lists (`schema_error`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

from .fsio import ManifestError, fsync_path, locked, sha256_file, write_text_atomic

MANIFEST_VERSION = 1
MANIFEST = "manifest.json"
NOT_COMMITTED = "not committed"  # a verdict's reason for a shard the extraction had not made: nothing to redo
PROJECTION_FILE = "projection.safetensors"  # a projected cache's P per tap (`projection.py`), beside its shards


# --- read / create / merge -----------------------------------------------------------------------------------


def has_manifest(cache: str | Path) -> bool:
    """Whether `cache` holds a manifest (a cache, of either kind): what a caller asks before `read_manifest` where no
    cache is no error."""
    return (Path(cache) / MANIFEST).is_file()


def read_manifest(cache: str | Path, need: tuple[str, ...] = (), kind: str = "") -> dict:
    """The manifest of `cache`, every field it has checked for type (`schema_error`) before any is used: a hand-edited
    or damaged one is one error naming the file, the field, what was found and what to do. `need`: dotted fields
    (`OPTIONAL_FIELDS`) the caller reads, refused when absent; `kind` ("tokens", "hidden"): the kind of cache the
    caller reads, the other refused first (`wrong_kind`)."""
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
    if kind and m["kind"] != kind:
        raise ManifestError(wrong_kind(Path(cache), m, kind))
    return require(m, path, need)


def wrong_kind(cache: Path, m: dict, want: str) -> str:
    """Why a cache of the other kind cannot be read, and which to pass: for a token cache (stage 1a) where a hidden
    one is wanted, the hidden caches beside it extracted from it (any sibling holding a manifest: CACHE= pins any
    name)."""
    if want == "tokens":
        return (f"{cache} is a hidden-state cache (stage 1b); pass a token cache (make tokenize writes "
                f"cache/tokens-<key12>)")
    made = []
    for d in sorted(p.parent for p in cache.resolve().parent.glob(f"*/{MANIFEST}")):
        try:
            h = read_manifest(d)  # (no kind: a sibling token cache is passed over, not explained)
        except (OSError, ManifestError):
            continue
        if h["kind"] == "hidden" and (h["producer"].get("tokens") or {}).get("key") == m["key"]:
            done, n = len(committed(h)), h["num_shards"]
            made.append(f"{d}" + ("" if done == n else f" ({done} of {n} shards done)"))
    return (f"{cache} is a token cache (stage 1a: token rows, no hidden states); pass the hidden-state cache extracted "
            f"from it (make extract writes cache/hidden-<key12>): "
            + (", ".join(made) if made else "none is beside it: make extract TOKENS=" + str(cache)))


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


_SHA = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


def _is_sha(v) -> bool:
    return isinstance(v, str) and _SHA.fullmatch(v) is not None


def is_file_name(name: str) -> bool:
    """A shard file name a manifest may list: a plain name inside the cache directory (letters, digits, `._-`, not
    starting with a dot: no separators, no `..`, no absolute path, none of the hidden temp and lock files)."""
    return isinstance(name, str) and _FILE_NAME.fullmatch(name) is not None


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
    "verified.seen": (lambda v: isinstance(v, list) and all(x is None or _is_num(x) for x in v),
                      "a list of numbers or nulls (each shard's committed_at as the verdict saw it)"),
    "projection": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "projection.sha256": (_is_sha, "a 64-character hex digest"),
    "projection.bytes": (lambda v: _is_int(v, 0), "an integer ≥ 0"),
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
                  **{k: (_is_num, "a number") for k in ("seconds", "compute_seconds", "write_seconds", "committed_at")}}
_ABSENT = object()


def field(m: dict, dotted: str):
    """`m["a"]["b"]` for "a.b"; `_ABSENT` where a level is missing or not an object."""
    if "." not in dotted:  # (a shard's fields: the check of a manifest of 24K shards reads 300K of them)
        return m.get(dotted, _ABSENT) if isinstance(m, dict) else _ABSENT
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
    """A hidden cache's token cache: its directory (`config.tokens_dir`, relative to the cache; else the absolute
    `config.extract.tokens` it was given, when the cache was moved alone) and its manifest, which must be the one the
    cache was extracted from (`producer.tokens.key`): another there is refused naming both keys."""
    require(m, Path(cache) / MANIFEST, ("config.tokens_dir",))
    rel = m["config"]["tokens_dir"]
    tokens_dir = (Path(cache) / rel).resolve()
    given = (m["config"].get("extract") or {}).get("tokens") or ""
    if not has_manifest(tokens_dir) and given and has_manifest(given):
        tokens_dir = Path(given).resolve()
    want = ((m.get("producer") or {}).get("tokens") or {}).get("key")
    where = f"{cache}'s token cache{f' (key {want[:12]})' if want else ''}, which it reads its token rows from,"
    if not has_manifest(tokens_dir):
        raise ManifestError(f"{where} is not at {tokens_dir} ({rel} from the cache): a hidden cache and its token "
                            f"cache move together; put it back there (or extract the cache again)")
    tm = read_manifest(tokens_dir)
    if want and tm.get("key") != want:
        raise ManifestError(f"{where} is not at {tokens_dir}: that holds another {tm.get('kind')} cache (key "
                            f"{str(tm.get('key'))[:12]}); put the one it was extracted from there")
    return tokens_dir, tm


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
                    f"differs in: {', '.join(diff) or 'code format'}). Use another "
                    f"{'TOKENS=' if kind == 'tokens' else 'CACHE='} or delete it deliberately."
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
        write_manifest(cache, m)
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


def write_manifest(cache: Path, m: dict) -> None:
    """Publish `m` as the manifest (temp → fsync → rename): its fields sorted and indented, each entry of `shards` on
    one line — readable and greppable, and written by json's C encoder (a manifest of 24K shards, 15 MB, is
    rewritten at every commit under the lock: indented whole, that took 0.9 s)."""
    def fields(d: dict) -> list[str]:  # ' "key": value' items of an indented object
        return [json.dumps(d, sort_keys=True, indent=1, ensure_ascii=False)[2:-2]] if d else []

    rows = ",\n  ".join(json.dumps(s, sort_keys=True, ensure_ascii=False) for s in m["shards"])
    shards = f' "shards": [\n  {rows}\n ]' if rows else ' "shards": []'
    items = (fields({k: v for k, v in m.items() if k < "shards"}) + [shards]
             + fields({k: v for k, v in m.items() if k > "shards"}))
    write_text_atomic(cache / MANIFEST, "{\n" + ",\n".join(items) + "\n}\n")


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


def commit_shard(cache: Path, entry: dict, redo: bool = False, summary: dict | None = None,
                 staged: dict[str, Path] | None = None) -> dict:
    """Add one shard's entry to the manifest under the lock: its files already published, or `staged` (file name →
    its fsynced temp file) published here, under the lock and only once the entry is accepted — a commit refused
    leaves the files in place untouched. Where the shard was committed (a redo), its entry is first marked `missing`,
    so that no moment shows new bytes against the old entry: a kill in between leaves the shard to do again."""
    try:
        with locked(cache):
            before = read_manifest(cache)
            m = merge_shard(before, entry, redo=redo)
            if staged:
                marked = entry["index"] in committed(before)
                if marked:
                    write_manifest(cache, dict(before, shards=[
                        dict(s, status="missing", reason="being redone") if s["index"] == entry["index"] else s
                        for s in before["shards"]]))
                published = []
                try:
                    for name, tmp in staged.items():
                        os.replace(tmp, cache / name)
                        published.append(name)
                    fsync_path(cache)
                except Exception:  # (an I/O error, not a kill) before anything moved: the shard stays as it was
                    if marked and not published:
                        with contextlib.suppress(OSError):
                            write_manifest(cache, before)
                    raise
            if summary is not None:
                m["summary"] = summary
            write_manifest(cache, m)
    finally:  # (a staged file not published: the commit was refused or failed)
        for tmp in (staged or {}).values():
            Path(tmp).unlink(missing_ok=True)
    return m


def commit_shards(cache: Path, entries: list[dict]) -> dict:
    """Add several shards' entries (their files already published) under one lock, one manifest write: a single
    writer's batch (tokenization), where a commit a shard would rewrite the whole manifest once per shard."""
    with locked(cache):
        m = read_manifest(cache)
        for entry in entries:
            m = merge_shard(m, entry)
        write_manifest(cache, m)
    return m


def update_manifest(cache: Path, **fields) -> dict:
    with locked(cache):
        m = read_manifest(cache)
        m.update(fields)
        write_manifest(cache, m)
    return m


def record_once(cache: Path, name: str, make) -> dict:
    """Under the lock: the manifest's field `name` when another process recorded it first, else `make()` (run under
    the lock: it may write files the record names) recorded there. The record."""
    with locked(cache):
        m = read_manifest(cache)
        if m.get(name):
            return m[name]
        m[name] = make()
        write_manifest(cache, m)
    return m[name]


def cache_kind(d: Path) -> str | None:
    """The kind ('tokens', 'hidden') a directory's manifest says, reading nothing else of it: None without one or
    when it is unreadable. For refusals that must not depend on the rest of a manifest being sound."""
    try:
        kind = json.loads((d / MANIFEST).read_text()).get("kind") if has_manifest(d) else None
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in ("tokens", "hidden") else None


def shard_list(indices) -> str:
    """[0, 1, 2, 3, 7] → '0-3,7': the SHARD= syntax (`config.parse_shard_list` reads it)."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


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


def restore_advice(cache: Path, rec: dict | None) -> str:
    """What to do about a projected cache's missing or changed projection file (`rec`: the manifest's record)."""
    copy = (f"every training run on this cache keeps a copy, RUN/{PROJECTION_FILE}: copy back the one whose SHA-256 "
            f"is {rec['sha256'][:12]}…, " if rec and rec.get("sha256") else "")
    return (f"restore it ({copy}or a backup), or extract the cache again (delete {cache}; a new projection changes "
            f"every stored value, so the shards cannot be kept)")


def projection_problem(cache, m: dict, check_sha: bool = False) -> str | None:
    """Why a projected cache's committed shards cannot be read back to full width — its projection file missing,
    not recorded, or not the size (with `check_sha`, the SHA-256) the manifest records — with what to do; None for an
    unprojected cache, or one whose projection is not calibrated yet and no shard committed. Stats only unless
    `check_sha` (the file is H × k × taps × 4 bytes: ≈ 0.26 GB at the 27B shapes)."""
    if not m["producer"].get("projection"):
        return None
    cache, rec = Path(cache), m.get("projection")
    path = cache / PROJECTION_FILE
    if rec:
        require(m, cache / MANIFEST, ("projection.sha256", "projection.bytes"))
    if not rec:
        if not committed(m):
            return None
        why = f"{cache}/manifest.json records no projection file, yet its committed shards store projected taps"
    elif not path.is_file():
        why = f"{path} is missing: the cache's projected taps cannot be unfolded without it"
    elif (size := path.stat().st_size) != rec["bytes"]:
        why = f"{path} is {size} bytes, the manifest records {rec['bytes']}: it is not the cache's projection"
    elif check_sha and (got := sha256_file(path)) != rec["sha256"]:
        why = (f"{path} has SHA-256 {got[:12]}…, the manifest records {rec['sha256'][:12]}…: it is not the projection "
               f"the cache's shards were computed with")
    else:
        return None
    return f"{why}; {restore_advice(cache, rec)}"


def requeue_missing(cache: Path) -> list[dict]:
    """Under the lock, mark committed shards whose files are missing or resized as `missing` (to do again)."""
    with locked(cache):
        m = read_manifest(cache)
        bad = missing_files(cache, m)
        if bad:
            why = {b["shard"]: b["reason"] for b in bad}
            shards = [dict(s, status="missing", reason=why[s["index"]]) if s["index"] in why else s for s in m["shards"]]
            write_manifest(cache, dict(m, shards=shards))
    return bad


# --- a recorded verdict, judged against the shards as they are now -------------------------------------------


def shard_stamps(m: dict, n: int) -> list:
    """What a verdict saw of shards 0..n-1, recorded as its `seen`: each committed shard's `committed_at` (0 for an
    entry without one), null for a shard not committed. A shard whose stamp is another now was (re)committed since;
    stamps are compared, never clocks, so hosts whose clocks differ agree."""
    done = committed(m)
    return [done[i].get("committed_at", 0) if i in done else None for i in range(n)]


def committed_since(m: dict, v: dict) -> list[int]:
    """The committed shards that verdict `v` does not cover, having been (re)committed since it read the manifest:
    those whose stamp is not the one its `seen` recorded. A verdict recorded without `seen` (by older code): those
    committed after its `at` (none where it has no `at`)."""
    seen, at = v.get("seen"), v.get("at")

    def since(i: int, s: dict) -> bool:
        stamp = s.get("committed_at", 0)
        if seen is not None:
            return stamp != (seen[i] if i < len(seen) else None)
        return at is not None and stamp > at

    return sorted(i for i, s in committed(m).items() if since(i, s))


def verdict_now(m: dict) -> dict | None:
    """The manifest's verdict (`verified`) judged against the shards as they are now, None where there is none: a
    copy whose `bad` keeps only the shards it named that are still as it saw them (to redo), with `redone`: the ones
    it named that were (re)committed since (a repair, or a shard not committed then: only `make verify` judges them
    now), and `since`: every shard (re)committed since, which it does not cover."""
    v = m.get("verified")
    if not v:
        return None
    since = committed_since(m, v)
    bad, now = v.get("bad", []), set(since)
    return dict(v, bad=[b for b in bad if b.get("shard") not in now],
                redone=[b for b in bad if b.get("shard") in now], since=since)


def not_covered(v: dict) -> str:
    """What verdict `v` (`verdict_now`'s) no longer covers, said for a person: the shards it named that were redone
    since, and the others (re)committed since."""
    redone = sorted({b["shard"] for b in v.get("redone", [])})
    others = sorted(set(v.get("since", [])) - set(redone))
    parts = ([f"shards {shard_list(redone)} that it named have been (re)committed since"] if redone else []) + \
            ([f"shards {shard_list(others)} have been (re)committed since it was taken"] if others else [])
    return "; ".join(parts) or "it names no bad shard"
