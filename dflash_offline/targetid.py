"""Identity of a target checkpoint for cache keys, computed in milliseconds without loading weights.

Hashing 54 GB of weights on every run is not an option, and a name or path is not an identity (a fine-tune keeps
the architecture and file layout). The fingerprint is the SHA-256 of `config.json`, of every safetensors file's
name, size and header (tensor names, dtypes, shapes, offsets), and of 16 evenly spaced 64 KiB samples of each
file's bytes — a different fine-tune of the same shapes changes the samples. `make verify` recomputes hidden
states from the weights themselves on sampled rows, which catches anything the fingerprint could miss.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

SAMPLES, SAMPLE_BYTES = 16, 1 << 16


def resolve_checkpoint(target: str) -> Path:
    """A local directory, or a hub id already present in the local HF cache (no downloads at run time)."""
    p = Path(target)
    if p.is_dir():
        return p
    if "/" in target and not p.exists():
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(target, local_files_only=True, allow_patterns=["*.json", "*.safetensors",
                                                                                         "*.jinja", "*.txt"]))
        except Exception as e:
            raise ValueError(
                f"target {target!r} is not a local directory and not in the local HF cache ({type(e).__name__}); "
                "download it first (huggingface-cli download) or pass TARGET=/path/to/checkpoint"
            ) from None
    raise ValueError(f"target {target!r} not found: pass TARGET=/path/to/checkpoint")


def weight_files(ckpt: Path) -> list[Path]:
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{ckpt}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def file_fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        h.update(f.read(header_len))
        for i in range(SAMPLES):
            f.seek(int(i * max(size - SAMPLE_BYTES, 0) / max(SAMPLES - 1, 1)))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def target_fingerprint(ckpt: Path) -> dict:
    cfg = ckpt / "config.json"
    if not cfg.is_file():
        raise ValueError(f"{ckpt}: no config.json; is this a Hugging Face checkpoint directory?")
    config_text = json.dumps(json.loads(cfg.read_text()), sort_keys=True)
    weights = hashlib.sha256()
    for f in weight_files(ckpt):
        weights.update(file_fingerprint(f).encode())
    return {
        "config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
        "weights_fingerprint": weights.hexdigest(),
    }
