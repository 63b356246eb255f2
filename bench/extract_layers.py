"""Where stage 1b's time goes: one layer of each type at Qwen3.5-27B shapes (RANDOM weights), timed per variant.

    python -m bench.extract_layers [--batch_rows=2,4,8 --seq_len=4096 --profile]   (GPU)
    python -m bench.extract_layers --tiny                                           (CPU smoke run)

Per layer type (Gated DeltaNet, gated full attention) and rows of log-normal documents (median 400 tokens):
- `hf`: transformers' decoder layer as it is, rows unpacked (what the plain forward of bench.extract runs);
- packed variants: our packed layer with a given attention kernel (flash varlen / compiled flex), delta-rule
  call (value heads native "gva" / q,k repeated "rep") and the pieces around the kernels compiled or eager;
- the kernels alone.
The per-layer times are extrapolated to the 62 layers extraction runs (47 Gated DeltaNet + 15 attention) as
tokens/s. With --profile, the kernel table of one packed forward of the best variant is printed too.
"""

# ruff: noqa: B023  (every lambda below is called at once by `timed`, inside the loop iteration that made it)
from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from bench.extract import TEXT_27B, TEXT_TINY, lognormal_packed_rows, write_config
from dflash_offline import target as tg
from dflash_offline.packing import materialize


def packed_rows(B: int, S: int, vocab: int, seed: int = 0):
    """(input_ids, position_ids, doc_ids) [B, S] on the CPU: log-normal documents (median 400) packed best-fit."""
    done = lognormal_packed_rows(8 * B, S, vocab, seed)
    # the first rows to complete are the rare single-document ones (a document of S tokens fills a row at once):
    # take later rows, which hold the typical mix
    arrays, _ = materialize(done[-B:], S, 0)
    return tuple(torch.from_numpy(np.asarray(arrays[k])).long() for k in ("input_ids", "position_ids", "doc_ids"))


def timed(fn, device, reps: int) -> float:
    """Median seconds of fn() over reps calls (after one warm-up call)."""
    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return float(np.median(out))


@contextmanager
def unfuse(*layers):
    """Run the layers with one GEMM per projection (as before `target.fuse_projections`), then restore."""
    owners = [o for la in layers for o in (la.mlp, getattr(la, "linear_attn", None) or la.self_attn)]
    saved = [o.fused_in for o in owners]
    for o in owners:
        o.fused_in = None
    try:
        yield
    finally:
        for o, w in zip(owners, saved, strict=True):
            o.fused_in = w


def fla_delta_rule_repeated(q, k, v, g, beta, seg):
    """The delta rule as transformers calls it: q and k repeated to the value heads first."""
    r = v.shape[2] // q.shape[2]
    return tg.fla_delta_rule(q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2), v, g, beta, seg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch_rows", default="2,4,8")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--workdir", type=Path, default=Path("build/bench-extract-layers"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    cuda = device.type == "cuda"
    text = TEXT_TINY if args.tiny else TEXT_27B
    S = min(args.seq_len, 256) if args.tiny else args.seq_len
    dtype = torch.bfloat16 if cuda else torch.float32
    info = tg.read_target_info(write_config(args.workdir / "target", text))
    torch.manual_seed(0)
    model = tg.random_target(info, 4, [3], device, dtype, "packed" if cuda else "per_doc")
    gdn_layer, attn_layer = model.stack.layers[0], model.stack.layers[3]
    n_gdn = sum(t == "linear_attention" for t in TEXT_27B_TYPES(62))
    n_attn = 62 - n_gdn
    flex, flash = tg.flex_attention_kernel, tg.flash_varlen_attention
    variants = {}
    if cuda:
        compiled = tg.compiled_pieces()
        variants = {
            "flex/rep/eager (previous)": (tg.PackedKernels(flex, tg.fla_conv, fla_delta_rule_repeated), tg.EAGER_PIECES),
            "flex/gva/compiled": (tg.PackedKernels(flex, tg.fla_conv, tg.fla_delta_rule), compiled),
            "flash/gva/eager": (tg.PackedKernels(flash, tg.fla_conv, tg.fla_delta_rule), tg.EAGER_PIECES),
            "flash/gva/compiled/unfused": (tg.PackedKernels(flash, tg.fla_conv, tg.fla_delta_rule), compiled),
            "flash/gva/compiled": (tg.PackedKernels(flash, tg.fla_conv, tg.fla_delta_rule), compiled),
        }
    else:
        variants = {"reference/eager": (tg.REFERENCE_KERNELS, tg.EAGER_PIECES)}
    res = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
           "weights": "random", "seq_len": S, "layers_extrapolated": {"gated_deltanet": n_gdn, "attention": n_attn},
           "rows": {}}
    rows_list = [int(b) for b in args.batch_rows.split(",")]
    rope, gated = model._rope, True
    for B in rows_list:
        ids, pos, doc = packed_rows(B, S, info.vocab_size)
        T = B * S
        t0 = time.perf_counter()
        seg = tg.Segments.build(tg.row_spans(doc, pos), S, device)
        host_s = time.perf_counter() - t0
        r = {"tokens": T, "segments": len(seg.bounds), "host_segments_ms": 1000 * host_s,
             "padding_frac": float((doc < 0).float().mean())}
        g = torch.Generator(device=device).manual_seed(1)
        cpu_kernels = tg.torch_gated_deltanet_kernels() if not cuda else nullcontext()
        with torch.inference_mode(), cpu_kernels:
            h = (torch.randn(1, T, info.hidden_size, generator=g, device=device) * 0.5).to(dtype)
            cos_sin = model._cos_sin(h, seg.pos_1T)
            h_BSH = h.view(B, S, -1)
            cos_sin_rows = model._cos_sin(h_BSH, torch.arange(S, device=device).expand(B, S))
            for name, (kern, pieces) in variants.items() if B == rows_list[0] else []:
                seg.cache.clear()
                t_start = time.perf_counter()
                try:
                    stash = unfuse(gdn_layer, attn_layer) if name.endswith("/unfused") else nullcontext()
                    with stash:
                        for layer in (gdn_layer, attn_layer):  # warm-up: autotune / compile
                            tg._packed_layer(layer, h, seg, kern, pieces, cos_sin, rope, gated)
                        if cuda:
                            torch.cuda.synchronize()
                        r[f"warmup_s {name}"] = time.perf_counter() - t_start
                        for kind, layer in (("gdn", gdn_layer), ("attn", attn_layer)):
                            r[f"{kind} ms {name}"] = 1000 * timed(
                                lambda layer=layer, kern=kern, pieces=pieces: tg._packed_layer(
                                    layer, h, seg, kern, pieces, cos_sin, rope, gated), device, args.reps)
                except Exception as e:  # report and go on with the other variants
                    import traceback

                    traceback.print_exc()
                    r[f"error {name}"] = repr(e)[:300]
            for kind, layer in (("gdn", gdn_layer), ("attn", attn_layer)):
                r[f"{kind} ms hf"] = 1000 * timed(
                    lambda layer=layer: layer(h_BSH, attention_mask=None, position_embeddings=cos_sin_rows),
                    device, args.reps)
            if cuda and B != rows_list[0]:
                kern, pieces = variants["flash/gva/compiled"]
                for kind, layer in (("gdn", gdn_layer), ("attn", attn_layer)):
                    r[f"{kind} ms flash/gva/compiled"] = 1000 * timed(
                        lambda layer=layer: tg._packed_layer(layer, h, seg, kern, pieces, cos_sin, rope, gated),
                        device, args.reps)
            # kernels alone
            x = attn_layer.input_layernorm(h)
            q, k, v, gate = tg._attention_in(attn_layer, h, *cos_sin, rope, gated)
            if cuda:
                r["kernel ms flash varlen attention"] = 1000 * timed(lambda: flash(q, k, v, seg, 0.0625), device,
                                                                     args.reps)
                seg.cache.clear()
                r["kernel ms flex attention (mask cached)"] = 1000 * timed(lambda: flex(q, k, v, seg, 0.0625),
                                                                          device, args.reps)

                def mask_and_flex():
                    seg.cache.clear()
                    flex(q, k, v, seg, 0.0625)

                r["kernel ms flex attention + block mask"] = 1000 * timed(mask_and_flex, device, args.reps)
            qr, kr, vr = (t.view(B, S, *t.shape[2:]).transpose(1, 2) for t in (q, k, v))
            r["kernel ms sdpa causal rows (hf)"] = 1000 * timed(lambda: torch.nn.functional.scaled_dot_product_attention(
                qr, kr, vr, is_causal=True, enable_gqa=True), device, args.reps)
            r["ms mlp (post-norm + MLP)"] = 1000 * timed(lambda: attn_layer.mlp(attn_layer.post_attention_layernorm(h)),
                                                         device, args.reps)
            if cuda:
                gdn = gdn_layer.linear_attn
                qkv, gg, beta, z = tg._deltanet_in(gdn_layer, h)
                r["kernel ms fla conv varlen"] = 1000 * timed(lambda: tg.fla_conv(
                    qkv, gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias, gdn.activation, seg), device, args.reps)
                qkv = tg.fla_conv(qkv, gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias, gdn.activation, seg)
                qq, kk, vv = torch.split(qkv, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
                qq, kk = qq.view(1, T, -1, gdn.head_k_dim), kk.view(1, T, -1, gdn.head_k_dim)
                vv = vv.view(1, T, -1, gdn.head_v_dim)
                r["kernel ms fla delta rule gva"] = 1000 * timed(lambda: tg.fla_delta_rule(qq, kk, vv, gg, beta, seg),
                                                                 device, args.reps)
                r["kernel ms fla delta rule repeated"] = 1000 * timed(
                    lambda: fla_delta_rule_repeated(qq, kk, vv, gg, beta, seg), device, args.reps)
                o1 = tg.fla_delta_rule(qq, kk, vv, gg, beta, seg).float()
                o2 = fla_delta_rule_repeated(qq, kk, vv, gg, beta, seg).float()
                r["gva vs repeated rel err"] = float((o1 - o2).norm() / o2.norm())
                o1 = flash(q, k, v, seg, 0.0625).float()
                seg.cache.clear()
                o2 = flex(q, k, v, seg, 0.0625).float()
                r["flash vs flex rel err"] = float((o1 - o2).norm() / o2.norm())
            del x
        for name in ["hf", *variants]:
            gk, ak = f"gdn ms {name}", f"attn ms {name}"
            if gk in r and ak in r:
                r[f"est tok/s {name}"] = T / ((n_gdn * r[gk] + n_attn * r[ak]) / 1000)
        res["rows"][B] = r
        print(json.dumps({B: r}), flush=True)
    if args.profile and cuda:
        from torch.profiler import ProfilerActivity, profile

        B = rows_list[0]
        ids, pos, doc = packed_rows(B, S, info.vocab_size)
        model.tapped_hidden_states(ids, pos, doc)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.tapped_hidden_states(ids, pos, doc)
            torch.cuda.synchronize()
        key = "self_cuda_time_total"
        try:
            table = prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60)
        except Exception:
            table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=22,
                                              max_name_column_width=60)
        print(table)
        res["profile_table"] = table
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    print(f"\n| per layer, {res['device']}, S={S} | " + " | ".join(f"B={b}" for b in rows_list) + " |")
    print("|---|" + "---|" * len(rows_list))
    keys = [k for k in res["rows"][rows_list[0]] if " ms " in f" {k} " or k.startswith("est")]
    for k in keys:
        vals = [res["rows"][b].get(k) for b in rows_list]
        print(f"| {k} | " + " | ".join("" if v is None else (f"{v:,.0f}" if v > 100 else f"{v:.3g}")
                                       for v in vals) + " |")


def TEXT_27B_TYPES(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


if __name__ == "__main__":
    main()
