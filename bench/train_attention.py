"""The drafter's training attention alone, forward + backward, per mask formulation and flex kernel options.

    python -m bench.train_attention                    (GPU: 27B drafter shapes, S 2048, 512 anchors, block 16)
    python -m bench.train_attention --tiny             (CPU smoke run)

Queries are the 512×16 block tokens (32 heads × 128), keys the 2048 context positions plus the block tokens (8 KV
heads; context and block K/V are separate tensors, as in the trainer), with the real DFlash mask
(`dflash_offline.masks`) on the train benchmark's two kinds of rows (`bench.train --rows`): its synthetic
two-document rows and packed single-turn chat rows. Each variant (`VARIANTS`) is one torch.compile'd formulation:
"joint" (one flex call over [context | block] keys; lost its A/B, not in the trainer) or "split"
(`drafter.split_attention`, attn=flex), with GQA or with K/V repeated per query head (what the trainer runs), and fixed flex kernel options.
Reports ms forward, ms forward+backward, max |diff| of the output against fp32 SDPA with the dense mask, and
TFLOP/s counted on the visible (mask-true) scores only: 4·D FLOPs per score forward, 10·D forward+backward.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from bench.extract_layers import timed
from dflash_offline import anchors as anc
from dflash_offline.drafter import expand_heads, split_attention
from dflash_offline.masks import block_allow, dense_mask, make_mask_mod
from fixtures.fake_cache import fake_token_rows

# name -> (formulation, expand_kv, kernel_options). "joint": one flex call over [context | block] keys (lost
# its A/B: not in the trainer); "split": what attn=flex runs, flex over the context keys + each block's keys as a
# dense attention, merged by log-sum-exp (`drafter.split_attention`). expand_kv: K/V repeated to the query heads
# instead of GQA.
# bwd_/fwd_ prefixes address one direction (torch's flex lowering strips them)
_BWD64 = {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_warps": 4,
          "bwd_num_stages": 3}
VARIANTS = {
    "default": ("joint", False, {}),
    "bwd 64/128 w8 s2": ("joint", False, {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                                          "bwd_BLOCK_N2": 64, "bwd_num_warps": 8, "bwd_num_stages": 2}),
    "bwd 64/64 w4 s3": ("joint", False, _BWD64),
    "rows safe": ("joint", False, {"ROWS_GUARANTEED_SAFE": True}),
    "joint kv32": ("joint", True, {}),
    "split": ("split", False, {}),
    "split kv32": ("split", True, {}),
    "split kv32 bwd 64/64": ("split", True, _BWD64),
}


def docs_mask_mod(anchor_pos_BA, keep_BA, doc_ids_BS, L):
    """The previous formulation, for comparison: a document-id gather per key."""
    S, A = doc_ids_BS.shape[1], anchor_pos_BA.shape[1]
    anchor_doc_BA = doc_ids_BS.gather(1, anchor_pos_BA)

    def mask_mod(b, h, q_idx, kv_idx):
        a = (q_idx // L).clamp(0, A - 1)
        j = kv_idx.clamp(0, S - 1)
        ctx = (kv_idx < S) & (kv_idx < anchor_pos_BA[b, a]) & (doc_ids_BS[b, j] == anchor_doc_BA[b, a]) & keep_BA[b, a]
        kb = (kv_idx - S).clamp(min=0)
        return ctx | ((kv_idx >= S) & (kb // L == q_idx // L))

    return mask_mod


def rows(kind: str, S: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_mask, doc_ids) [1, S] on device: the train benchmark's rows of either kind (`--rows` of bench.train)."""
    from bench.train import chat_token_rows

    gen = torch.Generator().manual_seed(0)
    a = fake_token_rows(0, 1, S, gen) if kind == "bench" else chat_token_rows(0, 1, S, gen, vocab)
    return (torch.as_tensor(np.asarray(a["loss_mask"]), device=device).bool(),
            torch.as_tensor(np.asarray(a["doc_ids"]), device=device).long())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from VARIANTS")
    p.add_argument("--masks", default="bounds,docs")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        S, A, L, N, G, D, vocab = 64, 8, 4, 4, 2, 16, 500
    else:
        S, A, L, N, G, D, vocab = 2048, 512, 16, 32, 8, 128, 248320
    Q, dt = A * L, torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    # flex has no CPU backward: the CPU smoke run times the forward only
    q = torch.randn(1, N, Q, D, device=device, dtype=dt, generator=gen).requires_grad_(cuda)
    # context and block K/V are separate tensors, as in the trainer (two projections of two inputs)
    kv = [torch.randn(1, G, T, D, device=device, dtype=dt, generator=gen).requires_grad_(cuda) for T in (S, S, Q, Q)]
    do = torch.randn(1, N, Q, D, device=device, dtype=dt, generator=gen)
    tile = 128 if cuda else 16
    build = torch.compile(create_block_mask, dynamic=False) if cuda else create_block_mask
    masks, visible, reference = {}, {}, {}
    for kind in ("bench", "chat"):
        lm, doc = rows(kind, S, vocab, device)
        a, keep = anc.sample_anchors(lm, doc, A, L, torch.Generator(device=device).manual_seed(0))
        visible[kind] = int(dense_mask(a, keep, doc, L).sum())
        for m in args.masks.split(","):
            mod = make_mask_mod(a, keep, doc, L) if m == "bounds" else docs_mask_mod(a, keep, doc, L)
            masks[m, kind] = build(mod, 1, None, Q, S + Q, device=device, BLOCK_SIZE=tile)
        masks["split", kind] = build(make_mask_mod(a, keep, doc, L, context_only=True), 1, None, Q, S,
                                     device=device, BLOCK_SIZE=tile)
        with torch.no_grad():  # what every variant must compute: fp32 SDPA with the dense mask
            reference[kind] = F.scaled_dot_product_attention(
                q.float(), *(torch.cat([c, b], 2).float() for c, b in ((kv[0], kv[2]), (kv[1], kv[3]))),
                attn_mask=dense_mask(a, keep, doc, L), enable_gqa=True)
    results = []
    torch._dynamo.config.cache_size_limit = 64  # one compiled entry per variant (same lambda code object)
    allow = block_allow(L, None, device)
    for name in args.variants.split(","):
        form, expand, opts = VARIANTS[name]
        if form == "split":
            def fn(q, kc, vc, kb, vb, bm, expand=expand, opts=opts):
                return split_attention(q, kc, vc, kb, vb, bm, allow, D**-0.5, expand_kv=expand,
                                       kernel_options=opts or None)
        else:
            def fn(q, kc, vc, kb, vb, bm, expand=expand, opts=opts):
                k, v = torch.cat([kc, kb], 2), torch.cat([vc, vb], 2)
                if expand:
                    k, v = expand_heads(k, v, N)
                return flex_attention(q, k, v, block_mask=bm, enable_gqa=not expand, kernel_options=opts or None)
        # (CPU: split runs eager, inductor's CPU flex has no log-sum-exp output)
        fn = torch.compile(fn, dynamic=False) if cuda or form == "joint" else fn
        for (m, kind), bm in masks.items():
            if (m == "split") != (form == "split"):
                continue
            def fwd(fn=fn, bm=bm):
                with torch.no_grad():
                    return fn(q, *kv, bm)

            def fwd_bwd(fn=fn, bm=bm):
                # (CPU: no backward, so no grad either: the grad mode fwd runs under, one compiled graph, not two)
                with torch.set_grad_enabled(cuda):
                    o = fn(q, *kv, bm)
                if cuda:
                    o.backward(do)

            t0 = time.time()
            try:
                fwd_bwd()
            except Exception as e:  # a config that does not fit (shared memory) is a result, not a crash
                results.append({"variant": name, "mask": m, "rows": kind, "error": f"{type(e).__name__}: {e}"[:200]})
                print(f"{name:20s} {m:6s} {kind:5s} FAILED {results[-1]['error']}", flush=True)
                break
            first_s = time.time() - t0
            err = (fwd().float() - reference[kind]).abs().max().item()
            ms_f, ms_fb = 1000 * timed(fwd, device, args.reps), 1000 * timed(fwd_bwd, device, args.reps)
            fl = visible[kind] * N * D
            r = {"variant": name, "mask": m, "rows": kind, "ms_fwd": ms_f, "ms_fwd_bwd": ms_fb,
                 "ms_bwd": ms_fb - ms_f, "tflops_fwd": 4 * fl / ms_f / 1e9, "tflops_bwd": 6 * fl / max(ms_fb - ms_f, 1e-6) / 1e9,
                 "first_call_s": first_s, "density": visible[kind] / (Q * (S + Q)), "max_abs_diff": err}
            results.append(r)
            print(f"{name:20s} {m:6s} {kind:5s} fwd {ms_f:7.3f} ms  bwd {ms_fb - ms_f:7.3f} ms  "
                  f"({r['tflops_fwd']:.0f} / {r['tflops_bwd']:.0f} TFLOP/s)  |diff| {err:.1e}  first call {first_s:.1f}s",
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                                        "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
                                        "max_abs_diff": "of the output against fp32 SDPA with the dense mask",
                                        "results": results}, indent=1))
    print(f"\n{'variant':20s} {'mask':6s} {'rows':5s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd TF/s':>9s} {'bwd TF/s':>9s}")
    for r in results:
        if "error" not in r:
            print(f"{r['variant']:20s} {r['mask']:6s} {r['rows']:5s} {r['ms_fwd']:8.3f} {r['ms_bwd']:8.3f} "
                  f"{r['tflops_fwd']:9.0f} {r['tflops_bwd']:9.0f}")


if __name__ == "__main__":
    main()
