"""Regenerating a chat corpus's answers with the target (self-distillation data): the records, the held-out split,
the output and its resume. `regenrun.run` (`stages/regen.py`) runs it with one of two answerers.

- Input (`make_job`): a record without an assistant turn is a prompt (its last turn a user's, or a tool result): it
  gets one answer appended. A conversation with assistant turns gets the first regenerated, the rest dropped; with
  `keep=all_turns` every one, and an answer appended when it ends in a user or tool turn. `entries` streams the corpus as `Job`s, `Skipped` records (malformed, with their `file:line`)
  and `Heldout` records (`held_out`: 1 in N by a stable hash of the first user turn, set aside for evaluation).
- Answerers: `dflash_offline.regen_local.Regenerator` (the target under `transformers.generate`, batches of jobs)
  and `dflash_offline.engine` (an OpenAI-compatible server, concurrent requests). Both add each answer with
  `Job.add_turn` and end a job with `Job.result`, so both write the same records (same `regen` keys).
- Output: `Writer` appends results to OUT and held-out records to their file in input order, flushed and fsynced,
  then commits `OUT.stats.json` — the resume point (`commit`, `resume_state`): input records consumed, lines written
  to each file. Lines past it are cut and redone; a resume with other settings (`RESUME_FIELDS`) is refused. A run
  that writes no record is an error (`check_usable`): its files are removed and the message counts the reasons.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .cache.fsio import write_json_atomic
from .chat import RecordError, validate_messages, validate_tools
from .corpus import HELDOUT_KEY, CorpusError, iter_records, parse, skip_heldout
from .progress import log

STATS_VERSION = 1
MAX_SKIP_EXAMPLES = 20
# settings that change the output bytes: a resume must use the same ones (the corpus files' sizes and contents: one
# edited in place would be resumed by record position; the dtype the target decodes in: bf16 and fp32 give other greedy answers)
RESUME_FIELDS = ("target", "corpus", "corpus_bytes", "corpus_sha256", "thinking", "max_new_tokens", "keep", "on_truncated", "on_empty",
                 "dtype", "sampling", "heldout", "template_kwargs")
UNDIGESTED = ("corpus_sha256",)  # checked from the stats only: outputs made before it keep their records' digest
OPTIONAL_FIELDS = ("sampling", "heldout", "template_kwargs")  # recorded only when on: absent = off (older outputs' digests unchanged)
PROMPT_ENDS = ("user", "tool")  # the roles a prompt (a record without an assistant turn) may end with


def hash_seed(*parts: int) -> int:
    """A 63-bit seed from integers (the same on every machine and Python)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def settings_digest(conf: dict) -> str:
    """A short digest of the resume settings, written into every output record (`regen.settings`): what a resume
    without its stats file checks the output against."""
    fields = [k for k in RESUME_FIELDS if (k not in OPTIONAL_FIELDS or conf.get(k)) and k not in UNDIGESTED]
    return hashlib.sha256(json.dumps([conf.get(k) for k in fields]).encode()).hexdigest()[:16]


# --- the generated text → content and reasoning ---------------------------------------------------------------


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


# --- reading the corpus --------------------------------------------------------------------------------------


@dataclass
class Result:
    """A finished job: its output record (None when dropped), what it counted and the skips it caused."""

    index: int  # ordinal in the corpus stream
    record: dict | None
    counts: dict
    skips: list  # [reason, detail, source]

    def to_json(self) -> dict:
        return {"index": self.index, "record": self.record, "counts": self.counts, "skips": self.skips}


@dataclass
class Skipped:
    index: int
    reason: str
    detail: str
    source: str  # file:line


@dataclass
class Heldout:
    index: int
    obj: dict  # the input record, written verbatim to the held-out file


@dataclass
class Job:
    """One input record on its way through generation."""

    index: int  # ordinal in the corpus stream
    source: str  # file:line
    obj: dict  # the parsed input record
    raw_msgs: list  # the input's messages, verbatim
    msgs: list  # validated (normalized) messages, used for rendering
    turns: list  # indices (in msgs) of the assistant turns to regenerate; len(msgs) = answer the prompt's end
    history: list = field(default_factory=list)  # conversation so far (validated + regenerated turns)
    out_msgs: list = field(default_factory=list)  # output messages so far (verbatim prompts + regenerated turns)
    finish: list = field(default_factory=list)
    new_tokens: list = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    skips: list = field(default_factory=list)
    dropped: str = ""  # reason the record is dropped (truncated / empty / a skip reason)
    cursor: int = 0  # next input message to copy into the history

    def next_turn(self, k: int) -> None:
        """Bring the history up to the k-th turn to generate: the input's non-assistant turns before it."""
        t = self.turns[k]
        for i in range(self.cursor, t):
            if self.msgs[i]["role"] != "assistant":
                self.history.append(self.msgs[i])
                self.out_msgs.append(self.raw_msgs[i])
        self.cursor = t + 1

    def skip(self, reason: str, detail: str) -> None:
        self.dropped = reason
        self.skips.append([reason, detail, self.source])

    def add_turn(self, msg: dict, finish: str, new_tokens: int, prompt_tokens: int, on_truncated: str,
                 on_empty: str) -> None:
        """Count one generated assistant message and append it; `finish` "length" = cut at max_new_tokens."""
        c = self.counts
        c["prompt_tokens"] += prompt_tokens
        c["new_tokens"] += new_tokens
        c["turns_generated"] += 1
        self.finish.append(finish)
        self.new_tokens.append(new_tokens)
        if finish == "length":
            c["truncated"] += 1
            if on_truncated == "drop":
                self.dropped = "truncated"
        if not msg["content"].strip() and not msg.get("reasoning_content") and not msg.get("tool_calls"):
            c["empty"] += 1
            if on_empty == "drop":
                self.dropped = self.dropped or "empty"
        self.history.append(msg)
        self.out_msgs.append(msg)

    def result(self, keep: str, settings: str) -> Result:
        """The output record of the finished job (None when dropped), with its counts."""
        if self.dropped in ("truncated", "empty"):
            self.counts[f"{self.dropped}_dropped"] += 1
        record = None
        if not self.dropped:
            if keep == "all_turns":  # the turns after the last assistant one (e.g. a final tool result)
                self.out_msgs += [m for m in self.raw_msgs[self.turns[-1] + 1:] if m.get("role") != "assistant"]
            meta = {"source": self.source, "index": self.index, "finish_reason": self.finish,
                    "new_tokens": self.new_tokens, "settings": settings}
            record = {**{k: v for k, v in self.obj.items() if k != "regen"}, "messages": self.out_msgs, "regen": meta}
        return Result(self.index, record, dict(self.counts), self.skips)


def make_job(rec, keep: str) -> Job:
    obj = parse(rec.raw)
    skip_heldout(obj)  # (answered, it would become training data)
    msgs = validate_messages(obj, answered=False)
    validate_tools(obj)  # a `tools` that is not a list of schemas: stage 1a would skip the record after its GPU time
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if msgs[-1]["role"] in PROMPT_ENDS and (not turns or keep == "all_turns"):
        turns.append(len(msgs))  # the conversation waits for an answer: it gets one
    if not turns:
        raise RecordError("no_prompt", f"no assistant turn and the last turn is {msgs[-1]['role']!r}: a prompt "
                                       f"ends with a {' or '.join(PROMPT_ENDS)} turn")
    if turns[0] == 0:
        raise RecordError("no_prompt", "the conversation starts with an assistant turn: there is nothing to answer")
    if keep == "first_turn":
        turns = turns[:1]
    return Job(rec.ordinal, f"{rec.file}:{rec.line}", obj, list(obj["messages"]), msgs, turns)


def held_out(msgs: list[dict], every: int) -> bool:
    """Whether a record belongs to the held-out set: the first 8 bytes of the SHA-256 of its first user turn's text
    (of the whole conversation when it has none), big-endian, divisible by `every`. About 1 in `every`; the same
    records on every machine and run, and a prompt repeated in the corpus always on the same side."""
    first = next((m["content"] for m in msgs if m["role"] == "user"), None)
    text = first if first is not None else json.dumps(msgs, sort_keys=True, ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % every == 0


def entries(paths: list[Path], start: int, num_docs: int, keep: str,
            heldout_every: int = 0) -> Iterator[Job | Skipped | Heldout]:
    """The corpus from input record `start` on, one entry per record, in order."""
    for rec in iter_records(paths, num_docs):
        if rec.ordinal < start:
            continue
        try:
            job = make_job(rec, keep)
        except RecordError as e:
            yield Skipped(rec.ordinal, e.reason, e.detail, f"{rec.file}:{rec.line}")
            continue
        yield Heldout(rec.ordinal, job.obj) if heldout_every and held_out(job.msgs, heldout_every) else job


def batches(items: Iterator, size: int) -> Iterator[list]:
    """Runs of consecutive entries holding `size` jobs each (the last may hold fewer)."""
    batch, jobs = [], 0
    for e in items:
        batch.append(e)
        jobs += isinstance(e, Job)
        if jobs == size:
            yield batch
            batch, jobs = [], 0
    if batch:
        yield batch


# --- stats and resume ----------------------------------------------------------------------------------------


def stats_path(out: str | Path) -> Path:
    return Path(f"{out}.stats.json")


def check_regen_finished(paths: list[Path]) -> None:
    """Refuse a corpus file that a `make regen` still writes, or stopped writing (its `OUT.stats.json` says
    complete: false): packing part of the answers trains on part of the data, and a rerun of regen finishes it."""
    for path in paths:
        try:
            st = json.loads(stats_path(path).read_text())
        except (OSError, ValueError):  # (no stats: not a regen output, or one whose stats were removed)
            continue
        if isinstance(st, dict) and st.get("complete") is False:
            raise CorpusError(f"{path} is the output of a make regen that has not finished ({stats_path(path)}: "
                              f"complete false, {st.get('records_read', '?')} input records read, "
                              f"{st.get('written', '?')} written): rerun the same make regen command to finish it "
                              f"(it resumes), or pass --partial_regen=1 (make tokenize ARGS=--partial_regen=1) to "
                              f"tokenize what it has written")


def fresh_stats() -> dict:
    return {"records_read": 0, "written": 0, "heldout": 0, "skipped": {}, "skip_examples": [], "turns_generated": 0,
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


def cut_to(path: Path, lines: int, what: str) -> None:
    """Cut `path` back to its first `lines` complete lines (what the stats committed)."""
    n, ends = complete_lines(path)
    if n < lines:
        raise ValueError(f"{path} has {n} complete lines but the stats say {lines} {what} were written: the file was "
                         f"cut; delete the output, its stats and its held-out file to start over")
    cut = ends[lines - 1] if lines else 0
    if path.stat().st_size != cut:
        log(f"{path}: cutting {path.stat().st_size - cut} bytes past the last committed record (an interrupted batch)")
        with open(path, "r+b") as f:
            f.truncate(cut)


def resume_state(out: Path, conf: dict, heldout: Path | None = None) -> dict:
    """Counts to continue from, after cutting `out` (and the held-out file) back to their last committed line."""
    held = heldout is not None and heldout.exists() and heldout.stat().st_size > 0
    if not out.exists() or out.stat().st_size == 0:
        if stats_path(out).is_file() and out.exists():
            state = committed_state(out, conf)  # a run that has written nothing yet (or only held-out records)
        elif held:
            raise ValueError(f"the held-out file {heldout} already holds records, but {out} does not exist: it belongs "
                             f"to another run; pass another --heldout_out, or delete it")
        else:
            return fresh_stats()
    elif stats_path(out).is_file():
        state = committed_state(out, conf)
    elif held:
        raise ValueError(f"{stats_path(out)} is missing: which lines of {out} and of the held-out file {heldout} were "
                         f"committed is unknown; delete all three to start over")
    else:
        state = state_from_output(out, conf, complete_lines(out)[0])
    cut_to(out, state["written"], "records")
    if heldout is not None and heldout.exists():
        cut_to(heldout, state["heldout"], "held-out records")
    return state


def committed_state(out: Path, conf: dict) -> dict:
    """The counts `OUT.stats.json` committed; refused when generated with other settings."""
    sp, fresh = stats_path(out), fresh_stats()
    st = json.loads(sp.read_text())
    for name in RESUME_FIELDS:
        before = st.get("config", {}).get(name)
        if name in OPTIONAL_FIELDS:  # recorded only when on
            if before != conf.get(name):
                raise ValueError(f"{out} was generated with {name} {before or 'off'}, not {conf.get(name) or 'off'}: "
                                 f"pass the same settings to resume it, or another --out (OUT=)")
        elif before is None:  # stats of older code, which did not record it
            log(f"warning: {sp} does not record {name}: resuming without checking it")
        elif before != conf[name]:
            edited = ("; a corpus edited to fix a few records need not be answered again: resume OUT on the corpus as "
                      "it was (a malformed record is only skipped), regenerate the fixed records alone into another "
                      "--out, and give make extract both outputs (CORPUS=OUT,OTHER)"
                      if name in ("corpus_bytes", "corpus_sha256") else "")
            raise ValueError(f"{out} was generated with {name}={before!r}, not {conf[name]!r}: pass the same "
                             f"settings to resume it (the same corpus files, unchanged), or another --out (OUT=)"
                             + edited)
    return {k: st.get(k, v) for k, v in fresh.items()}


def state_from_output(out: Path, conf: dict, lines: int) -> dict:
    """No commit point (the stats were deleted): trust the output itself, up to its last complete record, if it was
    made with these settings (its `regen.settings`)."""
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
                         f"pass the same settings to resume it, or another --out (OUT=)")
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
    keys = ("records_read", "written", "heldout", "turns_generated", "truncated", "truncated_dropped", "empty",
            "empty_dropped", "skipped", "new_tokens", "new_tokens_per_s")
    return {k: st.get(k, 0) for k in keys}


def append_records(f, records: list[dict]) -> None:
    """Append JSONL records and make them durable (flush + fsync) before the stats commit them."""
    for r in records:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


RECORD_FORMAT = ("A record is a chat (JSONL line or Parquet row with 'messages'): a prompt, whose last turn is a user "
                 "or tool turn, or a conversation whose assistant turns are replaced (docs/data.md, 'Regenerated data').")


def check_usable(st: dict, corpus: list[str], files: list[Path]) -> None:
    """A run that wrote no record is an error: its files are removed, the message counts why and shows examples."""
    if st["written"]:
        return
    for f in files:
        f.unlink(missing_ok=True)
    why = [f"skipped: {', '.join(f'{k} {v}' for k, v in sorted(st['skipped'].items()))}"] if st["skipped"] else []
    for name, fix in (("truncated_dropped", "--on_truncated=keep, or a larger --max_new_tokens"),
                      ("empty_dropped", "--on_empty=keep"), ("heldout", "a larger --heldout_every")):
        if st.get(name):
            why.append(f"{name.removesuffix('_dropped')} {st[name]} (pass {fix})")
    examples = "".join(f"\n  {e}" for e in st["skip_examples"][:5])
    raise ValueError(f"no usable record in {', '.join(corpus)}: {st['records_read']} read, none written; "
                     f"{'; '.join(why) or 'the corpus holds no record'}{examples}\n{RECORD_FORMAT} Nothing was "
                     f"written.")


PREVIEW = 1000  # records of each file read before the target loads (or a request is sent), to refuse a corpus with
# none usable


def check_first_records(paths: list[Path], corpus: list[str], num_docs: int, keep: str, heldout_every: int) -> None:
    """Refuse a run none of whose files holds a record to answer among its first `PREVIEW` (a file of another
    schema, a prompt file of the wrong format), before a 27B target takes minutes to load only to skip them all. It
    stops at the first usable record; a file without one among its first `PREVIEW` is passed over for the next (a
    corpus whose first file is bad but whose others are fine runs, counting the skips)."""
    reasons, examples, held, seen, capped = Counter(), [], 0, 0, False
    for path in paths:
        n = 0
        for e in entries([path], 0, 0, keep, heldout_every):
            if num_docs and seen >= num_docs or n >= PREVIEW:
                capped = capped or n >= PREVIEW
                break
            n, seen = n + 1, seen + 1
            if isinstance(e, Job):
                return
            if isinstance(e, Heldout):
                held += 1
            else:
                reasons[e.reason] += 1
                if len(examples) < 5:
                    examples.append(f"\n  {e.source}: {e.reason}: {e.detail}")
    if not seen:
        return
    why = ([f"skipped: {', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))}"] if reasons else []) + \
        ([f"held out {held} (pass a larger --heldout_every)"] if held else [])
    where = f"among the first {PREVIEW} records of each file of" if capped else "in"
    raise ValueError(f"no usable record {where} {', '.join(corpus)} ({seen} read before the target loads): "
                     f"{'; '.join(why)}{''.join(examples)}\n{RECORD_FORMAT} Nothing was loaded or written.")


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


class Writer:
    """Appends entries, in input order, to OUT (results) and the held-out file, then commits the stats."""

    def __init__(self, out: Path, heldout: Path | None, conf: dict, state: dict):
        self.out_path, self.conf, self.state, self.tally = out, conf, state, Tally(state)
        # the chat template's settings every answer was generated with: stage 1a renders the record with them
        self.template = {"enable_thinking": conf["thinking"] == "on", **conf.get("template_kwargs", {})}
        self.out = open(out, "a", encoding="utf-8")
        self.held = open(heldout, "a", encoding="utf-8") if heldout is not None else None
        self.t0, self.elapsed0 = time.time(), state["elapsed_s"]
        commit(out, conf, state, self.elapsed0)  # the resume point exists before any line does

    def put(self, items: list) -> tuple[int, int]:
        """Write `items` (`Result`, `Skipped`, `Heldout`, the next ones in input order) and commit; returns the input
        records and the new tokens they account for."""
        records, held, new_tokens = [], [], 0
        for e in items:
            if isinstance(e, Skipped):
                self.tally.skip(e.reason, e.detail, e.source)
            elif isinstance(e, Heldout):  # marked: stage 1a refuses it, the eval renders it as OUT was generated
                held.append({**e.obj, HELDOUT_KEY: {"every": self.conf["heldout"]["every"], "of": str(self.out_path),
                                                    "template": self.template}})
            else:
                self.tally.counts.update(e.counts)
                new_tokens += e.counts.get("new_tokens", 0)
                for reason, detail, source in e.skips:
                    self.tally.skip(reason, detail, source)
                if e.record is not None:
                    e.record["regen"]["template"] = self.template
                    records.append(e.record)
        append_records(self.out, records)
        if held:
            append_records(self.held, held)
        c = self.tally.counts
        consumed = items[-1].index + 1 - c["records_read"]
        c["written"] += len(records)
        c["heldout"] += len(held)
        c["records_read"] = items[-1].index + 1
        commit(self.out_path, self.conf, self.tally.into(self.state), self.elapsed())
        return consumed, new_tokens

    def elapsed(self) -> float:
        return self.elapsed0 + time.time() - self.t0

    def close(self) -> dict:
        for f in (self.out, self.held):
            if f is not None:
                f.close()
        return commit(self.out_path, self.conf, self.tally.into(self.state), self.elapsed(), complete=True)
