"""GPU end-to-end checks of the training stage (make test-gpu-train): the compiled flex trainer equals the eager
dense one, with flat reserved memory and no recompiles; a step of 4 accumulated micro-batches is that of one batch of
their rows; bf16 master weights train like fp32 weights; TF32, bf16 and fp8 logits train like the defaults; a
non-finite step is skipped; on 2 GPUs, DDP (also accumulating with master weights) and FSDP train like one GPU."""

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_offline.trainer import Trainer
from dflash_offline.trainsetup import BenchSwitches, TrainConfig, cache_defaults, drafter_config
from stages import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_compiled_flex_trainer_matches_eager_and_holds_memory(tmp_path, hidden_cache):
    tiny = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, batch_rows=2, log_every=1,
                trackers="none", lr=3e-3, warmup_steps=1, ckpt_every=1000)
    runs, modes = {}, {"eager": dict(attn="dense", compile="off"), "compiled": dict(attn="flex", compile="on")}
    for name, extra in modes.items():
        cfg = TrainConfig.of(cache=str(hidden_cache), run=str(tmp_path / name), steps=50, **tiny, **extra).resolve()
        train.run(cfg)
        runs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    e, c = runs["eager"], runs["compiled"]
    assert c[0]["loss"] == pytest.approx(e[0]["loss"], rel=2e-2)  # same first step within bf16 tolerance
    assert c[-1]["recompiles"] == 0
    reserved = [r["reserved_gb"] for r in c[5:]]
    assert max(reserved) - min(reserved) < 0.05, reserved  # flat after warm-up


def test_a_step_of_four_micro_batches_is_that_of_one_batch_of_their_rows(tmp_path, hidden_cache):
    """The CUDA defaults (compiled flex attention, bf16 weights + fp32 masters summing the micro-batches' gradients
    in fp32), 1 GPU × 4 micro-batches of one row: the first step's logged loss and gradient norm are those of one
    batch of the same 4 rows with the same blocks, in fp32 with dense attention (bf16 tolerance: a micro-batch
    divided by the wrong weight, or a gradient of the wrong scale, is far outside it). The CPU suite checks the
    same exactly, and 2 processes (tests/test_accum_norm.py)."""
    from test_accum_norm import reference_step, trainer_blocks
    from test_train import TINY

    kw = {**TINY, "batch_rows": 1, "steps": 1, "ckpt_every": 1, "global_batch_tokens": 4 * 128}
    cfg = TrainConfig.of(cache=str(hidden_cache), run=str(tmp_path / "r"), **kw).resolve()
    train.run(cfg)
    d = json.loads((tmp_path / "r" / "config.json").read_text())["derived"]
    assert (d["grad_accum"], d["master_weights"], d["attn"], d["compile"]) == (4, True, "flex", True)
    logged = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    micros, model, embed, head = trainer_blocks(cfg, torch.device("cuda"))
    grad_norm, loss = reference_step(model, embed, head, micros)
    assert logged["loss"] == pytest.approx(loss, rel=2e-2)
    assert logged["grad_norm"] == pytest.approx(grad_norm, rel=3e-2)


def train_off_and_on(tmp_path, hidden_cache, option: str, log_every: int, values=("off", "on")):
    """12 steps of a tiny drafter with `option` off, then on (runs in tmp_path/off, tmp_path/on; or the two
    `values`): the metrics of each, and the last config. An `option` that is one of bench.train's `BenchSwitches`
    is set as such."""
    tiny = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, batch_rows=2,
                log_every=log_every, trackers="none", lr=3e-3, warmup_steps=1, ckpt_every=1000, grad_clip=0.5)
    switch = option in BenchSwitches.__dataclass_fields__
    runs = {}
    for value in values:
        cfg = TrainConfig.of(cache=str(hidden_cache), run=str(tmp_path / value), steps=12,
                          **({} if switch else {option: value}), **tiny).resolve()
        train.run(cfg, BenchSwitches(**{option: value == "on"}) if switch else BenchSwitches())
        runs[value] = [json.loads(x) for x in (tmp_path / value / "metrics.jsonl").read_text().splitlines()]
    return runs, cfg


def test_bf16_master_weights_train_like_fp32_weights_on_cuda(tmp_path, hidden_cache):
    """The CUDA default (bf16 weights + compiled MasterAdamW) against fp32 weights + fused torch AdamW + clip."""
    runs, cfg = train_off_and_on(tmp_path, hidden_cache, "master_weights", log_every=1)
    assert json.loads((tmp_path / "on" / "config.json").read_text())["derived"]["master_weights"] is True
    on, off = runs["on"], runs["off"]
    assert [r["loss"] for r in on] == pytest.approx([r["loss"] for r in off], rel=5e-3)
    # the first step's gradients come from the same weights (rounded to bf16 in both) and agree to bf16 noise; the
    # next steps' from weights that Adam's first update moved by ±lr each, whatever the size of the gradient, so a
    # weight whose gradient is noise-sized moves one way in one run and the other in the other: 0.45 % apart at
    # step 2 on an H200 (torch 2.11), 4e-5 eager on the CPU, where the two runs' arithmetic is the same. A gradient
    # of the wrong scale or a sum not cleared between steps (2× or more) is far outside either bound.
    assert on[0]["grad_norm"] == pytest.approx(off[0]["grad_norm"], rel=1e-3)
    assert [r["grad_norm"] for r in on[1:3]] == pytest.approx([r["grad_norm"] for r in off[1:3]], rel=2e-2)
    assert on[-1]["recompiles"] == 0 and on[-1]["skipped_steps"] == 0
    w_on = load_file(str(tmp_path / "on" / "checkpoints" / "step-00000012" / "model.safetensors"))
    w_off = load_file(str(tmp_path / "off" / "checkpoints" / "step-00000012" / "model.safetensors"))
    from dflash_offline.drafter import DFlashDrafter

    torch.manual_seed(cfg.seed)  # the trainer's initial weights (built on the CPU right after this seeding)
    init = DFlashDrafter(drafter_config(cfg, cache_defaults(cfg))).state_dict()
    for k in w_off:
        assert w_on[k].dtype == torch.float32
        update = (w_off[k] - init[k]).norm()
        assert update > 0, k
        # two bf16 runs round differently and the compiled backward is not bitwise deterministic, so their weights
        # drift apart (0.2-0.4 % of the weight norm after 12 steps on an H200); judged against what the 12 steps
        # moved the weights, that is small. A wrong update (stale master, lost fp32 accumulation) is of its size.
        assert float((w_on[k] - w_off[k]).norm() / update) < 0.05, k


def one_and_two_gpus(tmp_path, hidden_cache, kw: dict):
    """For DDP and FSDP: (name, a one-GPU run, the same steps on 2 GPUs) of test_train's tiny drafter with `kw`; DDP
    against one GPU with master weights, FSDP (fp32 weights) against one GPU with fp32 weights. The one-GPU runs come
    first."""
    from test_train import TINY, launch_two

    def one(name, **extra):
        train.run(TrainConfig.of(cache=str(hidden_cache), run=str(tmp_path / name), **{**TINY, **kw, **extra}).resolve())
        return tmp_path / name

    pairs = {"ddp": (one("one_master"), tmp_path / "ddp", {}),
             "fsdp": (one("one_fp32", master_weights="off"), tmp_path / "fsdp", {"fsdp": 1})}
    for name, (single, two, extra) in pairs.items():
        launch_two(hidden_cache, two, **kw, **extra)
        yield name, single, two


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_ddp_and_fsdp_train_like_one_gpu_with_accumulation(tmp_path, hidden_cache):
    """NCCL, one process per GPU, the CUDA defaults (compiled flex attention, bf16). DDP with bf16 master weights
    (gradients reduced in fp32, the optimizer update between steps) = one GPU accumulating the same two
    micro-batches; FSDP-sharded (fp32 weights under autocast) = one GPU with fp32 weights doing the same; the
    sharded checkpoint holds full tensors. (The CPU suite checks the same with gloo; this is the NCCL/CUDA path.)"""
    from test_train import final_weights, losses

    kw = dict(steps=6, ckpt_every=6, grad_clip=0.5, global_batch_tokens=2 * 2 * 128)  # 2 micro-batches of 2 rows
    for name, single, two in one_and_two_gpus(tmp_path, hidden_cache, kw):
        d1 = json.loads((single / "config.json").read_text())["derived"]
        d2 = json.loads((two / "config.json").read_text())["derived"]
        assert (d1["world_size"], d1["grad_accum"], d2["world_size"], d2["grad_accum"]) == (1, 2, 2, 1)
        assert d2["attn"] == "flex" and d2["compile"] is True and d2["fsdp_sharded"] is (name == "fsdp")
        assert d2["master_weights"] is d1["master_weights"] is (name == "ddp")
        recs = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
        assert recs[-1]["recompiles"] == 0
        assert losses(two) == pytest.approx(losses(single), rel=5e-3), name
        w1, w2 = final_weights(single, 6), final_weights(two, 6)
        assert w1.keys() == w2.keys()
        for k in w1:  # full fp32 tensors in both checkpoints; bf16 runs drift apart a little (see above)
            assert w2[k].dtype == torch.float32 and w2[k].shape == w1[k].shape, k
            assert float((w1[k] - w2[k]).norm() / w1[k].norm()) < 1e-2, (name, k)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_accumulating_with_master_weights_train_like_one_gpu(tmp_path, hidden_cache):
    """NCCL, master_weights=on with accumulation: each GPU sums its 2 micro-batches' bf16 gradients in fp32 and the
    comm hook reduces those sums in fp32 = one GPU accumulating all 4. (master_weights=auto keeps fp32 weights for
    this combination until this test has passed on GPUs; the CPU suite checks the same with gloo.)"""
    from test_train import TINY, final_weights, launch_two, losses

    kw = dict(steps=6, ckpt_every=6, grad_clip=0.5, global_batch_tokens=4 * 2 * 128, master_weights="on")
    single = tmp_path / "one"
    train.run(TrainConfig.of(cache=str(hidden_cache), run=str(single), **{**TINY, **kw}).resolve())
    two = tmp_path / "two"
    launch_two(hidden_cache, two, **kw)
    d1 = json.loads((single / "config.json").read_text())["derived"]
    d2 = json.loads((two / "config.json").read_text())["derived"]
    assert (d1["grad_accum"], d2["world_size"], d2["grad_accum"]) == (4, 2, 2)
    assert d1["master_weights"] is d2["master_weights"] is True
    assert [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()][-1]["recompiles"] == 0
    assert losses(two) == pytest.approx(losses(single), rel=5e-3)
    norms = [[json.loads(x)["grad_norm"] for x in (r / "metrics.jsonl").read_text().splitlines()]
             for r in (single, two)]
    assert norms[0] == pytest.approx(norms[1], rel=2e-2)  # a wrong scale (x2) would hide in the clipping
    w1, w2 = final_weights(single, 6), final_weights(two, 6)
    for k in w1:
        assert float((w1[k] - w2[k]).norm() / w1[k].norm()) < 1e-2, k


def test_tf32_block_part_and_bf16_logits_train_like_the_defaults(tmp_path, hidden_cache, monkeypatch):
    """TF32 (bench.train's switch; for bf16 runs: the dense block part of attn=flex) and loss_logits=bf16 each train
    like the run without them, are recorded in the run's config, TF32 is what the run says while it runs, and the
    process's setting is put back after it."""
    from dflash_offline import loss

    m, seen, real = torch.backends.cuda.matmul, [], loss.block_ce_loss

    def spy(*a, **k):
        seen.append(m.allow_tf32)
        return real(*a, **k)

    monkeypatch.setattr(loss, "block_ce_loss", spy)
    before, m.allow_tf32 = m.allow_tf32, False
    try:
        runs, _ = train_off_and_on(tmp_path / "tf32", hidden_cache, "tf32", log_every=1)
        assert m.allow_tf32 is False
    finally:
        m.allow_tf32 = before
    assert seen[:12] == [False] * 12 and seen[12:] == [True] * 12  # the off run's 12 steps, then the on run's
    for value, flag in (("off", False), ("on", True)):
        assert json.loads((tmp_path / "tf32" / value / "config.json").read_text())["derived"]["tf32"] is flag
    assert [r["loss"] for r in runs["on"]] == pytest.approx([r["loss"] for r in runs["off"]], rel=2e-3)
    runs, _ = train_off_and_on(tmp_path / "logits", hidden_cache, "loss_logits", log_every=1,
                               values=("fp32", "bf16"))
    assert json.loads((tmp_path / "logits" / "bf16" / "config.json").read_text())["derived"]["loss_logits"] == "bf16"
    assert [r["loss"] for r in runs["bf16"]] == pytest.approx([r["loss"] for r in runs["fp32"]], rel=5e-3)
    assert runs["bf16"][-1]["recompiles"] == 0


def test_fp8_lm_head_trains_like_fp32_logits_on_cuda(tmp_path, hidden_cache):
    """loss_logits=fp8 on CUDA (torch._scaled_mm: rowwise-scaled e4m3 logits GEMM, e5m2 × e4m3 input-gradient GEMM)
    in the compiled trainer: each step's loss within 3 % of the fp32 logits' run, no recompile."""
    runs, _ = train_off_and_on(tmp_path / "logits", hidden_cache, "loss_logits", log_every=1, values=("fp32", "fp8"))
    assert json.loads((tmp_path / "logits" / "fp8" / "config.json").read_text())["derived"]["loss_logits"] == "fp8"
    a, b = [r["loss"] for r in runs["fp32"]], [r["loss"] for r in runs["fp8"]]
    assert a != b and b == pytest.approx(a, rel=3e-2)
    assert runs["fp8"][-1]["recompiles"] == 0


def test_a_non_finite_step_is_skipped_by_the_fused_adamw_on_cuda(tmp_path, hidden_cache, monkeypatch):
    """fp32 weights and torch's fused AdamW on CUDA: a step whose gradient is NaN is skipped through the optimizer's
    `found_inf` (no host sync), counted, and the weights stay finite."""
    real, calls = Trainer.micro_batch, {"n": 0}

    def poisoned(trainer, batch, norm, last):
        calls["n"] += 1
        if calls["n"] == 3:
            batch = dict(batch, hidden=batch["hidden"] * float("nan"))
        return real(trainer, batch, norm, last)

    monkeypatch.setattr(Trainer, "micro_batch", poisoned)
    run = tmp_path / "r"
    train.run(TrainConfig.of(cache=str(hidden_cache), run=str(run), steps=4, ckpt_every=4, log_every=1, trackers="none",
                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, batch_rows=2,
                          precision="fp32", master_weights="off", attn="dense", compile="off").resolve())
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in recs] == [0, 0, 1, 1]
    weights = load_file(str(run / "checkpoints" / "step-00000004" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
