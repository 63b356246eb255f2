"""The storage plan of an extraction: what the hidden cache will weigh in every encoding, what training will read,
and what regeneration, extraction, verification and training cost in GPU-hours — printed by `make extract DRY_RUN=1`
before anything runs, from the target's config.json and tokenizer alone (weights optional).

Every number is a product of a few inputs: the rows and tokens stage 1a packs (its real counts, from the dry run's
in-memory manifest), the bytes per token of an encoding (the registry `cache.encodings.ENCODINGS`: a new encoding is
one more entry there, and a row of the plan), and rates measured on one H200 (`EXTRACT_TOK_S`, `TRAIN_TOK_S`,
`TRAIN_SMALL_TOK_S`, sources beside them). A target or drafter of other shapes gets those rates scaled by work per
token — the extraction by the parameters of the target layers it runs, the training by the drafter's FLOPs per context
token (`metrics.flops_per_row`) at the FLOP rate measured for its block tokens a row (`train_flop_rate`: the 27B
bench drafter's and the Qwen3.8-27B recipe's, interpolated between; a DFlash2 drafter as DFlash, then × DFlash2's
measured cost against DFlash) — and the plan says so;
`plan_extract_tok_s=` / `plan_train_tok_s=` replace them with your own. The read bandwidth is bytes per token ×
training tokens/s per GPU × GPUs. Regeneration is the corpus's answer tokens (its supervised tokens) at an engine rate
this repository has not measured (`plan_regen_tok_s=` gives it); verification re-hashes the whole cache
(`HASH_GB_S_PER_THREAD`, or `plan_read_gb_s=`) and recomputes `make verify`'s sampled rows at the extraction rate.
`storage_plan` takes plain values and `render` prints them, so both are tested without a checkpoint;
`stages/extract.py` composes them with `extract_plan.plan_run`'s `ExtractPlan`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

from .cache.fsio import size  # (bytes in decimal units: the plan's figures)

# Measured rates, one NVIDIA H200 at the Qwen3.5/3.6-27B shapes, random weights (docs/benchmarks.md):
# stage 1b, row tok/s per GPU including shard writes (bf16), 4 rows of 4096 a forward, taps [1, 16, 31, 46, 61]:
# `make bench-extract`, 2026-11-30, commit f18a350, bench/results/bench-extract-h200.json ("row_tok_per_s")
EXTRACT_TOK_S = 12_045
EXTRACT_SEQ_LEN = 4096  # the rows it was measured on (attention's share of the work grows with them)
EXTRACT_LAYER_PARAMS = 23_597_668_128  # parameters of the decoder layers it ran (layers 0..61; "layer_params")
# stage 2, context tok/s per GPU, 1 row of 2048 a step, 512 anchors: `make bench-train`, 2026-12-01 (docs/benchmarks.md):
# 9,633-10,088 over four calls on as many H200s, which hold different clocks at the power limit (1509-1578 MHz); the
# read check every run does costs ≤ 0.5 % (bench/results/train-read-check-h200.json: 10,053 and 10,014 with it,
# 10,088 without, one call). A plan takes the slowest: a GPU-hour budget should not assume the fastest GPU.
TRAIN_TOK_S = 9_633
# precision=fp8 (float8 linears, tensorwise) over bf16, one process a run on one H200, bf16 first and last (drift
# 0.04 %): 12,084 vs 9,858 and 9,854 ctx tok/s (bench/results/bench-train-precision-h200.json, 2026-12-03,
# `bench.train_compare`): a plan of an fp8 run takes the bf16 rate × this. The ratio of rates, not per clock (1.196):
# every run sat at the 700 W limit, where float8's lower power per operation holds a higher clock — on any GPU that
# runs at its power limit, as these steps do
TRAIN_FP8_SPEEDUP = 12_084 / ((9_858 + 9_854) / 2)
# precision=fp8 with loss_logits=fp8 (both lm_head GEMMs in float8 as well), the same call: 13,383 ctx tok/s
TRAIN_FP8_HEAD_SPEEDUP = 13_383 / ((9_858 + 9_854) / 2)
# weighting=dpace over decay, each with float8 linears and lm_head GEMMs on an fp4 cache (the Qwen3.5/3.6-27B
# recipes' step), one process each, two H200s (1678 and 1670 MHz; 2026-12-04, `0b2900e`,
# bench/results/bench-train-{dpace,decay}-fp8-fp4-h200.json): 13,257 vs 13,482 ctx tok/s — D-PACE's epilogue runs
# twice a chunk. A plan of a D-PACE run takes its rate × this (a cost within the spread between H200s, kept: a budget
# should not round a measured cost away)
TRAIN_DPACE_FACTOR = 13_257 / 13_482
TRAIN_SEQ_LEN = 2048
TRAIN_DRAFTER = SimpleNamespace(hidden_size=5120, intermediate_size=17408, vocab_size=248320, num_layers=5,
                                num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, num_anchors=512,
                                target_layer_ids=[1, 16, 31, 46, 61], variant="dflash")  # the drafter it was measured at
# stage 2 at the Qwen3.8-27B DFlash2 recipe's drafter (the same widths; block 8, 64 anchors a row of 4096, every layer
# sliding over 2048, the whole block visible), bf16, the cache resident on the GPU (the step, not the reader: with a
# bf16 cache streamed and its read check on, the reader set the pace there, 36-56 % of the wall time waiting):
# `python -m bench.train --recipe=manifests/qwen3.8-27b-dflash2.toml --seq_len=4096 --anchors=64 --skip_baseline
# --resident=on --read_check=off`, one H200, 2026-12-04, commit ec85964,
# bench/results/bench-train-dflash2-resident-h200.json: as DFlash 118,113 then 104,285 ctx tok/s (the second 12 %
# slower at a 3.6 % higher mean clock, 1935 vs 1868 MHz: a drift within the call not explained by the clock), as
# DFlash2 84,748 (1956 MHz). A plan takes the slower DFlash run. FLOPs scaled from the bench shape above would have
# said 215,563 for this DFlash: small blocks (64 anchors × 8) use the GPU half as well (FLOP fraction 0.35-0.39 in bf16)
TRAIN_SMALL_TOK_S = 104_285
TRAIN_SMALL_AT = "the Qwen3.8-27B recipe's drafter (block 8, 64 anchors, rows of 4096)"
TRAIN_SMALL_SEQ_LEN = 4096
TRAIN_SMALL_DRAFTER = SimpleNamespace(**{**vars(TRAIN_DRAFTER), "block_size": 8, "num_anchors": 64})
# DFlash2 over DFlash at those shapes, against the mean of the DFlash runs (A, B, A): its conv and selector take 31 %
# more time a context token where they add 13 % of the FLOPs (the selector's top-16 search over the vocabulary): one
# of the two measured costs of DFlash2 (`dflash2_points`)
TRAIN_DFLASH2_FACTOR = 84_748 / ((118_113 + 104_285) / 2)
TRAIN_VARIANT_FACTOR = {"dflash": 1.0, "dflash2": TRAIN_DFLASH2_FACTOR}
# the DFlash2 drafter that cost was measured at (the Qwen3.8-27B recipe's conv and selector)
TRAIN_DFLASH2_DRAFTER = SimpleNamespace(**{**vars(TRAIN_SMALL_DRAFTER), "variant": "dflash2", "conv_kernel_size": 2,
                                           "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16})
# DFlash2 against DFlash in the Qwen3.5/3.6-27B recipes' own training (their drafter, the same conv and selector: block
# 16, 512 anchors, rows of 4096; float8 linears and lm_head GEMMs, D-PACE, a streamed fp4 cache), one process a run on
# one H200, DFlash first and last (drift 0.2 %): DFlash 25,106 and 25,168, DFlash2 18,143 ctx tok/s, ×0.722 (peak
# 48.5 vs 42.2 GB): `python -m bench.train_compare --reference=fp8+fp8head+dflash --variants=fp8+fp8head+dflash2
# --recipe=manifests/qwen3.6-27b.toml --seq_len=4096 --weighting=dpace --quant=fp4 --steps=40`, 2026-12-04, commit
# 68852ee, bench/results/bench-train-compare-dflash2-qwen36-h200.json. Its conv and selector (in bf16 under
# precision=fp8: no float8 there) add 19 % to the FLOPs and 15.3 µs a context token, less time per FLOP than at
# the Qwen3.8 recipe's drafter (larger GEMMs)
TRAIN_DFLASH2_BIG_TOK_S = {"dflash": (25_106 + 25_168) / 2, "dflash2": 18_143}
TRAIN_DFLASH2_BIG_AT = "the Qwen3.5/3.6-27B recipes' drafter (block 16, 512 anchors, rows of 4096)"
TRAIN_DFLASH2_BIG_SEQ_LEN = 4096
TRAIN_DFLASH2_BIG_DRAFTER = SimpleNamespace(**{**vars(TRAIN_DRAFTER), **{k: getattr(TRAIN_DFLASH2_DRAFTER, k) for k in (
    "variant", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}})
# DFlash2's added time (conv, selector, the selector's top-k search) is counted in units of DFlash's bf16 step at the
# same drafter: at the Qwen3.8 recipe's drafter 1/×0.762 − 1 (measured in bf16, against the mean of the two DFlash
# runs, where the plan takes the slower run's rate: 79,479 planned for the 84,748 measured, a budget on the safe
# side), at the Qwen3.5/3.6 recipes' the measured 15.3 µs a token × the plan's bf16 DFlash rate there (so the plan's
# DFlash2 step there is its DFlash step + the measured 15.3 µs). A plan divides that by the share of FLOPs they add
# there (their time per FLOP), takes it at its drafter's block tokens a row (the two interpolated in log block tokens,
# as `train_flop_rate`; the nearer one beyond them) and multiplies it by its drafter's share (`dflash2_factor`)
# the measured training points (where, drafter, row length, rate), most block tokens a row (anchors × block) first:
# a plan takes the model FLOP rate (tok/s × FLOPs per context token) of the point its drafter's block tokens reach or
# pass, between them the two interpolated in log block tokens, and divides it by its drafter's FLOPs per token
TRAIN_POINTS = (("the 27B drafter, rows of 2048", TRAIN_DRAFTER, TRAIN_SEQ_LEN, TRAIN_TOK_S),
                (TRAIN_SMALL_AT, TRAIN_SMALL_DRAFTER, TRAIN_SMALL_SEQ_LEN, TRAIN_SMALL_TOK_S))
# One trainer process's reader (one thread: row reads, the read check's hashing, pinned copies) where it set the pace:
# the Qwen3.8 recipe's drafter on a streamed bf16 cache ran slower in every run than with the cache resident on the
# GPU — DFlash 48,420 and 65,504 ctx tok/s (resident 118,113 / 104,285), DFlash2 77,613 (84,748)
# (bench/results/bench-train-dflash2-h200.json, -resident-h200.json; one H200 host, files in the page cache): the
# reader delivered 2.48-3.97 GB/s of states. A plan whose chosen encoding asks a GPU for more than it was ever seen to
# deliver says training may wait for data
READER_GB_S = 77_613 * 51_200 / 1e9
# make verify re-hashes every shard file: SHA-256 (hashlib, 4 MiB reads, fsio.sha256_file) on HASH_THREADS
# threads. 1.0 GB/s a thread: one core of a shared 2-vCPU AMD EPYC with SHA-NI, files in the page cache (2026-12-02;
# 0.99-1.07 GB/s over four runs). Not measured on a GPU host: a plan takes that × the threads, which the filesystem's
# read rate caps (`plan_read_gb_s=` gives that rate).
HASH_GB_S_PER_THREAD = 1.0
# What each encoding costs in τ on the GPU yardstick, as the testbed's verdict says it (docs/testbed.md: A/B with 2
# seeds, a null and a known-bad arm, a 124M target of hidden 768, DFlash drafters): "parity" = the interval of Δ τ vs
# bf16 holds 0 and |Δ| is within the null arm's half-width (inside the null arm's interval in the sweeps before
# 13498fd), every seed lossless. fp8: +0.02 (95 % −0.28 … +0.32, null ±0.30;
# bench/results/testbed-sweep-h200-419204b.json); fp4: −0.01 (−0.23 … +0.21) and taps projected to half the width in
# fp8 ("fp8 k=1/2", project_dims=384 of 768): −0.06 (−0.28 … +0.16), both in bench/results/testbed-sweep-h200-9b6a2b6.json
# (2026-12-03), null ±0.22 — a loss under ≈ 6–7 % would go unseen; taps projected to half the width in bf16 ("bf16
# k=1/2"): −0.07 (−0.26 … +0.13), null −0.23 … +0.17, bench/results/testbed-sweep-h200-66bb894.json (2026-12-03);
# taps projected to a quarter in fp8 ("fp8 k=1/4", project_dims=192 of 768): −0.02 (−0.16 … +0.12), null ±0.12, at
# 300 steps under seeds of each arm's own, bench/results/testbed-sweep-h100-913a79a-seeds.json (2026-12-06).
# At 4327e15 (2026-12-07, bench/results/testbed-sweep-h100-4327e15-seeds.json, null ±0.18) every one of them again.
# A projection is keyed by its share of the width.
TESTBED_TAU = {"bf16": "reference", "fp8": "parity", "fp4": "parity", "fp8 k=1/2": "parity", "bf16 k=1/2": "parity",
               "fp8 k=1/4": "parity"}


def testbed_tau(name: str, hidden: int, kk: int = 0) -> str:
    """The yardstick's verdict on encoding `name` of taps of width `hidden`, projected to `kk` dims (0: not projected),
    or "not judged". A projection was judged at its share of the testbed's width only ("parity at 1/2 the width on the
    testbed"): what k directions keep of the states' energy is the target's own (the extraction log reports it), which
    the testbed's 124M target does not stand for."""
    if not kk or kk == hidden:
        return TESTBED_TAU.get(name, "not judged")
    share = f"1/{hidden // kk}" if hidden % kk == 0 else ""
    verdict = TESTBED_TAU.get(f"{name} k={share}")
    return f"{verdict} at {share} the width on the testbed" if verdict else "not judged"


def projected_widths(hidden: int) -> list[int]:
    """The projected widths a full-width plan also sizes: half and a quarter of `hidden`, where a multiple of 32."""
    return [w for w in (hidden // 2, hidden // 4) if w and w % 32 == 0]


def token_bytes_per_token() -> int:
    """Bytes a token takes in the token cache: stage 1a's Arrow columns (`shards.TOKEN_COLUMNS`; 13), headers and
    each row's document sources aside."""
    import numpy as np

    from .cache.shards import TOKEN_COLUMNS

    return sum(np.dtype(d).itemsize for _, d in TOKEN_COLUMNS.values())


def target_layer_params(ckpt: Path, depth: int) -> int:
    """Parameters of the target's first `depth` decoder layers, from its config alone (built on the meta device)."""
    import torch
    from transformers import AutoConfig

    from .target import TextStack, read_target_info

    text = AutoConfig.from_pretrained(str(ckpt), local_files_only=True).get_text_config()
    with torch.device("meta"):
        stack = TextStack(text, read_target_info(ckpt).arch, depth, False)
    return sum(p.numel() for p in stack.layers.parameters())


def drafter_shape(train, hidden: int, intermediate: int, vocab: int, layer_ids: list[int]) -> SimpleNamespace:
    """What `metrics.flops_per_row` reads of a drafter, from a TrainConfig (or None: its defaults) and the target."""
    from .trainsetup import TrainConfig

    t = train or TrainConfig(cache="")
    d = t.drafter
    return SimpleNamespace(hidden_size=hidden, intermediate_size=d.intermediate_size or intermediate,
                           vocab_size=vocab, num_layers=d.num_layers, num_heads=d.num_heads,
                           num_kv_heads=d.num_kv_heads, head_dim=d.head_dim, block_size=d.block_size,
                           num_anchors=t.loss.num_anchors, target_layer_ids=list(d.layer_ids) or layer_ids,
                           variant=d.variant, conv_kernel_size=d.conv_kernel_size, conv_group_size=d.conv_group_size,
                           selector_rank=d.selector_rank, selector_top_k=d.selector_top_k)


def as_dflash(drafter) -> SimpleNamespace:
    """`drafter` as DFlash: its shape without DFlash2's conv and selector (for `metrics.flops_per_row`)."""
    return SimpleNamespace(**{**vars(drafter), "variant": "dflash"})


def log_interpolated(block_tokens: int, points: list[tuple[int, float]]) -> tuple[float, int | None]:
    """A value at `block_tokens` a row from measured (block tokens, value) `points`, most block tokens first: a
    point's own where `block_tokens` reach it (the first's at or above, the last's at or below; the point's index),
    else the two around it interpolated in log block tokens (None)."""
    from math import exp, log

    if block_tokens >= points[0][0]:
        return points[0][1], 0
    for (q_hi, f_hi), (q_lo, f_lo) in zip(points, points[1:], strict=False):
        if block_tokens > q_lo:
            w = log(block_tokens / q_lo) / log(q_hi / q_lo)
            return exp(log(f_lo) + w * (log(f_hi) - log(f_lo))), None
    return points[-1][1], len(points) - 1


def train_flop_rate(block_tokens: int) -> tuple[float, int | None]:
    """The model FLOP/s of a bf16 DFlash training step with `block_tokens` (anchors × block) a row, from
    `TRAIN_POINTS` (`log_interpolated`: the point's index, or None between two)."""
    from .metrics import flops_per_row

    return log_interpolated(block_tokens, [(d.num_anchors * d.block_size, rate * flops_per_row(d, n, d.num_anchors) / n)
                                           for _, d, n, rate in TRAIN_POINTS])


def dflash2_flop_share(drafter, seq_len: int) -> float:
    """The FLOPs a DFlash2 drafter's conv and selector add to a training row, as a share of its FLOPs as DFlash."""
    from .metrics import flops_per_row

    return flops_per_row(drafter, seq_len, drafter.num_anchors) / flops_per_row(as_dflash(drafter), seq_len,
                                                                                 drafter.num_anchors) - 1


@functools.cache
def dflash2_points() -> tuple[tuple[str, int, float, float], ...]:
    """The two drafters DFlash2's cost was measured at, most block tokens a row first: (where, block tokens a row,
    the share of FLOPs its conv and selector add there, their time as a fraction of DFlash's bf16 step there)."""
    from .metrics import flops_per_row

    big, n = TRAIN_DFLASH2_BIG_DRAFTER, TRAIN_DFLASH2_BIG_SEQ_LEN
    bf16_tok_s = train_flop_rate(big.num_anchors * big.block_size)[0] / (flops_per_row(as_dflash(big), n,
                                                                                        big.num_anchors) / n)
    added_s = 1 / TRAIN_DFLASH2_BIG_TOK_S["dflash2"] - 1 / TRAIN_DFLASH2_BIG_TOK_S["dflash"]
    small = TRAIN_DFLASH2_DRAFTER
    return ((TRAIN_DFLASH2_BIG_AT, big.num_anchors * big.block_size, dflash2_flop_share(big, n), added_s * bf16_tok_s),
            (TRAIN_SMALL_AT, small.num_anchors * small.block_size, dflash2_flop_share(small, TRAIN_SMALL_SEQ_LEN),
             1 / TRAIN_DFLASH2_FACTOR - 1))


def dflash2_time_per_share(block_tokens: int) -> tuple[float, int | None]:
    """The time DFlash2's conv and selector take, as a fraction of DFlash's bf16 step, per unit of the FLOP share they
    add, at `block_tokens` a row (`log_interpolated` over `dflash2_points`: the point's index, or None between)."""
    return log_interpolated(block_tokens, [(q, time / share) for _, q, share, time in dflash2_points()])


def dflash2_factor(drafter, seq_len: int) -> float:
    """DFlash2's training rate against DFlash's bf16 step for `drafter`: 1 / (1 + its conv and selector's time), that
    time = their time per FLOP share at its block tokens (`dflash2_time_per_share`) × the share they add here."""
    per_share, _ = dflash2_time_per_share(drafter.num_anchors * drafter.block_size)
    return 1 / (1 + per_share * dflash2_flop_share(drafter, seq_len))


def rates(*, layer_params: int, drafter, seq_len: int, extract_tok_s: float = 0.0, train_tok_s: float = 0.0,
          regen_tok_s: float = 0.0, precision: str = "bf16", loss_logits: str = "fp32",
          weighting: str = "decay") -> dict:
    """Tokens/s per GPU for both stages, each with where it comes from: given (> 0), or measured H200 rates scaled
    by work per token — extraction by the parameters of the target layers it runs ("measured" at its shapes and row
    length); training by the drafter's FLOPs per context token, from the FLOP rate measured at its block tokens a
    row (`train_flop_rate`; `at` names the point, or `interpolated` between two; "measured" at a point's own
    drafter) — and, for a `precision="fp8"` training, by fp8's measured speed-up (`fp8`: with `loss_logits="fp8"`,
    that of float8 lm_head GEMMs as well; `fp8_logits`), for `weighting="dpace"` by D-PACE's measured cost against
    decay (`dpace`) — both measured at the first point, so elsewhere "scaled" — and for a DFlash2 drafter by its
    measured cost against DFlash (`variant`, `variant_factor`: `dflash2_factor`, the time per FLOP of its conv and
    selector measured at two drafters, `variant_point` the one taken, None: interpolated at `variant_block_tokens`,
    × the share of FLOPs they add here, `variant_share`; its FLOPs counted as DFlash's, its rate always "scaled": a
    product of measurements; float8 and D-PACE scale DFlash's share of the step only: DFlash2's added time — its conv,
    selector and the selector's top-k search, a bf16 GEMM under any `loss_logits` — is counted as measured in bf16);
    and regeneration's generated tokens/s when given."""
    from .metrics import flops_per_row

    if drafter.variant not in TRAIN_VARIANT_FACTOR:
        raise ValueError(f"no measured training rate for variant={drafter.variant!r} (measured: "
                         f"{', '.join(TRAIN_VARIANT_FACTOR)}): give plan_train_tok_s=")
    per_tok = flops_per_row(as_dflash(drafter), seq_len, drafter.num_anchors) / seq_len
    block_tokens = drafter.num_anchors * drafter.block_size
    flop_rate, point = train_flop_rate(block_tokens)
    variant = drafter.variant if drafter.variant != "dflash" else None
    fp8 = ({} if precision != "fp8" else {"fp8": TRAIN_FP8_SPEEDUP} if loss_logits != "fp8" else
           {"fp8": TRAIN_FP8_HEAD_SPEEDUP, "fp8_logits": True})  # (fp8 logits alone: not measured, no speed-up)
    train = {**fp8, **({"variant": variant, "variant_factor": dflash2_factor(drafter, seq_len),
                        "variant_share": dflash2_flop_share(drafter, seq_len), "variant_block_tokens": block_tokens,
                        "variant_point": dflash2_time_per_share(block_tokens)[1]} if variant else {}),
             **({"dpace": TRAIN_DPACE_FACTOR} if weighting == "dpace" else {})}
    train_tok_per_s = flop_rate / per_tok  # (bf16 DFlash at this drafter's FLOPs and block tokens)
    if point is None:
        train.update(interpolated=drafter.num_anchors * drafter.block_size)
        measured, factor = tuple(p[3] for p in TRAIN_POINTS), train_tok_per_s / TRAIN_TOK_S
    else:
        measured = TRAIN_POINTS[point][3]
        train.update(at=TRAIN_POINTS[point][0])
        factor = train_tok_per_s / measured
    # (fp8 and D-PACE were measured at the first point only; a DFlash2 rate is always a product of measurements)
    train_same = point is not None and not variant and (point == 0 or not (fp8 or weighting == "dpace"))
    ex = EXTRACT_LAYER_PARAMS / layer_params  # (extraction's row length is not in its work: measured at its own)
    out = {"extract": {"tok_s": extract_tok_s, "source": "given"} if extract_tok_s else
           {"tok_s": EXTRACT_TOK_S * ex,
            "source": "measured" if abs(ex - 1) < 0.01 and seq_len == EXTRACT_SEQ_LEN else "scaled",
            "factor": ex, "measured_tok_s": EXTRACT_TOK_S},
           "train": {"tok_s": train_tok_s, "source": "given"} if train_tok_s else
           {"tok_s": train_tok_per_s / (1 / (train.get("fp8", 1.0) * train.get("dpace", 1.0))
                                        + 1 / train.get("variant_factor", 1.0) - 1),
            "source": "measured" if abs(factor - 1) < 0.01 and train_same else "scaled",
            "factor": factor, "measured_tok_s": measured, **train}}
    if regen_tok_s:
        out["regen"] = {"tok_s": regen_tok_s, "source": "given"}
    return out


def hash_rate(read_gb_s: float = 0.0) -> dict:
    """The rate `make verify` re-hashes the cache at, GB/s: given (the filesystem's read rate), or SHA-256's a
    thread × the threads verify uses (what the CPU allows)."""
    from .cache.fsio import HASH_THREADS

    if read_gb_s:
        return {"gb_s": read_gb_s, "source": "given"}
    return {"gb_s": HASH_GB_S_PER_THREAD * HASH_THREADS, "source": "estimate", "threads": HASH_THREADS}


def plan_epochs(train, rows: int, seq_len: int, gpus: int) -> float | None:
    """Passes over the cache a [train] table asks for: `epochs`, or steps × global batch rows / rows (the global
    batch: global_batch_tokens, else batch_rows on each of `gpus` processes). None without a [train] table."""
    if train is None or not rows:
        return None
    sch = train.schedule
    if sch.epochs:
        return sch.epochs
    step_rows = sch.global_batch_tokens / seq_len if sch.global_batch_tokens else sch.batch_rows * gpus
    return sch.steps * step_rows / rows


def storage_plan(*, rows: int, seq_len: int, doc_tokens: int, k: int, hidden: int, quant: str, need: int,
                 shards: str, free: int, fits: bool, min_free_gb: float, allow_overfill: bool, gpus: int,
                 epochs: float | None, rate: dict, gpu: bool, projected_from: int = 0, todo_rows: int | None = None,
                 token_bytes: int = 0, answer_tokens: int = 0, verify_rows: int = 0, verify_per_shard: int = 2,
                 hashing: dict | None = None) -> dict:
    """The plan's numbers. `hidden`: values stored per token and tap (project_dims for a projected cache, whose
    target's hidden size is `projected_from`); `need`: bytes the run writes — the shards still to do in the chosen
    encoding (`shards`: '3/4', to do of all; `todo_rows` their rows, default all: what extraction's GPU-hours are
    for), plus `token_bytes` when stage 1a has not written the token cache yet; `free`: free bytes where the cache
    goes; `fits`: `extract_plan.disk_refusal` found room; `gpu`: False on a CPU run (device=cpu), where the H200 rates (not
    given ones) are left out. `answer_tokens`: the corpus's supervised tokens (what regeneration generates);
    `verify_rows`: the rows `make verify` recomputes (`verify_per_shard` a shard); `hashing`: `hash_rate`'s."""
    from .cache.encodings import (
        ENCODINGS,  # (`h`: the hidden size, or project_dims: any encoding stores either)
    )

    tokens = rows * seq_len
    todo_tokens = tokens if todo_rows is None else todo_rows * seq_len
    enc = {name: {"what": e.what, "bytes_per_token": e.size(k, hidden), "total_bytes": tokens * e.size(k, hidden),
                  "testbed_tau": testbed_tau(name, projected_from or hidden, hidden)}
           for name, e in ENCODINGS.items()}
    if not projected_from:  # the same encodings of taps projected to half and a quarter of the width (project_dims)
        for kk in projected_widths(hidden):
            enc.update({f"{name} k={kk}": {"what": f"{e.what}, {kk} projected dims a tap (project_dims={kk})",
                                           "bytes_per_token": e.size(k, kk), "total_bytes": tokens * e.size(k, kk),
                                           "testbed_tau": testbed_tau(name, hidden, kk)}
                        for name, e in ENCODINGS.items()})
    shown = {s: r for s, r in rate.items() if gpu or r["source"] == "given"}
    train = shown.get("train")
    for e in enc.values():
        e["read_gb_s"] = e["bytes_per_token"] * train["tok_s"] * gpus / 1e9 if train else None
    gpu_h = {}
    if "regen" in shown:
        gpu_h["regen"] = answer_tokens / shown["regen"]["tok_s"] / 3600
    if "extract" in shown:
        gpu_h["extract"] = todo_tokens / shown["extract"]["tok_s"] / 3600
        gpu_h["verify"] = verify_rows * seq_len / shown["extract"]["tok_s"] / 3600
    if train:
        gpu_h["train_epoch"] = tokens / train["tok_s"] / 3600
        if epochs is not None:
            gpu_h["train"] = epochs * gpu_h["train_epoch"]
    hashing = hashing or hash_rate()
    verify = {"rows": verify_rows, "per_shard": verify_per_shard, "bytes": enc[quant]["total_bytes"],
              "hashing": hashing, "hash_h": enc[quant]["total_bytes"] / (hashing["gb_s"] * 1e9) / 3600}
    return {"rows": rows, "seq_len": seq_len, "tokens": tokens, "doc_tokens": doc_tokens, "k": k, "hidden": hidden,
            "todo_rows": rows if todo_rows is None else todo_rows,
            "projected_from": projected_from, "quant": quant, "encodings": enc, "need_bytes": need, "shards": shards,
            "token_bytes": token_bytes, "free_bytes": free, "fits": fits,
            "min_free_gb": min_free_gb, "allow_overfill": allow_overfill, "gpus": gpus, "epochs": epochs,
            "rates": shown, "gpu": gpu, "gpu_hours": gpu_h, "answer_tokens": answer_tokens, "verify": verify}


def hours(h: float) -> str:
    return f"{h:.1f} h" if h >= 1 else f"{h * 60:.0f} min" if h >= 1 / 60 else f"{h * 3600:.0f} s"


MEASURED_AT = {"extract": ("Qwen3.5-27B shapes, rows of 4096", "the parameters of the target layers it runs"),
               "train": (TRAIN_POINTS[0][0], "the drafter's FLOPs per context token")}


def describe_rate(stage: str, r: dict) -> str:
    """'train 18,681 context tok/s per H200 (estimate: … scaled ×1.94 by …)'."""
    unit = "row tok/s" if stage == "extract" else "context tok/s"
    if r["source"] == "given":
        return f"{stage} {r['tok_s']:,.0f} {unit} per GPU (given)"
    at, by = MEASURED_AT[stage]
    at = r.get("at", at)
    as_dflash = " as DFlash" if r.get("variant") else ""  # (its rate: that drafter's as DFlash, × DFlash2's cost)
    if r.get("interpolated"):
        (hi, lo), (q_hi, q_lo) = r["measured_tok_s"], [d.num_anchors * d.block_size for _, d, _, _ in TRAIN_POINTS]
        how = (f"estimate: {hi:,} and {lo:,} measured at {TRAIN_POINTS[0][0]} ({q_hi:,} block tokens a row) and "
               f"{TRAIN_SMALL_AT} ({q_lo:,}), their FLOP rates interpolated at {r['interpolated']:,}, divided by "
               f"{by}{as_dflash}")
    elif r["source"] == "measured":
        how = f"measured at {at}, docs/benchmarks.md"
    else:
        how = f"estimate: {r['measured_tok_s']:,} measured at {at}, scaled ×{r['factor']:.3g} by {by}{as_dflash}"
    if r.get("variant"):
        points, i = dflash2_points(), r["variant_point"]
        measured_share = i is not None and abs(r["variant_share"] / points[i][2] - 1) < 0.01
        if i == 1 and measured_share:  # (the drafter its ratio was measured at)
            how += (f"; ×{r['variant_factor']:.3g} for variant={r['variant']}, its cost against DFlash "
                    + ("there" if r.get("at") == points[i][0] else f"at {points[i][0]}"))
        elif i == 0 and measured_share:  # (its added time measured there)
            how += (f"; ×{r['variant_factor']:.3g} for variant={r['variant']} against DFlash's bf16 step: its added "
                    f"time as measured at {points[i][0]} in their float8 training")
        else:
            where = points[i][0] if i is not None else (
                f"{points[0][0]} and {points[1][0]}, interpolated at {r['variant_block_tokens']:,} block tokens a row")
            how += (f"; ×{r['variant_factor']:.3g} for variant={r['variant']}: its conv and selector add "
                    f"{100 * r['variant_share']:.0f} % to the FLOPs here, at their time per FLOP measured at {where}")
    first = TRAIN_POINTS[0][0]
    if r.get("fp8"):
        how += (f"; ×{r['fp8']:.3g} for precision=fp8" + (" loss_logits=fp8" if r.get("fp8_logits") else "")
                + f", its speed-up {'there' if r.get('at') == first and not r.get('variant') else f'at {first}'} on an H200")
    if r.get("dpace"):
        how += f"; ×{r['dpace']:.3g} for weighting=dpace, its cost against decay " + \
            ("there" if r.get("fp8") or (r.get("at") == first and not r.get("variant")) else f"at {first}")
    if r.get("variant") and (r.get("fp8") or r.get("dpace")):
        how += (f"; {' and '.join(n for n, k in (('float8', 'fp8'), ('D-PACE', 'dpace')) if r.get(k))} scale DFlash's "
                f"share of the step only: DFlash2's added time (conv, selector, its bf16 top-k search) as in bf16")
    return f"{stage} {r['tok_s']:,.0f} {unit} per H200 ({how})"


def render(p: dict, cache: Path, cpu_estimate_min: float | None = None) -> list[str]:
    """The plan as lines for the log: tokens, a table of encodings, free space and verdict, rates, GPU-hours."""
    n, pad = p["gpus"], 1 - p["doc_tokens"] / max(p["tokens"], 1)
    width = f"{p['hidden']:,} projected dims (of hidden {p['projected_from']:,})" if p.get("projected_from") else \
        f"hidden {p['hidden']:,}"
    lines = [f"storage plan: {p['rows']:,} rows × {p['seq_len']:,} = {p['tokens']:,} tokens "
             f"({100 * pad:.1f} % padding); {p['k']} taps × {width}"]
    read = any(e["read_gb_s"] is not None for e in p["encodings"].values())
    lines.append(f"  {'encoding':<16}{'bytes/token':>12}{'cache size':>12}"
                 + (f"{f'training reads at {n} GPUs':>28}" if read else "") + "  τ on the testbed")
    for name, e in p["encodings"].items():
        label = f"{name} (chosen)" if name == p["quant"] else name
        lines.append(f"  {label:<16}{e['bytes_per_token']:>12,}{size(e['total_bytes']):>12}"
                     + (f"{size(e['read_gb_s'] * 1e9) + '/s':>28}" if read else "") + f"  {e['testbed_tau']}")
    if line := reader_line(p):
        lines.append("  " + line)
    if any(" k=" in name for name in p["encodings"]):
        lines.append("  (k=…: taps projected to k dims, project_dims=k; τ on the testbed: vs bf16 at 2 seeds, DFlash drafters, "
                     "docs/testbed.md; a projection's loss also depends on the target's spectrum: calibration logs the "
                     "energy kept)")
    keep = f"keeping min_free_gb={p['min_free_gb']:g}"
    verdict = f"fits, {keep} ({size(p['free_bytes'] - p['need_bytes'])} left after it)" if p["fits"] else \
        f"does not fit, {keep}: " + ("allow_overfill=1 starts a real run anyway" if p["allow_overfill"] else
                                     "a real run is refused (--allow_overfill=1 starts it anyway)")
    tokens = f" and the token cache ({size(p['token_bytes'])})" if p.get("token_bytes") else ""
    lines.append(f"  free where the cache goes ({cache}): {size(p['free_bytes'])}; this run writes "
                 f"{size(p['need_bytes'])} ({p['shards']} shards{tokens}) → {verdict}")
    lines += [f"  rate: {describe_rate(stage, r)}" for stage, r in p["rates"].items()]
    lines += ["  " + regen_line(p), "  " + verify_line(p, cpu_estimate_min)]
    lines.append("  " + gpu_hours_line(p, cpu_estimate_min))
    return lines


def reader_line(p: dict) -> str | None:
    """'reader: bf16 asks 4.07 GB/s a GPU …' when the chosen encoding asks a GPU's reader for more than one was ever
    seen to deliver (`READER_GB_S`), naming the full-width encodings that ask less; else None."""
    n, chosen = p["gpus"], p["encodings"][p["quant"]]
    if chosen["read_gb_s"] is None or chosen["read_gb_s"] / n <= READER_GB_S:
        return None
    less = [name for name, e in p["encodings"].items() if " k=" not in name and e["read_gb_s"] / n <= READER_GB_S]
    return (f"reader: {p['quant']} asks {size(chosen['read_gb_s'] / n * 1e9)}/s a GPU at the training rate below; one "
            f"trainer's reader was seen to deliver up to {READER_GB_S:.2f} GB/s on an H200 host (docs/benchmarks.md): "
            f"training may wait for data"
            + (f"; {', '.join(less)} ask{'s' if len(less) == 1 else ''} less" if less else ""))


def regen_line(p: dict) -> str:
    """'regen: 1,560,000,000 answer tokens …: 21.7 GPU-h …', or why there are no GPU-hours."""
    line = (f"regen: {p['answer_tokens']:,} answer tokens in this corpus (its supervised tokens: ≈ what the target "
            f"generates, cut at rows of {p['seq_len']:,})")
    if "regen" in p["gpu_hours"]:
        h = p["gpu_hours"]["regen"]
        return f"{line}: {h:,.1f} GPU-h ({hours(h / p['gpus'])} on {p['gpus']})"
    return (f"{line}; no engine rate is measured here: --plan_regen_tok_s=R (the generated tok/s per GPU your vLLM or "
            f"SGLang logs) gives its GPU-hours")


def verify_line(p: dict, cpu_minutes: float | None) -> str:
    """'verify: re-hashes 81.9 TB (2.8 h at …) and recomputes 48,830 rows (…): 4.6 GPU-h …'."""
    v, h = p["verify"], p["gpu_hours"]
    rate = v["hashing"]
    at = f"{rate['gb_s']:g} GB/s (given)" if rate["source"] == "given" else (
        f"{rate['gb_s']:g} GB/s = {rate['threads']} threads × SHA-256's {HASH_GB_S_PER_THREAD:g} GB/s a CPU core, if "
        f"the filesystem reads that fast: --plan_read_gb_s= gives its rate")
    line = (f"verify: re-hashes {size(v['bytes'])} ({hours(v['hash_h'])} at {at}) and recomputes {v['rows']:,} rows "
            f"(ROWS={v['per_shard']} a shard)")
    if "verify" in h:
        return f"{line}: {h['verify']:,.1f} GPU-h at the extraction rate, on one GPU (verify is one process)"
    if cpu_minutes is not None and p["todo_rows"]:
        return f"{line}: ≈ {hours(cpu_minutes / 60 * v['rows'] / p['todo_rows'])} on this CPU, from the timed batch"
    return f"{line}: n/a on CPU"


def gpu_hours_line(p: dict, cpu_minutes: float | None) -> str:
    """'GPU-hours: extract 36.9 (4.6 h on 8), verify 4.6 (on 1), train 6 epochs 142.7 (17.8 h on 8); total …', or
    n/a on a CPU run. Extraction counts the shards still to do ('extract 1.2 for 3/24,415 shards' when not all);
    regeneration comes first when its rate is given, else the total says it is left out. The wall time adds the
    phases: N GPUs for regen, extract and train, one for verify, plus verify's hashing."""
    h, n = p["gpu_hours"], p["gpus"]
    todo, total = p["shards"].split("/")
    parts = [f"regen {h['regen']:,.1f} ({hours(h['regen'] / n)} on {n})"] if "regen" in h else []
    if "extract" in h:
        part = f" for {p['shards']} shards" if todo != total else ""
        parts += [f"extract {h['extract']:,.1f}{part} ({hours(h['extract'] / n)} on {n})",
                  f"verify {h['verify']:,.1f} (on 1)"]
    else:
        parts += ["extract n/a on CPU" + (f" (≈ {hours(cpu_minutes / 60)} on this CPU, from the timed batch)"
                                          if cpu_minutes is not None else "")]
    if "train" in h:
        parts.append(f"train {p['epochs']:.3g} epochs {h['train']:,.1f} ({hours(h['train'] / n)} on {n})")
    elif "train_epoch" in h:
        parts.append(f"train {h['train_epoch']:,.1f} per epoch (no [train] table: epochs unknown)")
    else:
        parts.append("train n/a on CPU")
    line = "GPU-hours: " + ", ".join(parts)
    if "extract" in h and "train" in h:
        total = sum(h[k] for k in ("regen", "extract", "verify", "train") if k in h)
        wall = (total - h["verify"]) / n + h["verify"] + p["verify"]["hash_h"]
        line += (f"; total {total:,.1f} GPU-h{'' if 'regen' in h else ' without regen'}, {hours(wall)} end to end on "
                 f"{n} GPUs (verify on one, its hashing included)")
    if "extract" not in p["rates"] or "train" not in p["rates"]:
        line += " (device=cpu: the rates are H200 figures; --plan_extract_tok_s= / --plan_train_tok_s= give yours)"
    return line


def plan_lines(cfg, p, train) -> list[str]:
    """The storage plan of an extraction as log lines: `cfg` its ExtractConfig, `p` its `extract_plan.ExtractPlan`
    (`plan_run`'s: the cache's facts + need, free, refusal, the probe's minutes), `train` the recipe's [train] (or
    None)."""
    info, ids, seq_len, rows = p.info, p.layer_ids, p.seq_len, p.rows
    from .config import VerifyConfig

    drafter = drafter_shape(train, info.hidden_size, info.intermediate_size, info.vocab_size, ids)
    rate = rates(layer_params=target_layer_params(p.ckpt, max(ids) + 1), drafter=drafter, seq_len=seq_len,
                 extract_tok_s=cfg.plan_extract_tok_s, train_tok_s=cfg.plan_train_tok_s,
                 regen_tok_s=cfg.plan_regen_tok_s, precision=train.compute.precision if train else "bf16",
                 loss_logits=train.loss.loss_logits if train else "fp32",
                 weighting=train.loss.weighting if train else "decay")
    shards, per_shard = p.tokens_manifest["shards"], VerifyConfig(cache="").rows  # verify's default ROWS=
    sp = storage_plan(rows=rows, seq_len=seq_len, doc_tokens=sum(s["tokens"] for s in shards),
                      answer_tokens=sum(s["supervised_tokens"] for s in shards),
                      verify_rows=sum(min(per_shard, s["rows"]) for s in shards), verify_per_shard=per_shard,
                      hashing=hash_rate(cfg.plan_read_gb_s),
                      k=len(ids), hidden=p.width, quant=cfg.quant, need=p.need,
                      projected_from=info.hidden_size if cfg.project_dims else 0,
                      shards=f"{len(p.todo):,}/{p.num_shards:,}", free=p.free,
                      todo_rows=p.todo_rows, token_bytes=p.token_bytes,
                      fits=not p.refusal, min_free_gb=cfg.min_free_gb, allow_overfill=cfg.allow_overfill,
                      gpus=cfg.plan_gpus, epochs=plan_epochs(train, rows, seq_len, cfg.plan_gpus), rate=rate,
                      gpu=cfg.device != "cpu")
    return render(sp, p.cache, p.minutes)


def recipe_train(recipe: str | None):
    """A recipe's [train] table as a TrainConfig (its cache left empty), or None: what the plan's epochs and drafter
    come from."""
    from .config import build_config, read_recipe, recipe_values
    from .trainsetup import TrainConfig

    tables = read_recipe(recipe) if recipe else {}
    if "train" not in tables:
        return None
    return build_config(TrainConfig, "train", {"cache": "", **recipe_values(tables, recipe, TrainConfig, "train")})
