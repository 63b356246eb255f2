"""GPU: DFlash2 (`variant=dflash2`) on the CUDA paths. Its training step compiled as the trainer compiles it (each
decoder layer a region, flex attention, the chunked block CE + the selector CE) equals the eager dense step in
forward and backward at bf16 tolerance, for both block attentions, and compiles nothing after its first step while
the anchors change; a tiny run of the qwen3.8-27b-dflash2 recipe's settings trains compiled through `stages.train`,
and its export decodes losslessly in exact mode with the selector's walk.

Run with `pytest -m gpu tests/test_dflash2_gpu.py -s` on a CUDA machine (about 1 min an H200 per test, cold
caches). The CPU suite checks the same computations in fp32 (tests/test_dflash2.py, test_speculate.py).
"""

import json
import types
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "manifests" / "qwen3.8-27b-dflash2.toml"
L = 8  # the published DFlash2 block
DEV, ATTN = "cuda", "flex"  # (the compiled path; a CPU dry run of the logic sets "cpu", "dense")


def d2_config(block_attention: str, H: int, V: int):
    """test_drafter_gpu's drafter (a sliding and a full layer) as DFlash2 at block 8 with the published conv and
    selector settings (kernel 2, group 16, rank 256, top-16)."""
    from dflash_offline.drafter import DrafterConfig

    return DrafterConfig(
        hidden_size=H, intermediate_size=3072, vocab_size=V, target_layer_ids=[1, 9, 17], num_target_layers=28,
        mask_token_id=V - 1, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, rope_theta=1e6,
        block_size=L, sliding_window=512, layer_types=["sliding_attention", "full_attention"],
        block_attention=block_attention, variant="dflash2", conv_kernel_size=2, conv_group_size=16,
        selector_rank=256, selector_top_k=16,
    )


def moved_off_the_identity(model, seed: int) -> None:
    """DFlash2's own parameters moved off their identity init (with it, DFlash2 computes DFlash and the conv and the
    selector's pair term would be tested by nothing): taps of ~0.1 on normed inputs, pair scores of ~0.2."""
    g = torch.Generator().manual_seed(seed)
    std = {"base_kernel": 0.1, "kernel_projection": 3e-3, "successor_codebook": 1.0}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if s := next((v for k, v in std.items() if k in name), None):
                p.add_(torch.randn(p.shape, generator=g).to(p.device) * s)


def step(fn, model, batch, embed, head, attn, epilogue, bf16):
    """The trainer's micro-batch (`Trainer.micro_batch`): the scored slots' states, block CE + selector CE, backward.
    Returns (states, loss, {parameter: gradient})."""
    from dflash_offline.dflash2 import selector_ce_loss
    from dflash_offline.loss import block_ce_loss

    ids, lm, doc, pos, hidden, anc, keep, labels = batch
    masks = model.build_masks(doc, anc, keep, attn)
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEV, dtype=torch.bfloat16, enabled=bf16):
        h = fn(hidden, ids, pos, anc, keep, embed, masks, attn, scored_only=True, out_dtype=head.dtype)
    out = block_ce_loss(h, head, labels, epilogue=epilogue)
    sel = selector_ce_loss(model.candidate_selector, h, head, labels, ids, anc)
    loss = out.loss + sel.loss
    loss.backward()
    return h.detach(), loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("block_attention", ["causal", "bidirectional"])
def test_compiled_dflash2_step_equals_the_eager_dense_step_and_never_recompiles(block_attention):
    """fp32 dense eager is the ground truth; the bf16 compiled flex step (the trainer's `compile_model`, its loss
    epilogue) must be about as close to it as the bf16 dense eager step is, in the states, the loss and every
    parameter's gradient (the conv's and the selector's included); then 3 more steps with fresh anchors compile no
    graph (`metrics.compiled_graphs`, the trainer's recompile count, under its error_on_recompile)."""
    from test_drafter_gpu import A, B, H, S, V, packed, rel

    from dflash_offline.anchors import block_labels, sample_anchors
    from dflash_offline.drafter import DFlashDrafter
    from dflash_offline.loss import resolve_epilogue
    from dflash_offline.metrics import compiled_graphs
    from dflash_offline.trainer import compile_model

    dev = DEV
    torch.manual_seed(0)
    ref = DFlashDrafter(d2_config(block_attention, H, V))
    moved_off_the_identity(ref, 1)
    ref = ref.to(dev)
    eager = DFlashDrafter(ref.cfg).to(dev, torch.bfloat16)
    eager.load_state_dict(ref.state_dict())
    model = DFlashDrafter(ref.cfg).to(dev, torch.bfloat16)
    model.load_state_dict(ref.state_dict())
    compile_model(model, types.SimpleNamespace(compile=True, sharded=False))  # as `Trainer.__init__` does
    g = torch.Generator(dev).manual_seed(2)
    embed = torch.randn(V, H, device=dev, generator=g)
    head = torch.randn(V, H, device=dev, generator=g) * 0.05
    ids, lm, doc, pos = packed(1)
    hidden = torch.randn(B, S, 3 * H, device=dev, generator=g)

    def blocks(seed):
        anc, keep = sample_anchors(lm, doc, A, L, torch.Generator(dev).manual_seed(seed))
        keep[0, -3:] = False
        labels = block_labels(ids, lm, doc, anc, keep, L)
        with torch.no_grad():  # half the labels the reference's top token: candidates, so the selector CE has slots
            h = ref(hidden, ids, pos, anc, keep, embed, ref.build_masks(doc, anc, keep, "dense"), "dense",
                    scored_only=True)
            top = (h @ head.t()).argmax(-1).view(B, A, L - 1)
        coin = torch.rand(B, A, L - 1, device=dev, generator=torch.Generator(dev).manual_seed(seed)) < 0.5
        labels[:, :, 1:] = torch.where(coin & (labels[:, :, 1:] >= 0), top, labels[:, :, 1:])
        return anc, keep, labels

    anc, keep, labels = blocks(0)
    batch32 = [ids, lm, doc, pos, hidden, anc, keep, labels]
    batch16 = [ids, lm, doc, pos, hidden.bfloat16(), anc, keep, labels]
    epilogue = resolve_epilogue("auto", cuda=dev == "cuda")  # the trainer's: Triton's two-pass kernel on CUDA
    h32, loss32, g32 = step(ref, ref, batch32, embed, head, "dense", "eager", bf16=False)
    h_d, loss_d, g_d = step(eager, eager, batch16, embed.bfloat16(), head.bfloat16(), "dense", epilogue, bf16=True)
    h_f, loss_f, g_f = step(model, model, batch16, embed.bfloat16(), head.bfloat16(), ATTN, epilogue, bf16=True)
    assert torch.isfinite(h_f).all() and torch.isfinite(loss_f)

    e_dense, e_flex = rel(h_d, h32), rel(h_f, h32)
    assert e_flex < 1.5 * e_dense + 1e-3, (e_flex, e_dense)
    assert rel(h_f, h_d) < 2e-2
    assert abs(loss_f - loss32) < 1.5 * abs(loss_d - loss32) + 2e-3 * loss32, (loss_f, loss_d, loss32)
    new = [n for n in g32 if "_conv." in n or "candidate_selector" in n]
    assert len(new) == 4 * 2 + 3
    for n in g32:
        assert g32[n].norm() > 0, n  # (every parameter is trained by this step: none is compared at zero)
        ed, ef = rel(g_d[n], g32[n]), rel(g_f[n], g32[n])
        assert ef < 1.5 * ed + 2e-3, (n, ef, ed)

    # the trainer's warm-up is over: new anchors, masks and labels each step, the same shapes, no new graph
    graphs = compiled_graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (1, 2, 3):
            anc, keep, labels = blocks(seed)
            _, loss, _ = step(model, model, [ids, lm, doc, pos, hidden.bfloat16(), anc, keep, labels],
                              embed.bfloat16(), head.bfloat16(), ATTN, epilogue, bf16=True)
            assert torch.isfinite(loss)
    assert compiled_graphs() == graphs


def tiny_recipe() -> dict:
    """manifests/qwen3.8-27b-dflash2.toml's [train] settings that make it DFlash2 (variant, conv, selector, block,
    attention layout, γ), at test_train's tiny drafter size; the window shrunk to the test cache's 128-token rows (the
    recipe's 2048 of 4096) so that the sliding layers do slide."""
    from test_train import TINY

    from dflash_offline.config import read_recipe

    train = read_recipe(str(RECIPE))["train"]
    keys = ("variant", "selector_weight", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
            "block_size", "full_attention_layers", "block_attention", "gamma")
    assert train["variant"] == "dflash2" and train["block_size"] == L
    return {**TINY, **{k: train[k] for k in keys}, "sliding_window": 64}


def test_a_tiny_dflash2_recipe_trains_compiled_on_cuda_and_its_export_is_lossless_with_the_selector(
        tmp_path, hidden_cache, monkeypatch):
    """`stages.train` on CUDA with the CUDA defaults (compiled flex, bf16 weights + fp32 masters): 20 steps, every
    loss and selector figure finite, 0 recompiles after the warm-up, the checkpoint in z-lab's DFlash2 layout with
    both new modules trained off the identity (that the loss falls takes more steps: tests/test_dflash2.py); `stages.evaluate` on the GPU (auto: float32, exact mode, TF32 off) decodes 6 prompts
    losslessly with the export loaded as DFlash2DraftModel, every draft its selector's walk."""
    from safetensors.torch import load_file
    from test_dflash2 import expected_shapes
    from test_speculate import count_selector_walks, prompts_with_categories

    from dflash_offline.trainsetup import TrainConfig
    from stages import evaluate, train

    run = tmp_path / "run"
    cfg = TrainConfig.of(cache=str(hidden_cache), run=str(run), steps=20, ckpt_every=20, **tiny_recipe()).resolve()
    train.run(cfg)
    conf = json.loads((run / "config.json").read_text())
    d = conf["derived"]
    assert (d["attn"], d["compile"], d["precision"], d["master_weights"]) == ("flex", True, "bf16", True)
    dc = conf["drafter"]
    assert (dc["variant"], dc["block_size"], dc["block_attention"]) == ("dflash2", L, "bidirectional")
    assert set(dc["layer_types"]) == {"sliding_attention"}
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 20 and recs[-1]["recompiles"] == 0 and recs[-1]["skipped_steps"] == 0
    for key in ("loss", "grad_norm", "selector_ce", "selector_acc", "selector_recall"):
        assert all(torch.isfinite(torch.tensor(float(r[key]))) for r in recs), key
    assert max(r["selector_recall"] for r in recs) > 0  # labels among the candidates: the selector CE trains
    sd = load_file(str(run / "checkpoints" / "step-00000020" / "model.safetensors"))
    new = expected_shapes(dc["num_layers"], dc["hidden_size"], dc["vocab_size"], dc["conv_kernel_size"],
                          dc["conv_group_size"], dc["selector_rank"])
    assert {k: tuple(sd[k].shape) for k in new} == new
    assert sd["candidate_selector.successor_codebook"].abs().sum() > 0  # both new modules left the identity
    assert sd["layers.1.mlp_conv.kernel_projection.weight"].abs().sum() > 0

    seen = count_selector_walks(monkeypatch)
    prompts = prompts_with_categories(tmp_path / "eval.jsonl", 6)
    assert evaluate.main([f"--run={run}", f"--prompts={prompts}", "--num_prompts=6", "--max_new_tokens=48",
                          "--tf_batches=1", "--device=cuda"]) == 0
    r = json.loads((run / "eval.json").read_text())
    assert json.loads((run / "eval-export" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert r["device"].startswith("cuda") and r["dtype"] == "float32" and r["mode"] == "exact"
    assert r["lossless"] and r["exact"] and all(p["equal"] for p in r["per_prompt"])
    assert seen["classes"] == {"DFlash2DraftModel"} and seen["drafts"] == seen["walks"] > 0
    assert r["block_size"] == L and sum(r["tau_hist"]) == r["verify_steps"] > 0
    print(json.dumps({"tau_mean": r["tau_mean"], "loss": [recs[0]["loss"], recs[-1]["loss"]],
                      "selector_ce": [recs[1]["selector_ce"], recs[-1]["selector_ce"]]}))
