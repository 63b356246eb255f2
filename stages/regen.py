"""Regenerate the assistant answers of a chat corpus with the target itself (self-distillation data).

    python -m stages.regen --target=DIR --corpus=a.jsonl,b/*.parquet [--out=FILE.jsonl] [--max_new_tokens=2048]
        [--batch_size=16] [--thinking=on|off] [--num_docs=N] [--device=auto|cpu|cuda] [--dtype=auto|bfloat16|float32]
        [--keep=first_turn|all_turns] [--on_truncated=keep|drop] [--on_empty=drop|keep]
    make regen TARGET=DIR CORPUS='data/*.jsonl' [OUT=regen/x.jsonl]

A DFlash drafter learns to predict what *the target* would write next, so it should be trained on the target's own
answers rather than on the corpus's (written by people or other models). This stage keeps every prompt and replaces
the answer with the target's greedy decode:

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
below; also printed at the end). Rerunning with the same `--out` resumes: `OUT.stats.json` is the commit point
(input records consumed, lines written); lines past it (a batch cut off by a crash) are cut and redone, records
already written are skipped, nothing is written twice. A resume with different generation settings (target,
corpus, thinking, max_new_tokens, keep, on_truncated, on_empty) is refused, naming the field. The last line printed
is the output path. The output feeds stage 1: `make extract CORPUS=OUT TARGET=...` (tokenize it with the same
`thinking` choice you regenerated with).

Stats fields (`OUT.stats.json`): `records_read` (input records consumed), `written` (output records),
`skipped` (reason → count) and `skip_examples` (the first 20 as `file:line: reason: detail`), `turns_generated`,
`truncated` / `truncated_dropped`, `empty` / `empty_dropped`, `prompt_tokens`, `new_tokens`, `elapsed_s`,
`new_tokens_per_s`, `complete`, and `config` (the settings, to refuse an inconsistent resume).

Regenerating at scale with a serving engine
-------------------------------------------
This stage runs `transformers.generate`: right for small corpora and tests, slow for millions of prompts (no
continuous batching, no paged KV cache). At scale, serve the target with vLLM or SGLang and send the prompts through
their OpenAI-compatible chat API; write the same JSONL chat format and feed it to `make extract` the same way:

    vllm serve /ckpt/Qwen3.5-27B --tensor-parallel-size 8 --max-model-len 16384 --reasoning-parser qwen3
    # or: python -m sglang.launch_server --model-path /ckpt/Qwen3.5-27B --tp 8 --reasoning-parser qwen3

    # client (one process; raise the concurrency until the server is saturated):
    import asyncio, json, openai
    client = openai.AsyncOpenAI(base_url="http://localhost:8000/v1", api_key="none")
    sem = asyncio.Semaphore(256)
    async def regen(rec):
        msgs = rec["messages"]
        prompt = msgs[: next(i for i, m in enumerate(msgs) if m["role"] == "assistant")]
        async with sem:
            r = await client.chat.completions.create(
                model="/ckpt/Qwen3.5-27B", messages=prompt, tools=rec.get("tools"), temperature=0, max_tokens=2048,
                extra_body={"chat_template_kwargs": {"enable_thinking": True}, "skip_special_tokens": False})
        m = r.choices[0].message
        turn = {"role": "assistant", "content": m.content or ""}
        if getattr(m, "reasoning_content", None):
            turn["reasoning_content"] = m.reasoning_content
        return {**rec, "messages": prompt + [turn], "regen": {"finish_reason": [r.choices[0].finish_reason]}}

Notes for the engine path: greedy (`temperature=0`) matches this stage; sampling at the temperature you will serve
with is also reasonable (the drafter then learns the served distribution). Keep the reasoning parser on so the
thinking lands in `reasoning_content` (the chat template renders it back as `<think>…</think>`); with tool calls,
either turn the engine's tool parser off so the `<tool_call>` text stays in `content`, or convert the returned
`tool_calls` back into the record's `tool_calls` field. Count `finish_reason == "length"` as truncated. Write one
line per record, in any order, and keep the prompts unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflash_offline.corpus import (
    RecordError,
    check_tokenizer,
    expand_paths,
    iter_records,
    parse,
    validate_messages,
)
from dflash_offline.manifest import write_json_atomic
from dflash_offline.progress import Progress, log, run_cli, unbuffered
from dflash_offline.targetid import resolve_checkpoint

STATS_VERSION = 1
MAX_SKIP_EXAMPLES = 20
# settings that change the output bytes: a resume must use the same ones
RESUME_FIELDS = ("target", "corpus", "thinking", "max_new_tokens", "keep", "on_truncated", "on_empty")


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
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device={self.device!r}: expected auto, cpu, cuda or cuda:N")
        if not self.out:
            name = Path(self.target.rstrip("/")).name or "target"
            self.out = str(Path("regen") / f"{name}-thinking_{self.thinking}.jsonl")
        return self


def stats_path(out: str | Path) -> Path:
    return Path(f"{out}.stats.json")


# --- the generated text → an assistant message ---------------------------------------------------------------


def split_reasoning(text: str, think_open_in_prompt: bool) -> tuple[str, str | None]:
    """(content, reasoning) of a generation. `<think>R</think>C` → (C, R); the template may have opened the block
    in the prompt (then the generation is `R</think>C`, or only `R` when cut off inside the thinking)."""
    stripped = text.lstrip()
    opened = think_open_in_prompt or stripped.startswith("<think>")
    if "</think>" in text:
        pre, post = text.split("</think>", 1)
        pre = pre.lstrip()
        if pre.startswith("<think>"):
            pre = pre[len("<think>"):]
        return post.lstrip("\n"), pre.strip()
    if opened:
        body = stripped[len("<think>"):] if stripped.startswith("<think>") else text
        return "", body.strip()
    return text, None


def assistant_message(text: str, think_open_in_prompt: bool) -> dict:
    content, reasoning = split_reasoning(text, think_open_in_prompt)
    msg = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def prompt_opens_think(prompt_text: str) -> bool:
    """True when the generation prompt ends inside an open `<think>` block (Qwen3.5 with thinking on)."""
    tail = prompt_text.rstrip()
    return tail.endswith("<think>")


# --- reading the corpus --------------------------------------------------------------------------------------


@dataclass
class Job:
    """One input record on its way through generation."""

    index: int  # ordinal in the corpus stream
    source: str  # file:line
    obj: dict  # the parsed input record
    raw_msgs: list  # the input's messages, verbatim
    msgs: list  # validated (normalized) messages, used for rendering
    turns: list  # indices (in msgs) of the assistant turns to regenerate
    history: list = field(default_factory=list)  # rendered conversation so far (validated + regenerated turns)
    out_msgs: list = field(default_factory=list)  # output messages so far (verbatim prompts + regenerated turns)
    finish: list = field(default_factory=list)
    new_tokens: list = field(default_factory=list)
    dropped: str = ""  # reason the record is dropped (truncated / empty / prompt_too_long)


def make_job(rec, keep: str) -> Job:
    obj = parse(rec.raw)
    msgs = validate_messages(obj)
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if turns[0] == 0:
        raise RecordError("no_prompt", "the conversation starts with an assistant turn: there is nothing to answer")
    if keep == "first_turn":
        turns = turns[:1]
    return Job(rec.ordinal, f"{rec.file}:{rec.line}", obj, list(obj["messages"]), msgs, turns)


def count_records(paths: list[Path]) -> int | None:
    """Input records for the progress bar's total (cheap: newlines of JSONL, metadata of Parquet)."""
    total = 0
    for p in paths:
        name = p.name.lower()
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            total += pq.ParquetFile(p).metadata.num_rows
        elif name.endswith((".jsonl", ".json", ".jsonl.txt")):
            with open(p, "rb") as f:
                total += sum(1 for line in f if line.strip())
        else:
            return None
    return total


# --- resume --------------------------------------------------------------------------------------------------


def config_record(cfg: RegenConfig, paths: list[Path]) -> dict:
    return {"target": str(Path(cfg.target).resolve()), "corpus": [str(p.resolve()) for p in paths],
            "thinking": cfg.thinking, "max_new_tokens": cfg.max_new_tokens, "keep": cfg.keep,
            "on_truncated": cfg.on_truncated, "on_empty": cfg.on_empty, "num_docs": cfg.num_docs,
            "batch_size": cfg.batch_size}


def complete_lines(path: Path) -> tuple[int, list[int]]:
    """Number of newline-terminated lines of `path` and the byte offset after each."""
    ends, at = [], 0
    with open(path, "rb") as f:
        for line in f:
            at += len(line)
            if line.endswith(b"\n"):
                ends.append(at)
    return len(ends), ends


def resume_state(cfg: RegenConfig, conf: dict) -> dict:
    """Counts to continue from, after cutting `out` back to its last committed line. Fresh counts if no `out`."""
    out, sp = Path(cfg.out), stats_path(cfg.out)
    fresh = {"records_read": 0, "written": 0, "skipped": {}, "skip_examples": [], "turns_generated": 0,
             "truncated": 0, "truncated_dropped": 0, "empty": 0, "empty_dropped": 0, "prompt_tokens": 0,
             "new_tokens": 0, "elapsed_s": 0.0}
    if not out.exists() or out.stat().st_size == 0:
        return fresh
    n, ends = complete_lines(out)
    if sp.is_file():
        st = json.loads(sp.read_text())
        for name in RESUME_FIELDS:
            if st.get("config", {}).get(name) != conf[name]:
                raise ValueError(f"{out} was generated with {name}={st.get('config', {}).get(name)!r}, not "
                                 f"{conf[name]!r}: pass the same settings to resume it, or another --out")
        if n < st["written"]:
            raise ValueError(f"{out} has {n} complete lines but {sp} says {st['written']} were written: the file "
                             f"was cut; delete both to start over")
        state = {k: st.get(k, v) for k, v in fresh.items()}
    else:
        # no commit point (stats deleted): trust the output itself, up to its last complete record
        last = None
        with open(out, "rb") as f:
            for line in f:
                if line.endswith(b"\n"):
                    last = line
        try:
            index = json.loads(last)["regen"]["index"] if last else -1
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{out} exists but was not written by stages.regen (no {sp.name} and no 'regen' key): "
                             f"pass another --out or delete it") from None
        state = {**fresh, "records_read": index + 1, "written": n}
        log(f"warning: {sp} is missing; resuming after record {index} from {out} alone (earlier counts are lost)")
    if out.stat().st_size != (ends[state["written"] - 1] if state["written"] else 0):
        cut = ends[state["written"] - 1] if state["written"] else 0
        log(f"{out}: cutting {out.stat().st_size - cut} bytes past the last committed record (an interrupted batch)")
        with open(out, "r+b") as f:
            f.truncate(cut)
    return state


# --- the run -------------------------------------------------------------------------------------------------


def pick_device(name: str):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible: pass --device=cpu or run on a GPU machine")
    return torch.device(name)


def pick_dtype(name: str, device):
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def eos_ids(tok, model) -> list[int]:
    ids = [tok.convert_tokens_to_ids("<|im_end|>")]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in gen_eos if isinstance(gen_eos, list | tuple) else [gen_eos]:
        if e is not None and e not in ids:
            ids.append(int(e))
    return ids


def context_length(model) -> int:
    conf = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(conf, "max_position_embeddings", 0) or 0)


def load_model(cfg: RegenConfig, device, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype)
    return model.to(device).eval()


def run(cfg: RegenConfig, model=None, tokenizer=None) -> dict:
    """Regenerate; returns the stats. `model`/`tokenizer` may be passed in (tests) instead of loaded."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    t0 = time.time()
    cfg.resolve()
    # validate everything cheap before any weight loads
    paths = expand_paths(cfg.corpus)
    if model is None:
        resolve_checkpoint(cfg.target, need=("config", "weights", "tokenizer"), field="regen --target")
    tok = tokenizer or AutoTokenizer.from_pretrained(cfg.target)
    check_tokenizer(tok)
    device = pick_device(cfg.device) if model is None else next(model.parameters()).device
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    conf = config_record(cfg, paths)
    state = resume_state(cfg, conf)
    n = count_records(paths)
    total = min(cfg.num_docs, n) if cfg.num_docs and n is not None else (cfg.num_docs or n)
    if total is not None and state["records_read"] >= total:
        log(f"{out}: all {total} records already done")
        return finish(cfg, conf, state, 0.0, complete=True)
    if state["records_read"]:
        log(f"resuming {out}: {state['records_read']} input records done, {state['written']} written")

    if model is None:
        model = load_model(cfg, device, pick_dtype(cfg.dtype, device))
    eos = eos_ids(tok, model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=cfg.max_new_tokens, eos_token_id=eos,
                               pad_token_id=pad, num_beams=1)
    max_ctx = context_length(model)
    log(f"regenerating with {type(model).__name__} on {device}, thinking={cfg.thinking}, keep={cfg.keep}, "
        f"batch {cfg.batch_size}, max_new_tokens {cfg.max_new_tokens} → {out}")

    counts = Counter({k: v for k, v in state.items() if isinstance(v, int)})
    skipped = Counter(state["skipped"])
    examples = list(state["skip_examples"])
    elapsed0 = state["elapsed_s"]
    progress = Progress("regen", total, "doc", None, disable=None if cfg.progress else True)
    progress.update(counts["records_read"])

    def skip(reason: str, detail: str, source: str) -> None:
        skipped[reason] += 1
        msg = f"{source}: {reason}: {detail}"
        if len(examples) < MAX_SKIP_EXAMPLES:
            examples.append(msg)
            log(f"skip {msg}")

    def render(job: Job) -> str:
        kwargs = {"tools": job.obj["tools"]} if isinstance(job.obj.get("tools"), list) else {}
        return tok.apply_chat_template(job.history, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=cfg.thinking == "on", **kwargs)

    def generate(jobs: list[Job]) -> None:
        """One assistant turn for each job (its `history` ends just before that turn)."""
        texts, live = [], []
        for job in jobs:
            try:
                texts.append(render(job))
                live.append(job)
            except Exception as e:  # the chat template rejected the conversation
                job.dropped = "template_error"
                skip("template_error", f"{type(e).__name__}: {e}", job.source)
        if not live:
            return
        enc = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        ok = []
        for job, ids, text in zip(live, enc, texts, strict=True):
            if max_ctx and len(ids) + cfg.max_new_tokens > max_ctx:
                job.dropped = "prompt_too_long"
                skip("prompt_too_long", f"{len(ids)} prompt tokens + max_new_tokens {cfg.max_new_tokens} > "
                     f"the target's context {max_ctx}", job.source)
            else:
                ok.append((job, ids, text))
        if not ok:
            return
        width = max(len(ids) for _, ids, _ in ok)
        input_ids = torch.full((len(ok), width), pad, dtype=torch.long)
        attn = torch.zeros((len(ok), width), dtype=torch.long)
        for r, (_, ids, _) in enumerate(ok):
            input_ids[r, width - len(ids):] = torch.tensor(ids)
            attn[r, width - len(ids):] = 1
        with torch.inference_mode():
            gen = model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device),
                                 generation_config=gen_cfg)
        gen = gen[:, width:].tolist()
        for (job, ids, text), row in zip(ok, gen, strict=True):
            stop = next((i for i, t in enumerate(row) if t in eos), None)
            new = row[:stop] if stop is not None else row
            counts["prompt_tokens"] += len(ids)
            counts["new_tokens"] += len(new)
            counts["turns_generated"] += 1
            msg = assistant_message(tok.decode(new, skip_special_tokens=False), prompt_opens_think(text))
            job.finish.append("stop" if stop is not None else "length")
            job.new_tokens.append(len(new))
            if stop is None:
                counts["truncated"] += 1
                if cfg.on_truncated == "drop":
                    job.dropped = "truncated"
            if not msg["content"].strip() and not msg.get("reasoning_content"):
                counts["empty"] += 1
                if cfg.on_empty == "drop":
                    job.dropped = job.dropped or "empty"
            job.history.append(msg)
            job.out_msgs.append(msg)

    def process(jobs: list[Job]) -> list[dict]:
        """Regenerate the batch's turns in order (round k = k-th assistant turn of every job that has one)."""
        cursors = {id(j): 0 for j in jobs}  # next message index to copy into the history
        for k in range(max(len(j.turns) for j in jobs)):
            round_jobs = []
            for job in jobs:
                if job.dropped or k >= len(job.turns):
                    continue
                t = job.turns[k]
                for i in range(cursors[id(job)], t):  # the original non-assistant turns before this one
                    if job.msgs[i]["role"] != "assistant":
                        job.history.append(job.msgs[i])
                        job.out_msgs.append(job.raw_msgs[i])
                cursors[id(job)] = t + 1
                round_jobs.append(job)
            if round_jobs:
                generate(round_jobs)
        records = []
        for job in jobs:
            if job.dropped in ("truncated", "empty"):
                counts[f"{job.dropped}_dropped"] += 1
            if job.dropped:
                continue
            if cfg.keep == "all_turns":  # the turns after the last assistant one (e.g. a final tool result)
                last = job.turns[-1]
                job.out_msgs += [m for m in job.raw_msgs[last + 1:] if m.get("role") != "assistant"]
            meta = {"source": job.source, "index": job.index, "finish_reason": job.finish,
                    "new_tokens": job.new_tokens}
            records.append({**{k: v for k, v in job.obj.items() if k != "regen"}, "messages": job.out_msgs,
                            "regen": meta})
        return records

    def batches() -> Iterator[tuple[list[Job], int]]:
        """Batches of valid jobs, with the input records consumed up to the batch's end."""
        batch: list[Job] = []
        consumed = state["records_read"]
        for rec in iter_records(paths, cfg.num_docs):
            if rec.ordinal < state["records_read"]:
                continue
            consumed = rec.ordinal + 1
            try:
                batch.append(make_job(rec, cfg.keep))
            except RecordError as e:
                skip(e.reason, e.detail, f"{rec.file}:{rec.line}")
            if len(batch) == cfg.batch_size:
                yield batch, consumed
                batch = []
        yield batch, consumed  # the last (maybe empty) batch also commits the trailing skipped records

    tg = time.time()
    with open(out, "a", encoding="utf-8") as f:
        for batch, consumed in batches():
            records = process(batch) if batch else []
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            counts["written"] += len(records)
            progress.update(consumed - counts["records_read"], tokens=sum(sum(j.new_tokens) for j in batch))
            counts["records_read"] = consumed
            state.update(counts, skipped=dict(skipped), skip_examples=examples)
            commit(cfg, conf, state, elapsed0 + time.time() - tg)  # the resume point
    progress.close("done")
    st = finish(cfg, conf, state, elapsed0 + time.time() - tg, complete=True)
    log(f"regen done in {time.time() - t0:.1f}s: {json.dumps(summary(st))}")
    return st


def commit(cfg: RegenConfig, conf: dict, state: dict, elapsed: float, complete: bool = False) -> dict:
    st = {**state, "version": STATS_VERSION, "config": conf, "elapsed_s": round(elapsed, 3),
          "new_tokens_per_s": round(state["new_tokens"] / elapsed, 2) if elapsed > 0 else 0.0,
          "complete": complete, "out": str(cfg.out)}
    write_json_atomic(stats_path(cfg.out), st)
    return st


def finish(cfg: RegenConfig, conf: dict, state: dict, elapsed: float, complete: bool) -> dict:
    return commit(cfg, conf, state, elapsed or state.get("elapsed_s", 0.0), complete)


def summary(st: dict) -> dict:
    keys = ("records_read", "written", "turns_generated", "truncated", "truncated_dropped", "empty",
            "empty_dropped", "skipped", "new_tokens", "new_tokens_per_s")
    return {k: st[k] for k in keys}


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
    for name in ("max_new_tokens", "batch_size", "num_docs"):
        if getattr(a, name):
            try:
                setattr(cfg, name, int(getattr(a, name)))
            except ValueError:
                raise ValueError(f"--{name}={getattr(a, name)!r}: expected an integer") from None
    if a.progress:
        cfg.progress = a.progress.lower() not in ("0", "false", "no", "off")
    return cfg.resolve()


def main(argv: list[str]) -> dict:
    unbuffered()
    cfg = parse_args(argv)
    st = run(cfg)
    print(json.dumps(summary(st), indent=1))
    print(cfg.out)
    return st


if __name__ == "__main__":
    run_cli(main)
