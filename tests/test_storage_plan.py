"""The storage plan `make extract DRY_RUN=1` prints: bytes per encoding equal to what the shards hold, read bandwidth
and GPU-hours from the measured rates (scaled for other shapes), and a run the disk cannot hold refused before any
weight loads — with the override it names — while a dry run still writes nothing."""

import json
import re
import shutil
import struct
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_offline import storage
from dflash_offline.cache import encodings
from dflash_offline.cache.manifest import read_manifest
from dflash_offline.config import ExtractConfig, TokenizeConfig
from stages import extract

REPO = Path(__file__).resolve().parents[1]


def small_plan(gpus=8, quant="bf16", rows=10, seq_len=128, free=10**12, fits=True, epochs=2.0, gpu=True,
               projected_from=0, shards="2/2", rate=None, hidden=64, **kw):
    rate = rate or storage.rates(layer_params=storage.EXTRACT_LAYER_PARAMS, drafter=storage.TRAIN_DRAFTER,
                                 seq_len=storage.TRAIN_SEQ_LEN)
    return storage.storage_plan(rows=rows, seq_len=seq_len, doc_tokens=rows * seq_len - 7, k=3, hidden=hidden,
                                quant=quant, need=rows * seq_len * 384, shards=shards, free=free, fits=fits,
                                min_free_gb=2.0, allow_overfill=False, gpus=gpus, epochs=epochs, rate=rate, gpu=gpu,
                                projected_from=projected_from, **kw)


def test_bytes_per_token_at_the_27b_shapes():
    assert encodings.bytes_per_token("bf16", 5, 5120) == 51_200  # 5 taps × 5120 × 2 B
    assert encodings.bytes_per_token("fp8", 5, 5120) == 25_620  # 5 × (5120 e4m3 + a 4-byte scale)
    assert encodings.bytes_per_token("fp4", 5, 5120) == 14_420  # 5 × (2560 B of codes + 320 e4m3 scales + 4 B)
    assert set(encodings.ENCODINGS) >= {"bf16", "fp8", "fp4"}  # every quant= value has its entry


def test_extraction_gpu_hours_are_for_the_shards_still_to_do():
    every, some = small_plan(), small_plan(todo_rows=3, shards="1/2")
    assert some["gpu_hours"]["extract"] == pytest.approx(every["gpu_hours"]["extract"] * 3 / 10)
    assert some["gpu_hours"]["train"] == every["gpu_hours"]["train"]  # training reads the whole cache
    assert "GPU-hours: extract 0.0 for 1/2 shards (" in storage.gpu_hours_line(some, None)
    assert "GPU-hours: extract 0.0 (" in storage.gpu_hours_line(every, None)


def test_each_encodings_total_is_tokens_times_its_bytes_per_token():
    p = small_plan(quant="fp8")
    assert p["tokens"] == 10 * 128
    # every encoding at full width, then at the projected widths (half of 64; a quarter, 16, is no multiple of 32)
    assert list(p["encodings"]) == list(encodings.ENCODINGS) + [f"{name} k=32" for name in encodings.ENCODINGS]
    for name, e in p["encodings"].items():
        quant, _, width = name.partition(" k=")
        assert e["total_bytes"] == p["tokens"] * e["bytes_per_token"] == p["tokens"] * encodings.bytes_per_token(
            quant, 3, int(width or 64))
    lines = storage.render(p, Path("cache/x"))
    assert any(re.match(r"\s+fp8 \(chosen\)\s+204\s", line) for line in lines), lines
    assert any(re.match(r"\s+bf16\s+384\s", line) for line in lines), lines
    assert any(re.match(r"\s+fp8 k=32\s+108\s", line) for line in lines), lines  # 3 × (32 + 4)
    assert any(line.startswith("  (k=…: taps projected to k dims, project_dims=k") for line in lines)
    # a projected plan sizes its own width only
    proj = small_plan(quant="fp8", projected_from=128)
    assert list(proj["encodings"]) == list(encodings.ENCODINGS)


def test_read_bandwidth_scales_with_the_gpus_and_gpu_hours_do_not():
    one, eight = small_plan(gpus=1), small_plan(gpus=8)
    for name in encodings.ENCODINGS:
        r1, r8 = one["encodings"][name]["read_gb_s"], eight["encodings"][name]["read_gb_s"]
        assert r8 == pytest.approx(8 * r1)
        assert r1 == pytest.approx(one["encodings"][name]["bytes_per_token"] * storage.TRAIN_TOK_S / 1e9)
    assert one["gpu_hours"] == eight["gpu_hours"]
    assert eight["gpu_hours"]["train"] == pytest.approx(2 * 1280 / storage.TRAIN_TOK_S / 3600)  # 2 epochs


def test_the_plan_says_when_the_chosen_encoding_asks_a_gpus_reader_for_more_than_one_was_seen_to_deliver():
    """`READER_GB_S` is the most one trainer's reader was seen to feed the GPU where it set the pace (the streamed
    DFlash2 bench: every run slower than the same drafter with the cache resident); a plan whose chosen encoding asks a
    GPU for more says training may wait and names the encodings that ask less — per GPU, so more GPUs do not raise it
    — and is silent otherwise. The Qwen3.8 recipe's drafter: bf16 asks 4.07 GB/s a GPU (warned: its streamed run fell
    8 % short of the resident one), fp8 2.0 and its fp4 1.1 (not)."""
    streamed = json.loads((REPO / "bench/results/bench-train-dflash2-h200.json").read_text())
    resident = json.loads((REPO / "bench/results/bench-train-dflash2-resident-h200.json").read_text())
    assert "--resident" not in streamed["command"] and streamed["quant"] == "bf16"
    keys = ("ours", "ours_dflash2", "ours_again")
    assert all(streamed[k]["read_check"] == "on" and streamed[k]["resident"] == "off" for k in keys)
    for k in keys:  # the reader set the pace: each run slower than the same variant with the cache resident
        same = [resident[r]["tok_per_s"] for r in keys if resident[r]["variant"] == streamed[k]["variant"]]
        assert streamed[k]["tok_per_s"] < min(same), k
    bf16 = encodings.bytes_per_token("bf16", 5, 5120)
    assert storage.READER_GB_S == pytest.approx(max(round(streamed[k]["tok_per_s"]) for k in keys) * bf16 / 1e9)

    fast = storage.rates(layer_params=1, drafter=storage.TRAIN_DRAFTER, seq_len=2048, train_tok_s=1.5e7)
    for quant, gpus in (("bf16", 1), ("bf16", 8)):  # 384 B a token × 1.5e7 tok/s = 5.76 GB/s a GPU
        line = storage.reader_line(small_plan(quant=quant, gpus=gpus, rate=fast))
        assert line.startswith("reader: bf16 asks 5.76 GB/s a GPU") and line.endswith("; fp8, fp4 ask less"), line
        assert "may wait for data" in line
    assert storage.reader_line(small_plan(quant="fp8", rate=fast)) is None  # 204 B a token: 3.06 GB/s
    assert storage.reader_line(small_plan(quant="bf16")) is None  # the measured 27B rate: 3.7 MB/s
    assert any(x.startswith("  reader: bf16 asks") for x in storage.render(small_plan(quant="bf16", rate=fast),
                                                                          Path("/c")))
    train = storage.recipe_train(str(REPO / "manifests/qwen3.8-27b-dflash2.toml"))
    d2 = storage.drafter_shape(train, 5120, 17408, 248320, [5, 19, 33, 47, 61])
    rate = storage.rates(layer_params=storage.EXTRACT_LAYER_PARAMS, drafter=d2, seq_len=4096)
    for quant, warned in (("bf16", True), ("fp8", False), ("fp4", False)):  # 4.07, 2.04, 1.15 GB/s a GPU
        plan = storage.storage_plan(rows=1000, seq_len=4096, doc_tokens=4_000_000, k=5, hidden=5120, quant=quant,
                                    need=0, shards="1/1", free=10**15, fits=True, min_free_gb=2.0,
                                    allow_overfill=False, gpus=8, epochs=6.0, rate=rate, gpu=True)
        assert (storage.reader_line(plan) is not None) == warned, (quant, storage.reader_line(plan))


def test_rates_are_the_measured_ones_at_their_shapes_scaled_elsewhere_and_given_ones_win():
    at = storage.rates(layer_params=storage.EXTRACT_LAYER_PARAMS, drafter=storage.TRAIN_DRAFTER,
                       seq_len=storage.TRAIN_SEQ_LEN)  # training's shapes; extraction was measured on rows of 4096
    assert {s: (r["source"], r["tok_s"]) for s, r in at.items()} == {"extract": ("scaled", storage.EXTRACT_TOK_S),
                                                                     "train": ("measured", storage.TRAIN_TOK_S)}
    at = storage.rates(layer_params=storage.EXTRACT_LAYER_PARAMS, drafter=storage.TRAIN_DRAFTER,
                       seq_len=storage.EXTRACT_SEQ_LEN)
    assert (at["extract"]["source"], at["extract"]["tok_s"]) == ("measured", storage.EXTRACT_TOK_S)
    half = storage.rates(layer_params=storage.EXTRACT_LAYER_PARAMS // 2, drafter=storage.TRAIN_DRAFTER,
                         seq_len=2 * storage.TRAIN_SEQ_LEN)  # half the layers; longer rows: less work per token
    assert half["extract"]["source"] == "scaled" and half["extract"]["tok_s"] == pytest.approx(2 * storage.EXTRACT_TOK_S, rel=1e-6)
    assert half["train"]["source"] == "scaled" and half["train"]["tok_s"] > 1.5 * storage.TRAIN_TOK_S
    given = storage.rates(layer_params=1, drafter=storage.TRAIN_DRAFTER, seq_len=512, extract_tok_s=5e3,
                          train_tok_s=7e3)
    assert {s: (r["source"], r["tok_s"]) for s, r in given.items()} == {"extract": ("given", 5e3), "train": ("given", 7e3)}
    line = storage.describe_rate("train", half["train"])
    assert "estimate" in line and f"{storage.TRAIN_TOK_S:,}" in line


def test_a_dflash2_plan_takes_the_rates_measured_at_the_qwen38_recipes_drafter():
    """The Qwen3.8-27B DFlash2 recipe's plan sizes its DFlash2 drafter (conv kernel 2, group 16, selector rank 256,
    top-16; block 8, 64 anchors, rows of 4096) from what was measured at that drafter on an H200 — as DFlash (the
    slower of the A, B, A pair's DFlash runs), × DFlash2's cost against DFlash there, a product of measurements so
    an "estimate" — not from FLOPs scaled from the 27B bench shape, which said 190,051 where the step ran at 84,748
    (small blocks use the GPU half as well). The constants are the results file's, its runs the step's (cache
    resident, no read check: the reader's pace is not the GPU's). fp8's and D-PACE's factors, measured at the bench
    drafter only, make a rate at the recipe's drafter an estimate that says where they come from."""
    from types import SimpleNamespace

    from dflash_offline.metrics import flops_per_row

    res = json.loads((REPO / "bench/results/bench-train-dflash2-resident-h200.json").read_text())
    runs = [res[k] for k in ("ours", "ours_dflash2", "ours_again")]
    assert [r["variant"] for r in runs] == ["dflash", "dflash2", "dflash"] and res["recipe"].endswith(
        "qwen3.8-27b-dflash2.toml")
    assert all(f"--{o}" in res["command"] for o in ("resident=on", "read_check=off"))
    assert all(r["recompiles"] == 0 and r["data_wait_frac"] < 0.05 and r["precision"] == "bf16" for r in runs)
    tok = [round(r["tok_per_s"]) for r in runs]
    assert storage.TRAIN_SMALL_TOK_S == min(tok[0], tok[2])
    assert storage.TRAIN_DFLASH2_FACTOR == pytest.approx(tok[1] / ((tok[0] + tok[2]) / 2))
    small, shape = storage.TRAIN_SMALL_DRAFTER, res["shape"]
    assert (shape["seq_len"], shape["anchors"], shape["block_size"], shape["num_layers"], shape["hidden"],
            shape["num_heads"], shape["num_kv_heads"], shape["head_dim"], shape["intermediate_size"]) == (
        storage.TRAIN_SMALL_SEQ_LEN, small.num_anchors, small.block_size, small.num_layers, small.hidden_size,
        small.num_heads, small.num_kv_heads, small.head_dim, small.intermediate_size)

    train = storage.recipe_train(str(REPO / "manifests/qwen3.8-27b-dflash2.toml"))
    d2 = storage.drafter_shape(train, 5120, 17408, 248320, [5, 19, 33, 47, 61])
    assert (d2.variant, d2.conv_kernel_size, d2.conv_group_size, d2.selector_rank, d2.selector_top_k, d2.block_size,
            d2.num_anchors) == ("dflash2", 2, 16, 256, 16, 8, 64)
    d1 = SimpleNamespace(**{**vars(d2), "variant": "dflash"})
    per_tok = [flops_per_row(d, 4096, d.num_anchors) / 4096 for d in (d1, d2)]
    assert [round(f / 1e9, 3) for f in per_tok] == [2.632, 2.986]  # (+13 % FLOPs, +31 % time)

    def rate(d, **kw):
        return storage.rates(layer_params=storage.EXTRACT_LAYER_PARAMS, drafter=d, seq_len=4096, **kw)["train"]

    r1, r2 = rate(d1), rate(d2)
    assert (r1["source"], r1["tok_s"]) == ("measured", storage.TRAIN_SMALL_TOK_S) and "variant" not in r1
    assert r2["tok_s"] == pytest.approx(storage.TRAIN_SMALL_TOK_S * storage.TRAIN_DFLASH2_FACTOR)
    assert (r2["source"], r2["variant"]) == ("scaled", "dflash2")
    assert storage.describe_rate("train", r2) == (
        "train 79,479 context tok/s per H200 (estimate: 104,285 measured at the Qwen3.8-27B recipe's drafter (block 8, "
        "64 anchors, rows of 4096), scaled ×1 by the drafter's FLOPs per context token as DFlash; ×0.762 for "
        "variant=dflash2, its cost against DFlash there)")
    # fp8 and D-PACE at the recipe's drafter: estimates naming the bench drafter they were measured at
    for kw, factor in (({"precision": "fp8"}, storage.TRAIN_FP8_SPEEDUP), ({"weighting": "dpace"},
                                                                             storage.TRAIN_DPACE_FACTOR)):
        r = rate(d1, **kw)
        assert r["source"] == "scaled" and r["tok_s"] == pytest.approx(storage.TRAIN_SMALL_TOK_S * factor), kw
        assert f"at {storage.TRAIN_POINTS[0][0]}" in storage.describe_rate("train", r), kw
    # DFlash2 at the bench shape (rows of 2048): DFlash's rate there × DFlash2's cost, its conv and selector's time
    # per FLOP taken where their cost was measured at the same block tokens a row (the Qwen3.5/3.6 recipes' drafter,
    # rows of 4096), × the share of FLOPs they add here (20 %, 19 % there)
    big2 = SimpleNamespace(**{**vars(storage.TRAIN_DRAFTER), **{k: getattr(d2, k) for k in (
        "variant", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}})
    b1, b2 = (storage.rates(layer_params=storage.EXTRACT_LAYER_PARAMS, drafter=d,
                            seq_len=storage.TRAIN_SEQ_LEN)["train"] for d in (storage.TRAIN_DRAFTER, big2))
    assert (b1["source"], b1["tok_s"]) == ("measured", storage.TRAIN_TOK_S)
    assert storage.dflash2_factor(d2, 4096) == pytest.approx(storage.TRAIN_DFLASH2_FACTOR)
    assert vars(storage.TRAIN_DFLASH2_DRAFTER) == {**vars(d2), "target_layer_ids": [1, 16, 31, 46, 61]}
    assert vars(storage.TRAIN_DFLASH2_BIG_DRAFTER) == vars(big2)
    (_, block_tokens, there, time_there), _ = storage.dflash2_points()
    share = storage.dflash2_flop_share(big2, storage.TRAIN_SEQ_LEN)
    factor = 1 / (1 + time_there / there * share)
    assert block_tokens == 512 * 16 and 0.19 < share < 0.21 and abs(share / there - 1) > 0.01
    assert b2["source"] == "scaled" and b2["tok_s"] == pytest.approx(storage.TRAIN_TOK_S * factor)
    assert (f"×{factor:.3g} for variant=dflash2: its conv and selector add 20 % to the FLOPs here, at their time per "
            "FLOP measured at the Qwen3.5/3.6-27B recipes' drafter") in storage.describe_rate("train", b2)
    with pytest.raises(ValueError, match="variant='dflash3'.*plan_train_tok_s="):
        storage.rates(layer_params=1, drafter=SimpleNamespace(**{**vars(d1), "variant": "dflash3"}), seq_len=4096)


def test_the_planned_training_rate_rises_with_row_length_and_moves_smoothly_with_block_tokens():
    """Between the two measured drafters (8,192 and 512 block tokens a row) the model FLOP rate is interpolated in
    log block tokens, outside them it is the nearer one's: longer rows (less work a token) never plan a slower rate,
    and one anchor more or less never moves the rate by more than its share of the work — no jump where the plan
    changes from one measured point to the other."""
    from types import SimpleNamespace

    def tok_s(anchors, seq_len, block=16):
        d = SimpleNamespace(**{**vars(storage.TRAIN_DRAFTER), "num_anchors": anchors, "block_size": block})
        return storage.rates(layer_params=1, drafter=d, seq_len=seq_len)["train"]["tok_s"]

    for anchors in (16, 32, 48, 64, 100, 128, 256, 400, 512, 1024):
        rates = [tok_s(anchors, n) for n in range(2048, 16385, 512)]
        assert all(b > a for a, b in zip(rates, rates[1:], strict=False)), anchors
    for anchors in range(20, 1100, 7):
        a, b = tok_s(anchors, 4096), tok_s(anchors + 1, 4096)
        assert a > b > a * (anchors / (anchors + 1)) ** 1.5, anchors  # (more anchors: more work, a smooth step)
    # the points themselves, and the interpolation's ends
    assert tok_s(512, 2048) == pytest.approx(storage.TRAIN_TOK_S)
    assert tok_s(64, 4096, block=8) == pytest.approx(storage.TRAIN_SMALL_TOK_S)
    mid = SimpleNamespace(**{**vars(storage.TRAIN_DRAFTER), "num_anchors": 128})
    r = storage.rates(layer_params=1, drafter=mid, seq_len=4096)["train"]
    assert r["source"] == "scaled" and r["interpolated"] == 2048
    assert storage.describe_rate("train", r).startswith(
        f"train {r['tok_s']:,.0f} context tok/s per H200 (estimate: 9,633 and 104,285 measured at the 27B drafter")


def test_epochs_come_from_the_recipes_train_table():
    from dflash_offline.trainsetup import TrainConfig

    assert storage.plan_epochs(storage.recipe_train(str(REPO / "manifests/qwen3.6-27b.toml")), 1000, 4096, 8) == 6
    steps = TrainConfig.of(cache="", steps=300, batch_rows=4).resolve()
    assert storage.plan_epochs(steps, 121, 512, 1) == pytest.approx(300 * 4 / 121)  # steps × global batch / rows
    assert storage.plan_epochs(steps, 121, 512, 8) == pytest.approx(300 * 32 / 121)
    tokens = TrainConfig.of(cache="", steps=100, global_batch_tokens=8 * 4096).resolve()
    assert storage.plan_epochs(tokens, 800, 4096, 8) == pytest.approx(1.0)
    assert storage.plan_epochs(None, 800, 4096, 8) is None and storage.recipe_train(None) is None


def test_regen_and_verify_are_in_the_plan_and_regen_gpu_hours_need_a_given_engine_rate():
    rate = storage.rates(layer_params=storage.EXTRACT_LAYER_PARAMS, drafter=storage.TRAIN_DRAFTER,
                         seq_len=storage.TRAIN_SEQ_LEN, regen_tok_s=2000)
    assert rate["regen"] == {"tok_s": 2000, "source": "given"}
    kw = dict(answer_tokens=7_200_000, verify_rows=4)
    without, given = small_plan(**kw), small_plan(rate=rate, **kw)
    assert "regen" not in without["gpu_hours"] and given["gpu_hours"]["regen"] == pytest.approx(1.0)  # 7.2M / 2000 / 3600
    assert "--plan_regen_tok_s=R" in storage.regen_line(without)
    assert storage.regen_line(given).endswith(": 1.0 GPU-h (8 min on 8)")
    line = storage.gpu_hours_line(given, None)
    assert line.startswith("GPU-hours: regen 1.0 (8 min on 8), extract ") and "GPU-h without regen" not in line
    assert "GPU-h without regen" in storage.gpu_hours_line(without, None)
    # verify recomputes its rows at the extraction rate, and re-hashes the chosen encoding's bytes
    assert given["gpu_hours"]["verify"] == pytest.approx(4 * 128 / rate["extract"]["tok_s"] / 3600)
    assert given["verify"]["bytes"] == given["encodings"]["bf16"]["total_bytes"]
    mine = small_plan(hashing=storage.hash_rate(0.5), **kw)
    assert mine["verify"]["hash_h"] == pytest.approx(10 * 128 * 384 / 0.5e9 / 3600)
    assert "at 0.5 GB/s (given)" in storage.verify_line(mine, None)


def test_on_cpu_the_plan_prints_no_gpu_figures():
    text = "\n".join(storage.render(small_plan(gpu=False), Path("c"), cpu_estimate_min=0.5))
    assert "n/a on CPU" in text and "30 s on this CPU" in text
    assert "training reads" not in text and "H200 (" not in text and "GPU-h," not in text
    assert "GB/s" not in "\n".join(line for line in text.splitlines() if "verify: re-hashes" not in line)


def test_the_qwen35_36_recipes_dflash2_step_is_planned_from_its_cost_measured_in_their_training():
    """The Qwen3.5/3.6-27B recipes' step, DFlash2 beside DFlash (one process a run, DFlash first and last) in their
    training: float8 linears and lm_head GEMMs, D-PACE, an fp4 cache, rows of 4096. The constants are the results
    file's and its runs the recipes' settings and drafter; the plan's rates there (FLOPs scaled from the bench
    drafter, × fp8's and D-PACE's measured factors; DFlash2's added time from this measurement) are within 2 % of
    the measured DFlash step and 1 % of the DFlash2 step — not the 15,688 that DFlash2's time per FLOP at the Qwen3.8
    recipe's drafter (block 8, 64 anchors) said here, 14 % under the step."""
    from types import SimpleNamespace

    res = json.loads((REPO / "bench/results/bench-train-compare-dflash2-qwen36-h200.json").read_text())
    runs = res["runs"]
    assert res["drift_ok"] and not res["failed"] and [r["drafter"] for r in runs] == ["dflash", "dflash2", "dflash"]
    assert all((r["precision"], r["loss_logits"], r["bench_train"]["weighting"], r["recompiles"]) ==
               ("fp8", "fp8", "dpace", 0) for r in runs)
    assert "--quant=fp4" in res["bench_train_args"] and "--seq_len=4096" in res["bench_train_args"]
    tok = [r["tok_per_s"] for r in runs]
    assert storage.TRAIN_DFLASH2_BIG_TOK_S == {"dflash": pytest.approx((tok[0] + tok[2]) / 2, abs=1),
                                               "dflash2": round(tok[1])}
    assert storage.TRAIN_DFLASH2_BIG_SEQ_LEN == res["shape"]["seq_len"] == 4096
    for recipe in ("qwen3.5-27b", "qwen3.6-27b"):
        train = storage.recipe_train(str(REPO / f"manifests/{recipe}.toml"))
        drafter = storage.drafter_shape(train, 5120, 17408, 248320, [1, 16, 31, 46, 61])
        assert vars(drafter) == vars(storage.TRAIN_DFLASH2_BIG_DRAFTER), recipe
        assert (train.compute.precision, train.loss.loss_logits, train.loss.weighting) == ("fp8", "fp8", "dpace")
        shape = res["shape"]
        assert (shape["anchors"], shape["block"], shape["num_layers"], shape["hidden"], shape["intermediate_size"]) \
            == (drafter.num_anchors, drafter.block_size, drafter.num_layers, drafter.hidden_size,
                drafter.intermediate_size)

        def plan(d):
            return storage.rates(layer_params=storage.EXTRACT_LAYER_PARAMS, drafter=d, seq_len=4096, precision="fp8",
                                 loss_logits="fp8", weighting="dpace")["train"]["tok_s"]

        as_dflash = SimpleNamespace(**{**vars(drafter), "variant": "dflash"})
        assert plan(as_dflash) == pytest.approx((tok[0] + tok[2]) / 2, rel=0.02)
        assert plan(drafter) == pytest.approx(tok[1], rel=0.01)
        # (its DFlash2 step is its DFlash step + the added time measured there: 15.3 µs a context token)
        assert 1 / plan(drafter) - 1 / plan(as_dflash) == pytest.approx(1 / tok[1] - 2 / (tok[0] + tok[2]), rel=1e-3)
    # between the two drafters DFlash2's cost was measured at, its time per FLOP is interpolated in block tokens a row
    (_, q_hi, _, _), (_, q_lo, _, _) = storage.dflash2_points()
    hi, lo, mid = (storage.dflash2_time_per_share(q) for q in (q_hi, q_lo, 2048))
    assert hi[1] == 0 and lo[1] == 1 and mid[1] is None
    assert mid[0] == pytest.approx((hi[0] * lo[0]) ** 0.5)  # (2048: halfway between 512 and 8192 in log block tokens)
    d128 = SimpleNamespace(**{**vars(storage.TRAIN_DFLASH2_BIG_DRAFTER), "num_anchors": 128})
    r = storage.rates(layer_params=storage.EXTRACT_LAYER_PARAMS, drafter=d128, seq_len=4096)["train"]
    assert (r["variant_point"], r["variant_block_tokens"]) == (None, 2048)
    assert r["variant_factor"] == pytest.approx(1 / (1 + mid[0] * storage.dflash2_flop_share(d128, 4096)))
    assert (f"×{r['variant_factor']:.3g} for variant=dflash2: its conv and selector add 18 % to the FLOPs here, at "
            f"their time per FLOP measured at {storage.TRAIN_DFLASH2_BIG_AT} and {storage.TRAIN_SMALL_AT}, "
            "interpolated at 2,048 block tokens a row") in storage.describe_rate("train", r)
    assert storage.dflash2_time_per_share(4 * q_hi) == hi and storage.dflash2_time_per_share(q_lo // 4) == lo


def test_a_27b_plan_from_shapes_alone(tmp_path, capsys):
    """Qwen3.6-27B config (no weights), the qwen3.6-27b recipe, z-lab's scale (1.6B tokens): the numbers
    docs/full-run.md works out by hand."""
    from bench.extract import TEXT_27B, write_config

    ckpt = write_config(tmp_path / "q27", TEXT_27B)
    params = storage.target_layer_params(ckpt, 62)  # taps up to 61: the layers bench-extract ran
    assert params == storage.EXTRACT_LAYER_PARAMS
    train = storage.recipe_train(str(REPO / "manifests/qwen3.6-27b.toml"))
    drafter = storage.drafter_shape(train, 5120, 17408, 248320, [1, 16, 31, 46, 61])
    # (the recipe's: at parity on the testbed, 1.36× bf16's step with float8 lm_head GEMMs too)
    assert train.compute.precision == "fp8" and train.loss.loss_logits == "fp8"
    # (and DFlash2, ranked better in that training: its rate is DFlash's × its measured cost against DFlash)
    assert drafter.variant == "dflash2"
    as_dflash = SimpleNamespace(**{**vars(drafter), "variant": "dflash"})
    bf16 = storage.rates(layer_params=params, drafter=as_dflash, seq_len=4096)["train"]
    rate = storage.rates(layer_params=params, drafter=drafter, seq_len=4096, precision=train.compute.precision,
                         loss_logits=train.loss.loss_logits, weighting=train.loss.weighting)
    assert rate["extract"]["source"] == "measured" and rate["train"]["source"] == "scaled"
    assert 18_000 < bf16["tok_s"] < 20_000  # rows of 4096: ≈ half the FLOPs per token of rows of 2048
    measured = json.loads((REPO / "bench/results/bench-train-precision-h200.json").read_text())
    assert measured["drift_ok"] and measured["runs"][0]["variant"] == measured["runs"][-1]["variant"] == "bf16"
    assert train.loss.weighting == "dpace"  # (and D-PACE's measured cost against decay, the same float8 step)
    # (float8 and D-PACE scale DFlash's share of the step; DFlash2's added time, in bf16, stays as measured)
    as_dflash_s = 1 / (bf16["tok_s"] * measured["ratios"]["fp8+fp8head"]["tok_per_s"] * storage.TRAIN_DPACE_FACTOR)
    added_s = (1 / storage.dflash2_factor(drafter, 4096) - 1) / bf16["tok_s"]
    assert rate["train"]["tok_s"] == pytest.approx(1 / (as_dflash_s + added_s), rel=1e-4)
    rows = 390_625  # × 4096 = 1.6B tokens
    # 16 rows a shard: 24,414 full shards and one of 1 row; verify recomputes 2 rows of each. 1,500 answer tokens of
    # each of 800K samples of 2,000 tokens (docs/full-run.md's assumption)
    quant = tomllib.loads((REPO / "manifests/qwen3.6-27b.toml").read_text())["extract"]["quant"]
    assert quant == "fp4"  # (the recipe's: the smallest unprojected encoding at parity on the testbed)
    p = storage.storage_plan(rows=rows, seq_len=4096, doc_tokens=rows * 4000, k=5, hidden=5120, quant=quant,
                             need=rows * 4096 * 14_420, shards="24,415/24,415", free=20 * 10**12, fits=False,
                             min_free_gb=2.0, allow_overfill=False, gpus=8,
                             epochs=storage.plan_epochs(train, rows, 4096, 8), rate=rate, gpu=True,
                             answer_tokens=1_200_000_000, verify_rows=24_414 * 2 + 1)
    assert p["encodings"]["bf16"]["total_bytes"] == 81_920_000_000_000
    assert p["encodings"]["fp8"]["total_bytes"] == 40_992_000_000_000
    assert p["encodings"]["fp8 k=2560"]["bytes_per_token"] == 12_820  # a quarter of bf16's, + the scales
    assert p["encodings"]["fp4 k=1280"]["bytes_per_token"] == 5 * (640 + 80 + 4)
    assert p["gpu_hours"]["extract"] == pytest.approx(1.6e9 / 12_045 / 3600)  # 36.9, as docs/full-run.md
    assert p["encodings"]["bf16"]["read_gb_s"] == pytest.approx(51_200 * rate["train"]["tok_s"] * 8 / 1e9)
    lines = storage.render(p, Path("/data/cache/hidden-0123456789ab"))
    print("\n".join(lines))
    text = "\n".join(lines)
    assert "81.9 TB" in text and "23.1 TB" in text and "a real run is refused (--allow_overfill=1" in text
    assert re.search(r"\n  fp4 \(chosen\) +14,420 +23\.1 TB .*parity\n", text)
    assert re.search(r"\n  fp8 k=2560 +12,820 +20\.5 TB .*  parity at 1/2 the width on the testbed\n", text)  # (not chosen)
    assert "GPU-hours: extract 36.9 (4.6 h on 8), verify 4.6 (on 1), train 6 epochs 147.8 (18.5 h on 8); total " \
           "189.3 GPU-h without regen, 28.5 h end to end" in text  # (as docs/extract.md and docs/full-run.md)
    # verify: the whole cache re-hashed at SHA-256's rate × 8 threads (23.1 TB / 8 GB/s), 48,829 rows recomputed
    assert "verify: re-hashes 23.1 TB (48 min at 8 GB/s = 8 threads × SHA-256" in text and "recomputes 48,829 rows" in text
    assert "regen: 1,200,000,000 answer tokens" in text and "--plan_regen_tok_s=R" in text
    assert "extract 12,045 row tok/s per H200 (measured at Qwen3.5-27B shapes" in text
    assert re.search(rf"train 18,041 context tok/s per H200 \(estimate: {storage.TRAIN_TOK_S:,} measured at the 27B "
                     r"drafter.*; ×0\.777 for variant=dflash2 against DFlash's bf16 step: its added time as measured "
                     r"at the Qwen3\.5/3\.6-27B recipes' drafter \(block 16, 512 anchors, rows of 4096\) in their float8 "
                     r"training; ×1\.36 for precision=fp8 "
                     r"loss_logits=fp8.*; "
                     r"float8 and D-PACE scale DFlash's share of the step only: DFlash2's added time", text)


# --- the stage: real shard bytes, refusals, dry runs -----------------------------------------------------------


def configs(root, target, corpus, **kw):
    tok = TokenizeConfig(corpus=[str(corpus)], tokenizer=str(target), cache_root=str(root), seq_len=128,
                         rows_per_shard=4, workers=1, max_docs=12).resolve()
    ext = ExtractConfig(target=str(target), cache_root=str(root), num_draft_layers=3, device="cpu", batch_rows=2,
                        **kw).resolve()
    return ext, tok


def tensor_bytes(path: Path) -> int:
    """Bytes of the tensors of a safetensors file (its header's data offsets)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for name, t in header.items() if name != "__metadata__")


@pytest.mark.parametrize("quant", ["bf16", "fp8", "fp4"])
def test_the_planned_bytes_are_the_bytes_the_shards_hold(tmp_path, qwen35_dir, chat_corpus, quant):
    cache = extract.run(*configs(tmp_path / "c", qwen35_dir, chat_corpus, quant=quant))
    m = read_manifest(cache)
    per_token = encodings.bytes_per_token(quant, len(m["config"]["layer_ids"]), m["producer"]["target"]["hidden_size"])
    seq_len = m["producer"]["tokens"]["producer"]["seq_len"]
    for s in m["shards"]:
        (name,) = s["files"]
        assert tensor_bytes(cache / name) == s["rows"] * seq_len * per_token


def fake_free(monkeypatch, free_bytes: int) -> None:
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free_bytes))


def test_a_run_the_disk_cannot_hold_is_refused_naming_the_numbers_and_the_override(
        tmp_path, qwen35_dir, chat_corpus, monkeypatch, capsys):
    from dflash_offline import target

    monkeypatch.setattr(target, "load_target", lambda *a, **k: pytest.fail("weights loaded"))
    fake_free(monkeypatch, 2 * 10**9 + 1000)  # min_free_gb 2 kept: room for 1000 bytes
    root = tmp_path / "dry"
    ext, tok = configs(root, qwen35_dir, chat_corpus, dry_run=True)
    with pytest.raises(ValueError, match=r"^dry run: a real run would be refused: .*need [\d.]+ [kM]B but the filesystem "
                                         r"has 2.00 GB free \(keeping min_free_gb=2\).*--allow_overfill=1"):
        extract.run(ext, tok)
    out = capsys.readouterr().out
    assert "storage plan:" in out and "does not fit" in out and "bf16 (chosen)" in out and "fp8" in out
    ext, tok = configs(root, qwen35_dir, chat_corpus, dry_run=True, allow_overfill=True)
    assert extract.run(ext, tok) is None
    out = capsys.readouterr().out
    assert "allow_overfill=1 starts a real run anyway" in out and out.strip().splitlines()[-1].endswith("nothing written")
    assert not root.exists()  # dry runs, refused or not, write nothing

    ext, tok = configs(tmp_path / "real", qwen35_dir, chat_corpus)
    with pytest.raises(ValueError, match=r"filesystem has 2.00 GB free.*--allow_overfill=1 \(make "
                                         r"ARGS=--allow_overfill=1\) starts it anyway$"):
        extract.run(ext, tok)
    assert not list((tmp_path / "real").glob("hidden-*"))
    ext, tok = configs(tmp_path / "real", qwen35_dir, chat_corpus, allow_overfill=True)
    with pytest.raises(pytest.fail.Exception, match="weights loaded"):  # past the disk check, to the weights
        extract.run(ext, tok)
    assert "starting anyway (allow_overfill=1)" in capsys.readouterr().out


def test_the_dry_run_plan_on_cpu_uses_the_real_token_counts(tmp_path, qwen35_dir, chat_corpus, capsys):
    from dflash_offline import tokenization

    root = tmp_path / "c"
    ext, tok = configs(root, qwen35_dir, chat_corpus, dry_run=True)
    assert extract.run(ext, tok) is None
    out = capsys.readouterr().out
    m = tokenization.dry_run(tok)
    rows = sum(s["rows"] for s in m["shards"])
    assert f"storage plan: {rows:,} rows × 128 = {rows * 128:,} tokens" in out
    assert "GPU-hours: extract n/a on CPU" in out and "training reads" not in out and "/s per H200" not in out
    # the token cache is not on disk yet: what its 13 bytes a token will take counts in what the run writes
    token_bytes = rows * 128 * storage.token_bytes_per_token()
    assert storage.token_bytes_per_token() == 13
    assert f"shards and the token cache ({storage.size(token_bytes)})) →" in out
    assert not root.exists()
    tokenization.run(tok)  # once it is there, the plan does not count it again
    assert extract.run(ext, tok) is None
    assert "and the token cache" not in capsys.readouterr().out


def test_the_plan_marks_each_encodings_testbed_verdict_as_the_results_files_record_it():
    """storage.TESTBED_TAU says what the frozen yardstick results ranked (bench/results/testbed-sweep-<gpu>-<commit>.json,
    each with its null and known-bad checks passed): an encoding marked "parity" is an arm judged at parity there (its
    Δ inside the null arm's interval, every seed lossless), a projection by its share of the testbed's width; one no
    file ranked is "not judged" — and the production recipes store the smallest encoding at parity."""
    import json
    import tomllib

    root = Path(__file__).resolve().parents[1]
    from testbed.runs import parse_arm
    from testbed.target import DIMS

    verdicts = {}
    # (21931d7: 3 seeds; 913a79a, 4327e15, 01f126a and 818e575: every arm under seeds of its own, 300 steps)
    for commit in ("h200-419204b", "h200-9b6a2b6", "h200-66bb894", "h100-21931d7-encodings", "h100-913a79a-seeds",
                   "h100-4327e15-seeds", "h100-01f126a-seeds", "h200-818e575-seeds"):
        res = json.loads((root / f"bench/results/testbed-sweep-{commit}.json").read_text())
        assert res["discriminating"] and res["null_arm"]["ci_low"] < 0 < res["null_arm"]["ci_high"]
        assert res["bad_arm"]["ci_high"] < 0
        ranked = {a["label"]: a["verdict"] for a in res["arms"] if a["lossless"] and a["verdict"]}
        assert all(verdicts.get(k, v) == v for k, v in ranked.items()), (commit, ranked, verdicts)  # no file contradicts
        verdicts.update(ranked)
    hidden = DIMS["hidden_size"]  # the testbed target's width (768)
    # TESTBED_TAU holds exactly what the files ranked: "fp8 k=1/2" from project_dims=384 quant=fp8, and so on
    ranked_keys = {"bf16": "reference"}
    for label, verdict in verdicts.items():
        opts, train_opts = parse_arm(label)
        if not train_opts and set(opts) <= {"quant", "project_dims"}:
            kk = int(opts.get("project_dims", 0))
            share = f" k=1/{hidden // kk}" if kk else ""
            ranked_keys[opts.get("quant", "bf16") + share] = verdict
    assert storage.TESTBED_TAU == ranked_keys
    for name in encodings.ENCODINGS:
        for kk in storage.projected_widths(hidden):
            label = f"project_dims={kk}" + ("" if name == "bf16" else f" quant={name}")
            want = f"{verdicts[label]} at 1/{hidden // kk} the width on the testbed" if label in verdicts else "not judged"
            assert storage.testbed_tau(name, hidden, kk) == want, label
    assert verdicts["quant=fp4"] == verdicts["project_dims=384 quant=fp8"] == "parity"
    # at the 27B width: half is judged (as a share), a width that is no share of it, or another share, is not
    assert storage.testbed_tau("fp8", 5120, 2560) == "parity at 1/2 the width on the testbed"
    assert storage.testbed_tau("fp8", 5120, 1280) == "parity at 1/4 the width on the testbed"
    assert {storage.testbed_tau("fp8", 5120, kk) for kk in (2048, 3072, 640)} == {"not judged"}
    assert storage.testbed_tau("fp4", 5120, 5120) == "parity" and storage.testbed_tau("fp4", 5120, 2560) == "not judged"
    p = small_plan(quant="fp8")
    marks = {name: e["testbed_tau"] for name, e in p["encodings"].items()}
    assert marks["bf16"] == "reference" and marks["fp4"] == marks["fp8"] == "parity"
    half = storage.projected_widths(p["hidden"])[0]
    assert marks[f"fp8 k={half}"] == "parity at 1/2 the width on the testbed"
    assert marks[f"bf16 k={half}"] == "parity at 1/2 the width on the testbed"
    assert marks[f"fp4 k={half}"] == "not judged"
    assert all(v == "not judged" for n, v in marks.items() if " k=" in n and n not in (f"fp8 k={half}", f"bf16 k={half}"))
    wide = {name: e["testbed_tau"] for name, e in small_plan(quant="fp8", hidden=128)["encodings"].items()}
    assert wide["fp8 k=32"] == "parity at 1/4 the width on the testbed"  # (64 of 128: half; 32: a quarter)
    assert wide["fp4 k=32"] == wide["bf16 k=32"] == "not judged"
    assert any(re.match(r"\s+fp8 \(chosen\)\s.*parity$", line) for line in storage.render(p, Path("/c"))), \
        storage.render(p, Path("/c"))
    # a cache already projected to half or a quarter of the width is judged as such, to another share is not
    projected = small_plan(quant="fp8", hidden=half, projected_from=p["hidden"])["encodings"]
    assert projected["fp8"]["testbed_tau"] == "parity at 1/2 the width on the testbed"
    assert projected["fp4"]["testbed_tau"] == "not judged"
    assert small_plan(quant="fp8", hidden=32, projected_from=128)["encodings"]["fp8"]["testbed_tau"] == \
        "parity at 1/4 the width on the testbed"
    assert small_plan(quant="fp8", hidden=96, projected_from=128)["encodings"]["fp8"]["testbed_tau"] == "not judged"
    for recipe in ("qwen3.5-27b", "qwen3.6-27b", "qwen3.8-27b-dflash2", "qwen3-8b"):
        quant = tomllib.loads((root / "manifests" / f"{recipe}.toml").read_text())["extract"]["quant"]
        assert storage.TESTBED_TAU.get(quant) in ("reference", "parity"), recipe
        # the smallest unprojected encoding at parity (a projection needs calibrating on the target: its share of the
        # states' energy is the target's own, which the 124M testbed does not stand for)
        at_parity = [n for n in encodings.ENCODINGS if storage.TESTBED_TAU.get(n) in ("reference", "parity")]
        assert quant == min(at_parity, key=lambda n: encodings.ENCODINGS[n].size(5, 5120)), recipe


def _judged_at_parity(name: str, label: str, verdict: str = "parity") -> bool:
    """Frozen yardstick results bench/results/testbed-sweep-h200-`name`.json (or `name`.json, a file's whole stem)
    rank arm `label` at parity (or `verdict`), every seed lossless, with both checks passed."""
    stem = name if name.startswith("testbed-sweep-") else f"testbed-sweep-h200-{name}"
    res = json.loads((REPO / f"bench/results/{stem}.json").read_text())
    arm = {a["label"]: a for a in res["arms"]}.get(label)
    return (res["discriminating"] and res["null_arm"]["ci_low"] < 0 < res["null_arm"]["ci_high"]
            and res["bad_arm"]["ci_high"] < 0 and arm is not None and arm["lossless"] and arm["verdict"] == verdict)


def test_a_recipe_trains_in_fp8_only_where_the_yardstick_judged_it_at_parity():
    """The production recipes' `precision` is the reference (bf16, the default) or fp8, and fp8 only because the
    frozen yardstick results rank `precision=fp8` at parity (testbed-sweep-h200-0f164ec.json, and at 3 seeds
    testbed-sweep-h100-8c73fd9-fp8.json); their `loss_logits` is fp32 (the default) or fp8 with fp8 linears, only
    because `precision=fp8 loss_logits=fp8` is at parity (testbed-sweep-h200-80f65fe.json, and the 3 seeds'); the plan then counts the measured speed-up of what they train in. Their loss
    weighs slots by decay (the default) or by D-PACE, only because `weighting=dpace` ranked better
    (testbed-sweep-h200-66bb894.json), and the plan then counts D-PACE's measured cost (its step against decay's,
    bench-train-{dpace,decay}-fp8-fp4-h200.json: the factor must be the ratio of those files' rates). A recipe
    that combines them — D-PACE with float8 linears and lm_head GEMMs on its cache's encoding — does so because that
    combination was judged at parity with D-PACE in bf16 on a bf16 cache (testbed-sweep-h200-85a5cb0.json, whose
    first arm and checks are D-PACE's)."""
    import tomllib

    three_seeds = "testbed-sweep-h100-8c73fd9-fp8"  # (the float8 arms again, at 3 seeds on an H100)
    judged = {"fp8": _judged_at_parity("0f164ec", "precision=fp8") and _judged_at_parity(three_seeds, "precision=fp8"),
              "fp8 logits": _judged_at_parity("80f65fe", "precision=fp8 loss_logits=fp8")
              and _judged_at_parity(three_seeds, "precision=fp8 loss_logits=fp8"),
              "dpace": _judged_at_parity("66bb894", "weighting=dpace", "better")}
    seen = {}
    for recipe in ("qwen3.5-27b", "qwen3.6-27b", "qwen3.8-27b-dflash2", "qwen3-8b"):
        path = REPO / "manifests" / f"{recipe}.toml"
        train_table = tomllib.loads(path.read_text())["train"]
        seen[recipe] = (train_table.get("precision", "auto"), train_table.get("loss_logits", "fp32"))
        precision, logits = seen[recipe]
        assert precision in ("auto", "bf16") or (precision == "fp8" and judged["fp8"]), recipe
        assert logits == "fp32" or (logits == "fp8" and precision == "fp8" and judged["fp8 logits"]), recipe
        train = storage.recipe_train(str(path))
        assert train.loss.weighting == "decay" or (train.loss.weighting == "dpace" and judged["dpace"]), recipe
        if train.loss.weighting == "dpace" and precision == "fp8":
            quant = tomllib.loads(path.read_text())["extract"]["quant"]
            combined = f"weighting=dpace precision=fp8 loss_logits={logits}" + ("" if quant == "bf16" else
                                                                               f" quant={quant}")
            assert _judged_at_parity("85a5cb0", combined), (recipe, combined)
        rate = storage.rates(layer_params=storage.EXTRACT_LAYER_PARAMS, drafter=storage.TRAIN_DRAFTER, seq_len=2048,
                             precision=train.compute.precision, loss_logits=train.loss.loss_logits,
                             weighting=train.loss.weighting)["train"]
        shown = storage.describe_rate("train", rate)
        assert (train.loss.weighting == "dpace") == ("for weighting=dpace" in shown), (recipe, shown)
        speedup = {("fp8", "fp8"): storage.TRAIN_FP8_HEAD_SPEEDUP, ("fp8", "fp32"): storage.TRAIN_FP8_SPEEDUP}
        dpace = storage.TRAIN_DPACE_FACTOR if train.loss.weighting == "dpace" else 1.0
        assert rate["tok_s"] == pytest.approx(storage.TRAIN_TOK_S * speedup.get(seen[recipe], 1.0) * dpace)
    assert seen["qwen3.6-27b"] == seen["qwen3.5-27b"] == ("fp8", "fp8")
    assert storage.recipe_train(str(REPO / "manifests/qwen3.6-27b.toml")).loss.weighting == "dpace"
    measured = {w: json.loads((REPO / "bench/results" / f"bench-train-{w}-fp8-fp4-h200.json").read_text())["ours"]
                for w in ("dpace", "decay")}
    assert all(m["precision"] == "fp8" and m["loss_logits"] == "fp8" and m["weighting"] == w
               for w, m in measured.items())
    assert storage.TRAIN_DPACE_FACTOR == pytest.approx(round(measured["dpace"]["tok_per_s"])
                                                       / round(measured["decay"]["tok_per_s"]))


def test_a_recipe_trains_dflash2_only_where_the_yardstick_ranked_it_better_in_its_training():
    """A recipe's drafter is DFlash (the default) or DFlash2 trained as the yardstick judged it better than DFlash in
    that same training, both checks passed: with decay weights, bf16 linears and fp32 logits at block 16
    (testbed-sweep-h200-443d86b-dflash2.json) or block 8 (-block8.json); with float8 linears and logits, by D-PACE
    or by decay, at block 16 against the Qwen3.5/3.6-27B recipes' DFlash training (D-PACE, float8 linears and
    logits: testbed-sweep-h200-7284dea-dflash2-recipes.json). Any other combination (D-PACE in bf16, float8 linears
    with fp32 logits, float8 at block 8) is not judged and fails here. The Qwen3.5/3.6-27B recipes train DFlash2 so
    (their training the judged one), and on the cache encoding they store (testbed-sweep-h200-5d5decc-dflash2-fp4.json:
    DFlash2 against that DFlash training, both on that encoding); the Qwen3.8-27B recipe the published drafter's
    block 8. (Its other settings — sliding window, in-block attention, anchors, the fp4 cache — are the published
    shape or judged for DFlash, not as DFlash2.)"""
    recipes = "7284dea-dflash2-recipes"
    judged = {(16, "decay", "bf16", "fp32"): _judged_at_parity("443d86b-dflash2", "variant=dflash2", "better"),
              (8, "decay", "bf16", "fp32"): _judged_at_parity("443d86b-dflash2-block8",
                                                                "variant=dflash2 block_size=8 gamma=4", "better"),
              (16, "dpace", "fp8", "fp8"): _judged_at_parity(
                  recipes, "variant=dflash2 weighting=dpace precision=fp8 loss_logits=fp8", "better"),
              (16, "decay", "fp8", "fp8"): _judged_at_parity(recipes, "variant=dflash2 precision=fp8 loss_logits=fp8",
                                                             "better")}
    # the recipes' sweep compared DFlash2 against their own DFlash training (its first arm and checks are that)
    res = json.loads((REPO / f"bench/results/testbed-sweep-h200-{recipes}.json").read_text())
    assert res["arms"][0]["label"] == res["bad_arm"]["label"].removesuffix(" steps=150") == \
        "weighting=dpace precision=fp8 loss_logits=fp8"
    # the DFlash2 the yardstick trained: the testbed recipe's conv, selector and selector CE weight
    tb = storage.recipe_train(str(REPO / "manifests/testbed.toml"))
    dflash2 = lambda t: (t.drafter.conv_kernel_size, t.drafter.conv_group_size, t.drafter.selector_rank,  # noqa: E731
                         t.drafter.selector_top_k, t.loss.selector_weight)
    variants = {}
    for recipe in ("qwen3.5-27b", "qwen3.6-27b", "qwen3.8-27b-dflash2", "qwen3-8b"):
        train = storage.recipe_train(str(REPO / "manifests" / f"{recipe}.toml"))
        d, precision = train.drafter, {"auto": "bf16"}.get(train.compute.precision, train.compute.precision)
        variants[recipe] = (d.variant, d.block_size, train.loss.weighting, precision, train.loss.loss_logits)
        assert d.variant == "dflash" or (d.variant == "dflash2" and judged.get(variants[recipe][1:])), \
            (recipe, variants[recipe])
        assert d.variant == "dflash" or dflash2(train) == dflash2(tb) == (2, 16, 256, 16, 1.0), recipe
    assert variants["qwen3.8-27b-dflash2"][:2] == ("dflash2", 8)
    assert variants["qwen3.5-27b"] == variants["qwen3.6-27b"] == ("dflash2", 16, "dpace", "fp8", "fp8")
    # and on the cache they store: DFlash2 against their DFlash training on that encoding, the recipes as they train
    # (testbed-sweep-h200-5d5decc-dflash2-fp4.json, whose first arm and checks are that DFlash training)
    on_cache = "5d5decc-dflash2-fp4"
    res = json.loads((REPO / f"bench/results/testbed-sweep-h200-{on_cache}.json").read_text())
    for recipe in ("qwen3.5-27b", "qwen3.6-27b"):
        quant = tomllib.loads((REPO / "manifests" / f"{recipe}.toml").read_text())["extract"]["quant"]
        training = f"weighting=dpace precision=fp8 loss_logits=fp8 quant={quant}"
        assert res["arms"][0]["label"] == training, recipe
        assert set(res["bad_arm"]["label"].split()) == {*training.split(), "steps=150"}, recipe  # (in another order)
        assert _judged_at_parity(on_cache, f"variant=dflash2 {training}", "better"), recipe


def test_the_recipes_dflash2_beats_dflash_given_its_compute():
    """DFlash given DFlash2's compute — its steps × the cost of a DFlash2 step in the Qwen3.5/3.6-27B recipes'
    training at the 27B shapes (`storage.TRAIN_DFLASH2_BIG_TOK_S`, measured) — in those recipes' training on their
    fp4 cache still ranks below DFlash2 at the recipe's steps (testbed-sweep-h200-8f72974-dflash2-equal-compute.json,
    whose first arm and checks are that DFlash training at the matched steps), lossless, both checks passed."""
    name = "8f72974-dflash2-equal-compute"
    res = json.loads((REPO / f"bench/results/testbed-sweep-h200-{name}.json").read_text())
    steps = storage.recipe_train(str(REPO / "manifests/testbed.toml")).schedule.steps
    cost = storage.TRAIN_DFLASH2_BIG_TOK_S["dflash"] / storage.TRAIN_DFLASH2_BIG_TOK_S["dflash2"]
    matched = round(steps * cost)
    assert matched > steps
    for recipe in ("qwen3.5-27b", "qwen3.6-27b"):
        quant = tomllib.loads((REPO / "manifests" / f"{recipe}.toml").read_text())["extract"]["quant"]
        training = f"weighting=dpace precision=fp8 loss_logits=fp8 quant={quant}"
        assert res["arms"][0]["label"] == f"{training} steps={matched}", recipe
        assert set(res["bad_arm"]["label"].split()) == {*training.split(), f"steps={matched // 4}"}, recipe
        assert _judged_at_parity(name, f"variant=dflash2 {training}", "better"), recipe
