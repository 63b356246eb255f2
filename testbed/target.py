"""The testbed's target: a Qwen3.5-architecture model of ~120M parameters trained from scratch, on the GPU, on the
Python sources every machine has (`testbed.sources`), written as a checkpoint every stage loads like a real one.

- Tokenizer: the tiny target's byte-level BPE recipe (`fixtures.tiny.build_tokenizer`: Qwen special tokens, `<|MASK|>`, the
  Qwen3-style chat template) at `vocab` ids, trained on the first `tokenizer_bytes` of the training files.
- Model: `Qwen3_5ForConditionalGeneration` (the VL-wrapper checkpoint layout of Qwen3.5/3.6) with `DIMS`: hidden
  768, 12 layers in the real 3 Gated DeltaNet : 1 gated full-attention pattern, untied embeddings.
- Training (`train_target`): transformers' PyTorch Gated DeltaNet (fla 0.6 refuses the gated chunk backward on
  Hopper GPUs with Triton < 3.7.1, its issue #640; generation and extraction use fla's kernels); every chunk of every training file as a chat ("continue this file"), rendered exactly
  as the chat template renders it (`render`), concatenated and cut into rows of `seq_len`; next-token CE on all
  tokens, AdamW (fp32 weights, bf16 autocast on CUDA), linear warm-up and cosine decay; each step's batch at once,
  or in micro-batches halved while the GPU runs out of memory (`accumulate_fitting`). The length is a time budget:
  after `PLAN_AFTER` steps the measured step time sets the number of steps (≤ `max_steps`) that fit in `budget_s`,
  and the cosine spans exactly those; the steps taken are recorded. Held-out loss is measured on rows of the
  held-out files before and after.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from dflash_offline.target import torch_gated_deltanet_kernels
from fixtures import tiny

from . import sources

DIMS = {"hidden_size": 768, "intermediate_size": 2560, "num_attention_heads": 12, "num_key_value_heads": 4,
        "head_dim": 64, "num_hidden_layers": 12, "linear_num_key_heads": 6, "linear_num_value_heads": 12,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64}
PLAN_AFTER = 10  # steps timed before the run's length is fixed


def render(rec: dict) -> str:
    """A user/assistant record as the tiny chat template renders it (checked against it in the tests)."""
    out = []
    for m in rec["messages"]:
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    return "".join(out)


def token_rows(tokenizer, texts: Iterable[str], seq_len: int, batch: int = 1024) -> torch.Tensor:
    """Tokenize `texts` (in batches: the fast tokenizer runs them in parallel), concatenate, cut into rows."""
    ids: list[int] = []
    buf: list[str] = []

    def flush():
        for row in tokenizer(buf, add_special_tokens=False)["input_ids"]:
            ids.extend(row)
        buf.clear()

    for t in texts:
        buf.append(t)
        if len(buf) == batch:
            flush()
    flush()
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"only {len(ids)} tokens of text: fewer than one row of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.int32).view(n, seq_len)


def _loss(model, rows_BT: torch.Tensor, autocast: bool) -> torch.Tensor:
    rows_BT = rows_BT.long()
    with torch.autocast(rows_BT.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits_BTV = model(input_ids=rows_BT).logits
    return torch.nn.functional.cross_entropy(logits_BTV[:, :-1].flatten(0, 1).float(), rows_BT[:, 1:].flatten())


@torch.no_grad()
def held_out_loss(model, rows_NT: torch.Tensor, batch: int, autocast: bool) -> float:
    model.eval()
    losses = [_loss(model, rows_NT[i:i + batch], autocast).item() for i in range(0, len(rows_NT), batch)]
    model.train()
    return sum(losses) / len(losses)


def accumulate(model, rows_BT: torch.Tensor, micro_batch: int, autocast: bool) -> torch.Tensor:
    """The batch's mean loss, its gradient accumulated over micro-batches of `micro_batch` rows (each weighted by its
    share of the batch: the batch's gradient, in a fraction of the activations' memory); returns the loss, detached."""
    total = rows_BT.new_zeros((), dtype=torch.float32)
    for rows in rows_BT.split(micro_batch):
        loss = _loss(model, rows, autocast) * (len(rows) / len(rows_BT))
        loss.backward()
        total += loss.detach()
    return total


def accumulate_fitting(model, rows_BT: torch.Tensor, micro_batch: int, autocast: bool, shrink: bool,
                       log: Callable[[str], None]) -> tuple[torch.Tensor, int]:
    """`accumulate`, and with `shrink` the micro-batch halved (the gradient so far dropped, the step redone) each time
    the GPU runs out of memory: (the loss, the micro-batch that fit). Its transformers-PyTorch Gated DeltaNet is
    launch-bound, so fewer, larger micro-batches are faster (on an H200: 64 rows at once ≈ 0.7 s a step, 4 × 16
    ≈ 1.3 s)."""
    while True:
        try:
            return accumulate(model, rows_BT, micro_batch, autocast), micro_batch
        except RuntimeError as e:  # (torch.OutOfMemoryError, or cuBLAS/cuDNN failing to allocate its workspace)
            if not shrink or micro_batch <= 1 or not (isinstance(e, torch.OutOfMemoryError) or "ALLOC_FAILED" in str(e)):
                raise
        # (outside the handler: the failed step's activations, held by its traceback, are freed by now)
        model.zero_grad(set_to_none=True)
        if rows_BT.device.type == "cuda":
            torch.cuda.empty_cache()
        log(f"  out of GPU memory with {micro_batch} rows a forward/backward: {(micro_batch + 1) // 2} from now on")
        micro_batch = (micro_batch + 1) // 2


def train_target(model, rows_NT: torch.Tensor, held_NT: torch.Tensor, *, budget_s: float, max_steps: int,
                 batch: int, lr: float, seed: int, log: Callable[[str], None] = print,
                 planned: Callable[[], None] | None = None, micro_batch: int = 0) -> dict:
    """Train `model` (fp32 weights, on its device) on random batches of `rows_NT`, each in micro-batches of
    `micro_batch` rows (0: the whole batch at once, halved while it does not fit: `accumulate_fitting`); see the
    module doc. `planned()` is
    called once the number of steps is fixed (or, where the plan is never timed, once the steps are done): from
    then on, other work on the machine slows the training but does not shorten it."""
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    shrink, micro_batch = not micro_batch, micro_batch or batch
    rows_NT, held_NT = rows_NT.to(dev), held_NT.to(dev)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    warmup = 30
    total = max_steps

    def lr_at(step: int) -> float:
        decay = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
        return lr * min(1.0, (step + 1) / warmup) * decay

    before = held_out_loss(model, held_NT, batch, cuda)
    log(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {rows_NT.numel() / 1e6:.1f}M "
        f"training tokens in rows of {rows_NT.shape[1]}, batch {batch}, held-out loss {before:.3f}")
    model.train()
    losses, t0, step, t_plan = [], time.perf_counter(), 0, None
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        idx = torch.randint(len(rows_NT), (batch,), generator=gen).to(dev)
        opt.zero_grad(set_to_none=True)
        loss, micro_batch = accumulate_fitting(model, rows_NT[idx], micro_batch, cuda, shrink, log)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 2:  # step time measured from here (the first steps compile and autotune kernels)
            if cuda:
                torch.cuda.synchronize()
            t_plan = time.perf_counter()
        if step == PLAN_AFTER + 2 and t_plan is not None:
            losses.append(loss.item())  # (synchronizes)
            per_step = (time.perf_counter() - t_plan) / PLAN_AFTER
            left = budget_s - (time.perf_counter() - t0)
            total = max(step + 1, min(max_steps, step + int(left / per_step)))
            log(f"  {per_step * 1000:.0f} ms/step ({batch * rows_NT.shape[1] / per_step / 1000:.0f}K tok/s): "
                f"{total} steps fit in {budget_s:.0f}s")
            if planned is not None:
                planned()
                planned = None
        if step % max(1, total // 10) == 0 or step == total:
            losses.append(loss.item())
            log(f"  step {step}/{total} loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f}s)")
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if planned is not None:
        planned()
    after = held_out_loss(model, held_NT, batch, cuda)
    return {"steps": step, "batch_rows": batch, "micro_batch_rows": micro_batch, "seq_len": rows_NT.shape[1], "lr": lr,
            "tokens": step * batch * rows_NT.shape[1], "train_loss_last": round(losses[-1], 4) if losses else None,
            "heldout_loss_before": round(before, 4), "heldout_loss_after": round(after, 4),
            "seconds": round(seconds, 1), "tok_per_s": round(step * batch * rows_NT.shape[1] / seconds)}


def build_target(out: Path, files: sources.FileList, *, dims: dict, vocab: int, tokenizer_bytes: int,
                 seq_len: int, batch: int, lr: float, budget_s: float, max_steps: int, seed: int, device,
                 log: Callable[[str], None] = print, planned: Callable | None = None, micro_batch: int = 0) -> dict:
    """Tokenizer + trained model + sidecar into `out`; returns the build record (timings, losses). `planned(
    write_config, mask_token_id)` once the training's steps are fixed (`train_target`): `write_config(dir)` writes
    the target's config.json into `dir`."""
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    texts, size = [], 0
    for f in files.train:
        if size >= tokenizer_bytes:
            break
        texts.append(f.path.read_text(encoding="utf-8"))
        size += f.size
    tokenizer = tiny.build_tokenizer(out, texts, vocab)
    t_tok = time.perf_counter() - t0
    log(f"tokenizer: {len(tokenizer)} ids from {size / 1e6:.1f} MB of source ({t_tok:.1f}s)")

    rows_NT = token_rows(tokenizer, (render(r) for r in sources.records(files.train)), seq_len)
    held_NT = token_rows(tokenizer, (render(r) for r in sources.records(files.heldout)), seq_len)[:4 * batch]
    t_rows = time.perf_counter() - t0 - t_tok
    log(f"corpus: {rows_NT.numel() / 1e6:.1f}M training + {held_NT.numel() / 1e6:.2f}M held-out tokens "
        f"({t_rows:.1f}s)")

    config = tiny.make_config("qwen3_5", tokenizer, dims)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tiny.model_class("qwen3_5")(config).float()
    model.to(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    with torch_gated_deltanet_kernels():  # fla 0.6's gated backward refuses Hopper with Triton < 3.7.1 (its #640)
        mask = tokenizer.convert_tokens_to_ids(tiny.MASK_TOKEN)
        train = train_target(model, rows_NT, held_NT, budget_s=budget_s, max_steps=max_steps, batch=batch, lr=lr,
                             seed=seed, log=log, micro_batch=micro_batch,
                             planned=planned and (lambda: planned(lambda d: config.save_pretrained(str(d)), mask)))
    model = model.to("cpu", torch.bfloat16)
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False)
    model.save_pretrained(str(out))
    text_config = config.get_text_config()
    params = sum(p.numel() for p in model.parameters())
    tiny.write_json(out / tiny.SIDECAR, {
        "built_by": "testbed.target", "arch": "qwen3_5", "model_class": type(model).__name__,
        "mask_token": tiny.MASK_TOKEN, "mask_token_id": tokenizer.convert_tokens_to_ids(tiny.MASK_TOKEN),
        "pad_token_id": pad, "eos_token_id": eos, "tokenizer_size": len(tokenizer),
        "vocab_size": text_config.vocab_size, "hidden_size": text_config.hidden_size,
        "num_hidden_layers": text_config.num_hidden_layers, "layer_types": list(text_config.layer_types),
        "parameters": params, "files": files.digest, "train": train,
    })
    return {"parameters": params, "tokenizer_s": round(t_tok, 1), "corpus_s": round(t_rows, 1),
            "train_tokens_available": rows_NT.numel(), **train, "seconds_total": round(time.perf_counter() - t0, 1)}
