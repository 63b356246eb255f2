"""make regen through an OpenAI-compatible server, tested against a real one: `transformers serve` with the tiny Qwen3
target on a loopback port, and in front of it a small proxy written here (http.server) that records every request
and can fail, refuse or hold some. The answers are the server's, the records the local path's; a resume after a kill
asks no answered prompt again; retries back off; a server that keeps failing gives a clear error and loses nothing."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from dflash_offline import engine, regenrun
from dflash_offline.chat import validate_messages
from dflash_offline.engine import engine_message

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import executable, free_port, serve, stop  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NEW = 6  # tokens per answer: the tiny target is random, so most answers hit the budget (finish "length")
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    """`transformers serve` on 127.0.0.1 (a free port) serving the tiny Qwen3 target in float32 on the CPU: (its base
    URL, the model name it serves). Ready when /health answers (at most 120 s); stopped after the module."""
    if executable() is None:
        if os.environ.get("CI"):
            raise RuntimeError("transformers[serving] is not installed: make setup (pip install -e '.[dev]')")
        pytest.skip("transformers[serving] is not installed: make setup (pip install -e '.[dev]')")
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    proc = serve(qwen3_dir, port, log, {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    try:
        yield f"http://127.0.0.1:{port}/v1", str(qwen3_dir)
    finally:
        stop(proc)


class Proxy:
    """A real HTTP server on a loopback port in front of `upstream`. It records each chat request (`bodies`, and
    `log`: its last message's text and the status returned); the next `fail` requests get a 503, and so do the
    prompts in `down`; a prompt
    containing `reject` a 400, and one containing `hold` waits until `release()`, then gets a 503 (a request that was
    in flight when its client died: never answered); `models` set, it answers GET /v1/models with those."""

    def __init__(self, upstream: str):
        self.upstream, self.bodies, self.log, self.lock = upstream, [], [], threading.Lock()
        self.fail, self.down, self.reject, self.hold, self.released = 0, set(), None, None, threading.Event()
        self.models = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if proxy.models is not None and self.path == "/v1/models":
                    self.reply(200, json.dumps({"data": [{"id": m} for m in proxy.models]}).encode())
                else:
                    self.reply(*proxy.forward(self.path, None))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.reply(*proxy.chat(self.path, body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def forward(self, path: str, body: dict | None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.upstream + path.removeprefix("/v1"), data,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def chat(self, path: str, body: dict) -> tuple[int, bytes]:
        key = body["messages"][-1]["content"]
        with self.lock:
            self.bodies.append(body)
            failing = self.fail > 0 or key in self.down
            self.fail -= self.fail > 0
        if self.hold and self.hold in key:
            self.released.wait(60)
            status, data = 503, b'{"error": "dropped"}'
        elif failing:
            status, data = 503, b'{"error": "overloaded"}'
        elif self.reject is not None and self.reject in key:
            status, data = 400, b'{"error": "prompt too long for this server"}'
        else:
            status, data = self.forward(path, body)
        with self.lock:
            self.log.append((key, status))
        return status, data

    def answered(self) -> Counter:
        return Counter(key for key, status in self.log if status == 200)


@pytest.fixture
def proxy(server):
    p = Proxy(server[0])
    yield p
    p.released.set()
    p.httpd.shutdown()


def prompts_file(path: Path, chat_corpus, n: int) -> tuple[Path, list[dict]]:
    """The first `n` records of the corpus cut before their first assistant turn (prompts, as users bring them);
    the second one offers `tools`."""
    prompts = []
    for line in Path(chat_corpus).read_text().splitlines()[:n]:
        msgs = json.loads(line)["messages"]
        prompts.append({"messages": msgs[:next(i for i, m in enumerate(msgs) if m["role"] == "assistant")]})
    prompts[1]["tools"] = TOOLS
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path, prompts


def go(server, corpus, out, url=None, **kw):
    kw = {"max_new_tokens": NEW, "thinking": "off", "concurrency": 3, "backoff_s": 0.05, "retries": 3,
          "progress": False, **kw}
    return regenrun.run(regenrun.RegenConfig(corpus=[str(corpus)], out=str(out), engine=url or server[0],
                                             model=server[1], **kw))


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(server, chat_corpus, tmp_path_factory):
    """8 prompts answered through the server directly, in one uninterrupted run: (prompts file, prompts, records)."""
    d = tmp_path_factory.mktemp("reference")
    corpus, prompts = prompts_file(d / "prompts.jsonl", chat_corpus, 8)
    go(server, corpus, d / "ref.jsonl")
    return corpus, prompts, read(d / "ref.jsonl")


def test_prompts_get_the_servers_answers_in_the_local_paths_records(server, proxy, reference, qwen3_dir, tmp_path):
    """Each prompt gets one answer: the one the server gives the same chat, asked with the settings (thinking,
    max_tokens, temperature, top_p, the record's tools); the record is the local path's (same keys, same prompt
    turns, same greedy answer up to the whitespace the server's response parser trims, same finish reasons)."""
    corpus, prompts, ref = reference
    st = go(server, corpus, tmp_path / "e.jsonl", proxy.url)
    out = read(tmp_path / "e.jsonl")
    assert out == ref and len(out) == st["written"] == 8 and not Path(f"{tmp_path}/e.jsonl.answers.jsonl").exists()
    assert st["truncated"] == sum(r["regen"]["finish_reason"] == ["length"] for r in out) > 0
    for rec, prompt in zip(out, prompts, strict=True):
        assert rec["messages"][:-1] == prompt["messages"] and rec.get("tools") == prompt.get("tools")
        direct = post(f"{server[0]}/chat/completions", {
            "model": server[1], "messages": prompt["messages"], "max_tokens": NEW, "temperature": 0,
            **({"tools": prompt["tools"]} if "tools" in prompt else {}),
            "chat_template_kwargs": {"enable_thinking": False}})["choices"][0]
        assert rec["messages"][-1] == engine_message(direct["message"], False)
        assert rec["regen"]["finish_reason"] == [direct["finish_reason"]]
    sent = {b["messages"][-1]["content"]: b for b in proxy.bodies}
    assert len(sent) == 8 and all(b["chat_template_kwargs"] == {"enable_thinking": False} and b["max_tokens"] == NEW
                                  and b["temperature"] == 0 and b["top_p"] == 1 for b in sent.values())
    assert [("tools" in sent[p["messages"][-1]["content"]]) for p in prompts] == [False, True] + [False] * 6
    # the local path on the same prompts: the same records but for the settings digest (another dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    regenrun.run(regenrun.RegenConfig(corpus=[str(corpus)], target=str(qwen3_dir), out=str(tmp_path / "l.jsonl"),
                                      max_new_tokens=NEW, thinking="off", progress=False),
                 model, AutoTokenizer.from_pretrained(qwen3_dir))
    for e, loc in zip(out, read(tmp_path / "l.jsonl"), strict=True):
        assert e.keys() == loc.keys() and e["regen"].keys() == loc["regen"].keys()
        assert e["messages"][:-1] == loc["messages"][:-1] and e["messages"][-1].keys() == loc["messages"][-1].keys()
        assert e["messages"][-1]["content"] == loc["messages"][-1]["content"].strip()
        assert {k: v for k, v in e["regen"].items() if k != "settings"} == {
            k: v for k, v in loc["regen"].items() if k != "settings"}


def test_every_turn_and_sampling_settings_reach_the_server(server, proxy, chat_corpus, tmp_path):
    """keep=all_turns: one request per assistant turn, each with the regenerated turns before it (tool calls as the
    API takes them), the tool results kept; thinking on and the other template settings (Qwen3.8's reasoning effort);
    sampling with a seed per record and turn."""
    conv = json.loads(Path(chat_corpus).read_text().splitlines()[6])
    assert any(m.get("tool_calls") for m in conv["messages"])
    (tmp_path / "c.jsonl").write_text(json.dumps(conv) + "\n")
    kw = {"keep": "all_turns", "thinking": "on", "temperature": 0.8, "top_p": 0.9, "seed": 5, "on_empty": "keep",
          "template_kwargs": '{"reasoning_effort": "low"}'}
    go(server, tmp_path / "c.jsonl", tmp_path / "o.jsonl", proxy.url, **kw)
    (rec,) = read(tmp_path / "o.jsonl")
    assert [m["role"] for m in rec["messages"]] == [m["role"] for m in conv["messages"]]
    turns = [i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant"]
    assert len(proxy.bodies) == len(turns) == len(rec["regen"]["finish_reason"])
    for k, (body, t) in enumerate(zip(proxy.bodies, turns, strict=True)):
        assert len(body["messages"]) == t and body["messages"][-1]["role"] != "assistant"
        assert [m["content"] for m in body["messages"] if m["role"] == "assistant"] == [
            rec["messages"][i]["content"] for i in turns[:k]]  # the regenerated turns, not the corpus's
        assert body["chat_template_kwargs"] == {"enable_thinking": True, "reasoning_effort": "low"}
        assert (body["temperature"], body["top_p"]) == (0.8, 0.9) and isinstance(body["seed"], int)
    assert len({b["seed"] for b in proxy.bodies}) == len(turns)
    assert [m for m in rec["messages"] if m["role"] != "assistant"] == [
        m for m in conv["messages"] if m["role"] != "assistant"]


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_resume_after_a_kill_asks_no_answered_prompt_again(server, proxy, reference, tmp_path, sig):
    """The run is killed (SIGKILL) or stopped (SIGTERM: one line, exit 143, without waiting for the request in
    flight) while the 3rd prompt's request hangs and the later ones were answered: a rerun of the same command sends
    only the 3rd again (the answers that came ahead of their turn were kept), and the output equals an uninterrupted
    run's."""
    corpus, prompts, ref = reference
    out = tmp_path / "k.jsonl"
    proxy.hold = prompts[2]["messages"][-1]["content"]
    cmd = [sys.executable, "-m", "stages.regen", f"--engine={proxy.url}", f"--model={server[1]}", f"--corpus={corpus}",
           f"--out={out}", f"--max_new_tokens={NEW}", "--thinking=off", "--concurrency=3", "--progress=0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    journal, deadline = Path(f"{out}.answers.jsonl"), time.monotonic() + 60
    while not (journal.exists() and journal.read_text().count("\n") == 7):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
        time.sleep(0.1)
    proc.send_signal(getattr(signal, sig))
    said = proc.communicate(timeout=30)[0].decode()  # (SIGTERM: the request held by the server is not waited for)
    if sig == "SIGTERM":
        assert proc.returncode == 143 and "Traceback" not in said, said[-2000:]
        assert said.strip().splitlines()[-1] == "stopped on SIGTERM: nothing it committed is lost; rerun the same command"
    proxy.released.set()  # the held request dies unanswered, as it would with its client gone
    st = json.loads(Path(f"{out}.stats.json").read_text())
    assert st["written"] == len(read(out)) <= 2 and not st["complete"]
    proxy.hold = None
    go(server, corpus, out, proxy.url)
    assert read(out) == ref and not journal.exists()
    assert proxy.answered() == Counter(p["messages"][-1]["content"] for p in prompts)  # each answered once


def test_retries_back_off_and_a_server_that_keeps_failing_loses_nothing(server, proxy, reference, tmp_path):
    """Two 503s are retried (backoff) and the run completes; a server that answers the first 2 prompts and only 503s
    to the others stops the run with an error naming the first failed record, the attempts and the fix, with the 2
    answers written and committed; the rerun completes without asking for them again. A 400 skips that record,
    counted."""
    corpus, prompts, ref = reference
    proxy.fail = 2
    go(server, corpus, tmp_path / "r.jsonl", proxy.url, concurrency=1, num_docs=3)
    assert read(tmp_path / "r.jsonl") == ref[:3] and [s for _, s in proxy.log[:3]] == [503, 503, 200]
    proxy.log.clear()
    out = tmp_path / "f.jsonl"
    proxy.down = {p["messages"][-1]["content"] for p in prompts[2:]}
    with pytest.raises(ValueError, match=rf"{corpus}:3: the engine at {proxy.url} failed 1 attempt \(last: HTTP 503.*"
                                         rf"Records written so far are committed: rerun the same command"):
        go(server, corpus, out, proxy.url, retries=0)
    assert read(out) == ref[:2] and json.loads(Path(f"{out}.stats.json").read_text())["written"] == 2
    proxy.down = set()
    go(server, corpus, out, proxy.url)
    assert read(out) == ref and set(proxy.answered().values()) == {1}
    proxy.reject = prompts[1]["messages"][-1]["content"]
    st = go(server, corpus, tmp_path / "x.jsonl", proxy.url, num_docs=3)
    assert st["skipped"] == {"engine_rejected": 1} and "prompt too long for this server" in st["skip_examples"][0]
    assert read(tmp_path / "x.jsonl") == [ref[0], ref[2]]


def test_a_corpus_with_no_usable_record_exits_nonzero_and_writes_nothing(server, proxy, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user"\n' + json.dumps({"messages": [{"role": "system", "content": "x"}]})
                   + "\n")
    out = tmp_path / "o.jsonl"
    res = subprocess.run([sys.executable, "-m", "stages.regen", f"--engine={proxy.url}", f"--model={server[1]}",
                          f"--corpus={bad}", f"--out={out}", "--progress=0"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no usable record" in res.stderr and "skipped: invalid_json 1, no_prompt 1" in res.stderr
    assert f"{bad}:1: invalid_json" in res.stderr and f"{bad}:2: no_prompt" in res.stderr
    assert list(tmp_path.iterdir()) == [bad] and proxy.bodies == []


def test_wrong_engine_settings_fail_early_with_the_fix(server, proxy, reference, tmp_path, monkeypatch):
    """Nothing listening at --engine, or a server that lists other models: an error before any record is read; a
    server that refuses (HTTP 400) every one of the first records: an error naming one and what to check."""
    corpus, prompts, _ = reference
    with pytest.raises(ValueError, match=r"engine=http://h:1/v1: pass --model=NAME \(MODEL= in make\)"):
        regenrun.RegenConfig(corpus=[str(corpus)], engine="http://h:1/v1").resolve()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    # (the start-up check makes engine.CHECK_ATTEMPTS quick attempts, not the records' 7: seconds, not a minute)
    with pytest.raises(ValueError, match=r"no server answers: the engine at .* failed 3 attempts \(last: URLError.*"
                                         r"Start it .* or fix --engine"):
        go(server, corpus, tmp_path / "a.jsonl", closed, retries=6)
    # something listening that does not answer (a server still loading): said so, not "no server answers"
    monkeypatch.setattr(engine, "CHECK_TIMEOUT_S", 0.3)
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        with pytest.raises(ValueError, match=r"did not answer GET /models within 0.3 s: .*still loading"):
            go(server, corpus, tmp_path / "a.jsonl", f"http://127.0.0.1:{mute.getsockname()[1]}/v1")
    proxy.models = ["Qwen/Qwen3-8B"]
    with pytest.raises(ValueError, match=r"serves \['Qwen/Qwen3-8B'\], not --model='.*qwen3': pass one of them"):
        go(server, corpus, tmp_path / "b.jsonl", proxy.url)
    assert list(tmp_path.iterdir()) == [] and proxy.bodies == []
    proxy.models, proxy.reject = None, ""  # (every prompt)
    monkeypatch.setattr(engine, "REJECT_LIMIT", 3)
    with pytest.raises(ValueError, match=rf"refused the first 3 records \(HTTP 400\), e.g. {corpus}:3: .*prompt too "
                                         rf"long for this server.*\. Check --max_new_tokens"):
        go(server, corpus, tmp_path / "c.jsonl", proxy.url, concurrency=1)


def test_engine_replies_become_the_messages_the_local_path_writes():
    """Reasoning (vLLM/SGLang `reasoning_content`, newer vLLM `reasoning`, or a `<think>` block left in the text by
    a server without a reasoning parser) goes to `reasoning_content`; parsed tool calls stay `tool_calls`, which
    stage 1a reads (arguments as a JSON string, as the API returns them)."""
    assert engine_message({"content": "\n\nAnswer", "reasoning_content": "\nplan\n"}, True) == {
        "role": "assistant", "content": "Answer", "reasoning_content": "plan"}
    assert engine_message({"content": "A", "reasoning": "r"}, True)["reasoning_content"] == "r"
    for text in ("<think>\nplan\n</think>\n\nAnswer", "plan\n</think>\n\nAnswer"):
        assert engine_message({"content": text}, True) == {"role": "assistant", "content": "Answer",
                                                          "reasoning_content": "plan"}
    assert engine_message({"content": "Close it with </think>."}, False) == {"role": "assistant",
                                                                           "content": "Close it with </think>."}
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    msg = engine_message({"content": None, "tool_calls": [call]}, False)
    assert msg == {"role": "assistant", "content": "", "tool_calls": [call]}
    (_, parsed) = validate_messages({"messages": [{"role": "user", "content": "Weather?"}, msg]})
    assert parsed["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
