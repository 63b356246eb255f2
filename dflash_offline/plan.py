"""An extraction's plan: what a run of stage 1b will compute and where, decided before any weight loads.

`make_plan` reads the token cache's manifest and the target's config.json (plus a fast fingerprint of its
weights; a dry run needs none, and its key then leaves them out): the layers to tap (checked against the target's
depth), the mask token (a real embedding row that is not pad or eos), the bytes per token of the chosen storage, and
the producer — everything that changes a stored byte — whose hash is the hidden cache's key. `disk_refusal` says why a run the filesystem has no room for does not start
(`allow_overfill=1` starts it anyway; `check_disk` raises it); the storage plan the dry run prints around these
numbers is `storage.py`. `recorded_config` is the rerun of an existing hidden cache: with `--hidden_out=DIR` and no
recipe, the ExtractConfig its manifest recorded (less a one-off `allow_overfill`), so the repair command that
training and verify print works as printed. `stages/extract.py` runs these first, in seconds, so that every refusal
comes before the weights load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import storage
from .cache.fsio import hash_obj
from .cache.manifest import has_manifest, read_manifest
from .config import ConfigError, ExtractConfig, TokenizeConfig, load_config, parse_overrides


def recorded_config(argv: list[str]) -> ExtractConfig | None:
    """For `--hidden_out=DIR` naming an existing hidden cache and no `--recipe`: the ExtractConfig its manifest
    recorded (reading the token cache it was made from), with the command line's non-empty settings on top, so that
    `make extract CACHE=DIR SHARD=k` works as printed. None otherwise."""
    if any(a in ("-h", "--help") for a in argv):
        return None
    recipe, overrides = parse_overrides(argv)
    out = overrides.get("hidden_out", "")
    if recipe or not out or not has_manifest(out):
        return None
    m = read_manifest(out)
    if m.get("kind") != "hidden":
        raise ConfigError(f"{out} holds a {m.get('kind')} cache; hidden_out (CACHE= for make extract) names a "
                          f"hidden-state cache")
    unknown = sorted(set(overrides) - set(ExtractConfig.__dataclass_fields__) - set(TokenizeConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; see --help")
    values = {**m["config"]["extract"], "shards": "", "dry_run": False, "allow_overfill": False, "hidden_out": out,
              "tokens": str((Path(out) / m["config"]["tokens_dir"]).resolve())}
    values.update({k: v for k, v in overrides.items() if k in ExtractConfig.__dataclass_fields__ and v != ""})
    return load_config(ExtractConfig, "extract", None, {}, values)


def target_needs(cfg: ExtractConfig) -> tuple[str, ...]:
    """What the target's directory must hold (keys of `targetid.NEEDS`): config.json for a dry run (a storage plan
    from a login node), the weights too for a real run."""
    return ("config",) if cfg.dry_run else ("config", "weights")


def make_plan(cfg: ExtractConfig, tokens: Path | dict) -> dict:
    """`tokens`: the token cache's directory, or (dry run) the manifest stage 1a would write."""
    from .cache.shards import HIDDEN_LAYOUT_VERSION, ShardError
    from .target import default_layer_ids, read_target_info
    from .targetid import resolve_checkpoint, target_fingerprint

    tm = tokens if isinstance(tokens, dict) else read_manifest(tokens)
    if tm["kind"] != "tokens" or not tm.get("complete"):
        raise ShardError(f"{tokens} is not a complete token cache: run `make tokenize` (or extract) again")
    ckpt = resolve_checkpoint(cfg.target, target_needs(cfg), "extract.target")
    weights = any(ckpt.glob("*.safetensors"))  # a dry run plans from config.json alone; its key then lacks them
    info = read_target_info(ckpt)
    layer_ids = list(cfg.layer_ids) or default_layer_ids(info.num_layers, cfg.num_draft_layers)
    bad = [i for i in layer_ids if not 0 <= i < info.num_layers]
    if bad:
        raise ValueError(f"extract.layer_ids {bad} out of range: {ckpt} has layers 0..{info.num_layers - 1}")
    seq_len = tm["producer"]["seq_len"]
    vocab = tm["producer"]["tokenizer"]["vocab_size"]
    sidecar = ckpt / "dflash_target.json"  # the tiny targets name their mask token there
    mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else (
        json.loads(sidecar.read_text()).get("mask_token_id") if sidecar.is_file() else None)
    if mask_id is not None:
        eos = info.eos_token_id if isinstance(info.eos_token_id, list) else [info.eos_token_id]
        specials = {info.pad_token_id, *eos, tm["producer"]["tokenizer"]["pad_id"]} - {None}
        if not 0 <= mask_id < info.vocab_size or mask_id in specials:
            raise ValueError(f"extract.mask_token_id={mask_id} must be a real embedding row in [0, {info.vocab_size}) "
                             f"that is not pad/eos ({sorted(specials)}); Qwen3 uses 151669, Qwen3.5/3.6 use 248070")
    if vocab > info.vocab_size:
        raise ValueError(f"tokenizer has {vocab} tokens but {ckpt} embeds only {info.vocab_size}: wrong tokenizer?")
    k, hidden = len(layer_ids), info.hidden_size
    if cfg.project_dims > hidden:
        raise ConfigError(f"extract.project_dims={cfg.project_dims} is larger than {ckpt}'s hidden size {hidden}: "
                          f"give at most {hidden} (0 stores full states)")
    width = cfg.project_dims or hidden  # values stored per token and tapped layer
    from .cache import encodings

    bytes_per_token = encodings.bytes_per_token(cfg.quant, k, width)
    rows = sum(s["rows"] for s in tm["shards"])
    producer = {"stage": "extract", "tokens": {"key": tm["key"], "producer": tm["producer"]},
                "target": {"arch": info.arch, "num_layers": info.num_layers, "hidden_size": hidden,
                           "vocab_size": info.vocab_size, **target_fingerprint(ckpt, weights)},
                "layer_ids": sorted(layer_ids), "quant": cfg.quant, "dtype": cfg.dtype,
                "format_version": HIDDEN_LAYOUT_VERSION}  # everything that changes a stored byte: the cache key
    if cfg.project_dims:  # (absent when off: the keys of full-state caches stay what they were)
        producer["projection"] = {"dims": cfg.project_dims, "rows": cfg.project_rows}
    return {"ckpt": ckpt, "weights": weights, "info": info, "layer_ids": layer_ids, "seq_len": seq_len,
            "mask_token_id": mask_id, "width": width, "num_shards": tm["num_shards"], "rows": rows, "bytes_per_token": bytes_per_token,
            "total_bytes": rows * seq_len * bytes_per_token, "tokens_manifest": tm, "producer": producer,
            "key": hash_obj(producer)}


OVERFILL = "--allow_overfill=1 (make ARGS=--allow_overfill=1) starts it anyway"  # the override a refusal names


def free_space(cache: Path) -> int:
    """Free bytes on the filesystem `cache` goes to (a dry run creates nothing: the nearest existing folder's)."""
    where = cache
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


def disk_refusal(cache: Path, need_bytes: int, free_bytes: int, min_free_gb: float) -> str:
    """Why a run that writes `need_bytes` into `cache` does not start ('' when it fits, keeping min_free_gb)."""
    if free_bytes - need_bytes >= min_free_gb * 1e9:
        return ""
    return (f"{cache}: the remaining shards need {storage.size(need_bytes)} but the filesystem has "
            f"{storage.size(free_bytes)} free (keeping min_free_gb={min_free_gb:g}): free space, use CACHE= elsewhere, "
            f"a smaller encoding (quant=fp8 or fp4, project_dims=k: the plan sizes each), or fewer layers")


def check_disk(cache: Path, need_bytes: int, min_free_gb: float) -> None:
    if refusal := disk_refusal(cache, need_bytes, free_space(cache), min_free_gb):
        raise ValueError(refusal)
