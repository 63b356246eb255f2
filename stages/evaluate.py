"""Evaluate a drafter by real speculative decoding with its target (the final τ), plus a teacher-forced estimate.

    python -m stages.evaluate --run=RUN --prompts=FILE.jsonl [--num_prompts=16 --max_new_tokens=128 --step=300]
                              [--untrained=1] [--cache=HELD_OUT_CACHE] [--out=FILE]

For each prompt (a chat record `{"messages": [...]}`, cut after its first — `--turn=last`: last — user turn and
rendered with the target's chat template and `add_generation_prompt=True`) the target generates greedily alone
and with the drafter (`dflash_offline.speculate`). Reported: real τ (tokens per target verify step) and its
histogram, tok/s of both and the speed-up, target forward counts, and the teacher-forced estimate (per-slot
accuracy → simulated τ, and the per-block τ) on a few batches of a hidden cache — the run's own training cache
unless `--cache=` names a held-out one (the report says which). Every speculative output must equal the target's
greedy output (the lossless check); otherwise the JSON is still written and the exit status is 1. A block forward
and token-by-token forwards round differently, so in bf16 two near-equal logits may swap: where outputs part, one
full forward of the target measures the logit margin between the two tokens, and a margin <= `tie_tol` (auto:
1e-3 in fp32, 0.25 in bf16) is reported as a rounding tie (`exact` false, `lossless` still true).

`--untrained=1` evaluates a freshly initialised drafter of the run's config and seed (the trainer's step 0), the
baseline a trained drafter must beat. The JSON goes to RUN/eval.json (RUN/eval-untrained.json) or `--out=`.
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


@dataclass
class EvalConfig:
    run: str  # run directory (config.json + checkpoints/) written by make train
    prompts: str = ""  # chat JSONL; empty = corpus/eval.jsonl beside the target (the demo target has one)
    num_prompts: int = 16  # prompts taken from the start of the file
    max_new_tokens: int = 128  # new tokens per prompt (the first, from the prefill, counts)
    turn: str = "first"  # the prompt ends after the "first" or "last" user turn of each chat
    step: int = -1  # checkpoint step; -1 = the latest
    untrained: bool = False  # evaluate a fresh drafter (the run's config and seed, step 0) instead
    cache: str = ""  # hidden cache for the teacher-forced estimate; empty = the run's training cache (not held out)
    tf_batches: int = 4  # teacher-forced batches (0 = skip the estimate)
    tf_rows: int = 1  # rows per teacher-forced batch
    num_anchors: int = 0  # anchors per row for the estimate; 0 = the run's num_anchors
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    dtype: str = "auto"  # "bf16" / "fp32" for target and drafter; auto = bf16 on cuda, fp32 on cpu
    threads: int = 0  # CPU threads for torch (0 = 1 on a CPU run unless OMP_NUM_THREADS is set, else torch's default)
    out: str = ""  # JSON report path; empty = RUN/eval.json (RUN/eval-untrained.json)
    tie_tol: float = -1.0  # a mismatch counts as a rounding tie if the two tokens' logits differ by <= this; -1 = auto

    def resolve(self) -> EvalConfig:
        check_choice("eval.turn", self.turn, ("first", "last"))
        check_choice("eval.dtype", self.dtype, ("auto", "bf16", "fp32"))
        check_setting(self.device, "eval.device")
        for name in ("num_prompts", "max_new_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"eval.{name} must be > 0, got {getattr(self, name)}")
        if self.tf_batches < 0 or self.tf_rows < 1:
            raise ConfigError(f"eval.tf_batches must be >= 0 and eval.tf_rows >= 1, got {self.tf_batches}, "
                              f"{self.tf_rows}")
        return self


# --- the run ---------------------------------------------------------------------------------------------------


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
    return {"config": cfg, "train": train, "cache": train["cache"], "target": resolve_checkpoint(target, need=("config", "weights", "tokenizer"), field="eval target")}


def render_prompt(messages: list[dict], tokenizer, turn: str = "first", tools=None) -> list[int] | None:
    """Token ids of `messages` up to the first/last user turn + the generation prompt; None without a user turn."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return None
    cut = users[0] if turn == "first" else users[-1]
    kw = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages[: cut + 1], add_generation_prompt=True, tokenize=False, **kw)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def read_prompts(path: Path, n: int, turn: str, tokenizer) -> list[list[int]]:
    """Token ids of the first `n` usable chats: messages up to the first/last user turn + the generation prompt."""
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
                out.append(ids)
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


def divergence(target, prompt: list[int], out: list[int], ref: list[int]) -> dict:
    """Where two generations part, and the target's logit margin between the two tokens there (one full forward)."""
    import torch

    j = next(j for j, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b)
    ids = torch.tensor([prompt + ref[:j]], device=next(target.parameters()).device)
    with torch.no_grad():
        z = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    return {"at": j, "spec_token": out[j], "target_token": ref[j], "margin": float((z[out[j]] - z[ref[j]]).abs()),
            "full_forward_token": int(z.argmax())}


def teacher_forced(drafter, cache_dir, gamma, batches: int, rows: int, num_anchors: int, seed: int = 0) -> dict:
    """Per-slot accuracy, simulated τ and mean per-block τ of `drafter` on `batches` batches of a hidden cache."""
    import torch

    from dflash_offline import anchors as anc
    from dflash_offline.dataset import HiddenStream, open_hidden_cache
    from dflash_offline.loss import block_ce_loss, block_tau, simulated_acceptance_length, slot_accuracy

    cfg, dev = drafter.cfg, drafter.embed.device
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
            masks = drafter.model.build_masks(b["doc_ids"], a_BA, keep_BA, "dense")
            h = drafter.model(b["hidden"], b["input_ids"], b["position_ids"], a_BA, keep_BA, drafter.embed, masks,
                              "dense")
            out = block_ce_loss(h, drafter.lm_head, labels, gamma=gamma)
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


def evaluate(cfg: EvalConfig) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_offline.checkpoint import find_checkpoint
    from dflash_offline.devices import cpu_threads, pick_device
    from dflash_offline.drafter import DrafterConfig
    from dflash_offline.loss import DEFAULT_GAMMA
    from dflash_offline.progress import log
    from dflash_offline.speculate import Drafter, greedy_generate, speculative_generate, summarize
    from dflash_offline.target import read_target_info

    run_dir = Path(cfg.run)
    ri = run_info(run_dir)
    target_dir, train = ri["target"], ri["train"]
    prompts_file = Path(cfg.prompts) if cfg.prompts else target_dir / "corpus" / "eval.jsonl"
    if not prompts_file.is_file():
        raise ValueError(f"prompts file {prompts_file} does not exist: pass --prompts= a chat JSONL")
    device = pick_device(cfg.device, "eval.device")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        cfg.dtype if cfg.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")]
    cpu_threads(device, cfg.threads, log)  # one thread on a CPU run unless OMP_NUM_THREADS or --threads says

    # --- drafter (small; validates the run before the target is loaded)
    if cfg.untrained:
        dc = DrafterConfig(**ri["config"]["drafter"])
        drafter = Drafter.untrained(dc, target_dir, seed=int(train.get("seed", 0)), device=device, dtype=dtype)
        ckpt, step = None, 0
    else:
        ckpt = find_checkpoint(run_dir, None if cfg.step < 0 else cfg.step)
        drafter = Drafter.from_checkpoint(ckpt, target_dir, device=device, dtype=dtype)
        step = json.loads((ckpt / "meta.json").read_text())["step"]
    dc = drafter.cfg
    info = read_target_info(target_dir)
    if (info.hidden_size, info.num_layers) != (dc.hidden_size, dc.num_target_layers):
        raise ValueError(f"target {target_dir} (hidden {info.hidden_size}, {info.num_layers} layers) is not the "
                         f"drafter's (hidden {dc.hidden_size}, {dc.num_target_layers} layers)")

    # --- teacher-forced estimate
    tf = {"batches": 0}
    tf_cache = cfg.cache or ri["cache"]
    if cfg.tf_batches:
        gamma = float(train.get("gamma") or 0) or DEFAULT_GAMMA.get(dc.block_size, 7.0)
        tf = teacher_forced(drafter, tf_cache, gamma, cfg.tf_batches, cfg.tf_rows,
                            cfg.num_anchors or int(train.get("num_anchors", 512)))
    held_out = bool(cfg.cache) and Path(cfg.cache).resolve() != Path(ri["cache"]).resolve()
    tf.update(cache=str(tf_cache), held_out=held_out)

    # --- target
    log(f"loading target {target_dir} ({info.arch}, {info.num_layers} layers) on {device} in {dtype}")
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    if device.type == "cpu":
        target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
    else:  # straight onto the device (a 27B target never passes through host memory in full)
        target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype, device_map=str(device)).eval()
    eos = eos_ids(target, tok)
    prompts = read_prompts(prompts_file, cfg.num_prompts, cfg.turn, tok)
    log(f"{len(prompts)} prompts from {prompts_file} (mean {sum(map(len, prompts)) / len(prompts):.0f} tokens), "
        f"≤ {cfg.max_new_tokens} new tokens, block {dc.block_size}, eos {eos}")

    # --- generate (one untimed warm-up of each path first)
    greedy_generate(target, prompts[0], 2, eos)
    speculative_generate(target, drafter, prompts[0], 2, eos)
    tie_tol = cfg.tie_tol if cfg.tie_tol >= 0 else (1e-3 if dtype == torch.float32 else 0.25)
    spec, alone, per_prompt, mismatches, ties = [], [], [], [], []
    for i, p in enumerate(prompts):
        ref, rs = greedy_generate(target, p, cfg.max_new_tokens, eos)
        out, ss = speculative_generate(target, drafter, p, cfg.max_new_tokens, eos)
        equal = out == ref
        div = None if equal else divergence(target, p, out, ref)
        if div is not None:
            div["tie"] = div["margin"] <= tie_tol
            (ties if div["tie"] else mismatches).append(i)
        spec.append(ss)
        alone.append(rs)
        per_prompt.append({"prompt_tokens": len(p), "new_tokens": len(out), "tau_mean": ss.tau_mean,
                           "steps": ss.steps, "spec_s": ss.seconds, "target_s": rs.seconds, "equal": equal,
                           "divergence": div})
        what = "" if equal else (f", differs at token {div['at']} (logit margin {div['margin']:.3g}: "
                                 f"{'rounding tie' if div['tie'] else 'MISMATCH'})")
        log(f"prompt {i + 1}/{len(prompts)}: {len(out)} tokens, τ {ss.tau_mean:.2f}, "
            f"{ss.tok_per_s:.1f} vs {rs.tok_per_s:.1f} tok/s{what}")
    s, a = summarize(spec), summarize(alone)
    return {
        "run": str(run_dir), "checkpoint": str(ckpt) if ckpt else None, "step": step, "untrained": cfg.untrained,
        "target": str(target_dir), "arch": info.arch, "prompts": str(prompts_file), "num_prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens, "block_size": dc.block_size, "device": str(device),
        "dtype": str(dtype).removeprefix("torch."), "rollback": spec[0].rollback,
        "tau_mean": s["tau_mean"], "tau_hist": s["tau_hist"], "verify_steps": s["steps"],
        "new_tokens": s["new_tokens"], "spec_tok_per_s": s["tok_per_s"], "target_tok_per_s": a["tok_per_s"],
        "speedup": a["seconds"] / s["seconds"] if s["seconds"] > 0 else math.nan,
        "spec_target_forwards": s["target_forwards"], "refeeds": s["refeeds"],
        "target_forwards_alone": a["target_forwards"], "lossless": not mismatches, "mismatches": mismatches,
        "exact": not mismatches and not ties, "rounding_ties": ties, "tie_tol": tie_tol,
        "teacher_forced": tf, "per_prompt": per_prompt, "config": as_dict(cfg), "time": time.time(),
    }


def table(r: dict) -> str:
    tf = r["teacher_forced"]
    which = "untrained (step 0)" if r["untrained"] else f"step {r['step']}"
    hist = " ".join(f"{k + 1}:{c}" for k, c in enumerate(r["tau_hist"]) if c)
    lines = [
        f"drafter {r['run']} {which} · target {r['target']} ({r['arch']}) · block {r['block_size']} · "
        f"{r['num_prompts']} prompts × ≤{r['max_new_tokens']} tokens · {r['device']} {r['dtype']}",
        f"  real τ (tokens per verify step)  {r['tau_mean']:.3f}   over {r['verify_steps']} steps   "
        f"histogram τ:count  {hist}",
        f"  speculative {r['spec_tok_per_s']:.1f} tok/s · target alone {r['target_tok_per_s']:.1f} tok/s · "
        f"speed-up ×{r['speedup']:.2f}",
        f"  target forwards {r['spec_target_forwards']} (rollback {r['rollback']}: {r['refeeds']} refeeds) vs "
        f"{r['target_forwards_alone']} alone",
    ]
    if tf.get("batches"):
        lines.append(f"  teacher-forced ({'held-out' if tf['held_out'] else 'training, NOT held out'} cache "
                     f"{tf['cache']}, {tf['blocks']} blocks): sim τ {tf['sim_tau']:.3f} · block τ "
                     f"{tf['block_tau']:.3f} · acc slots 1-4 {tf['acc'][:4]}")
    n_eq = r["num_prompts"] - len(r["mismatches"]) - len(r["rounding_ties"])
    lines.append(f"  lossless: {n_eq}/{r['num_prompts']} speculative outputs equal the target's greedy output"
                 + (f"; {len(r['rounding_ties'])} part at a rounding tie (logit margin <= {r['tie_tol']:g})"
                    if r["rounding_ties"] else "")
                 + ("" if r["lossless"] else f"; MISMATCH in prompts {r['mismatches']}"))
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
        print(f"error: speculative output differs from the target's greedy output in prompts {report['mismatches']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from dflash_offline.progress import run_cli

    run_cli(main)
