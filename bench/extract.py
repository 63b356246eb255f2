"""Benchmark stage 1b at Qwen3.5-27B shapes with RANDOM weights, stopping after layer 61 (taps [1,16,31,46,61]).

    python -m bench.extract [--shards=48 --rows_per_shard=4 --batch_rows=4 --seq_len=4096]   (GPU; ~40 GB on disk)
    python -m bench.extract --tiny                                                            (CPU smoke run)

Ours: the real extraction loop (`extraction.extract_shards`: packed forward with fla varlen kernels, flash
varlen attention and compiled pieces between them, device→host copies on a side stream, background safetensors
writes, manifest commits) over a synthetic
token cache of long-tailed packed documents. Baseline, in the same process on the same rows: a plain transformers
forward (`Qwen3_5TextModel` with 62 layers, `output_hidden_states=True`), each packed row taken as one sequence
(no document isolation: more attention than per document, states that are not the per-document ones). Machines are
noisy: compare the ratio of the two, measured in one run. The headline is the whole run (first claim to last commit,
the final write included); the steady state (first shard's device end to the last one's) is reported next to it.
48 shards (~65 s of extraction, 0.84 GB each) keep the start-up and the last write to ~1.5 % of the run. SM clock
and board power are sampled during both runs (an H200 running these kernels sits at its 700 W limit). Results: a
table last, JSON in --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.gpu import GpuSampler
from dflash_offline.cache.fsio import hash_obj
from dflash_offline.cache.manifest import commit_shard, open_cache, update_manifest
from dflash_offline.cache.shards import token_shard_name, write_token_shard
from dflash_offline.packing import Doc, Packer, materialize

TEXT_27B = {
    "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64, "vocab_size": 248320,
    "intermediate_size": 17408, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "eos_token_id": 248044, "dtype": "bfloat16", "tie_word_embeddings": False,
}
TEXT_TINY = dict(TEXT_27B, hidden_size=64, num_hidden_layers=8, vocab_size=2048, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 rope_parameters=dict(TEXT_27B["rope_parameters"], mrope_section=[1, 1, 0]))


def write_config(path: Path, text: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", **text,
                                                  "architectures": ["Qwen3_5ForCausalLM"]}))
    return path


def lognormal_packed_rows(n_rows: int, seq_len: int, vocab: int, seed: int = 0) -> list:
    """Rows (packing.Row) of random documents with log-normal lengths (median 400 tokens, like real chat), packed
    best-fit over 64 open rows, in the order they complete."""
    rng = np.random.default_rng(seed)
    packer, done, ordinal = Packer(seq_len, 64), [], 0
    while len(done) < n_rows:
        n = int(min(seq_len, max(8, rng.lognormal(np.log(400), 1.0))))
        done += packer.add(Doc(rng.integers(0, vocab, n).astype(np.int32), np.ones(n, dtype=np.uint8), ordinal))
        ordinal += 1
    return done


def synthetic_tokens(root: Path, shards: int, rows: int, seq_len: int, vocab: int, seed: int = 0) -> tuple[Path, dict]:
    """A complete token cache of packed documents with log-normal lengths (median 400 tokens), like real chat."""
    producer = {"stage": "bench", "seq_len": seq_len, "seed": seed, "shards": shards, "rows": rows,
                "tokenizer": {"vocab_size": vocab, "pad_id": 0}}
    out = root / "tokens"
    open_cache(out, "tokens", hash_obj(producer), producer, {}, None)
    done = lognormal_packed_rows(shards * rows, seq_len, vocab, seed)
    for i in range(shards):
        arrays, sources = materialize(done[i * rows:(i + 1) * rows], seq_len, 0)
        name = token_shard_name(i)
        files = {name: write_token_shard(out / name, arrays, sources, {"shard": i})}
        commit_shard(out, {"index": i, "rows": rows, "tokens": int((arrays["doc_ids"] >= 0).sum()), "files": files})
    update_manifest(out, complete=True, num_shards=shards)
    from dflash_offline.cache.manifest import read_manifest

    return out, read_manifest(out)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours(args, info, layer_ids, tokens_dir, tm, device) -> dict:
    from dflash_offline.config import ExtractConfig
    from dflash_offline.extract_plan import ExtractPlan
    from dflash_offline.extraction import extract_shards
    from dflash_offline.target import random_target

    torch.manual_seed(0)
    t0 = time.time()
    model = random_target(info, max(layer_ids) + 1, layer_ids, device, torch.bfloat16, "auto")
    build_s = time.time() - t0
    from dflash_offline.cache.shards import read_token_shard

    rows = read_token_shard(tokens_dir / token_shard_name(0))
    batch = [torch.from_numpy(np.array(rows[k][:args.batch_rows])) for k in ("input_ids", "position_ids", "doc_ids")]
    t0 = time.time()
    model.tapped_hidden_states(*batch)  # autotuning + compilation
    sync(device)
    warm_s = time.time() - t0
    cfg = ExtractConfig(target="bench", batch_rows=args.batch_rows, lease_s=3600).resolve()
    cache = args.workdir / "hidden"
    key = hash_obj({"bench": tm["key"], "layers": layer_ids})
    open_cache(cache, "hidden", key, {"bench": True}, {}, num_shards=args.shards)
    plan = ExtractPlan(ckpt=Path("bench"), weights=False, info=info, layer_ids=layer_ids, seq_len=args.seq_len,
                       mask_token_id=None, width=info.hidden_size, num_shards=args.shards,
                       rows=args.shards * args.rows_per_shard,
                       bytes_per_token=0, total_bytes=0, tokens_manifest=tm, producer={"bench": True}, key=key,
                       tokens_dir=tokens_dir, cache=cache, device=device, todo=list(range(args.shards)))
    sampler = GpuSampler()
    t_run = time.time()
    stats = extract_shards(cfg, plan, model, 0, 1)
    sampler.stop()
    # steady state: from the end of the first shard's device work to the end of the last one's (no start-up, no
    # final write; every write but the last one overlaps it)
    ends = sorted(t[2] for t in stats["shard_timings"])
    steady = (args.shards - 1) * args.rows_per_shard * args.seq_len / (ends[-1] - ends[0]) if len(ends) > 1 else 0.0
    written = sum((cache / f).stat().st_size for f in (p.name for p in cache.glob("hidden-*.safetensors")))
    row_tokens = args.shards * args.rows_per_shard * args.seq_len
    out = {"mode": model.mode, "build_s": build_s, "warmup_s": warm_s, "seconds": stats["elapsed_s"],
           "row_tok_per_s": row_tokens / stats["elapsed_s"], "real_tok_per_s": stats["tokens_per_s"],
           "bytes_per_s": written / stats["elapsed_s"], "busy_frac": stats["busy_frac"],
           "compute_s_per_shard": stats["compute_s"] / args.shards, "write_s_per_shard": stats["write_s"] / args.shards,
           "main_thread_wait_on_writer_s": stats["io_wait_s"], "steady_row_tok_per_s": steady,
           "gpu": sampler.between(t_run, time.time()),
           "reserved_gb": [round(r / 2**30, 2) for r in stats["reserved_bytes"]],
           "layer_params": sum(p.numel() for p in model.stack.layers.parameters())}
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run_plain_hf(args, text: dict, depth: int, tokens_dir, device) -> dict:
    """transformers as it is: the text model with `depth` layers and output_hidden_states, each packed row one
    sequence."""
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    from dflash_offline.cache.shards import read_token_shard

    config = AutoConfig.for_model(**dict(text, num_hidden_layers=depth))
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = Qwen3_5TextModel(config).eval().requires_grad_(False)
    torch.set_default_dtype(old)
    batches = []
    for i in range(args.shards):
        ids = read_token_shard(tokens_dir / token_shard_name(i))["input_ids"]
        for r in range(0, args.rows_per_shard, args.batch_rows):
            batches.append(torch.from_numpy(np.array(ids[r:r + args.batch_rows])).long().to(device))
    with torch.inference_mode():
        t0 = time.time()
        model(input_ids=batches[0], output_hidden_states=True)
        sync(device)
        warm_s = time.time() - t0
        sampler = GpuSampler()
        t0 = time.time()
        for b in batches:
            hs = model(input_ids=b, output_hidden_states=True).hidden_states
            del hs
        sync(device)
        secs = time.time() - t0
        clocks = sampler.between(t0, time.time())
        sampler.stop()
    tokens = sum(b.numel() for b in batches)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"warmup_s": warm_s, "seconds": secs, "row_tok_per_s": tokens / secs, "gpu": clocks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny config")
    p.add_argument("--shards", type=int, default=48)
    p.add_argument("--rows_per_shard", type=int, default=4)
    p.add_argument("--batch_rows", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--skip_baseline", action="store_true")
    p.add_argument("--workdir", type=Path, default=Path("build/bench-extract"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import shutil

    shutil.rmtree(args.workdir, ignore_errors=True)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    text = TEXT_TINY if args.tiny else TEXT_27B
    if args.tiny:
        args.seq_len = min(args.seq_len, 256)
    from dflash_offline.target import default_layer_ids, read_target_info

    info = read_target_info(write_config(args.workdir / "target", text))
    layer_ids = default_layer_ids(info.num_layers, 5)
    from dflash_offline.extract_plan import check_disk

    per_shard = args.rows_per_shard * args.seq_len * len(layer_ids) * info.hidden_size * 2  # bf16 states
    check_disk(args.workdir, args.shards * per_shard, 2.0)  # now, not after a minute of warm-up and 40 shards
    tokens_dir, tm = synthetic_tokens(args.workdir, args.shards, args.rows_per_shard, args.seq_len, info.vocab_size)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "weights": "random", "layer_ids": layer_ids,
               "shape": {"hidden": info.hidden_size, "layers_run": max(layer_ids) + 1, "seq_len": args.seq_len,
                         "batch_rows": args.batch_rows, "rows": args.shards * args.rows_per_shard}}
    results["ours"] = run_ours(args, info, layer_ids, tokens_dir, tm, device)
    print(json.dumps(results["ours"]), flush=True)
    if not args.skip_baseline:
        results["plain_hf"] = run_plain_hf(args, text, max(layer_ids) + 1, tokens_dir, device)
        print(json.dumps(results["plain_hf"]), flush=True)
    flop_per_token = 2 * results["ours"]["layer_params"]  # matmul FLOPs; attention/recurrence on top
    ours = results["ours"]["row_tok_per_s"]
    results["flop_per_token"] = flop_per_token
    results["ideal_frac_790T"] = ours * flop_per_token / 790e12
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print("\n| extraction, " + results["device"] + " | value |\n|---|---|")
    print(f"| ours tok/s per GPU (incl. writes), rows incl. padding | {ours:,.0f} |")
    print(f"| ours real (non-padding) tok/s | {results['ours']['real_tok_per_s']:,.0f} |")
    if "plain_hf" in results:
        base = results["plain_hf"]["row_tok_per_s"]
        print(f"| plain HF forward tok/s (output_hidden_states, {max(layer_ids) + 1} layers) | {base:,.0f} |")
        print(f"| ratio ours / plain | {ours / base:.2f} |")
    print(f"| matmul GFLOP/token, fraction of 790 TFLOP/s | {flop_per_token / 1e9:.1f}, "
          f"{results['ideal_frac_790T']:.3f} |")
    o = results["ours"]
    print(f"| written GB/s; per shard: device compute s, background write s | {o['bytes_per_s'] / 1e9:.2f}; "
          f"{o['compute_s_per_shard']:.2f}, {o['write_s_per_shard']:.2f} |")
    print(f"| steady state tok/s (first shard's device end → last shard's), ratio to plain | "
          f"{o['steady_row_tok_per_s']:,.0f}, "
          + (f"{o['steady_row_tok_per_s'] / results['plain_hf']['row_tok_per_s']:.2f} |" if "plain_hf" in results
             else "|"))
    og, pg = o.get("gpu") or {}, results.get("plain_hf", {}).get("gpu") or {}
    if og:
        print(f"| SM clock MHz (min), board power W: ours; plain | {og['sm_mhz']:.0f} ({og['sm_mhz_min']:.0f}), "
              f"{og['power_w']:.0f}; " + (f"{pg['sm_mhz']:.0f} ({pg['sm_mhz_min']:.0f}), {pg['power_w']:.0f} |"
                                           if pg else "|"))
    print(f"| device busy fraction (shard compute time / wall time) | {o['busy_frac']:.3f} |")
    print(f"| ours compute only (device time of the shards) tok/s | "
          f"{args.rows_per_shard * args.seq_len / o['compute_s_per_shard']:,.0f} |")
    print(f"| reserved GB per shard | {results['ours']['reserved_gb']} |")
    print(f"| warm-up (autotune+compile) s: ours, plain | {results['ours']['warmup_s']:.0f}, "
          f"{results.get('plain_hf', {}).get('warmup_s', 0):.0f} |")


if __name__ == "__main__":
    main()
