"""Stage 2: train a DFlash drafter on a hidden-state cache.

    python -m stages.train --recipe=manifests/demo.toml --cache=DIR --run=runs/x [--resume=1] ...
    accelerate launch --num_processes N -m stages.train ...        (one process per GPU; NPROC=N in make)

Sections: config → compute → model → optimizer → data → loop. Fixed shapes everywhere: B rows per micro-batch,
A anchors per row (padded with a keep mask, resampled every step), so the compiled step sees one shape; after the
warm-up step any recompile is an error. The streaming loader splits rows by rank itself (it never goes through
accelerator.prepare). Each row's anchors and noise come from a generator seeded by (seed, the row's place in the
run's sequence of rows), so resumed, 1-process and N-process runs — also a resume on another processes × batch_rows
split of the same global batch — see the same anchors for the same rows. A step draws the blocks of all its
micro-batches first, and divides each one's loss by the step's loss weight over all its micro-batches and processes
(`loss.step_normalizer`). What the settings mean on this machine: `dflash_offline.trainsetup`; the metrics windows
and the run's last line: `dflash_offline.metrics`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.cache.fsio import write_json_atomic
from dflash_offline.config import TrainConfig, as_dict, configs_from_argv
from dflash_offline.runguard import Interrupted, StopSignals, StopVote, check_run_dir, ender, owned
from dflash_offline.trainsetup import (
    BenchSwitches,
    TrainSetup,
    check_inputs,
    cosine_schedule,
    end_warm_up,
    kept_process_state,
    release_process_group,
    resolve_train,
    same_start_on_every_rank,
)

# --- the run ---------------------------------------------------------------------------------------------------


def run(cfg: TrainConfig, switches: BenchSwitches = BenchSwitches()) -> Path:
    """Train; `switches` are bench.train's A/B switches (not options). The process is left as the run found it.
    SIGTERM/SIGINT stop it after the step in flight with a final checkpoint (`runguard`): it raises `Interrupted`."""
    check_run_dir(Path(cfg.run))
    rank, stopped = int(os.environ.get("RANK", 0)), None
    try:
        with kept_process_state(), StopSignals(cfg.stop_grace_s, ender(Path(cfg.run), rank)) as stopper:
            run_dir = _run(cfg, switches, stopper)
    except Interrupted as e:
        stopped = e.with_traceback(None)  # its traceback would keep `_run`'s frame, and the DDP model, alive
    release_process_group()  # after `_run`'s frame is gone
    if stopped is not None:
        raise stopped
    return run_dir


@dataclass
class Parts:
    """What the loop drives: the model as trained and as a plain module, optimizer, schedule, frozen tables."""

    model: object  # DDP-wrapped (or FSDP-sharded) drafter
    raw: object  # the plain DFlashDrafter (saving, masks)
    opt: object  # accelerate-wrapped optimizer (MasterAdamW or AdamW as `.optimizer`)
    sched: object  # accelerate-wrapped LambdaLR
    embed: object  # the target's frozen embedding
    head: object  # the target's frozen lm_head
    skipped: object = None  # steps skipped for a non-finite gradient norm (a device tensor; MasterAdamW keeps its own)


def _run(cfg: TrainConfig, switches: BenchSwitches, stopper: StopSignals) -> Path:
    # --- config: everything checked before any weights load; then the run is this trainer's (rank 0 holds its lock)
    t0, run_dir = time.time(), Path(cfg.run)
    c, dc, info = check_inputs(cfg, run_dir)  # (also removes what a killed run left half-written)
    with owned(run_dir, int(os.environ.get("RANK", 0)), lost=lambda held: os._exit(1)):  # (another owns it now)
        return _train(cfg, switches, stopper, t0, c, dc, info)


def _train(cfg: TrainConfig, switches: BenchSwitches, stopper: StopSignals, t0: float, c: dict, dc, info) -> Path:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from dflash_offline.checkpoint import load_checkpoint, resume_point
    from dflash_offline.dataset import HiddenStream
    from dflash_offline.metrics import available_trackers
    from dflash_offline.progress import log

    run_dir = Path(cfg.run)
    # --- compute
    cuda, trackers = torch.cuda.is_available(), available_trackers(cfg.trackers)
    if not cuda:
        from dflash_offline.devices import quiet_cpu_kernel_notes

        quiet_cpu_kernel_notes(log)
    # step_scheduler_with_optimizer=False: the schedule is in optimizer steps, whatever the number of processes
    acc = Accelerator(mixed_precision="no", cpu=not cuda, log_with=trackers or None, project_dir=str(run_dir),
                      step_scheduler_with_optimizer=False)
    s = resolve_train(cfg, cuda=cuda, world=acc.num_processes, seq_len=c["seq_len"], rows=info.num_rows,
                      switches=switches)
    torch.backends.cuda.matmul.allow_tf32 = s.tf32  # after the Accelerator, which may set it (`run` puts it back)
    rank, device = acc.process_index, acc.device
    # the newest checkpoint whose files match their recorded SHA-256 (a damaged one is skipped, and said so); the
    # processes hash a share of its files each
    start = resume_point(run_dir, log, rank, acc.num_processes, lambda v: int(acc.gather(
        torch.tensor([v], dtype=torch.int64, device=device)).max())) if cfg.resume else None
    set_seed(cfg.seed)
    run_dir.mkdir(parents=True, exist_ok=True)  # every rank: its status file goes there (RUN= local to a machine too)
    same_start_on_every_rank(acc, start, run_dir, info)  # machines that do not share RUN= or CACHE= would differ
    if start is not None:
        check_same_projection(start, run_dir, c.get("projection"))
    if rank == 0:
        resolved = {"train": as_dict(cfg), "drafter": as_dict(dc), "derived": s.derived(cfg, info.key),
                    **({"projection": c["projection"]} if c.get("projection") else {})}
        write_json_atomic(run_dir / "config.json", resolved)  # a reader never sees half of it
        if c.get("projection"):  # the run keeps the P it trains on: export and eval then need no cache
            from dflash_offline.projection import copy_to_run

            copy_to_run(c["projection"], run_dir)
        log(f"drafter {dc.num_layers}×(H {dc.hidden_size}, {dc.num_heads}/{dc.num_kv_heads} heads × "
            f"{dc.head_dim}, FFN {dc.intermediate_size}) on taps {dc.target_layer_ids}; {s.describe(cfg)}")
        log(s.describe_schedule(cfg, c["seq_len"]))

    # --- model
    from dflash_offline.drafter import DFlashDrafter, load_target_embeddings

    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(dc).to(device)
    if s.precision == "fp8":  # float8 linears, before sharding, the optimizer and compilation (torchao's order)
        from dflash_offline.fp8 import convert

        convert(model, cfg.fp8_recipe, emulate=s.fp8_emulate, log=log if rank == 0 else None)
    embed, head = load_target_embeddings(c["target"])
    wdtype = torch.bfloat16 if s.bf16 else torch.float32
    embed, head = embed.to(device, wdtype).requires_grad_(False), head.to(device, wdtype).requires_grad_(False)

    # --- optimizer (built after sharding when FSDP is on: it must hold the sharded parameters)
    p = build_optimizer(cfg, s, acc, model, embed, head)
    compile_model(p.raw, s)

    # --- data
    stream = HiddenStream(info, cfg.batch_rows, rank=rank, world_size=s.world, seed=cfg.seed, device=device)
    step = 0
    if start is not None:
        state = load_checkpoint(run_dir, p.raw, p.opt, p.sched, step=int(start.name.split("-")[1]),
                                sharded=s.sharded, verify=False)  # (verified above)
        stream.load_state_dict(state["data_state"])
        step = state["step"]
        log(f"[rank {rank}] resumed {run_dir} at step {step} ({state['dir'].name})")
    elif cfg.resume:  # killed before its first checkpoint was whole: nothing to continue, so it starts over
        log(f"[rank {rank}] {run_dir} holds no complete checkpoint: starting at step 0")
    if trackers and rank == 0:
        acc.init_trackers("dflash", config={k: v for k, v in as_dict(cfg).items() if isinstance(v, int | float | str)})

    # --- loop
    try:
        train_loop(cfg, s, acc, p, stream, step, dc, c["seq_len"], run_dir, t0, c.get("projection"), stopper)
    finally:  # a failed step too: the reader's queued reads are dropped, its files closed, before the error surfaces
        stream.close()
    return run_dir


# --- model and optimizer ---------------------------------------------------------------------------------------


def build_optimizer(cfg: TrainConfig, s: TrainSetup, acc, model, embed, head) -> Parts:
    """Shard (FSDP) or wrap (DDP) the model and build its optimizer and schedule through accelerate."""
    import torch

    from dflash_offline.optim import MasterAdamW, fp32_allreduce_hook
    from dflash_offline.progress import log

    if cfg.fsdp and not s.sharded and acc.process_index == 0:
        log("fsdp=1 with one process: nothing to shard, training unsharded")
    if s.sharded:  # FSDP2, one unit per decoder layer + the rest
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    if s.master:  # bf16 matmul weights; fp32 masters, clipping and AdamW in one fused pass
        opt = MasterAdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                          max_grad_norm=cfg.grad_clip, low_dtype=torch.bfloat16)
        if s.accum > 1:
            opt.accumulate_in_fp32()
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                                fused=acc.device.type == "cuda")
    lr_at = lambda step: cosine_schedule(step, s.warmup, s.steps, cfg.min_lr_ratio)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    if s.sharded:  # the sharded model never goes through accelerate (it would wrap it in DDP)
        opt, sched = acc.prepare(opt, sched)
    else:
        model, opt, sched = acc.prepare(model, opt, sched)
    raw = acc.unwrap_model(model)
    if s.master and s.world > 1:  # DDP: reduce the bf16 gradients in fp32 (as the fp32-weight path does) ...
        # (with accumulation, together with the fp32 sums of the earlier micro-batches)
        model.register_comm_hook(opt.optimizer if s.accum > 1 else None, fp32_allreduce_hook)
        opt.optimizer.broadcast_masters(0)  # ... and start every rank from rank 0's fp32 weights, as DDP does the model
    if s.overlap:  # each layer's weights are waited for just before the forward uses them
        opt.optimizer.overlap_with_forward(raw.weight_groups())
        raw.weight_fence = opt.optimizer.wait_for
    skipped = None if s.master else torch.zeros((), dtype=torch.float32, device=acc.device)
    return Parts(model=model, raw=raw, opt=opt, sched=sched, embed=embed, head=head, skipped=skipped)


def compile_model(raw, s: TrainSetup) -> None:
    """Each decoder layer one compiled region; layers 1.. reuse layer 0's graph (same code, same shapes; the last
    layer, which drops slot 0 before its MLP, has its own). The uncompiled module stays for saving and eval."""
    import torch

    if not s.compile:
        return
    for layer in raw.layers:
        layer.compile(dynamic=False)
    if not s.sharded:  # the context projection and the final norm + cast: fused instead of ~10 eager kernels each
        raw.encode_context = torch.compile(raw.encode_context, dynamic=False)
        raw.output_norm = torch.compile(raw.output_norm, dynamic=False)


# --- the loop --------------------------------------------------------------------------------------------------


def train_loop(cfg: TrainConfig, s: TrainSetup, acc, p: Parts, stream, step: int, dc, seq_len: int, run_dir: Path,
               t0: float, projection: dict | None = None, stopper: StopSignals | None = None) -> None:
    from dflash_offline.checkpoint import find_checkpoint
    from dflash_offline.loss import loss_weight, step_normalizer
    from dflash_offline.metrics import Meter, flops_per_row, start_profiler, write_profile
    from dflash_offline.progress import Progress, log

    rank, cuda, rows_per_step = acc.process_index, acc.device.type == "cuda", cfg.batch_rows * s.accum * s.world
    progress = Progress("train", s.steps, "step", run_dir / f"status-rank{rank}.json", disable=rank != 0 or None)
    progress.update(step)
    meter, profiler = Meter(run_dir, acc, progress, step, seq_len, flops_per_row(dc, seq_len, cfg.num_anchors)), None
    log(f"[rank {rank}] ready in {time.time() - t0:.1f}s{'; first step compiles' if s.compile else ''}")
    warm_step = step + 1  # this process's first step compiles (also when resumed)
    vote = StopVote(acc)
    while step < s.steps:
        if cfg.profile_steps and rank == 0 and step == max(2, s.steps - cfg.profile_steps) and profiler is None:
            profiler, profile_end = start_profiler(cuda), step + cfg.profile_steps  # the last steps, after warm-up
        micros = [next_micro(cfg, s, acc, stream, step * s.accum + m, dc) for m in range(s.accum)]
        norm = step_normalizer([loss_weight(b["labels"], cfg.gamma or None, cfg.weighting) for b, _ in micros], s.world)
        for m, (batch, wait_s) in enumerate(micros):
            out, sel = micro_batch(cfg, s, acc, p, batch, norm, last=m == s.accum - 1)
            meter.add(out, batch["keep"], wait_s, sel)
        grad_norm = optimizer_step(cfg, s, acc, p)
        step += 1
        if profiler is not None and step == profile_end:
            write_profile(profiler, run_dir / "profile.txt", cuda, cfg.profile_steps)
            profiler = None
        if step == warm_step:
            end_warm_up(s.compile)  # freeze the heap built so far; with compilation, a recompile is now an error
            meter.warmed_up(s.compile)
        meter.step(rows_per_step, grad_norm)  # (reads the last window's report, now that this step is queued)
        checkpoint = step % cfg.ckpt_every == 0 or step == s.steps
        if step % cfg.log_every == 0 or checkpoint:  # a window also ends at a checkpoint: its time is not training
            meter.end_window(step, p.sched.get_last_lr()[0], p.opt.optimizer.skipped if s.master else p.skipped,
                             read_now=checkpoint)
        if checkpoint:
            save(cfg, s, acc, p, run_dir, step, stream, projection)
            meter.restart()  # the window starts after the checkpoint
        if stopper is not None and (signum := vote(stopper.requested)):  # (every process at the same step)
            stop(cfg, s, acc, p, run_dir, step, stream, projection, progress, meter, signum, saved=checkpoint)
    stream.close()
    progress.close("done")
    meter.close()
    if rank == 0:
        log(meter.summary(time.time() - t0, find_checkpoint(run_dir)))
    for tracker in acc.trackers:  # `acc.end_training()` without its process-group destruction: see `run`
        tracker.finish()


def stop(cfg: TrainConfig, s: TrainSetup, acc, p: Parts, run_dir: Path, step: int, stream, projection, progress,
         meter, signum: int, saved: bool) -> None:
    """A stop signal: a checkpoint of this step (unless just written), the status file says `interrupted`, and
    `Interrupted` carries the run's one line and exit status up to `main`."""
    import signal

    from dflash_offline.checkpoint import step_dir

    if not saved:  # as at a checkpoint: the window ends at this step and its record is written before the save
        if meter.window.steps:  # (a resume starts after this step: a record left pending or unended would be lost)
            meter.end_window(step, p.sched.get_last_lr()[0], p.opt.optimizer.skipped if s.master else p.skipped)
        meter.read()
        save(cfg, s, acc, p, run_dir, step, stream, projection)
    progress.close("interrupted")
    meter.close()
    name = signal.Signals(signum).name
    raise Interrupted(signum, f"stopped on {name} at step {step} of {s.steps}: checkpoint {step_dir(run_dir, step)}; "
                              f"continue with --resume=1 (make RESUME=1); exit status {128 + signum}")


def next_micro(cfg: TrainConfig, s: TrainSetup, acc, stream, index: int, dc) -> tuple[dict, float]:
    """Micro-batch `index` of this process's run: the stream's next batch with its blocks (`anchors`, `keep`,
    `labels`) and its noise (noise_std > 0), each row's drawn in this order from a generator seeded by the row's
    place in the run's sequence of rows — (global micro-batch index × rows per micro-batch) + its row, which is the
    same for any split of the global batch into processes × micro-batches × rows; and the time the stream kept the
    host waiting for it."""
    import torch

    from dflash_offline.anchors import random_rows, sample_blocks

    batch, wait_s = next(stream), stream.last_wait_s
    B = batch["input_ids"].shape[0]
    first = (index * s.world + acc.process_index) * B
    g = [torch.Generator(device=acc.device).manual_seed(micro_seed(cfg.seed, first + r)) for r in range(B)]
    batch["anchors"], batch["keep"], batch["labels"] = sample_blocks(batch, cfg.num_anchors, dc.block_size, g)
    if cfg.noise_std > 0:
        hidden = batch["hidden"]
        rms = hidden.float().pow(2).mean(-1, keepdim=True).sqrt()
        noise = random_rows(torch.randn, hidden.shape, g, acc.device)
        batch["hidden"] = (hidden.float() + cfg.noise_std * rms * noise).to(hidden.dtype)
    return batch, wait_s


def micro_batch(cfg: TrainConfig, s: TrainSetup, acc, p: Parts, batch: dict, norm, last: bool):
    """Forward and backward of a `next_micro` batch (`last`: the step's last), its loss divided by `norm`, the step's
    (`loss.step_normalizer`): the loss returned is its share of the step's loss (see `metrics.Meter.add`). Returns
    (that loss output, the selector's `dflash2.SelectorLoss` with its `norm` — DFlash2 — or None)."""
    import torch

    from dflash_offline.loss import block_ce_loss

    a_BA, keep_BA = batch["anchors"], batch["keep"]
    masks = p.raw.build_masks(batch["doc_ids"], a_BA, keep_BA, s.attn)
    if s.sharded:  # reduce-scatter the gradients once, on the last micro-batch
        p.model.set_requires_gradient_sync(last)
    if s.master and s.reduced_accum:  # the last micro-batch's gradients go to the comm hook as they are
        p.opt.optimizer.reduce_next_backward(last)
    with acc.no_sync(p.model) if not last and not s.sharded else nullcontext():
        with torch.autocast(acc.device.type, dtype=torch.bfloat16, enabled=s.bf16):
            h = p.model(batch["hidden"], batch["input_ids"], batch["position_ids"], a_BA, keep_BA, p.embed, masks,
                        s.attn, scored_only=True, out_dtype=p.head.dtype)  # slots 1..L-1: the scored ones
        out = block_ce_loss(h, p.head, batch["labels"], gamma=cfg.gamma or None, weighting=cfg.weighting,
                            chunk_tokens=cfg.loss_chunk_tokens, normalizer=norm, epilogue=s.epilogue,
                            logits=cfg.loss_logits)
        if p.raw.candidate_selector is not None:  # DFlash2: + the selector's CE (dflash2.selector_ce_loss)
            from dflash_offline.dflash2 import selector_ce_loss

            sel = selector_ce_loss(p.raw.candidate_selector, h, p.head, batch["labels"], batch["input_ids"], a_BA,
                                   gamma=cfg.gamma or None, normalizer=norm, chunk_tokens=cfg.loss_chunk_tokens)
            out = out._replace(loss=out.loss + cfg.selector_weight * sel.loss)
        acc.backward(out.loss)
    return out, (sel, batch["labels"], norm) if p.raw.candidate_selector is not None else None


def check_same_projection(start: Path, run_dir: Path, now: dict | None) -> None:
    """A resumed run must read the projected taps it started on: the checkpoint it resumes from records its cache's
    P, and a cache extracted again in place keeps its key (dims, rows) but not its P. (The checkpoint, not
    RUN/config.json: rank 0 rewrites that one as the run starts, and a machine may hold only the checkpoints.)"""
    before = json.loads((start / "meta.json").read_text())["config"].get("projection")
    if (before or {}).get("sha256") != (now or {}).get("sha256"):
        def what(p):
            return f"projection {p['sha256'][:12]}…" if p else "full states"

        raise ValueError(f"{run_dir} trained on {what(before)} and its cache now holds {what(now)} (extracted again "
                         f"since?): resuming would continue fc' on another basis; restore the cache the run started "
                         f"on (RUN/projection.safetensors holds its P), or start a new RUN=")


def micro_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7919 + 12345) % (2**63 - 1)


def optimizer_step(cfg: TrainConfig, s: TrainSetup, acc, p: Parts):
    """Clip, update, schedule, zero; returns the global gradient norm before clipping. A step whose norm is not
    finite is skipped (weights, moments and step counts unchanged) and counted, as MasterAdamW does: on CUDA by the
    fused AdamW's `found_inf` (no host sync), on a CPU by looking."""
    if s.master:
        grad_norm = p.opt.optimizer.step()  # clips and skips inside; the global norm before clipping
    else:
        grad_norm = plain_step(cfg, s, acc, p)
    p.sched.step()
    p.opt.zero_grad(set_to_none=True)
    return grad_norm


def plain_step(cfg: TrainConfig, s: TrainSetup, acc, p: Parts):
    """torch's AdamW after clipping (the norm computed also without clipping), skipping a non-finite step."""
    import torch

    grad_norm = acc.clip_grad_norm_(p.model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
        grad_norm = grad_norm.full_tensor()
    bad = (~torch.isfinite(grad_norm)).float()
    p.skipped.add_(bad)
    inner = p.opt.optimizer
    if inner.defaults.get("fused") and not s.sharded:  # (FSDP's DTensor parameters: not tried with found_inf)
        inner.found_inf = bad
        try:
            p.opt.step()
        finally:
            del inner.found_inf
    elif grad_norm.device.type == "cuda" or not bad.item():  # FSDP on CUDA: counted, not skipped (a host sync)
        p.opt.step()
    return grad_norm


def save(cfg: TrainConfig, s: TrainSetup, acc, p: Parts, run_dir: Path, step: int, stream,
         projection: dict | None = None) -> None:
    from dflash_offline.checkpoint import gather_full_state, save_checkpoint

    if s.overlap:
        p.opt.optimizer.wait_all()  # the weights the checkpoint reads are the updated ones
    acc.wait_for_everyone()
    states = gather_full_state(p.raw, p.opt) if s.sharded else None  # a collective: every rank
    if acc.process_index == 0:
        save_checkpoint(run_dir, step, p.raw, p.opt, p.sched, data_state=stream.state_dict(),
                        config={"train": as_dict(cfg), "drafter": as_dict(p.raw.cfg),
                                **({"projection": projection} if projection else {})}, keep_last=cfg.keep_last,
                        states=states)
    acc.wait_for_everyone()


def main(argv: list[str]) -> int:
    from dflash_offline.progress import private_compile_caches, unbuffered

    private_compile_caches()  # before anything compiles: per-rank caches, no autotuner races between processes
    unbuffered()
    (cfg,) = configs_from_argv([(TrainConfig, "train")], argv, __doc__)
    code = 0
    try:
        out = run(cfg)
        if int(os.environ.get("RANK", 0)) == 0:
            print(out)
    except Interrupted as e:  # one line, no traceback; 128 + the signal
        if int(os.environ.get("RANK", 0)) == 0:
            print(e.line, file=sys.stderr)
        code = e.code
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # everything is written and closed: end now, so that no destructor of a still-live distributed object
        # (the process group, kept by anything that outlived the run) can hang the exit at interpreter shutdown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    from dflash_offline.progress import run_cli

    run_cli(main)
