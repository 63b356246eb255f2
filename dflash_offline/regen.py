"""Regenerating a chat corpus's answers with the target (self-distillation data): what `stages/regen.py` runs.

- `make_job` turns an input record into a `Job` (its prompt turns, the assistant turns to regenerate);
  `batches` streams the corpus as batches of jobs, skipping malformed records with their `file:line`.
- `Regenerator` renders each job's conversation so far with the chat template, decodes a batch greedily (left
  padded) and turns each generation into an assistant message (`assistant_message`: a `<think>` block goes to
  `reasoning_content`); `process` runs every round of a batch (round k = the k-th assistant turn of each job) and
  returns the output records. Everything counted goes to a `Tally`.
- Resume: `OUT.stats.json` is the commit point (`commit`, `resume_state`): input records consumed and lines written;
  lines past it are cut and redone, and a resume with other generation settings (`RESUME_FIELDS`) is refused.

Regenerating at scale with a serving engine
-------------------------------------------
`stages/regen.py` runs `transformers.generate`: right for small corpora and tests, slow for millions of prompts (no
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

Notes for the engine path: greedy (`temperature=0`) matches `stages/regen.py`; sampling at the temperature you will
serve with is also reasonable (the drafter then learns the served distribution). Keep the reasoning parser on so the
thinking lands in `reasoning_content` (the chat template renders it back as `<think>…</think>`); with tool calls,
either turn the engine's tool parser off so the `<tool_call>` text stays in `content`, or convert the returned
`tool_calls` back into the record's `tool_calls` field. Count `finish_reason == "length"` as truncated. Write one
line per record, in any order, and keep the prompts unchanged.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .chat import RecordError, validate_messages, validate_tools
from .corpus import iter_records, parse
from .manifest import write_json_atomic
from .progress import log

STATS_VERSION = 1
MAX_SKIP_EXAMPLES = 20
# settings that change the output bytes: a resume must use the same ones (the corpus files' sizes: one edited in place
# would be resumed by record position; the dtype the target decodes in: bf16 and fp32 give other greedy answers)
RESUME_FIELDS = ("target", "corpus", "corpus_bytes", "thinking", "max_new_tokens", "keep", "on_truncated", "on_empty",
                 "dtype", "sampling")


def hash_seed(*parts: int) -> int:
    """A 63-bit seed from integers (the same on every machine and Python)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def settings_digest(conf: dict) -> str:
    """A short digest of the resume settings, written into every output record (`regen.settings`): what a resume
    without its stats file checks the output against."""
    import hashlib

    fields = [k for k in RESUME_FIELDS if k != "sampling" or conf.get(k)]  # (greedy runs' digest as before sampling)
    return hashlib.sha256(json.dumps([conf.get(k) for k in fields]).encode()).hexdigest()[:16]


# --- the generated text → an assistant message ---------------------------------------------------------------


def split_reasoning(text: str, think_open_in_prompt: bool) -> tuple[str, str | None]:
    """(content, reasoning) of a generation. `<think>R</think>C` → (C, R); the template may have opened the block
    in the prompt (then the generation is `R</think>C`, or only `R` when cut off inside the thinking). An answer that
    opened no block keeps a `</think>` it mentions as text."""
    stripped = text.lstrip()
    opened = think_open_in_prompt or stripped.startswith("<think>")
    if opened and "</think>" in text:
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
    validate_tools(obj)  # a `tools` that is not a list of schemas: stage 1a would skip the record after its GPU time
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


def batches(paths: list[Path], start: int, num_docs: int, size: int, keep: str,
            skip: Callable[[str, str, str], None]) -> Iterator[tuple[list[Job], int]]:
    """Batches of `size` valid jobs from input record `start` on, each with the input records consumed up to its
    end; the last (maybe empty) batch also commits the trailing skipped records."""
    batch: list[Job] = []
    consumed = start
    for rec in iter_records(paths, num_docs):
        if rec.ordinal < start:
            continue
        consumed = rec.ordinal + 1
        try:
            batch.append(make_job(rec, keep))
        except RecordError as e:
            skip(e.reason, e.detail, f"{rec.file}:{rec.line}")
        if len(batch) == size:
            yield batch, consumed
            batch = []
    yield batch, consumed


# --- stats and resume ----------------------------------------------------------------------------------------


def stats_path(out: str | Path) -> Path:
    return Path(f"{out}.stats.json")


def fresh_stats() -> dict:
    return {"records_read": 0, "written": 0, "skipped": {}, "skip_examples": [], "turns_generated": 0,
            "truncated": 0, "truncated_dropped": 0, "empty": 0, "empty_dropped": 0, "prompt_tokens": 0,
            "new_tokens": 0, "elapsed_s": 0.0}


def complete_lines(path: Path) -> tuple[int, list[int]]:
    """Number of newline-terminated lines of `path` and the byte offset after each."""
    ends, at = [], 0
    with open(path, "rb") as f:
        for line in f:
            at += len(line)
            if line.endswith(b"\n"):
                ends.append(at)
    return len(ends), ends


def resume_state(out: Path, conf: dict) -> dict:
    """Counts to continue from, after cutting `out` back to its last committed line. Fresh counts if no `out`."""
    if not out.exists() or out.stat().st_size == 0:
        return fresh_stats()
    n, ends = complete_lines(out)
    state = committed_state(out, conf, n) if stats_path(out).is_file() else state_from_output(out, conf, n)
    cut = ends[state["written"] - 1] if state["written"] else 0
    if out.stat().st_size != cut:
        log(f"{out}: cutting {out.stat().st_size - cut} bytes past the last committed record (an interrupted batch)")
        with open(out, "r+b") as f:
            f.truncate(cut)
    return state


def committed_state(out: Path, conf: dict, lines: int) -> dict:
    """The counts `OUT.stats.json` committed; refused when generated with other settings or when `out` was cut."""
    sp, fresh = stats_path(out), fresh_stats()
    st = json.loads(sp.read_text())
    for name in RESUME_FIELDS:
        before = st.get("config", {}).get(name)
        if name == "sampling":  # recorded only when sampling: absent is greedy
            if before != conf.get(name):
                raise ValueError(f"{out} was generated with sampling {before or 'off (greedy)'}, not "
                                 f"{conf.get(name) or 'off (greedy)'}: pass the same settings to resume it, or "
                                 f"another --out")
        elif before is None:  # stats of older code, which did not record it
            log(f"warning: {sp} does not record {name}: resuming without checking it")
        elif before != conf[name]:
            raise ValueError(f"{out} was generated with {name}={before!r}, not {conf[name]!r}: pass the same "
                             f"settings to resume it (the same corpus files, unchanged), or another --out")
    if lines < st["written"]:
        raise ValueError(f"{out} has {lines} complete lines but {sp} says {st['written']} were written: the file "
                         f"was cut; delete both to start over")
    return {k: st.get(k, v) for k, v in fresh.items()}


def state_from_output(out: Path, conf: dict, lines: int) -> dict:
    """No commit point (the stats were deleted, or a kill came between the first records and their commit): trust the
    output itself, up to its last complete record, if it was made with these settings (its `regen.settings`)."""
    sp, last = stats_path(out), None
    with open(out, "rb") as f:
        for line in f:
            if line.endswith(b"\n"):
                last = line
    try:
        meta = json.loads(last)["regen"] if last else {"index": -1}
        index = meta["index"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{out} exists but was not written by stages.regen (no {sp.name} and no 'regen' key): "
                         f"pass another --out or delete it") from None
    if meta.get("settings") not in (None, settings_digest(conf)):
        raise ValueError(f"{out} was generated with other settings than these ({', '.join(RESUME_FIELDS)}: its "
                         f"records say {meta['settings']}, these are {settings_digest(conf)}) and {sp} is missing: "
                         f"pass the same settings to resume it, or another --out")
    log(f"warning: {sp} is missing; resuming after record {index} from {out} alone (earlier counts are lost)")
    return {**fresh_stats(), "records_read": index + 1, "written": lines}


def commit(out: str | Path, conf: dict, state: dict, elapsed: float, complete: bool = False) -> dict:
    """Write the stats (the resume point) atomically; returns them."""
    st = {**state, "version": STATS_VERSION, "config": conf, "elapsed_s": round(elapsed, 3),
          "new_tokens_per_s": round(state["new_tokens"] / elapsed, 2) if elapsed > 0 else 0.0,
          "complete": complete, "out": str(out)}
    write_json_atomic(stats_path(out), st)
    return st


def summary(st: dict) -> dict:
    keys = ("records_read", "written", "turns_generated", "truncated", "truncated_dropped", "empty",
            "empty_dropped", "skipped", "new_tokens", "new_tokens_per_s")
    return {k: st[k] for k in keys}


def append_records(f, records: list[dict]) -> None:
    """Append JSONL records and make them durable (flush + fsync) before the stats commit them."""
    for r in records:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


# --- generation ----------------------------------------------------------------------------------------------


class Tally:
    """What a run counted, continued from the stats it resumes: counts, skips by reason, the first skip examples."""

    def __init__(self, state: dict):
        self.counts = Counter({k: v for k, v in state.items() if isinstance(v, int)})
        self.skipped = Counter(state["skipped"])
        self.examples = list(state["skip_examples"])

    def skip(self, reason: str, detail: str, source: str) -> None:
        self.skipped[reason] += 1
        msg = f"{source}: {reason}: {detail}"
        if len(self.examples) < MAX_SKIP_EXAMPLES:
            self.examples.append(msg)
            log(f"skip {msg}")

    def into(self, state: dict) -> dict:
        state.update(self.counts, skipped=dict(self.skipped), skip_examples=self.examples)
        return state


class Regenerator:
    """The target answering batches of jobs: greedy (`temperature` 0) or sampled, left padded, stopping at
    `<|im_end|>` or any eos of the target's generation config. `thinking`: `enable_thinking` of the chat template.
    Counts go to `tally`. Sampling draws from a generator seeded by (`seed`, the batch's first input record, the
    round), so a resumed run writes the bytes an uninterrupted one would (for the same batch size)."""

    def __init__(self, model, tok, tally: Tally, max_new_tokens: int, thinking: bool, keep: str, on_truncated: str,
                 on_empty: str, settings: str = "", temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        from transformers import GenerationConfig

        self.model, self.tok, self.tally, self.settings = model, tok, tally, settings
        self.max_new_tokens, self.thinking, self.keep = max_new_tokens, thinking, keep
        self.on_truncated, self.on_empty = on_truncated, on_empty
        self.eos = eos_ids(tok, model)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos[0]
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} if temperature > 0 \
            else {"do_sample": False}
        self.seed = seed
        self.gen_cfg = GenerationConfig(**sampling, max_new_tokens=max_new_tokens, eos_token_id=self.eos,
                                        pad_token_id=self.pad, num_beams=1)
        self.max_ctx = context_length(model)

    def process(self, jobs: list[Job]) -> list[dict]:
        """Regenerate the batch's turns in order (round k = k-th assistant turn of every job that has one); the
        output records of the jobs not dropped."""
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
                self.generate(round_jobs, k)
        return [r for r in map(self.record, jobs) if r is not None]

    def record(self, job: Job) -> dict | None:
        """The output record of a finished job; None when it is dropped."""
        if job.dropped in ("truncated", "empty"):
            self.tally.counts[f"{job.dropped}_dropped"] += 1
        if job.dropped:
            return None
        if self.keep == "all_turns":  # the turns after the last assistant one (e.g. a final tool result)
            last = job.turns[-1]
            job.out_msgs += [m for m in job.raw_msgs[last + 1:] if m.get("role") != "assistant"]
        meta = {"source": job.source, "index": job.index, "finish_reason": job.finish, "new_tokens": job.new_tokens,
                "settings": self.settings}
        return {**{k: v for k, v in job.obj.items() if k != "regen"}, "messages": job.out_msgs, "regen": meta}

    def render(self, job: Job) -> str:
        kwargs = {"tools": job.obj["tools"]} if isinstance(job.obj.get("tools"), list) else {}
        return self.tok.apply_chat_template(job.history, tokenize=False, add_generation_prompt=True,
                                            enable_thinking=self.thinking, **kwargs)

    def prompts(self, jobs: list[Job]) -> list[tuple[Job, list[int], str]]:
        """(job, prompt ids, prompt text) of each job whose conversation renders and fits the target's context."""
        live = []
        for job in jobs:
            try:
                live.append((job, self.render(job)))
            except Exception as e:  # the chat template rejected the conversation
                job.dropped = "template_error"
                self.tally.skip("template_error", f"{type(e).__name__}: {e}", job.source)
        ok = []
        for job, text in live:
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            if self.max_ctx and len(ids) + self.max_new_tokens > self.max_ctx:
                job.dropped = "prompt_too_long"
                self.tally.skip("prompt_too_long", f"{len(ids)} prompt tokens + max_new_tokens {self.max_new_tokens} "
                                f"> the target's context {self.max_ctx}", job.source)
            else:
                ok.append((job, ids, text))
        return ok

    def generate(self, jobs: list[Job], round_: int = 0) -> None:
        """One assistant turn for each job (its `history` ends just before that turn)."""
        import torch

        ok = self.prompts(jobs)
        if not ok:
            return
        width = max(len(ids) for _, ids, _ in ok)
        input_ids = torch.full((len(ok), width), self.pad, dtype=torch.long)
        attn = torch.zeros((len(ok), width), dtype=torch.long)
        for r, (_, ids, _) in enumerate(ok):
            input_ids[r, width - len(ids):] = torch.tensor(ids)
            attn[r, width - len(ids):] = 1
        device = next(self.model.parameters()).device
        if self.gen_cfg.do_sample:  # (generate draws from the default generator of the device)
            torch.manual_seed(hash_seed(self.seed, min(job.index for job in jobs), round_))
        with torch.inference_mode():
            gen = self.model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device),
                                      generation_config=self.gen_cfg)
        for (job, ids, text), row in zip(ok, gen[:, width:].tolist(), strict=True):
            self.answer(job, len(ids), row, prompt_opens_think(text))

    def answer(self, job: Job, prompt_tokens: int, row: list[int], think_open: bool) -> None:
        """Count one generated row and append it to the job as its next assistant message."""
        stop = next((i for i, t in enumerate(row) if t in self.eos), None)
        new = row[:stop] if stop is not None else row
        counts = self.tally.counts
        counts["prompt_tokens"] += prompt_tokens
        counts["new_tokens"] += len(new)
        counts["turns_generated"] += 1
        msg = assistant_message(self.tok.decode(new, skip_special_tokens=False), think_open)
        job.finish.append("stop" if stop is not None else "length")
        job.new_tokens.append(len(new))
        if stop is None:
            counts["truncated"] += 1
            if self.on_truncated == "drop":
                job.dropped = "truncated"
        if not msg["content"].strip() and not msg.get("reasoning_content"):
            counts["empty"] += 1
            if self.on_empty == "drop":
                job.dropped = job.dropped or "empty"
        job.history.append(msg)
        job.out_msgs.append(msg)


def pick_dtype(name: str, device):
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_model(target: str, device, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=pick_dtype(dtype, device))
    return model.to(device).eval()


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
