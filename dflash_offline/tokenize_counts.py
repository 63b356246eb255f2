"""Stage 1a's accounting: the tally of skipped records, a token shard's manifest entry, the run's summary.

`tokenization.py` streams records through the tokenizer workers and the packer; what it counts on the way lives here,
as plain values. `Tally` is the one owner of skipped records: each is counted per reason with its first
file:line examples and logged to `skips.jsonl` — or, in strict mode, raised — and per file it counts documents, so
that a file none of whose records became a document is reported loudly and a corpus without a single document is
an error that says what was skipped and why. `shard_entry` turns a shard's packed rows into its arrays and its
manifest entry (rows, documents, real, supervised and padding tokens); the real run writes and commits them, the
dry run only keeps the entry. `summarize` is the manifest's `summary` from the counters and the entries, and
`dry_manifest` is the manifest a dry run returns instead of writing one.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .cache.manifest import MANIFEST_VERSION
from .corpus import CorpusError, Skip
from .packing import materialize
from .progress import log, warn

# --- skips -------------------------------------------------------------------------------------------------------


FILE_HINTS = {  # what to do about a file all of whose records were skipped, by its most common reason
    "invalid_utf8": "re-encode it as UTF-8",
    "invalid_json": "each line must be one JSON object (JSONL, not one JSON array)",
    "missing_messages": "records need 'messages' (chat) or 'input_ids' + 'loss_mask' (pre-tokenized)",
    "too_long": "raise seq_len or use long_doc=split",
    "no_assistant_turn": "prompts without answers train nothing: make regen CORPUS=THIS_FILE TARGET=... writes the "
                         "target's answers to them, which stage 1a then takes (docs/data.md, 'Regenerated data')",
}


class Tally:
    """Skipped records: counted per reason with their first file:line examples and logged to `skips.jsonl`, or, in
    strict mode, the error. Per file, records and documents: a file none of whose records became a document is
    reported loudly, and a corpus without a document is an error that says what was skipped and why."""

    EXAMPLES = 3  # file:line examples kept per reason
    LOGGED = 10  # skips printed as they happen

    def __init__(self, strict: bool, skip_log):
        self.strict, self.skip_log = strict, skip_log
        self.skips: Counter = Counter()
        self.examples: dict[str, list[str]] = {}
        self.files: dict[str, Counter] = {}  # file → {"docs": n, <reason>: n}
        self.policy: dict[str, Counter] = {}  # file → {<reason>: n} of the documents long_doc skipped

    def doc(self, file: str) -> None:
        self.files.setdefault(file, Counter())["docs"] += 1

    def skip(self, skip: Skip, policy: bool = False) -> None:
        if self.strict and not policy:
            raise CorpusError(
                skip.message() + "\n(strict mode stops at the first bad record: fix it, or run without "
                "--strict to skip such records and count them in the manifest)"
            )
        self.skips[skip.reason] += 1
        self.files.setdefault(skip.file, Counter())[skip.reason] += 1
        if policy:  # (a document of a record skipped by long_doc, not the record: turns=each packs its others)
            self.policy.setdefault(skip.file, Counter())[skip.reason] += 1
        self.examples.setdefault(skip.reason, [])
        if len(self.examples[skip.reason]) < self.EXAMPLES:
            self.examples[skip.reason].append(f"{skip.file}:{skip.line}")
        if self.skip_log is not None:
            self.skip_log.write(json.dumps(vars(skip), ensure_ascii=False) + "\n")
        if sum(self.skips.values()) <= self.LOGGED:
            log(f"skipped {skip.message()}")

    def warn_about_files(self, read_whole: list[Path] = ()) -> None:
        """Warn about each file none of whose records became a document, each whose records were mostly skipped
        (a prompts file given to stage 1a packs its few answered records and trains on next to nothing), and each of
        `read_whole` (files read to their end) that held no record at all."""
        for file in [str(p) for p in read_whole if str(p) not in self.files]:
            warn(f"WARNING: {file}: holds no record (empty, or blank lines only)")
        for file, counts in self.files.items():
            skips = Counter({r: n for r, n in counts.items() if r != "docs"})
            records = skips - self.policy.get(file, Counter())  # (skipped records; counts["docs"]: records packed)
            if not skips or counts["docs"] and records.total() <= counts["docs"]:
                continue
            top = skips.most_common(1)[0][0]
            reasons = ", ".join(f"{r} ×{n}" for r, n in skips.most_common())
            hint = FILE_HINTS.get(top, "check its records against the corpus format").replace("THIS_FILE", file)
            if not counts["docs"]:
                warn(f"WARNING: {file}: not one of its {skips.total()} record(s) became a document ({reasons}): {hint}")
            else:
                warn(f"WARNING: {file}: most of its {records.total() + counts['docs']} records were skipped "
                     f"({reasons}; {counts['docs']} packed): {hint}")

    def nothing_to_train_on(self, records: int, paths: list[Path]) -> CorpusError:
        if not records:
            return CorpusError(f"the corpus has no records ({', '.join(map(str, paths))}: empty or blank lines "
                               "only): point CORPUS= at chat JSONL/Parquet files")
        why = "; ".join(f"{r} ×{n} (e.g. {', '.join(self.examples[r])})" for r, n in self.skips.most_common())
        listed = f" (every skip is listed in {self.skip_log.name})" if self.skip_log is not None else ""
        return CorpusError(f"no document to train on: every record was skipped ({records} read): {why}. Fix these "
                           f"records{listed} or point CORPUS= at other files")


# --- shards and the summary ---------------------------------------------------------------------------------


def shard_entry(index: int, rows, seq_len: int, pad: int) -> tuple[dict, dict, list]:
    """(manifest entry without files, arrays, doc sources) of one shard's rows."""
    arrays, sources = materialize(rows, seq_len, pad)
    real = int((arrays["doc_ids"] >= 0).sum())
    entry = {
        "index": index,
        "rows": len(rows),
        "docs": sum(len(s) for s in sources),
        "tokens": real,
        "supervised_tokens": int(arrays["loss_mask"].sum()),
        "padding_tokens": int(arrays["doc_ids"].size - real),
    }
    return entry, arrays, sources

def summarize(stats: Counter, skips: Counter, entries: list[dict], seconds: float) -> dict:
    """The manifest's summary. docs_* count records read and skipped, and documents packed (one per record, or one
    per assistant turn with turns=each); `chat` says what rendering did (think blocks count supervised turns)."""
    tokens, padding = (sum(e[k] for e in entries) for k in ("tokens", "padding_tokens"))
    return {
        "docs_read": stats["docs_read"],
        "docs_packed": stats["docs_packed"],
        "records_packed": stats["records_packed"],
        "chat": chat_summary(stats),
        # records by the enable_thinking they were rendered under (their regen.template's, else template_kwargs')
        "rendered_enable_thinking": {v: stats[f"enable_thinking_{v}"] for v in ("true", "false", "unset")},
        "docs_skipped": dict(sorted(skips.items())),
        "docs_skipped_total": sum(skips.values()),
        "pieces": stats["pieces"],
        "truncated_tokens": stats["truncated_tokens"],
        "split_unsupervised_tokens": stats["split_unsupervised_tokens"],  # long_doc=split: pieces with nothing to learn
        "rows": sum(e["rows"] for e in entries),
        "shards": len(entries),
        "tokens": tokens,
        "supervised_tokens": sum(e["supervised_tokens"] for e in entries),
        "padding_tokens": padding,
        "padding_fraction": padding / (tokens + padding) if tokens + padding else 0.0,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
    }


def chat_summary(stats: Counter) -> dict:
    samples = stats["samples"]
    return {
        "samples": samples,
        "samples_per_record": samples / stats["chat_records"] if stats["chat_records"] else 0.0,
        "turns_expanded": samples - stats["chat_records"],
        "think_blocks": {k: stats[f"think_{k}"] for k in ("kept", "stripped", "empty", "dropped_by_template")},
        "tool_calls": stats["tool_calls"],
        "tool_arguments_parsed": stats["tool_arguments_parsed"],
        "content_parts_joined": stats["content_parts_joined"],  # messages whose content was a list of text parts
        "truncated_turns": stats["truncated_turns"],  # cut at max_new_tokens by make regen: supervised up to the cut
    }


def dry_manifest(key: str, producer: dict, config: dict, shards: list[dict], summary: dict) -> dict:
    """The manifest a dry run returns: what the real run would leave, complete, marked `dry_run`."""
    return {"version": MANIFEST_VERSION, "kind": "tokens", "key": key, "producer": producer, "config": config,
            "num_shards": len(shards), "shards": shards, "summary": summary, "complete": True, "dry_run": True}
