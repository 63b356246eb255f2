"""A projected cache's projection file, CACHE/projection.safetensors (`dflash_offline.projection`: what it holds and
how it is calibrated): written (`write_projection`: `P.L{id}` float32 [H, k] per tapped layer, the calibration's
metadata in its header), read back after checking its SHA-256 against the manifest's record (`read_projection`),
and copied into a training run (`copy_to_run`) so that the run's fc can be folded without its cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .fsio import atomic_path, sha256_file
from .manifest import PROJECTION_FILE, read_manifest, restore_advice
from .shards import META_KEY, write_safetensors

PROJECTION_FORMAT = "dflash-projection"


class ProjectionError(ValueError):
    """A cache's projection file is missing or is not the one its manifest records; the message says what to do."""


def write_projection(cache: Path, projections: dict[int, torch.Tensor], meta: dict) -> dict:
    """Write CACHE/projection.safetensors atomically: `P.L{id}` float32 [H, k] per tapped layer, `meta` (sorted JSON)
    in its header; returns its record {"bytes", "sha256", "header_sha256"}."""
    tensors = {f"P.L{lid}": P.to(torch.float32).contiguous() for lid, P in projections.items()}
    head = {META_KEY: json.dumps(dict(meta, format=PROJECTION_FORMAT), sort_keys=True)}
    return write_safetensors(Path(cache) / PROJECTION_FILE, tensors, head)


def read_projection(cache, layer_ids, record: dict | None = None) -> list[torch.Tensor]:
    """P [H, k] float32 of each layer of `layer_ids` (in that order) from a projected cache, after checking the file's
    SHA-256 against the manifest's record (`record`: the manifest's `projection` block, read when not given)."""
    from safetensors import safe_open

    cache = Path(cache)
    rec = record if record is not None else read_manifest(cache).get("projection")
    path = cache / PROJECTION_FILE
    fix = restore_advice(cache, rec)
    if not rec:
        raise ProjectionError(f"{cache}/manifest.json records no projection file, yet the cache stores projected taps; "
                              f"{fix}")
    if not path.is_file():
        raise ProjectionError(f"{path} is missing: the cache's projected taps cannot be unfolded without it; {fix}")
    if (got := sha256_file(path)) != rec["sha256"]:
        raise ProjectionError(f"{path} has SHA-256 {got[:12]}…, the manifest records {rec['sha256'][:12]}…: it is not "
                              f"the projection the cache's shards were computed with; {fix}")
    with safe_open(str(path), framework="pt") as f:
        have = {name for name in f.keys()}
        if missing := [lid for lid in layer_ids if f"P.L{lid}" not in have]:
            raise ProjectionError(f"{path} holds no projection for layers {missing}; {fix}")
        return [f.get_tensor(f"P.L{lid}") for lid in layer_ids]


def copy_to_run(rec: dict, run_dir) -> Path:
    """RUN/projection.safetensors: the cache's projection file the run trains on (atomic copy, checked against `rec`;
    kept when already there), so that the run's fc can be folded without its cache."""
    dst = Path(run_dir) / PROJECTION_FILE
    if dst.is_file() and sha256_file(dst) == rec["sha256"]:
        return dst
    src = Path(rec["cache"]) / PROJECTION_FILE
    with atomic_path(dst) as tmp:  # (a copy that does not match is removed, never published)
        shutil.copyfile(src, tmp)
        if (got := sha256_file(tmp)) != rec["sha256"]:
            raise ProjectionError(f"{src} has SHA-256 {got[:12]}…, the cache's manifest records "
                                  f"{rec['sha256'][:12]}…; restore it or extract the cache again")
    return dst
