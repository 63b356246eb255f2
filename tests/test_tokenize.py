"""Stage 1a end to end: chat-template masks, malformed input, determinism, key sensitivity, formats, streaming."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from dflash_offline import tokenization
from dflash_offline.cache.manifest import read_manifest
from dflash_offline.cache.shards import read_token_shard
from dflash_offline.chat import turn_spans
from dflash_offline.config import TokenizeConfig
from dflash_offline.corpus import CorpusError
from dflash_offline.packing import unpack_row

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo, 世界?"},
        {"role": "assistant", "content": "Bonjour 🌍!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}]},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "It rains."},
    ]
}


def run(tmp_path, corpus, tokenizer, **kw):
    cfg = TokenizeConfig(corpus=[str(c) for c in corpus], tokenizer=str(tokenizer), cache_root=str(tmp_path / "c"),
                         seq_len=kw.pop("seq_len", 256), rows_per_shard=kw.pop("rows_per_shard", 8), workers=1, **kw)
    return tokenization.run(cfg.resolve())


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in records))
    return path


def all_docs(cache):
    m = read_manifest(cache)
    docs = []
    for s in m["shards"]:
        arrays = read_token_shard(cache / next(iter(s["files"])))
        for i in range(arrays["input_ids"].shape[0]):
            docs += [(int(src), ids, mask) for src, (ids, mask) in zip(arrays["doc_sources"][i], unpack_row(arrays, i),
                                                                     strict=True)]
    return sorted(docs, key=lambda d: d[0])


@pytest.mark.parametrize("thinking", ["keep", "strip"])
def test_loss_mask_covers_exactly_assistant_turns(tmp_path, qwen35_dir, thinking):
    tok = AutoTokenizer.from_pretrained(qwen35_dir)
    cache = run(tmp_path, [write_jsonl(tmp_path / "c.jsonl", [CHAT])], qwen35_dir, thinking=thinking)
    [(_, ids, mask)] = all_docs(cache)
    text = tok.decode(ids)
    supervised = tok.decode(ids[mask == 1])
    # what is supervised is exactly the assistant spans of the rendered conversation (through <|im_end|>)
    expected = "".join(text[a:b] for a, b in turn_spans(text))
    assert supervised == expected
    assert supervised.count("<|im_end|>") == 3 and "Bonjour 🌍!" in supervised and "It rains." in supervised
    assert "Héllo" not in supervised and "rain<|im_end|>" not in supervised.replace("It rains.<|im_end|>", "")
    assert ("Greet back." in supervised) == (thinking == "keep")
    assert "Be brief." in text and "Weather?" in text
    m = read_manifest(cache)
    assert m["producer"]["thinking"] == thinking and m["config"]["thinking"] == thinking


BAD = [
    ("{not json", "invalid_json"),
    ("[1, 2]", "not_an_object"),
    ({"text": "hi"}, "missing_messages"),
    ({"messages": []}, "empty_conversation"),
    ({"messages": "hi"}, "wrong_type"),
    ({"messages": [{"content": "hi"}]}, "missing_role"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}, "non_string_content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
                   {"role": "assistant", "content": "x"}]}, "non_text_content"),
    ({"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}]}, "non_text_content"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                                        "reasoning_content": ["x"]}]}, "wrong_type"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "tools": "calc"},
     "wrong_type"),
    ({"input_ids": [1, 2, 3], "loss_mask": [1, 1]}, "length_mismatch"),
    ({"input_ids": [1, 2, 10**9], "loss_mask": [1, 1, 1]}, "token_out_of_range"),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}, "no_supervised_tokens"),
    ({"input_ids": [1, 2**70], "loss_mask": [1, 1]}, "token_out_of_range"),  # beyond int64
    ('{"input_ids": [' + "7" * 5000 + '], "loss_mask": [1]}', "invalid_json"),  # past Python's int digit limit
    ("[" * 100_000 + "]" * 100_000, "invalid_json"),  # nested deeper than the parser's stack
    # tool calls: arguments that are not a JSON object (string or value), a call without a function name
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{'city': 'Oslo'}"}}]}]},
     "invalid_tool_call"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"name": "f", "arguments": "[1, 2]"}]}]}, "invalid_tool_call"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"arguments": {}}}]}]}, "invalid_tool_call"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": {"name": "f"}}]},
     "wrong_type"),
    # a lone surrogate (a \ud800 JSON escape without its pair): a Python string the tokenizer cannot encode
    ('{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "a"}]}',
     "encode_error"),
]


def test_malformed_records_are_skipped_counted_and_named(tmp_path, qwen35_dir):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "fine"}]}
    corpus = write_jsonl(tmp_path / "bad.jsonl", [good] + [r for r, _ in BAD] + [good])
    with open(corpus, "ab") as f:
        f.write(b'{"messages": [{"role": "user", "content": "\xff"}]}\n')
    cache = run(tmp_path, [corpus], qwen35_dir)
    m = read_manifest(cache)
    expected = {}
    for _, reason in BAD + [(None, "invalid_utf8")]:
        expected[reason] = expected.get(reason, 0) + 1
    assert m["summary"]["docs_skipped"] == expected
    assert m["summary"]["docs_packed"] == 2
    skips = [json.loads(line) for line in (cache / "skips.jsonl").read_text().splitlines()]
    assert [(s["line"], s["reason"]) for s in skips] == [(i + 2, r) for i, (_, r) in enumerate(BAD)] + [
        (len(BAD) + 3, "invalid_utf8")
    ]


@pytest.mark.parametrize("index", range(len(BAD)))
def test_strict_mode_stops_at_first_bad_record_with_file_and_line(tmp_path, qwen35_dir, index):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "fine"}]}
    record, reason = BAD[index]
    corpus = write_jsonl(tmp_path / "bad.jsonl", [good, good, record])
    with pytest.raises(CorpusError, match=rf"(?s)bad\.jsonl:3: {reason}: .*strict"):
        run(tmp_path, [corpus], qwen35_dir, strict=True)


def test_long_document_policies(tmp_path, qwen35_dir):
    long = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "word " * 400}]}
    short = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"}]}
    corpus = write_jsonl(tmp_path / "long.jsonl", [long, short])
    cache = run(tmp_path / "s", [corpus], qwen35_dir, long_doc="skip", strict=True)  # a policy, not a fault
    skipped = read_manifest(cache)["summary"]
    assert skipped["docs_skipped"] == {"too_long": 1} and skipped["docs_packed"] == 1
    [skip] = [json.loads(line) for line in (cache / "skips.jsonl").read_text().splitlines()]
    assert (skip["file"], skip["line"], skip["reason"]) == (str(corpus), 1, "too_long")
    split = read_manifest(run(tmp_path / "p", [corpus], qwen35_dir, long_doc="split"))["summary"]
    trunc = read_manifest(run(tmp_path / "t", [corpus], qwen35_dir, long_doc="truncate"))["summary"]
    assert split["pieces"] >= 3 and trunc["pieces"] == 2 and trunc["tokens"] == 256 + skipped["tokens"]
    assert split["tokens"] + split["split_unsupervised_tokens"] == trunc["tokens"] + trunc["truncated_tokens"]
    # nothing left to train on: an error naming the reason and the record, before the cache is marked complete
    only_long = write_jsonl(tmp_path / "only_long.jsonl", [long])
    with pytest.raises(CorpusError, match=r"no document to train on.*too_long ×1 \(e\.g\. .*only_long\.jsonl:1\)"):
        run(tmp_path / "o", [only_long], qwen35_dir, long_doc="skip")
    assert not any(json.loads(m.read_text()).get("complete") for m in (tmp_path / "o").rglob("manifest.json"))


def test_same_inputs_same_key_and_bytes_and_workers_do_not_matter(tmp_path, qwen35_dir, chat_corpus):
    a = run(tmp_path / "a", [chat_corpus], qwen35_dir)
    cfg = TokenizeConfig(corpus=[str(chat_corpus)], tokenizer=str(qwen35_dir), cache_root=str(tmp_path / "b" / "c"),
                         seq_len=256, rows_per_shard=8, workers=2, chunk_docs=7)
    b = tokenization.run(cfg.resolve())
    assert a.name == b.name
    ma, mb = read_manifest(a), read_manifest(b)
    assert ma["key"] == mb["key"] and len(ma["shards"]) > 3
    assert [s["files"] for s in ma["shards"]] == [s["files"] for s in mb["shards"]]
    for s in ma["shards"]:
        name = next(iter(s["files"]))
        assert (a / name).read_bytes() == (b / name).read_bytes()
    # every document once, in corpus order, as the tokenizer renders it alone
    tok = AutoTokenizer.from_pretrained(qwen35_dir)
    whole: dict[int, list] = {}
    for src, ids, _ in all_docs(a):  # split documents come back as consecutive pieces of one source
        whole.setdefault(src, []).extend(ids.tolist())
    assert sorted(whole) == list(range(300))
    lines = chat_corpus.read_text().splitlines()
    for i in (0, 1, 299):
        msgs = json.loads(lines[i])["messages"]
        assert whole[i] == tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]


def test_a_run_tokenizing_inline_loads_its_tokenizer_once(tmp_path, qwen35_dir, chat_corpus, monkeypatch):
    """workers=1 tokenizes with the tokenizer the stage loaded to check it (a real Qwen tokenizer costs ≈ 1 s a load);
    the test above shows its shards equal a pool's, whose processes load their own."""
    loads, real = [], AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(a) or real(cls, *a, **k)))
    assert read_manifest(run(tmp_path, [chat_corpus], qwen35_dir))["complete"] and len(loads) == 1, loads


def test_key_changes_with_every_input(tmp_path, qwen35_dir, chat_corpus):
    base = read_manifest(run(tmp_path / "0", [chat_corpus], qwen35_dir))["key"]
    other_corpus = tmp_path / "other.jsonl"
    other_corpus.write_bytes(chat_corpus.read_bytes().replace(b"assistant", b"assistant", 1) + b"\n")
    edited = tmp_path / "edited.jsonl"
    edited.write_bytes(chat_corpus.read_bytes().replace(b"the", b"teh", 1))
    tok2 = tmp_path / "tok2"
    shutil.copytree(qwen35_dir, tok2)
    tpl = tok2 / "chat_template.jinja"
    tpl.write_text(tpl.read_text().replace("<|im_start|>", "<|im_start|>", 1) + "\n")
    keys = {
        "corpus": read_manifest(run(tmp_path / "1", [edited], qwen35_dir))["key"],
        "seq_len": read_manifest(run(tmp_path / "2", [chat_corpus], qwen35_dir, seq_len=512))["key"],
        "packing": read_manifest(run(tmp_path / "3", [chat_corpus], qwen35_dir, open_rows=4))["key"],
        "long_doc": read_manifest(run(tmp_path / "4", [chat_corpus], qwen35_dir, long_doc="skip"))["key"],
        "template": read_manifest(run(tmp_path / "5", [chat_corpus], tok2))["key"],
        "thinking": read_manifest(run(tmp_path / "6", [chat_corpus], qwen35_dir, thinking="strip"))["key"],
        "turns": read_manifest(run(tmp_path / "8", [chat_corpus], qwen35_dir, turns="each"))["key"],
        "empty_think": read_manifest(run(tmp_path / "9", [chat_corpus], qwen35_dir, empty_think="supervise"))["key"],
    }
    assert base not in keys.values() and len(set(keys.values())) == len(keys)
    # a blank line is not a record and the bytes changed: the key must still change (content-addressed)
    assert read_manifest(run(tmp_path / "7", [other_corpus], qwen35_dir))["key"] != base


def test_rerun_reuses_and_interrupted_run_completes_identically(tmp_path, qwen35_dir, chat_corpus):
    cache = run(tmp_path, [chat_corpus], qwen35_dir)
    m = read_manifest(cache)
    files = {n: (cache / n).read_bytes() for s in m["shards"] for n in s["files"]}
    # simulate a crash after 2 committed shards: manifest without `complete` and without the later shards
    crashed = dict(m, shards=m["shards"][:2], complete=False, summary={})
    (cache / "manifest.json").write_text(json.dumps(crashed))
    for name in list(files)[2:]:
        (cache / name).unlink()
    (cache / "tokens-00005.arrow.partial").write_bytes(b"junk")  # stray file of a dead writer: ignored
    again = run(tmp_path, [chat_corpus], qwen35_dir)
    m2 = read_manifest(again)
    assert again == cache and m2["complete"] and m2["summary"]["rows"] == m["summary"]["rows"]
    assert {n: (cache / n).read_bytes() for s in m2["shards"] for n in s["files"]} == files


def test_shards_are_committed_in_batches_and_an_interrupted_run_commits_those_it_wrote(tmp_path, qwen35_dir,
                                                                                          chat_corpus, monkeypatch):
    """A commit rewrites the whole manifest (15 MB at 24K shards): one a shard made tokenization quadratic in its
    shards. The run's shards are committed in a few batches; one stopped (Ctrl-C) commits the shards it wrote first,
    and a rerun keeps them and ends with the same cache."""
    from dflash_offline.cache import manifest as mf

    writes, real = [], mf.write_manifest
    monkeypatch.setattr(mf, "write_manifest", lambda cache, m: (writes.append(len(m["shards"])), real(cache, m)))
    ref = run(tmp_path / "ref", [chat_corpus], qwen35_dir, rows_per_shard=1)
    n = read_manifest(ref)["num_shards"]
    assert n >= 20 and len(writes) <= 4, (n, writes)  # (open, vocabulary, the batch, complete)
    want = {p.name: p.read_bytes() for p in ref.glob("tokens-*.arrow")}

    calls, write = [], tokenization.write_token_shard

    def stopped(path, *a, **k):
        calls.append(path)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return write(path, *a, **k)

    monkeypatch.setattr(tokenization, "write_token_shard", stopped)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, [chat_corpus], qwen35_dir, rows_per_shard=1)
    cache = next((tmp_path / "c").glob("tokens-*"))
    assert sorted(mf.committed(read_manifest(cache))) == list(range(6))  # the six it wrote
    monkeypatch.setattr(tokenization, "write_token_shard", write)
    assert run(tmp_path, [chat_corpus], qwen35_dir, rows_per_shard=1) == cache
    assert {p.name: p.read_bytes() for p in cache.glob("tokens-*.arrow")} == want


def test_parquet_arrow_pretokenized_and_globs(tmp_path, qwen35_dir):
    recs = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(6)]
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", recs[:3])
    pq.write_table(pa.Table.from_pylist(recs[3:]), tmp_path / "d" / "b.parquet")
    pre = pa.table({"input_ids": [[5, 6, 7, 8]], "loss_mask": [[0, 0, 1, 1]]})
    with pa.ipc.new_file(str(tmp_path / "d" / "c.arrow"), pre.schema) as w:
        w.write_table(pre)
    cache = run(tmp_path, [str(tmp_path / "d" / "*")], qwen35_dir)
    docs = all_docs(cache)
    assert len(docs) == 7
    assert docs[-1][1].tolist() == [5, 6, 7, 8] and docs[-1][2].tolist() == [0, 0, 1, 1]
    with pytest.raises(CorpusError, match="matches no file"):
        run(tmp_path, [str(tmp_path / "nope" / "*.jsonl")], qwen35_dir)


STREAM_SCRIPT = """
import json, resource, sys
from dflash_offline.config import TokenizeConfig
from dflash_offline import tokenization
cfg = TokenizeConfig(corpus=[sys.argv[1]], tokenizer=sys.argv[2], cache_root=sys.argv[3], seq_len=512,
                     rows_per_shard=64, workers=2, chunk_docs=512).resolve()
out = tokenization.run(cfg)
# this process's own peak (VmHWM resets at exec; ru_maxrss does not: it would report the parent test process's peak)
hwm = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")]
rss = int(hwm[0]) * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print("RESULT", json.dumps({"rss": rss, "kids": kids, "summary": json.load(open(out / "manifest.json"))["summary"]}))
"""


def stream_run(tmp_path, n, tokenizer):
    path = tmp_path / f"stream{n}.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Say {i}."},
                                             {"role": "assistant", "content": f"{i} — ok ✓"}]}) + "\n")
    res = subprocess.run([sys.executable, "-c", STREAM_SCRIPT, str(path), str(tokenizer), str(tmp_path / f"c{n}")],
                         capture_output=True, text=True, check=True, env={"DFLASH_NO_BAR": "1", "PATH": ""})
    return json.loads(res.stdout.split("RESULT ", 1)[1])


def test_streaming_100k_documents_in_bounded_memory(tmp_path, qwen35_dir):
    small, big = stream_run(tmp_path, 5_000, qwen35_dir), stream_run(tmp_path, 100_000, qwen35_dir)
    assert big["summary"]["docs_packed"] == 100_000 and big["summary"]["docs_skipped_total"] == 0
    assert big["summary"]["padding_fraction"] < 0.05
    print(f"\npeak RSS main {big['rss'] / 2**20:.0f} MiB, worker {big['kids'] / 2**20:.0f} MiB "
          f"(5K docs: {small['rss'] / 2**20:.0f} MiB); {big['summary']['tokens_per_s']:,.0f} tok/s")
    # memory does not grow with the corpus: 20× the documents, (almost) the same peak
    assert big["rss"] < small["rss"] + 64 * 2**20 and big["kids"] < small["kids"] + 64 * 2**20
    assert big["rss"] < 1.5 * 2**30


def test_status_prints_table_and_json(tmp_path, qwen35_dir, chat_corpus):
    cache = run(tmp_path, [chat_corpus], qwen35_dir)
    out = subprocess.run([sys.executable, "-m", "stages.status", f"--cache={cache}"], capture_output=True, text=True,
                         check=True).stdout
    assert "committed" in out and "padding_fraction" in out and "complete" in out
    js = json.loads(subprocess.run([sys.executable, "-m", "stages.status", f"--cache={cache}", "--json=1"],
                                   capture_output=True, text=True, check=True).stdout)
    assert js["complete"] and js["committed"] == len(js["shards"]) > 0 and js["kind"] == "tokens"
    assert np.isclose(js["summary"]["padding_fraction"],
                      js["summary"]["padding_tokens"] / (js["summary"]["tokens"] + js["summary"]["padding_tokens"]))


def test_record_tools_are_rendered_unsupervised(tmp_path, qwen35_dir):
    tools = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {}}}}}]
    base = {"messages": CHAT["messages"][3:]}
    corpus = write_jsonl(tmp_path / "t.jsonl", [base, dict(base, tools=tools), dict(base, tools=[])])
    docs = all_docs(run(tmp_path, [corpus], qwen35_dir))
    tok = AutoTokenizer.from_pretrained(str(qwen35_dir))
    (_, plain, plain_mask), (_, with_tools, tools_mask), (_, empty, _) = docs
    text = tok.decode(with_tools)
    assert "Weather of a city" in text and "Weather of a city" not in tok.decode(plain)
    assert np.array_equal(empty, plain)  # an empty list renders like no list
    assert tok.decode(with_tools[tools_mask.astype(bool)]) == tok.decode(plain[plain_mask.astype(bool)])


def test_tool_calls_in_every_shape_render_alike(tmp_path, qwen35_dir):
    """OpenAI tool calls (JSON-string arguments, id, type, null content), flat calls with object arguments, tool
    messages with tool_call_id/name: the same tokens; the arguments parsed from strings are counted."""
    def chat(style):
        args = {"city": "Zürich", "days": [1, 2]}
        if style == "openai":
            calls = [{"id": "c1", "type": "function",
                      "function": {"name": "weather", "arguments": json.dumps(args, ensure_ascii=False)}}]
            turn, result = {"content": None, "tool_calls": calls}, {"tool_call_id": "c1", "name": "weather"}
        else:
            turn, result = {"content": "", "tool_calls": [{"name": "weather", "arguments": args}]}, {}
        return {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", **turn},
                             {"role": "tool", "content": "sun", **result}, {"role": "assistant", "content": "Sun."}]}

    cache = run(tmp_path, [write_jsonl(tmp_path / "t.jsonl", [chat("openai"), chat("flat")])], qwen35_dir)
    (_, a, mask_a), (_, b, mask_b) = all_docs(cache)
    assert a.tolist() == b.tolist() and mask_a.tolist() == mask_b.tolist()
    tok = AutoTokenizer.from_pretrained(str(qwen35_dir))
    assert '{"name": "weather", "arguments": {"city": "Zürich", "days": [1, 2]}}' in tok.decode(a[mask_a == 1])
    chat_summary = read_manifest(cache)["summary"]["chat"]
    assert chat_summary["tool_calls"] == 2 and chat_summary["tool_arguments_parsed"] == 1


def test_turns_each_with_a_template_that_renders_every_turn_alike_is_turns_last(tmp_path, qwen35_dir):
    """turns=each: one sample per assistant turn (the conversation through it), but a sample whose rendering the next
    one starts with is carried into it. The embedded template renders every turn alike whatever follows (reasoning
    included), so the samples of a conversation that ends with an assistant turn collapse into the whole
    conversation: same bytes as turns=last. (Templates that drop earlier reasoning: tests/test_real_templates.py.)"""
    corpus = write_jsonl(tmp_path / "c.jsonl", [CHAT, {"messages": CHAT["messages"][:3]}])
    last, each = run(tmp_path / "l", [corpus], qwen35_dir), run(tmp_path / "e", [corpus], qwen35_dir, turns="each")
    assert [(s, i.tolist(), m.tolist()) for s, i, m in all_docs(last)] == \
        [(s, i.tolist(), m.tolist()) for s, i, m in all_docs(each)]
    summary = read_manifest(each)["summary"]
    assert (summary["docs_read"], summary["records_packed"], summary["docs_packed"]) == (2, 2, 2)
    assert summary["chat"]["samples_per_record"] == 1 and summary["chat"]["turns_expanded"] == 0
    assert read_manifest(each)["key"] != read_manifest(last)["key"]


def test_content_beside_given_reasoning_is_kept_as_the_target_wrote_it():
    """A regenerated record whose target wrote `</think>` twice: the reasoning field holds the first block and the
    content starts with the second `</think>`. With thinking=keep that content is what the target generated (and what
    the real Qwen templates render), so it stays verbatim; without a reasoning field the leaked reasoning is split."""
    from collections import Counter

    from dflash_offline.chat import prepare_messages

    twice = {"role": "assistant", "reasoning_content": "dog → rain", "content": "</think>\n\npizza"}
    leaked = {"role": "assistant", "content": "dog → rain\n</think>\n\npizza"}
    (kept,) = prepare_messages([twice], "keep", Counter())
    assert kept["content"] == "</think>\n\npizza" and kept["reasoning_content"] == "dog → rain"
    (split,) = prepare_messages([leaked], "keep", Counter())
    assert split["content"] == "pizza" and split["reasoning_content"] == "dog → rain"
    assert [m["content"] for m in prepare_messages([twice, leaked], "strip", Counter())] == ["pizza", "pizza"]
