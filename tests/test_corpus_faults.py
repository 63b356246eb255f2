"""Stage 1a on corpus files as users have them: byte-order marks, CRLF, blank lines, files that are not UTF-8, text
the tokenizer cannot encode, huge lines, corpora with no document; and a dry run of stage 1b that writes nothing."""

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import pytest

from dflash_offline import corpus, tokenization
from dflash_offline.cache.manifest import read_manifest
from dflash_offline.config import ExtractConfig, TokenizeConfig
from dflash_offline.corpus import CorpusError
from stages import extract

GOOD = [{"messages": [{"role": "user", "content": f"Ça va {i}?"}, {"role": "assistant", "content": f"Oui, {i}, très bien"}]}
        for i in range(3)]


def tok_cfg(tmp_path, files, tokenizer, **kw):
    return TokenizeConfig(corpus=[str(f) for f in files], tokenizer=str(tokenizer), cache_root=str(tmp_path / "c"),
                          seq_len=128, rows_per_shard=2, workers=kw.pop("workers", 1), **kw).resolve()


def run(tmp_path, files, tokenizer, **kw):
    return tokenization.run(tok_cfg(tmp_path, files, tokenizer, **kw))


def lines(records) -> list[bytes]:
    return [json.dumps(r, ensure_ascii=False).encode() for r in records]


def skips(cache) -> list[tuple[int, str]]:
    return [(s["line"], s["reason"]) for s in map(json.loads, (cache / "skips.jsonl").read_text().splitlines())]


def docs(cache) -> list[list[int]]:
    from dflash_offline.cache.shards import read_token_shard
    from dflash_offline.packing import unpack_row

    out = []
    for s in read_manifest(cache)["shards"]:
        arrays = read_token_shard(cache / next(iter(s["files"])))
        out += [ids.tolist() for i in range(arrays["input_ids"].shape[0]) for ids, _ in unpack_row(arrays, i)]
    return sorted(out)


def test_bom_crlf_and_blank_lines_read_like_a_clean_file(tmp_path, qwen35_dir):
    clean = tmp_path / "clean.jsonl"
    clean.write_bytes(b"\n".join(lines(GOOD)) + b"\n")
    windows = tmp_path / "windows.jsonl"  # as a Windows editor saves it: BOM, CRLF, blank and whitespace-only lines
    a, b, c = lines(GOOD)
    windows.write_bytes(b"\xef\xbb\xbf" + a + b"\r\n\r\n" + b + b"\r\n \t\r\n" + b'{"text": "x"}\r\n' + c + b"\r\n")
    want, got = run(tmp_path / "a", [clean], qwen35_dir), run(tmp_path / "b", [windows], qwen35_dir)
    assert read_manifest(got)["summary"]["docs_packed"] == 3
    assert docs(got) == docs(want)
    assert skips(got) == [(5, "missing_messages")]  # line numbers count the blank lines


@pytest.mark.parametrize("workers", [1, 2])
def test_text_the_tokenizer_cannot_encode_is_a_counted_skip_or_a_strict_error(tmp_path, qwen35_dir, workers):
    # "\ud800" in JSON is a lone UTF-16 surrogate: a Python string, but no Unicode text the tokenizer can encode
    surrogate = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\\ud800"}]}'
    bad = tmp_path / "bad.jsonl"
    a, b, c = lines(GOOD)
    bad.write_bytes(b"\n".join([a, surrogate, b, c]) + b"\n")
    # chunks of 2: the bad record shares a tokenizer call (in a worker process with workers=2) with a good one
    cache = run(tmp_path / "d", [bad], qwen35_dir, workers=workers, chunk_docs=2)
    summary = read_manifest(cache)["summary"]
    assert summary["docs_skipped"] == {"encode_error": 1} and summary["docs_packed"] == 3
    assert skips(cache) == [(2, "encode_error")]
    with pytest.raises(CorpusError, match=r"(?s)bad\.jsonl:2: encode_error: .*surrogate U\+D800.*strict"):
        run(tmp_path / "s", [bad], qwen35_dir, workers=workers, chunk_docs=2, strict=True)


@pytest.mark.parametrize("encoding", ["utf-16", "latin-1"])
def test_file_that_is_not_utf8_names_every_line_and_says_so_loudly(tmp_path, qwen35_dir, capsys, encoding):
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in GOOD)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_bytes(text.encode(encoding))  # every line holds a non-ASCII character
    fine = tmp_path / "fine.jsonl"
    fine.write_text(text, encoding="utf-8")
    cache = run(tmp_path / "d", [foreign, fine], qwen35_dir)
    summary = read_manifest(cache)["summary"]
    n = len(skips(cache))
    assert summary["docs_skipped"] == {"invalid_utf8": n} and summary["docs_packed"] == 3
    assert skips(cache) == [(i, "invalid_utf8") for i in range(1, n + 1)] and n >= 3
    err = capsys.readouterr().err
    assert f"WARNING: {foreign}: not one of its {n} record(s) became a document (invalid_utf8 ×{n})" in err
    assert "re-encode it as UTF-8" in err
    with pytest.raises(CorpusError, match=r"(?s)foreign\.jsonl:1: invalid_utf8: .*UTF-8.*strict"):
        run(tmp_path / "s", [foreign, fine], qwen35_dir, strict=True)


def test_a_file_holding_no_record_is_said_so(tmp_path, qwen35_dir, capsys):
    """A glob that also matches an empty (or blank-lines-only) file: the run goes on with the others, saying so."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in GOOD)
    fine, empty = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    fine.write_text(text)
    empty.write_text("\n  \n")
    cache = run(tmp_path / "d", [fine, empty], qwen35_dir)
    assert read_manifest(cache)["summary"]["docs_packed"] == 3
    err = capsys.readouterr().err
    assert f"WARNING: {empty}: holds no record (empty, or blank lines only)" in err and str(fine) not in err


def test_a_file_of_mostly_unanswered_prompts_is_said_to_need_regen(tmp_path, qwen35_dir, capsys):
    """A prompts file given to stage 1a instead of make regen: its one answered record is packed and the run goes on,
    but the file is named loudly with what to do; a file with a minority of skips is not."""
    prompts, mixed = tmp_path / "prompts.jsonl", tmp_path / "mixed.jsonl"
    unanswered = [{"messages": [{"role": "user", "content": f"write function {i}"}]} for i in range(5)]
    prompts.write_bytes(b"\n".join(lines(unanswered + GOOD[:1])) + b"\n")
    mixed.write_bytes(b"\n".join(lines(GOOD + unanswered[:1])) + b"\n")
    cache = run(tmp_path / "d", [prompts, mixed], qwen35_dir)
    summary = read_manifest(cache)["summary"]
    assert summary["docs_skipped"] == {"no_assistant_turn": 6} and summary["docs_packed"] == 4
    err = capsys.readouterr().err
    assert f"WARNING: {prompts}: most of its 6 records were skipped (no_assistant_turn ×5; 1 packed)" in err
    assert f"make regen CORPUS={prompts} TARGET=" in err and str(mixed) not in err
    # documents long_doc=skip drops inside packed records (turns=each: a record's others are packed) are not records
    tally = tokenization.Tally(False, None)
    for line in range(10):
        tally.doc("f.jsonl")
        for _ in range(3):
            tally.skip(corpus.Skip("too_long", "x", "f.jsonl", line), policy=True)
    tally.warn_about_files()
    assert "WARNING" not in capsys.readouterr().err


def test_the_same_tokens_dir_takes_the_fixed_corpus_after_a_run_that_packed_nothing(tmp_path, qwen35_dir):
    """make tokenize TOKENS=t given a prompts file (no document: an error) and rerun with the regen output: the failed
    run's empty cache is replaced, not refused as another cache; a cache that holds shards is still refused."""
    prompts, fine = tmp_path / "prompts.jsonl", tmp_path / "fine.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) + "\n"
                               for i in range(3)))
    fine.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in GOOD))
    tokens = tmp_path / "t"

    def tokenize(corpus):
        return tokenization.run(dataclasses.replace(tok_cfg(tmp_path, [corpus], qwen35_dir), tokens=str(tokens)))

    with pytest.raises(CorpusError, match="no document to train on"):
        tokenize(prompts)
    assert (tokens / "manifest.json").is_file()
    from dflash_offline.extract_plan import check_tokens_dir

    check_tokens_dir(tokens, tok_cfg(tmp_path, [fine], qwen35_dir))  # (extract's check lets it be replaced too)
    assert read_manifest(tokenize(fine))["summary"]["docs_packed"] == 3
    with pytest.raises(Exception, match="already holds a different tokens cache"):
        tokenize(prompts)  # (this one holds shards: never replaced)


def test_a_corpus_file_given_twice_is_said_so(tmp_path, qwen35_dir, capsys):
    """A copy of a corpus file (or one file two globs match) beside it: its records would be trained on twice — said
    on stderr, naming both; files of other bytes are not."""
    a, b, c = (tmp_path / n for n in ("a.jsonl", "b.jsonl", "c.jsonl"))
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in GOOD)
    a.write_text(text)
    b.write_text(text)
    c.write_text(text.replace("bien", "mal"))  # (the same size, other bytes)
    run(tmp_path / "d", [a, b, c, a], qwen35_dir)
    err = capsys.readouterr().err
    assert f"WARNING: {b} holds the same bytes as {a}: its records are tokenized, and trained on, twice" in err
    assert f"WARNING: {a} is given twice: its records" in err and f"{c} holds" not in err


def test_make_status_names_the_tokenizing_host_and_process(tmp_path, qwen35_dir):
    """make status on a token cache: the process that wrote it as host:pid (a single process has no rank: no
    'rank ?' and no '?:pid')."""
    import socket
    import subprocess
    import sys

    fine = tmp_path / "a.jsonl"
    fine.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in GOOD))
    cache = run(tmp_path / "d", [fine], qwen35_dir)
    st = json.loads((cache / "status.json").read_text())
    assert st["host"] == socket.gethostname() and st["pid"] > 0 and "rank" not in st
    out = subprocess.run([sys.executable, "-m", "stages.status", f"--cache={cache}"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120).stdout
    assert f"tokenize {st['host']}:{st['pid']}: 3" in out and "rank ?" not in out and "?:" not in out, out


def complete_caches(root) -> list:
    return [m.parent for m in root.rglob("manifest.json") if json.loads(m.read_text()).get("complete")]


def test_corpus_without_a_document_is_an_error_before_any_cache_is_complete(tmp_path, qwen35_dir):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in GOOD[:2]).encode("latin-1"))
    nothing = tmp_path / "nothing.jsonl"
    nothing.write_bytes(json.dumps({"text": "hi"}).encode() + b"\n")
    match = (r"no document to train on: every record was skipped \(3 read\): invalid_utf8 ×2 \(e\.g\. "
             r".*latin\.jsonl:1, .*latin\.jsonl:2\); missing_messages ×1 \(e\.g\. .*nothing\.jsonl:1\)")
    with pytest.raises(CorpusError, match=match):
        run(tmp_path, [latin, nothing], qwen35_dir)
    blank = tmp_path / "blank.jsonl"
    blank.write_bytes(b"\n \r\n\n")
    with pytest.raises(CorpusError, match=r"the corpus has no records \(.*blank\.jsonl: empty or blank lines only"):
        run(tmp_path, [blank], qwen35_dir)
    # stage 1b (which runs stage 1a) refuses the same corpus before it builds anything
    ext = ExtractConfig(target=str(qwen35_dir), cache_root=str(tmp_path / "c"), num_draft_layers=3,
                        device="cpu").resolve()
    with pytest.raises(CorpusError, match="no document to train on"):
        extract.run(ext, tok_cfg(tmp_path, [latin, nothing], qwen35_dir))
    assert not complete_caches(tmp_path / "c") and not list((tmp_path / "c").glob("hidden-*"))


def test_huge_line_is_skipped_unread_with_file_and_line(tmp_path, qwen35_dir):
    a, b, _ = lines(GOOD)
    huge = b'{"messages": [{"role": "user", "content": "' + b"x" * (64 << 20) + b'"}]}'  # over the 64 MiB limit
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"\n".join([a, huge, b]) + b"\n")
    cache = run(tmp_path / "d", [big], qwen35_dir)
    summary = read_manifest(cache)["summary"]
    assert summary["docs_skipped"] == {"line_too_long": 1} and summary["docs_packed"] == 2
    assert skips(cache) == [(2, "line_too_long")]
    with pytest.raises(CorpusError, match=r"(?s)big\.jsonl:2: line_too_long: .*64 MiB.*strict"):
        run(tmp_path / "s", [big], qwen35_dir, strict=True)


def test_extract_dry_run_writes_nothing_and_estimates_like_the_real_run(tmp_path, qwen35_dir, chat_corpus, capsys):
    root = tmp_path / "cache"  # a fresh cache root: it does not exist yet
    tok = TokenizeConfig(corpus=[str(chat_corpus)], tokenizer=str(qwen35_dir), cache_root=str(root), seq_len=128,
                         rows_per_shard=4, workers=1, max_docs=40).resolve()
    ext = ExtractConfig(target=str(qwen35_dir), cache_root=str(root), num_draft_layers=3, device="cpu",
                        batch_rows=2, dry_run=True).resolve()
    assert extract.run(ext, tok) is None
    assert not root.exists()  # no token cache, no hidden cache, no status or skip files, not even the root
    out = capsys.readouterr().out
    assert "kernels ok" in out and "estimated" in out and "GB" in out
    # the in-memory manifest is the one the real run writes (shards, rows, tokens, skips)
    dry = tokenization.dry_run(tok)
    real = read_manifest(tokenization.run(tok))
    timing = ("seconds", "tokens_per_s")
    assert {k: v for k, v in dry["summary"].items() if k not in timing} == \
        {k: v for k, v in real["summary"].items() if k not in timing}
    fields = ("index", "rows", "docs", "tokens", "supervised_tokens", "padding_tokens", "status")
    assert [{k: s[k] for k in fields} for s in dry["shards"]] == [{k: s[k] for k in fields} for s in real["shards"]]
    assert (dry["key"], dry["num_shards"]) == (real["key"], real["num_shards"]) and dry["num_shards"] > 1
    assert tokenization.dry_run(tok) == real  # a complete cache on disk is read, not recomputed


@pytest.mark.parametrize("thinking", ["keep", "strip"])
def test_reasoning_left_in_content_is_split_or_stripped_never_answer(tmp_path, qwen35_dir, thinking):
    """Content as servers without a reasoning parser return it: a dangling `R</think>A` (the template opened the
    block), an unclosed `<think>R` (cut off while thinking), a whole `<think>R</think>A`. keep: R becomes the turn's
    think block; strip: only A is trained; no tag is ever left inside the answer."""
    from transformers import AutoTokenizer

    from dflash_offline.cache.shards import read_token_shard
    from dflash_offline.packing import unpack_row

    contents = ["Check 2+2.\n</think>\n\nIt is 4.", "<think>\nStill thinking about", "<think>Easy.</think>Yes."]
    recs = [{"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": c}]} for c in contents]
    # cut off while thinking, as a server returns it: null content, the reasoning in its own field
    recs.append({"messages": [{"role": "user", "content": "Q?"},
                              {"role": "assistant", "content": None, "reasoning_content": "Only thought"}]})
    path = tmp_path / "leaked.jsonl"
    path.write_bytes(b"\n".join(lines(recs)) + b"\n")
    cache = run(tmp_path / "d", [path], qwen35_dir, thinking=thinking)
    tok = AutoTokenizer.from_pretrained(str(qwen35_dir))
    [s] = read_manifest(cache)["shards"]
    arrays = read_token_shard(cache / next(iter(s["files"])))
    trained = sorted(tok.decode(ids[mask == 1]) for ids, mask in unpack_row(arrays, 0))
    if thinking == "keep":
        assert trained == ["<think>\nCheck 2+2.\n</think>\n\nIt is 4.<|im_end|>", "<think>\nEasy.\n</think>\n\nYes.<|im_end|>",
                           "<think>\nOnly thought\n</think>\n\n<|im_end|>",
                           "<think>\nStill thinking about\n</think>\n\n<|im_end|>"]
    else:
        assert trained == ["<|im_end|>", "<|im_end|>", "It is 4.<|im_end|>", "Yes.<|im_end|>"]
        assert read_manifest(cache)["summary"]["chat"]["think_blocks"]["stripped"] == 4


_PARENT, _PROCESS_CHUNK = os.getpid(), corpus.process_chunk


def _dies_at_line_2(chunk):
    """process_chunk, except that a worker process given line 2 exits at once (forked workers inherit the patch)."""
    if os.getpid() != _PARENT and any(r.line == 2 for r in chunk):
        os._exit(9)
    return _PROCESS_CHUNK(chunk)


def test_a_tokenizer_worker_that_dies_fails_the_stage_in_seconds_instead_of_hanging(tmp_path, qwen35_dir, monkeypatch):
    """A worker process killed mid-chunk (the OOM killer, a crash) stops stage 1a with an error that says so; the
    process pool used before waited forever on the chunk it lost."""
    import threading

    monkeypatch.setattr(corpus, "process_chunk", _dies_at_line_2)
    src = tmp_path / "a.jsonl"
    src.write_bytes(b"\n".join(lines(GOOD)) + b"\n")
    raised = []

    def stage():
        try:
            run(tmp_path / "d", [src], qwen35_dir, workers=2, chunk_docs=1)
        except Exception as e:  # noqa: BLE001
            raised.append(e)

    t = threading.Thread(target=stage, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "stage 1a hung on a dead worker"
    assert raised and "a tokenizer worker process died" in str(raised[0]) and "rerun" in str(raised[0])


KILLED_STAGE = """
import sys, time
from dflash_offline import corpus, tokenization
from dflash_offline.config import TokenizeConfig
def slow(chunk):  # (a worker at work when the stage is killed; by reference, as the pool sends it)
    time.sleep(600)
corpus.process_chunk = slow
tokenization.run(TokenizeConfig(corpus=[sys.argv[1]], tokenizer=sys.argv[2], cache_root=sys.argv[3], seq_len=128,
                                rows_per_shard=2, workers=2, chunk_docs=1).resolve())
"""


def test_a_killed_stage_leaves_no_tokenizer_worker_behind(tmp_path, qwen35_dir):
    """kill -9 of stage 1a (a scheduler's, a user's) while its workers tokenize: they end within seconds; they were
    left blocked on a pipe, hundreds of MB each, for good."""
    import signal
    import subprocess
    import sys
    import time

    src = tmp_path / "a.jsonl"
    src.write_bytes(b"\n".join(lines(GOOD)) + b"\n")
    stage = subprocess.Popen([sys.executable, "-c", KILLED_STAGE, str(src), str(qwen35_dir), str(tmp_path / "c")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def children() -> set[int]:
        found = set()
        for task in Path(f"/proc/{stage.pid}/task").glob("*"):
            with contextlib.suppress(OSError):  # (a thread that ended since the glob)
                found |= {int(c) for c in (task / "children").read_text().split()}
        return found

    deadline, workers = time.time() + 120, set()
    while time.time() < deadline and len(workers) < 2:
        time.sleep(0.2)
        workers = children()
    assert len(workers) == 2, "the stage started no workers"
    time.sleep(3)  # (they are in their initializer or tokenizing)
    stage.send_signal(signal.SIGKILL)
    stage.wait()
    deadline = time.time() + 15
    while time.time() < deadline and any(Path(f"/proc/{w}").exists() for w in workers):
        time.sleep(0.2)
    alive = [w for w in workers if Path(f"/proc/{w}").exists()]
    for w in alive:
        os.kill(w, signal.SIGKILL)
    assert not alive, f"tokenizer workers {alive} outlived the killed stage"


def test_one_read_gives_the_corpus_hash_and_its_records(tmp_path):
    """Regen's start-up reads the corpus once for its resume hash and its progress total: the hash is SHA-256 over
    each file's bytes after a separator, and the records are the non-blank lines (counted across read chunks: a line
    straddling 4 MiB, CRLF, blank lines, no final newline) and Parquet's rows; any other file leaves no total."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    big = tmp_path / "a.jsonl"
    line = json.dumps({"text": "x" * 3000}) + "\r\n"
    with open(big, "w", newline="") as f:
        f.write(line * 1400 + "\n  \n" + line * 100 + json.dumps({"text": "last"}))  # 1,501 records, 4.4 MB
    assert big.stat().st_size > 1 << 22
    table = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": ["p", "q", "r"]}), table)
    paths = [big, table]
    expect = hashlib.sha256(b"".join(b"\x00file\x00" + p.read_bytes() for p in paths)).hexdigest()
    assert corpus.hash_and_count(paths) == (expect, 1501 + 3)
    assert corpus.corpus_hash(paths) == expect
    other = tmp_path / "c.txt"
    other.write_text("plain\n")
    assert corpus.hash_and_count([big, other])[1] is None


def test_the_record_count_is_the_non_blank_lines_whatever_the_reads(tmp_path, monkeypatch):
    """Counted in reads of any size, equal to the non-blank lines of the whole file: lines and runs of blanks longer
    than a read, a line ending exactly at a read's end, no final newline. (It kept the unfinished line and copied it
    at every read: a corpus of one huge line took time quadratic in its size.)"""
    import random

    rng = random.Random(0)
    path = tmp_path / "x.jsonl"
    for trial in range(200):
        data = bytes(rng.choice(b"ab \t\r\n\n") for _ in range(rng.randrange(0, 60)))
        path.write_bytes(data)
        monkeypatch.setattr(corpus, "READ_CHUNK", rng.randrange(1, 9))
        want = sum(1 for line in data.split(b"\n") if line.strip())
        assert corpus.hash_and_count([path])[1] == want, (trial, data)
