"""An extraction's plan: what a run of stage 1b will compute and where, decided before any weight loads.

`ExtractPlan` is that plan, frozen, with typed fields; `plan_run` builds it, in seconds, so that every refusal
comes before the weights load. First the token cache (`token_cache`: given, or made by stage 1a's library,
`tokenization.py`, on rank 0 while the other ranks wait; a dry run's is a manifest in memory), checked against the
target (`check_tokens_fit`). Then `make_plan`'s facts about the cache: it reads the token cache's manifest and the
target's config.json (plus a fingerprint of its weights; a dry run needs none, and its key then leaves them out):
the layers to tap (checked against the target's depth), the mask token (a real embedding row that is not pad or
eos), the bytes per token of the chosen storage, and the producer — everything that changes a stored byte — whose
hash is the hidden cache's key (`continued_legacy_cache`: a cache keyed by the sampled weight fingerprint is
continued, not redone). Then this run's: the cache directory, the shards to do (`shards_to_do`), the disk room
(`disk_room`; `disk_refusal` says why a run the filesystem has no room for does not start, `allow_overfill=1` starts
it anyway) and the kernel check on a small random model of the target's widths (`check_kernels`). The storage plan
the dry run prints around these numbers is `storage.py`. `recorded_config` is the rerun of an existing hidden cache:
with `--cache=DIR` and no recipe, the ExtractConfig its manifest recorded (less a one-off `allow_overfill`), so
the repair command that training and verify print works as printed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import storage
from .cache.fsio import free_space, hash_obj, remove_dead_temps
from .cache.manifest import (
    committed,
    diff_producers,
    has_manifest,
    missing_files,
    projection_problem,
    read_manifest,
)
from .cache.manifest import token_cache as hidden_token_cache
from .config import (
    ConfigError,
    ExtractConfig,
    TokenizeConfig,
    applied_overrides,
    check_renamed,
    load_config,
    parse_overrides,
    parse_shard_list,
    upgrade_recorded,
)
from .corpus import CorpusError
from .devices import pick_device
from .progress import log


@dataclass(frozen=True)
class ExtractPlan:
    """What a run of stage 1b computes and where: `make_plan`'s facts about the cache (the same for every process
    and run of its key), then `plan_run`'s about this run (left at their defaults by `make_plan`)."""

    ckpt: Path  # the target's resolved directory
    weights: bool  # it holds *.safetensors (a dry run may plan from config.json alone: its key then lacks them)
    info: object  # the target's config.json (`target.TargetInfo`)
    layer_ids: list[int]  # the tapped layers, as configured (the producer records them sorted)
    seq_len: int  # tokens a row (the token cache's)
    mask_token_id: int | None  # the drafter's mask token, when known here
    width: int  # values stored per token and tapped layer: project_dims, else the hidden size
    num_shards: int  # the token cache's shards, so the hidden cache's
    rows: int  # rows over all shards
    bytes_per_token: int  # stored bytes per token over all taps
    total_bytes: int  # the whole cache's shard bytes
    tokens_manifest: dict  # the token cache's manifest (a dry run's: computed in memory)
    producer: dict  # everything that changes a stored byte
    key: str  # the producer's hash: the cache's key
    tokens_dir: Path | dict | None = None  # this run's token cache (a dry run: its manifest in memory)
    cache: Path | None = None  # the hidden cache's directory
    device: object = None  # the torch.device this process computes on
    todo: list[int] = field(default_factory=list)  # the shards to do
    redo: bool = False  # SHARD= named them: redone even when committed
    todo_rows: int = 0  # their rows
    need: int = 0  # bytes they write (the dry run's token cache included)
    token_bytes: int = 0  # of which the token cache a dry run has not written yet
    free: int = 0  # free bytes where the cache goes
    refusal: str = ""  # why the disk has no room ('' when it fits)
    minutes: float | None = None  # the kernel check's estimate for this process (None: not checked)
    kernels: str = "not checked here"  # the kernel check's verdict
    t0: float = 0.0  # when planning began (time.time())


def recorded_config(argv: list[str]) -> ExtractConfig | None:
    """For `--cache=DIR` naming an existing hidden cache and no `--recipe`: the ExtractConfig its manifest
    recorded (reading the token cache it was made from), with the command line's non-empty settings on top, so that
    `make extract CACHE=DIR SHARD=k` works as printed. None otherwise."""
    if any(a in ("-h", "--help") for a in argv):
        return None
    specs = [(ExtractConfig, "extract"), (TokenizeConfig, "tokenize")]
    recipe, overrides = parse_overrides(argv, specs)
    check_renamed(overrides, specs, "extract")
    out = overrides.get("cache", "")
    if recipe or not out or not has_manifest(out):
        return None
    m = read_manifest(out)
    if m.get("kind") != "hidden":
        raise ConfigError(f"{out} holds a {m.get('kind')} cache; --cache (CACHE= for make extract) names a "
                          f"hidden-state cache")
    unknown = sorted(set(overrides) - set(ExtractConfig.__dataclass_fields__) - set(TokenizeConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; see --help")
    values = {**upgrade_recorded("extract", m["config"]["extract"]), "shards": "", "dry_run": False,
              "allow_overfill": False, "cache": out,
              "tokens": str(hidden_token_cache(Path(out), m)[0])}  # (moved alone: the absolute --tokens it was given)
    check_stage_1a_unchanged(out, values["tokens"], {k: v for k, v in overrides.items()
                                                     if k not in ExtractConfig.__dataclass_fields__ and v != ""})
    # (an empty override keeps the recorded value, but for EMPTY_CLEARS's: --from_cache= computes from the target)
    values.update(applied_overrides("extract", overrides, ExtractConfig.__dataclass_fields__))
    return load_config(ExtractConfig, "extract", None, {}, values)


# stage 1a's settings that make its token cache (`tokenization.producer_for`); the others (workers, strict, …) only
# say how a token cache is made
TOKEN_KEY_SETTINGS = ("tokenizer", "corpus", "seq_len", "open_rows", "long_doc", "rows_per_shard", "thinking", "turns",
                      "empty_think", "max_docs", "template_kwargs")


def check_stage_1a_unchanged(cache: str, tokens: str, given: dict[str, str]) -> None:
    """An existing hidden cache continues from the token cache it was extracted from: a stage 1a setting given now
    (CORPUS=, --seq_len, …) that differs from the one that token cache was made with would be silently ignored (the
    user then trains on the old corpus), so it is refused naming it."""
    if not (given := {k: v for k, v in given.items() if k in TOKEN_KEY_SETTINGS}):
        return
    try:
        recorded = read_manifest(tokens, kind="tokens")["config"]
    except (ValueError, KeyError, OSError):  # (a missing token cache is said so by the plan, naming it)
        return
    base = load_config(TokenizeConfig, "tokenize", None, {}, recorded)
    now = load_config(TokenizeConfig, "tokenize", None, given, recorded)
    def same(k):  # by meaning: the files a corpus names, a tokenizer's directory, the settings' object
        a, b = getattr(now, k), getattr(base, k)
        if a == b:
            return True
        try:
            if k == "corpus":
                from .corpus import expand_paths

                return [p.resolve() for p in expand_paths(a)] == [p.resolve() for p in expand_paths(b)]
            if k == "tokenizer":
                return Path(a).resolve() == Path(b).resolve()
            if k == "template_kwargs":
                from .chat import parse_settings

                return parse_settings(a) == parse_settings(b)
        except ValueError:  # (a corpus not here, settings not JSON: not the same)
            return False
        return False

    if diff := [k for k in given if not same(k)]:
        said = ", ".join(f"{k}={getattr(now, k)!r} (made with {getattr(base, k)!r})" for k in diff)
        raise ConfigError(f"{cache} continues from its token cache {tokens}, which stage 1a made with other settings: "
                          f"{said}. An existing cache's data cannot change: drop them to continue or repair this "
                          f"cache, or leave CACHE= out (RECIPE= and these settings) to extract a new one")


def target_needs(cfg: ExtractConfig) -> tuple[str, ...]:
    """What the target's directory must hold (keys of `targetid.NEEDS`): config.json for a dry run (a storage plan
    from a login node), the weights too for a real run."""
    return ("config",) if cfg.dry_run else ("config", "weights")


def weights_missing(ckpt: Path) -> str:
    """'' when `ckpt` holds its whole set of weight files (`targetid.weight_files`), else what is missing."""
    from .targetid import TargetError, weight_files

    try:
        weight_files(ckpt)
    except TargetError as e:
        return str(e).split("; ")[0]
    return ""


def target_settings(cfg: ExtractConfig, ckpt: Path) -> tuple:
    """(target info, taps, mask token id or None) with the taps and the mask token checked against the target's
    config alone: run before stage 1a, so a bad one fails in seconds, not after the corpus is tokenized."""
    from .target import default_layer_ids, read_target_info
    from .targetid import check_mask_token

    info = read_target_info(ckpt)
    layer_ids = list(cfg.layer_ids) or default_layer_ids(info.num_layers, cfg.num_draft_layers)
    bad = [i for i in layer_ids if not 0 <= i < info.num_layers]
    if bad:
        raise ValueError(f"extract.layer_ids {bad} out of range: {ckpt} has layers 0..{info.num_layers - 1}")
    sidecar = ckpt / "dflash_target.json"  # the tiny targets name their mask token there
    mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else (
        json.loads(sidecar.read_text()).get("mask_token_id") if sidecar.is_file() else None)
    if mask_id is not None:
        check_mask_token(mask_id, ckpt, info, "extract.mask_token_id")
    return info, layer_ids, mask_id


def make_plan(cfg: ExtractConfig, tokens: Path | dict) -> ExtractPlan:
    """The facts about the cache; `tokens`: the token cache's directory, or (dry run) the manifest stage 1a would
    write."""
    from .cache.shards import HIDDEN_LAYOUT_VERSION, ShardError
    from .targetid import check_mask_token, resolve_checkpoint, target_fingerprint

    tm = tokens if isinstance(tokens, dict) else read_manifest(tokens, kind="tokens")
    if not tm.get("complete"):
        raise ShardError(f"{tokens} is not a complete token cache: run `make tokenize` (or extract) again")
    ckpt = resolve_checkpoint(cfg.target, target_needs(cfg), "extract.target")
    weights = not cfg.dry_run or not weights_missing(ckpt)  # a dry run plans from config.json alone; its key then
    # lacks them
    info, layer_ids, mask_id = target_settings(cfg, ckpt)
    seq_len = tm["producer"]["seq_len"]
    vocab = tm["producer"]["tokenizer"]["vocab_size"]
    if mask_id is not None:  # (again with the token cache's pad id)
        check_mask_token(mask_id, ckpt, info, "extract.mask_token_id", (tm["producer"]["tokenizer"]["pad_id"],))
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
    return ExtractPlan(ckpt=ckpt, weights=weights, info=info, layer_ids=layer_ids, seq_len=seq_len,
                       mask_token_id=mask_id, width=width, num_shards=tm["num_shards"], rows=rows,
                       bytes_per_token=bytes_per_token, total_bytes=rows * seq_len * bytes_per_token,
                       tokens_manifest=tm, producer=producer, key=hash_obj(producer))


OVERFILL = "--allow_overfill=1 (make ARGS=--allow_overfill=1) starts it anyway"  # the override a refusal names


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


# --- this run: everything that can fail, before any weight loads -----------------------------------------------


def plan_run(cfg: ExtractConfig, tok_cfg: TokenizeConfig | None, rank: int, world: int, local_rank: int) -> ExtractPlan:
    """The plan plus this run's cache, device, shards to do and the kernel check: everything that can fail before the
    weights load, in seconds (stage 1a runs first when the token cache is not there yet)."""
    from .targetid import check_seq_len, resolve_checkpoint, weight_files

    t0 = time.time()
    ckpt = resolve_checkpoint(cfg.target, target_needs(cfg), "extract.target")  # a wrong path fails before stage 1a
    if not cfg.dry_run:
        weight_files(ckpt)  # and so does a checkpoint cut short (a file its index lists absent or truncated)
    device = pick_device(cfg.device, "extract.device", local_rank)
    target_settings(cfg, ckpt)  # taps and mask token: before stage 1a tokenizes the corpus
    if tok_cfg is not None and not cfg.tokens:
        check_seq_len(tok_cfg.seq_len, ckpt)
    tokens_dir = token_cache(cfg, tok_cfg, rank)
    check_tokens_fit(ckpt, tokens_dir, rank)
    facts = continued_legacy_cache(cfg, make_plan(cfg, tokens_dir), rank)
    plan = replace(facts, tokens_dir=tokens_dir, device=device, t0=t0, **shards_to_do(cfg, facts))
    plan = replace(plan, **disk_room(cfg, plan, rank))
    log(f"[rank {rank}/{world}] {plan.info.arch} target {plan.ckpt} taps {plan.layer_ids} "
        f"({plan.bytes_per_token} B/token {cfg.quant}"
        f"{f', projected to {cfg.project_dims} dims a tap' if cfg.project_dims else ''}); "
        f"{len(plan.todo)}/{plan.num_shards} shards to do, "
        f"{plan.need / 1e9:.2f} GB; device {device}")
    if cfg.from_cache and plan.todo:  # (before the kernel check and any write: a source that cannot give it refused)
        from .derive import source_problem

        if why := source_problem(cfg.from_cache, plan):
            raise ConfigError(f"extract.from_cache: {why}")
    if cfg.dry_run and not plan.weights:
        log(f"[rank {rank}] dry run without weights ({weights_missing(plan.ckpt)}): the cache's key, and "
            f"so its directory and the shards already done, are the real run's only once the weights are there")
    return replace(plan, **check_kernels(cfg, plan, rank, world))


def complete_cache(d: str | Path) -> bool:
    return has_manifest(d) and bool(read_manifest(d).get("complete"))


def token_cache(cfg: ExtractConfig, tok_cfg: TokenizeConfig | None, rank: int) -> Path | dict:
    """The token cache: `--tokens=DIR` holding a complete one, or made/reused by stage 1a (into `--tokens=DIR` when
    given: the same flag in extract's two configs; rank 0 writes it; other ranks wait for it). A dry run writes
    nothing: it gets the manifest stage 1a would leave (read from disk when that cache is complete)."""
    from . import tokenization

    if cfg.tokens and tok_cfg is None:
        return Path(cfg.tokens)
    if cfg.tokens:
        tok_cfg = replace(tok_cfg, tokens=tok_cfg.tokens or cfg.tokens)  # (a recipe's [extract] tokens, too)
        check_tokens_dir(Path(cfg.tokens), tok_cfg)
        if complete_cache(cfg.tokens):
            return Path(cfg.tokens)
        log(f"stage 1a writes the token cache into --tokens={cfg.tokens}")
    if cfg.dry_run:
        return tokenization.dry_run(tok_cfg)
    if rank == 0:
        return tokenization.run(tok_cfg)
    out = tokenization.identify(tok_cfg)[-1]
    while not (has_manifest(out) and read_manifest(out).get("complete")):
        time.sleep(2)
    return out


def check_tokens_dir(d: Path, tok_cfg: TokenizeConfig) -> None:
    """`--tokens=DIR` beside a corpus: a complete token cache there is read as it is (said in one line when this
    corpus and [tokenize] settings would make another: its own settings are the ones used); DIR is written only when
    it is new, empty, or a token cache of that key begun before — never a directory of other files (a typo, a cache
    root) tokenized into, nor an unfinished cache of other settings."""
    from . import tokenization

    if has_manifest(d):
        m = read_manifest(d)
        complete = m.get("kind") == "tokens" and m.get("complete")
        try:
            key = tokenization.identify(tok_cfg)[3]
        except CorpusError as e:  # a complete token cache copied to a machine without the corpus reads as it is
            if not complete:
                raise
            log(f"--tokens={d}: its token cache (key {str(m.get('key'))[:12]}) is read as it is; the corpus and "
                f"[tokenize] settings were not compared with it ({e})")
            return
        if complete and m.get("key") != key:
            log(f"--tokens={d}: its token cache (key {str(m.get('key'))[:12]}) is read as it is, with the [tokenize] "
                f"settings it was made with — this corpus and these settings would make key {key[:12]} (leave "
                f"--tokens (TOKENS=) empty to make that one)")
        elif (m.get("kind") != "tokens" or m.get("key") != key) and not tokenization.failed_empty(d, key):
            raise ConfigError(f"--tokens={d} holds a {m.get('kind')} cache of key {str(m.get('key'))[:12]}; this "
                              f"corpus and [tokenize] settings make key {key[:12]}: another cache, never continued nor "
                              f"overwritten — give another --tokens (TOKENS=), or none (then cache_root/tokens-<key>)")
    elif d.is_dir() and any(d.iterdir()):
        raise ConfigError(f"--tokens={d} holds no token cache (no manifest.json) and is not empty: stage 1a writes a "
                          f"token cache only into a new or empty directory — give another --tokens (TOKENS=), or none")


def check_named_corpus(d: Path, tok_cfg: TokenizeConfig) -> None:
    """CORPUS= named on the command line beside TOKENS= holding a complete token cache of other corpus files with
    other contents: refused (that cache would be read as it is, and the hidden cache would hold the other corpus's
    tokens). The same files (changed since: a regen still appending, --partial_regen), the same contents elsewhere, a
    corpus from the recipe, other [tokenize] settings, or a corpus not on this machine keep `check_tokens_dir`'s
    reading as it is."""
    from .corpus import corpus_hash, expand_paths

    if not has_manifest(d):
        return
    m = read_manifest(d)
    have = ((m.get("producer") or {}).get("corpus") or {}).get("sha256")
    made = (m.get("config") or {}).get("corpus") or []
    if m.get("kind") != "tokens" or not m.get("complete") or not have:
        return
    try:
        named = expand_paths(tok_cfg.corpus)
    except CorpusError:
        return

    def files(patterns) -> set:
        try:
            return {p.resolve() for p in expand_paths(patterns)}
        except CorpusError:
            return {Path(p).resolve() for p in patterns}

    if {p.resolve() for p in named} == files(made) or corpus_hash(named) == have:
        return
    raise ConfigError(f"--tokens={d} (TOKENS=) holds the token cache of other corpus files ({', '.join(made) or '?'}), "
                      f"not of CORPUS={','.join(tok_cfg.corpus)}: the extraction would read those files' tokens. Leave "
                      f"TOKENS= empty to tokenize CORPUS= (into cache_root/tokens-<key>), give another TOKENS=, or leave "
                      f"CORPUS= empty to extract {d} as it is")


def check_tokens_fit(ckpt: Path, tokens: Path | dict, rank: int) -> None:
    """Refuse a token cache whose rows are longer than the target's positions or whose ids mean other tokens to the
    target's tokenizer (`targetid`); say what could not be checked. Seconds, before the fingerprint and the weights."""
    from .targetid import check_seq_len, check_tokenizer_fits

    tm = tokens if isinstance(tokens, dict) else read_manifest(tokens, kind="tokens")
    label = "(in memory)" if isinstance(tokens, dict) else str(tokens)
    check_seq_len(tm["producer"]["seq_len"], ckpt, f"token cache {label}: seq_len")
    rec = tm.get("tokenizer_vocab")
    if note := check_tokenizer_fits(ckpt, label, rec, (rec or {}).get("path") or tm["config"].get("tokenizer", "?")):
        log(f"[rank {rank}] warning: {note}")


def continued_legacy_cache(cfg: ExtractConfig, plan: ExtractPlan, rank: int) -> ExtractPlan:
    """`plan`, or, when the cache this run would go on with was made before weights were hashed in full (its key
    holds the sampled fingerprint, `targetid`), the plan under that cache's key: its shards are kept, not redone in a
    new directory. A cache of the new key, or none of either, leaves the plan as it is."""
    from .targetid import target_fingerprint

    ours = cache_dir(cfg, plan.key)
    if not plan.weights or has_manifest(ours) and read_manifest(ours)["key"] == plan.key:
        return plan
    target = {k: v for k, v in plan.producer["target"].items() if k != "weights_hash"}
    target.update(target_fingerprint(plan.ckpt, scheme="sampled"))
    producer = dict(plan.producer, target=target)
    key, cache = hash_obj(producer), cache_dir(cfg, hash_obj(producer))
    if not has_manifest(cache) or read_manifest(cache)["key"] != key:
        return plan
    log(f"[rank {rank}] {cache} was made before targets were hashed in full (its key holds the sampled fingerprint of "
        f"the weights): continuing it under that key. Its weights are known by 16 samples a file; extract into a new "
        f"cache (another CACHE=) to have them checked byte for byte")
    return replace(plan, producer=producer, key=key)


def cache_dir(cfg: ExtractConfig, key: str) -> Path:
    return Path(cfg.cache) if cfg.cache else Path(cfg.cache_root) / f"hidden-{key[:12]}"


def shards_to_do(cfg: ExtractConfig, plan: ExtractPlan) -> dict:
    """This run's cache, its shards to do and their rows: those SHARD= names (redone), else every shard not committed
    under this key or committed but damaged on disk."""
    cache = cache_dir(cfg, plan.key)
    existing = read_manifest(cache) if has_manifest(cache) else None
    if existing and existing["key"] != plan.key:  # (first: SHARD= numbers mean nothing against another cache)
        raise ConfigError(another_cache(cache, existing, plan))
    redo = parse_shard_list(cfg.shards, plan.num_shards)
    if existing is None and not cfg.cache:
        note_sibling_caches(cfg, plan.producer)
    done = committed(existing) if existing else {}
    from .cache.projection_file import ProjectionError

    if existing and (why := projection_problem(cache, existing, check_sha=True)):  # (before the target loads: the
        raise ProjectionError(why)  # shards to come would be projected with a P the committed ones were not)
    damaged = {b["shard"]: b["reason"] for b in missing_files(cache, existing)} if done else {}
    todo = redo or [i for i in range(plan.num_shards) if i not in done or i in damaged]
    shard_rows = {s["index"]: s["rows"] for s in plan.tokens_manifest["shards"]}
    return {"cache": cache, "todo": todo, "redo": bool(redo), "todo_rows": sum(shard_rows[i] for i in todo)}


# producer fields a run chooses (its [extract] settings) → the option that sets them
CHOSEN = {"quant": "quant", "dtype": "dtype", "layer_ids": "layer_ids", "projection.dims": "project_dims",
          "projection.rows": "project_rows"}


def chosen_diff(there: dict, here: dict) -> tuple[list[str], list[str]]:
    """(the producer fields that differ, the `--option=value`s that give `there`'s values — empty unless a run's
    settings choose every field that differs, i.e. unless options alone make `here` into `there`)."""
    fields, args = diff_producers(there, here), []
    for f in fields:
        value = there
        for part in f.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if f in CHOSEN and value is not None:
            args.append(f"--{CHOSEN[f]}={','.join(map(str, value)) if isinstance(value, list) else value}")
        elif f == "projection":
            args.append("--project_dims=0" if "projection" not in there else
                        f"--project_dims={there['projection']['dims']} --project_rows={there['projection']['rows']}")
    return fields, args if len(args) == len(fields) else []


def another_cache(cache: Path, m: dict, plan: ExtractPlan) -> str:
    """The refusal when CACHE= names a cache this run's settings do not make: what differs and how to continue it."""
    fields, args = chosen_diff(m.get("producer", {}), plan.producer)
    done = len(committed(m))
    cont = (f"to continue it ({done}/{m.get('num_shards', '?')} shards done), run with its settings: `make extract "
            f"CACHE={cache}` without RECIPE= takes them from its manifest"
            + (f", or add ARGS=\"{' '.join(args)}\"" if args else ""))
    return (f"{cache} holds another hidden cache (key {m['key'][:12]} ≠ this run's {plan.key[:12]}; differs "
            f"in: {', '.join(fields) or 'code format'}); {cont}; to extract anew, name another CACHE= (or delete that "
            f"one deliberately)")


def note_sibling_caches(cfg: ExtractConfig, producer: dict) -> None:
    """A new cache whose settings differ from a cache already under `cache_root` only in what a run chooses (its
    encoding, projection, dtype, taps): say so, with the options that continue that one (e.g. a recipe now storing
    fp4 beside an fp8 cache extracted under the recipe before)."""
    for d in sorted(Path(cfg.cache_root).glob("hidden-*")):
        m = read_manifest(d) if has_manifest(d) else None
        if not m or m.get("kind") != "hidden":
            continue
        fields, args = chosen_diff(m.get("producer", {}), producer)
        if args:
            log(f"note: {d} holds this extraction with other settings ({', '.join(fields)}; "
                f"{len(committed(m))}/{m.get('num_shards', '?')} shards done); this run starts a new cache — to "
                f"continue that one instead, add ARGS=\"{' '.join(args)}\" (or CACHE={d} without RECIPE=)")


def disk_room(cfg: ExtractConfig, plan: ExtractPlan, rank: int) -> dict:
    """The bytes the shards to do write, the free space, and the refusal when it lacks room: raised for a real run
    (a warning with allow_overfill=1); a dry run says so at its end, after its plan."""
    need = plan.todo_rows * plan.seq_len * plan.bytes_per_token
    # a dry run's token cache is in memory: the real run writes it first, mostly on the same filesystem
    token_bytes = plan.rows * plan.seq_len * storage.token_bytes_per_token() if plan.tokens_manifest.get(
        "dry_run") else 0
    need += token_bytes
    # what dead writers left is removed before the first shard (`claims.sweep`): room this run will have
    free = free_space(plan.cache) + sum(remove_dead_temps(d, dry=True)[1] for d in (plan.cache, plan.cache / "claims"))
    refusal = disk_refusal(plan.cache, need, free, cfg.min_free_gb)
    if refusal and not cfg.dry_run:
        if not cfg.allow_overfill:
            raise ValueError(f"{refusal}; {OVERFILL}")
        log(f"[rank {rank}] warning: {refusal}; starting anyway (allow_overfill=1)")
    return {"need": need, "token_bytes": token_bytes, "free": free, "refusal": refusal}


def check_kernels(cfg: ExtractConfig, plan: ExtractPlan, rank: int, world: int) -> dict:
    """The kernels checked and one batch timed on a small random model of the target's widths (`target.probe`),
    before any weight loads: the estimate for this process and the verdict. A dry run on a machine without a GPU
    (device=auto) checks nothing."""
    import torch

    from .target import probe

    if cfg.from_cache:  # (no forward runs: the states are read)
        return {"minutes": None, "kernels": f"none run (states read from {cfg.from_cache})"}
    if cfg.dry_run and plan.device.type == "cpu" and cfg.device == "auto":  # planning from a machine without a GPU
        log(f"[rank {rank}] no GPU here: kernels and timing not checked (the real run checks them before loading "
            f"weights); the plan takes its rates from H200 measurements")
        return {"minutes": None, "kernels": "not checked here"}
    p = probe(plan.info, plan.layer_ids, plan.device, getattr(torch, cfg.dtype), plan.seq_len, cfg.batch_rows, cfg.mode)
    est = p["seconds_per_row"] * plan.todo_rows / max(world, 1)
    log(f"[rank {rank}] kernels ok ({p['mode']}, max rel err {p['max_rel_err']:.2e} vs per-document); "
        f"estimated {p['seconds_per_row']:.3f} s/row → {est / 60:.1f} min for this process "
        f"(checked in {time.time() - plan.t0:.1f}s, before loading weights)")
    return {"minutes": est / 60, "kernels": f"ok ({p['mode']})"}
