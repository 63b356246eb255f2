"""Stage 1a as a library: the token cache's identity, the corpus → shards loop, the real run and the dry run.

`identify` is everything known before a record is read: the corpus files, the tokenizer (loaded from the directory
its name resolves to), the producer — everything that changes a token byte (`producer_for`: the tokenizer's files,
template and vocabulary, the corpus hash, seq_len, packing, chat rules) — its hash, the cache's key, and the cache
directory `<cache_root>/tokens-<key12>` (`cache_dir_for`). `run` writes the cache (temp → fsync → rename →
manifest commit per shard; a cache complete for its key is reused, damaged shards of one are redone) and returns
its directory; `dry_run` returns the manifest `run` would leave, writing nothing. Both stream the corpus through the
tokenizer workers and the packer (`tokenize_corpus`), counting what they skip in `tokenize_counts.Tally`. `stages/tokenize.py`
is the command line; stage 1b (`plan.token_cache`) runs or reads the token cache through the same two functions.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from . import chat
from .cache.claims import sweep
from .cache.fsio import hash_obj
from .cache.manifest import (
    ManifestError,
    commit_shards,
    committed,
    diff_producers,
    has_manifest,
    open_cache,
    read_manifest,
    requeue_missing,
    update_manifest,
)
from .cache.shards import TOKENS_FORMAT_VERSION, token_shard_name, write_token_shard
from .config import TokenizeConfig, as_dict
from .corpus import (
    Skip,
    Tokens,
    check_not_heldout,
    check_settings_agree,
    check_tokenizer,
    corpus_hash,
    duplicate_files,
    expand_paths,
    iter_records,
    rendered_with,
    tokenize_stream,
)
from .devices import usable_cpus
from .packing import PACKING_RULE, Doc, Packer, split_long
from .progress import Progress, log, warn
from .regen import check_regen_finished
from .tokenize_counts import Tally, dry_manifest, shard_entry, summarize

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")


def tokenizer_identity(tokenizer_dir: str, tok) -> dict:
    """What about the tokenizer changes token bytes: its files, template, vocabulary and special ids."""
    files = {}
    for name in TOKENIZER_FILES:
        p = Path(tokenizer_dir) / name
        if p.is_file():
            files[name] = hash_obj(p.read_bytes().decode("utf-8", "replace"))
    return {
        "files_sha256": hash_obj(files),
        "template_sha256": hash_obj(tok.chat_template or ""),
        "vocab_size": len(tok),
        "pad_id": pad_id(tok),
    }


def pad_id(tok) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


# --- the cache's identity ------------------------------------------------------------------------------------


def producer_for(cfg: TokenizeConfig, tok, paths: list[Path]) -> dict:
    """`tok` loaded from its resolved directory (`identify`): its files there are what the key hashes."""
    return {
        "stage": "tokenize",
        "tokenizer": tokenizer_identity(tok.name_or_path, tok),
        "corpus": {"sha256": corpus_hash(paths), "bytes": sum(p.stat().st_size for p in paths)},
        "seq_len": cfg.seq_len,
        "packing": {"rule": PACKING_RULE, "open_rows": cfg.open_rows, "long_doc": cfg.long_doc,
                    "rows_per_shard": cfg.rows_per_shard},
        "thinking": cfg.thinking,
        "turns": cfg.turns,
        "empty_think": cfg.empty_think,
        "chat_rules": chat.RULES,
        "max_docs": cfg.max_docs,
        "format_version": TOKENS_FORMAT_VERSION,
        **({"template_kwargs": chat.parse_settings(cfg.template_kwargs)} if cfg.template_kwargs else {}),
    }


def cache_dir_for(cfg: TokenizeConfig, key: str) -> Path:
    return Path(cfg.tokens) if cfg.tokens else Path(cfg.cache_root) / f"tokens-{key[:12]}"


# --- the run -------------------------------------------------------------------------------------------------


def identify(cfg: TokenizeConfig) -> tuple[list[Path], object, dict, str, Path]:
    """(corpus files, tokenizer, producer, key, cache directory): everything known before reading a record. The
    tokenizer is loaded from the directory `cfg.tokenizer` resolves to (a hub id: its local HF cache snapshot), which
    its `name_or_path` keeps for the workers."""
    from transformers import AutoTokenizer

    from .targetid import check_seq_len, resolve_checkpoint

    paths = expand_paths(cfg.corpus)
    check_not_heldout(paths)
    if not cfg.partial_regen:
        check_regen_finished(paths)
    tok_dir = resolve_checkpoint(cfg.tokenizer, need=("tokenizer",), field="tokenize.tokenizer")
    if (tok_dir / "config.json").is_file():  # the tokenizer is a target's: its rows must fit that target
        check_seq_len(cfg.seq_len, tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    check_tokenizer(tok, settings := chat.parse_settings(cfg.template_kwargs))
    check_settings_agree(paths, tok, settings)  # a regen output answered under other settings: refused now
    producer = producer_for(cfg, tok, paths)
    key = hash_obj(producer)
    return paths, tok, producer, key, cache_dir_for(cfg, key)


def failed_empty(out: Path, key: str) -> str | None:
    """How the run of a token cache of another key in `out` that holds no shard ended ("failed", "interrupted": its
    status says so), or None (no such cache, or its writer may still run)."""
    if not has_manifest(out):
        return None
    m = read_manifest(out)
    try:
        state = json.loads((out / "status.json").read_text()).get("state")
    except (OSError, ValueError, AttributeError):
        return None
    replaceable = m.get("key") != key and m.get("kind") == "tokens" and not m.get("shards")
    return state if replaceable and state in ("failed", "interrupted") else None


def forget_failed_start(out: Path, key: str) -> None:
    """A token cache of another key in `out` that holds nothing — its run failed or was stopped before a shard (a
    prompts file given to stage 1a: no document) and said so in its status — is replaced, so that the same command
    with the corpus fixed runs instead of being refused as another cache. A cache with shards, or whose writer may
    still run, stays refused."""
    if state := failed_empty(out, key):
        log(f"{out}: replacing a token cache of another key that holds no shard (its run {state})")
        (out / "manifest.json").unlink()


def tokenizer_record(tok) -> dict:
    """The manifest's `tokenizer_vocab`: where the tokenizer came from and what its ids mean (`vocab_identity`), so
    that extraction can refuse a target whose tokenizer gives the ids other meanings. Outside the producer: the key
    already hashes the tokenizer's files, and existing keys stay what they were."""
    from .targetid import vocab_identity

    return {"path": str(tok.name_or_path), **vocab_identity(tok)}


def warn_duplicates(paths: list[Path]) -> None:
    for first, again in duplicate_files(paths):
        what = "is given twice" if first.resolve() == again.resolve() else f"holds the same bytes as {first}"
        warn(f"WARNING: {again} {what}: its records are tokenized, and trained on, twice; drop one from CORPUS=")


def run(cfg: TokenizeConfig) -> Path:
    paths, tok, producer, key, out = identify(cfg)
    forget_failed_start(out, key)
    m = open_cache(out, "tokens", key, producer, as_dict(cfg), num_shards=None)
    same = ("vocab_sha256", "vocab_size")  # (not its path: the same files from another mount are the same tokenizer)
    if {k: (m.get("tokenizer_vocab") or {}).get(k) for k in same} != {k: (rec := tokenizer_record(tok))[k] for k in same}:
        try:  # (one made before recorded none: same files, its key says so)
            m = update_manifest(out, tokenizer_vocab=rec)
        except OSError as e:
            log(f"token cache {out}: its tokenizer's vocabulary could not be recorded ({e}); extraction then warns "
                f"that it cannot check it")
    sweep(out, log=log)
    if m.get("complete") and (bad := requeue_missing(out)):  # tokenization is deterministic: redo those shards
        log(f"token cache {out}: {len(bad)} committed shard(s) damaged on disk ({bad[0]['reason']}): redoing them")
        m = update_manifest(out, complete=False)
    if m.get("complete"):
        log(f"token cache {out} is complete for this key ({len(m['shards'])} shards): reusing it")
        return out
    done = committed(m)
    warn_duplicates(paths)
    log(f"tokenizing {len(paths)} file(s), {producer['corpus']['bytes'] / 1e6:.1f} MB, {workers_for(cfg)} worker(s) "
        f"→ {out}")
    progress = Progress("tokenize", cfg.max_docs or None, "doc", out / "status.json")
    commits = Commits(out)
    try:
        with open(out / "skips.jsonl", "w", encoding="utf-8") as skip_log:
            summary = tokenize_corpus(cfg, paths, tok, progress, skip_log,
                                      lambda i, rows: write_shard(out, key, i, rows, cfg, pad_id(tok), done, commits))
        commits.flush()
    except BaseException as e:
        commits.flush(quiet=True)  # (the shards written so far are whole: a rerun keeps them)
        progress.close("interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
        raise
    asked = chat.parse_settings(cfg.template_kwargs).get("enable_thinking")
    other = summary["rendered_enable_thinking"].get(str(not asked).lower(), 0) if isinstance(asked, bool) else 0
    if other:  # (a record's own regen.template renders it: make regen's THINKING= wins over template_kwargs)
        warn(f"WARNING: template_kwargs enable_thinking={asked} was not used for {other} record(s): their regen.template "
             f"(make regen THINKING=) says enable_thinking={not asked}, and renders them; the cache records that")
    # (rendered_with: outside the key, like tokenizer_vocab; training copies it into the run for make eval)
    update_manifest(out, complete=True, num_shards=summary["shards"], summary=summary,
                    rendered_with=rendered_with(summary["rendered_enable_thinking"],
                                                chat.parse_settings(cfg.template_kwargs)))
    progress.extra.update(summary)
    progress.close("done")
    return out


def dry_run(cfg: TokenizeConfig) -> dict:
    """The manifest `run` would leave, with nothing written to disk: read from the cache when it is complete for this
    key, else computed in memory (records tokenized and packed, rows counted, no shard kept)."""
    paths, tok, producer, key, out = identify(cfg)
    if has_manifest(out):
        m = read_manifest(out)
        if m["key"] != key:
            raise ManifestError(f"{out} already holds another cache (key {m['key'][:12]} ≠ {key[:12]}; differs in: "
                                f"{', '.join(diff_producers(m.get('producer', {}), producer)) or 'code format'}): "
                                "use another cache directory or delete it deliberately")
        if m.get("complete"):
            log(f"token cache {out} is complete for this key ({len(m['shards'])} shards)")
            return dict(m, tokenizer_vocab=tokenizer_record(tok))
    warn_duplicates(paths)
    log(f"dry run: tokenizing {len(paths)} file(s) in memory, {producer['corpus']['bytes'] / 1e6:.1f} MB, "
        f"{workers_for(cfg)} worker(s); nothing is written")
    shards: list[dict] = []

    def count(index: int, rows) -> dict:
        shards.append(dict(shard_entry(index, rows, cfg.seq_len, pad_id(tok))[0], status="committed"))
        return shards[-1]

    progress = Progress("tokenize (dry run)", cfg.max_docs or None, "doc", None)
    summary = tokenize_corpus(cfg, paths, tok, progress, None, count)
    progress.close("done")
    return dict(dry_manifest(key, producer, as_dict(cfg), shards, summary), tokenizer_vocab=tokenizer_record(tok))


def workers_for(cfg: TokenizeConfig) -> int:
    """Tokenizer processes: `workers`, or one per CPU this process may use (affinity and cgroup quota)."""
    return cfg.workers or usable_cpus()


def tokenize_corpus(cfg: TokenizeConfig, paths: list[Path], tok, progress: Progress, skip_log, write) -> dict:
    """Stream the corpus through the tokenizer workers and the packer; `write(index, rows)` takes each shard's rows
    and returns its manifest entry. The summary, once every record is read. Raises CorpusError — before anything
    is marked complete — at the first bad record in strict mode, and when no document is left to train on."""
    t0 = time.time()
    opts = {"thinking": cfg.thinking, "turns": cfg.turns, "empty_think": cfg.empty_think, "vocab_size": len(tok),
            "settings": chat.parse_settings(cfg.template_kwargs)}
    stream = tokenize_stream(iter_records(paths, cfg.max_docs), tok, opts, workers_for(cfg),
                             cfg.chunk_docs)
    packer = Packer(cfg.seq_len, cfg.open_rows)
    stats, tally, pending, entries = Counter(), Tally(cfg.strict, skip_log), [], []

    def emit(rows, final=False):
        nonlocal pending
        pending += rows
        while len(pending) >= cfg.rows_per_shard or (final and pending):
            batch, pending = pending[: cfg.rows_per_shard], pending[cfg.rows_per_shard :]
            entries.append(write(len(entries), batch))

    try:
        for result in stream:
            stats["docs_read"] += 1
            pieces = accept(result, cfg, tally, stats)
            for piece in pieces:
                emit(packer.add(piece))
            progress.update(1, tokens=sum(len(p.input_ids) for p in pieces))
        emit(packer.flush(), final=True)
    finally:
        stream.close()
    tally.warn_about_files(paths if not cfg.max_docs or stats["docs_read"] < cfg.max_docs else [])
    if not stats["docs_packed"]:
        raise tally.nothing_to_train_on(stats["docs_read"], paths)
    summary = summarize(stats, tally.skips, entries, time.time() - t0)
    log(f"{summary['rows']} rows in {summary['shards']} shards; {summary['tokens']:,} tokens "
        f"({summary['supervised_tokens']:,} supervised), padding {100 * summary['padding_fraction']:.2f}%, "
        f"{summary['docs_skipped_total']} skipped {dict(tally.skips) or ''}; {summary['tokens_per_s']:,.0f} tok/s")
    return summary


def accept(result: Tokens | Skip, cfg: TokenizeConfig, tally: Tally, stats: Counter) -> list[Doc]:
    """The pieces of a record's documents to pack; [] for a skipped record (counted, or the error in strict mode).
    A document longer than seq_len under long_doc=skip is skipped alone (counted as too_long with file:line)."""
    if isinstance(result, Skip):
        tally.skip(result)
        return []
    out = []
    for ids, mask in result.docs:
        pieces, reason, left_out = split_long(Doc(ids, mask, result.ordinal), cfg.seq_len, cfg.long_doc)
        if reason:  # the long_doc policy, not a fault: counted, also in strict mode
            why = "its first seq_len tokens hold no supervised token" if reason == "truncated_unsupervised" else ""
            tally.skip(Skip(reason, f"{len(ids)} tokens > seq_len {cfg.seq_len} (long_doc={cfg.long_doc}"
                                    f"{': ' + why if why else ''})", result.file, result.line), policy=True)
            continue
        stats["docs_packed"] += 1
        stats["pieces"] += len(pieces)
        stats["truncated_tokens" if cfg.long_doc == "truncate" else "split_unsupervised_tokens"] += left_out
        out += pieces
    if out:
        tally.doc(result.file)
        stats["records_packed"] += 1
    stats.update(result.counts)
    return out


# --- shards --------------------------------------------------------------------------------------------------


class Commits:
    """The token cache's shard commits, batched: tokenization is the cache's one writer, and a commit rewrites the
    whole manifest (15 MB at 24K shards), so one a shard made the run quadratic in its shards (6,094 shards of one
    row: 20 min, against 30 s for the same tokens in 24). Entries are committed together once `EVERY_S` has passed
    and ten times as long as the last commit took (≤ 10 % of the run), and at the end; a killed run leaves at most
    that many seconds of shards to redo (their files, whole, are rewritten: same bytes)."""

    EVERY_S = 5.0

    def __init__(self, cache: Path):
        self.cache, self.pending, self.last, self.took = cache, [], time.monotonic(), 0.0

    def add(self, entry: dict) -> None:
        self.pending.append(entry)
        if time.monotonic() - self.last >= max(self.EVERY_S, 10 * self.took):
            self.flush()

    def flush(self, quiet: bool = False) -> None:
        t = time.monotonic()
        pending, self.pending = self.pending, []  # (a commit that failed is not tried again)
        if pending:
            try:
                commit_shards(self.cache, pending)
            except Exception as e:  # noqa: BLE001 - (quiet: the run fails already, with its own error)
                if not quiet:
                    raise
                log(f"token cache {self.cache}: the last {len(pending)} shard(s) were not committed ({e})")
        self.last, self.took = time.monotonic(), time.monotonic() - t


def write_shard(out: Path, key: str, index: int, rows, cfg, pad: int, done: dict, commits: Commits) -> dict:
    t = time.time()
    entry, arrays, sources = shard_entry(index, rows, cfg.seq_len, pad)
    if index in done:  # committed by an earlier, interrupted run of the same key: same bytes by construction
        return entry
    name = token_shard_name(index)
    files = {name: write_token_shard(out / name, arrays, sources, {"shard": index, "key": key})}
    commits.add(dict(entry, files=files, seconds=time.time() - t, committed_at=time.time()))
    return entry
