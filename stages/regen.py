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

import argparse
import dataclasses
import typing

from dflash_offline.cli import run_cli, unbuffered
from dflash_offline.config import field_help
from dflash_offline.regenrun import RegenConfig, run

# --- command line --------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> RegenConfig:
    """The fields of `RegenConfig` as `--name=value` options, each with its comment as help; empty = default."""
    p = argparse.ArgumentParser(prog="python -m stages.regen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Empty values (as make passes for unset variables) mean the default.")
    helps, hints = field_help(RegenConfig), typing.get_type_hints(RegenConfig)
    for f in dataclasses.fields(RegenConfig):
        default = "required" if f.default is dataclasses.MISSING else f"default {f.default!r}"
        p.add_argument(f"--{f.name}", default=[] if f.name == "corpus" else "",
                       action="append" if f.name == "corpus" else "store", help=f"{helps[f.name]} [{default}]")
    values = {}
    for name, text in vars(p.parse_args(argv)).items():
        if name == "corpus":
            values[name] = [c for arg in text for c in arg.split(",") if c]
        elif text != "":
            values[name] = coerce(name, text, hints[name])
    return RegenConfig(**values).resolve()


def coerce(name: str, text: str, kind) -> object:
    if kind is bool:
        return text.lower() not in ("0", "false", "no", "off")
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"--{name}={text!r}: expected {'an integer' if kind is int else 'a number'}") from None


def main(argv: list[str]) -> dict:
    unbuffered()
    cfg = parse_args(argv)
    st = run(cfg)  # (its counts are logged once, at the end)
    print(cfg.out)
    return st


if __name__ == "__main__":
    run_cli(main)
