"""What `evalrun.py` measures, as pieces that take plain values: the run and the artifact, the prompts,
the lossless check, the estimates, and the report.

The artifact is what users ship: `export_for_eval` takes an export directory as it is when it holds an export of
this run (and of the step asked for), else writes a fresh one; the decoding loops themselves live in `speculate.py`
(the engine's side). Prompts are chat records cut after their first or last user turn and rendered with the
target's chat template and the generation prompt (`render_prompt`). Where a speculative output parts from the
target's greedy output, `divergence` runs one full forward of the target to the parting token and measures its
logit margin there: in bfloat16 a small margin is a rounding tie between a block forward and token-by-token
forwards, not a fault (`lossless` counts both and bins the margins by `MARGIN_EDGES`). `teacher_forced` runs the
same weights in the training forward on a hidden cache (per-slot accuracy → simulated τ, per-block τ), and
`speedups` turns measured times into speed-up estimates. `decode_summary` and `lossless` build the JSON
report's measured fields; `table` is its printed summary. torch and transformers are imported where used, so
`--help` stays fast.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

MARGIN_EDGES = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0, 2.0)  # bf16 logits of 8..64 step 1/16..1/4


# --- the run, the artifact, the prompts ------------------------------------------------------------------------


def run_info(run_dir: Path, target: str = "") -> dict:
    """The run's resolved config, its training cache and its target checkpoint: `target` (eval's --target), else the
    run's (its config.json records it; a run made before it did: its cache's, while the cache is there). The cache:
    as the run named it, else its absolute path as recorded (another working directory)."""
    from .cache.manifest import read_manifest
    from .export import run_cache
    from .targetid import resolve_checkpoint

    cfg_file = run_dir / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{cfg_file} does not exist: pass --run= a run directory written by make train")
    cfg = json.loads(cfg_file.read_text())
    train = cfg["train"]
    cache = run_cache(cfg) or train["cache"]
    if not (target := target or cfg.get("target") or train.get("target")):  # (recorded: an absolute path)
        if not run_cache(cfg):
            raise ValueError(f"{run_dir} names no target and its training cache {train['cache']} is gone: pass "
                             f"--target= (make eval ARGS=--target=DIR) the checkpoint it was trained for")
        target = read_manifest(cache)["config"]["extract"]["target"]
    return {"config": cfg, "train": train, "cache": cache, "template_kwargs": trained_settings(cfg, train),
            "target": resolve_checkpoint(target, need=("config", "weights", "tokenizer"), field="eval target")}


def trained_on(prompts: Path, cache) -> str | None:
    """Why the eval prompts are the drafter's training prompts, as the run's caches record its corpus — `prompts` is
    one of the token cache's corpus files, or the file whose prompts `make regen` answered into one of them (its
    stats), not only the part it held out — else None (not, or not known: a cache or the files gone)."""
    from .cache.manifest import ManifestError, read_manifest, token_cache
    from .corpus import expand_paths
    from .regen import stats_path

    def same(a, b) -> bool:
        with contextlib.suppress(OSError):
            return Path(a).samefile(b)
        return False

    try:
        _, tm = token_cache(Path(cache), read_manifest(cache, kind="hidden"))
        corpus = expand_paths(tm["config"]["corpus"])
    except (ManifestError, ValueError, OSError, KeyError, TypeError):  # (CorpusError: a ValueError)
        return None
    for f in corpus:
        if same(f, prompts):
            return f"{prompts} is a file of the drafter's training corpus"
        try:
            conf = json.loads(stats_path(f).read_text())["config"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if any(same(src, prompts) for src in conf.get("corpus") or []):
            held, n = conf.get("heldout") or {}, conf.get("num_docs") or 0
            part = f"its first {n:,} records" if n else "all its records"
            if held.get("every"):
                part += f" but 1 in {held['every']}, which make regen held out into {held.get('out')} (pass that file)"
            return f"{f}, which the drafter trained on, holds the target's answers to the prompts of {prompts} ({part})"
    return None


def trained_settings(cfg: dict, train: dict) -> dict:
    """The chat template settings the run's corpus was rendered with (tokenize.template_kwargs): its config.json's,
    else (a run made before it recorded them) its cache's while the cache is there, else none."""
    from .cache.manifest import read_manifest

    if "template_kwargs" in cfg:
        return cfg["template_kwargs"] or {}
    from .export import run_cache

    try:
        return read_manifest(run_cache(dict(cfg, train=train)))["producer"]["tokens"]["producer"].get(
            "template_kwargs") or {}
    except (ValueError, KeyError, TypeError, OSError):  # (TypeError: no cache, None)
        return {}


def export_for_eval(export_dir: str, step: int, run_dir: Path, log) -> Path:
    """The export directory to measure: `export_dir` (`--export`) as it is when it holds an export of this run, else a
    fresh export of the run's checkpoint `step` (`--step`, -1 = the latest) into `export_dir` or RUN/eval-export."""
    from .export import PROVENANCE, export, provenance_paths

    d = Path(export_dir) if export_dir else run_dir / "eval-export"
    if export_dir and (d / PROVENANCE).is_file():
        prov = json.loads((d / PROVENANCE).read_text())
        if (its := provenance_paths(d, prov)["run"]) != run_dir.resolve():
            raise ValueError(f"{d} is an export of run {its}, not of RUN={run_dir}: pass that RUN=")
        if step >= 0 and prov.get("step") != step:
            raise ValueError(f"{d} holds step {prov.get('step')}, not --step={step} (make STEP=): leave EXPORT= "
                             f"empty to export step {step}, or drop STEP=")
        return d
    if export_dir and d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise ValueError(f"{d} is not an export (no {PROVENANCE}): pass EXPORT= a directory written by make export, "
                         f"a new directory, or nothing")
    out = export(run_dir, d, step=None if step < 0 else step)
    log(f"exported {run_dir} step {json.loads((out / PROVENANCE).read_text())['step']} to {out}")
    return out


def render_prompt(messages: list[dict], tokenizer, turn: str = "first", tools=None,
                  settings: dict | None = None) -> list[int] | None:
    """Token ids of `messages` up to the first/last user turn + the generation prompt (the chat template's
    `settings`, e.g. Qwen3.8's reasoning_effort, as served); None without a user turn."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return None
    cut = users[0] if turn == "first" else users[-1]
    kw = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages[: cut + 1], add_generation_prompt=True, tokenize=False, **kw,
                                         **(settings or {}))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def read_prompts(path: Path, n: int, turn: str, tokenizer, settings: dict | None = None,
                 trained: dict | None = None) -> list[dict]:
    """The first `n` usable chats as {"ids": messages up to the first/last user turn + the generation prompt,
    "category": the record's `category` or None, "template": the chat template settings it was rendered with}. A
    record `make regen` held out is rendered as its answers were generated (its mark's `template`, e.g.
    enable_thinking), any other with `trained` (the settings the training corpus was rendered with), `settings`
    (--template_kwargs) over either. A line that is not a chat record is one error naming file:line and what is
    wrong (read before the target loads, so in seconds)."""
    from .chat import RecordError, validate_messages
    from .corpus import heldout_mark, jsonl_lines, parse

    out = []
    for lineno, raw in jsonl_lines(path):
        if len(out) >= n:
            break
        try:
            rec = parse(raw)
            msgs = validate_messages(rec, answered=False)  # (rendered as stage 1a renders a record's turns)
        except RecordError as e:
            raise ValueError(f"{path}:{lineno}: {e.reason}: {e.detail} (prompts must be chat records, one JSON "
                             f"object a line: fix or remove the line)") from None
        held = (heldout_mark(rec) or {}).get("template") or {}
        if not isinstance(held, dict):
            raise ValueError(f"{path}:{lineno}: heldout.template is a {type(held).__name__}; expected the chat "
                             f"template settings make regen wrote (an object): fix or remove the line")
        template = {**(held if heldout_mark(rec) else trained or {}), **(settings or {})}
        ids = render_prompt(msgs, tokenizer, turn, rec.get("tools"), template)
        if ids is not None:
            cat = rec.get("category")
            out.append({"ids": ids, "category": None if cat is None else str(cat), "template": template})
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


def parts_at(out: list[int], ref: list[int]) -> int:
    """The first position where two generations differ (the shorter one's length where one is the other's start)."""
    return next((j for j, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), min(len(out), len(ref)))


def divergence(target, prompt: list[int], out: list[int], ref: list[int]) -> dict:
    """Where two generations part, and the target's margin there (one full forward over the prompt and the common
    prefix): the top logit minus the lower of the two tokens' logits — the top-2 margin when they are its top two."""
    import torch

    j = parts_at(out, ref)
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
    """Exact mode on CUDA: no TF32 in matmuls or convolutions (torch's defaults allow it in cuDNN convolutions), nor
    in Triton kernels' fp32 dot products (fla's Gated DeltaNet kernels leave the precision to Triton's default)."""
    import os

    import torch

    if device.type == "cuda":
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

def lossless(mismatches: list[int], ties: list[int], margins: list[float], exact: bool, tie_tol: float) -> dict:
    """The report's lossless check: prompts whose outputs differ beyond a tie (`mismatches`) or at a rounding tie
    (`ties`), and the histogram of the target's margins at every difference."""
    return {"lossless": not mismatches, "mismatches": mismatches, "exact": not mismatches and not ties,
            "rounding_ties": ties, "tie_tol": None if exact else tie_tol, "tie_margin_hist": margin_hist(margins)}


# --- estimates -------------------------------------------------------------------------------------------------


def teacher_forced(model, embed_VH, lm_head_VH, cache_dir, gamma, batches: int, rows: int, num_anchors: int,
                   seed: int = 0) -> dict:
    """Per-slot accuracy, simulated τ and mean per-block τ of the training forward `model` (a DFlashDrafter) on
    `batches` batches of a hidden cache; a projected cache's taps are lifted to P z (`projection.lift`) for a
    full-width drafter (an exported or folded one), and read as they are by a drafter of projected taps."""
    import torch

    from . import anchors as anc
    from .dataset import HiddenStream, open_hidden_cache
    from .loss import block_ce_loss, block_tau, simulated_acceptance_length, slot_accuracy

    cfg, dev = model.cfg, embed_VH.device
    info = open_hidden_cache(cache_dir, cfg.target_layer_ids, hidden_size=cfg.hidden_size)
    stream = HiddenStream(info, rows, seed=seed, device=dev, prefetch=0)
    lift = None
    if info.projection and not cfg.tap_width:
        from .cache.projection_file import read_projection
        from .projection import lift

        Ps = read_projection(cache_dir, cfg.target_layer_ids, info.projection)
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
            hidden = b["hidden"] if lift is None else lift(b["hidden"], Ps)
            h = model(hidden, b["input_ids"], b["position_ids"], a_BA, keep_BA, embed_VH, masks, "dense")
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


def prompt_ids_digest(prompts: list[dict]) -> str:
    """SHA-256 of the prompts' token ids, in order: two evaluations decoded the same prompts iff theirs are equal."""
    import hashlib

    return hashlib.sha256(json.dumps([p["ids"] for p in prompts]).encode()).hexdigest()


def baseline_key(cfg, target_dir: Path, prompts: list[dict], eos: list[int], dtype: str, device) -> dict:
    """What the target-alone decodes depend on: the target's weights and config, the prompts' tokens, eos, the
    budget, the dtype and the device type (and the library versions that compute them: torch, transformers and the
    kernel packages transformers picks up when installed — fla, causal_conv1d, flash_attn —, and on a CPU the thread
    count, which can change float32 sums)."""
    from importlib import metadata

    import torch
    import transformers

    from .autotune import pinned_table
    from .targetid import target_fingerprint

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    return {"target": target_fingerprint(target_dir), "prompt_ids_sha256": prompt_ids_digest(prompts), "eos": list(eos),
            "max_new_tokens": cfg.max_new_tokens, "dtype": dtype, "device": name, "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kernels": {d: version(d) for d in ("flash-linear-attention", "fla-core", "causal-conv1d", "flash-attn")},
            "autotune_pin": pinned_table()}


def read_baseline(path: Path, key: dict, log) -> list | None:
    """[(ids, GenStats)] per prompt from `path` when it was made with `key`, else None (and why, logged)."""
    from dataclasses import fields

    from .speculate import GenStats

    if not path.is_file():
        log(f"baseline {path}: not there yet; the target-alone decodes run and are written there")
        return None
    data = json.loads(path.read_text())
    if data.get("key") != key:
        diff = sorted(k for k in key if data.get("key", {}).get(k) != key[k])
        log(f"baseline {path} was made for another {', '.join(diff)}: the target-alone decodes run again")
        return None
    names = {f.name for f in fields(GenStats)}
    log(f"baseline {path}: reusing the target-alone decodes of {len(data['decodes'])} prompts")
    return [(d["ids"], GenStats(**{k: v for k, v in d["stats"].items() if k in names})) for d in data["decodes"]]


def write_baseline(path: Path, key: dict, refs: list[list[int]], alone: list) -> None:
    from .cache.fsio import write_json_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"key": key, "decodes": [{"ids": r, "stats": s.to_dict()} for r, s in zip(refs, alone,
                                                                                                    strict=True)]})


KEEP_BASELINES = 8  # target-alone decode files a run keeps (RUN/eval-baselines: the most recently written or reused)


def prune_baselines(current: Path, log, most: int | None = None) -> int:
    """Mark `current` (a file of a run's baseline folder, named by its key: 16 hex digits) used now and remove all but
    the `most` (`KEEP_BASELINES`) most recently used such files of its folder; returns how many went. Housekeeping:
    a file another evaluation removed meanwhile, or one this user may not touch, is passed over, never an error."""
    import os
    import re

    def used(f: Path) -> float:
        try:
            return f.stat().st_mtime
        except OSError:
            return -1.0

    most = KEEP_BASELINES if most is None else most
    with contextlib.suppress(OSError):
        os.utime(current)
    files = sorted((f for f in current.parent.glob("*.json") if re.fullmatch(r"[0-9a-f]{16}", f.stem)), key=used,
                   reverse=True)
    gone = 0
    for f in files[most:]:
        if f != current:
            with contextlib.suppress(OSError):
                f.unlink()
                gone += 1
    if gone:
        log(f"{current.parent}: removed {gone} target-alone decode file(s) not used lately (the {most} most "
            f"recently used are kept)")
    return gone


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


# --- the report ------------------------------------------------------------------------------------------------


def decode_summary(taus: list, spec: list, alone: list, prompts: list[dict]) -> dict:
    """The report's fields of the decodes (`GenStats` per prompt): τ, its histogram and τ per prompt category from
    `taus` (the speculative decodes, or their replays); ms per phase, tok/s, speed-ups and target forwards from the
    real speculative decodes `spec` against the target alone on the same prompts (`alone`; None where nothing was
    decoded for real)."""
    from .speculate import summarize

    t = summarize(taus)
    out = {"rollback": spec[0].rollback if spec else "replay", "tau_mean": t["tau_mean"],
           "tau_emitted": t["tau_emitted"], "tau_hist": t["tau_hist"], "accept_ge": t["accept_ge"],
           "by_category": by_category(taus, prompts[: len(taus)]), "verify_steps": t["steps"],
           "new_tokens": t["new_tokens"]}
    speed = ("draft_ms", "verify_ms", "rollback_ms", "spec_tok_per_s", "target_tok_per_s", "speedup",
             "target_ms_per_token", "speedup_engine_est", "speedup_step_est", "spec_target_forwards", "refeeds",
             "target_forwards_alone")
    if not spec:
        return {**out, **dict.fromkeys(speed)}
    s, a = summarize(spec), summarize(alone[: len(spec)])
    return {
        **out, "draft_ms": s["draft_ms"], "verify_ms": s["verify_ms"], "rollback_ms": s["rollback_ms"],
        "spec_tok_per_s": s["tok_per_s"], "target_tok_per_s": a["tok_per_s"],
        "speedup": a["seconds"] / s["seconds"] if s["seconds"] > 0 else math.nan, **speedups(s, a),
        "spec_target_forwards": s["target_forwards"], "refeeds": s["refeeds"],
        "target_forwards_alone": a["target_forwards"],
    }


def by_category(spec: list, prompts: list[dict]) -> dict:
    """τ and acceptance shares of the speculative decodes pooled per prompt category (prompts without one left out)."""
    from .speculate import summarize

    cats = sorted({p["category"] for p in prompts if p["category"] is not None})
    out = {}
    for c in cats:
        sc = summarize([st for st, p in zip(spec, prompts, strict=True) if p["category"] == c])
        none = not sc["steps"]  # (every answer of the category ended at its first token: τ undefined, not nan)
        out[c] = {"prompts": sc["generations"], "verify_steps": sc["steps"],
                  **{k: None if none else sc[k] for k in ("tau_mean", "tau_emitted", "accept_ge")}}
    return out


def tau_text(tau) -> str:
    """τ to two decimals; "—" where no verify step measured it (None)."""
    return "—" if tau is None else f"{tau:.2f}"


def table(r: dict) -> str:
    tf, art = r["teacher_forced"], r["artifact"]
    which = (f"untrained (seed {art['untrained_seed']}, modeling code {art['modeling_file']})" if r["untrained"]
             else f"{art['path']} (step {r['step']}, weights sha256 {art['weights_sha256'][:12]})")
    hist = " ".join(f"{k + 1}:{c}" for k, c in enumerate(r["tau_hist"]) if c)
    lines = [
        f"drafter {which} · target {r['target']} ({r['arch']}) · block {r['block_size']} · "
        f"{r['num_prompts']} prompts × ≤{r['max_new_tokens']} tokens · {r['device']} {r['dtype']} ({r['mode']})",
        f"  {'replayed' if r.get('tau_from') == 'replay' else 'real'} τ (drafts accepted + 1 per verify step)  "
        f"{r['tau_mean']:.3f}   over {r['verify_steps']} steps   histogram τ:count  {hist}",
        f"  tokens emitted per verify step  {r.get('tau_emitted', math.nan):.3f}   (τ without what a last step accepted "
        f"past eos or the budget)",
        "  steps accepting ≥ k drafts  " + " ".join(f"{k + 1}:{x:.2f}" for k, x in enumerate(r["accept_ge"][:8]))
        + (" …" if len(r["accept_ge"]) > 8 else ""),
    ]
    if r["by_category"]:
        lines.append("  τ by category  " + " · ".join(f"{c} {tau_text(v['tau_mean'])} ({v['prompts']})"
                                                      for c, v in r["by_category"].items()))
    n_real = r.get("lossless_prompts", r["num_prompts"])
    if r.get("tau_from") == "replay":
        agree = [p["replay_agrees"] for p in r["per_prompt"] if "replay_agrees" in p]
        lines.append(f"  τ replayed on the target's greedy output (one target forward per prompt); {len(agree)} "
                     f"prompts also decoded for real" + (f": the replay took their steps in {sum(agree)}/{len(agree)}"
                                                          if agree else ""))
    if n_real:
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
    n_eq = n_real - len(r["mismatches"]) - len(r["rounding_ties"])
    h = r["tie_margin_hist"]
    lines.append(f"  lossless: {n_eq}/{n_real} speculative outputs equal the target's greedy output"
                 + (f"; {len(r['rounding_ties'])} part at a rounding tie (logit margin <= {r['tie_tol']:g})"
                    if r["rounding_ties"] else "")
                 + ("" if r["lossless"] else f"; MISMATCH in prompts {r['mismatches']}")
                 + ("" if r["exact"] else "; margins " + " ".join(
                     f"≤{e:g}:{c}" for e, c in zip([*h["edges"], math.inf], h["counts"], strict=True) if c)))
    return "\n".join(lines)
