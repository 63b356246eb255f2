"""Stage 1a throughput per core with a real tokenizer: records/s and tokens/s of one tokenizer process.

    python -m bench.tokenize --tokenizer=build/fixtures/qwen3 [--records=2000] [--group=8] [--turns=last|each]
        [--thinking=keep|strip] [--out=FILE.json]          (make fixtures builds the real tokenizers)

What one worker does, timed after its tokenizer is loaded: parse, validate, render every sample with the chat
template, locate the supervised spans, encode each chunk in one batched call, build the masks
(`corpus.process_chunk`). Stage 1a runs one such process per core and scales with them (records are independent);
packing and shard writes happen in the parent, off the workers' path.

Corpus: the bundled demo corpus (`democorpus`, deterministic) in the shapes a serving engine returns: `--group`
consecutive records joined into one multi-turn conversation, tool calls in OpenAI format with JSON-*string*
`arguments` and an `id`, `tool` messages with `tool_call_id`, a record-level `tools` list, reasoning in
`reasoning_content`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

from dflash_offline import corpus
from fixtures import democorpus

TOOLS = {
    "calculator": {"expression": "An arithmetic expression"},
    "lookup_capital": {"country": "A country name"},
    "convert_units": {"value": "The amount", "from": "Source unit", "to": "Target unit"},
}


def openai_record(group: list[dict], index: int) -> dict:
    """Records joined into one conversation, with tool calls and results as the OpenAI API returns them."""
    msgs, used = [], set()
    for rec in group:
        for m in rec["messages"]:
            if m["role"] == "system" and msgs:
                continue
            m = dict(m)
            if m.get("tool_calls"):
                m["content"] = m["content"] or None
                m["tool_calls"] = [{"id": f"call_{index}_{len(msgs)}_{k}", "type": "function",
                                    "function": {"name": c["function"]["name"],
                                                 "arguments": json.dumps(c["function"]["arguments"],
                                                                         ensure_ascii=False)}}
                                   for k, c in enumerate(m["tool_calls"])]
                used.update(c["function"]["name"] for c in m["tool_calls"])
            if m["role"] == "tool":
                m["tool_call_id"] = msgs[-1]["tool_calls"][0]["id"]
            msgs.append(m)
    out = {"messages": msgs}
    if used:
        out["tools"] = [{"type": "function", "function": {
            "name": name, "description": f"The {name.replace('_', ' ')} tool.",
            "parameters": {"type": "object", "properties": {k: {"type": "string", "description": d}
                                                            for k, d in TOOLS[name].items()},
                           "required": list(TOOLS[name])}}} for name in sorted(used)]
    return out


def write_corpus(path: Path, records: int, group: int) -> Path:
    demo = list(democorpus.generate(records * group, seed=7))
    with open(path, "w", encoding="utf-8") as f:
        for i in range(records):
            f.write(json.dumps(openai_record(demo[i * group : (i + 1) * group], i), ensure_ascii=False) + "\n")
    return path


def measure(tokenizer: str, path: Path, opts: dict, chunk_docs: int) -> dict:
    corpus._init_worker(tokenizer, opts)
    records = list(corpus.iter_records([path]))
    t0 = time.perf_counter()
    results = [r for i in range(0, len(records), chunk_docs) for r in corpus.process_chunk(records[i : i + chunk_docs])]
    seconds = time.perf_counter() - t0
    docs = [d for r in results if isinstance(r, corpus.Tokens) for d in r.docs]
    tokens = sum(len(ids) for ids, _ in docs)
    skipped = Counter(r.reason for r in results if isinstance(r, corpus.Skip))
    return {"records": len(records), "samples": len(docs), "tokens": tokens,
            "supervised_tokens": int(sum(m.sum() for _, m in docs)), "tokens_per_record": tokens / len(records),
            "seconds": seconds, "records_per_s": len(records) / seconds, "tokens_per_s": tokens / seconds,
            "skipped": dict(skipped), "load_1min": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (e.g. build/fixtures/qwen3.6)")
    p.add_argument("--records", type=int, default=2000)
    p.add_argument("--group", type=int, default=8, help="demo records joined into one conversation")
    p.add_argument("--turns", default="last", choices=("last", "each"))
    p.add_argument("--thinking", default="keep", choices=("keep", "strip"))
    p.add_argument("--chunk_docs", type=int, default=256)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_corpus(Path(tmp) / "bench.jsonl", a.records, a.group)
        opts = {"thinking": a.thinking, "turns": a.turns, "empty_think": "prompt", "vocab_size": 1 << 31}
        res = dict(measure(a.tokenizer, path, opts, a.chunk_docs), tokenizer=a.tokenizer, group=a.group,
                   turns=a.turns, thinking=a.thinking)
    print(f"{Path(a.tokenizer).name}: {res['records']} records ({res['tokens_per_record']:.0f} tokens each, "
          f"{res['samples']} samples), {res['seconds']:.1f} s on one core: {res['records_per_s']:,.0f} records/s, "
          f"{res['tokens_per_s']:,.0f} tokens/s; 1B tokens on 64 such cores: "
          f"{1e9 / (64 * res['tokens_per_s']) / 60:.1f} min (load average {res['load_1min']:.1f})")
    if res["skipped"]:
        print(f"skipped: {res['skipped']}")
    if a.out:
        a.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
