"""One regeneration run (`stages/regen.py` is its command line): its config (`RegenConfig`: checked, defaults
resolved), the settings the stats record and a resume checks (`config_record`), and the run (`run`): everything cheap
checked before any weight loads or request is sent, then the corpus streamed through one of two answerers — a
server (`engine`) or the target here (`regen_local.Regenerator`) — into the resumable output (`regen.Writer`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from dflash_offline import engine, runguard
from dflash_offline.chat import parse_settings
from dflash_offline.corpus import check_not_heldout, check_tokenizer, expand_paths, hash_and_count
from dflash_offline.devices import check_setting, pick_device
from dflash_offline.progress import Progress, log
from dflash_offline.regen import (
    Job,
    Writer,
    batches,
    check_first_records,
    check_usable,
    commit,
    entries,
    resume_state,
    settings_digest,
    stats_path,
    summary,
)
from dflash_offline.regen_local import Regenerator, load_model, pick_dtype
from dflash_offline.targetid import resolve_checkpoint

# --- config --------------------------------------------------------------------------------------------------

TRUNCATED_WARN = 0.25  # share of answers cut at max_new_tokens above which the run warns (a budget set too low)
ENGINE_ONLY = ("model", "concurrency", "timeout_s", "retries", "backoff_s")
LOCAL_ONLY = ("batch_size", "device", "dtype")


@dataclass
class RegenConfig:
    corpus: list[str]  # chat JSONL / Parquet / Arrow files or globs, comma separated: prompts or conversations
    target: str = ""  # checkpoint directory that answers here (transformers); with --engine, the default --model
    out: str = ""  # output JSONL ("" → regen/<target or model name>-thinking_<on|off>.jsonl)
    engine: str = ""  # base URL of an OpenAI-compatible server, e.g. http://host:8000/v1 ("" = answer here)
    model: str = ""  # engine: the model name the server serves ("" = --target)
    concurrency: int = 64  # engine: requests in flight
    timeout_s: float = 600.0  # engine: seconds a request may take before it is retried
    retries: int = 6  # engine: retries of a request after a 429, 5xx, timeout or lost connection
    backoff_s: float = 1.0  # engine: wait before the first retry (doubling, at most 60 s)
    max_new_tokens: int = 2048  # generation budget per assistant turn (the engine's max_tokens)
    batch_size: int = 16  # local: prompts per generate call (left padded)
    thinking: str = "on"  # on | off: `enable_thinking` passed to the chat template
    template_kwargs: str = ""  # other chat template settings, a JSON object, e.g. '{"reasoning_effort": "low"}' (Qwen3.8); give tokenize the same
    num_docs: int = 0  # stop after this many input records (0 = all)
    device: str = "auto"  # local: auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # local: auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32
    keep: str = "first_turn"  # first_turn | all_turns: which assistant turns of a conversation are regenerated
    on_truncated: str = "keep"  # keep | drop a record whose generation hit max_new_tokens without an eos
    on_empty: str = "drop"  # drop | keep a record whose generation is empty
    temperature: float = 0.0  # 0 = greedy; > 0 samples at this temperature (seeded per batch or record)
    top_p: float = 1.0  # nucleus sampling mass (with temperature > 0)
    seed: int = 0  # sampling seed
    heldout_every: int = 0  # hold out 1 record in N (by SHA-256 of its first user turn), unanswered (0 = none)
    heldout_out: str = ""  # held-out records' JSONL ("" → heldout/ beside OUT, under OUT's name: out of a corpus glob)
    progress: bool = True  # show the progress bar

    def resolve(self) -> RegenConfig:
        choices = {"thinking": ("on", "off"), "keep": ("first_turn", "all_turns"),
                   "on_truncated": ("keep", "drop"), "on_empty": ("drop", "keep"),
                   "dtype": ("auto", "bfloat16", "float16", "float32")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {', '.join(allowed)}")
        if "enable_thinking" in parse_settings(self.template_kwargs, "regen.template_kwargs"):
            raise ValueError("regen.template_kwargs: enable_thinking is --thinking=on|off (THINKING= in make)")
        if not self.corpus:
            raise ValueError("no corpus: pass --corpus=FILES (CORPUS= in make; paths and globs, comma separated)")
        if self.engine and not (self.model or self.target):
            raise ValueError(f"engine={self.engine}: pass --model=NAME (MODEL= in make), the name the server serves "
                             f"the target under (GET {self.engine.rstrip('/')}/models lists them)")
        if not self.target and not (self.engine and self.model):
            raise ValueError("nothing answers: pass --target=DIR (TARGET= in make) to answer here, or --engine=URL "
                             "--model=NAME (ENGINE=, MODEL=) for a server")
        if min(self.max_new_tokens, self.batch_size, self.concurrency) < 1 or min(self.num_docs, self.retries) < 0:
            raise ValueError("max_new_tokens, batch_size and concurrency must be >= 1, num_docs and retries >= 0")
        if not (self.temperature >= 0 and 0 < self.top_p <= 1):
            raise ValueError(f"temperature={self.temperature}, top_p={self.top_p}: expected temperature >= 0 (0 = "
                             f"greedy) and 0 < top_p <= 1")
        if self.heldout_every == 1 or self.heldout_every < 0:
            raise ValueError(f"heldout_every={self.heldout_every}: expected 0 (none) or N >= 2 (1 record in N)")
        if self.engine:
            url = urlparse(self.engine)
            if url.scheme not in ("http", "https") or not url.netloc or url.path in ("", "/"):
                raise ValueError(f"engine={self.engine!r}: expected the server's base URL, e.g. "
                                 f"http://host:8000/v1 (vLLM and SGLang serve the API under /v1)")
            self.model = self.model or self.target
        check_setting(self.device, "device")
        if not self.out:
            name = Path((self.model or self.target).rstrip("/")).name or "target"
            self.out = str(Path("regen") / f"{name}-thinking_{self.thinking}.jsonl")
        if self.heldout_every and not self.heldout_out:
            old = str(Path(self.out).with_suffix("")) + ".heldout.jsonl"  # (the default before: a run begun with it
            # continues there; stage 1a refuses the name in a corpus)
            self.heldout_out = old if Path(old).exists() else str(Path(self.out).parent / "heldout" / Path(self.out).name)
        if self.heldout_out and (not self.heldout_every or Path(self.heldout_out).resolve() == Path(self.out).resolve()):
            raise ValueError(f"heldout_out={self.heldout_out!r}: needs --heldout_every=N (1 record in N, N >= 2) and "
                             f"a file other than --out")
        return self


def config_record(cfg: RegenConfig, paths: list[Path], corpus_sha256: str, dtype: str) -> dict:
    """The run's settings, as the stats record them (`RESUME_FIELDS` of them are checked on a resume); `dtype`: the
    one the target decodes in ("engine" when a server answers)."""
    target = cfg.model if cfg.engine else str(Path(cfg.target).resolve())
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed,  # (local: seeded per batch)
                **({} if cfg.engine else {"batch_size": cfg.batch_size})}
    conf = {"target": target, "corpus": [str(p.resolve()) for p in paths],
            "corpus_bytes": [p.stat().st_size for p in paths], "corpus_sha256": corpus_sha256,
            "thinking": cfg.thinking,
            "max_new_tokens": cfg.max_new_tokens, "keep": cfg.keep, "on_truncated": cfg.on_truncated,
            "on_empty": cfg.on_empty, "num_docs": cfg.num_docs, "dtype": dtype,
            **({"engine": cfg.engine, "concurrency": cfg.concurrency} if cfg.engine else {"batch_size": cfg.batch_size})}
    if cfg.temperature > 0:  # (absent: greedy, and the greedy runs' records and checks stay as they were)
        conf["sampling"] = sampling
    if cfg.template_kwargs:  # (absent: none, and earlier runs' records and checks stay as they were)
        conf["template_kwargs"] = parse_settings(cfg.template_kwargs)
    if cfg.heldout_every:
        conf["heldout"] = {"every": cfg.heldout_every, "out": str(Path(cfg.heldout_out).resolve())}
    return conf


# --- the run -------------------------------------------------------------------------------------------------


def run(cfg: RegenConfig, model=None, tokenizer=None) -> dict:
    """Regenerate; returns the stats. `model`/`tokenizer` may be passed in (tests) instead of loaded."""
    t0 = time.time()
    cfg.resolve()
    warn_ignored(cfg)
    paths = expand_paths(cfg.corpus)  # everything cheap is checked before any weight loads or request is sent
    check_not_heldout(paths)
    out, client = Path(cfg.out), None
    if cfg.engine:
        client = engine.Client(cfg.engine, cfg.model, cfg.timeout_s, cfg.retries, cfg.backoff_s)
        client.check()
        dtype, device = "engine", None
    else:
        tokenizer, device, dtype = local_setup(cfg, model, tokenizer)
    corpus_sha256, n = hash_and_count(paths)  # (one read of the corpus: its hash for a resume, its records counted)
    conf = config_record(cfg, paths, corpus_sha256, str(dtype).removeprefix("torch."))
    out.parent.mkdir(parents=True, exist_ok=True)
    with runguard.holding(Path(f"{out}.lock"), lambda held, lock: (
            f"{out} is being written by {runguard.holder_line(held)} ({lock}): two runs appending to one output "
            f"would write its records twice; wait for it or stop it (kill -TERM; a rerun resumes), or choose another "
            f"--out (OUT=); if no such process runs (another machine that crashed), delete {lock}")):
        return regenerate(cfg, client, model, tokenizer, device, paths, n, conf, t0)


def regenerate(cfg: RegenConfig, client, model, tokenizer, device, paths: list[Path], n: int | None, conf: dict,
               t0: float) -> dict:
    """`run`'s work once it holds OUT: resume where OUT's stats say, answer the rest, commit; returns the stats."""
    out, heldout = Path(cfg.out), Path(cfg.heldout_out) if cfg.heldout_every else None
    files = [out, stats_path(out), Path(f"{out}.answers.jsonl")] + ([heldout] if heldout else [])
    state = resume_state(out, conf, heldout)
    if heldout:  # (after the resume check: a refused rerun leaves no folder behind)
        heldout.parent.mkdir(parents=True, exist_ok=True)
    total = min(cfg.num_docs, n) if cfg.num_docs and n is not None else (cfg.num_docs or n)
    if total is not None and state["records_read"] >= total and state["records_read"]:
        log(f"{out}: all {total} records already done")
        check_usable(st := commit(out, conf, state, state["elapsed_s"], complete=True), cfg.corpus, files)
        said_heldout(st, heldout)
        return st
    if not state["written"]:  # (a resume that wrote some may skip the rest: it was usable)
        check_first_records(paths, cfg.corpus, cfg.num_docs, cfg.keep, cfg.heldout_every)
    if state["records_read"]:
        log(f"resuming {out}: {state['records_read']} input records done, {state['written']} written")
    writer = Writer(out, heldout, conf, state)
    items = entries(paths, state["records_read"], cfg.num_docs, cfg.keep, cfg.heldout_every)
    progress = Progress("regen", total, "doc", None, disable=None if cfg.progress else True)
    progress.update(state["records_read"])
    try:
        if cfg.engine:
            through_engine(cfg, client, items, writer, settings_digest(conf), state["records_read"], progress)
        else:
            here(cfg, model, tokenizer, device, items, writer, settings_digest(conf), progress)
    except BaseException:  # (a stop, an error: the bar ends before the line that says why)
        progress.close("stopped")
        raise
    progress.close("done")
    st = writer.close()
    check_usable(st, cfg.corpus, files)
    log(f"regen done in {time.time() - t0:.1f}s: {json.dumps(summary(st))}")
    said_heldout(st, heldout)
    cut, turns = st.get("truncated", 0), st.get("turns_generated", 0)
    if turns and cut > TRUNCATED_WARN * turns:
        from dflash_offline.progress import warn

        kept = "kept cut off" if cfg.on_truncated == "keep" else "dropped"
        warn(f"WARNING: {cut} of {turns} answers hit --max_new_tokens={cfg.max_new_tokens} before the target ended "
             f"them ({kept}): raise it (make regen ARGS=--max_new_tokens=N) unless answers that long are meant")
    return st


def said_heldout(st: dict, heldout: Path | None) -> None:
    """Where the held-out prompts went: the prompts to evaluate a drafter trained on OUT with."""
    if heldout and st.get("heldout"):
        log(f"{st['heldout']} prompts held out into {heldout}: evaluate with make eval PROMPTS={heldout}")


def warn_ignored(cfg: RegenConfig) -> None:
    """A warning for each setting of the other answerer that differs from its default."""
    defaults = RegenConfig(corpus=[])
    for name in LOCAL_ONLY if cfg.engine else ENGINE_ONLY:
        if getattr(cfg, name) != getattr(defaults, name) and not (name == "model" and cfg.model == cfg.target):
            log(f"warning: --{name} is ignored {'with' if cfg.engine else 'without'} --engine")


def local_setup(cfg: RegenConfig, model, tokenizer):
    """(tokenizer, device, dtype) of the target answering here, checked before its weights load."""
    from transformers import AutoTokenizer

    if model is None:
        resolve_checkpoint(cfg.target, need=("config", "weights", "tokenizer"), field="regen --target")
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(cfg.target)
    check_tokenizer(tokenizer, parse_settings(cfg.template_kwargs, "regen.template_kwargs"), "regen.template_kwargs")
    device = pick_device(cfg.device, "regen --device") if model is None else next(model.parameters()).device
    dtype = next(model.parameters()).dtype if model is not None else pick_dtype(cfg.dtype, device)
    return tokenizer, device, dtype


def sampling(cfg: RegenConfig) -> str:
    return f"temperature {cfg.temperature:g}, top_p {cfg.top_p:g}, seed {cfg.seed}" if cfg.temperature else "greedy"


def through_engine(cfg: RegenConfig, client, items, writer, digest: str, done: int, progress) -> None:
    """The answers from an OpenAI-compatible server, `concurrency` requests in flight, journaled for a resume."""
    log(f"regenerating through {cfg.engine} (model {cfg.model}, {cfg.concurrency} requests in flight, "
        f"{sampling(cfg)}), thinking={cfg.thinking}, keep={cfg.keep}, max_new_tokens {cfg.max_new_tokens} → "
        f"{Path(cfg.out)}")
    if cfg.template_kwargs:  # (a server drops settings its template does not read: nothing here can tell)
        log(f"warning: --template_kwargs={cfg.template_kwargs} go to {cfg.engine} unchecked: a server ignores a "
            f"setting its chat template does not read")
    answer = engine.Answerer(client, cfg.max_new_tokens, cfg.thinking == "on", cfg.keep, cfg.on_truncated,
                             cfg.on_empty, digest, cfg.temperature, cfg.top_p, cfg.seed,
                             parse_settings(cfg.template_kwargs))
    journal = engine.Journal(Path(f"{Path(cfg.out)}.answers.jsonl"), digest, done)
    engine.run_jobs(items, answer, writer, cfg.concurrency, journal, progress)


def here(cfg: RegenConfig, model, tokenizer, device, items, writer, digest: str, progress) -> None:
    """The answers from the target under `transformers.generate`, `batch_size` prompts a call."""
    model = model if model is not None else load_model(cfg.target, device, cfg.dtype)
    target = Regenerator(model, tokenizer, cfg.max_new_tokens, cfg.thinking == "on", cfg.on_truncated,
                         cfg.on_empty, cfg.temperature, cfg.top_p, cfg.seed, parse_settings(cfg.template_kwargs))
    log(f"regenerating with {type(model).__name__} on {device} ({sampling(cfg)}), thinking={cfg.thinking}, "
        f"keep={cfg.keep}, batch {cfg.batch_size}, max_new_tokens {cfg.max_new_tokens} → {Path(cfg.out)}")
    for batch in batches(items, cfg.batch_size):
        target.process([e for e in batch if isinstance(e, Job)])
        done, tokens = writer.put([e.result(cfg.keep, digest) if isinstance(e, Job) else e for e in batch])
        progress.update(done, tokens=tokens)
