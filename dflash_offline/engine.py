"""The engine answerer of `make regen`: any OpenAI-compatible `/v1/chat/completions` server (vLLM, SGLang,
`transformers serve`), through the standard library (urllib + threads).

- `Client.call` sends one request. 429, 5xx, timeouts and connection errors are retried `retries` times with
  exponential backoff (`backoff_s`, doubling, at most 60 s; longer when the server's Retry-After says so); then an
  `EngineError` names the record. A 400 is the server refusing this record (e.g. a prompt longer than its context):
  the record is skipped as `engine_rejected` with the server's words (but `REJECT_LIMIT` refusals before any answer
  fail the run: then the settings are wrong). Any other status fails the run at once (a wrong URL, model name or key
  fails every record alike). `OPENAI_API_KEY`, when set, is sent as the bearer token.
- `Answerer` turns a job into requests, one per turn to generate: the conversation so far, the record's `tools`,
  `max_tokens`, `temperature`, `top_p`, a per-record `seed` when sampling, `chat_template_kwargs.enable_thinking`.
  `engine_message` turns the reply into the assistant message the local path writes: reasoning in
  `reasoning_content` (vLLM's `reasoning` too; a `<think>` block a server without a reasoning parser leaves in
  `content` is split off as the local path does), tool calls the server parsed kept as `tool_calls`, the
  `finish_reason` as the server gives it ("length" = truncated, counted and handled as the local path does).
- `run_jobs` keeps `concurrency` requests in flight over a window of `WINDOW`×concurrency records and hands results
  to `regen.Writer` in input order: the commit point is the local path's. Each answer is also appended to
  `OUT.answers.jsonl` as it arrives; a resume after a kill takes the answers from there instead of asking again (only
  the requests in flight at the kill are sent again). The file is removed when the run completes.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .cache.fsio import atomic_path
from .progress import log
from .regen import Job, Result, Writer, hash_seed, split_reasoning

WINDOW = 16  # records in the window per request in flight: slack for answers that take longer than most
MAX_WAIT_S = 60.0  # longest backoff between two attempts
REJECT_LIMIT = 32  # records the server refuses (HTTP 400) before any answer: then the settings are wrong, not them
CHECK_ATTEMPTS, CHECK_BACKOFF_S, CHECK_TIMEOUT_S = 3, 0.5, 30.0  # the start-up check: seconds, not --retries' minute
COMMIT_EVERY_S = 1.0  # how often finished records at the head of the window are written and committed
RETRYABLE = (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException, ValueError)


class EngineError(ValueError):
    """The engine failed a request for good; the message names the record and what to do."""


class Rejected(Exception):
    """The engine refused this record (HTTP 400)."""


class Unanswered(Exception):
    """Every attempt failed with a retryable error (the last one is the message)."""


class Client:
    """One OpenAI-compatible server: `url` is its base (…/v1), `model` the name it serves the target under."""

    def __init__(self, url: str, model: str, timeout_s: float = 600.0, retries: int = 6, backoff_s: float = 1.0):
        self.url, self.model = url.rstrip("/"), model
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.stop = threading.Event()  # set when the run ends early: retries stop waiting
        self.headers = {"Content-Type": "application/json"}
        if os.environ.get("OPENAI_API_KEY"):
            self.headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"

    def request(self, path: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=self.headers)
        with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
            return json.loads(resp.read())

    def call(self, path: str, body: dict | None, what: str, any_status: bool = False,
             quick: bool = False) -> dict:
        """The JSON reply to one request, retried as the module docstring says (`any_status`: an HTTP error status
        is the empty reply; `quick`: `CHECK_ATTEMPTS` attempts, short waits and timeout); `Unanswered` when every
        attempt failed."""
        last = ""
        retries, backoff = (CHECK_ATTEMPTS - 1, CHECK_BACKOFF_S) if quick else (self.retries, self.backoff_s)
        timeout = min(self.timeout_s, CHECK_TIMEOUT_S) if quick else None
        for attempt in range(retries + 1):
            wait = min(MAX_WAIT_S, backoff * 2 ** attempt) * (1 + 0.1 * random.random())
            try:
                return self.request(path, body, timeout)
            except urllib.error.HTTPError as e:
                text = e.read()[:600].decode("utf-8", "replace").strip()
                if any_status:
                    return {}
                if e.code == 400:
                    raise Rejected(text) from None
                if e.code != 429 and e.code < 500:
                    raise EngineError(f"{what}: {self.url}{path} answered HTTP {e.code}: {text}. Check --engine (the "
                                      f"base URL, ending in /v1), --model (the name the server serves: GET "
                                      f"{self.url}/models lists them) and OPENAI_API_KEY") from None
                last = f"HTTP {e.code} {text[:200]}"
                wait = max(wait, min(MAX_WAIT_S, retry_after(e.headers.get("Retry-After"))))
            except RETRYABLE as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < retries and self.stop.wait(wait):
                break
        n = retries + 1
        raise Unanswered(f"the engine at {self.url} failed {n} attempt{'s' * (n > 1)} (last: {last})")

    def check(self) -> None:
        """Fail in seconds, before the corpus is read, when nothing answers at the URL (`CHECK_ATTEMPTS` quick
        attempts, not the records' retries), or the server lists other models."""
        try:
            reply = self.call("/models", None, "GET /models", any_status=True, quick=True)
        except Unanswered as e:
            if "timed out" in str(e).lower() or "Timeout" in str(e):  # (something listens but does not answer)
                raise EngineError(f"the server at {self.url} did not answer GET /models within "
                                  f"{min(self.timeout_s, CHECK_TIMEOUT_S):g} s: {e}. If it is still loading the model, "
                                  f"rerun once it reports being ready; else check --engine (ENGINE=)") from None
            raise EngineError(f"no server answers: {e}. Start it and wait until it reports being ready (docs/data.md, "
                              f"'At scale: a serving engine'), or fix --engine (ENGINE=)") from None
        data = reply.get("data") if isinstance(reply, dict) else None  # (transformers serve has no usable list)
        served = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if served and self.model not in served:
            raise EngineError(f"the engine at {self.url} serves {served}, not --model={self.model!r}: pass one of them")


def retry_after(value: str | None) -> float:
    try:
        return float(value) if value else 0.0
    except ValueError:
        return 0.0  # (an HTTP date: the backoff decides)


def wire(msg: dict) -> dict:
    """A message as the chat API takes it: tool-call arguments as JSON strings."""
    if not msg.get("tool_calls"):
        return msg
    calls = [{**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                                if isinstance(c["function"]["arguments"], str)
                                else json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
             for c in msg["tool_calls"]]
    return {**msg, "tool_calls": calls}


def engine_message(msg: dict, thinking: bool) -> dict:
    """The assistant message of a chat-completion reply, shaped as the local path writes it."""
    content = msg.get("content") or ""
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if reasoning:
        reasoning, content = reasoning.strip(), content.lstrip("\n")
    else:  # no reasoning parser on the server: the think block is in the text
        content, reasoning = split_reasoning(content, thinking and "</think>" in content)
    out = {"role": "assistant", "content": content}
    if reasoning:
        out["reasoning_content"] = reasoning
    if msg.get("tool_calls"):
        out["tool_calls"] = [{k: c[k] for k in ("id", "type", "function") if k in c} for c in msg["tool_calls"]]
    return out


class Answerer:
    """A job → its `Result`, one request per turn to generate (called from the worker threads)."""

    def __init__(self, client: Client, max_new_tokens: int, thinking: bool, keep: str, on_truncated: str,
                 on_empty: str, settings: str, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 template_kwargs: dict | None = None):
        self.client, self.settings, self.keep = client, settings, keep
        self.template_kwargs = template_kwargs or {}
        self.max_new_tokens, self.thinking, self.temperature, self.top_p, self.seed = (
            max_new_tokens, thinking, temperature, top_p, seed)
        self.on_truncated, self.on_empty = on_truncated, on_empty
        self.lock, self.answered, self.refused = threading.Lock(), 0, 0

    def body(self, job: Job, k: int) -> dict:
        body = {"model": self.client.model, "messages": [wire(m) for m in job.history],
                "max_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "chat_template_kwargs": {"enable_thinking": self.thinking, **self.template_kwargs}}
        if isinstance(job.obj.get("tools"), list) and job.obj["tools"]:
            body["tools"] = job.obj["tools"]
        if self.temperature > 0:
            body["seed"] = hash_seed(self.seed, job.index, k) >> 32  # (31 bits: what every server takes)
        return body

    def __call__(self, job: Job) -> Result:
        for k in range(len(job.turns)):
            job.next_turn(k)
            try:
                reply = self.client.call("/chat/completions", self.body(job, k), job.source)
            except Unanswered as e:
                raise EngineError(f"{job.source}: {e}. Records written so far are committed: rerun the same command, "
                                  f"once the server answers, to resume (--retries, --timeout_s to wait longer)") from None
            except Rejected as e:
                self.rejected(job, str(e)[:300])
                break
            try:
                choice, usage = reply["choices"][0], reply.get("usage") or {}
                msg = engine_message(choice["message"], self.thinking)
            except (KeyError, IndexError, TypeError, AttributeError):
                raise EngineError(f"{job.source}: the engine's reply is not a chat completion: "
                                  f"{json.dumps(reply)[:300]}") from None
            job.add_turn(msg, choice.get("finish_reason") or "stop", int(usage.get("completion_tokens") or 0),
                         int(usage.get("prompt_tokens") or 0), self.on_truncated, self.on_empty)
            with self.lock:
                self.answered += 1
            if job.dropped:
                break
        return job.result(self.keep, self.settings)

    def rejected(self, job: Job, text: str) -> None:
        """Skip the record; a server that refuses the first `REJECT_LIMIT` records and answers none is an error."""
        job.skip("engine_rejected", text)
        with self.lock:
            self.refused += 1
            if self.refused >= REJECT_LIMIT and not self.answered:
                raise EngineError(f"the engine at {self.client.url} refused the first {self.refused} records (HTTP "
                                  f"400), e.g. {job.source}: {text}. Check --max_new_tokens against the server's "
                                  f"context (vLLM --max-model-len) and --model")


class Journal:
    """`OUT.answers.jsonl`: every answer as it arrives (a `Result` a line, flushed); read back by a resume."""

    def __init__(self, path: Path, settings: str, start: int):
        self.path, self.settings, self.lock, self.lines = path, settings, threading.Lock(), 0
        self.kept: dict[int, Result] = {}  # answers from an earlier run, not yet in OUT
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    d = json.loads(line)
                    r = Result(d["index"], d["record"], d["counts"], d["skips"])
                except (ValueError, KeyError, TypeError):
                    continue  # (a line cut by a kill)
                if d.get("settings") == settings and r.index >= start:
                    self.kept[r.index] = r
            if self.kept:
                log(f"{path}: {len(self.kept)} answers received before the interruption are reused")
        self.rewrite(lambda: list(self.kept.values()))

    def take(self, index: int) -> Result | None:
        return self.kept.pop(index, None)

    def add(self, fut: Future) -> None:
        """A done-callback: append the answer (worker threads; a failed request leaves nothing)."""
        if fut.cancelled() or fut.exception() is not None:
            return
        with self.lock:
            self.f.write(json.dumps({"settings": self.settings, **fut.result().to_json()}, ensure_ascii=False) + "\n")
            self.f.flush()
            self.lines += 1

    def rewrite(self, live) -> None:
        """Start the file over with only the answers `live()` lists, those not yet in OUT (keeps it small)."""
        with self.lock:
            live = live()
            if getattr(self, "f", None):
                self.f.close()
            with atomic_path(self.path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                for r in live:
                    f.write(json.dumps({"settings": self.settings, **r.to_json()}, ensure_ascii=False) + "\n")
            self.f, self.lines = open(self.path, "a", encoding="utf-8"), len(live)

    def close(self, remove: bool) -> None:
        self.f.close()
        if remove:
            self.path.unlink(missing_ok=True)


def run_jobs(items: Iterator, answer: Answerer, writer: Writer, concurrency: int, journal: Journal,
             progress=None) -> None:
    """Answer every job of `items` with up to `concurrency` requests in flight; write everything in input order."""
    window: deque = deque()  # Future (a job being answered) | Result | Skipped | Heldout, in input order
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="engine")
    last = time.monotonic()
    try:
        for e in items:
            if isinstance(e, Job):
                e = journal.take(e.index) or submit(pool, answer, e, journal)
            window.append(e)
            if len(window) >= WINDOW * concurrency or time.monotonic() - last >= COMMIT_EVERY_S:
                flush(window, writer, journal, progress, wait=len(window) >= WINDOW * concurrency)
                last = time.monotonic()
        while window:
            flush(window, writer, journal, progress, wait=True)
    except BaseException as e:
        answer.client.stop.set()  # no more retries; after an error, the answers in flight still reach the journal
        pool.shutdown(wait=isinstance(e, Exception), cancel_futures=True)
        raise
    pool.shutdown()
    journal.close(remove=True)


def submit(pool: ThreadPoolExecutor, answer: Answerer, job: Job, journal: Journal) -> Future:
    fut = pool.submit(answer, job)
    fut.add_done_callback(journal.add)
    return fut


def flush(window: deque, writer: Writer, journal: Journal, progress, wait: bool) -> None:
    """Write the finished entries at the head of the window (`wait`: at least one, waiting for it). A job that
    failed raises its error once the entries before it are written and committed."""
    ready, error = [], None
    while window and (not isinstance(window[0], Future) or window[0].done() or (wait and not ready)):
        head = window.popleft()
        try:
            ready.append(head.result() if isinstance(head, Future) else head)
        except Exception as e:
            error = e
            break
    if ready:
        n, tokens = writer.put(ready)
        if progress is not None:
            progress.update(n, tokens=tokens)
    if error is not None:
        raise error
    if journal.lines > max(1000, 2 * len(window)):
        journal.rewrite(lambda: [e.result() if isinstance(e, Future) else e for e in window
                                 if isinstance(e, Result) or isinstance(e, Future) and e.done() and not e.exception()]
                        + list(journal.kept.values()))
