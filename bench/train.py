"""Benchmark stage 2 at the 27B drafter shapes: H 5120, 5 layers, 32/8 heads × 128, FFN 17408, vocab 248320,
S = 2048, 512 anchors, block 16 (random weights and random cached states); `--shape=testbed` at the testbed's
(H 768, 12/4 heads × 64, FFN 2560, vocab 16384, 4 rows a step: where its drafters' time goes).

    python -m bench.train [--steps=40]        (GPU)
    python -m bench.train --precision=fp8     (GPU: ours in bf16, then in fp8; fp8 / bf16 rates)
    python -m bench.train --tiny              (CPU smoke run; with --precision=fp8, float8 emulated)
    python -m bench.train --quant=fp4         (GPU: ours on a bf16 cache, then on the same states stored as fp4 and
                                               decoded by the trainer's reader: the encoded / bf16-cache rates)
    python -m bench.train --project_dims=2560 --quant=fp8   (GPU: the same with projected taps, k a tap; no baseline)
    python -m bench.train --precision=fp8 --alone --skip_baseline   (ours in fp8 only: one run a process, as
                                               `bench.train_compare` runs each variant)
    python -m bench.train --precision=fp8 --loss_logits=fp8 --weighting=dpace --quant=fp4 --alone --skip_baseline
                                              (GPU: the Qwen3.5/3.6-27B recipes' step; --weighting=decay: theirs
                                               with decay's epilogue)
    python -m bench.train --recipe=manifests/qwen3.8-27b-dflash2.toml --seq_len=4096 --anchors=64 --skip_baseline
                                              (GPU: the recipe's drafter — block 8, 5 sliding layers, DFlash2 — as
                                               DFlash, then as DFlash2: the DFlash2 / DFlash rates at its shapes)

Ours: `dflash_offline.trainrun.run` as a user runs it (compiled flex attention, chunked one-pass lm_head + CE, streaming
loader) on a synthetic hidden cache and a synthetic target holding only embed + lm_head. Baseline, same process:
a straightforward in-tree step — the eager drafter with the dense-mask SDPA path and full-vocabulary logits
computed chunk by chunk under activation checkpointing. Reports context tokens/s, ms/step, fraction of the FLOP
ideal (at 790 TFLOP/s, the bf16 dense peak, also for fp8), peak memory, SM clock and board power, and
ours/baseline; `--precision=fp8` adds ours with float8 linears (`precision=fp8`) and the fp8 / bf16 ratios; a cache
encoding other than bf16 (`--quant`, `--project_dims`) runs ours on a bf16 cache first, then on the encoded one, and
gives the encoded / bf16-cache ratios (what decoding on the reader's side stream costs the step). Compared runs go
A, B, A: the bf16 run again last, the ratios against the mean of its two runs, and their own ratio as the drift.
All in one process: `bench.train_compare` runs each precision variant in a process of its own (`--alone`).
`--recipe=FILE` takes the drafter a recipe's [train] trains (its DrafterSettings but the taps and mask token, which
are the synthetic cache's, and its γ and selector weight; --tiny keeps the tiny sizes) in place of the default
shape; a DFlash2 drafter (`--variant=dflash2`, or the recipe's) is timed against DFlash at the same shapes (A, B, A:
DFlash, DFlash2, DFlash again) unless `--alone`. Each FLOP fraction counts its own variant's FLOPs
(`metrics.flop_terms`: DFlash2's with its conv and selector); the rates give what they cost.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import shutil
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

from bench import git_commit
from bench.extract import TEXT_27B, TEXT_TINY, write_config
from bench.gpu import GpuSampler
from dflash_offline.cache.encodings import ENCODINGS
from fixtures.fake_cache import bind_to_target, fake_target, make_fake_cache

DRAFTER_27B = dict(num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=17408)
DRAFTER_TINY = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)
SIZES = tuple(DRAFTER_27B)  # what --tiny keeps its own of, whatever the recipe says
LAYERS = [1, 16, 31, 46, 61]


TESTBED_RECIPE = "manifests/testbed.toml"


def testbed_shape() -> tuple[dict, dict]:
    """The testbed's target text config (`testbed.target.DIMS`, vocabulary 16,384) and its drafter's sizes (the
    target's FFN width; layers and heads from the testbed recipe)."""
    from testbed.config import TestbedConfig
    from testbed.target import DIMS

    text = {**TEXT_27B, **DIMS, "vocab_size": TestbedConfig().vocab, "eos_token_id": 2}
    return text, {**DRAFTER_27B, "intermediate_size": DIMS["intermediate_size"]}


def synthetic_target(path: Path, text: dict, device) -> Path:
    """config.json + a safetensors file with just the embedding and lm_head (all the trainer reads)."""
    write_config(path, text)
    return fake_target(path, text["vocab_size"], text["hidden_size"], device)


def chat_token_rows(first_id: int, n: int, seq_len: int, gen: torch.Generator, vocab: int) -> dict:
    """Rows packed from documents of log-normal length (median 400 tokens, as `bench.extract`), each a prompt (its
    first 30 %, no loss) and an answer (loss): single-turn chat, unlike the default rows (two documents per row,
    a random 70 % of tokens supervised, so ~27 % of block slots have no label)."""
    from bench.extract import lognormal_packed_rows
    from dflash_offline.packing import materialize

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    # the packer completes whole-row documents first: skip its first 64 rows, then every 16th row samples its
    # steady state
    a, _ = materialize(lognormal_packed_rows(64 + 16 * n, seq_len, vocab, seed=seed)[64 : 64 + 16 * n : 16],
                       seq_len, 0)
    doc = a["doc_ids"]
    length = np.stack([np.bincount(r[r >= 0], minlength=int(r.max()) + 1)[np.clip(r, 0, None)] for r in doc])
    a["loss_mask"] = ((a["position_ids"] >= 0.3 * length) & (doc >= 0)).astype(np.uint8)
    return a


def synthetic_cache(root: Path, text: dict, target: Path, rows: int, seq_len: int, kind: str = "bench",
                    quant: str = "bf16", project_dims: int = 0):
    """A hidden cache of random states in encoding `quant` (projected to `project_dims` a tap when set) over `kind`
    rows: "bench" (`fixtures.fake_cache.fake_token_rows`) or "chat" (`chat_token_rows`)."""
    layers = [1, 2, 3, 4, 5] if text["num_hidden_layers"] < 16 else LAYERS
    token_rows = None
    if kind == "chat":
        token_rows = functools.partial(chat_token_rows, vocab=text["vocab_size"] - 300)  # (below the mask token)
    cache = make_fake_cache(root / "hidden", 2, rows // 2, seq_len, text["hidden_size"], layers, quant=quant,
                            token_rows=token_rows, project_dims=project_dims)
    return bind_to_target(cache, target, text["num_hidden_layers"], text["vocab_size"], text["vocab_size"] - 250)


def recipe_drafter(recipe: str, tiny: bool) -> dict:
    """The drafter settings of a recipe's [train] (`drafter.DrafterSettings`: shape, variant and its conv and
    selector, attention layout) with its γ and selector weight; not its taps and mask token (the synthetic cache's),
    nor, with `tiny`, its sizes (`SIZES`)."""
    import dataclasses

    from dflash_offline.config import read_recipe
    from dflash_offline.drafter import DrafterSettings

    keys = {f.name for f in dataclasses.fields(DrafterSettings)} - {"layer_ids", "mask_token_id"}
    keys = (keys | {"gamma", "selector_weight"}) - (set(SIZES) if tiny else set())
    return {k: v for k, v in read_recipe(recipe).get("train", {}).items() if k in keys}


def run_ours(args, cache: Path, drafter: dict, precision: str = "auto", name: str = "run") -> dict:
    from dflash_offline.trainrun import run as train_run
    from dflash_offline.trainsetup import BenchSwitches, TrainConfig

    run = args.workdir / name
    shutil.rmtree(run, ignore_errors=True)
    cfg = TrainConfig.of(cache=str(cache), run=str(run), steps=args.steps, batch_rows=args.batch_rows,
                      num_anchors=args.anchors, log_every=args.log_every, ckpt_every=10**9, trackers="none",
                      attn=args.attn, profile_steps=args.profile_steps, master_weights=args.master_weights,
                      global_batch_tokens=args.accum * args.batch_rows * args.seq_len,
                      loss_logits=args.loss_logits, precision=precision, weighting=args.weighting,
                      **({} if args.loss_chunk_tokens is None else {"loss_chunk_tokens": args.loss_chunk_tokens}),
                      **{"block_size": 16, **drafter}).resolve()
    # the A/B switches that are not trainer options (within the run-to-run spread: docs/benchmarks.md)
    switches = BenchSwitches(tf32=args.tf32 == "on", resident=args.resident == "on",
                             reader_threads=args.reader_threads,
                             final_checkpoint=False,  # (its write, ≈ 25 GB at the 27B shapes, is not the step's time)
                             fp8_emulate=args.tiny and not torch.cuda.is_available())  # (the CPU smoke run)
    gc.collect()  # an earlier run's drafter (a reference cycle through its compiled method) goes before the peak resets
    t0 = time.time()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sampler = GpuSampler()
    try:
        with read_check(args.read_check) as hashed:
            train_run(cfg, switches)
    finally:
        sampler.stop()
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # (none is written; a disk per run at the 27B shapes if one were)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the first window holds compilation; windows reaching into the profiled last steps are slowed by the profiler
    last_clean = args.steps - args.profile_steps if args.profile_steps else args.steps
    steady = [r for r in recs[1:] if r["step"] <= last_clean]
    if not steady:
        raise SystemExit(f"bench.train: {len(recs)} window(s) of {args.log_every} steps, none after the first "
                         f"(compilation) and before the profiled steps: raise --steps or lower --log_every")
    first = recs.index(steady[0])  # clocks over the steady windows (each window ends at its record's time)
    clocks = sampler.between(recs[first - 1]["time"] if first else t0, steady[-1]["time"])
    derived = json.loads((run / "config.json").read_text())["derived"]
    # per window: its steps (a last, shorter window counts for its steps only) and seconds
    n = [r["step"] - (recs[first + i - 1]["step"] if first + i else 0) for i, r in enumerate(steady)]
    secs = [k * r["ms_per_step"] / 1000 for k, r in zip(n, steady, strict=True)]

    def mean(key):  # time-weighted over the steady windows
        return sum(s * r.get(key, 0.0) for s, r in zip(secs, steady, strict=True)) / sum(secs)

    return {"total_s": time.time() - t0, "tok_per_s": mean("tok_per_s"), "ms_per_step": 1000 * sum(secs) / sum(n),
            "flop_frac": mean("flop_frac"), "data_wait_frac": mean("data_wait_frac"), "gc_frac": mean("gc_frac"),
            "windows_tok_per_s": [round(r["tok_per_s"]) for r in steady],
            "peak_gb": max(r.get("peak_gb", 0) for r in recs), "reserved_gb": [r.get("reserved_gb") for r in recs],
            "recompiles": recs[-1]["recompiles"], "first_window_ms": recs[0]["ms_per_step"], "gpu": clocks,
            "master_weights": derived["master_weights"],
            "attn": derived["attn"], "loss_logits": derived["loss_logits"], "tf32": derived["tf32"],
            "precision": derived["precision"], "variant": cfg.drafter.variant, "weighting": cfg.loss.weighting,
            "loss_chunk_tokens": cfg.loss.loss_chunk_tokens, "loss": [r["loss"] for r in recs], "pid": os.getpid(),
            "resident": args.resident, "reader_threads": args.reader_threads, "read_check": args.read_check,
            "read_check_ms_per_step": 1000 * hashed["s"] / args.steps,
            "read_check_gb_per_step": hashed["bytes"] / 1e9 / args.steps,
            "profile": (run / "profile.txt").read_text() if (run / "profile.txt").exists() else None}


@contextlib.contextmanager
def read_check(mode: str):
    """The stream's row checks as they are ("on"), timing each digest on its reader thread, or with the shards'
    row digests dropped ("off", the A/B reference; headers and sizes are still checked). Yields
    {"s": seconds hashing, summed over the reader threads, "bytes": bytes hashed}."""
    import threading

    from dflash_offline import dataset
    from dflash_offline.cache import shards

    hashed = {"s": 0.0, "bytes": 0}
    real_hash, real_open = shards.xxhash, dataset.open_shard
    lock = threading.Lock()  # (several reader threads: --reader_threads)

    def timed(buf):
        t = time.perf_counter()
        out = real_hash.xxh3_64_hexdigest(buf)
        dt = time.perf_counter() - t
        with lock:
            hashed["s"] += dt
            hashed["bytes"] += len(buf)
        return out

    def unchecked(info, shard):
        f = real_open(info, shard)
        f.digests = None
        return f

    shards.xxhash = types.SimpleNamespace(xxh3_64_hexdigest=timed)
    if mode == "off":
        dataset.open_shard = unchecked
    try:
        yield hashed
    finally:
        shards.xxhash, dataset.open_shard = real_hash, real_open


def run_baseline(args, cache: Path, target: Path, drafter: dict, device) -> dict:
    """Eager drafter, dense mask, logits chunked under activation checkpointing, plain F.cross_entropy."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from dflash_offline import anchors as anc
    from dflash_offline.dataset import HiddenStream, open_hidden_cache
    from dflash_offline.drafter import DFlashDrafter, load_target_embeddings
    from dflash_offline.loss import slot_weights
    from dflash_offline.trainsetup import TrainConfig, cache_defaults, drafter_config

    cfg = TrainConfig.of(cache=str(cache), batch_rows=1, num_anchors=args.anchors,
                         **{"block_size": 16, **drafter, "variant": "dflash"}).resolve()
    c = cache_defaults(cfg)
    dc = drafter_config(cfg, c)
    L = dc.block_size
    model = DFlashDrafter(dc).to(device)
    embed, head = (w.to(device, torch.bfloat16) for w in load_target_embeddings(target))
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=device.type == "cuda")
    stream = HiddenStream(open_hidden_cache(cache, c["layer_ids"]), 1, device=device)
    w_L = slot_weights(L, cfg.loss.gamma or None, device)

    def chunk_loss(h, labels, weights):
        logits = (h @ head.T).float()
        return (F.cross_entropy(logits, labels.clamp_min(0), reduction="none") * weights).sum()

    def step():
        b = next(stream)
        a, keep = anc.sample_anchors(b["loss_mask"], b["doc_ids"], args.anchors, L)
        labels = anc.block_labels(b["input_ids"], b["loss_mask"], b["doc_ids"], a, keep, L).reshape(-1)
        masks = model.build_masks(b["doc_ids"], a, keep, "dense")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            h = model(b["hidden"], b["input_ids"], b["position_ids"], a, keep, embed, masks, "dense")
        h = h.reshape(-1, h.shape[-1]).to(torch.bfloat16)
        weights = torch.where(labels >= 0, w_L.repeat(labels.numel() // L), 0.0)
        total = sum(checkpoint(chunk_loss, h[i:i + 2048], labels[i:i + 2048], weights[i:i + 2048],
                               use_reentrant=False) for i in range(0, h.shape[0], 2048))
        loss = total / weights.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    sampler = GpuSampler()
    t0 = time.time()
    n = max(3, args.steps // 4)
    for _ in range(n):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.time()
    secs = (t1 - t0) / n
    clocks = sampler.between(t0, t1)
    sampler.stop()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    stream.close()
    gc.collect()
    return {"ms_per_step": 1000 * secs, "tok_per_s": c["seq_len"] / secs, "peak_gb": peak, "gpu": clocks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--log_every", type=int, default=10, help="the trainer's default: a window per 10 steps")
    p.add_argument("--anchors", type=int, default=None, help="default 512; --tiny: 8, 16 with --precision=fp8")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--skip_baseline", action="store_true")
    p.add_argument("--alone", action="store_true",
                   help="ours at --precision on the --quant cache only: no bf16 or bf16-cache run to compare with")
    p.add_argument("--rows", default="bench", choices=["bench", "chat"],
                   help="bench: the synthetic two-document rows of every earlier figure; chat: packed single-turn "
                        "chat documents (log-normal lengths, answers supervised)")
    p.add_argument("--attn", default="auto", choices=["auto", "flex"], help="the trainer's attn")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--batch_rows", type=int, default=None, help="rows per micro-batch (default 1; --shape=testbed 4)")
    p.add_argument("--shape", default="27b", choices=["27b", "testbed"],
                   help="27b: the 27B drafter on a synthetic 27B target; testbed: the testbed's drafter "
                        "(manifests/testbed.toml's [train], 4 rows a step) at its target's width and vocabulary")
    p.add_argument("--master_weights", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--loss_logits", default="fp32", choices=["fp32", "bf16", "fp8"],
                   help="the trainer's loss_logits (fp8: both lm_head GEMMs in float8)")
    p.add_argument("--weighting", default="decay", choices=["decay", "dpace"],
                   help="ours' slot weighting (dpace: the epilogue runs twice a chunk); the baseline's stays decay")
    p.add_argument("--tf32", default="off", choices=["on", "off"], help="on: TF32 tensor cores for fp32 matmuls")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp8"],
                   help="the trainer's precision; fp8: ours in bf16, then ours in fp8 (float8 linears), one call")
    p.add_argument("--loss_chunk_tokens", type=int, default=None,
                   help="the trainer's loss_chunk_tokens (query tokens per lm_head chunk; default: the trainer's)")
    p.add_argument("--profile_steps", type=int, default=0, help="print a kernel table of that many steps")
    p.add_argument("--quant", default="bf16", choices=list(ENCODINGS),
                   help="encoding of the synthetic hidden cache (extract.quant): the trainer's reader decodes it")
    p.add_argument("--project_dims", type=int, default=0,
                   help="projected taps: the synthetic cache stores k values a tap (extract.project_dims); 0 = full")
    p.add_argument("--cache_rows", type=int, default=8,
                   help="rows in the synthetic cache (even; the stream cycles through them)")
    p.add_argument("--resident", default="off", choices=["on", "off"],
                   help="on: the stream reads the whole cache onto the GPU once and gathers each batch there "
                        "(no reader thread, no copies a step)")
    p.add_argument("--reader_threads", type=int, default=1,
                   help="threads the stream reads the next batches with at once (1: the trainer's one reader)")
    p.add_argument("--read_check", default="on", choices=["on", "off"],
                   help="off: the stream skips its per-row checksums (the A/B reference for their cost)")
    p.add_argument("--recipe", default=None,
                   help="the drafter of this recipe's [train] (shape, variant, attention layout, γ) instead of the "
                        "default 27B shape; the target stays the synthetic 27B (--tiny: the tiny one, tiny sizes)")
    p.add_argument("--variant", default=None, choices=["dflash", "dflash2"],
                   help="the drafter variant (default: the recipe's, else dflash); dflash2: DFlash2 timed against "
                        "DFlash at the same shapes (A, B, A), unless --alone")
    p.add_argument("--workdir", type=Path, default=Path("build/bench-train"))
    p.add_argument("--out", type=Path, default=None)
    from dflash_offline.config import REMOVED, REMOVED_CHOICES

    for arg in sys.argv[1:]:  # switches that are gone: what the trainer does instead, in one line
        key, _, value = arg.removeprefix("--").partition("=")
        if why := REMOVED["train"].get(key) or REMOVED_CHOICES.get(f"train.{key}", {}).get(value):
            p.error(f"{arg}: {why}")
    args = p.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    text, drafter = (TEXT_TINY, DRAFTER_TINY) if args.tiny else (TEXT_27B, DRAFTER_27B)
    if args.shape == "testbed" and not args.tiny:
        text, drafter = testbed_shape()
        args.recipe = args.recipe or TESTBED_RECIPE
    args.batch_rows = args.batch_rows or (4 if args.shape == "testbed" else 1)
    drafter = {**drafter, **(recipe_drafter(args.recipe, args.tiny) if args.recipe else {})}
    drafter["variant"] = args.variant or drafter.get("variant", "dflash")
    dflash2 = drafter["variant"] == "dflash2" and not args.alone  # DFlash2 against DFlash, same shapes
    reference = {**drafter, "variant": "dflash"} if dflash2 else drafter
    if args.tiny:  # (fp8: 16 anchors, so that the token counts are multiples of 16, as float8 GEMMs need)
        args.seq_len, args.anchors = 128, args.anchors or (16 if args.precision == "fp8" else 8)
    args.anchors = args.anchors or 512
    target = synthetic_target(args.workdir / "target", text, device)
    cache = synthetic_cache(args.workdir, text, target, args.cache_rows, args.seq_len, args.rows, args.quant,
                            args.project_dims)
    encoded = (args.quant != "bf16" or args.project_dims > 0) and not args.alone  # (alone: "ours" runs on `cache`)
    bf16_cache = (synthetic_cache(args.workdir / "bf16", text, target, args.cache_rows, args.seq_len, args.rows)
                  if encoded else cache)
    res = {"commit": git_commit(), "command": " ".join(["python -m bench.train", *sys.argv[1:]]),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "shape": {"hidden": text["hidden_size"], "seq_len": args.seq_len, "anchors": args.anchors,
                     "block": drafter.get("block_size", 16), **drafter}, "recipe": args.recipe, "rows": args.rows, "attn": args.attn, "quant": args.quant,
           "project_dims": args.project_dims}
    # the baseline first: it needs no compilation, so a run cut short by a time limit still has it (JSON after each)
    if not args.skip_baseline:
        res["baseline"] = run_baseline(args, bf16_cache, target, reference, device)
        print(json.dumps(res["baseline"]), flush=True)
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    precision = "bf16" if args.precision == "fp8" and not args.alone else args.precision
    runs = [("ours", precision, "run", bf16_cache, reference)]
    if args.precision == "fp8" and not args.alone:
        runs.append(("ours_fp8", "fp8", "run-fp8", bf16_cache, reference))
    if encoded:
        runs.append(("ours_encoded", precision, "run-encoded", cache, reference))
    if dflash2:
        runs.append(("ours_dflash2", precision, "run-dflash2", bf16_cache, drafter))
    if len(runs) > 1:  # the reference again, last: the ratios take both (A, B, A), the pair bounds the drift
        runs.append(("ours_again", precision, "run-again", bf16_cache, reference))
    for key, precision, name, on, settings in runs:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        res[key] = run_ours(args, on, settings, precision, name)
        print(json.dumps({k: v for k, v in res[key].items() if k != "profile"}), flush=True)
        if res[key]["profile"]:
            print(res[key]["profile"], flush=True)
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))
    print_table(res, args)


def reference(res: dict) -> dict:
    """The bf16 run on the bf16 cache the others are compared with: the mean of its two runs (before and after them)
    where it ran twice, so that a GPU warming up over the call biases no ratio."""
    if "ours_again" not in res:
        return res["ours"]
    a, b = res["ours"], res["ours_again"]
    gpu = {"sm_mhz": (a["gpu"]["sm_mhz"] + b["gpu"]["sm_mhz"]) / 2} if a["gpu"] and b["gpu"] else None
    return {"tok_per_s": (a["tok_per_s"] + b["tok_per_s"]) / 2, "ms_per_step": (a["ms_per_step"] + b["ms_per_step"]) / 2,
            "gpu": gpu, "peak_gb": max(a["peak_gb"], b["peak_gb"])}


def ratio(x: dict, ref: dict) -> str:
    """x's rate over ref's, and per clock (ms × MHz) where both sampled the GPU (GPUs differ in clock at the power
    limit, and so does one GPU as it warms)."""
    per_clock = ""
    if ref["gpu"] and x["gpu"]:
        per_clock = f" ({ref['ms_per_step'] * ref['gpu']['sm_mhz'] / (x['ms_per_step'] * x['gpu']['sm_mhz']):.3f} per clock)"
    return f"{x['tok_per_s'] / ref['tok_per_s']:.3f}{per_clock}"


def print_table(res: dict, args) -> None:
    """One column per run of ours (bf16; fp8 with --precision=fp8; on the encoded cache with --quant/--project_dims),
    then the baseline's."""
    keys = [k for k in ("ours", "ours_fp8", "ours_encoded", "ours_dflash2", "ours_again") if k in res]
    ours = [res[k] for k in keys]
    b = res.get("baseline", {})
    cache = f"{args.quant}" + (f" k={args.project_dims}" if args.project_dims else "")
    label = {"ours": f"ours {res['ours']['precision']}" if "ours_fp8" in res else "ours, bf16 cache",
             "ours_fp8": "ours fp8", "ours_encoded": f"ours, {cache} cache", "ours_dflash2": "ours DFlash2",
             "ours_again": "the first again"}
    if "ours_dflash2" in res:
        label["ours"] += ", DFlash"
    names = ["ours"] if len(ours) == 1 else [label[k] for k in keys]

    def row(label: str, cells: list[str], base: str = "") -> None:
        print("|" + "".join(f" {c} |" if c else " |" for c in (label, *cells, base)))

    print(f"\n| training, {res['device']} | {' | '.join(names)} | baseline |\n|---|{'---|' * len(ours)}---|")
    row("context tok/s", [f"{x['tok_per_s']:,.0f}" for x in ours], f"{b.get('tok_per_s', 0):,.0f}")
    row("ms/step", [f"{x['ms_per_step']:.1f}" for x in ours], f"{b.get('ms_per_step', 0):.1f}")
    row("peak GB", [f"{x['peak_gb']:.1f}" for x in ours], f"{b.get('peak_gb', 0):.1f}")
    row("FLOP fraction @790T", [f"{x['flop_frac']:.3f}" for x in ours])
    if b:
        row("ours / baseline", [f"{x['tok_per_s'] / b['tok_per_s']:.2f}" for x in ours])
    ref = reference(res)
    if "ours_fp8" in res:  # fp8 / bf16 rates
        f = res["ours_fp8"]
        peak = f["peak_gb"] / ref["peak_gb"] if ref["peak_gb"] else 0.0
        row("fp8 / bf16 (its two runs): tok/s, peak GB", [f"{ratio(f, ref)}, {peak:.3f}" if k == "ours_fp8" else ""
                                                         for k in keys])
    if "ours_dflash2" in res:  # DFlash2's step / DFlash's at the same shapes
        d = res["ours_dflash2"]
        peak = d["peak_gb"] / ref["peak_gb"] if ref["peak_gb"] else 0.0
        row("DFlash2 / DFlash (its two runs): tok/s, peak GB", [f"{ratio(d, ref)}, {peak:.3f}"
                                                               if k == "ours_dflash2" else "" for k in keys])
    if "ours_encoded" in res:  # the same training on the encoded cache / on the bf16 cache
        row(f"{cache} cache / bf16 cache (its two runs): tok/s", [ratio(res["ours_encoded"], ref)
                                                                  if k == "ours_encoded" else "" for k in keys])
    if "ours_again" in res:  # how far the same run moved over the call: a ratio inside it is no difference
        row("the first run again / the first: tok/s (drift over the call)",
            [ratio(res["ours_again"], res["ours"]) if k == "ours_again" else "" for k in keys])
    row("recompiles after warm-up", [str(x["recompiles"]) for x in ours])
    row("host: data wait, GC (fraction of wall time)", [f"{x['data_wait_frac']:.3f}, {x['gc_frac']:.3f}" for x in ours])
    row("hidden cache encoding (decoded by the reader)",
        [cache if k == "ours_encoded" or args.alone else "bf16" for k in keys])
    row("read check: ms/step hashing, summed over the reader threads (GB/step); reader threads",
        [f"{x['read_check']}: {x['read_check_ms_per_step']:.2f} ({x['read_check_gb_per_step']:.3f}); "
         f"{'resident' if x['resident'] == 'on' else x.get('reader_threads', 1)}" for x in ours])
    bg = b.get("gpu") or {}
    if any(x.get("gpu") for x in ours):
        row("SM clock MHz (min), board power W",
            [f"{g['sm_mhz']:.0f} ({g['sm_mhz_min']:.0f}), {g['power_w']:.0f}" if (g := x.get("gpu")) else ""
             for x in ours], f"{bg['sm_mhz']:.0f} ({bg['sm_mhz_min']:.0f}), {bg['power_w']:.0f}" if bg else "")
    row("first window (compilation), s", [f"{x['first_window_ms'] * args.log_every / 1000:.0f}" for x in ours])
    row("drafter: variant, block, layers", [f"{x['variant']}, {res['shape']['block']}, {res['shape']['num_layers']}"
                                            for x in ours])
    row("rows per optimizer step, master weights", [f"{args.accum * args.batch_rows}, {x['master_weights']}" for x in ours])
    row("rows, attn, loss logits, TF32, loss chunk tokens",
        [f"{args.rows}, {x['attn']}, {x['loss_logits']}, {x['tf32']}, {x['loss_chunk_tokens']}" for x in ours])


if __name__ == "__main__":
    main()
