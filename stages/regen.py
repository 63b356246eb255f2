"""Regenerate the assistant answers of a chat corpus with the target itself (self-distillation data).

    make regen TARGET=DIR CORPUS='data/*.jsonl' [OUT=regen/x.jsonl] [THINKING=on|off]   # transformers, here
    make regen ENGINE=http://host:8000/v1 MODEL=NAME CORPUS=... OUT=...   # an OpenAI-compatible server (vLLM, SGLang)
    python -m stages.regen --corpus=FILES (--target=DIR | --engine=URL --model=NAME) [--key=value ...]

A DFlash drafter learns to predict what *the target* would write next, so it trains on the target's own answers.
A prompt (a chat record without an assistant turn, ending in a user or tool turn) gets the target's answer appended.
A conversation keeps its prompt turns verbatim and gets its first assistant turn replaced, later turns dropped
(--keep=all_turns: every one replaced, and an answer appended when it ends in a user or tool turn). The chat is
rendered with the target's chat template (`enable_thinking` from --thinking, the record's `tools` passed); reasoning
goes to `reasoning_content`; a `regen` key records the source `file:line`, the index in the corpus stream, each turn's
finish reason ("length": hit --max_new_tokens, truncated) and tokens generated. Malformed records are skipped, counted
with their `file:line`; a corpus with no usable record is an error (exit status 2, the counts by reason).

Output: OUT (JSONL, in input order) and OUT.stats.json (counts; the resume point: rerun the same command to resume,
nothing is asked or written twice; other settings are refused). --heldout_every=N sets about 1 record in N aside (by
SHA-256 of its first user turn), unanswered, for `make eval`. Then: `make extract CORPUS=OUT`. docs/data.md
("Regenerated data") has the record format, the stats fields and the engine setup.
"""

from __future__ import annotations

from dflash_offline.cli import run_cli, unbuffered
from dflash_offline.config import configs_from_argv
from dflash_offline.regenrun import RegenConfig, run


def parse_args(argv: list[str]) -> RegenConfig:
    """`RegenConfig` from `--name=value` options (`--help` lists them with their comments); empty = default."""
    (cfg,) = configs_from_argv([(RegenConfig, "regen")], argv, __doc__)
    return cfg


def main(argv: list[str]) -> dict:
    unbuffered()
    cfg = parse_args(argv)
    st = run(cfg)  # (its counts are logged once, at the end)
    print(cfg.out)
    return st


if __name__ == "__main__":
    run_cli(main)
