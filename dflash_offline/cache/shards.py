"""Self-describing shard files: token shards (Arrow IPC) and hidden-state shards (safetensors).

Token shard: one Arrow IPC file, fixed-shape rows, schema below, schema metadata naming the format, version, shard
index and cache key. Hidden shard: one safetensors file holding, per tapped layer, the tensors its encoding stores
(`encodings.py`: `hidden.L{id}` of shape [rows, seq_len, H] in bf16; fp8 adds a float32 `scale.L{id}` per token; fp4
stores codes, block scales and token scales); `__metadata__["dflash"]` is sorted JSON naming the format, version,
shard index, cache key, quantization (the encoding's name) and layer ids.
Storing layers separately lets a trainer read only the layers it needs from a superset cache.

Integrity on read: the description also lists an xxh3-64 digest of every row of every tensor (`row_digests`), and
the manifest records the SHA-256 of the file's header (`header_sha256`) beside the whole file's. A reader
(`HiddenShardFile`) checks the file's size and its header against the manifest record when it opens the shard, then
hashes each row as it reads it (xxh3 runs at ~25 GB/s on one core and releases the GIL): every byte a trainer uses
is checked every time it is read, at the cost of hashing only those bytes, whatever subset of layers and rows it
reads. Shards written before row digests (format_version 1) are checked whole against the file's SHA-256 instead.

Both are written to a temp file beside the final one, fsynced and renamed; the caller then commits the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import xxhash
from safetensors import safe_open

from .encodings import decode_layer, get
from .fsio import fsync_path, publish, sha256_file, temp_path

TOKENS_FORMAT = "dflash-tokens"
TOKENS_FORMAT_VERSION = 1
HIDDEN_FORMAT = "dflash-hidden"
HIDDEN_FORMAT_VERSION = 2  # of the shard file: 2 adds row digests (readers take 1 and 2)
HIDDEN_LAYOUT_VERSION = 1  # of the stored values (part of the cache key): a change here makes every cache new
ROW_HASH = "xxh3_64"
META_KEY = "dflash"  # the one safetensors metadata key; its value is the shard's JSON description


class ShardError(ValueError):
    """A shard file is missing, unreadable or not what its manifest entry says."""


def token_shard_name(index: int) -> str:
    return f"tokens-{index:05d}.arrow"


def hidden_shard_name(index: int) -> str:
    return f"hidden-{index:05d}.safetensors"


# --- token shards --------------------------------------------------------------------------------------------

# name -> (arrow value type, numpy dtype); each column is a fixed-size list of seq_len values per row
TOKEN_COLUMNS = {
    "input_ids": (pa.int32(), np.int32),
    "loss_mask": (pa.uint8(), np.uint8),
    "position_ids": (pa.int32(), np.int32),
    "doc_ids": (pa.int32(), np.int32),  # row-local document index; -1 on the padding tail
}
# the columns a target forward reads, and the value each takes on a padding row (extraction's and verify's batches)
ROW_FILL = (("input_ids", 0), ("position_ids", 0), ("doc_ids", -1))


def pad_rows(x, b: int, fill: int) -> np.ndarray:
    """Rows `x` of one column as a batch of `b` rows, the missing ones `fill` (that column's `ROW_FILL`)."""
    if x.shape[0] == b:
        return np.array(x)  # a writable copy of the memory-mapped rows
    out = np.full((b, *x.shape[1:]), fill, dtype=x.dtype)
    out[: x.shape[0]] = x
    return out


def token_schema(seq_len: int, metadata: dict) -> pa.Schema:
    fields = [pa.field(n, pa.list_(t, seq_len), nullable=False) for n, (t, _) in TOKEN_COLUMNS.items()]
    fields.append(pa.field("doc_sources", pa.list_(pa.int64()), nullable=False))  # corpus ordinal of each doc
    meta = {"format": TOKENS_FORMAT, "format_version": str(TOKENS_FORMAT_VERSION), "seq_len": str(seq_len)}
    meta.update({k: str(v) for k, v in metadata.items()})
    return pa.schema(fields, metadata=meta)


def write_token_shard(path: Path, rows: dict[str, np.ndarray], doc_sources: list[list[int]], metadata: dict) -> dict:
    """Write rows ([R, S] arrays per column) atomically; returns the file's manifest record."""
    seq_len = rows["input_ids"].shape[1]
    schema = token_schema(seq_len, metadata)
    arrays = []
    for name, (typ, dtype) in TOKEN_COLUMNS.items():
        flat = pa.array(np.ascontiguousarray(rows[name], dtype=dtype).reshape(-1), type=typ)
        arrays.append(pa.FixedSizeListArray.from_arrays(flat, seq_len))
    arrays.append(pa.array(doc_sources, type=pa.list_(pa.int64())))
    table = pa.Table.from_arrays(arrays, schema=schema)
    tmp = temp_path(path)
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            writer.write_table(table)
        publish(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def read_token_shard(path: Path, sha256: str | None = None, redo: str = "") -> dict[str, np.ndarray]:
    """A token shard's [R, S] numpy arrays per column plus `doc_sources` and `metadata`. With `sha256` the file is
    read whole, hashed and checked before it is parsed (`redo` is the command that rebuilds it); without, it is
    memory-mapped."""
    try:
        if sha256 is None:
            reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        else:
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != sha256:
                raise ShardError(f"{path} does not match its manifest checksum: it was altered after it was written; "
                                 f"{redo or 'rebuild the token cache'}")
            reader = pa.ipc.open_file(pa.py_buffer(data))
    except (OSError, pa.ArrowInvalid) as e:
        raise ShardError(f"{path}: not a readable Arrow token shard ({e}); {redo or 'rebuild the token cache'}") from None
    meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    if meta.get("format") != TOKENS_FORMAT:
        raise ShardError(f"{path}: format {meta.get('format')!r}, expected {TOKENS_FORMAT!r}")
    table = reader.read_all()
    seq_len = int(meta["seq_len"])
    out: dict = {"metadata": meta}
    for name in TOKEN_COLUMNS:
        col = table.column(name).combine_chunks()
        out[name] = col.values.to_numpy(zero_copy_only=False).reshape(-1, seq_len)
    out["doc_sources"] = table.column("doc_sources").to_pylist()
    return out


# --- hidden-state shards -------------------------------------------------------------------------------------


def hidden_shard_metadata(index: int, key: str, projection_sha256: str | None = None) -> dict:
    """What a hidden shard's header says it is, beyond its format: shard index, cache key and, for a projected cache,
    the SHA-256 of the projection file its states were projected with (same key, other P: `open_shard` refuses it)."""
    return {"shard": index, "key": key, **({"projection": projection_sha256} if projection_sha256 else {})}


def write_hidden_shard(path: Path, tensors: dict[str, torch.Tensor], quant: str, layer_ids: list[int],
                       metadata: dict) -> dict:
    """Write encoded per-layer tensors atomically (temp → fsync → rename); returns the file's manifest record."""
    tmp, rec = stage_hidden_shard(path, tensors, quant, layer_ids, metadata)
    try:
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return rec


def stage_hidden_shard(path: Path, tensors: dict[str, torch.Tensor], quant: str, layer_ids: list[int],
                       metadata: dict) -> tuple[Path, dict]:
    """`write_hidden_shard` up to the rename: (the fsynced temp file beside `path`, its manifest record). The caller
    publishes it (`manifest.commit_shard(staged=)`, with the entry under the lock) or removes it."""
    meta = {
        "format": HIDDEN_FORMAT,
        "format_version": str(HIDDEN_FORMAT_VERSION),
        "quant": quant,
        "layer_ids": json.dumps(sorted(layer_ids)),
        "row_hash": ROW_HASH,
        "row_digests": {name: row_digests(t) for name, t in sorted(tensors.items())},
    }
    meta.update({k: str(v) for k, v in metadata.items()})
    # One key holding sorted JSON: a deterministic header, so identical shards have identical bytes.
    return stage_safetensors(path, tensors, {META_KEY: json.dumps(meta, sort_keys=True)})


SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
                      torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
                      torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
WRITE_CHUNK = 64 << 20


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict:
    """Write CPU tensors as one safetensors file atomically (temp → fsync → rename) and return its manifest record
    {"bytes", "sha256", "header_sha256"} (`stage_safetensors`, then the rename)."""
    tmp, rec = stage_safetensors(path, tensors, metadata)
    try:
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return rec


def stage_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[Path, dict]:
    """Write CPU tensors as one safetensors file into a temp file beside `path`, fsynced, not renamed: (its path, its
    manifest record {"bytes", "sha256", "header_sha256"}); a failed write removes it. Streams each tensor's memory straight to the file (no serialized copy of the whole file
    in memory) and hashes the same bytes on a second thread as they go out (no re-read). Deterministic: tensors
    in name order, compact header JSON padded to 8 bytes, as the safetensors format specifies."""
    names = sorted(tensors)
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    head = struct.pack("<Q", len(head)) + head
    digest = hashlib.sha256()
    tmp = temp_path(path)
    try:
        # hashlib and file writes release the GIL on large buffers: hashing chunk i overlaps writing chunk i+1
        with open(tmp, "wb") as f, ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") as hasher:
            pending = []
            for chunk in _chunks(head, names, tensors):
                f.write(chunk)
                pending.append(hasher.submit(digest.update, chunk))
                while len(pending) > 4:  # bounded: the hasher keeps up with the disk in practice
                    pending.pop(0).result()
            for p in pending:
                p.result()
        fsync_path(tmp)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # a failed write (a full disk, EIO, an interrupt) leaves no debris
        if isinstance(e, OSError) and not e.filename:
            raise OSError(e.errno, e.strerror, str(path)) from None  # name the file the write was for
        raise
    return tmp, {"bytes": len(head) + offset, "sha256": digest.hexdigest(),
                 "header_sha256": hashlib.sha256(head).hexdigest()}


def row_digests(t: torch.Tensor) -> list[str]:
    """xxh3-64 of each row (first dimension) of a CPU tensor's bytes, as hex."""
    flat = t.detach().contiguous().view(torch.uint8).reshape(t.shape[0], -1).numpy() if t.dim() else None
    if flat is None:
        raise ValueError("row digests need a tensor with a row dimension")
    return [xxhash.xxh3_64_hexdigest(flat[r]) for r in range(flat.shape[0])]


def _chunks(head: bytes, names: list[str], tensors: dict[str, torch.Tensor]):
    yield head
    for name in names:
        t = tensors[name].detach()
        if t.device.type != "cpu":
            raise ValueError(f"tensor {name} is on {t.device}; copy it to the CPU first")
        flat = t.contiguous().reshape(-1)
        buf = memoryview(flat.view(torch.uint8).numpy() if flat.numel() else b"")
        for i in range(0, len(buf), WRITE_CHUNK):
            yield buf[i:i + WRITE_CHUNK]


def parse_hidden_metadata(raw: dict | None) -> dict:
    """The shard's own description from a safetensors `__metadata__` map ({} when absent or foreign)."""
    try:
        return json.loads((raw or {}).get(META_KEY, "{}"))
    except json.JSONDecodeError:
        return {}


def hidden_metadata(path: Path) -> dict:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = parse_hidden_metadata(f.metadata())
    except Exception as e:  # safetensors raises its own error types
        raise ShardError(f"{path}: not a readable safetensors hidden shard ({e}); redo it with SHARD=<index>") from None
    if meta.get("format") != HIDDEN_FORMAT:
        raise ShardError(f"{path}: format {meta.get('format')!r}, expected {HIDDEN_FORMAT!r}")
    return meta


def read_hidden(
    path: Path, layer_ids: list[int], rows: slice | None = None, dtype=torch.bfloat16, device="cpu"
) -> torch.Tensor:
    """Read the given layers (a subset of the shard's, in this order) → [R, S, k·H], decoded (by the encoding) on
    `device`."""
    meta = hidden_metadata(path)
    have = json.loads(meta["layer_ids"])
    missing = [i for i in layer_ids if i not in have]
    if missing:
        raise ShardError(f"{path}: layers {missing} are not in this cache (it holds {have})")
    parts = []
    with safe_open(str(path), framework="pt") as f:
        for lid in layer_ids:
            stored = {}
            for name in get(meta["quant"]).tensors:
                sl = f.get_slice(f"{name}.L{lid}")
                stored[name] = (sl[rows] if rows is not None else sl[:]).to(device)
            parts.append(decode_layer(stored, meta["quant"], dtype))
    return torch.cat(parts, dim=-1)


class HiddenShardFile:
    """One hidden shard opened against its manifest record, for checked row reads.

    Opening checks the file's size and the SHA-256 of its header against `record` ({"bytes", "sha256",
    "header_sha256"}); `read_row` reads one row of one tensor with `pread`, hashes the bytes it read and compares
    them with the row digest that the (checked) header lists. A format-1 shard, which lists no row digests, is
    hashed whole against the record's SHA-256 when opened. Every failure is a `ShardError` that names the file and
    ends with `repair` (the command that redoes the shard).
    """

    def __init__(self, path: Path, record: dict, repair: str):
        self.path, self.repair = Path(path), repair
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise self._bad(f"cannot be opened ({e.strerror})") from None
        try:
            self._open(record)
        except BaseException:
            os.close(self.fd)
            raise

    def _bad(self, what: str) -> ShardError:
        return ShardError(f"{self.path} {what}: the cache was damaged after extraction; redo the shard with "
                          f"`{self.repair}`")

    def _open(self, record: dict) -> None:
        size = os.fstat(self.fd).st_size
        if size != record["bytes"]:
            raise self._bad(f"is {size} bytes, its manifest entry says {record['bytes']}")
        (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        head = os.pread(self.fd, n, 8) if 8 + n <= size else b""
        if len(head) != n or not n:
            raise self._bad("has a corrupt header")
        if "header_sha256" in record:
            if hashlib.sha256(struct.pack("<Q", n) + head).hexdigest() != record["header_sha256"]:
                raise self._bad("has a header that does not match its checksum")
        elif sha256_file(self.path) != record["sha256"]:  # format 1: no row digests, the whole file is checked
            raise self._bad("does not match its checksum")
        self.header = json.loads(head)
        self.meta = parse_hidden_metadata(self.header.get("__metadata__"))
        if self.meta.get("format") != HIDDEN_FORMAT:
            raise self._bad(f"has format {self.meta.get('format')!r}, expected {HIDDEN_FORMAT!r}")
        self.digests = self.meta.get("row_digests")
        self.data_start = 8 + n
        self._scratch = bytearray()

    def rows(self, name: str) -> int:
        return self.header[name]["shape"][0]

    def read_row(self, name: str, row: int, out: torch.Tensor) -> None:
        """Copy row `row` of tensor `name` into `out` (any tensor of that row's shape and dtype), checked. A
        contiguous host `out` is read into directly (a damaged row then leaves it partly written: the error says
        so); another goes through a scratch buffer and one torch copy (whose threads, where other processes keep
        the cores busy, cost more than the read: 3× fewer rows a second on 2 busy cores)."""
        info = self.header[name]
        begin, end = info["data_offsets"]
        nbytes = (end - begin) // info["shape"][0]
        direct = out.device.type == "cpu" and out.is_contiguous() and out.numel() * out.element_size() == nbytes
        if direct:
            buf = memoryview(out.view(torch.uint8).numpy()).cast("B")
        else:
            if len(self._scratch) < nbytes:
                self._scratch = bytearray(nbytes)
            buf = memoryview(self._scratch)[:nbytes]
        got = os.preadv(self.fd, [buf], self.data_start + begin + row * nbytes)
        if got != nbytes:
            raise self._bad(f"is truncated (row {row} of {name})")
        if self.digests is not None and xxhash.xxh3_64_hexdigest(buf) != self.digests[name][row]:
            raise self._bad(f"has row {row} of {name} that does not match its checksum")
        if not direct:
            out.copy_(torch.frombuffer(buf, dtype=torch.uint8).view(out.dtype).view(out.shape))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
