"""The drafter's loss alone (frozen lm_head + block CE, forward + backward) per epilogue and chunk size.

    python -m bench.train_loss            (GPU: 27B shapes — 512 anchors × 15 scored slots, H 5120, vocab 248320)
    python -m bench.train_loss --tiny     (CPU smoke run)

`block_ce_loss` as the trainer calls it, timed for each epilogue implementation ("triton": the two-pass kernel of
`dflash_offline.ce_kernel`; "compiled": the torch.compile'd elementwise epilogue) and each `loss_chunk_tokens`;
then the epilogue alone on one chunk's fp32 logits, for the kernel's block/warp choices, with the bandwidth it
reaches counting two reads of the logits and one bf16 write. Medians of CUDA-event timings. A table last, JSON in
--out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.extract_layers import timed
from dflash_offline.loss import _decay_epilogue, _logits, block_ce_loss

KERNEL_CONFIGS = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]  # (BLOCK, num_warps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--chunks", default="4096,8192", help="loss_chunk_tokens values")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    A, L, H, V = (512, 16, 5120, 248320) if not args.tiny else (8, 16, 64, 2048)
    if args.tiny:
        args.reps = 2
    g = torch.Generator(dev).manual_seed(0)
    hidden = (torch.randn(1, A * L, H, device=dev, generator=g)).bfloat16().requires_grad_(True)
    head = (torch.randn(V, H, device=dev, generator=g) * 0.02).bfloat16()
    labels = torch.randint(0, V, (1, A, L), device=dev, generator=g)
    labels[..., 0] = -100
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "shape": {"anchors": A, "block": L, "hidden": H, "vocab": V}, "loss": {}, "epilogue": {}}
    epilogues = ["triton", "compiled"] if cuda else ["eager"]
    gemm_flop = 2 * 2 * A * (L - 1) * H * V  # logits and dh

    def loss_step(chunk, epi):
        def f():
            hidden.grad = None
            block_ce_loss(hidden, head, labels, chunk_tokens=chunk, epilogue=epi).loss.backward()
        return f

    for chunk in (int(c) for c in args.chunks.split(",")):
        for epi in epilogues:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            ms = 1000 * timed(loss_step(chunk, epi), dev, args.reps)
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            res["loss"][f"{epi} chunk {chunk}"] = {"ms": ms, "gemm_tflops": gemm_flop / ms / 1e9, "peak_gb": peak}
            print(json.dumps({f"{epi} chunk {chunk}": res["loss"][f"{epi} chunk {chunk}"]}), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    n = A * (L - 1)
    z = _logits(hidden.detach()[0, :n], head)  # as the loss computes them
    lab = labels[0, :, 1:].reshape(-1)
    w = torch.rand(n, device=dev, generator=g)
    moved = n * V * (4 + 4 + 2)  # two fp32 reads, one bf16 write
    variants = {"compiled": torch.compile(_decay_epilogue, dynamic=False)} if cuda else {"eager": _decay_epilogue}
    if cuda:
        from dflash_offline import ce_kernel

        for block, warps in KERNEL_CONFIGS:
            variants[f"triton {block}/w{warps}"] = (
                lambda z_, l_, w_, ng, dt, b=block, nw=warps: ce_kernel.ce_epilogue(z_, l_, w_, ng, dt, b, nw))
    for name, fn in variants.items():
        ms = 1000 * timed(lambda fn=fn: fn(z, lab, w, True, torch.bfloat16), dev, args.reps)
        res["epilogue"][name] = {"ms": ms, "tb_per_s_2r1w": moved / ms / 1e9}
        print(json.dumps({name: res["epilogue"][name]}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    print(f"\n| lm_head + CE fwd+bwd, {res['device']} | ms | GEMM TFLOP/s | peak GB |\n|---|---|---|---|")
    for k, v in res["loss"].items():
        print(f"| {k} | {v['ms']:.2f} | {v['gemm_tflops']:.0f} | {v['peak_gb']:.1f} |")
    print(f"\n| epilogue alone, {n} x {V} fp32 logits | ms | TB/s (2 reads + bf16 write) |\n|---|---|---|")
    for k, v in res["epilogue"].items():
        print(f"| {k} | {v['ms']:.2f} | {v['tb_per_s_2r1w']:.2f} |")


if __name__ == "__main__":
    main()
