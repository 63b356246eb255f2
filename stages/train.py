"""Stage 2: train a DFlash drafter on a hidden-state cache.

    python -m stages.train --recipe=manifests/demo.toml --cache=DIR [--run=runs/x] [--resume=1] ...
    accelerate launch --num_processes N -m stages.train ...        (one process per GPU; NPROC=N in make)

Sections: config → compute → model → optimizer → data → loop. Fixed shapes everywhere: B rows per micro-batch,
A anchors per row (padded with a keep mask, resampled every step), so the compiled step sees one shape; after the
warm-up step any recompile is an error. The streaming loader splits rows by rank itself (it never goes through
accelerator.prepare). Anchors and noise come from a generator seeded by (seed, global micro-batch index), so
resumed, 1-process and N-process runs see the same anchors for the same rows.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from dflash_offline.config import TrainConfig, as_dict, configs_from_argv

# --- config ----------------------------------------------------------------------------------------------------


def cache_defaults(cfg: TrainConfig) -> dict:
    """What the cache says about the target: its checkpoint, tapped layers, mask token, sizes."""
    from dflash_offline.manifest import read_manifest

    m = read_manifest(cfg.cache)
    if m["kind"] != "hidden":
        raise ValueError(f"{cfg.cache} is a {m['kind']} cache: train on a hidden-state cache (make extract output)")
    tgt = m["producer"]["target"]
    return {
        "target": cfg.target or m["config"]["extract"]["target"], "cache_target": m["config"]["extract"]["target"],
        "target_id": tgt,
        "layer_ids": list(cfg.layer_ids) or list(m["config"]["layer_ids"]),
        "mask_token_id": cfg.mask_token_id if cfg.mask_token_id >= 0 else m["config"]["mask_token_id"],
        "hidden_size": tgt["hidden_size"], "num_target_layers": tgt["num_layers"], "vocab_size": tgt["vocab_size"],
        "seq_len": m["producer"]["tokens"]["producer"]["seq_len"],
    }


def drafter_config(cfg: TrainConfig, c: dict):
    from dflash_offline.drafter import DrafterConfig
    from dflash_offline.target import read_target_info
    from dflash_offline.targetid import resolve_checkpoint

    info = read_target_info(resolve_checkpoint(c["target"], field="train.target" if cfg.target else
                                               f"train.target (empty: the target {cfg.cache} was extracted from)"))
    if c["mask_token_id"] is None:
        raise ValueError("no mask token: pass mask_token_id= (Qwen3 151669, Qwen3.5/3.6 248070)")
    if info.hidden_size != c["hidden_size"] or info.num_layers != c["num_target_layers"]:
        raise ValueError(f"target {c['target']} (hidden {info.hidden_size}, {info.num_layers} layers) is not the "
                         f"target the cache was extracted from (hidden {c['hidden_size']}, "
                         f"{c['num_target_layers']} layers): pass target= the right checkpoint")
    types = None
    if cfg.sliding_window:
        types = ["sliding_attention"] * (cfg.num_layers - 1) + ["full_attention"]
    return DrafterConfig(
        hidden_size=c["hidden_size"], intermediate_size=cfg.intermediate_size or info.intermediate_size,
        vocab_size=info.vocab_size, target_layer_ids=c["layer_ids"], num_target_layers=info.num_layers,
        mask_token_id=int(c["mask_token_id"]), num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=info.rms_norm_eps,
        rope_theta=info.rope_theta, block_size=cfg.block_size, sliding_window=cfg.sliding_window or None,
        layer_types=types,
    )


def cosine_schedule(step: int, warmup: int, total: int, floor: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def flops_per_row(dc, seq_len: int, num_anchors: int) -> float:
    """Model FLOPs of one training row (forward + backward; lm_head: logits + input gradient only)."""
    H, L, Q = dc.hidden_size, dc.block_size, num_anchors * dc.block_size
    k, qd, kvd = len(dc.target_layer_ids), dc.num_heads * dc.head_dim, dc.num_kv_heads * dc.head_dim
    per_layer = H * (qd + 2 * kvd) + qd * H + 3 * H * dc.intermediate_size
    layers = 6 * Q * per_layer * dc.num_layers
    ctx_kv = 6 * seq_len * H * 2 * kvd * dc.num_layers
    fc = 4 * seq_len * k * H * H
    attn = 3 * 4 * Q * (seq_len / 2 + L) * qd * dc.num_layers  # ~half the row visible on average
    head = 4 * num_anchors * (L - 1) * H * dc.vocab_size
    return layers + ctx_kv + fc + attn + head


# --- the run ---------------------------------------------------------------------------------------------------


def run(cfg: TrainConfig) -> Path:
    import gc

    import torch

    strict, tf32 = torch._dynamo.config.error_on_recompile, tf32_setting()
    frozen = gc.get_freeze_count()
    gc.callbacks.append(GC_CLOCK)
    try:
        run_dir = _run(cfg)
    finally:  # set after the warm-up step; not left on for whatever runs next in this process
        gc.callbacks.remove(GC_CLOCK)
        torch._dynamo.config.error_on_recompile = strict
        setattr(torch.backends.cuda.matmul, *tf32)  # set by `_run` for its own matmuls
        if not frozen and gc.get_freeze_count():  # we froze (a caller's own frozen objects are left as they are)
            gc.unfreeze()
    release_process_group()  # after `_run`'s frame is gone
    return run_dir


def tf32_setting() -> tuple[str, object]:
    """The process's TF32 setting for CUDA matmuls as (attribute, value) of `torch.backends.cuda.matmul`, to put back
    with setattr: torch's `allow_tf32` flag, which `_run` sets; or, where a caller has used torch's newer
    `fp32_precision` setting (the flag then cannot be read: torch refuses a mix of the two), that one."""
    import torch

    m = torch.backends.cuda.matmul
    try:
        return "allow_tf32", m.allow_tf32
    except RuntimeError:
        return "fp32_precision", m.fp32_precision


def release_process_group() -> None:
    """Destroy the default process group, after `_run`'s frame (and with it the DDP model) is gone.

    The order matters: DDP's C++ reducer holds the process group. If the group is unregistered first (what
    `Accelerator.end_training` does) and the reducer is freed later, the group's destructor runs inside the
    reducer's deallocation with the GIL held and joins gloo's worker threads; a worker that is releasing its last
    tensor needs the GIL, and both wait forever (seen once: a 2-process CPU run that finished all its steps and
    checkpoints and never exited). Freed here, from Python, the group is destroyed without the GIL.
    """
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()  # cycles that still hold the DDP model
        dist.destroy_process_group()


def _run(cfg: TrainConfig) -> Path:
    import gc

    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from dflash_offline import anchors as anc
    from dflash_offline.checkpoint import gather_full_state, load_checkpoint, save_checkpoint
    from dflash_offline.dataset import HiddenStream, open_hidden_cache
    from dflash_offline.drafter import DFlashDrafter, load_target_embeddings
    from dflash_offline.loss import block_ce_loss, resolve_epilogue
    from dflash_offline.manifest import remove_dead_temps
    from dflash_offline.optim import MasterAdamW, fp32_allreduce_hook
    from dflash_offline.progress import Progress, log
    from dflash_offline.targetid import check_same_target

    t0 = time.time()
    run_dir = Path(cfg.run)
    c = cache_defaults(cfg)
    dc = drafter_config(cfg, c)
    check_same_target(c["target"], c["target_id"], cfg.cache, c["cache_target"])
    info = open_hidden_cache(cfg.cache, c["layer_ids"], hidden_size=c["hidden_size"], seq_len=c["seq_len"],
                             require_verified=cfg.require_verified)
    if (run_dir / "checkpoints").exists() and not cfg.resume:
        raise ValueError(f"{run_dir} already holds checkpoints: pass resume=1 (make train RESUME=1) to continue "
                         f"it, or choose another RUN=")
    if (n := remove_dead_temps(run_dir / "checkpoints"))[0]:  # a checkpoint half-written by a killed run
        log(f"{run_dir}/checkpoints: removed {n[0]} unfinished checkpoint(s) of dead runs ({n[1] / 1e6:.1f} MB)")

    # --- compute
    cuda = torch.cuda.is_available()
    precision = cfg.precision if cfg.precision != "auto" else ("bf16" if cuda else "fp32")
    attn = cfg.attn if cfg.attn != "auto" else ("flex" if cuda else "dense")
    use_compile = cfg.compile == "on" or (cfg.compile == "auto" and cuda)
    if attn != "dense" and not cuda:
        raise ValueError(f"attn={attn} needs CUDA (flex_attention has no CPU backward); use attn=dense or auto on "
                         f"the CPU")
    if attn != "dense" and not use_compile:
        raise ValueError(f"attn={attn} needs compile=on: uncompiled flex_attention materializes the full score "
                         f"matrix")
    epilogue = resolve_epilogue(cfg.loss_epilogue, cuda)  # fails here, at start, if this machine cannot run it
    if cfg.tf32 == "on" and not cuda:
        raise ValueError("tf32=on needs CUDA (TF32 tensor cores); use tf32=auto or off on the CPU")
    tf32 = cfg.tf32 == "on" or (cfg.tf32 == "auto" and cuda and precision == "bf16")
    trackers = [t for t in cfg.trackers.split(",") if t and t != "none" and tracker_available(t)]
    rows_per_micro = cfg.batch_rows * c["seq_len"]
    # step_scheduler_with_optimizer=False: the schedule is in optimizer steps, whatever the number of processes
    acc = Accelerator(mixed_precision="no", cpu=not cuda, log_with=trackers or None, project_dir=str(run_dir),
                      step_scheduler_with_optimizer=False)
    # after the Accelerator, which sets TF32 on itself when a dynamo backend is configured (`run` puts the caller's
    # setting back)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    world, rank = acc.num_processes, acc.process_index
    sharded = cfg.fsdp and world > 1  # FSDP only shards over more than one process
    accum = 1
    if cfg.global_batch_tokens:
        accum, rem = divmod(cfg.global_batch_tokens, rows_per_micro * world)
        if rem or accum < 1:
            raise ValueError(f"global_batch_tokens={cfg.global_batch_tokens} must be a multiple of batch_rows × "
                             f"seq_len × processes = {rows_per_micro * world}")
    master = cfg.master_weights == "on" or (cfg.master_weights == "auto" and precision == "bf16")
    why_not = "precision is fp32" if precision != "bf16" else "FSDP shards fp32 weights" if sharded else None
    if master and why_not:
        if cfg.master_weights == "on":
            raise ValueError(f"master_weights=on is not available here: {why_not}; use master_weights=off/auto")
        master = False
    # several processes with gradient accumulation: fp32 sums reduced by the comm hook (`fp32_allreduce_hook`),
    # tested on the CPU (gloo) only so far, so `on` asks for it and `auto` keeps fp32 weights there
    reduced_accum = world > 1 and accum > 1 and not sharded
    if master and reduced_accum and cfg.master_weights == "auto":
        master = False
    why_not = ("it needs master weights (master_weights)" if not master else "it needs CUDA" if not cuda else
               "compile_scope=model compiles the forward as one graph" if use_compile and cfg.compile_scope == "model"
               else None)
    if cfg.optimizer_overlap == "on" and why_not:
        raise ValueError(f"optimizer_overlap=on is not available here: {why_not}; use optimizer_overlap=off/auto")
    overlap = cfg.optimizer_overlap != "off" and why_not is None
    device = acc.device
    set_seed(cfg.seed)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved = {"train": as_dict(cfg), "drafter": as_dict(dc), "derived": {
            "world_size": world, "grad_accum": accum, "fsdp_sharded": sharded, "precision": precision,
            "attn": attn, "compile": use_compile, "master_weights": master, "optimizer_overlap": overlap,
            "loss_epilogue": epilogue, "loss_logits": cfg.loss_logits, "tf32": tf32,
            "global_batch_rows": cfg.batch_rows * world * accum, "cache_key": info.key}}
        (run_dir / "config.json").write_text(json.dumps(resolved, indent=1, sort_keys=True))
        log(f"drafter {dc.num_layers}×(H {dc.hidden_size}, {dc.num_heads}/{dc.num_kv_heads} heads × "
            f"{dc.head_dim}, FFN {dc.intermediate_size}) on taps {dc.target_layer_ids}; {world} process(es) × "
            f"{cfg.batch_rows} rows × accum {accum}{', FSDP-sharded' if sharded else ''}; {precision}"
            f"{' (bf16 weights, fp32 masters)' if master else ''}"
            f"{', optimizer update overlapping the next forward' if overlap else ''}, "
            f"attn {attn}, compile {use_compile}")

    # --- model
    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(dc).to(device)
    embed, head = load_target_embeddings(c["target"])
    wdtype = torch.bfloat16 if precision == "bf16" else torch.float32
    embed, head = embed.to(device, wdtype).requires_grad_(False), head.to(device, wdtype).requires_grad_(False)

    # --- optimizer (built after sharding when FSDP is on: it must hold the sharded parameters)
    if cfg.fsdp and not sharded and rank == 0:
        log("fsdp=1 with one process: nothing to shard, training unsharded")
    if sharded:  # FSDP2, one unit per decoder layer + the rest
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    if master:  # bf16 matmul weights; fp32 masters, clipping and AdamW in one fused pass
        opt = MasterAdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                          max_grad_norm=cfg.grad_clip, low_dtype=torch.bfloat16)
        if accum > 1:
            opt.accumulate_in_fp32()
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                fused=cuda)
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 0 else max(1, round(0.04 * cfg.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_schedule(s, warmup, cfg.steps, cfg.min_lr_ratio))
    if sharded:  # the sharded model never goes through accelerate (it would wrap it in DDP)
        opt, sched = acc.prepare(opt, sched)
    else:
        model, opt, sched = acc.prepare(model, opt, sched)
    raw = acc.unwrap_model(model)
    if master and world > 1:  # DDP: reduce the bf16 gradients in fp32 (as the fp32-weight path does) ...
        # (with accumulation, together with the fp32 sums of the earlier micro-batches)
        model.register_comm_hook(opt.optimizer if accum > 1 else None, fp32_allreduce_hook)
        opt.optimizer.broadcast_masters(0)  # ... and start every rank from rank 0's fp32 weights, as DDP does the model
    if overlap:  # each layer's weights are waited for just before the forward uses them
        opt.optimizer.overlap_with_forward(raw.weight_groups())
        raw.weight_fence = opt.optimizer.wait_for
    step_fn = model
    if use_compile and cfg.compile_scope == "layers":
        for layer in raw.layers:  # one compiled region; layers 1.. reuse layer 0's graph (same code, same shapes)
            layer.compile(dynamic=False)  # (the last layer, which drops slot 0 before its MLP, has its own graph)
        if not sharded:  # the context projection and the final norm + cast: fused instead of ~10 eager kernels each
            raw.encode_context = torch.compile(raw.encode_context, dynamic=False)
            raw.output_norm = torch.compile(raw.output_norm, dynamic=False)
    elif use_compile:
        step_fn = torch.compile(model, dynamic=False)

    # --- data
    stream = HiddenStream(info, cfg.batch_rows, rank=rank, world_size=world, seed=cfg.seed, device=device)
    step = 0
    if cfg.resume:
        state = load_checkpoint(run_dir, raw, opt, sched, sharded=sharded)
        stream.load_state_dict(state["data_state"])
        step = state["step"]
        log(f"[rank {rank}] resumed {run_dir} at step {step} ({state['dir'].name})")
    if trackers and rank == 0:
        acc.init_trackers("dflash", config={k: v for k, v in as_dict(cfg).items() if isinstance(v, int | float | str)})

    # --- loop
    fpr = flops_per_row(dc, c["seq_len"], cfg.num_anchors)
    progress = Progress("train", cfg.steps, "step", run_dir / f"status-rank{rank}.json", disable=rank != 0 or None)
    progress.update(step)
    metrics_file = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None
    window, pending = Window().begin(device), None

    def emit(rec: dict) -> None:  # a finished window's record: metrics.jsonl, trackers, progress bar, log line
        if rank == 0:
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
            acc.log({k: v for k, v in rec.items() if isinstance(v, int | float)}, step=rec["step"])
            progress.extra.update(loss=rec["loss"], tau=rec["sim_tau"])
            log(f"step {rec['step']}: loss {rec['loss']:.4f} acc1 {rec['acc'][0]:.3f} sim τ {rec['sim_tau']:.2f} "
                f"{rec['tok_per_s']:,.0f} tok/s mfu {rec['flop_frac']:.3f} wait {rec['data_wait_frac']:.3f} "
                f"gc {rec['gc_frac']:.3f}")

    log(f"[rank {rank}] ready in {time.time() - t0:.1f}s; first step compiles" if use_compile else
        f"[rank {rank}] ready in {time.time() - t0:.1f}s")
    profiler = None
    graphs_start, graphs0 = compiled_graphs(), None
    warm_step, t_loop = step + 1, time.time()  # this process's first step compiles (also when resumed)
    while step < cfg.steps:
        if cfg.profile_steps and rank == 0 and step == max(2, cfg.steps - cfg.profile_steps) and profiler is None:
            profiler, profile_end = start_profiler(cuda), step + cfg.profile_steps  # the last steps, after warm-up
        for micro in range(accum):
            batch = next(stream)
            window.wait_s += stream.last_wait_s
            g = torch.Generator(device=device).manual_seed(micro_seed(cfg.seed, (step * accum + micro) * world + rank))
            a_BA, keep_BA = anc.sample_anchors(batch["loss_mask"], batch["doc_ids"], cfg.num_anchors, dc.block_size, g)
            labels_BAL = anc.block_labels(batch["input_ids"], batch["loss_mask"], batch["doc_ids"], a_BA, keep_BA,
                                          dc.block_size)
            hidden = batch["hidden"]
            if cfg.noise_std > 0:
                rms = hidden.float().pow(2).mean(-1, keepdim=True).sqrt()
                noise = torch.randn(hidden.shape, generator=g, device=device)
                hidden = (hidden.float() + cfg.noise_std * rms * noise).to(hidden.dtype)
            masks = raw.build_masks(batch["doc_ids"], a_BA, keep_BA, attn)
            if sharded:  # reduce-scatter the gradients once, on the last micro-batch
                model.set_requires_gradient_sync(micro + 1 == accum)
            if master and reduced_accum:  # the last micro-batch's gradients go to the comm hook as they are
                opt.optimizer.reduce_next_backward(micro + 1 == accum)
            with acc.no_sync(model) if micro + 1 < accum and not sharded else nullcontext():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    h = step_fn(hidden, batch["input_ids"], batch["position_ids"], a_BA, keep_BA, embed, masks, attn,
                                scored_only=True, out_dtype=head.dtype)  # slots 1..L-1: the scored ones
                out = block_ce_loss(h, head, labels_BAL, gamma=cfg.gamma or None,
                                    weighting=cfg.weighting, chunk_tokens=cfg.loss_chunk_tokens,
                                    epilogue=epilogue, logits=cfg.loss_logits)
                acc.backward(out.loss / accum)
            window.add(out, keep_BA)
        if master:
            grad_norm = opt.optimizer.step()  # clips inside; the global norm before clipping
        else:
            grad_norm = acc.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if profiler is not None and step == profile_end:
            write_profile(profiler, run_dir / "profile.txt", cuda, cfg.profile_steps)
            profiler = None
        if step == warm_step and gc.get_freeze_count() == 0:
            # everything built so far (modules, compiled graphs, the dynamo/inductor caches: millions of objects)
            # lives until the end: keep it out of the cyclic GC's full passes, which would otherwise walk it all
            # every so often on the thread that feeds the GPU
            gc.freeze()
        if step == warm_step and use_compile:
            torch._dynamo.config.error_on_recompile = True  # warm-up done: a new shape is a bug, not a slowdown
            graphs0 = compiled_graphs()
            log(f"[rank {rank}] warm-up step compiled {graphs0 - graphs_start} graphs in {time.time() - t_loop:.0f}s")
        window.graphs0 = graphs0
        window.steps += 1
        window.rows += cfg.batch_rows * accum * world
        if grad_norm is not None and hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
            grad_norm = grad_norm.full_tensor()
        window.grad_norm = grad_norm.detach() if grad_norm is not None else 0.0  # no host sync per step
        progress.update(1, tokens=cfg.batch_rows * accum * world * c["seq_len"])
        if pending is not None:  # last window's report, read now that this step is queued behind it (no idle GPU)
            emit(pending.result())
            pending = None
        checkpoint = step % cfg.ckpt_every == 0 or step == cfg.steps
        if step % cfg.log_every == 0 or checkpoint:  # a window also ends at a checkpoint: its time is not training
            pending = window.report(acc, step, sched.get_last_lr()[0], c["seq_len"], fpr, device,
                                    skipped=opt.optimizer.skipped if master else None)
            window = Window(start=pending.done, t0=pending.t_end)  # the next window starts where this one ends
        if pending is not None and checkpoint:  # report before the checkpoint: its time is not training time
            emit(pending.result())
            pending = None
        if checkpoint:
            if overlap:
                opt.optimizer.wait_all()  # the weights the checkpoint reads are the updated ones
            acc.wait_for_everyone()
            states = gather_full_state(raw, opt) if sharded else None  # a collective: every rank
            if rank == 0:
                save_checkpoint(run_dir, step, raw, opt, sched, data_state=stream.state_dict(),
                                config={"train": as_dict(cfg), "drafter": as_dict(dc)}, keep_last=cfg.keep_last,
                                states=states)
            acc.wait_for_everyone()
            window.begin(device)  # the window starts after the checkpoint
    stream.close()
    progress.close("done")
    if metrics_file:
        metrics_file.close()
    for tracker in acc.trackers:  # `acc.end_training()` without its process-group destruction: see `run`
        tracker.finish()
    return run_dir


def start_profiler(cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), record_shapes=True)
    prof.__enter__()
    return prof


def write_profile(prof, path: Path, cuda: bool, steps: int) -> None:
    import torch

    from dflash_offline.progress import log

    if cuda:
        torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    avg = prof.key_averages()
    sort = "self_cpu_time_total"
    if cuda:
        sort = "self_device_time_total" if hasattr(avg[0], "self_device_time_total") else "self_cuda_time_total"
    text = f"# {steps} training steps, sorted by {sort}\n" + avg.table(sort_by=sort, row_limit=40,
                                                                      max_name_column_width=70) + "\n"
    try:  # extras: GEMM time per input shape, and the timeline (never worth failing a run for)
        rows = [(getattr(e, sort, 0), e.count, e.input_shapes)
                for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mm"]
        text += f"\n# aten::mm by input shapes: {sort} (µs), calls, shapes\n" + "".join(
            f"{us:12.0f} {n:5d}  {shapes}\n" for us, n, shapes in sorted(rows, key=lambda r: -r[0])[:30])
        trace = path.with_name(path.stem + "_trace.json")
        prof.export_chrome_trace(str(trace))  # open in https://ui.perfetto.dev, or: python -m bench.trace_gaps
    except Exception as e:  # noqa: BLE001
        text += f"\n# (shape table / timeline not written: {e!r})\n"
    path.write_text(text)
    log(f"profile of {steps} steps written to {path}")


def micro_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7919 + 12345) % (2**63 - 1)


class nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def tracker_available(name: str) -> bool:
    import importlib.util

    module = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(name, name)
    if importlib.util.find_spec(module) is None:
        print(f"warning: tracker {name!r} is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
        return False
    return True


class GcClock:
    """Seconds the process spent in Python's cyclic GC (all generations), counted through `gc.callbacks`."""

    def __init__(self):
        self.total, self._t0 = 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._t0


GC_CLOCK = GcClock()


class Window:
    """Metrics accumulated between two log lines (reduced over processes when reported)."""

    def __init__(self, start=None, t0: float | None = None):
        self.t0 = time.time() if t0 is None else t0  # (off CUDA) wall clock from here to the end of the window
        # on CUDA, the window's time is device time between two events on the compute stream: from `start` (the
        # previous window's end, or `begin`) to its report's; it does not depend on when the host looks
        self.start = start
        self.gc0 = GC_CLOCK.total
        self.loss_sum, self.n, self.steps, self.rows, self.wait_s, self.grad_norm = 0.0, 0, 0, 0, 0.0, 0.0
        self.correct_L = self.valid_L = None
        self.tau_sum, self.blocks = 0.0, 0
        self.graphs0: int | None = None  # compiled graphs at the end of the warm-up step (None: not compiling)

    def begin(self, device) -> Window:
        """(Re)start the window's clocks now: after a checkpoint, or at the first step."""
        import torch

        self.t0, self.gc0 = time.time(), GC_CLOCK.total
        if device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        return self

    def add(self, out, keep_BA) -> None:
        from dflash_offline.loss import block_tau

        c, v = out.correct_BAL.sum((0, 1)).float(), out.valid_BAL.sum((0, 1)).float()
        self.correct_L = c if self.correct_L is None else self.correct_L + c
        self.valid_L = v if self.valid_L is None else self.valid_L + v
        self.loss_sum += out.loss.detach()
        self.n += 1
        self.tau_sum += (block_tau(out.correct_BAL) * keep_BA).sum().float()
        self.blocks += keep_BA.sum()

    def report(self, acc, step: int, lr: float, seq_len: int, fpr: float, device, skipped=None) -> Report:
        """Start this window's report: reduce its metrics over the processes and copy them to the host, without
        waiting for the device. `Report.result()` waits (for the copy only) and builds the record; called after the
        next step has been queued, the device never idles for it."""
        import torch

        t = torch.stack([torch.as_tensor(self.loss_sum, device=device, dtype=torch.float32),
                         torch.tensor(float(self.n), device=device), torch.as_tensor(self.tau_sum, device=device).float(),
                         torch.as_tensor(self.blocks, device=device).float()])
        t = acc.reduce(t, "sum")
        cl, vl = acc.reduce(self.correct_L, "sum"), acc.reduce(self.valid_L, "sum")
        local = torch.stack([torch.as_tensor(self.grad_norm, device=device, dtype=torch.float32),
                             torch.as_tensor(0.0 if skipped is None else skipped, device=device, dtype=torch.float32)])
        vals = torch.cat([t, local, cl.float(), vl.float()])
        host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=device.type == "cuda")
        host.copy_(vals, non_blocking=device.type == "cuda")
        done = None
        if device.type == "cuda":
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        return Report(self, host, done, step=step, lr=lr, seq_len=seq_len, fpr=fpr, device=device,
                      graphs=compiled_graphs(), skipped=skipped is not None)


class Report:
    """A window's metrics on their way to the host (see `Window.report`)."""

    def __init__(self, window: Window, host, done, **kw):
        self.w, self.host, self.done, self.kw = window, host, done, kw
        # off CUDA the work is done when the report is made: the window ends now (on CUDA: at the `done` event)
        self.t_end = time.time()

    def result(self) -> dict:
        from dflash_offline.loss import simulated_acceptance_length, slot_accuracy

        if self.done is not None:
            self.done.synchronize()  # the window's last step has run on the device
        now = time.time()
        w, k, v = self.w, self.kw, self.host
        loss_sum, n, tau_sum, blocks, grad_norm, skipped = v[:6].tolist()
        L = (v.numel() - 6) // 2
        acc_L = slot_accuracy(v[6 : 6 + L], v[6 + L :])
        secs = (w.start.elapsed_time(self.done) / 1000 if w.start is not None and self.done is not None
                else self.t_end - w.t0)
        secs = max(secs, 1e-9)
        cuda = k["device"].type == "cuda"
        rec = {
            "step": k["step"], "loss": loss_sum / n, "acc": [round(a, 4) for a in acc_L[1:].tolist()],
            "sim_tau": 1 + simulated_acceptance_length(acc_L).item(),
            "block_tau": tau_sum / max(blocks, 1.0), "lr": k["lr"], "grad_norm": grad_norm,
            "tok_per_s": w.rows * k["seq_len"] / secs, "ms_per_step": 1000 * secs / max(w.steps, 1),
            "flop_frac": w.rows * k["fpr"] / secs / 790e12 if cuda else 0.0,
            "data_wait_frac": w.wait_s / secs, "time": now if self.done is not None else self.t_end,
            "gc_frac": (GC_CLOCK.total - w.gc0) / secs,  # the feeding thread stopped for garbage collection
            # graphs compiled after the warm-up step (a recompile after it also raises; 0 in a healthy run)
            "recompiles": k["graphs"] - w.graphs0 if w.graphs0 is not None else 0,
        }
        if k["skipped"]:  # steps whose gradient norm was not finite: skipped, weights untouched
            rec["skipped_steps"] = int(skipped)
        if cuda:
            import torch

            rec["reserved_gb"] = torch.cuda.memory_reserved(k["device"]) / 2**30
            rec["peak_gb"] = torch.cuda.max_memory_allocated(k["device"]) / 2**30
        return rec


def compiled_graphs() -> int:
    """Graphs torch.compile has produced in this process so far (new frames and recompiles alike)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def main(argv: list[str]) -> None:
    from dflash_offline.progress import private_compile_caches, unbuffered

    private_compile_caches()  # before anything compiles: per-rank caches, no autotuner races between processes
    unbuffered()
    (cfg,) = configs_from_argv([(TrainConfig, "train")], argv, __doc__)
    out = run(cfg)
    if int(os.environ.get("RANK", 0)) == 0:
        print(out)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # everything is written and closed: end now, so that no destructor of a still-live distributed object
        # (the process group, kept by anything that outlived the run) can hang the exit at interpreter shutdown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    from dflash_offline.progress import run_cli

    run_cli(main)
