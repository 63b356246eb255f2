"""The bundled demo corpus: deterministic, every feature present, valid records, learnable answers."""

import json
import re
import statistics

import pytest

from fixtures import democorpus


@pytest.fixture(scope="module")
def records():
    return list(democorpus.generate(600, seed=0))


def test_deterministic_and_seeded():
    a = list(democorpus.generate(40, seed=7))
    assert a == list(democorpus.generate(40, seed=7))
    assert a[:25] == list(democorpus.generate(25, seed=7))  # prefix-stable: doc i does not depend on n_docs
    assert a != list(democorpus.generate(40, seed=8))
    # pinned content: a change of the generator (even on another platform) must be deliberate
    assert a[0]["messages"][:2] == [
        {"role": "system", "content": "You are a friendly assistant 🙂 who loves numbers and words."},
        {"role": "user", "content": "What is 127 + 270?"},
    ]


def test_every_record_valid(records):
    for i, rec in enumerate(records):
        democorpus.validate_record(rec, where=f"record {i}")
        assert json.loads(json.dumps(rec, ensure_ascii=False)) == rec


def test_has_all_features(records):
    c = democorpus.feature_counts(records)
    n = c["records"]
    assert n == 600
    assert 0.25 * n < c["system"] < 0.55 * n
    assert 0.2 * n < c["reasoning"] < 0.5 * n
    assert 0.1 * n < c["tool"] < 0.5 * n
    assert c["non_ascii"] > 0.5 * n and c["cjk"] > 0.05 * n and c["emoji"] > 0.05 * n
    assert c["multi_turn"] > 0.5 * n
    n_exchanges = [sum(m["role"] == "user" for m in r["messages"]) for r in records]
    assert min(n_exchanges) == 1 and max(n_exchanges) == 4


def test_tool_exchanges_are_well_formed(records):
    seen = 0
    for rec in records:
        msgs = rec["messages"]
        for j, m in enumerate(msgs):
            if m["role"] != "tool":
                continue
            seen += 1
            call = msgs[j - 1]
            assert call["role"] == "assistant" and call["tool_calls"][0]["function"]["name"] == m["name"]
            assert isinstance(json.loads(m["content"]), dict)
            assert msgs[j + 1]["role"] == "assistant" and msgs[j + 1]["content"]
    assert seen > 50


def test_answers_are_functions_of_prompts():
    answer_of = {}
    for rec in democorpus.generate(3000, seed=1):
        msgs = rec["messages"]
        for j, m in enumerate(msgs[:-1]):
            reply = msgs[j + 1]
            if m["role"] == "user" and reply["role"] == "assistant" and not reply.get("tool_calls"):
                key = (m["content"], "reasoning_content" in reply)
                assert answer_of.setdefault(key, reply["content"]) == reply["content"], key
                add = re.fullmatch(r"What is (\d+) \+ (\d+)\?", m["content"])
                if add:
                    assert reply["content"].endswith(f"= {int(add[1]) + int(add[2])}.")
    assert len(answer_of) > 1000


def test_number_to_words():
    assert democorpus.number_to_words(0) == "zero"
    assert democorpus.number_to_words(15) == "fifteen"
    assert democorpus.number_to_words(40) == "forty"
    assert democorpus.number_to_words(347) == "three hundred forty-seven"
    assert democorpus.number_to_words(90210) == "ninety thousand two hundred ten"
    assert democorpus.number_to_words(100000) == "one hundred thousand"
    with pytest.raises(ValueError):
        democorpus.number_to_words(10**6)


def test_write_jsonl_utf8(tmp_path):
    path = democorpus.write_jsonl(tmp_path / "sub" / "demo.jsonl", 50, seed=0)
    raw = path.read_bytes().decode("utf-8")
    lines = raw.splitlines()
    assert len(lines) == 50 and raw.endswith("\n")
    assert [json.loads(line) for line in lines] == list(democorpus.generate(50, seed=0))
    assert not raw.isascii() and "\\u" not in raw  # non-ASCII written raw, not escaped
    assert not list(tmp_path.glob("sub/*.tmp"))


def test_validate_record_rejects_bad_records():
    bad = [
        {},
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "{}"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]},
    ]
    for rec in bad:
        with pytest.raises(ValueError, match="line 3"):
            democorpus.validate_record(rec, where="line 3")


def test_longtail_lengths():
    docs = list(democorpus.generate_longtail(800, seed=0))
    assert docs[:10] == list(democorpus.generate_longtail(10, seed=0))
    for d in docs:
        democorpus.validate_record(d)
    chars = [len(democorpus.record_text(d)) for d in docs]
    words = [len(democorpus.record_text(d).split()) for d in docs]
    # median ~400 tokens at 1.5 tokens/word -> ~267 words; long tail: some > 4000 chars, a few > 4x median
    assert 200 < statistics.median(words) < 340
    assert sum(c > 4000 for c in chars) > 0.05 * len(docs)
    assert max(chars) > 10 * statistics.median(chars)


def test_corpus_texts():
    texts = list(democorpus.corpus_texts(100, seed=0))
    assert len(texts) == 110 and all(isinstance(t, str) and t for t in texts)
    assert texts == list(democorpus.corpus_texts(100, seed=0))
