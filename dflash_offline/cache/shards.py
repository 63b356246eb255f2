"""Self-describing shard files: token shards (Arrow IPC) and hidden-state shards (safetensors).

Token shard: one Arrow IPC file, fixed-shape rows, schema below, schema metadata naming the format, version, shard
index and cache key. Hidden shard: one safetensors file holding one tensor per tapped layer, `hidden.L{id}` of shape
[rows, seq_len, H] (bf16); in FP8 mode `hidden.L{id}` float8_e4m3fn plus `scale.L{id}` float32 [rows, seq_len, 1]
(per-token, per-layer scales); in FP4 mode `hidden.L{id}` uint8 [rows, seq_len, H/2] (two e2m1 codes a byte),
`bscale.L{id}` float8_e4m3fn [rows, seq_len, H/16] (one scale per 16 values) and `scale.L{id}` float32
[rows, seq_len, 1] (`LAYER_TENSORS`, `fp4_encode`); `__metadata__["dflash"]` is sorted JSON naming the format,
version, shard index, cache key, quantization and layer ids.
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

import functools
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

from .fsio import publish, sha256_file, temp_path

TOKENS_FORMAT = "dflash-tokens"
TOKENS_FORMAT_VERSION = 1
HIDDEN_FORMAT = "dflash-hidden"
HIDDEN_FORMAT_VERSION = 2  # of the shard file: 2 adds row digests (readers take 1 and 2)
HIDDEN_LAYOUT_VERSION = 1  # of the stored values (part of the cache key): a change here makes every cache new
ROW_HASH = "xxh3_64"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1 magnitude
FP4_BLOCK = 16  # values per e4m3 block scale (along H)
FP4_ALIGN = 32  # quant=fp4 needs H % 32 == 0 (whole blocks, whole bytes)
FP4_TOKEN_STEP = float(torch.tensor(1 / (FP4_MAX * FP8_MAX), dtype=torch.float32))  # token scale = amax · this
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of e2m1 codes 0..7; code bit 3 is the sign
# round to nearest e2m1, ties to the even code (as the hardware's cvt.rn does): between codes i and i+1 the midpoint
# goes down when i is even (`>`), up when i is odd (`>=`)
E2M1_UP_GT, E2M1_UP_GE = (0.25, 1.25, 2.5, 5.0), (0.75, 1.75, 3.5)
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


def fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., H] → (float8_e4m3fn [..., H], float32 scale [..., 1]) with one scale per token (per layer)."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def fp8_decode(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


def check_fp4_width(hidden: int) -> None:
    if hidden % FP4_ALIGN:
        raise ValueError(f"quant=fp4 stores blocks of {FP4_BLOCK} values, two a byte: it needs a hidden size that is a "
                         f"multiple of {FP4_ALIGN}, got hidden_size={hidden}; use quant=fp8 or quant=bf16")


def fp4_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., H] → (uint8 [..., H/2] e2m1 codes, float8_e4m3fn [..., H/16] block scales, float32 [..., 1] token
    scale), on x's device.

    Token scale = amax · fl32(1 / (6 · 448)), so that block scales span e4m3's range; block scale = block amax / 6 / token
    scale = 448 · block amax / token amax, rounded to the nearest e4m3 (a block whose scale rounds down saturates its
    largest values at ±6, by at most 1/16 of them — less than e2m1's own rounding there — while the scale is a normal
    e4m3, i.e. the block's amax is at least 2⁻⁶/448 ≈ 3.5e-5 of the token's; further below, the scale is subnormal,
    with fewer bits, and saturation grows); codes = x / (block scale · token scale) rounded to the nearest e2m1, ties
    to even. A block whose scale underflows e4m3 (all-zero blocks and tokens included) stores zeros. Value 2i of a
    token is the low nibble of its byte i, value 2i + 1 the high nibble."""
    *lead, H = x.shape
    check_fp4_width(H)
    x_NBb = x.float().reshape(*lead, H // FP4_BLOCK, FP4_BLOCK)  # N… leading dims, B blocks, b = 16 values
    # (only correctly rounded tensor ops, no division by a Python number, which CUDA turns into a multiplication by
    # its rounded reciprocal: the same bytes on every device)
    scale_N1 = x_NBb.abs().amax(dim=(-2, -1)).clamp_min(1e-12).unsqueeze(-1) * FP4_TOKEN_STEP
    bscale_NB = (x_NBb.abs().amax(dim=-1) / (scale_N1 * FP4_MAX)).clamp_max(FP8_MAX).to(torch.float8_e4m3fn)
    step_NB = bscale_NB.float() * scale_N1
    a_NBb = torch.where(step_NB.unsqueeze(-1) > 0, x_NBb / step_NB.clamp_min(1e-38).unsqueeze(-1), 0.0)
    mag_NBb = a_NBb.abs()
    code_NBb = torch.zeros(mag_NBb.shape, dtype=torch.uint8, device=x.device)
    for t in E2M1_UP_GT:  # (7 thresholds: a code is the count of those its magnitude passes; 6 and above → 7)
        code_NBb += mag_NBb > t
    for t in E2M1_UP_GE:
        code_NBb += mag_NBb >= t
    code_NBb |= (a_NBb < 0).to(torch.uint8) << 3
    pair_Nh2 = code_NBb.reshape(*lead, H // 2, 2)
    return pair_Nh2[..., 0] | (pair_Nh2[..., 1] << 4), bscale_NB, scale_N1


@functools.cache
def e2m1_table(device: torch.device) -> torch.Tensor:
    """float32 [16]: the value of each e2m1 code, on `device` (made once: no host copy per decode)."""
    return torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=device)


def fp4_decode(packed: torch.Tensor, bscale: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """`fp4_encode`'s (uint8 [..., H/2], e4m3 [..., H/16], float32 [..., 1]) → [..., H] in `dtype`, on their device:
    code value × block scale × token scale."""
    *lead, half = packed.shape
    code_Nh2 = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    v_NBb = e2m1_table(packed.device)[code_Nh2.int()].view(*lead, 2 * half // FP4_BLOCK, FP4_BLOCK)
    step_NB = bscale.float() * scale.float()
    return (v_NBb * step_NB.unsqueeze(-1)).view(*lead, 2 * half).to(dtype)


# Per tapped layer `id`, the tensors an encoding stores, `{name}.L{id}` of shape [rows, seq_len, width(H)]:
# name → (dtype, width). `encode_layer` writes them, `decode_layer` reads them (storage.ENCODINGS sizes them).
LAYER_TENSORS = {
    "bf16": {"hidden": (torch.bfloat16, lambda h: h)},
    "fp8": {"hidden": (torch.float8_e4m3fn, lambda h: h), "scale": (torch.float32, lambda h: 1)},
    "fp4": {"hidden": (torch.uint8, lambda h: h // 2), "bscale": (torch.float8_e4m3fn, lambda h: h // FP4_BLOCK),
            "scale": (torch.float32, lambda h: 1)},
}


def encode_layer(x: torch.Tensor, lid: int, quant: str) -> dict[str, torch.Tensor]:
    """One layer's [R, S, H] states → the tensors stored for it (works on any device)."""
    if quant == "fp4":
        q, b, s = fp4_encode(x)
        return {f"hidden.L{lid}": q, f"bscale.L{lid}": b, f"scale.L{lid}": s}
    if quant == "fp8":
        q, s = fp8_encode(x)
        return {f"hidden.L{lid}": q, f"scale.L{lid}": s}
    if quant == "bf16":
        return {f"hidden.L{lid}": x.to(torch.bfloat16)}
    raise ValueError(f"quantization {quant!r} is not one of {', '.join(LAYER_TENSORS)}")


def decode_layer(parts: dict[str, torch.Tensor], quant: str, dtype=torch.bfloat16) -> torch.Tensor:
    """One layer's stored tensors (by `LAYER_TENSORS` name, without the layer suffix) → [..., H] in `dtype`, computed
    on their device."""
    if quant == "fp4":
        return fp4_decode(parts["hidden"], parts["bscale"], parts["scale"], dtype)
    if quant == "fp8":
        return fp8_decode(parts["hidden"], parts["scale"], dtype)
    return parts["hidden"].to(dtype)


def hidden_shard_metadata(index: int, key: str, projection_sha256: str | None = None) -> dict:
    """What a hidden shard's header says it is, beyond its format: shard index, cache key and, for a projected cache,
    the SHA-256 of the projection file its states were projected with (same key, other P: `open_shard` refuses it)."""
    return {"shard": index, "key": key, **({"projection": projection_sha256} if projection_sha256 else {})}


def write_hidden_shard(path: Path, tensors: dict[str, torch.Tensor], quant: str, layer_ids: list[int],
                       metadata: dict) -> dict:
    """Write encoded per-layer tensors atomically (temp → fsync → rename); returns the file's manifest record."""
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
    return write_safetensors(path, tensors, {META_KEY: json.dumps(meta, sort_keys=True)})


SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
                      torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
                      torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
WRITE_CHUNK = 64 << 20


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict:
    """Write CPU tensors as one safetensors file atomically (temp → fsync → rename) and return its manifest record
    {"bytes", "sha256", "header_sha256"}. Streams each tensor's memory straight to the file (no serialized copy of the whole file
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
        publish(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # a failed write (a full disk, EIO, an interrupt) leaves no debris
        if isinstance(e, OSError) and not e.filename:
            raise OSError(e.errno, e.strerror, str(path)) from None  # name the file the write was for
        raise
    return {"bytes": len(head) + offset, "sha256": digest.hexdigest(), "header_sha256": hashlib.sha256(head).hexdigest()}


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
    """Read the given layers (a subset of the shard's, in this order) → [R, S, k·H]; FP8 and FP4 are decoded on
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
            for name in LAYER_TENSORS[meta["quant"]]:
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
        """Copy row `row` of tensor `name` into `out` (any tensor of that row's shape and dtype), checked."""
        info = self.header[name]
        begin, end = info["data_offsets"]
        nbytes = (end - begin) // info["shape"][0]
        if len(self._scratch) < nbytes:
            self._scratch = bytearray(nbytes)
        buf = memoryview(self._scratch)[:nbytes]
        got = os.preadv(self.fd, [buf], self.data_start + begin + row * nbytes)
        if got != nbytes:
            raise self._bad(f"is truncated (row {row} of {name})")
        if self.digests is not None and xxhash.xxh3_64_hexdigest(buf) != self.digests[name][row]:
            raise self._bad(f"has row {row} of {name} that does not match its checksum")
        out.copy_(torch.frombuffer(buf, dtype=torch.uint8).view(out.dtype).view(out.shape))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
