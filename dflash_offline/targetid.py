"""Identity of a target checkpoint (and of a tokenizer) for cache keys and refusals, without loading weights.

A name or path is not an identity (a fine-tune keeps the architecture and file layout), and a sample of the bytes is
not one either (a copy with embedding rows changed between the samples kept the old fingerprint). The fingerprint is
the SHA-256 of `config.json` and of every weight file's name, size and full SHA-256 (`weights_hash` "sha256"): the
files the shard index lists (or the one model.safetensors), each checked whole first (`weight_files`).
Each file's hash is computed once, on a pool of threads, and remembered by the file's (size, mtime, ctime, inode) in
`.dflash_offline-sha256.json` beside the weights, or, where that directory is read-only or a snapshot of the HF hub
cache (huggingface_hub's files), under `$XDG_CACHE_HOME/dflash_offline` (else `~/.cache/dflash_offline`): a rerun
costs a `stat` per file. Caches made before record the "sampled" fingerprint (16 × 64 KiB of each file; no `weights_hash`): `check_same_target` checks them in
their own scheme, and extraction continues them under their key. `make verify` recomputes hidden states from the
weights themselves on sampled rows.

`resolve_checkpoint` is the one place a target or tokenizer path is turned into a directory and checked to hold what
its caller reads, before any cache or run directory exists: a local directory, or a hub id (`Qwen/Qwen3.6-27B`)
found in the local HF cache (`HF_HUB_CACHE`, else `HF_HOME/hub`; `models--Qwen--Qwen3.6-27B/snapshots/<rev>/` with
`refs/main` naming the revision), offline: nothing is downloaded at run time. `tokenizer_for` is the rule by which the
tokenizer follows the target; `check_same_target` is the trainer's refusal of a cache extracted from other weights.
`vocab_identity` is a tokenizer's (the id of every token, added and special tokens included; what a token cache
records), and `check_tokenizer_fits` refuses a token cache whose ids mean other tokens to the target's tokenizer;
`check_seq_len` refuses rows longer than the target's `max_position_embeddings`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .cache.fsio import HASH_THREADS, hash_obj, sha256_file, write_json_atomic

SAMPLES, SAMPLE_BYTES = 16, 1 << 16  # the "sampled" fingerprint of caches made before full hashes
WEIGHTS_HASH = "sha256"  # producer.target.weights_hash of new caches; absent = "sampled"
HASH_MEMO = ".dflash_offline-sha256.json"  # each weight file's SHA-256 by its (size, mtime, ctime, inode)


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
    """The checkpoint's weight files — those its shard index lists, else its one model.safetensors — each checked
    whole (`check_whole`): an interrupted download is refused before anything is tokenized, hashed or loaded, naming
    the file. Other *.safetensors beside them are not the checkpoint's (the loaders never read them) and count for
    nothing, the fingerprint included."""
    single = ckpt / "model.safetensors"
    if not (ckpt / "model.safetensors.index.json").is_file() and single.is_file():
        check_whole(ckpt, single)  # (before its header is read for the tensor names)
    files = sorted(set(weight_map(ckpt).values()))
    for f in files:
        check_whole(ckpt, f)
    return files


def check_whole(ckpt: Path, path: Path) -> None:
    """Refuse a weight file that is absent, or shorter than its header says its tensors need (a download cut short)."""
    redo = (f"the checkpoint {ckpt} is incomplete (an interrupted download or copy?): download or copy it again "
            f"(huggingface-cli download resumes), then rerun")
    if not path.is_file():
        raise TargetError(f"{path}: missing, though {ckpt.name}'s model.safetensors.index.json lists it; {redo}")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                raise ValueError
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError):
        raise TargetError(f"{path}: not a whole safetensors file ({size:,} bytes, its header unreadable); {redo}") \
            from None
    if size < 8 + header_len + end:
        raise TargetError(f"{path}: {size:,} bytes where its header's tensors need {8 + header_len + end:,}; {redo}")


def file_fingerprint(path: Path) -> str:
    """The "sampled" fingerprint of one file (caches made before full hashes): name, size, header, 16 × 64 KiB."""
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


def file_stamp(path: Path) -> dict:
    """What changes when a file's bytes may have: a copy has another inode, a write another mtime and ctime."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def is_hub_snapshot(ckpt: Path) -> bool:
    """A revision in the HF hub cache (`models--ORG--NAME/snapshots/<rev>/`): huggingface_hub's files, not ours."""
    return ckpt.parent.name == "snapshots" and ckpt.parent.parent.name.startswith("models--")


def memo_paths(ckpt: Path) -> list[Path]:
    """Where the weights' hashes are remembered, the first writable one taking them: beside them, then the user's
    cache (a read-only checkpoint; a hub cache snapshot, which gets no file of ours, goes there first)."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash_offline"
    places = [ckpt / HASH_MEMO, home / f"sha256-{hash_obj(str(ckpt.resolve()))[:16]}.json"]
    return places[::-1] if is_hub_snapshot(ckpt) else places


def read_memo(ckpt: Path) -> list[dict]:
    """Every remembered table (beside the weights first): `weight_hashes` takes, per file, the first entry whose
    stamp still matches, so a stale copy in one place never hides a current one in the other."""
    out = []
    for p in memo_paths(ckpt):
        try:
            memo = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(memo, dict):
            out.append(memo)
    return out


def write_memo(ckpt: Path, memo: dict) -> None:
    """Remember the hashes in the first place that takes them; nowhere writable only costs a rehash next time."""
    for p in memo_paths(ckpt):
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(p, memo, durable=False)
            return
        except OSError:
            continue


def rel_name(ckpt: Path, f: Path) -> str:
    """A weight file's name in the fingerprint and the memo: its path under `ckpt` (its bare name for the usual flat
    checkpoint, so existing fingerprints stay what they were; an index may name files in subfolders)."""
    return f.relative_to(ckpt).as_posix()


def weight_hashes(ckpt: Path, files: list[Path], threads: int = HASH_THREADS) -> dict[str, str]:
    """File name (`rel_name`) → full SHA-256 of each of `files` (in `ckpt`): remembered ones whose stamp still
    matches, the others hashed on `threads` threads (hashlib releases the GIL) and remembered."""
    names = {f: rel_name(ckpt, f) for f in files}
    stamps = {names[f]: file_stamp(f) for f in files}
    memo = {}
    for table in reversed(read_memo(ckpt)):  # (current entries of either place; beside the weights wins a tie)
        memo.update({k: v for k, v in table.items() if isinstance(v, dict) and v.get("stamp") == stamps.get(k)})
    todo = [f for f in files if names[f] not in memo]
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(todo)))) as pool:
            for f, digest in zip(todo, pool.map(sha256_file, todo), strict=True):
                memo[names[f]] = {"stamp": stamps[names[f]], "sha256": digest}
        write_memo(ckpt, memo)
    return {names[f]: memo[names[f]]["sha256"] for f in files}


def target_fingerprint(ckpt: Path, weights: bool = True, scheme: str = WEIGHTS_HASH, every_file: bool = False) -> dict:
    """{"config_sha256", "weights_fingerprint", "weights_hash"}; `weights` False (a storage plan from config.json
    alone): the weights' fingerprint is None. `scheme` "sampled": the fingerprint of caches made before full hashes
    (their producer has no `weights_hash`, and neither has this result). `every_file`: over every *.safetensors in
    `ckpt`, as caches made before the fingerprint took the index's files only (`target_mismatch` tries it)."""
    cfg = ckpt / "config.json"
    if not cfg.is_file():
        raise TargetError(f"{ckpt}: no config.json; is this a Hugging Face checkpoint directory?")
    config_text = json.dumps(json.loads(cfg.read_text()), sort_keys=True)
    files = (sorted(ckpt.glob("*.safetensors")) if every_file else weight_files(ckpt)) if weights else []
    fingerprint = hashlib.sha256()
    if scheme == "sampled":
        for f in files:
            fingerprint.update(file_fingerprint(f).encode())
    else:
        for name, digest in weight_hashes(ckpt, files).items():
            fingerprint.update(f"{name}:{(ckpt / name).stat().st_size}:{digest}\n".encode())
    out = {"config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
           "weights_fingerprint": fingerprint.hexdigest() if weights else None}
    return out if scheme == "sampled" else dict(out, weights_hash=scheme)


def target_mismatch(target: str, recorded: dict, where: str = "the cache") -> list[str]:
    """How `target`'s fingerprint differs from `recorded` (a cache's producer.target, in its own scheme; recorded in
    `where`), one phrase a field; [] when it is the same target."""
    ckpt, scheme = resolve_checkpoint(target), recorded.get("weights_hash", "sampled")
    got = target_fingerprint(ckpt, scheme=scheme)
    diff = [f"{k} {got[k][:16]} here, {str(recorded.get(k))[:16]} in {where}" for k in FINGERPRINT_KEYS
            if got[k] != recorded.get(k)]
    if diff and sorted(ckpt.glob("*.safetensors")) != weight_files(ckpt):  # a cache fingerprinted over every file
        legacy = target_fingerprint(ckpt, scheme=scheme, every_file=True)
        if all(legacy[k] == recorded.get(k) for k in FINGERPRINT_KEYS):
            return []
    return diff


def check_same_target(target: str, recorded: dict, cache: str, cache_target: str, use: str = "train") -> None:
    """Refuse `target` unless its fingerprint equals `recorded`, the producer.target of the cache at `cache`, which was
    extracted from `cache_target`. The whole fingerprint counts: the cache's hidden states came from all weights.
    `use`: what the caller does with it (train, verify), for the message."""
    if not (diff := target_mismatch(target, recorded)):
        return
    if target == cache_target or Path(target).resolve() == Path(cache_target).resolve():
        what = f"target {target} has changed since {cache} was extracted from it"
        fix = "put back the checkpoint the cache was extracted from"
    else:
        what = f"target {target} is not the target {cache} was extracted from ({cache_target})"
        fix = f"{use} with the target the cache was extracted from (target={cache_target})"
    raise TargetError(f"{what}: {'; '.join(diff)}; its hidden states came from other weights. Either {fix}, or "
                      f"re-extract the cache from this target (make extract TARGET={target})")


# --- what else must fit the target: the token ids and the row length ----------------------------------------------


def vocab_identity(tok) -> dict:
    """{"vocab_sha256", "vocab_size"}: the SHA-256 of the tokenizer's id of every token (added tokens included) and of
    which added tokens are special — what a token id means; two tokenizers with one size can differ in it. Not the
    chat template or the special-token roles (a base and an instruct checkpoint share ids, not their eos)."""
    added = sorted((i, t.content, bool(t.special)) for i, t in tok.added_tokens_decoder.items())
    return {"vocab_sha256": hash_obj({"vocab": sorted(tok.get_vocab().items(), key=lambda kv: kv[1]),
                                      "added": added}),
            "vocab_size": len(tok)}


def check_tokenizer_fits(ckpt: Path, tokens: str, recorded: dict | None, tokens_tokenizer: str) -> str:
    """Refuse a token cache (`tokens`, made with `tokens_tokenizer`, which recorded `recorded`: its `vocab_identity`)
    whose token ids mean other tokens to the target's own tokenizer: one TargetError line saying which each side has
    and what to do. Returns what could not be checked ('' when checked): a target without tokenizer files, a token
    cache made before caches recorded their tokenizer's vocabulary."""
    if not holds(str(ckpt), "tokenizer"):
        return f"{ckpt} ships no tokenizer: the token cache's ({tokens_tokenizer}) is taken as the target's, unchecked"
    if not recorded:
        return (f"token cache {tokens} records no tokenizer vocabulary (made before caches did): its ids are not "
                f"checked against {ckpt}'s tokenizer; rerun make tokenize (or extract without tokens=) to record it")
    from transformers import AutoTokenizer

    mine = vocab_identity(AutoTokenizer.from_pretrained(str(ckpt)))
    if mine["vocab_sha256"] == recorded["vocab_sha256"]:
        return ""
    raise TargetError(
        f"token cache {tokens} was made with tokenizer {tokens_tokenizer} (vocab {recorded['vocab_sha256'][:12]}, "
        f"{recorded['vocab_size']} tokens) but target {ckpt} ships another (vocab {mine['vocab_sha256'][:12]}, "
        f"{mine['vocab_size']} tokens): its token ids would index other embedding rows. Tokenize with the target's "
        f"own tokenizer (drop tokens= and --tokenizer=, or pass --tokenizer={ckpt})")


def max_positions(ckpt: Path) -> int | None:
    """The target's `max_position_embeddings` (its text config's, else the top level's); None when it names none."""
    raw = json.loads((ckpt / "config.json").read_text())
    return (raw.get("text_config") or {}).get("max_position_embeddings") or raw.get("max_position_embeddings")


def check_seq_len(seq_len: int, ckpt: Path, field: str = "tokenize.seq_len") -> None:
    """Refuse rows longer than the positions the target was made for (its rotary tables and training end there)."""
    limit = max_positions(ckpt)
    if limit and seq_len > limit:
        raise TargetError(f"{field}={seq_len} is longer than {ckpt}'s max_position_embeddings={limit}: the target "
                          f"was not made for positions past {limit}; use seq_len ≤ {limit} (--seq_len=, make "
                          f"ARGS=--seq_len=N)")


def special_ids(ckpt: Path, info) -> set[int]:
    """The checkpoint's pad and end ids: config.json's (`info`), generation_config.json's (what generation stops on:
    Qwen3.5/3.6 list <|im_end|> there) and the tokenizer's pad/eos tokens (tokenizer_config.json, by their ids in its
    added tokens)."""
    ids: set = set()

    def add(v):
        ids.update(v if isinstance(v, list) else [v])

    add(info.eos_token_id), add(info.pad_token_id)
    gen = ckpt / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text())
        add(g.get("eos_token_id")), add(g.get("pad_token_id"))
    tc, tj = ckpt / "tokenizer_config.json", ckpt / "tokenizer.json"
    if tc.is_file():
        t = json.loads(tc.read_text())
        names = {v.get("content") if isinstance(v, dict) else v for v in (t.get("eos_token"), t.get("pad_token"))}
        added = [(int(i), tok) for i, tok in (t.get("added_tokens_decoder") or {}).items()]
        if not added and tj.is_file():  # (the fast tokenizer's file lists them)
            added = [(tok.get("id"), tok) for tok in json.loads(tj.read_text()).get("added_tokens") or []]
        add([i for i, tok in added if isinstance(tok, dict) and tok.get("content") in names - {None}])
    return {int(i) for i in ids if isinstance(i, int)}


def check_mask_token(mask_id: int, ckpt: Path, info, field: str, also: tuple = ()) -> None:
    """Refuse a mask token that is not a real embedding row of the target, or that is one of its pad/end tokens
    (`special_ids`, and `also`): the drafter's every masked slot would read as one."""
    specials = special_ids(ckpt, info) | ({*also} - {None})
    if not 0 <= mask_id < info.vocab_size or mask_id in specials:
        raise ValueError(f"{field}={mask_id} must be a real embedding row in [0, {info.vocab_size}) of {ckpt} that is "
                         f"not pad/eos ({sorted(specials)}); Qwen3 uses 151669, Qwen3.5/3.6 use 248070")
