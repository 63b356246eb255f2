"""Stage 1a: corpus → packed fixed-shape token shards under a content-addressed manifest.

    python -m stages.tokenize --recipe=manifests/demo.toml [--corpus=a.jsonl,b/*.parquet] [--tokenizer=DIR] ...

Reads the corpus as a stream, renders chats with the target tokenizer's template (loss on assistant tokens only),
packs documents into rows of `seq_len` tokens, writes Arrow shards (temp → fsync → rename → manifest commit) into
`<cache_root>/tokens-<key12>` and prints the cache directory on the last line. Same inputs → same key and
byte-identical shards; a cache already complete for this key is reused as is.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

from dflash_offline.config import TokenizeConfig, as_dict, config_from_argv
from dflash_offline.corpus import (
    CorpusError,
    check_tokenizer,
    corpus_hash,
    expand_paths,
    iter_records,
    tokenize_stream,
)
from dflash_offline.manifest import commit_shard, committed, hash_obj, open_cache, update_manifest
from dflash_offline.packing import PACKING_RULE, Doc, Packer, materialize, split_long
from dflash_offline.progress import Progress, log, unbuffered
from dflash_offline.shards import TOKENS_FORMAT_VERSION, token_shard_name, write_token_shard

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
    return {
        "stage": "tokenize",
        "tokenizer": tokenizer_identity(cfg.tokenizer, tok),
        "corpus": {"sha256": corpus_hash(paths), "bytes": sum(p.stat().st_size for p in paths)},
        "seq_len": cfg.seq_len,
        "packing": {"rule": PACKING_RULE, "open_rows": cfg.open_rows, "long_doc": cfg.long_doc,
                    "rows_per_shard": cfg.rows_per_shard},
        "thinking": cfg.thinking,
        "record_tools": True,  # a record's `tools` list reaches the chat template (caches made before differ)
        "max_docs": cfg.max_docs,
        "format_version": TOKENS_FORMAT_VERSION,
    }


def cache_dir_for(cfg: TokenizeConfig, key: str) -> Path:
    return Path(cfg.out) if cfg.out else Path(cfg.cache_root) / f"tokens-{key[:12]}"


# --- the run -------------------------------------------------------------------------------------------------


def run(cfg: TokenizeConfig) -> Path:
    from transformers import AutoTokenizer

    t0 = time.time()
    paths = expand_paths(cfg.corpus)
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
    check_tokenizer(tok)
    producer = producer_for(cfg, tok, paths)
    key = hash_obj(producer)
    out = cache_dir_for(cfg, key)
    m = open_cache(out, "tokens", key, producer, as_dict(cfg), num_shards=None)
    if m.get("complete"):
        log(f"token cache {out} is complete for this key ({len(m['shards'])} shards): reusing it")
        return out
    done = committed(m)
    workers = cfg.workers or os.cpu_count() or 1
    log(f"tokenizing {len(paths)} file(s), {producer['corpus']['bytes'] / 1e6:.1f} MB, {workers} worker(s) → {out}")

    opts = {"thinking": cfg.thinking, "vocab_size": len(tok)}
    records = iter_records(paths, cfg.max_docs)
    stream = tokenize_stream(records, cfg.tokenizer, opts, workers, cfg.chunk_docs)
    packer = Packer(cfg.seq_len, cfg.open_rows)
    stats = Counter()
    skips: Counter = Counter()
    pending_rows: list = []
    shard_index = 0
    progress = Progress("tokenize", cfg.max_docs or None, "doc", out / "status.json")
    skip_log = open(out / "skips.jsonl", "w", encoding="utf-8")

    def emit(rows, final=False):
        nonlocal shard_index, pending_rows
        pending_rows += rows
        while len(pending_rows) >= cfg.rows_per_shard or (final and pending_rows):
            batch, pending_rows = pending_rows[: cfg.rows_per_shard], pending_rows[cfg.rows_per_shard :]
            write_shard(out, key, shard_index, batch, cfg, pad_id(tok), done, stats)
            shard_index += 1

    try:
        for result in stream:
            stats["docs_read"] += 1
            if result[0] == "skip":
                skip = result[1]
                if cfg.strict:
                    raise CorpusError(
                        skip.message() + "\n(strict mode stops at the first bad record: fix it, or run without "
                        "--strict to skip such records and count them in the manifest)"
                    )
                skips[skip.reason] += 1
                skip_log.write(json.dumps(vars(skip), ensure_ascii=False) + "\n")
                if sum(skips.values()) <= 10:
                    log(f"skipped {skip.message()}")
                progress.update(1)
                continue
            _, ordinal, ids, mask = result
            pieces, reason = split_long(Doc(ids, mask, ordinal), cfg.seq_len, cfg.long_doc)
            if reason:
                skips[reason] += 1
                skip_log.write(json.dumps({"reason": reason, "detail": f"{len(ids)} tokens > seq_len",
                                           "ordinal": ordinal}) + "\n")
                progress.update(1)
                continue
            stats["docs_packed"] += 1
            stats["pieces"] += len(pieces)
            stats["truncated_tokens"] += max(0, len(ids) - cfg.seq_len) if cfg.long_doc == "truncate" else 0
            for piece in pieces:
                emit(packer.add(piece))
            progress.update(1, tokens=len(ids))
        emit(packer.flush(), final=True)
    finally:
        skip_log.close()
        stream.close()
    summary = summarize(stats, skips, shard_index, cfg, time.time() - t0)
    update_manifest(out, complete=True, num_shards=shard_index, summary=summary)
    progress.extra.update(summary)
    progress.close("done")
    log(
        f"{summary['rows']} rows in {shard_index} shards; {summary['tokens']:,} tokens "
        f"({summary['supervised_tokens']:,} supervised), padding {100 * summary['padding_fraction']:.2f}%, "
        f"{summary['docs_skipped_total']} skipped {dict(skips) or ''}; {summary['tokens_per_s']:,.0f} tok/s"
    )
    return out


def write_shard(out: Path, key: str, index: int, rows, cfg, pad: int, done: dict, stats: Counter) -> None:
    t = time.time()
    arrays, sources = materialize(rows, cfg.seq_len, pad)
    real = int((arrays["doc_ids"] >= 0).sum())
    entry = {
        "index": index,
        "rows": len(rows),
        "docs": sum(len(s) for s in sources),
        "tokens": real,
        "supervised_tokens": int(arrays["loss_mask"].sum()),
        "padding_tokens": int(arrays["doc_ids"].size - real),
    }
    stats["rows"] += entry["rows"]
    stats["tokens"] += entry["tokens"]
    stats["supervised_tokens"] += entry["supervised_tokens"]
    stats["padding_tokens"] += entry["padding_tokens"]
    if index in done:  # committed by an earlier, interrupted run of the same key: same bytes by construction
        return
    name = token_shard_name(index)
    files = {name: write_token_shard(out / name, arrays, sources, {"shard": index, "key": key})}
    commit_shard(out, dict(entry, files=files, seconds=time.time() - t, committed_at=time.time()))


def summarize(stats: Counter, skips: Counter, shards: int, cfg, seconds: float) -> dict:
    total = stats["tokens"] + stats["padding_tokens"]
    return {
        "docs_read": stats["docs_read"],
        "docs_packed": stats["docs_packed"],
        "docs_skipped": dict(sorted(skips.items())),
        "docs_skipped_total": sum(skips.values()),
        "pieces": stats["pieces"],
        "truncated_tokens": stats["truncated_tokens"],
        "rows": stats["rows"],
        "shards": shards,
        "tokens": stats["tokens"],
        "supervised_tokens": stats["supervised_tokens"],
        "padding_tokens": stats["padding_tokens"],
        "padding_fraction": stats["padding_tokens"] / total if total else 0.0,
        "seconds": seconds,
        "tokens_per_s": stats["tokens"] / seconds if seconds > 0 else 0.0,
    }


def main(argv: list[str]) -> None:
    unbuffered()
    cfg = config_from_argv(TokenizeConfig, "tokenize", argv, __doc__)
    out = run(cfg)
    print(out)


if __name__ == "__main__":
    from dflash_offline.progress import run_cli

    run_cli(main)
