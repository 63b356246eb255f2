"""An optimizer step's loss is its weighted CE over all its micro-batches and processes divided by their total loss
weight (SpecForge's rule): 1 process × 4 micro-batches = 2 processes × 2 = one batch of the same rows with the same
blocks, on rows whose label counts differ; dividing each micro-batch by its own weight and averaging would not."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from equivalence import check, loss_rtol, scalar_rtol, step_terms
from safetensors.torch import load_file

from dflash_offline.anchors import sample_blocks
from dflash_offline.drafter import DFlashDrafter, DrafterConfig
from dflash_offline.loss import block_ce_loss, loss_weight, step_normalizer

REPO = Path(__file__).resolve().parents[1]
S, A, L, V = 48, 6, 8, 96  # row length, anchors per row, block size (γ 4 by default), vocab


def setup():
    """A tiny drafter, frozen embedding/lm_head and 4 rows with their blocks. Row 0 has 3 supervised tokens, row 3 two
    documents, rows 1-2 are supervised from position 2 on: loss weights 2.8 vs ~22 (decay), 2 vs 6 blocks (D-PACE)."""
    torch.manual_seed(0)
    dc = DrafterConfig(hidden_size=32, intermediate_size=64, vocab_size=V, target_layer_ids=[0, 1],
                       num_target_layers=2, mask_token_id=V - 1, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=16, block_size=L)
    model = DFlashDrafter(dc)
    embed, head = torch.randn(V, 32) * 0.5, torch.randn(V, 32) * 0.5
    loss_mask = torch.zeros(4, S, dtype=torch.bool)
    loss_mask[0, 20:23] = True
    loss_mask[1:, 2:] = True
    doc_ids = torch.zeros(4, S, dtype=torch.long)
    doc_ids[3, 30:] = 1
    position_ids = torch.arange(S).repeat(4, 1)
    position_ids[3, 30:] -= 30
    batch = {"hidden": torch.randn(4, S, 2 * 32), "input_ids": torch.randint(0, V - 1, (4, S)),
             "position_ids": position_ids, "doc_ids": doc_ids, "loss_mask": loss_mask}
    batch["anchors"], batch["keep"], batch["labels"] = sample_blocks(batch, A, L, torch.Generator().manual_seed(1))
    return model, embed, head, batch


def rows(batch, *idx):
    return {k: v[list(idx)] for k, v in batch.items()}


def backward(model, embed, head, micro, weighting, normalizer):
    """Forward + backward of one micro-batch as the trainer runs it (dense attention; `model` may be DDP-wrapped),
    its loss divided by `normalizer` (None: its own loss weight)."""
    masks = getattr(model, "module", model).build_masks(micro["doc_ids"], micro["anchors"], micro["keep"], "dense")
    h = model(micro["hidden"], micro["input_ids"], micro["position_ids"], micro["anchors"], micro["keep"], embed,
              masks, "dense", scored_only=True)
    out = block_ce_loss(h, head, micro["labels"], weighting=weighting, normalizer=normalizer, epilogue="eager")
    out.loss.backward()
    return out


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def step_grads(model, embed, head, micros, weighting, world=1, rule="step", losses=False):
    """This process's gradient of one optimizer step over `micros` (or the micro-batches' losses): divided by the
    step's normalizer (`rule="step"`), or each micro-batch by its own loss weight and the sum by their number
    (`rule="each"`)."""
    model.zero_grad(set_to_none=True)
    norm = step_normalizer([loss_weight(m["labels"], None, weighting) for m in micros], world)
    outs = []
    for m in micros:
        each = loss_weight(m["labels"], None, weighting).clamp(min=1e-6) * len(micros)
        outs.append(backward(model, embed, head, m, weighting, norm if rule == "step" else each).loss.detach())
    return outs if losses else grads(model)


def rel(a, b):
    """Relative distance of two gradients (all parameters together)."""
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    return (num / sum(float(b[k].pow(2).sum()) for k in b)) ** 0.5


N = step_terms(rows=4, seq_len=S, anchors=A, block=L)  # the terms of the step's longest sums: 384


def close(a, b):
    """Equal to the rounding of fp32 sums in another order, in all and per tensor: ‖δg‖ / ‖g‖ ≤ λ·n·u = 1.1e-4
    (`equivalence.scalar_rtol`, n = 4 rows × (48 + 6 × 8) = 384 terms; measured ≤ 2.1e-7 on an AMD EPYC, torch 2.13),
    where the other normalisation rule is > 0.05 away."""
    assert set(a) == set(b)
    check("gradients", rel(a, b), scalar_rtol(N))
    return all(check(f"gradient of {k}", float((a[k] - b[k]).norm() / b[k].norm()), scalar_rtol(N)) for k in a)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_a_step_of_four_micro_batches_equals_one_batch_of_their_rows(weighting):
    model, embed, head, batch = setup()
    weights = [float(loss_weight(rows(batch, i)["labels"], None, weighting)) for i in range(4)]
    assert max(weights) > 2.5 * min(weights) > 0, weights  # the rows really differ
    one_batch = step_grads(model, embed, head, [batch], weighting)
    accum4 = step_grads(model, embed, head, [rows(batch, i) for i in range(4)], weighting)
    accum2 = step_grads(model, embed, head, [rows(batch, 0, 3), rows(batch, 1, 2)], weighting)
    assert close(accum4, one_batch) and close(accum2, one_batch)
    # each micro-batch divided by its own weight, then averaged: a different gradient
    each = step_grads(model, embed, head, [rows(batch, i) for i in range(4)], weighting, rule="each")
    assert rel(each, one_batch) > 0.05


def test_a_step_without_any_label_has_loss_zero_and_zero_gradient():
    model, embed, head, batch = setup()
    empty = dict(batch, loss_mask=torch.zeros_like(batch["loss_mask"]))
    empty["anchors"], empty["keep"], empty["labels"] = sample_blocks(empty, A, L, torch.Generator().manual_seed(1))
    micros = [rows(empty, 0, 1), rows(empty, 2, 3)]
    norm = step_normalizer([loss_weight(m["labels"]) for m in micros], 1)
    model.zero_grad(set_to_none=True)
    losses = [backward(model, embed, head, m, "decay", norm).loss for m in micros]
    assert all(float(x.detach()) == 0.0 for x in losses)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads(model).values())


# rank r of 2 runs micro-batches [rows 2r], [rows 2r+1] under DDP (gloo) and rank 0 saves the averaged gradient
WORKER = """
import gc
import sys
import torch
import torch.distributed as dist
from safetensors.torch import save_file
sys.path.insert(0, sys.argv[1])
import test_accum_norm as t

dist.init_process_group("gloo")
rank = dist.get_rank()
model, embed, head, batch = t.setup()
ddp = torch.nn.parallel.DistributedDataParallel(model)
micros = [t.rows(batch, 2 * rank), t.rows(batch, 2 * rank + 1)]
norm = t.step_normalizer([t.loss_weight(m["labels"], None, sys.argv[3]) for m in micros], 2)
with ddp.no_sync():
    t.backward(ddp, embed, head, micros[0], sys.argv[3], norm)
t.backward(ddp, embed, head, micros[1], sys.argv[3], norm)
if rank == 0:
    save_file(t.grads(model), sys.argv[2])
del ddp  # DDP's reducer holds the process group: freed first (see trainsetup.release_process_group)
gc.collect()
dist.destroy_process_group()
"""


def test_two_processes_accumulating_two_micro_batches_equal_one_batch_of_all_rows(tmp_path):
    """2 gloo processes × 2 micro-batches of one row under DDP (which averages the processes' gradients) = one
    process with the 4 rows in one batch, with the same blocks."""
    from test_train import free_port

    port, out = str(free_port()), tmp_path / "grads.safetensors"
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(REPO / "tests"), str(out), "decay"], cwd=REPO,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, PYTHONPATH=path, OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    model, embed, head, batch = setup()
    two = load_file(str(out))
    one_batch = step_grads(model, embed, head, [batch], "decay")
    assert close(two, one_batch)


def trainer_blocks(cfg, device):
    """The micro-batches of the first optimizer step of a 1-process run of `cfg` on `device`, with the blocks the
    trainer draws for them; the drafter as the trainer builds it (fp32 here) and the target's embedding and lm_head."""
    from dflash_offline.dataset import HiddenStream
    from dflash_offline.drafter import load_target_embeddings
    from dflash_offline.trainer import next_micro
    from dflash_offline.trainsetup import check_inputs, resolve_train

    c, dc, info = check_inputs(cfg, Path(cfg.run) / "unused")
    s = resolve_train(cfg, cuda=device.type == "cuda", world=1, seq_len=c["seq_len"], rows=info.num_rows)
    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(dc).to(device)
    embed, head = (t.to(device, torch.float32) for t in load_target_embeddings(c["target"]))
    stream = HiddenStream(info, cfg.schedule.batch_rows, seed=cfg.seed, device=device)
    acc = SimpleNamespace(device=device, process_index=0)
    micros = [next_micro(cfg, s, acc, stream, i, dc)[0] for i in range(s.accum)]
    stream.close()
    return micros, model, embed, head


def reference_step(model, embed, head, micros, rule="step"):
    """(gradient norm, loss) of one optimizer step over `micros`, in fp32 with dense attention: the step's rule
    computed as one batch of all their rows (each row with its own blocks), or each micro-batch divided by its own
    weight, averaged ("each")."""
    if rule == "step":
        one = {k: torch.cat([m[k] for m in micros]) for k in ("hidden", "input_ids", "position_ids", "doc_ids",
                                                               "loss_mask", "anchors", "keep", "labels")}
        model.zero_grad(set_to_none=True)
        loss = float(backward(model, embed, head, one, "decay", None).loss.detach())
    else:
        losses = [float(x) for x in step_grads(model, embed, head, micros, "decay", rule="each", losses=True)]
        loss = sum(losses)
    return sum(float(p.grad.pow(2).sum()) for p in model.parameters()) ** 0.5, loss


def test_the_trainers_step_of_four_micro_batches_is_that_of_one_batch_of_their_rows(tmp_path, hidden_cache):
    """The trainer's first step, 1 process × 4 micro-batches of one row: its logged loss and gradient norm are those
    of one batch of the same 4 rows with the same blocks; not those of the mean of each row's own weighted mean;
    and 2 processes × 2 micro-batches log the same. Both sides sum in another order from the same weights: the
    gradient norm within λ·n·u = 3.1e-4 (n = 4 rows × 256 terms), the loss within λ·u·(√480 + √2048) = 2e-5 (480
    scored slots, a vocabulary of 2048; tests/equivalence.py); measured 1.3e-8 and 6e-8 on an AMD EPYC, torch 2.13.
    The other rule is 1.3e-2 and 8.1e-5 away (near-uniform CE at the start: the loss hardly moves)."""
    from test_train import TINY, launch_two

    from dflash_offline.trainsetup import TrainConfig
    from stages import train

    kw = {**TINY, "batch_rows": 1, "steps": 1, "ckpt_every": 1, "global_batch_tokens": 4 * 128}
    cfg = TrainConfig.of(cache=str(hidden_cache), run=str(tmp_path / "one"), **kw).resolve()
    train.run(cfg)
    logged = json.loads((tmp_path / "one" / "metrics.jsonl").read_text().splitlines()[0])
    micros, model, embed, head = trainer_blocks(cfg, torch.device("cpu"))
    weights = [float(loss_weight(m["labels"])) for m in micros]
    assert len(micros) == 4 and max(weights) > 1.2 * min(weights), weights
    want, old = reference_step(model, embed, head, micros), reference_step(model, embed, head, micros, "each")
    norm_tol, loss_tol = scalar_rtol(4 * 256), loss_rtol(4 * TINY["num_anchors"] * 15, head.shape[0])
    check("gradient norm", abs(logged["grad_norm"] / want[0] - 1), norm_tol)
    check("loss", abs(logged["loss"] / want[1] - 1), loss_tol)
    assert abs(old[0] / want[0] - 1) > 10 * norm_tol and abs(old[1] / want[1] - 1) > 2 * loss_tol  # the other rule
    launch_two(hidden_cache, tmp_path / "two", batch_rows=1, steps=1, ckpt_every=1, global_batch_tokens=4 * 128)
    two = json.loads((tmp_path / "two" / "metrics.jsonl").read_text().splitlines()[0])
    assert json.loads((tmp_path / "two" / "config.json").read_text())["derived"]["grad_accum"] == 2
    check("gradient norm, 2 processes", abs(two["grad_norm"] / want[0] - 1), norm_tol)
    check("loss, 2 processes", abs(two["loss"] / want[1] - 1), loss_tol)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_a_dflash2_step_of_four_micro_batches_equals_one_batch_of_their_rows(tmp_path, hidden_cache, weighting):
    """DFlash2: the selector CE shares the block CE's step normalizer, so the trainer's first step over 4 micro-batches
    of one row logs the loss, gradient norm and selector CE of one batch of the same 4 rows (the same blocks), with
    decay's and with D-PACE's weights; a selector CE divided by each micro-batch's own weight would not. Tolerances
    as in the DFlash test above (the same sums in another order)."""
    from test_train import TINY

    from dflash_offline.trainsetup import TrainConfig
    from stages import train

    kw = {**TINY, "variant": "dflash2", "weighting": weighting, "steps": 1, "ckpt_every": 1,
          "global_batch_tokens": 4 * 128}
    logged = {}
    for name, rows in (("batch", 4), ("micro", 1)):
        cfg = TrainConfig.of(cache=str(hidden_cache), run=str(tmp_path / name), **{**kw, "batch_rows": rows}).resolve()
        train.run(cfg)
        logged[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
    assert json.loads((tmp_path / "micro" / "config.json").read_text())["derived"]["grad_accum"] == 4
    norm_tol, loss_tol = scalar_rtol(4 * 256), loss_rtol(4 * TINY["num_anchors"] * 15, 2048)
    one, four = logged["batch"], logged["micro"]
    check("gradient norm", abs(four["grad_norm"] / one["grad_norm"] - 1), norm_tol)
    check("loss", abs(four["loss"] / one["loss"] - 1), loss_tol)
    check("selector CE", abs(four["selector_ce"] / one["selector_ce"] - 1), loss_tol)
