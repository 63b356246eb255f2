"""Evaluate the exported drafter by real speculative decoding with its target (the final τ), plus a teacher-forced
estimate.

    python -m stages.evaluate --run=RUN [--export=DIR | --step=N] --prompts=FILE.jsonl [--num_prompts=16
                              --max_new_tokens=128] [--dtype=auto|float32|bfloat16] [--untrained=1] [--cache=HELD_OUT]

What is measured is the artifact users ship: the z-lab export directory, loaded as users load it
(`AutoModel.from_pretrained(DIR, trust_remote_code=True)`, i.e. its own dflash.py, weights checked against the
SHA-256 in its provenance), drafting with its `draft_block`. `--export=DIR` names it (make EXPORT= or OUT=; a DIR
that does not exist yet receives a fresh export of the run); without it the run's checkpoint (`--step`, default the
latest) is exported into RUN/eval-export first. The JSON records the artifact (path, weights and modeling-file
SHA-256, run, step). `--untrained=1` measures a fresh drafter (the run's config and seed, the trainer's step 0) in
the same modeling code, the baseline a trained drafter must beat.

For each prompt (a chat record `{"messages": [...]}`, optionally with a `category`, cut after its first —
`--turn=last`: last — user turn and rendered with the target's chat template and `add_generation_prompt=True`) the
target generates greedily alone and with the drafter (`dflash_offline.speculate`: the target side — verification,
acceptance, cache rollback — is the engine's job and lives there). Reported: real τ (tokens per verify step), its
histogram and the share of verify steps accepting at least k drafts (k = 1..B-1), τ per prompt category, draft /
verify / rollback ms per step, tok/s of both decodes, and speed-ups (see `speedups`), target forward counts, and
the teacher-forced estimate (per-slot accuracy → simulated τ, and the per-block τ) of the same weights on a few
batches of a hidden cache — the run's own training cache unless `--cache=` names a held-out one.

Lossless check, by `--dtype` (target and drafter compute dtype): in float32 (exact mode) every speculative output
must equal the target's greedy output, any difference fails (TF32 is switched off on CUDA); in bfloat16 a block
forward and token-by-token forwards round differently, so where outputs part one full forward of the target
measures its top-2 logit margin there, and a margin <= `--tie_tol` is a rounding tie (`exact` false, `lossless`
still true; margins of all differences in `tie_margin_hist`); any other difference fails. auto = float32 on a CPU or
when the target's fp32 weights take at most half the GPU's memory, else bfloat16. A failure still writes the JSON
(RUN/eval.json, RUN/eval-untrained.json, or `--out=`) and exits 1.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.config import ConfigError, as_dict, check_choice, config_from_argv
from dflash_offline.devices import check_setting

MARGIN_EDGES = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0, 2.0)  # bf16 logits of 8..64 step 1/16..1/4


@dataclass
class EvalConfig:
    run: str  # run directory (config.json + checkpoints/) written by make train
    export: str = ""  # z-lab export to measure (make EXPORT= or OUT=); empty = export --step into RUN/eval-export first
    prompts: str = ""  # chat JSONL; empty = corpus/eval.jsonl beside the target (the demo target has one)
    num_prompts: int = 16  # prompts taken from the start of the file
    max_new_tokens: int = 128  # new tokens per prompt (the first, from the prefill, counts)
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

    def resolve(self) -> EvalConfig:
        check_choice("eval.turn", self.turn, ("first", "last"))
        check_choice("eval.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        check_setting(self.device, "eval.device")
        for name in ("num_prompts", "max_new_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"eval.{name} must be > 0, got {getattr(self, name)}")
        if self.tf_batches < 0 or self.tf_rows < 1:
            raise ConfigError(f"eval.tf_batches must be >= 0 and eval.tf_rows >= 1, got {self.tf_batches}, "
                              f"{self.tf_rows}")
        if self.tie_tol < 0:
            raise ConfigError(f"eval.tie_tol must be >= 0, got {self.tie_tol}")
        return self


# --- the run, the artifact, the prompts ------------------------------------------------------------------------


def run_info(run_dir: Path) -> dict:
    """The run's resolved config, its training cache and its target checkpoint."""
    from dflash_offline.manifest import read_manifest
    from dflash_offline.targetid import resolve_checkpoint

    cfg_file = run_dir / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{cfg_file} does not exist: pass --run= a run directory written by make train")
    cfg = json.loads(cfg_file.read_text())
    train = cfg["train"]
    target = train.get("target") or read_manifest(train["cache"])["config"]["extract"]["target"]
    return {"config": cfg, "train": train, "cache": train["cache"],
            "target": resolve_checkpoint(target, need=("config", "weights", "tokenizer"), field="eval target")}


def export_for_eval(cfg: EvalConfig, run_dir: Path, log) -> Path:
    """The export directory to measure: `--export` as it is when it holds an export of this run, else a fresh export
    of the run's checkpoint (`--step`) into `--export` or RUN/eval-export."""
    from dflash_offline.export import PROVENANCE, export

    d = Path(cfg.export) if cfg.export else run_dir / "eval-export"
    if cfg.export and (d / PROVENANCE).is_file():
        prov = json.loads((d / PROVENANCE).read_text())
        if Path(prov.get("run", "")).resolve() != run_dir.resolve():
            raise ValueError(f"{d} is an export of run {prov.get('run')}, not of RUN={run_dir}: pass that RUN=")
        if cfg.step >= 0 and prov.get("step") != cfg.step:
            raise ValueError(f"{d} holds step {prov.get('step')}, not --step={cfg.step} (make STEP=): leave EXPORT= "
                             f"empty to export step {cfg.step}, or drop STEP=")
        return d
    if cfg.export and d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise ValueError(f"{d} is not an export (no {PROVENANCE}): pass EXPORT= a directory written by make export, "
                         f"a new directory, or nothing")
    out = export(run_dir, d, step=None if cfg.step < 0 else cfg.step)
    log(f"exported {run_dir} step {json.loads((out / PROVENANCE).read_text())['step']} to {out}")
    return out


def render_prompt(messages: list[dict], tokenizer, turn: str = "first", tools=None) -> list[int] | None:
    """Token ids of `messages` up to the first/last user turn + the generation prompt; None without a user turn."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return None
    cut = users[0] if turn == "first" else users[-1]
    kw = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages[: cut + 1], add_generation_prompt=True, tokenize=False, **kw)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def read_prompts(path: Path, n: int, turn: str, tokenizer) -> list[dict]:
    """The first `n` usable chats as {"ids": messages up to the first/last user turn + the generation prompt,
    "category": the record's `category` or None}."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if len(out) >= n:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            msgs = rec.get("messages")
            if not isinstance(msgs, list):
                raise ValueError(f"{path}:{lineno}: no 'messages' list (prompts must be chat records)")
            ids = render_prompt(msgs, tokenizer, turn, rec.get("tools"))
            if ids is not None:
                cat = rec.get("category")
                out.append({"ids": ids, "category": None if cat is None else str(cat)})
    if not out:
        raise ValueError(f"{path}: no chat with a user turn")
    return out


def eos_ids(target, tokenizer) -> list[int]:
    ids: set[int] = set()
    for v in (getattr(target.generation_config, "eos_token_id", None), target.config.eos_token_id,
              tokenizer.eos_token_id):
        if v is not None:
            ids.update([v] if isinstance(v, int) else v)
    return sorted(ids)


def compute_dtype(setting: str, device, target_dir: Path) -> str:
    """float32 / bfloat16; auto = float32 on a CPU or when 4 bytes per target parameter fit in half the GPU."""
    import torch
    from safetensors import safe_open

    if setting != "auto":
        return setting
    if device.type == "cpu":
        return "float32"
    params = 0
    for f in target_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys() if "visual" not in k)
    return "float32" if 4 * params <= 0.5 * torch.cuda.get_device_properties(device).total_memory else "bfloat16"


# --- the lossless check ----------------------------------------------------------------------------------------


def divergence(target, prompt: list[int], out: list[int], ref: list[int]) -> dict:
    """Where two generations part, and the target's margin there (one full forward over the prompt and the common
    prefix): the top logit minus the lower of the two tokens' logits — the top-2 margin when they are its top two."""
    import torch

    j = next((j for j, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), min(len(out), len(ref)))
    ids = torch.tensor([prompt + ref[:j]], device=next(target.parameters()).device)
    with torch.no_grad():
        z = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    if j >= len(out) or j >= len(ref):  # one stopped early: no pair of tokens to compare, never a tie
        return {"at": j, "spec_token": None, "target_token": None, "margin": None, "top2_margin": None,
                "full_forward_token": int(z.argmax())}
    top2 = z.topk(2).values
    return {"at": j, "spec_token": out[j], "target_token": ref[j],
            "margin": float(z.max() - torch.minimum(z[out[j]], z[ref[j]])), "top2_margin": float(top2[0] - top2[1]),
            "full_forward_token": int(z.argmax())}


def margin_hist(margins: list[float]) -> dict:
    """Counts of margins in (0, e_0], (e_0, e_1], ..., (e_last, ∞) for e = MARGIN_EDGES."""
    counts = [0] * (len(MARGIN_EDGES) + 1)
    for m in margins:
        counts[next((i for i, e in enumerate(MARGIN_EDGES) if m <= e), len(MARGIN_EDGES))] += 1
    return {"edges": list(MARGIN_EDGES), "counts": counts}


def exact_float32(device) -> None:
    """Exact mode on CUDA: no TF32 in matmuls or convolutions (torch's defaults allow it in cuDNN convolutions)."""
    import torch

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


# --- estimates -------------------------------------------------------------------------------------------------


def teacher_forced(model, embed_VH, lm_head_VH, cache_dir, gamma, batches: int, rows: int, num_anchors: int,
                   seed: int = 0) -> dict:
    """Per-slot accuracy, simulated τ and mean per-block τ of the training forward `model` (a DFlashDrafter) on
    `batches` batches of a hidden cache."""
    import torch

    from dflash_offline import anchors as anc
    from dflash_offline.dataset import HiddenStream, open_hidden_cache
    from dflash_offline.loss import block_ce_loss, block_tau, simulated_acceptance_length, slot_accuracy

    cfg, dev = model.cfg, embed_VH.device
    info = open_hidden_cache(cache_dir, cfg.target_layer_ids, hidden_size=cfg.hidden_size)
    stream = HiddenStream(info, rows, seed=seed, device=dev, prefetch=0)
    g = torch.Generator(device=dev).manual_seed(seed)
    correct = valid = None
    loss_sum, tau_sum, blocks, n = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for _ in range(min(batches, stream.batches_per_epoch)):
            b = next(stream)
            a_BA, keep_BA = anc.sample_anchors(b["loss_mask"], b["doc_ids"], min(num_anchors, info.seq_len),
                                               cfg.block_size, g)
            labels = anc.block_labels(b["input_ids"], b["loss_mask"], b["doc_ids"], a_BA, keep_BA, cfg.block_size)
            masks = model.build_masks(b["doc_ids"], a_BA, keep_BA, "dense")
            h = model(b["hidden"], b["input_ids"], b["position_ids"], a_BA, keep_BA, embed_VH, masks, "dense")
            out = block_ce_loss(h, lm_head_VH, labels, gamma=gamma)
            c, v = out.correct_BAL.sum((0, 1)), out.valid_BAL.sum((0, 1))
            correct, valid = (c, v) if correct is None else (correct + c, valid + v)
            loss_sum += float(out.loss)
            tau_sum += float((block_tau(out.correct_BAL) * keep_BA).sum())
            blocks += int(keep_BA.sum())
            n += 1
    stream.close()
    if n == 0:
        return {"batches": 0}
    acc = slot_accuracy(correct, valid)
    return {"batches": n, "rows": n * rows, "blocks": blocks, "loss": loss_sum / n,
            "sim_tau": 1 + float(simulated_acceptance_length(acc)), "block_tau": tau_sum / max(blocks, 1),
            "acc": [round(float(x), 4) for x in acc[1:]]}


def speedups(s: dict, a: dict) -> dict:
    """Speed-up estimates beside the measured wall-clock ratio `speedup` (s, a: `summarize` of the speculative and
    the target-alone decodes), each relative to the target alone at one forward per token:
    - `speedup_engine_est` = τ / (1 + draft_ms / verify_ms): an engine where a verify forward of B tokens costs what
      a one-token decode step costs (batch-1 decoding of a large target on a GPU is bound by reading its weights),
      rollback is free (engines keep per-token recurrent states) and nothing runs on the host between kernels;
    - `speedup_step_est` = τ · target_ms_per_token / (draft_ms + verify_ms): the same with this machine's measured
      forward times (a verify forward against a one-token forward), rollback and host work between steps left out.
    """
    tau, draft, verify, one = s["tau_mean"], s["draft_ms"], s["verify_ms"], a["verify_ms"]
    ok = all(map(math.isfinite, (tau, draft, verify, one))) and verify > 0
    return {"target_ms_per_token": one,
            "speedup_engine_est": tau / (1 + draft / verify) if ok else math.nan,
            "speedup_step_est": tau * one / (draft + verify) if ok else math.nan}


# --- the stage -------------------------------------------------------------------------------------------------


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
        model, artifact = untrained_model(dc, ri["target"], int(ri["train"].get("seed", 0)), device, dtype)
        return model, artifact, dc
    model, artifact = load_exported(export_for_eval(cfg, run_dir, log), device, dtype)
    prov = json.loads((Path(artifact["path"]) / "dflash_export.json").read_text())
    return model, artifact, DrafterConfig(**{k: v for k, v in prov["drafter"].items() if k in known})


def evaluate(cfg: EvalConfig) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_offline.devices import cpu_threads, pick_device
    from dflash_offline.drafter import DFlashDrafter
    from dflash_offline.loss import DEFAULT_GAMMA
    from dflash_offline.progress import log
    from dflash_offline.speculate import ExportedDrafter, greedy_generate, speculative_generate, summarize
    from dflash_offline.target import read_target_info

    run_dir = Path(cfg.run)
    ri = run_info(run_dir)
    target_dir, train = ri["target"], ri["train"]
    prompts_file = Path(cfg.prompts) if cfg.prompts else target_dir / "corpus" / "eval.jsonl"
    if not prompts_file.is_file():
        raise ValueError(f"prompts file {prompts_file} does not exist: pass --prompts= a chat JSONL")
    device = pick_device(cfg.device, "eval.device")
    dtype_name = compute_dtype(cfg.dtype, device, target_dir)
    dtype = getattr(torch, dtype_name)
    exact = dtype_name == "float32"
    if exact:
        exact_float32(device)
    cpu_threads(device, cfg.threads, log)  # one thread on a CPU run unless OMP_NUM_THREADS or --threads says

    # --- the drafter: the shipped artifact (small; validates the run before the target is loaded)
    model, artifact, dc = load_drafter(cfg, ri, run_dir, device, dtype, log)
    info = read_target_info(target_dir)
    if (info.hidden_size, info.num_layers) != (dc.hidden_size, dc.num_target_layers):
        raise ValueError(f"target {target_dir} (hidden {info.hidden_size}, {info.num_layers} layers) is not the "
                         f"drafter's (hidden {dc.hidden_size}, {dc.num_target_layers} layers)")

    # --- target
    log(f"loading target {target_dir} ({info.arch}, {info.num_layers} layers) on {device} in {dtype_name}"
        f"{' (exact mode)' if exact else f' (ties up to a logit margin of {cfg.tie_tol:g} allowed)'}")
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    if device.type == "cpu":
        target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
    else:  # straight onto the device (a 27B target never passes through host memory in full)
        target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype, device_map=str(device)).eval()
    embed_VH, head_VH = target.get_input_embeddings().weight, target.get_output_embeddings().weight

    # --- teacher-forced estimate: the same weights in the training forward
    tf = {"batches": 0}
    tf_cache = cfg.cache or ri["cache"]
    if cfg.tf_batches:
        gamma = float(train.get("gamma") or 0) or DEFAULT_GAMMA.get(dc.block_size, 7.0)
        with torch.device("meta"):
            tf_model = DFlashDrafter(dc).eval()
        tf_model.load_state_dict(model.state_dict(), strict=True, assign=True)  # shares the shipped tensors
        tf = teacher_forced(tf_model, embed_VH, head_VH, tf_cache, gamma, cfg.tf_batches, cfg.tf_rows,
                            cfg.num_anchors or int(train.get("num_anchors", 512)))
        del tf_model
    held_out = bool(cfg.cache) and Path(cfg.cache).resolve() != Path(ri["cache"]).resolve()
    tf.update(cache=str(tf_cache), held_out=held_out)

    eos = eos_ids(target, tok)
    prompts = read_prompts(prompts_file, cfg.num_prompts, cfg.turn, tok)
    drafter = ExportedDrafter(model, target)
    log(f"{len(prompts)} prompts from {prompts_file} (mean {sum(len(p['ids']) for p in prompts) / len(prompts):.0f} "
        f"tokens), ≤ {cfg.max_new_tokens} new tokens, block {dc.block_size}, eos {eos}, drafter "
        f"{artifact['path'] or 'untrained'}")

    # --- generate (one untimed warm-up of each path first)
    greedy_generate(target, prompts[0]["ids"], 2, eos)
    speculative_generate(target, drafter, prompts[0]["ids"], 2, eos)
    spec, alone, per_prompt, mismatches, ties, margins = [], [], [], [], [], []
    for i, p in enumerate(prompts):
        ref, rs = greedy_generate(target, p["ids"], cfg.max_new_tokens, eos)
        out, ss = speculative_generate(target, drafter, p["ids"], cfg.max_new_tokens, eos)
        equal = out == ref
        div = None if equal else divergence(target, p["ids"], out, ref)
        if div is not None:
            div["tie"] = not exact and div["margin"] is not None and div["margin"] <= cfg.tie_tol
            (ties if div["tie"] else mismatches).append(i)
            margins.append(math.inf if div["margin"] is None else div["margin"])
        spec.append(ss)
        alone.append(rs)
        per_prompt.append({"prompt_tokens": len(p["ids"]), "category": p["category"], "new_tokens": len(out),
                           "tau_mean": ss.tau_mean, "steps": ss.steps, "spec_s": ss.seconds, "target_s": rs.seconds,
                           "equal": equal, "divergence": div})
        what = "" if equal else (f", differs at token {div['at']} (logit margin "
                                 f"{math.inf if div['margin'] is None else div['margin']:.3g}: "
                                 f"{'rounding tie' if div['tie'] else 'MISMATCH'})")
        log(f"prompt {i + 1}/{len(prompts)}: {len(out)} tokens, τ {ss.tau_mean:.2f}, "
            f"{ss.tok_per_s:.1f} vs {rs.tok_per_s:.1f} tok/s{what}")
    s, a = summarize(spec), summarize(alone)
    cats = sorted({p["category"] for p in prompts if p["category"] is not None})
    by_category = {}
    for c in cats:
        sc = summarize([st for st, p in zip(spec, prompts, strict=True) if p["category"] == c])
        by_category[c] = {"prompts": sc["generations"], "verify_steps": sc["steps"], "tau_mean": sc["tau_mean"],
                          "accept_ge": sc["accept_ge"]}
    return {
        "run": str(run_dir), "artifact": artifact, "checkpoint": artifact.get("checkpoint"),
        "step": 0 if cfg.untrained else artifact["step"], "untrained": cfg.untrained,
        "target": str(target_dir), "arch": info.arch, "prompts": str(prompts_file), "num_prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens, "block_size": dc.block_size, "device": str(device),
        "dtype": dtype_name, "mode": "exact" if exact else "ties allowed", "rollback": spec[0].rollback,
        "tau_mean": s["tau_mean"], "tau_hist": s["tau_hist"], "accept_ge": s["accept_ge"],
        "by_category": by_category, "verify_steps": s["steps"], "new_tokens": s["new_tokens"],
        "draft_ms": s["draft_ms"], "verify_ms": s["verify_ms"], "rollback_ms": s["rollback_ms"],
        "spec_tok_per_s": s["tok_per_s"], "target_tok_per_s": a["tok_per_s"],
        "speedup": a["seconds"] / s["seconds"] if s["seconds"] > 0 else math.nan, **speedups(s, a),
        "spec_target_forwards": s["target_forwards"], "refeeds": s["refeeds"],
        "target_forwards_alone": a["target_forwards"], "lossless": not mismatches, "mismatches": mismatches,
        "exact": not mismatches and not ties, "rounding_ties": ties, "tie_tol": None if exact else cfg.tie_tol,
        "tie_margin_hist": margin_hist(margins), "teacher_forced": tf, "per_prompt": per_prompt,
        "config": as_dict(cfg), "time": time.time(),
    }


def table(r: dict) -> str:
    tf, art = r["teacher_forced"], r["artifact"]
    which = (f"untrained (seed {art['untrained_seed']}, modeling code {art['modeling_file']})" if r["untrained"]
             else f"{art['path']} (step {r['step']}, weights sha256 {art['weights_sha256'][:12]})")
    hist = " ".join(f"{k + 1}:{c}" for k, c in enumerate(r["tau_hist"]) if c)
    lines = [
        f"drafter {which} · target {r['target']} ({r['arch']}) · block {r['block_size']} · "
        f"{r['num_prompts']} prompts × ≤{r['max_new_tokens']} tokens · {r['device']} {r['dtype']} ({r['mode']})",
        f"  real τ (tokens per verify step)  {r['tau_mean']:.3f}   over {r['verify_steps']} steps   "
        f"histogram τ:count  {hist}",
        "  steps accepting ≥ k drafts  " + " ".join(f"{k + 1}:{x:.2f}" for k, x in enumerate(r["accept_ge"][:8]))
        + (" …" if len(r["accept_ge"]) > 8 else ""),
    ]
    if r["by_category"]:
        lines.append("  τ by category  " + " · ".join(f"{c} {v['tau_mean']:.2f} ({v['prompts']})"
                                                      for c, v in r["by_category"].items()))
    lines += [
        f"  per step: draft {r['draft_ms']:.2f} ms · verify {r['verify_ms']:.2f} ms · rollback "
        f"{r['rollback_ms']:.2f} ms · target alone {r['target_ms_per_token']:.2f} ms/token",
        f"  speculative {r['spec_tok_per_s']:.1f} tok/s · target alone {r['target_tok_per_s']:.1f} tok/s · "
        f"speed-up ×{r['speedup']:.2f} (wall clock) · engine estimate ×{r['speedup_engine_est']:.2f} "
        f"(τ/(1+draft/verify)) · step estimate ×{r['speedup_step_est']:.2f}",
        f"  target forwards {r['spec_target_forwards']} (rollback {r['rollback']}: {r['refeeds']} refeeds) vs "
        f"{r['target_forwards_alone']} alone",
    ]
    if tf.get("batches"):
        lines.append(f"  teacher-forced ({'held-out' if tf['held_out'] else 'training, NOT held out'} cache "
                     f"{tf['cache']}, {tf['blocks']} blocks): sim τ {tf['sim_tau']:.3f} · block τ "
                     f"{tf['block_tau']:.3f} · acc slots 1-4 {tf['acc'][:4]}")
    n_eq = r["num_prompts"] - len(r["mismatches"]) - len(r["rounding_ties"])
    h = r["tie_margin_hist"]
    lines.append(f"  lossless: {n_eq}/{r['num_prompts']} speculative outputs equal the target's greedy output"
                 + (f"; {len(r['rounding_ties'])} part at a rounding tie (logit margin <= {r['tie_tol']:g})"
                    if r["rounding_ties"] else "")
                 + ("" if r["lossless"] else f"; MISMATCH in prompts {r['mismatches']}")
                 + ("" if r["exact"] else "; margins " + " ".join(
                     f"≤{e:g}:{c}" for e, c in zip([*h["edges"], math.inf], h["counts"], strict=True) if c)))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from dflash_offline.manifest import write_json_atomic
    from dflash_offline.progress import unbuffered

    unbuffered()
    cfg = config_from_argv(EvalConfig, "eval", argv, __doc__)
    report = evaluate(cfg)
    out = Path(cfg.out) if cfg.out else Path(cfg.run) / ("eval-untrained.json" if cfg.untrained else "eval.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, report)
    print(table(report))
    print(out)
    if not report["lossless"]:
        what = "differs from" if report["mode"] == "exact" else "differs beyond a rounding tie from"
        print(f"error: speculative output {what} the target's greedy output in prompts {report['mismatches']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from dflash_offline.progress import run_cli

    run_cli(main)
