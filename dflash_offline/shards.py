"""Self-describing shard files: token shards (Arrow IPC) and hidden-state shards (safetensors).

Token shard: one Arrow IPC file, fixed-shape rows, schema below, schema metadata naming the format, version, shard
index and cache key. Hidden shard: one safetensors file holding one tensor per tapped layer, `hidden.L{id}` of shape
[rows, seq_len, H] (bf16), or in FP8 mode `hidden.L{id}` float8_e4m3fn plus `scale.L{id}` float32 [rows, seq_len, 1]
(per-token, per-layer scales); `__metadata__["dflash"]` is sorted JSON naming the format, version, shard index,
cache key, quantization and layer ids.
Storing layers separately lets a trainer read only the layers it needs from a superset cache.

Both are written to a temp file beside the final one, fsynced and renamed; the caller then commits the manifest.
"""

from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from safetensors import safe_open

from .manifest import publish, sha256_file, temp_path

TOKENS_FORMAT = "dflash-tokens"
TOKENS_FORMAT_VERSION = 1
HIDDEN_FORMAT = "dflash-hidden"
HIDDEN_FORMAT_VERSION = 1
FP8_MAX = 448.0  # largest finite float8_e4m3fn
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
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_table(table)
    publish(tmp, path)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def read_token_shard(path: Path) -> dict[str, np.ndarray]:
    """Memory-map a token shard; returns [R, S] numpy arrays per column plus `doc_sources` and `metadata`."""
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
    except (OSError, pa.ArrowInvalid) as e:
        raise ShardError(f"{path}: not a readable Arrow token shard ({e}); redo it with SHARD=<index>") from None
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


def encode_layer(x: torch.Tensor, lid: int, quant: str) -> dict[str, torch.Tensor]:
    """One layer's [R, S, H] states → the tensors stored for it (works on any device)."""
    if quant == "fp8":
        q, s = fp8_encode(x)
        return {f"hidden.L{lid}": q, f"scale.L{lid}": s}
    if quant == "bf16":
        return {f"hidden.L{lid}": x.to(torch.bfloat16)}
    raise ValueError(f"quantization {quant!r} is not one of bf16, fp8")


def write_hidden_shard(path: Path, tensors: dict[str, torch.Tensor], quant: str, layer_ids: list[int],
                       metadata: dict) -> dict:
    """Write encoded per-layer tensors atomically (temp → fsync → rename); returns the file's manifest record."""
    meta = {
        "format": HIDDEN_FORMAT,
        "format_version": str(HIDDEN_FORMAT_VERSION),
        "quant": quant,
        "layer_ids": json.dumps(sorted(layer_ids)),
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
    {"bytes", "sha256"}. Streams each tensor's memory straight to the file (no serialized copy of the whole file
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
    digest = hashlib.sha256()
    tmp = temp_path(path)
    # hashlib and file writes release the GIL on large buffers: hashing chunk i overlaps writing chunk i+1
    with open(tmp, "wb") as f, ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") as hasher:
        pending = []
        for chunk in _chunks(struct.pack("<Q", len(head)) + head, names, tensors):
            f.write(chunk)
            pending.append(hasher.submit(digest.update, chunk))
            while len(pending) > 4:  # bounded: the hasher keeps up with the disk in practice
                pending.pop(0).result()
        for p in pending:
            p.result()
    publish(tmp, path)
    return {"bytes": 8 + len(head) + offset, "sha256": digest.hexdigest()}


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
    """Read the given layers (a subset of the shard's, in this order) → [R, S, k·H]; FP8 is decoded on `device`."""
    meta = hidden_metadata(path)
    have = json.loads(meta["layer_ids"])
    missing = [i for i in layer_ids if i not in have]
    if missing:
        raise ShardError(f"{path}: layers {missing} are not in this cache (it holds {have})")
    parts = []
    with safe_open(str(path), framework="pt") as f:
        for lid in layer_ids:
            sl = f.get_slice(f"hidden.L{lid}")
            x = sl[rows] if rows is not None else sl[:]
            if meta["quant"] == "fp8":
                s = f.get_slice(f"scale.L{lid}")
                s = s[rows] if rows is not None else s[:]
                x = fp8_decode(x.to(device), s.to(device), dtype)
            parts.append(x.to(device=device, dtype=dtype))
    return torch.cat(parts, dim=-1)
