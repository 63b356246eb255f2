"""Stage 1a: corpus → packed fixed-shape token shards under a content-addressed manifest.

    python -m stages.tokenize --recipe=manifests/demo.toml [--corpus=a.jsonl,b/*.parquet] [--tokenizer=DIR] [--tokens=DIR]

Reads the corpus as a stream, renders chats with the target tokenizer's template (loss on assistant tokens only,
located from the conversation's structure; `turns=each` makes one document per assistant turn), packs documents into
rows of `seq_len` tokens, writes Arrow shards (temp → fsync → rename → manifest commit) into
`<cache_root>/tokens-<key12>` (or `--tokens=DIR`, make TOKENS=) and prints the cache directory on the last line. Same inputs → same key and
byte-identical shards; a cache already complete for this key is reused as is.

A bad record is skipped and counted per reason (file:line of each in `skips.jsonl`), or with `--strict=1` stops the
run with that message; a file none of whose records became a document is reported loudly, and a corpus without a
single document is an error before the cache is marked complete. The run is `dflash_offline/tokenization.py`'s; its
`dry_run(cfg)` (what `make extract DRY_RUN=1` uses) computes the manifest in memory and writes nothing.
"""

from __future__ import annotations

from dflash_offline.cli import run_cli, unbuffered
from dflash_offline.config import TokenizeConfig, config_from_argv
from dflash_offline.tokenization import run


def main(argv: list[str]) -> None:
    unbuffered()
    cfg = config_from_argv(TokenizeConfig, "tokenize", argv, __doc__)
    out = run(cfg)
    print(out)


if __name__ == "__main__":
    run_cli(main)
