"""Regenerate the assistant answers of a chat corpus with the target itself (self-distillation data).

    python -m stages.regen --target=DIR --corpus=a.jsonl,b/*.parquet [--out=FILE.jsonl] [--max_new_tokens=2048]
        [--batch_size=16] [--thinking=on|off] [--num_docs=N] [--device=auto|cpu|cuda|cuda:N] [--dtype=auto|...]
        [--keep=first_turn|all_turns] [--on_truncated=keep|drop] [--on_empty=drop|keep] [--temperature=0 --top_p=1]
    make regen TARGET=DIR CORPUS='data/*.jsonl' [OUT=regen/x.jsonl]

A DFlash drafter learns to predict what *the target* would write next, so it should be trained on the target's own
answers rather than on the corpus's (written by people or other models). This stage keeps every prompt and replaces
the answer with the target's greedy decode (or, with `--temperature` > 0, a sample):

- For each chat record, the prompt is the conversation up to (not including) the first assistant turn. It is
  rendered with the target tokenizer's chat template (`add_generation_prompt=True`, `enable_thinking` set explicitly
  from `--thinking`; a record-level `tools` list is passed to the template) and decoded greedily by the target
  (`AutoModelForCausalLM`, batches of `--batch_size` prompts, left padding). Generation stops at `<|im_end|>` or at
  any eos of the target's `generation_config`.
- The output record is the input record with its `messages` replaced: the prompt turns exactly as they were in the
  input (system/user/tool messages untouched), then an assistant turn whose `content` is the generated text. A
  `<think>…</think>` block (also one opened by the template itself) goes to `reasoning_content`. Tool calls stay in
  `content` as the text the target wrote (`<tool_call>…</tool_call>`), so they render to the same tokens. Other
  top-level keys of the record are kept; a `regen` key records the source `file:line`, its index in the corpus
  stream, the finish reason(s) (`stop` / `length`) and the number of generated tokens.
- `--keep=first_turn` (default): only the first assistant turn is regenerated; every later turn is dropped (the
  following user turns answered the *original* reply, which is gone). `--keep=all_turns`: every assistant turn is
  regenerated in order, each conditioned on the regenerated turns before it and on the original user/tool turns
  (a tool result that answered an original tool call is kept as is, even if the new reply calls no tool).
- Failures are counted, never silent: malformed records (bad JSON, no messages, no assistant turn, ...) are skipped
  with their `file:line`; a conversation that starts with an assistant turn has no prompt (`no_prompt`); a prompt
  longer than the target's context minus `--max_new_tokens` is skipped (`prompt_too_long`). A generation that hits
  `--max_new_tokens` without an eos is `truncated` (`--on_truncated=keep` (default) writes it, `drop` drops the
  record); an empty generation is `empty` (`--on_empty=drop` (default) drops the record).

Output: `OUT` (JSONL chat records, appended and flushed + fsynced per batch) and `OUT.stats.json` (the counts, see
below; also logged once at the end). Rerunning with the same `--out` resumes: `OUT.stats.json` is the commit point
(input records consumed, lines written); lines past it (a batch cut off by a crash) are cut and redone, records
already written are skipped, nothing is written twice. A resume with different generation settings (target,
corpus, thinking, max_new_tokens, keep, on_truncated, on_empty) is refused, naming the field. The last line printed
is the output path. The output feeds stage 1: `make extract CORPUS=OUT TARGET=...` (tokenize it with the same
`thinking` choice you regenerated with).

Stats fields (`OUT.stats.json`): `records_read` (input records consumed), `written` (output records),
`skipped` (reason → count) and `skip_examples` (the first 20 as `file:line: reason: detail`), `turns_generated`,
`truncated` / `truncated_dropped`, `empty` / `empty_dropped`, `prompt_tokens`, `new_tokens`, `elapsed_s`,
`new_tokens_per_s`, `complete`, and `config` (the settings, to refuse an inconsistent resume).

At scale (millions of prompts), serve the target with vLLM or SGLang instead and write the same JSONL: the commands
and a complete asynchronous client are in the docstring of `dflash_offline/regen.py`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.corpus import check_tokenizer, expand_paths
from dflash_offline.devices import check_setting, pick_device
from dflash_offline.progress import Progress, log, run_cli, unbuffered
from dflash_offline.regen import (
    Regenerator,
    Tally,
    append_records,
    batches,
    commit,
    count_records,
    load_model,
    pick_dtype,
    resume_state,
    settings_digest,
    summary,
)
from dflash_offline.targetid import resolve_checkpoint

# --- config --------------------------------------------------------------------------------------------------


@dataclass
class RegenConfig:
    target: str  # target checkpoint directory (tokenizer + chat template + weights)
    corpus: list[str]  # chat JSONL / Parquet / Arrow files or globs
    out: str = ""  # output JSONL ("" → regen/<target name>-thinking_<on|off>.jsonl)
    max_new_tokens: int = 2048  # generation budget per assistant turn
    batch_size: int = 16  # prompts per generate call (left padded)
    thinking: str = "on"  # on | off: `enable_thinking` passed to the chat template
    num_docs: int = 0  # stop after this many input records (0 = all)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32
    keep: str = "first_turn"  # first_turn | all_turns
    on_truncated: str = "keep"  # keep | drop a record whose generation hit max_new_tokens without an eos
    on_empty: str = "drop"  # drop | keep a record whose generation is empty
    temperature: float = 0.0  # 0 = greedy; > 0 samples at this temperature (seeded per batch: a resume is exact)
    top_p: float = 1.0  # nucleus sampling mass (with temperature > 0)
    seed: int = 0  # sampling seed
    progress: bool = True  # show the progress bar

    def resolve(self) -> RegenConfig:
        choices = {"thinking": ("on", "off"), "keep": ("first_turn", "all_turns"),
                   "on_truncated": ("keep", "drop"), "on_empty": ("drop", "keep"),
                   "dtype": ("auto", "bfloat16", "float16", "float32")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {', '.join(allowed)}")
        if not self.target:
            raise ValueError("no target: pass --target=DIR (TARGET= in make), the checkpoint that answers")
        if not self.corpus:
            raise ValueError("no corpus: pass --corpus=FILES (CORPUS= in make; paths and globs, comma separated)")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.num_docs < 0:
            raise ValueError("max_new_tokens and batch_size must be >= 1, num_docs >= 0")
        if not (self.temperature >= 0 and 0 < self.top_p <= 1):
            raise ValueError(f"temperature={self.temperature}, top_p={self.top_p}: expected temperature >= 0 (0 = "
                             f"greedy) and 0 < top_p <= 1")
        check_setting(self.device, "device")
        if not self.out:
            name = Path(self.target.rstrip("/")).name or "target"
            self.out = str(Path("regen") / f"{name}-thinking_{self.thinking}.jsonl")
        return self


def config_record(cfg: RegenConfig, paths: list[Path], dtype: str) -> dict:
    """The run's settings, as the stats record them (`RESUME_FIELDS` of them are checked on a resume); `dtype`: the
    one the target decodes in."""
    return {"target": str(Path(cfg.target).resolve()), "corpus": [str(p.resolve()) for p in paths],
            "corpus_bytes": [p.stat().st_size for p in paths], "thinking": cfg.thinking,
            "max_new_tokens": cfg.max_new_tokens, "keep": cfg.keep, "on_truncated": cfg.on_truncated,
            "on_empty": cfg.on_empty, "num_docs": cfg.num_docs, "batch_size": cfg.batch_size, "dtype": dtype,
            **sampling_record(cfg)}


def sampling_record(cfg: RegenConfig) -> dict:
    """The sampling settings (none for greedy decoding, whose records and resume checks stay as they were); a
    sampled run also fixes its batch size (the seed of a batch is its first record's)."""
    if cfg.temperature <= 0:
        return {}
    return {"sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed,
                         "batch_size": cfg.batch_size}}


# --- the run -------------------------------------------------------------------------------------------------


def run(cfg: RegenConfig, model=None, tokenizer=None) -> dict:
    """Regenerate; returns the stats. `model`/`tokenizer` may be passed in (tests) instead of loaded."""
    from transformers import AutoTokenizer

    t0 = time.time()
    cfg.resolve()
    # everything cheap is checked before any weight loads
    paths = expand_paths(cfg.corpus)
    if model is None:
        resolve_checkpoint(cfg.target, need=("config", "weights", "tokenizer"), field="regen --target")
    tok = tokenizer or AutoTokenizer.from_pretrained(cfg.target)
    check_tokenizer(tok)
    device = pick_device(cfg.device, "regen --device") if model is None else next(model.parameters()).device
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype if model is not None else pick_dtype(cfg.dtype, device)
    conf = config_record(cfg, paths, str(dtype).removeprefix("torch."))
    state = resume_state(out, conf)
    n = count_records(paths)
    total = min(cfg.num_docs, n) if cfg.num_docs and n is not None else (cfg.num_docs or n)
    if total is not None and state["records_read"] >= total:
        log(f"{out}: all {total} records already done")
        return commit(out, conf, state, state["elapsed_s"], complete=True)
    if state["records_read"]:
        log(f"resuming {out}: {state['records_read']} input records done, {state['written']} written")
    if model is None:
        model = load_model(cfg.target, device, cfg.dtype)
    tally = Tally(state)
    target = Regenerator(model, tok, tally, cfg.max_new_tokens, cfg.thinking == "on", cfg.keep, cfg.on_truncated,
                         cfg.on_empty, settings_digest(conf), cfg.temperature, cfg.top_p, cfg.seed)
    how = f"sampling at temperature {cfg.temperature:g}, top_p {cfg.top_p:g}, seed {cfg.seed}" if cfg.temperature > 0 \
        else "greedy"
    log(f"regenerating with {type(model).__name__} on {device} ({how}), thinking={cfg.thinking}, keep={cfg.keep}, "
        f"batch {cfg.batch_size}, max_new_tokens {cfg.max_new_tokens} → {out}")
    progress = Progress("regen", total, "doc", None, disable=None if cfg.progress else True)
    progress.update(state["records_read"])
    tg, elapsed0 = time.time(), state["elapsed_s"]
    with open(out, "a", encoding="utf-8") as f:
        for batch, consumed in batches(paths, state["records_read"], cfg.num_docs, cfg.batch_size, cfg.keep,
                                       tally.skip):
            records = target.process(batch) if batch else []
            append_records(f, records)
            tally.counts["written"] += len(records)
            progress.update(consumed - tally.counts["records_read"], tokens=sum(sum(j.new_tokens) for j in batch))
            tally.counts["records_read"] = consumed
            commit(out, conf, tally.into(state), elapsed0 + time.time() - tg)  # the resume point
    progress.close("done")
    st = commit(out, conf, state, elapsed0 + time.time() - tg, complete=True)
    log(f"regen done in {time.time() - t0:.1f}s: {json.dumps(summary(st))}")
    return st


# --- command line --------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> RegenConfig:
    p = argparse.ArgumentParser(prog="python -m stages.regen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Empty values (as make passes for unset variables) mean the default.")
    defaults = RegenConfig(target="", corpus=[])
    p.add_argument("--target", default="", help="target checkpoint directory")
    p.add_argument("--corpus", action="append", default=[], help="chat files or globs (comma separated, repeatable)")
    p.add_argument("--out", default="", help="output JSONL (default regen/<target>-thinking_<on|off>.jsonl)")
    for name in ("max_new_tokens", "batch_size", "num_docs"):
        p.add_argument(f"--{name}", default="", help=f"default {getattr(defaults, name)}")
    p.add_argument("--temperature", default="", help="0 = greedy (default); > 0 samples (seeded per batch)")
    p.add_argument("--top_p", default="", help="nucleus mass when sampling (default 1)")
    p.add_argument("--seed", default="", help="sampling seed (default 0)")
    p.add_argument("--thinking", default="", help="on | off (enable_thinking of the chat template; default on)")
    p.add_argument("--device", default="", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--dtype", default="", help="auto | bfloat16 | float16 | float32 (default auto)")
    p.add_argument("--keep", default="", help="first_turn (default) | all_turns")
    p.add_argument("--on_truncated", default="", help="keep (default) | drop")
    p.add_argument("--on_empty", default="", help="drop (default) | keep")
    p.add_argument("--progress", default="", help="1 (default) | 0")
    a = p.parse_args(argv)
    corpus = [c for arg in a.corpus for c in arg.split(",") if c]
    cfg = RegenConfig(target=a.target, corpus=corpus)
    for name in ("out", "thinking", "device", "dtype", "keep", "on_truncated", "on_empty"):
        if getattr(a, name):
            setattr(cfg, name, getattr(a, name))
    for name, kind in (("max_new_tokens", int), ("batch_size", int), ("num_docs", int), ("temperature", float),
                       ("top_p", float), ("seed", int)):
        if getattr(a, name):
            try:
                setattr(cfg, name, kind(getattr(a, name)))
            except ValueError:
                raise ValueError(f"--{name}={getattr(a, name)!r}: expected {'an integer' if kind is int else 'a number'}") from None
    if a.progress:
        cfg.progress = a.progress.lower() not in ("0", "false", "no", "off")
    return cfg.resolve()


def main(argv: list[str]) -> dict:
    unbuffered()
    cfg = parse_args(argv)
    st = run(cfg)  # (its counts are logged once, at the end)
    print(cfg.out)
    return st


if __name__ == "__main__":
    run_cli(main)
