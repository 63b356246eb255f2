"""Corpus ingestion: stream records from JSONL / Parquet / Arrow files, validate them, tokenize them in worker
processes, and yield each record's documents (input_ids + assistant-only loss_mask) or its skip with a reason and
file:line.

Record kinds (per record, so one JSONL may mix them):
- chat: `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str (or text parts), "reasoning_content": str?,
  "tool_calls": [...]?}], "tools": [JSON schema, ...]?}`, rendered with the target's chat template into one sample
  per record or one per assistant turn, supervised from the conversation's structure (see `chat.py`);
- pre-tokenized: `{"input_ids": [int], "loss_mask": [0|1]}`.
JSONL files as users have them work: a UTF-8 byte-order mark, CRLF line ends and blank lines are fine. Whatever
fails for one record (bytes that are not UTF-8, JSON, validation, the chat template, text the tokenizer cannot
encode, a line longer than `MAX_LINE_BYTES`) makes that record a `Skip` with a reason and file:line, inside the
worker: no record ever raises out of `process_chunk`.
Nothing is read whole: files are read line by line or batch by batch, and at most `2 × workers` chunks are in
flight, so a corpus larger than RAM streams through with bounded memory.
"""

from __future__ import annotations

import codecs
import glob
import json
import multiprocessing as mp
import os
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_offline.chat import (
    RecordError,
    conversation_samples,
    prepare_messages,
    record_settings,
    template_opens_think,
    truncated_turns,
    validate_messages,
    validate_tools,
)

MAX_LINE_BYTES = 64 << 20  # a longer JSONL line is skipped (line_too_long) without being read into memory


class CorpusError(ValueError):
    """A corpus file or record is malformed; the message names file:line, the reason and what to do."""


@dataclass
class Record:
    file: str
    line: int  # 1-based line (JSONL) or row (Parquet/Arrow)
    ordinal: int  # position in the whole corpus stream
    raw: bytes | dict | None  # None: a JSONL line longer than MAX_LINE_BYTES (not read)


@dataclass
class Skip:
    reason: str
    detail: str
    file: str
    line: int

    def message(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}: {self.detail}"


@dataclass(eq=False)
class Tokens:
    """A record that became documents: one per sample (`turns=each`: one per assistant turn)."""

    file: str
    line: int
    ordinal: int
    docs: list[tuple[np.ndarray, np.ndarray]]  # (input_ids [n] int32, loss_mask [n] uint8 with 1 = supervised)
    counts: Counter  # what rendering did (samples, think blocks, tool calls); summed into the manifest


@dataclass(eq=False)
class Rendered:
    """A chat record rendered by the template, before tokenization: (text, supervised character spans) per sample."""

    rec: Record
    samples: list[tuple[str, list[tuple[int, int]]]]
    counts: Counter


# --- reading -------------------------------------------------------------------------------------------------


def expand_paths(patterns: list[str]) -> list[Path]:
    """Files for the given paths/globs, in a stable order; a pattern matching nothing is an error."""
    out: list[Path] = []
    for pat in patterns:
        hits = sorted(glob.glob(pat, recursive=True)) if any(c in pat for c in "*?[") else [pat]
        hits = [h for h in hits if not os.path.isdir(h)] or hits
        if not hits or not all(os.path.isfile(h) for h in hits):
            raise CorpusError(f"corpus {pat!r} matches no file: check CORPUS= (paths and globs are allowed)")
        out += [Path(h) for h in hits]
    return out


HELDOUT_KEY = "heldout"  # the mark `make regen` gives the records it holds out: {"every", "of", "template"}


def heldout_mark(obj: dict) -> dict | None:
    """The held-out mark of a record (`HELDOUT_KEY`), or None."""
    mark = obj.get(HELDOUT_KEY)
    return mark if isinstance(mark, dict) else None


def skip_heldout(obj: dict) -> None:
    """A record `make regen` held out is never trained on, nor answered to be (its skip: `heldout`)."""
    if (mark := heldout_mark(obj)) is not None:
        raise RecordError("heldout", f"held out for evaluation by make regen (of {mark.get('of', '?')}): never "
                                     f"trained on")


def heldout_refusal(where: str, mark: dict) -> str:
    return (f"{where}: a record `make regen` held out for evaluation (of {mark.get('of', '?')}): training on it would "
            f"measure τ on prompts the drafter learned; take the held-out file out of the corpus (CORPUS=, or the "
            f"recipe's [tokenize] corpus globs)")


def check_not_heldout(paths: list[Path]) -> None:
    """Refuse, before a record is tokenized, a JSONL corpus file whose first record carries the held-out mark (the
    file `make regen --heldout_every` writes); a marked record elsewhere is skipped (`heldout`)."""
    for path in paths:
        if file_kind(path) != "jsonl":
            continue
        if path.name.endswith(".heldout.jsonl"):  # what make regen named them before it marked them
            raise CorpusError(heldout_refusal(str(path), {"of": f"{path.name.removesuffix('.heldout.jsonl')}.jsonl, "
                                                                f"by its name"}))
        line_no, obj = first_record(path)
        if (mark := heldout_mark(obj)) is not None:
            raise CorpusError(heldout_refusal(f"{path}:{line_no}", mark))


def rendered_with(thinking: dict, base: dict) -> dict:
    """The chat template settings a corpus's records were rendered with where one set holds for all: `base`
    (tokenize.template_kwargs) with the enable_thinking every record was rendered under, when all were under one
    value (`thinking`: records per value, "true" / "false" / "unset", the summary's `rendered_enable_thinking`) —
    make regen's THINKING=off, which its records carry (regen.template) and template_kwargs need not say; a record's
    own regen.template renders it over template_kwargs, so the counts, not `base`, say what was used. Outside the
    cache key: what `make eval` renders plain prompts with."""
    used = {value for value, n in thinking.items() if n}
    if len(used) != 1 or used == {"unset"}:
        return base
    return {**base, "enable_thinking": used.pop() == "true"}


def first_record(path: Path) -> tuple[int, dict]:
    """(line, record) of a JSONL file's first record; {} where there is none or it does not parse (its own skip)."""
    for line_no, raw in jsonl_lines(path):
        try:
            return line_no, parse(raw)
        except RecordError:
            return line_no, {}
    return 0, {}


def check_settings_agree(paths: list[Path], tok, base: dict) -> None:
    """Refuse, before a record is tokenized, a JSONL corpus file (a make regen output) whose first record was answered
    under other chat template settings than `base` (tokenize.template_kwargs); a record elsewhere that was is skipped
    (`template_mismatch`)."""
    for path in paths:
        if file_kind(path) == "jsonl":
            line_no, obj = first_record(path)
            try:
                record_settings(obj, base, tok)
            except RecordError as e:
                if e.reason in ("template_mismatch", "template_error"):
                    raise CorpusError(f"{path}:{line_no}: {e.detail}") from None


def file_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".jsonl", ".json", ".jsonl.txt")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".arrow", ".feather", ".ipc")):
        return "arrow"
    raise CorpusError(f"{path}: unknown corpus format (expected .jsonl, .parquet or .arrow)")


def _table_batches(path: Path, kind: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        yield from pq.ParquetFile(path).iter_batches(batch_size=1024)
    else:
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path)))
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
        except pa.ArrowInvalid:
            with pa.ipc.open_stream(pa.memory_map(str(path))) as reader:
                yield from reader


def jsonl_lines(path: Path) -> Iterator[tuple[int, bytes | None]]:
    """(1-based line number, bytes) of every line that is not blank, with a UTF-8 byte-order mark dropped from its
    start; the bytes are None for a line longer than MAX_LINE_BYTES, which is skipped without being held whole."""
    limit = MAX_LINE_BYTES
    with open(path, "rb") as f:
        line_no = 0
        while line := f.readline(limit + 1):
            line_no += 1
            if len(line) > limit and not line.endswith(b"\n"):
                while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                    pass
                yield line_no, None
                continue
            line = line.removeprefix(codecs.BOM_UTF8)
            if line.strip():
                yield line_no, line


def iter_records(paths: list[Path], max_docs: int = 0) -> Iterator[Record]:
    """Every record of every file, lazily. Blank JSONL lines are not records."""
    ordinal = 0
    for path in paths:
        kind = file_kind(path)
        if kind == "jsonl":
            rows = jsonl_lines(path)
        else:
            rows = enumerate((obj for batch in _table_batches(path, kind) for obj in batch.to_pylist()), 1)
        for line_no, raw in rows:
            yield Record(str(path), line_no, ordinal, raw)
            ordinal += 1
            if max_docs and ordinal >= max_docs:
                return


def duplicate_files(paths: list[Path]) -> list[tuple[Path, Path]]:
    """(first, again) for each corpus file whose bytes an earlier one holds too (a copy, or one file two globs match):
    its records would be trained on twice. Only files of one size are hashed."""
    from collections import defaultdict

    from .cache.fsio import sha256_file

    by_size = defaultdict(list)
    for p in paths:
        by_size[p.stat().st_size].append(p)
    out = []
    for size, group in by_size.items():
        if size and len(group) > 1:
            first: dict[str, Path] = {}
            for p in group:
                digest = sha256_file(p)
                if digest in first:
                    out.append((first[digest], p))
                else:
                    first[digest] = p
    return sorted(out, key=lambda pair: paths.index(pair[1]))


def corpus_hash(paths: list[Path]) -> str:
    """Content hash of the corpus: the bytes of every file, in order (names do not matter, contents do)."""
    return hash_and_count(paths)[0]


READ_CHUNK = 1 << 22  # bytes a read of `hash_and_count`


def hash_and_count(paths: list[Path]) -> tuple[str, int | None]:
    """(`corpus_hash`, the input records) in one read of the corpus: the non-blank lines of JSONL files, the rows
    Parquet's metadata records; None records where a file is neither (a progress bar then has no total)."""
    import hashlib

    h, records = hashlib.sha256(), 0
    for p in paths:
        h.update(b"\x00file\x00")
        name = p.name.lower()
        lines = name.endswith((".jsonl", ".json", ".jsonl.txt"))
        if name.endswith(".parquet") and records is not None:
            import pyarrow.parquet as pq

            records += pq.ParquetFile(p).metadata.num_rows
        elif not lines:
            records = None
        open_line = False  # the line not ended yet has a non-blank byte (not kept: a huge line costs no copies)
        with open(p, "rb") as f:
            while chunk := f.read(READ_CHUNK):
                h.update(chunk)
                if lines and records is not None:
                    first, *rest = chunk.split(b"\n")
                    open_line = open_line or bool(first.strip())
                    if rest:
                        *whole, last = rest
                        records += open_line + sum(1 for line in whole if line.strip())
                        open_line = bool(last.strip())
        if lines and records is not None and open_line:
            records += 1
    return h.hexdigest(), records


# --- validation ----------------------------------------------------------------------------------------------


def parse(raw: bytes | dict | None) -> dict:
    if isinstance(raw, dict):
        return raw
    if raw is None:
        raise RecordError("line_too_long", f"the line is longer than {MAX_LINE_BYTES >> 20} MiB and was not read; "
                                           "each line must be one JSON object: split or drop this record")
    try:
        obj = json.loads(decode_utf8(raw).rstrip("\r\n"))  # (the line's own end: a cut line fails where it stops)
    except json.JSONDecodeError as e:
        raise RecordError("invalid_json", f"{e.msg} at column {e.colno}; each line must be one JSON object") from None
    except (ValueError, RecursionError) as e:  # an integer of > 4300 digits; nesting deeper than the stack
        raise RecordError("invalid_json", f"{type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise RecordError("not_an_object", f"got a JSON {type(obj).__name__}; expected an object with 'messages'")
    if "messages" not in obj and isinstance(obj.get("conversations"), list):
        return {**{k: v for k, v in obj.items() if k not in ("conversations", "system")},
                "messages": sharegpt_messages(obj)}
    return obj


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "chatgpt": "assistant", "system": "system", "tool": "tool", "observation": "tool"}


def sharegpt_messages(obj: dict) -> list[dict]:
    """ShareGPT's `conversations: [{"from": "human"|"gpt"|"system"|..., "value": str}]` as `messages`."""
    out = []
    for i, turn in enumerate(obj["conversations"]):
        who = turn.get("from") if isinstance(turn, dict) else None
        if who not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
            raise RecordError("invalid_conversations", f"conversations[{i}] is {str(turn)[:80]}; expected "
                                                       f"{{\"from\": one of {', '.join(SHAREGPT_ROLES)}, \"value\": "
                                                       f"a string}} (ShareGPT) or a 'messages' list")
        out.append({"role": SHAREGPT_ROLES[who], "content": turn["value"]})
    if isinstance(obj.get("system"), str) and obj["system"] and (not out or out[0]["role"] != "system"):
        out.insert(0, {"role": "system", "content": obj["system"]})  # (LLaMA-Factory's record-level system prompt)
    return out


def decode_utf8(raw: bytes) -> str:
    if b"\x00" in raw or raw.startswith((b"\xff\xfe", b"\xfe\xff")):  # never in UTF-8 JSON text
        raise RecordError("invalid_utf8", "NUL bytes or a UTF-16 byte-order mark: the file looks UTF-16/32 encoded; "
                                          "re-encode it as UTF-8 (e.g. iconv -f UTF-16 -t UTF-8)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError("invalid_utf8", f"byte {e.start} ({raw[e.start]:#04x}) is not UTF-8; re-encode the file "
                                          "as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)") from None


def validate_tokens(obj: dict, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = obj.get("input_ids"), obj.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise RecordError("wrong_type", "pre-tokenized records need lists 'input_ids' and 'loss_mask'")
    if len(ids) != len(mask):
        raise RecordError("length_mismatch", f"input_ids has {len(ids)} tokens, loss_mask {len(mask)}")
    if not ids:
        raise RecordError("empty_conversation", "input_ids is empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RecordError("wrong_type", "input_ids must hold integers only")
    if any(m not in (0, 1) for m in mask):
        raise RecordError("wrong_type", "loss_mask must hold 0 and 1 only")
    lo, hi = min(ids), max(ids)  # checked as Python ints: one beyond int64 must not overflow numpy
    if lo < 0 or hi >= vocab_size:
        raise RecordError("token_out_of_range", f"ids must be in [0, {vocab_size}); found {lo}..{hi}")
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


# --- loss mask --------------------------------------------------------------------------------------------


def mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for every token that starts inside a supervised span (spans sorted, not overlapping)."""
    starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
    if not spans:
        return np.zeros(len(starts), dtype=np.uint8)
    s0 = np.asarray([s for s, _ in spans])
    s1 = np.asarray([e for _, e in spans])
    idx = np.searchsorted(s0, starts, side="right") - 1
    ok = (idx >= 0) & (starts < s1[np.maximum(idx, 0)])
    return ok.astype(np.uint8)


def check_tokenizer(tok, settings: dict | None = None, field: str = "tokenize.template_kwargs") -> None:
    """Fail fast if the tokenizer cannot render Qwen chats with single-token turn markers, or its template ignores or
    refuses one of `settings` (its keyword arguments, given as `field`)."""
    template = getattr(tok, "chat_template", None)
    if not template:
        raise CorpusError("the tokenizer has no chat template: point TOKENIZER/TARGET at the target checkpoint")
    from .chat import template_reads

    if unread := sorted(set(settings or {}) - set(template_reads(tok, list(settings or {})))):
        raise CorpusError(f"{field}: the chat template of {tok.name_or_path} does not read "
                          f"{', '.join(unread)} (it would change nothing but the cache key): remove it")
    if not settings:
        return
    try:
        from .chat import apply

        apply(tok, [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}], None, settings)
    except Exception as e:  # noqa: BLE001 - the template's own refusal (raise_exception) is the message
        raise CorpusError(f"{field}: the chat template of {tok.name_or_path} refuses "
                          f"{json.dumps(settings)}: {e}") from None
    for marker in ("<|im_start|>", "<|im_end|>"):
        ids = tok.convert_tokens_to_ids(marker)
        if ids is None or ids == tok.unk_token_id:
            raise CorpusError(f"the tokenizer has no single token {marker}: only Qwen-style chat tokenizers work")


# --- worker processes ----------------------------------------------------------------------------------------

_TOK = None
_OPTS: dict = {}


def _init_worker(tokenizer, opts: dict, pool: bool = False) -> None:
    """A worker's tokenizer: `tokenizer` loaded from its directory in a pool's process, or the stage's own (already
    loaded: a second load of a real Qwen tokenizer costs ≈ 1 s) when the records are tokenized inline."""
    global _TOK, _OPTS
    if pool:
        exit_with_parent()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if isinstance(tokenizer, str | os.PathLike):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    _TOK = tokenizer
    _OPTS = dict(opts, opens_think=template_opens_think(_TOK))


def exit_with_parent(every_s: float = 1.0) -> None:
    """A pool worker ends within `every_s` of the stage that started it: after a kill -9 of the stage, its workers
    (hundreds of MB each, blocked on a pipe) were left to init forever."""
    import threading
    import time

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def process_chunk(chunk: list[Record]) -> list[Tokens | Skip]:
    """Records → Tokens or Skip, one each, in order. Runs in a worker (or inline when workers == 1) and never raises
    for a record: whatever fails for one (parse, validation, template, encoding) comes back as its Skip. The samples
    of all chat records of the chunk are encoded in one batched tokenizer call."""
    out = [render(rec) for rec in chunk]
    texts = [text for r in out if isinstance(r, Rendered) for text, _ in r.samples]
    encoded = iter(encode(texts))
    return [supervised(to_tokens(r, [next(encoded) for _ in r.samples]) if isinstance(r, Rendered) else r)
            for r in out]


def render(rec: Record) -> Rendered | Tokens | Skip:
    """A chat record's samples as the chat template renders them, a pre-tokenized record's tokens, or its Skip."""
    try:
        obj = parse(rec.raw)
        if "messages" not in obj and "input_ids" in obj:
            return Tokens(rec.file, rec.line, rec.ordinal, [validate_tokens(obj, _OPTS["vocab_size"])],
                          Counter(enable_thinking_unset=1))
        skip_heldout(obj)
        counts = Counter()
        msgs = prepare_messages(validate_messages(obj, counts), _OPTS["thinking"], counts)
        settings = record_settings(obj, _OPTS.get("settings"), _TOK)
        samples = conversation_samples(_TOK, msgs, validate_tools(obj), _OPTS["turns"], _OPTS["empty_think"], counts,
                                       truncated_turns(obj, msgs), _OPTS["opens_think"], settings)
        thinking = (settings or {}).get("enable_thinking")
        counts[f"enable_thinking_{'unset' if thinking is None else str(bool(thinking)).lower()}"] += 1
        return Rendered(rec, samples, counts)
    except RecordError as e:
        return Skip(e.reason, e.detail, rec.file, rec.line)
    except Exception as e:  # noqa: BLE001 - the chat template (the checkpoint's jinja) rejected the conversation
        return Skip("template_error", f"{type(e).__name__}: {e}", rec.file, rec.line)


def encode(texts: list[str]) -> list:
    """(input_ids, offsets) of each text, or the exception the tokenizer raised for it. One text the tokenizer
    cannot encode fails a whole batch call, so a failed batch is encoded again text by text."""
    if not texts:
        return []
    try:
        enc = _TOK(texts, add_special_tokens=False, return_offsets_mapping=True)
        return list(zip(enc["input_ids"], enc["offset_mapping"], strict=True))
    except Exception as e:  # noqa: BLE001 - the tokenizer's own error types (TypeError for a lone surrogate)
        return [e] if len(texts) == 1 else [encode([t])[0] for t in texts]


def to_tokens(r: Rendered, encs: list) -> Tokens | Skip:
    rec, docs = r.rec, []
    for (text, spans), enc in zip(r.samples, encs, strict=True):
        if isinstance(enc, Exception):
            return Skip("encode_error", encode_detail(text, enc), rec.file, rec.line)
        ids, offsets = enc
        docs.append((np.asarray(ids, dtype=np.int32), mask_from_offsets(offsets, spans)))
    return Tokens(rec.file, rec.line, rec.ordinal, docs, r.counts)


def encode_detail(text: str, err: Exception) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        return (f"the text holds a lone surrogate U+{code:04X} (a \\u{code:04x} JSON escape without its pair), "
                "which is not Unicode text and cannot be tokenized; fix or drop the record")
    return f"the tokenizer cannot encode the rendered text ({type(err).__name__}: {str(err)[:200]}); fix or drop it"


def supervised(r: Tokens | Skip) -> Tokens | Skip:
    """The record without samples that supervise nothing; a Skip when none is left."""
    if isinstance(r, Tokens):
        r.docs = [(ids, mask) for ids, mask in r.docs if mask.any()]
        if not r.docs:
            return Skip("no_supervised_tokens", "no assistant token to learn from", r.file, r.line)
    return r


def _chunks(records: Iterator[Record], size: int) -> Iterator[list[Record]]:
    chunk = []
    for rec in records:
        chunk.append(rec)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def tokenize_stream(
    records: Iterator[Record], tok, opts: dict, workers: int, chunk_docs: int
) -> Iterator[Tokens | Skip]:
    """Results in corpus order, computed by `workers` processes with a bounded number of chunks in flight. `tok`: the
    loaded tokenizer, used as it is inline (workers ≤ 1); each pool process loads its own from `tok.name_or_path`
    (a fast tokenizer used before a fork is not safe to use after it)."""
    if workers <= 1:
        _init_worker(tok, opts)
        for chunk in _chunks(records, chunk_docs):
            yield from process_chunk(chunk)
        return
    # fork: workers inherit the imported libraries (a spawned or forkserver worker spends seconds importing
    # transformers, in every stage that tokenizes). A worker that dies (killed, out of memory) fails the stage with
    # that said — a multiprocessing.Pool waited forever on its lost chunk instead (seen once in `make extract
    # DRY_RUN=1`); the shards committed before it are kept and a rerun continues.
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    try:
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(str(tok.name_or_path), opts, True)) as pool:
            pending: deque = deque()
            try:
                for chunk in _chunks(records, chunk_docs):
                    pending.append(pool.submit(process_chunk, chunk))
                    if len(pending) >= 2 * workers:
                        yield from pending.popleft().result()
                while pending:
                    yield from pending.popleft().result()
            finally:  # (a reader that stops early does not wait for the chunks queued ahead)
                for f in pending:
                    f.cancel()
    except BrokenProcessPool as e:
        raise RuntimeError(f"a tokenizer worker process died ({e}): the shards written before it are kept; rerun the "
                           f"same command (if it recurs, fewer workers: --workers=N)") from None
