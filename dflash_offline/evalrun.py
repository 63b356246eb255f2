"""One evaluation of a drafter (`stages/evaluate.py` is its command line): its config (`EvalConfig`), the drafter
and the target loaded as users load them (`load_drafter`: the export or an untrained drafter; `load_target`), the
teacher-forced estimate, the decodes of every prompt by the target alone and with the drafter (`decode`), and the
JSON report (`evaluate`, `write_report`). The measuring pieces that take plain values live in `evaluation.py`, the
decoding loops in `speculate.py`; torch and transformers are imported where used, so `--help` stays fast.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.cache.fsio import hash_obj
from dflash_offline.chat import parse_settings
from dflash_offline.config import ConfigError, as_dict, check_choice, flag
from dflash_offline.corpus import check_tokenizer
from dflash_offline.devices import check_setting
from dflash_offline.evaluation import (
    baseline_key,
    compute_dtype,
    decode_summary,
    divergence,
    eos_ids,
    exact_float32,
    export_for_eval,
    lossless,
    parts_at,
    prompt_ids_digest,
    prune_baselines,
    read_baseline,
    read_prompts,
    run_info,
    teacher_forced,
    trained_on,
    write_baseline,
)

BASELINE_DIR = "eval-baselines"  # in the run: the target-alone decodes its evaluations share, a file a key (--baseline)


@dataclass
class EvalConfig:
    run: str = ""  # run directory (config.json + checkpoints/) written by make train; required but with --baseline_only
    target: str = ""  # target checkpoint (directory or hub id); empty = the run's (RUN/config.json records it); another than the run's is refused (its fingerprint)
    export: str = ""  # export directory measured (make export's); empty = export --step into RUN/eval-export first
    prompts: str = ""  # chat JSONL; empty = corpus/eval.jsonl beside the target (the demo target has one)
    num_prompts: int = 16  # prompts taken from the start of the file
    max_new_tokens: int = 128  # new tokens per prompt, at least 2 (the first, from the prefill, counts)
    turn: str = "first"  # the prompt ends after the "first" or "last" user turn of each chat
    step: int = -1  # checkpoint step to export (when --export is empty or new); -1 = the latest
    untrained: bool = False  # measure a fresh drafter (the run's config and seed, step 0) in the same modeling code
    cache: str = ""  # hidden cache for the teacher-forced estimate; empty = the run's training cache (not held out)
    tf_batches: int = 4  # teacher-forced batches (0 = skip the estimate)
    tf_rows: int = 1  # rows per teacher-forced batch
    num_anchors: int = 0  # anchors per row for the estimate; 0 = the run's num_anchors
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    dtype: str = "auto"  # target + drafter: float32 (exact: any difference fails) | bfloat16 (ties allowed) | auto
    threads: int = 0  # CPU threads for torch (0 = 1 on a CPU run unless OMP_NUM_THREADS is set, else torch's default)
    out: str = ""  # JSON report path; empty = RUN/eval.json (RUN/eval-untrained.json)
    tie_tol: float = 0.25  # bfloat16: a difference where the target's top-2 logit margin is <= this is a rounding tie
    baseline: str = ""  # JSON file of the target-alone decodes: reused when made for the same target/prompts/dtype/device, else (re)written; empty = RUN/eval-baselines/<key>.json (one a set of prompts and settings), off = none (decode the target alone anew)
    spec_prompts: int = 0  # prompts also decoded with the drafter (0 = all); the rest by the target alone, for --baseline
    replay: bool = False  # τ by replaying the target's greedy output (one target forward per prompt, the drafter stepped along it): the decode's τ, no speed figures
    draft_baseline: bool = True  # target-alone decodes that are not timed (replayed or baseline-only prompts) verified in blocks against a batched greedy draft: the same tokens, ~10x fewer forwards
    template_kwargs: str = ""  # chat template settings the prompts are rendered with as served, a JSON object, e.g. '{"reasoning_effort": "low"}' (Qwen3.8)
    check_prompts: int = 0  # with --replay: the first N prompts also decoded for real (lossless check, speed figures, replay = decode checked)
    timed_alone: int = 0  # where a --baseline file is written: the target-alone decodes of its first N prompts token by token (timed) even where only replayed or baseline-only, as later evaluations decoding them for real would decode them again (the testbed's untrained evaluation: its check prompts)
    replay_batch: int = 0  # with --replay: the drafts at up to N anchors from one batched drafter forward (0: a drafting call a step, as a decode); float32 and this version's modeling code only
    trust_code: bool = False  # run the export's dflash.py even where it is not this version's shipped modeling code (loading runs it)
    baseline_only: bool = False  # only write the --baseline file (the target-alone decodes; --timed_alone of them token by token) and stop: no drafter, no report; without --run, --target, --prompts and --baseline=FILE name what it decodes and where, rendered with --template_kwargs instead of a run's corpus settings (give those)

    def resolve(self) -> EvalConfig:
        check_choice("eval.turn", self.turn, ("first", "last"))
        try:
            parse_settings(self.template_kwargs, "eval.template_kwargs")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        check_choice("eval.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        check_setting(self.device, "eval.device")
        if self.num_prompts <= 0:
            raise ConfigError(f"eval.num_prompts must be > 0, got {self.num_prompts}")
        if self.max_new_tokens < 2:  # (one token is the prefill's: no verify step would measure the drafter)
            raise ConfigError(f"eval.max_new_tokens must be >= 2 (the first new token comes from the target's "
                              f"prefill, the drafter is measured from the second), got {self.max_new_tokens}")
        if self.spec_prompts < 0 or self.check_prompts < 0 or self.timed_alone < 0:
            raise ConfigError(f"eval.spec_prompts, eval.check_prompts and eval.timed_alone must be >= 0, got "
                              f"{self.spec_prompts}, {self.check_prompts}, {self.timed_alone}")
        if self.replay_batch < 0:
            raise ConfigError(f"eval.replay_batch must be >= 0, got {self.replay_batch}")
        if (self.check_prompts or self.replay_batch) and not self.replay:
            raise ConfigError("eval.check_prompts and eval.replay_batch are a replay's: they need --replay=1 (without "
                              "it every prompt is decoded for real)")
        if self.tf_batches < 0 or self.tf_rows < 1:
            raise ConfigError(f"eval.tf_batches must be >= 0 and eval.tf_rows >= 1, got {self.tf_batches}, "
                              f"{self.tf_rows}")
        if self.tie_tol < 0:
            raise ConfigError(f"eval.tie_tol must be >= 0, got {self.tie_tol}")
        if not self.run and not self.baseline_only:  # (required but with --baseline_only: said as for any other)
            raise ConfigError(f"missing required eval setting(s): {flag('eval', 'run')}")
        if self.baseline_only and self.baseline == "off":
            raise ConfigError("eval.baseline_only writes the --baseline file: --baseline=off leaves it nothing to do")
        if self.baseline_only and not self.run and not (self.target and self.prompts and self.baseline):
            raise ConfigError("eval.baseline_only without --run needs --target=, --prompts= and --baseline=FILE (the "
                              "checkpoint, the prompts and the file the target-alone decodes go to)")
        return self


# --- the drafter, the target, the estimate ---------------------------------------------------------------------


def load_drafter(cfg: EvalConfig, ri: dict, run_dir: Path, device, dtype, log):
    """(the shipped model, its artifact record, its DrafterConfig) — the export, or an untrained drafter."""
    import dataclasses

    from dflash_offline.drafter import DrafterConfig
    from dflash_offline.speculate import load_exported, untrained_model

    known = {f.name for f in dataclasses.fields(DrafterConfig)}
    if cfg.untrained:
        if cfg.export:
            log(f"--untrained=1: --export={cfg.export} is ignored (the drafter is built from the run's config)")
        dc = DrafterConfig(**{k: v for k, v in ri["config"]["drafter"].items() if k in known})
        projections = None
        if dc.tap_width:  # trained on projected taps: the fresh drafter is folded with the run's projection
            from dflash_offline.projection import run_projections

            if not ri["config"].get("projection"):
                raise ValueError(f"{run_dir}/config.json: the drafter reads {dc.tap_width} values a tap but the run "
                                 f"records no projection to fold it with")
            projections = run_projections(ri["config"]["projection"], dc.target_layer_ids, run_dir)
        model, artifact = untrained_model(dc, ri["target"], int(ri["train"].get("seed", 0)), device, dtype,
                                          projections)
        return model, artifact, dataclasses.replace(dc, tap_width=0)
    model, artifact = load_exported(export_for_eval(cfg.export, cfg.step, run_dir, log), device, dtype,
                                    cfg.trust_code)
    prov = json.loads((Path(artifact["path"]) / "dflash_export.json").read_text())
    return model, artifact, DrafterConfig(**{k: v for k, v in prov["drafter"].items() if k in known})


def load_target(target_dir: Path, device, dtype):
    """The target in `dtype`, loaded as HF loads it."""
    from transformers import AutoModelForCausalLM

    if device.type == "cpu":
        return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
    # straight onto the device (a 27B target never passes through host memory in full)
    return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype, device_map=str(device)).eval()


def check_cache_target(cache: str, target_dir: Path) -> None:
    """`--cache` must hold hidden states of the eval target: the estimate feeds them to a drafter of this target
    (one line naming both targets and the fix, before anything loads)."""
    from dflash_offline.cache.manifest import read_manifest
    from dflash_offline.targetid import TargetError, target_mismatch

    m = read_manifest(cache, kind="hidden")
    if diff := target_mismatch(str(target_dir), m["producer"]["target"]):
        raise TargetError(f"--cache={cache} was extracted from {m['config']['extract']['target']}, not from the eval "
                          f"target {target_dir} ({'; '.join(diff)}): pass --cache= a cache extracted from it (make "
                          f"extract TARGET={target_dir}), or leave --cache empty for the run's training cache")


def check_run_target(ri: dict, target_dir: Path, run_dir: Path, log) -> None:
    """The eval target must be the one the run's cache was extracted from (`export.check_trained_target`)."""
    from dflash_offline.export import check_trained_target

    check_trained_target(ri["config"], ri["cache"], target_dir, run_dir, log, "eval", "make eval TARGET=")


def estimate(cfg: EvalConfig, ri: dict, model, dc, target) -> dict:
    """The teacher-forced estimate: the same weights in the training forward, on `--cache` or the run's training
    cache (then not held out)."""
    import torch

    from dflash_offline.drafter import DFlashDrafter
    from dflash_offline.loss import DEFAULT_GAMMA

    train = ri["train"]
    tf = {"batches": 0}
    tf_cache = cfg.cache or ri["cache"]
    if cfg.tf_batches:
        embed_VH, head_VH = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        gamma = float(train.get("gamma") or 0) or DEFAULT_GAMMA.get(dc.block_size, 7.0)
        with torch.device("meta"):
            tf_model = DFlashDrafter(dc).eval()
        tf_model.load_state_dict(model.state_dict(), strict=True, assign=True)  # shares the shipped tensors
        tf = teacher_forced(tf_model, embed_VH, head_VH, tf_cache, gamma, cfg.tf_batches, cfg.tf_rows,
                            cfg.num_anchors or int(train.get("num_anchors", 512)))
        del tf_model
    held_out = bool(cfg.cache) and Path(cfg.cache).resolve() != Path(ri["cache"]).resolve()
    tf.update(cache=str(tf_cache), held_out=held_out)
    return tf


# --- the decodes -----------------------------------------------------------------------------------------------


def decode(cfg: EvalConfig, target, drafter, prompts: list[dict], eos: list[int], exact: bool, reuse=None):
    """Each prompt decoded by the target alone and with the drafter (one untimed warm-up of each path first) — with
    `--replay`, the drafter's steps replayed on the target's greedy output and only the first `check_prompts` decoded
    for real: (τ: GenStats per prompt, real decodes: GenStats per prompt, alone: GenStats per prompt, per_prompt
    records, the lossless check of the real decodes). `reuse`: the target-alone decodes [(ids, GenStats)] of a
    matching `--baseline` file, decoded again only where absent."""
    from dflash_offline.progress import log
    from dflash_offline.speculate import greedy_generate, replay_generate, speculative_generate

    n_spec = min(cfg.spec_prompts or len(prompts), len(prompts))
    n_real = min(cfg.check_prompts, n_spec) if cfg.replay else n_spec
    # the target-alone decodes made token by token: the real decodes' (their reference), and where a baseline file is
    # written, `timed_alone`'s (a read one is kept as it is: its decodes are reused, not written again)
    n_timed = max(n_real, min(cfg.timed_alone, len(prompts))) if reuse is None and cfg.baseline != "off" else n_real
    greedy_generate(target, prompts[0]["ids"], 2, eos)
    if n_real:
        speculative_generate(target, drafter, prompts[0]["ids"], 2, eos)
    taus, spec, alone, refs, per_prompt, mismatches, ties, margins = [], [], [], [], [], [], [], []
    drafts = {} if reuse else block_drafts(cfg, target, prompts, n_timed, eos)
    for i, p in enumerate(prompts):
        ref, rs = target_alone(cfg, target, p, i, drafts, reuse, timed=i < n_timed, eos=eos)
        refs.append(ref)
        alone.append(rs)
        if i >= n_spec:  # (decoded for the baseline file only)
            continue
        rec = {"prompt_tokens": len(p["ids"]), "category": p["category"], "target_s": rs.seconds}
        if cfg.replay:
            _, st = replay_generate(target, drafter, p["ids"], ref, cfg.max_new_tokens, eos, cfg.replay_batch)
            taus.append(st)
        if i < n_real:
            out, ss = speculative_generate(target, drafter, p["ids"], cfg.max_new_tokens, eos)
            if out != ref and reuse:  # (a reference read from --baseline was decoded elsewhere: judged against ours)
                fresh, _ = greedy_generate(target, p["ids"], cfg.max_new_tokens, eos)
                if fresh != ref:
                    at = rec["baseline_parts_at"] = parts_at(fresh, ref)
                    log(f"prompt {i + 1}: the baseline's target-alone decode parts from this process's at token {at}: "
                        f"the decode is judged against this process's")
                    ref = refs[-1] = fresh
            equal = out == ref
            div = None if equal else divergence(target, p["ids"], out, ref)
            if div is not None:
                div["tie"] = not exact and div["margin"] is not None and div["margin"] <= cfg.tie_tol
                (ties if div["tie"] else mismatches).append(i)
                margins.append(math.inf if div["margin"] is None else div["margin"])
            spec.append(ss)
            rec.update(new_tokens=len(out), spec_s=ss.seconds, equal=equal, divergence=div)
            if cfg.replay:  # the replay took the decode's steps (its last step's accepted drafts may be fewer)
                rec["replay_agrees"] = st.emitted == ss.emitted and st.accepted[:-1] == ss.accepted[:-1]
        st = taus[-1] if cfg.replay else ss
        rec.update(tau_mean=st.tau_mean if st.steps else None,  # (strict JSON has no NaN)
                   steps=st.steps, emitted=sum(st.emitted))
        rec.setdefault("new_tokens", st.new_tokens)
        per_prompt.append(rec)
        speed = f", {ss.tok_per_s:.1f} vs {rs.tok_per_s:.1f} tok/s" if i < n_real else ", replayed"
        log(f"prompt {i + 1}/{len(prompts)}: {rec['new_tokens']} tokens, τ {st.tau_mean:.2f}{speed}{outcome(rec)}")
    return (taus if cfg.replay else spec), spec, alone, refs, per_prompt, lossless(mismatches, ties, margins, exact,
                                                                                   cfg.tie_tol)


def block_drafts(cfg: EvalConfig, target, prompts: list[dict], n_timed: int, eos: list[int]) -> dict:
    """{prompt index: the batched greedy draft its target-alone decode is verified against in blocks} for the prompts
    from `n_timed` on (`--draft_baseline`; none when off)."""
    from dflash_offline.progress import log
    from dflash_offline.speculate import batched_greedy

    if not cfg.draft_baseline or len(prompts) <= n_timed:
        return {}
    untimed = list(range(n_timed, len(prompts)))
    drafts = dict(zip(untimed, batched_greedy(target, [prompts[i]["ids"] for i in untimed], cfg.max_new_tokens, eos),
                      strict=True))
    log(f"target-alone decodes of {len(untimed)} untimed prompts: verified in blocks against a batched greedy draft")
    return drafts


def target_alone(cfg: EvalConfig, target, p: dict, i: int, drafts: dict, reuse, timed: bool, eos: list[int]):
    """(output, GenStats) of prompt `i` decoded by the target alone: reused from `--baseline`, verified in blocks
    against its batched greedy draft (`drafts`), or token by token — always token by token where it is `timed`."""
    from dflash_offline.progress import log
    from dflash_offline.speculate import greedy_by_blocks, greedy_generate

    ref, rs = reuse[i] if reuse else (greedy_by_blocks(target, p["ids"], drafts[i], cfg.max_new_tokens, eos)
                                      if i in drafts else greedy_generate(target, p["ids"], cfg.max_new_tokens, eos))
    if timed and rs.rollback == "drafted":  # (a reused decode that was not timed, for a prompt that is)
        out, rs = greedy_generate(target, p["ids"], cfg.max_new_tokens, eos)
        if out != ref:
            at = next((k for k, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), len(ref))
            log(f"prompt {i + 1}: the token-by-token decode parts from the block-verified one at token {at}")
        ref = out
    return ref, rs


def outcome(rec: dict) -> str:
    """The end of a prompt's log line: the replay's check, where the output parts from the target's and why."""
    div = rec.get("divergence")
    what = "" if rec.get("equal", True) else (f", differs at token {div['at']} (logit margin "
                                              f"{math.inf if div['margin'] is None else div['margin']:.3g}: "
                                              f"{'rounding tie' if div['tie'] else 'MISMATCH'})")
    agree = "" if "replay_agrees" not in rec else (", replay = decode" if rec["replay_agrees"]
                                                   else ", REPLAY DIFFERS from the decode")
    return agree + what


# --- the run ----------------------------------------------------------------------------------------------------


def evaluate(cfg: EvalConfig) -> dict:
    """The report of one evaluation (`stages/evaluate.py`'s docstring says what it measures)."""
    import torch

    from dflash_offline.cache.manifest import has_manifest
    from dflash_offline.progress import log
    from dflash_offline.speculate import ExportedDrafter, shipped_modeling_sha256
    from dflash_offline.target import read_target_info

    run_dir = Path(cfg.run)
    ri = run_info(run_dir, cfg.target)
    check_run_target(ri, ri["target"], run_dir, log)
    target_dir = ri["target"]
    if cfg.cache and cfg.tf_batches:
        check_cache_target(cfg.cache, target_dir)
    elif cfg.tf_batches and not has_manifest(ri["cache"]):
        raise ValueError(f"the teacher-forced estimate reads the run's training cache {ri['cache']}, which is gone: "
                         f"pass --tf_batches=0 (make eval ARGS=--tf_batches=0) to measure without it, or --cache= "
                         f"(make eval CACHE=) a hidden cache of this target")
    prompts_file = prompts_path(cfg, target_dir)
    from dflash_offline.progress import warn

    if seen := trained_on(prompts_file, ri["cache"]):  # (τ on them overstates the drafter on new prompts)
        warn(f"WARNING: {seen}. τ measured on prompts the drafter was trained on overstates what it does on new "
             f"ones: pass PROMPTS= (--prompts=) prompts held out of its training")
    device, dtype_name = compute(cfg, target_dir)
    dtype, exact = getattr(torch, dtype_name), dtype_name == "float32"
    if cfg.replay_batch and not exact:
        raise ConfigError(f"eval.replay_batch drafts in float32 only (in {dtype_name} its rows' masked context rounds "
                          f"otherwise than a decode's step): pass --dtype=float32, or --replay_batch=0")
    tok, settings, prompts = tokenized_prompts(cfg, target_dir, prompts_file, ri["template_kwargs"])
    trained_thinking = ri["template_kwargs"].get("enable_thinking")
    if "enable_thinking" in settings and trained_thinking is not None and settings["enable_thinking"] != trained_thinking:
        warn(f"WARNING: --template_kwargs enable_thinking={settings['enable_thinking']} renders the prompts otherwise "
             f"than the drafter's training corpus was rendered (enable_thinking={trained_thinking}): τ then measures "
             f"the drafter on a kind of answer it did not train on; leave enable_thinking out to render as trained")

    # --- the drafter: the shipped artifact (small; validates the run before the target is loaded)
    model, artifact, dc = load_drafter(cfg, ri, run_dir, device, dtype, log)
    if cfg.replay_batch and artifact["path"] and artifact["modeling_sha256"] != shipped_modeling_sha256():
        raise ConfigError(f"eval.replay_batch drafts through this version's modeling code (its forward, masks and "
                          f"cache); {artifact['path']}/dflash.py is other code (--trust_code=1): pass --replay_batch=0")
    info = read_target_info(target_dir)
    check_same_target(info, dc, target_dir)

    # --- target
    log(f"loading target {target_dir} ({info.arch}, {info.num_layers} layers) on {device} in {dtype_name}"
        f"{' (exact mode)' if exact else f' (ties up to a logit margin of {cfg.tie_tol:g} allowed)'}")
    target = load_target(target_dir, device, dtype)
    tf = estimate(cfg, ri, model, dc, target)

    eos = eos_ids(target, tok)
    drafter = ExportedDrafter(model, target)
    templates = sorted({json.dumps(p["template"], sort_keys=True) if p["template"] else "the template's defaults"
                        for p in prompts})
    log(f"{len(prompts)} prompts from {prompts_file} (mean {sum(len(p['ids']) for p in prompts) / len(prompts):.0f} "
        f"tokens; chat template settings {' / '.join(templates)}), ≤ {cfg.max_new_tokens} new tokens, block "
        f"{dc.block_size}, eos {eos}, drafter {artifact['path'] or 'untrained'}")

    # (the target-alone decodes are half an evaluation's target time and the same for every drafter of the run: a
    # trained and an untrained evaluation, or one after more training, share them; a file a key, so that a one-off
    # evaluation of other prompts or settings leaves the others' there)
    key = baseline_key(cfg, target_dir, prompts, eos, dtype_name, device) if cfg.baseline != "off" else None
    base = None if key is None else baseline_path(cfg, key)
    reuse = read_baseline(base, key, log) if base else None
    taus, spec, alone, refs, per_prompt, check = decode(cfg, target, drafter, prompts, eos, exact, reuse)
    if base and reuse is None:
        write_baseline(base, key, refs, alone)
    if base and base.resolve().parent == (run_dir / BASELINE_DIR).resolve():  # (kept from growing without end)
        prune_baselines(base, log)
    baseline_prompts = len(prompts)
    summary = decode_summary(taus, spec, alone, prompts)
    if not summary["verify_steps"]:  # (τ = 0 tokens over 0 steps: nan)
        raise ValueError(f"{prompts_file}: the target ended its answer to every one of the {len(taus)} prompts "
                         f"decoded at its first token, so no verify step measured the drafter (τ undefined): check "
                         f"the prompts and their chat template settings (--template_kwargs=, --turn=), or that the "
                         f"target answers them (--max_new_tokens={cfg.max_new_tokens})")
    alone, prompts = alone[: len(taus)], prompts[: len(taus)]  # what both decoded
    return {
        "run": str(run_dir), "artifact": artifact, "checkpoint": artifact.get("checkpoint"),
        "step": 0 if cfg.untrained else artifact["step"], "untrained": cfg.untrained,
        "target": str(target_dir), "arch": info.arch, "prompts": str(prompts_file), "num_prompts": len(prompts),
        "prompts_trained_on": seen, "template_settings": [json.loads(t) if t.startswith("{") else None
                                                           for t in templates],
        "prompt_ids_sha256": prompt_ids_digest(prompts),
        "max_new_tokens": cfg.max_new_tokens, "block_size": dc.block_size, "device": str(device),
        "baseline": {"file": str(base), "reused": reuse is not None, "prompts": baseline_prompts}
        if base else None,
        "dtype": dtype_name, "mode": "exact" if exact else "ties allowed", "tau_from": "replay" if cfg.replay else "decode",
        **summary, **check, "lossless_prompts": len(spec),
        "replay_check": {"prompts": len(checked := [q["replay_agrees"] for q in per_prompt if "replay_agrees" in q]),
                         "agree": sum(checked)} if cfg.replay else None, "teacher_forced": tf, "per_prompt": per_prompt, "config": as_dict(cfg), "time": time.time(),
    }


def baseline_only(cfg: EvalConfig) -> dict:
    """`--baseline_only`: the target-alone decodes of the prompts, as an evaluation with this `--baseline` would make
    them (the first `--timed_alone` token by token and timed, the others verified in blocks), written to the file, and
    nothing else — no drafter, no report; a file made for the same key is kept as it is. Without `--run` the prompts
    are rendered with `--template_kwargs` where a run's evaluation renders them with its corpus's settings (a held-out
    record's own, from make regen, and `--template_kwargs` over either, as always): it reuses the file only where they come out
    the same tokens (its corpus's settings; the key holds their digest), and else decodes them again. Lets a caller make
    the baseline while the drafter is still to come (the testbed: beside the extraction). Returns {"file", "reused",
    "prompts", "timed", "seconds"}."""
    import torch

    from dflash_offline.progress import log
    from dflash_offline.speculate import greedy_generate
    from dflash_offline.targetid import resolve_checkpoint

    t0 = time.perf_counter()
    if cfg.run:
        ri = run_info(Path(cfg.run), cfg.target)
        check_run_target(ri, ri["target"], Path(cfg.run), log)
        target_dir, trained = ri["target"], ri["template_kwargs"]
    else:
        target_dir = resolve_checkpoint(cfg.target, need=("config", "weights", "tokenizer"), field="eval target")
        trained = {}
    prompts_file = prompts_path(cfg, target_dir)
    device, dtype_name = compute(cfg, target_dir)
    tok, _, prompts = tokenized_prompts(cfg, target_dir, prompts_file, trained)
    log(f"loading target {target_dir} on {device} in {dtype_name} for the target-alone decodes of {len(prompts)} "
        f"prompts from {prompts_file}")
    target = load_target(target_dir, device, getattr(torch, dtype_name))
    eos = eos_ids(target, tok)
    key = baseline_key(cfg, target_dir, prompts, eos, dtype_name, device)
    base = baseline_path(cfg, key)
    n_timed = min(cfg.timed_alone, len(prompts))
    done = {"file": str(base), "prompts": len(prompts), "timed": n_timed}
    if read_baseline(base, key, log) is not None:
        return {**done, "reused": True, "seconds": time.perf_counter() - t0}
    greedy_generate(target, prompts[0]["ids"], 2, eos)  # (the untimed warm-up an evaluation's decodes have)
    drafts = block_drafts(cfg, target, prompts, n_timed, eos)
    refs, alone = [], []
    for i, p in enumerate(prompts):
        ref, rs = target_alone(cfg, target, p, i, drafts, None, timed=i < n_timed, eos=eos)
        refs.append(ref)
        alone.append(rs)
    write_baseline(base, key, refs, alone)
    log(f"baseline {base}: the target-alone decodes of {len(prompts)} prompts written ({n_timed} token by token)")
    return {**done, "reused": False, "seconds": time.perf_counter() - t0}


def prompts_path(cfg: EvalConfig, target_dir: Path) -> Path:
    """The prompts file evaluated: `--prompts`, else the target's corpus/eval.jsonl; refused where it is not there."""
    prompts_file = Path(cfg.prompts) if cfg.prompts else target_dir / "corpus" / "eval.jsonl"
    if not prompts_file.is_file():
        raise ValueError(f"prompts file {prompts_file} does not exist: pass --prompts= (make eval PROMPTS=) a chat JSONL")
    return prompts_file


def tokenized_prompts(cfg: EvalConfig, target_dir: Path, prompts_file: Path, trained: dict):
    """(tokenizer, --template_kwargs, prompts) of `prompts_file` rendered with the target's tokenizer and chat template
    (`trained`: the settings the run's corpus was rendered with), checked before anything large loads."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    settings = parse_settings(cfg.template_kwargs, "eval.template_kwargs")
    check_tokenizer(tok, settings, "eval.template_kwargs")
    return tok, settings, read_prompts(prompts_file, cfg.num_prompts, cfg.turn, tok, settings, trained)


def baseline_path(cfg: EvalConfig, key: dict) -> Path:
    """The target-alone decodes' file: `--baseline`, else one a key in RUN/eval-baselines."""
    return Path(cfg.baseline) if cfg.baseline else Path(cfg.run) / BASELINE_DIR / f"{hash_obj(key)[:16]}.json"


def compute(cfg: EvalConfig, target_dir: Path):
    """(device, compute dtype's name) of this evaluation; float32 (exact mode) switches TF32 off on CUDA."""
    from dflash_offline.devices import cpu_threads, pick_device
    from dflash_offline.progress import log

    device = pick_device(cfg.device, "eval.device")
    dtype_name = compute_dtype(cfg.dtype, device, target_dir)
    if dtype_name == "float32":
        exact_float32(device)
    cpu_threads(device, cfg.threads, log)  # one thread on a CPU run unless OMP_NUM_THREADS or --threads says
    return device, dtype_name


def check_same_target(info, dc, target_dir: Path) -> None:
    """The drafter reads the target's states: its hidden size and layer count must be the target's."""
    if (info.hidden_size, info.num_layers) != (dc.hidden_size, dc.num_target_layers):
        raise ValueError(f"target {target_dir} (hidden {info.hidden_size}, {info.num_layers} layers) is not the "
                         f"drafter's (hidden {dc.hidden_size}, {dc.num_target_layers} layers)")


def report_path(cfg: EvalConfig) -> Path:
    """Where the report goes: `--out`, else RUN/eval.json (RUN/eval-untrained.json)."""
    return Path(cfg.out) if cfg.out else Path(cfg.run) / ("eval-untrained.json" if cfg.untrained else "eval.json")


def write_report(cfg: EvalConfig, report: dict) -> Path:
    """The report, written whole (a reader never sees half of it); returns its path."""
    from dflash_offline.cache.fsio import write_json_atomic

    out = report_path(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, report)
    return out
