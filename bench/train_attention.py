"""The drafter's training attention alone, forward + backward, per mask formulation and flex kernel options.

    python -m bench.train_attention                    (GPU: 27B drafter shapes, S 2048, 512 anchors, block 16)
    python -m bench.train_attention --tiny             (CPU smoke run)

Queries are the 512×16 block tokens (32 heads × 128), keys the 2048 context positions plus the block tokens (8 KV
heads), with the real DFlash mask (`dflash_offline.masks`) on two kinds of rows: the two-document rows the train
benchmark's synthetic cache holds, and long-tailed packed chat rows. Each variant is one torch.compile'd
flex_attention (kernel options fixed, so one kernel per variant), or "split", the trainer's formulation
(`drafter.split_attention`); reports ms forward, ms forward+backward and
TFLOP/s counted on the visible (mask-true) scores only: 4·D FLOPs per score forward, 10·D forward+backward.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from bench.extract_layers import timed
from dflash_offline import anchors as anc
from dflash_offline.dataset import fake_token_rows
from dflash_offline.drafter import split_attention
from dflash_offline.masks import block_allow, dense_mask, make_mask_mod

# (name, kernel_options); bwd_/fwd_ prefixes address one direction (torch's flex lowering strips them)
VARIANTS = {
    "default": {},
    "bwd 64/128 w8 s2": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                         "bwd_num_warps": 8, "bwd_num_stages": 2},
    "bwd 64/128 w8 s4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                         "bwd_num_warps": 8, "bwd_num_stages": 4},
    "bwd 32/128 w4 s3": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                         "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd 64/64 w4 s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                        "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd 64/64 w8 s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                        "bwd_num_warps": 8, "bwd_num_stages": 3},
    "rows safe": {"ROWS_GUARANTEED_SAFE": True},
    # what the trainer runs: flex over the context keys only + each block's keys as a dense attention, merged by
    # log-sum-exp (`drafter.split_attention`); the other variants are one flex call over [context | block] keys
    "split": None,
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
    """(loss_mask, doc_ids) [1, S] on device."""
    if kind == "bench":
        a = fake_token_rows(0, 1, S, torch.Generator().manual_seed(0))
    else:
        from bench.extract import lognormal_packed_rows
        from dflash_offline.packing import materialize

        a = materialize(lognormal_packed_rows(1, S, vocab, seed=1), S, 0)[0]
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
    k = torch.randn(1, G, S + Q, D, device=device, dtype=dt, generator=gen).requires_grad_(cuda)
    v = torch.randn(1, G, S + Q, D, device=device, dtype=dt, generator=gen).requires_grad_(cuda)
    do = torch.randn(1, N, Q, D, device=device, dtype=dt, generator=gen)
    tile = 128 if cuda else 16
    build = torch.compile(create_block_mask, dynamic=False) if cuda else create_block_mask
    masks, visible = {}, {}
    for kind in ("bench", "chat"):
        lm, doc = rows(kind, S, vocab, device)
        a, keep = anc.sample_anchors(lm, doc, A, L, torch.Generator(device=device).manual_seed(0))
        visible[kind] = int(dense_mask(a, keep, doc, L).sum())
        for m in args.masks.split(","):
            mod = make_mask_mod(a, keep, doc, L) if m == "bounds" else docs_mask_mod(a, keep, doc, L)
            masks[m, kind] = build(mod, 1, None, Q, S + Q, device=device, BLOCK_SIZE=tile)
        masks["split", kind] = build(make_mask_mod(a, keep, doc, L, context_only=True), 1, None, Q, S,
                                     device=device, BLOCK_SIZE=tile)
    results = []
    torch._dynamo.config.cache_size_limit = 64  # one compiled entry per variant (same lambda code object)
    allow = block_allow(L, None, device)
    for name in args.variants.split(","):
        opts = VARIANTS[name]
        if name == "split":  # (CPU: eager; inductor's CPU flex has no log-sum-exp output)
            fn = lambda q, k, v, bm: split_attention(q, k[:, :, :S], v[:, :, :S], k[:, :, S:],  # noqa: E731
                                                     v[:, :, S:], bm, allow, D**-0.5)
            fn = torch.compile(fn, dynamic=False) if cuda else fn
            joint = torch.compile(lambda q, k, v, bm: flex_attention(q, k, v, block_mask=bm, enable_gqa=True),
                                  dynamic=False)
            with torch.no_grad():  # same values as one flex call over [context | block] keys
                err = {kind: (fn(q, k, v, masks["split", kind]).float() - joint(q, k, v, masks["bounds", kind])
                              .float()).abs().max().item() for kind in ("bench", "chat")} if cuda else {}
            print(f"split vs one flex call, max |diff| of the output: {err}", flush=True)
        else:
            fn = torch.compile(lambda q, k, v, bm, o=opts: flex_attention(q, k, v, block_mask=bm, enable_gqa=True,
                                                                          kernel_options=o or None), dynamic=False)
        for (m, kind), bm in masks.items():
            if (m == "split") != (name == "split"):
                continue
            def fwd(fn=fn, bm=bm):
                with torch.no_grad():
                    fn(q, k, v, bm)

            def fwd_bwd(fn=fn, bm=bm):
                o = fn(q, k, v, bm)
                if cuda:
                    o.backward(do)

            t0 = time.time()
            try:
                fwd_bwd()
            except Exception as e:  # a config that does not fit (shared memory) is a result, not a crash
                results.append({"variant": name, "mask": m, "rows": kind, "error": f"{type(e).__name__}: {e}"[:200]})
                print(f"{name:18s} {m:6s} {kind:5s} FAILED {results[-1]['error']}", flush=True)
                break
            first_s = time.time() - t0
            ms_f, ms_fb = 1000 * timed(fwd, device, args.reps), 1000 * timed(fwd_bwd, device, args.reps)
            fl = visible[kind] * N * D
            r = {"variant": name, "mask": m, "rows": kind, "ms_fwd": ms_f, "ms_fwd_bwd": ms_fb,
                 "ms_bwd": ms_fb - ms_f, "tflops_fwd": 4 * fl / ms_f / 1e9, "tflops_bwd": 6 * fl / max(ms_fb - ms_f, 1e-6) / 1e9,
                 "first_call_s": first_s, "density": visible[kind] / (Q * (S + Q))}
            results.append(r)
            print(f"{name:18s} {m:6s} {kind:5s} fwd {ms_f:7.3f} ms  bwd {ms_fb - ms_f:7.3f} ms  "
                  f"({r['tflops_fwd']:.0f} / {r['tflops_bwd']:.0f} TFLOP/s)  first call {first_s:.1f}s", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                                        "torch": torch.__version__, "results": results}, indent=1))
    print(f"\n{'variant':18s} {'mask':6s} {'rows':5s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd TF/s':>9s} {'bwd TF/s':>9s}")
    for r in results:
        if "error" not in r:
            print(f"{r['variant']:18s} {r['mask']:6s} {r['rows']:5s} {r['ms_fwd']:8.3f} {r['ms_bwd']:8.3f} "
                  f"{r['tflops_fwd']:9.0f} {r['tflops_bwd']:9.0f}")


if __name__ == "__main__":
    main()
