"""Identity of a target checkpoint for cache keys, computed in milliseconds without loading weights.

Hashing 54 GB of weights on every run is not an option, and a name or path is not an identity (a fine-tune keeps
the architecture and file layout). The fingerprint is the SHA-256 of `config.json`, of every safetensors file's
name, size and header (tensor names, dtypes, shapes, offsets), and of 16 evenly spaced 64 KiB samples of each
file's bytes — a different fine-tune of the same shapes changes the samples. `make verify` recomputes hidden
states from the weights themselves on sampled rows, which catches anything the fingerprint could miss.

`resolve_checkpoint` is the one place a target or tokenizer path is turned into a directory and checked to hold what
its caller reads, before any cache or run directory exists: a local directory, or a hub id (`Qwen/Qwen3.6-27B`)
found in the local HF cache (`HF_HUB_CACHE`, else `HF_HOME/hub`; `models--Qwen--Qwen3.6-27B/snapshots/<rev>/` with
`refs/main` naming the revision), offline: nothing is downloaded at run time. `tokenizer_for` is the rule by which the
tokenizer follows the target; `check_same_target` is the trainer's refusal of a cache extracted from other weights.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

SAMPLES, SAMPLE_BYTES = 16, 1 << 16


class TargetError(ValueError):
    """A target or tokenizer path that cannot be used, or a target that is not the cache's; the message says why."""


# what a caller may need from a checkpoint directory: (file patterns, any one of which is enough; how to name them)
NEEDS = {
    "config": (("config.json",), "config.json"),
    "weights": (("*.safetensors",), "*.safetensors weights"),
    "tokenizer": (("tokenizer.json", "tokenizer_config.json"), "tokenizer.json or tokenizer_config.json"),
}
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt"]
FINGERPRINT_KEYS = ("config_sha256", "weights_fingerprint")


def resolve_checkpoint(target: str, need: tuple[str, ...] = ("config", "weights"), field: str = "target") -> Path:
    """The directory `target` names, a local directory or a hub id already in the local HF cache (no downloads at
    run time), checked to hold what the caller reads (`need`: keys of NEEDS). Cheap: call it before creating
    anything. Every failure is one TargetError line naming `field`, the path and what is expected."""
    expected = (f"expected a directory with {' and '.join(NEEDS[n][1] for n in need)}, or a hub id already in the "
                f"local HF cache")
    ckpt = _locate(target, field, expected)
    missing = [NEEDS[n][1] for n in need if not any(any(ckpt.glob(pat)) for pat in NEEDS[n][0])]
    if missing:
        raise TargetError(f"{field} {target!r}: {ckpt} has no {' and no '.join(missing)}; {expected}")
    return ckpt


def _locate(target: str, field: str, expected: str) -> Path:
    if not target:
        raise TargetError(f"{field} is empty; {expected}")
    p = Path(target).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise TargetError(f"{field} {target!r} is a file; {expected}")
    if not is_hub_id(target):
        raise TargetError(f"{field} {target!r}: no such directory; {expected}")
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(target, local_files_only=True, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # the hub client's many ways of saying "not here" (validation, not cached, offline)
        raise TargetError(
            f"{field} {target!r}: no such directory, and not in the local HF cache {constants.HF_HUB_CACHE} "
            f"({type(e).__name__}; HF_HUB_CACHE or HF_HOME point elsewhere); {expected}: download it first "
            f"(huggingface-cli download {target}) or pass the checkpoint's directory"
        ) from None


def tokenizer_for(target: str, recipe_tokenizer: str = "", target_given: bool = True) -> tuple[str, str]:
    """Stage 1a's tokenizer when the command line names none (`--tokenizer=` always wins), and why: the target's own
    when its directory (or hub snapshot) holds tokenizer files, unless the target is the recipe's and the recipe
    pairs it with a tokenizer of its own (`target_given` False); else the recipe's `[tokenize] tokenizer`; else the
    target, whose check then says what is missing."""
    if recipe_tokenizer and not target_given:
        return recipe_tokenizer, "the recipe's [tokenize] tokenizer"
    if holds(target, "tokenizer"):
        return target, "the target's own"
    if recipe_tokenizer:
        return recipe_tokenizer, "the recipe's [tokenize] tokenizer: the target holds no tokenizer files"
    return target, "the target's"


def holds(target: str, need: str) -> bool:
    """Whether `target` resolves (locally, offline) to a directory holding NEEDS[need]; never raises."""
    try:
        resolve_checkpoint(target, need=(need,))
    except TargetError:
        return False
    return True


def is_hub_id(target: str) -> bool:
    """`owner/name` as the hub spells repo ids (a path like `build/demo/target` or `./x` is not one)."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", target) is not None and ".." not in target


def weight_map(ckpt: Path) -> dict[str, Path]:
    """Checkpoint tensor name → the safetensors file holding it, from the shard index or the single file's header
    (the one reader of a checkpoint's layout: the target loader and the drafter's frozen tables both use it)."""
    from safetensors import safe_open

    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        return {k: ckpt / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = ckpt / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise TargetError(f"{ckpt}: no model.safetensors or model.safetensors.index.json; pass a target checkpoint")


def weight_files(ckpt: Path) -> list[Path]:
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise TargetError(f"{ckpt}: no *.safetensors weights (only safetensors checkpoints are supported)")
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


def target_fingerprint(ckpt: Path, weights: bool = True) -> dict:
    """{"config_sha256", "weights_fingerprint"}; `weights` False (a storage plan from config.json alone): the
    weights' fingerprint is None."""
    cfg = ckpt / "config.json"
    if not cfg.is_file():
        raise TargetError(f"{ckpt}: no config.json; is this a Hugging Face checkpoint directory?")
    config_text = json.dumps(json.loads(cfg.read_text()), sort_keys=True)
    fingerprint = hashlib.sha256()
    for f in weight_files(ckpt) if weights else []:
        fingerprint.update(file_fingerprint(f).encode())
    return {
        "config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
        "weights_fingerprint": fingerprint.hexdigest() if weights else None,
    }


def check_same_target(target: str, recorded: dict, cache: str, cache_target: str) -> None:
    """Refuse `target` unless its fingerprint equals `recorded`, the producer.target of the cache at `cache`, which was
    extracted from `cache_target`. The whole fingerprint counts: the cache's hidden states came from all weights."""
    got = target_fingerprint(resolve_checkpoint(target))
    diff = [f"{k} {got[k][:16]} here, {str(recorded.get(k))[:16]} in the cache" for k in FINGERPRINT_KEYS
            if got[k] != recorded.get(k)]
    if not diff:
        return
    if target == cache_target or Path(target).resolve() == Path(cache_target).resolve():
        what = f"target {target} has changed since {cache} was extracted from it"
        fix = "put back the checkpoint the cache was extracted from"
    else:
        what = f"target {target} is not the target {cache} was extracted from ({cache_target})"
        fix = f"train with the target the cache was extracted from (target={cache_target})"
    raise TargetError(f"{what}: {'; '.join(diff)}; its hidden states came from other weights. Either {fix}, or "
                      f"re-extract the cache from this target (make extract TARGET={target})")
