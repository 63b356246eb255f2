"""precision=fp8 on the CPU: the one-line refusal without CUDA, and through torchao's emulation (the float8 casts
with fp32 matmuls, `BenchSwitches(fp8_emulate=True)`): which linears convert, training like bf16, exact resume, an
export in the bf16 run's format. The real float8 GEMMs, compiled: tests/test_fp8_gpu.py."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_offline import fp8
from dflash_offline.trainsetup import BenchSwitches, TrainConfig, resolve_train
from stages import train

REPO = Path(__file__).resolve().parents[1]
EMULATE = BenchSwitches(fp8_emulate=True)
TINY = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, batch_rows=2, log_every=1,
            trackers="none", lr=3e-3, warmup_steps=1, steps=20, ckpt_every=10)
LINEARS = {"fc"} | {f"layers.{i}.{n}" for i in range(2) for n in fp8.LAYER_LINEARS}


def cfg(cache, run, **kw) -> TrainConfig:
    return TrainConfig.of(cache=str(cache), run=str(run), **{**TINY, **kw}).resolve()


def records(run) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def weights(run, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run) / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def tiny_drafter(**kw):
    from dflash_offline.drafter import DFlashDrafter, DrafterConfig

    torch.manual_seed(0)
    return DFlashDrafter(DrafterConfig(**{**dict(hidden_size=64, intermediate_size=128, vocab_size=256,
                                                 target_layer_ids=[1, 3], num_target_layers=8, mask_token_id=200,
                                                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16), **kw}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hidden_cache):
    """20 steps of the tiny drafter in bf16 (CPU autocast, bf16 weights + fp32 masters) and in emulated fp8 (the
    same, with the linears' GEMMs on float8-rounded operands); checkpoints at steps 10 and 20. Also the names that
    `fp8.convert` returned for the trainer's drafter and the module types it left behind."""
    root = tmp_path_factory.mktemp("fp8")
    real, seen = fp8.convert, {}

    def convert(model, *a, **kw):
        seen["names"] = real(model, *a, **kw)
        seen["types"] = {n: type(m).__name__ for n, m in model.named_modules()}
        return seen["names"]

    train.run(cfg(hidden_cache, root / "bf16", precision="bf16"))
    fp8.convert = convert
    try:
        train.run(cfg(hidden_cache, root / "fp8", precision="fp8"), EMULATE)
    finally:
        fp8.convert = real
    return root / "bf16", root / "fp8", seen


# --- refusals and settings -------------------------------------------------------------------------------------


REFUSE_SCRIPT = """
import sys
from dflash_offline import drafter
drafter.load_target_embeddings = lambda *a: sys.exit("weights loaded before the refusal")
from dflash_offline.cli import run_cli
from stages import train
sys.argv = ["train"] + sys.argv[1:]
run_cli(train.main)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_fp8_is_refused_without_cuda_in_one_line_before_any_weights_load(tmp_path, hidden_cache):
    run = tmp_path / "run"
    args = [f"--cache={hidden_cache}", f"--run={run}", "--precision=fp8", "--num_layers=2", "--num_heads=4",
            "--num_kv_heads=2", "--head_dim=16", "--num_anchors=8", "--trackers=none"]
    env = dict(os.environ, DFLASH_NO_BAR="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", REFUSE_SCRIPT, *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("error: precision=fp8 needs CUDA") and "precision=bf16" in lines[0]
    assert not run.exists()  # nothing written either


def test_fp8_settings_are_bf16_settings_with_float8_linears(hidden_cache, tmp_path):
    """With CUDA (resolved here without one): bf16 autocast, bf16 weights + fp32 masters where bf16 has them, the
    tensorwise scaling in the log line; master_weights=on is refused where bf16 refuses it."""
    c = cfg(hidden_cache, tmp_path / "x", precision="fp8")
    gpu = resolve_train(c, cuda=True, world=1, seq_len=128)
    assert (gpu.precision, gpu.bf16, gpu.master, gpu.fp8_emulate) == ("fp8", True, True, False)
    d = gpu.derived(c, "k")
    assert (d["precision"], d["master_weights"]) == ("fp8", True) and "fp8_recipe" not in d
    assert "fp8 (tensorwise, bf16 elsewhere) (bf16 weights, fp32 masters)" in gpu.describe(c)
    bf16 = resolve_train(cfg(hidden_cache, tmp_path / "x", precision="bf16"), cuda=True, world=1, seq_len=128)
    assert bf16.bf16
    sharded = resolve_train(cfg(hidden_cache, tmp_path / "x", precision="fp8", fsdp=True), cuda=True, world=2,
                            seq_len=128)
    assert (sharded.sharded, sharded.master) == (True, False)
    with pytest.raises(ValueError, match="FSDP shards fp32 weights"):
        resolve_train(cfg(hidden_cache, tmp_path / "x", precision="fp8", fsdp=True, master_weights="on"), cuda=True,
                      world=2, seq_len=128)
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_train(c, cuda=False, world=1, seq_len=128)
    assert resolve_train(c, cuda=False, world=1, seq_len=128, switches=EMULATE).fp8_emulate


def test_fp8_linears_and_fp8_logits_are_refused_at_start_on_a_gpu_without_float8_tensor_cores(monkeypatch, hidden_cache,
                                                                                              tmp_path):
    """On an A100 (8.0) `precision=fp8` and `loss_logits=fp8` (the 27B recipes' settings) fail at start naming what to
    use instead, not at the first step with the weights loaded; the CPU runs float8 logits (slowly): not refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ValueError, match=r"precision=fp8 needs a GPU of compute capability 8\.9\+.*8\.0: use "
                                         r"precision=bf16"):
        resolve_train(cfg(hidden_cache, tmp_path / "x", precision="fp8"), cuda=True, world=1, seq_len=128)
    logits = cfg(hidden_cache, tmp_path / "x", precision="bf16", loss_logits="fp8")
    with pytest.raises(ValueError, match=r"loss_logits=fp8 .*compute capability 8\.9\+.*use loss_logits=fp32"):
        resolve_train(logits, cuda=True, world=1, seq_len=128)
    assert resolve_train(logits, cuda=False, world=1, seq_len=128).precision == "bf16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert resolve_train(logits, cuda=True, world=1, seq_len=128).precision == "bf16"


def test_fp8_without_torchao_is_refused_naming_the_extra(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find(name, *a))
    with pytest.raises(ValueError, match=r"needs torchao: pip install -e '\.\[fp8\]'"):
        fp8.check_available(cuda=True, emulate=False)


# --- conversion ------------------------------------------------------------------------------------------------


def test_convert_takes_fc_and_every_decoder_linear_and_keeps_the_weights():
    """Same parameters (the optimizer built afterwards holds them), same state_dict; norms untouched; every float8
    linear scales per tensor (torchao's tensorwise recipe, not its rowwise one)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    model = tiny_drafter()
    before = {k: (v.shape, v.dtype, v.data_ptr()) for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    logged = []
    names = fp8.convert(model, emulate=True, log=logged.append)
    assert set(names) == LINEARS and len(names) == 15
    mods = dict(model.named_modules())
    assert {n for n, m in mods.items() if isinstance(m, Float8Linear)} == LINEARS
    assert not any(isinstance(m, torch.nn.Linear) and not isinstance(m, Float8Linear) for m in mods.values())
    tensorwise = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    assert tensorwise != dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    assert all(mods[n].config == tensorwise for n in LINEARS)
    assert {k: (v.shape, v.dtype, v.data_ptr()) for k, v in model.state_dict().items()} == before
    assert all(p is params[n] for n, p in model.named_parameters())
    assert logged == ["fp8 (tensorwise, emulated): 15 of 15 linears in float8 (fc, the layers' q/k/v/o and "
                      "gate/up/down)"]


def test_convert_leaves_linears_off_multiples_of_16_in_bf16_and_names_them():
    from torchao.float8.float8_linear import Float8Linear

    model = tiny_drafter(intermediate_size=72)  # gate/up: 64 -> 72, down: 72 -> 64
    logged = []
    names = fp8.convert(model, emulate=True, log=logged.append)
    mlp = {f"layers.{i}.mlp.{n}" for i in range(2) for n in ("gate_proj", "up_proj", "down_proj")}
    assert set(names) == LINEARS - mlp
    assert not any(isinstance(m, Float8Linear) for n, m in model.named_modules() if n in mlp)
    assert "9 of 15 linears" in logged[0] and "layers.0.mlp.gate_proj" in logged[0]


def test_emulated_float8_linears_are_close_to_bf16_but_not_equal():
    """The casts really happen (the outputs move) and stay within e4m3's rounding: 3 mantissa bits, 3.6 % RMS per
    operand element, ~5 % for a GEMM of two rounded operands (measured: 4 % for the context projection, 6-8 % for
    the MLP's three GEMMs in a row and the weight gradients); a wrong or missing scale is off by 100 % or more.
    The context projection and a decoder layer's MLP, forward and weight gradient."""
    ref, model = tiny_drafter(), tiny_drafter()
    fp8.convert(model, emulate=True)
    g = torch.Generator().manual_seed(0)
    hidden, x, r = (torch.randn(2, 32, n, generator=g) for n in (128, 64, 64))

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = (m.encode_context(hidden).float(), m.layers[0].mlp(x).float())
        sum((o * r).sum() for o in out).backward()
        return (*(o.detach() for o in out), m.fc.weight.grad, m.layers[0].mlp.down_proj.weight.grad)

    for want, got in zip(run(ref), run(model), strict=True):
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        assert 0.01 < rel < 0.15, rel


# --- training, resume, export ----------------------------------------------------------------------------------


def test_emulated_fp8_trains_like_bf16(runs):
    """Tolerance: each step's loss within 0.03 of the bf16 run's over 20 steps (measured: ≤ 0.004, 5e-4 relative,
    with torch 2.13 CPU), a tenth of what the run's loss falls in those steps (~0.3). e4m3 rounds each GEMM operand
    to 3 mantissa bits, so a GEMM output moves by a few % with random signs across its elements; the weighted CE
    over ~240 scored slots averages that out, and 20 AdamW steps at lr 3e-3 do not amplify it. A float8 path that
    learned differently (a wrong scale, a lost gradient, an unconverted layer training at another rate) shows
    within the run; a run that was not converted at all is caught by the inequality."""
    bf16, run, seen = runs
    assert set(seen["names"]) == LINEARS  # fc and every decoder linear, nothing else
    assert {n for n, t in seen["types"].items() if t == "Float8Linear"} == LINEARS
    derived = json.loads((run / "config.json").read_text())["derived"]
    assert (derived["precision"], derived["master_weights"]) == ("fp8", True)
    a, b = records(bf16), records(run)
    assert len(a) == len(b) == 20
    la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
    assert lb == pytest.approx(la, abs=0.03)
    assert lb != la  # the float8 casts happened
    assert sum(lb[-5:]) < sum(lb[:5]) - 0.25  # and it learns (bf16 here: 0.5 over those 5 steps)
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in b) and b[-1]["skipped_steps"] == 0


def test_emulated_fp8_resumes_exactly(runs, hidden_cache, tmp_path):
    """The 20-step fp8 run, cut back to its step-10 checkpoint and resumed, ends bit-identical."""
    _, run, _ = runs
    b = tmp_path / "b"
    shutil.copytree(run, b)
    shutil.rmtree(b / "checkpoints" / "step-00000020")
    (b / "checkpoints" / "latest").write_text("step-00000010\n")
    (b / "metrics.jsonl").write_text("\n".join((b / "metrics.jsonl").read_text().splitlines()[:10]) + "\n")
    train.run(cfg(hidden_cache, b, precision="fp8", resume=True), EMULATE)
    assert [r["loss"] for r in records(b)] == [r["loss"] for r in records(run)]
    wa, wb = weights(run, 20), weights(b, 20)
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["fc.weight"], weights(b, 10)["fc.weight"])  # (the second half did train)


def test_fp8_checkpoint_and_export_have_the_bf16_runs_format(runs, tmp_path):
    """Checkpoint: the same keys, shapes and dtypes (fp32 weights) as the bf16 run's; export: the same files, keys,
    shapes and dtypes, loadable as the exported model (trust_remote_code) with the checkpoint's weights."""
    from test_export import load_hf, zlab_keys

    from dflash_offline.export import export

    bf16, run, _ = runs

    def fmt(sd):
        return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}

    assert fmt(weights(run, 20)) == fmt(weights(bf16, 20))
    assert all(v.dtype == torch.float32 for v in weights(run, 20).values())
    outs = {name: export(r, tmp_path / name) for name, r in (("bf16", bf16), ("fp8", run))}
    assert sorted(p.name for p in outs["fp8"].iterdir()) == sorted(p.name for p in outs["bf16"].iterdir())
    tensors = {}
    for name, out in outs.items():
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            tensors[name] = {k: f.get_tensor(k) for k in f.keys()}
    assert fmt(tensors["fp8"]) == fmt(tensors["bf16"]) and set(tensors["fp8"]) == zlab_keys(2)
    assert all(v.dtype == torch.bfloat16 for v in tensors["fp8"].values())
    cfg_fp8, cfg_bf16 = (json.loads((outs[n] / "config.json").read_text()) for n in ("fp8", "bf16"))
    assert cfg_fp8 == cfg_bf16
    hf = load_hf(outs["fp8"])
    ckpt = weights(run, 20)
    loaded = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    for k in zlab_keys(2):
        assert torch.equal(loaded[k], ckpt[k].to(torch.bfloat16).float()), k


def test_fp8_refuses_token_counts_off_multiples_of_16(hidden_cache, tmp_path):
    c = cfg(hidden_cache, tmp_path / "x", precision="fp8", batch_rows=1, num_anchors=12)
    # 12 × 16 = 192 fits; the last layer's MLP skips slot 0: 12 × 15 = 180 does not
    with pytest.raises(ValueError, match=r"got batch_rows × num_anchors × \(block_size − 1\) = 180: make "
                                         r"num_anchors × batch_rows a multiple of 16"):
        resolve_train(c, cuda=True, world=1, seq_len=128)
    with pytest.raises(ValueError, match=r"multiples of 16 .*batch_rows × seq_len = 100"):
        resolve_train(cfg(hidden_cache, tmp_path / "x", precision="fp8"), cuda=True, world=1, seq_len=50)
    resolve_train(cfg(hidden_cache, tmp_path / "x", precision="bf16", batch_rows=1, num_anchors=12), cuda=True,
                  world=1, seq_len=128)  # (bf16 has no such rule)


def test_bench_train_fp8_runs_bf16_and_fp8_in_one_call(tmp_path):
    """`make bench-train ARGS=--precision=fp8`, as the CPU smoke run (float8 emulated): both runs, the ratio row."""
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), DFLASH_NO_BAR="1")
    p = subprocess.run([sys.executable, "-m", "bench.train", "--tiny", "--precision=fp8", "--steps=4",
                        "--log_every=2", "--skip_baseline", f"--workdir={tmp_path / 'w'}", f"--out={out}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert (res["ours"]["precision"], res["ours_fp8"]["precision"]) == ("bf16", "fp8")
    assert res["ours_fp8"]["recompiles"] == 0 and "fp8_recipe" not in res["ours_fp8"]
    assert res["ours"]["tok_per_s"] > 0 and res["ours_fp8"]["tok_per_s"] > 0
    assert "| training, cpu | ours bf16 | ours fp8 | the first again | baseline |" in p.stdout
    assert "| fp8 / bf16 (its two runs): tok/s, peak GB | | " in p.stdout and res["ours_again"]["precision"] == "bf16"


FP8_WORKER = """
import sys
from dflash_offline.config import configs_from_argv
from dflash_offline.trainsetup import TrainConfig
from dflash_offline.trainsetup import BenchSwitches
from stages import train
(cfg,) = configs_from_argv([(TrainConfig, "train")], sys.argv[1:], "")
train.run(cfg, BenchSwitches(fp8_emulate=True))
"""


def test_emulated_fp8_fsdp_two_processes_equal_one(tmp_path, hidden_cache):
    """Converted before sharding, the float8 linears take FSDP2's sharded weights: 2 gloo processes × 2 micro-batches
    = one process accumulating 4 (fp32 weights: FSDP), with the same per-micro-batch float8 scales, to the rounding
    of the step's fp32 sums in another order, as tests/test_train.py's FSDP test (n = 2048 terms: λ·n·u = 6.1e-4,
    2·√(4·n·u·4) = 0.088). The float8 casts are functions of the fp32 values, so they round alike on both sides
    except where those straddle an e4m3 boundary, and then move by one e4m3 step (2⁻³): at the ~1e-7 apart the fp32
    sums leave them, about one operand in a million; measured on an AMD EPYC, torch 2.13: losses 1.3e-7, gradient
    norms 1.8e-7, update distance 1.9e-7."""
    from equivalence import drafter_start
    from test_train import N_FSDP, assert_same_training, final_weights, launch_two

    kw = dict(steps=4, ckpt_every=4, global_batch_tokens=4 * 2 * 128, precision="fp8")
    train.run(cfg(hidden_cache, tmp_path / "one", master_weights="off", **kw), EMULATE)
    launch_two(hidden_cache, tmp_path / "two", worker=FP8_WORKER, fsdp=1, **kw)
    d = json.loads((tmp_path / "two" / "config.json").read_text())["derived"]
    assert (d["precision"], d["fsdp_sharded"], d["grad_accum"], d["master_weights"]) == ("fp8", True, 2, False)
    assert final_weights(tmp_path / "one", 4).keys() == final_weights(tmp_path / "two", 4).keys()
    assert all(w.dtype == torch.float32 for w in final_weights(tmp_path / "two", 4).values())
    assert_same_training(tmp_path / "one", tmp_path / "two",
                         drafter_start(cfg(hidden_cache, tmp_path / "one", master_weights="off", **kw)), 4, N_FSDP)


def test_loading_a_model_prints_no_torchao_import_notes(qwen35_dir):
    """transformers imports torchao (installed for fp8) when it loads any model; its notes about extensions this
    machine cannot load, and torch's pytree deprecation notes, stay out of every stage's log."""
    import subprocess
    import sys

    code = ("import dflash_offline\nfrom transformers import AutoModelForCausalLM\n"
            f"AutoModelForCausalLM.from_pretrained({str(qwen35_dir)!r})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Failed to load" not in r.stderr and "opaque value type" not in r.stderr, r.stderr[-2000:]
