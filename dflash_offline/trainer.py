"""The training loop of stage 2 as one object: what the loop drives, built once, stepped until the run's end.

`Trainer` holds what a step needs — the settings (`TrainConfig` and what they mean here, `trainsetup.TrainSetup`),
the accelerator, the model as trained (DDP-wrapped or FSDP-sharded) and as a plain module (saving, masks), the
optimizer and schedule, the target's frozen embedding and lm_head, the hidden-state stream — and its methods are
the loop's pieces: `train_step` (the step's micro-batches drawn first, then forward + backward each, then the
update), `save` (a checkpoint), `stop` (a signal's checkpoint and `runguard.Interrupted`), `run` (the loop, its
metric windows, checkpoints and stop vote). `trainrun.run` checks the inputs, owns the run directory, builds
the model and hands it here (torchtitan's `Trainer`, without callbacks).

Fixed shapes everywhere: B rows per micro-batch, A anchors per row (padded with a keep mask, resampled every step),
so the compiled step sees one shape; after the warm-up step any recompile is an error. Each row's anchors and noise
come from a generator seeded by (seed, the row's place in the run's sequence of rows: `next_micro`), so resumed,
1-process and N-process runs see the same anchors for the same rows. Each micro-batch's loss is divided by the
step's loss weight over all its micro-batches and processes (`loss.step_normalizer`).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from pathlib import Path

from dflash_offline.config import as_dict
from dflash_offline.runguard import Interrupted, StopVote
from dflash_offline.trainsetup import TrainConfig, TrainSetup, cosine_schedule, end_warm_up


class Trainer:
    """The model, optimizer, schedule and stream of one run on this process, and the loop that steps them."""

    def __init__(self, cfg: TrainConfig, s: TrainSetup, acc, model, embed, head, info, run_dir: Path,
                 projection: dict | None = None):
        """`model`: the plain drafter on its device (fp8-converted where it trains in fp8); `embed`, `head`: the
        target's, frozen; `info`: the cache the stream reads; `projection`: its P's record, kept in checkpoints."""
        from dflash_offline.dataset import HiddenStream

        self.cfg, self.s, self.acc, self.run_dir, self.projection = cfg, s, acc, Path(run_dir), projection
        self.embed, self.head = embed, head  # the target's frozen embedding and lm_head
        self.step = 0  # optimizer steps done
        self.saved_step = None  # the step of the newest checkpoint this run wrote or resumed from
        self.step_data = None  # the stream's position while the step in flight draws its batches (`train_step`)
        self.ended = None  # how the status file was closed: "done", "interrupted", "failed" (None: not yet)
        self.progress = self.meter = None  # the loop's (`run`)
        self.warm_marks: dict | None = None  # (the warm-up step's seconds by part: `_warm_mark`)
        self.held_said = False  # (a resident cache's read said: `_log_held_read`)
        self._build_optimizer(model)  # after sharding when FSDP is on: it must hold the sharded parameters
        compile_model(self.raw, s)
        self.stream = HiddenStream(info, cfg.schedule.batch_rows, rank=acc.process_index, world_size=s.world,
                                   seed=cfg.seed, device=acc.device, resident=s.resident,
                                   reader_threads=s.reader_threads)

    # --- model and optimizer -----------------------------------------------------------------------------------

    def _build_optimizer(self, model) -> None:
        """Shard (FSDP) or wrap (DDP) the model and build its optimizer and schedule through accelerate."""
        import torch

        from dflash_offline.progress import log

        cfg, s, acc = self.cfg, self.s, self.acc
        if cfg.compute.fsdp and not s.sharded and acc.process_index == 0:
            log("fsdp=1 with one process: nothing to shard, training unsharded")
        if s.sharded:  # FSDP2, one unit per decoder layer + the rest
            shard(model)
        opt = new_optimizer(cfg, s, model, acc.device)
        lr_at = lambda step: cosine_schedule(step, s.warmup, s.steps, cfg.optim.min_lr_ratio)  # noqa: E731
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        if s.sharded:  # the sharded model never goes through accelerate (it would wrap it in DDP)
            opt, sched = acc.prepare(opt, sched)
        else:
            model, opt, sched = acc.prepare(model, opt, sched)
        self.model, self.opt, self.sched, self.raw = model, opt, sched, acc.unwrap_model(model)
        if s.master and s.world > 1:  # DDP: reduce the bf16 gradients in fp32 (as the fp32-weight path does) ...
            from dflash_offline.optim import fp32_allreduce_hook

            # (with accumulation, together with the fp32 sums of the earlier micro-batches)
            model.register_comm_hook(opt.optimizer if s.accum > 1 else None, fp32_allreduce_hook)
            opt.optimizer.broadcast_masters(0)  # ... and start every rank from rank 0's fp32 weights, as DDP does
        # steps skipped for a non-finite gradient norm (a device tensor; MasterAdamW keeps its own)
        self.skipped = None if s.master else torch.zeros((), dtype=torch.float32, device=acc.device)

    @property
    def skipped_steps(self):
        return self.opt.optimizer.skipped if self.s.master else self.skipped

    def resume(self, start: Path | None) -> None:
        """Load checkpoint `start` (verified by `checkpoint.resume_point`) into the model, optimizer, schedule and
        stream; None: a fresh start (said so when --resume=1 found no complete checkpoint)."""
        from dflash_offline.checkpoint import load_checkpoint
        from dflash_offline.progress import log

        rank = self.acc.process_index
        if start is None:
            if self.cfg.resume:  # killed before its first checkpoint was whole: nothing to continue, it starts over
                log(f"[rank {rank}] {self.run_dir} holds no complete checkpoint: starting at step 0")
            return
        state = load_checkpoint(self.run_dir, self.raw, self.opt, self.sched, step=int(start.name.split("-")[1]),
                                sharded=self.s.sharded, verify=False)  # (verified by resume_point)
        self.stream.load_state_dict(state["data_state"])
        self.step = self.saved_step = state["step"]
        log(f"[rank {rank}] resumed {self.run_dir} at step {self.step} ({state['dir'].name})")

    # --- the loop ----------------------------------------------------------------------------------------------

    def run(self, seq_len: int, t0: float, stopper=None) -> None:
        """Step to the run's end: metric windows every log_every steps, a checkpoint every ckpt_every and at the end;
        a stop signal (`stopper`: a `runguard.StopSignals`) ends the run after the step in flight, every process at
        the same step. The stream is closed however it ends (a failed step too: its queued reads dropped), and a
        failure marks the status file `failed`; a shard that fails its read check first gets a checkpoint of the
        last finished step (`read_failed`)."""
        from dflash_offline.cache.shards import ShardError

        try:
            self._loop(seq_len, t0, stopper)
        except ShardError as e:
            raise self.read_failed(e) from None
        except BaseException as e:  # (a stop, `Interrupted`, has closed it already)
            if self.progress is not None and self.ended is None:
                self._close_progress("interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
            raise
        finally:
            self.stream.close()

    def _loop(self, seq_len: int, t0: float, stopper) -> None:
        from dflash_offline.metrics import start_profiler, write_profile

        cfg, s, cuda = self.cfg, self.s, self.acc.device.type == "cuda"
        self._start(seq_len, t0)
        warm_step, vote, profiler = self.step + 1, StopVote(self.acc), None  # the first step compiles (resumed too)
        self.warm_marks = {} if s.compile else None  # (the first step's seconds by part, for the warm-up's line)
        while self.step < s.steps:
            if cfg.compute.profile_steps and self.acc.process_index == 0 and profiler is None \
                    and self.step == max(2, s.steps - cfg.compute.profile_steps):  # the last steps, after warm-up
                profiler, profile_end = start_profiler(cuda), self.step + cfg.compute.profile_steps
            grad_norm = self.train_step()
            if profiler is not None and self.step == profile_end:
                write_profile(profiler, self.run_dir / "profile.txt", cuda, cfg.compute.profile_steps)
                profiler = None
            if self.step == warm_step:
                end_warm_up(s.compile)  # freeze the heap built so far; with compilation, a recompile is now an error
                self.meter.warmed_up(s.compile, self.warm_marks)
                self.warm_marks = None
            saved = self._after_step(grad_norm)
            if stopper is not None and (signum := vote(stopper.requested)):  # (every process at the same step)
                self.stop(signum, saved=saved)
        self._finish(t0)

    def _start(self, seq_len: int, t0: float) -> None:
        from dflash_offline.metrics import Meter, flops_per_row
        from dflash_offline.progress import Progress, log

        rank, dc = self.acc.process_index, self.raw.cfg
        self.progress = Progress("train", self.s.steps, "step", self.run_dir / f"status-rank{rank}.json",
                                 disable=rank != 0 or None)
        self.progress.update(self.step)
        self.meter = Meter(self.run_dir, self.acc, self.progress, self.step, seq_len,
                           flops_per_row(dc, seq_len, self.cfg.loss.num_anchors))
        kept = "; the cache's rows still on the device from the last training: none read" if self.stream.rows_kept else ""
        log(f"[rank {rank}] ready in {time.time() - t0:.1f}s{kept}{'; first step compiles' if self.s.compile else ''}")

    def _after_step(self, grad_norm) -> bool:
        """The step's metrics; a window's end at a log step or a checkpoint, the checkpoint. Returns: saved."""
        sch, s = self.cfg.schedule, self.s
        self.meter.step(sch.batch_rows * s.accum * s.world, grad_norm)  # (reads the last window's report)
        last = self.step == s.steps
        checkpoint = self.step % sch.ckpt_every == 0 or (last and s.final_checkpoint)
        if self.step % sch.log_every == 0 or checkpoint or last:  # a window also ends at a checkpoint (its time is not
            read_now = checkpoint or last  # training) and at the end; its record is then read at once
            self.meter.end_window(self.step, self.sched.get_last_lr()[0], self.skipped_steps, read_now=read_now)
        if checkpoint:
            self.save()
            self.meter.restart()  # the window starts after the checkpoint
        return checkpoint

    def _finish(self, t0: float) -> None:
        from dflash_offline.checkpoint import find_checkpoint, list_checkpoints
        from dflash_offline.progress import log

        self.stream.close()
        self._close_progress("done")
        self.meter.close()
        if self.acc.process_index == 0:
            saved = self.s.final_checkpoint or list_checkpoints(self.run_dir)  # (a bench run may have none)
            log(self.meter.summary(time.time() - t0, find_checkpoint(self.run_dir) if saved else "none"))
        for tracker in self.acc.trackers:  # `acc.end_training()` without its process-group destruction: see `run`
            tracker.finish()

    def stop(self, signum: int, saved: bool) -> None:
        """A stop signal: a checkpoint of this step (unless just written), the status file says `interrupted`, and
        `Interrupted` carries the run's one line and exit status up to `main`."""
        import signal

        from dflash_offline.checkpoint import step_dir

        # a bench run's last step writes no checkpoint, stopped or not (its window is recorded already)
        bench_end = self.step == self.s.steps and not self.s.final_checkpoint and not saved
        if not saved and not bench_end:  # as at a checkpoint: the window ends here, its record written before the save
            if self.meter.window.steps:  # (a resume starts after this step: a record pending or unended would be lost)
                self.meter.end_window(self.step, self.sched.get_last_lr()[0], self.skipped_steps)
            self.meter.read()
            self.save()
        self._close_progress("interrupted")
        self.meter.close()
        name, step = signal.Signals(signum).name, self.step
        where = ("its steps all done, no checkpoint (a bench run)" if bench_end else
                 f"checkpoint {step_dir(self.run_dir, step)}; continue with --resume=1 (make RESUME=1)")
        raise Interrupted(signum, f"stopped on {name} at step {step} of {self.s.steps}: {where}; exit status "
                                  f"{128 + signum}")

    def read_failed(self, e):
        """A shard failed its read check while a step drew its batches (`HiddenStream` raises `ShardError` before
        handing the batch out; the step draws all its micro-batches before any forward, so nothing of it has been
        computed or accumulated): a checkpoint of the last finished step — its data position the step's first batch
        (`step_data`), so a resume re-reads the failed batch and continues as an uninterrupted run would — unless
        that step is checkpointed already or is step 0; the status file says `failed`. Returns the `ShardError` to
        raise: its line, plus the checkpoint and how to continue once the shard is redone.

        One process only: with several, the others do not know this one failed (they are in the step's forward,
        waiting for it in its collectives), and a save is a collective they would not join; this process ends
        without a checkpoint and the launcher stops the others: the run continues from its last checkpoint."""
        from dflash_offline.cache.shards import ShardError
        from dflash_offline.checkpoint import step_dir

        step, s = self.step, self.s
        if self.meter is None:  # (before the loop started: nothing done)
            if self.progress is not None:
                self._close_progress("failed")
            return e
        if s.world == 1 and step and step != self.saved_step and self.step_data is not None:
            try:  # as a stop does: the window ends here, its record written before the save
                if self.meter.window.steps:
                    self.meter.end_window(step, self.sched.get_last_lr()[0], self.skipped_steps)
                self.meter.read()
                self.save(data_state=self.step_data)
            except Exception:
                self._close_progress("failed")
                raise
        self._close_progress("failed")
        self.meter.close()
        if self.saved_step == step:
            where = f"checkpoint step {step} ({step_dir(self.run_dir, step)})"
        else:  # several processes (or step 0): the last checkpoint, if any, is where it continues
            where = (f"last checkpoint step {self.saved_step} ({step_dir(self.run_dir, self.saved_step)})"
                     if self.saved_step is not None else "no checkpoint yet (a resume starts at step 0)")
            if s.world > 1 and step:
                where += f"; with {s.world} processes none is written on a failed read"
        return ShardError(f"{e} — training stopped after step {step} of {s.steps}, {where}: once the shard is "
                          f"redone, `make train RESUME=1` (--resume=1, the same RUN=) continues from there")

    def _close_progress(self, state: str) -> None:
        self.ended = state
        self.progress.close(state)

    # --- one step ----------------------------------------------------------------------------------------------

    def train_step(self):
        """One optimizer step: its micro-batches drawn first (their blocks and the step's normalizer), forward and
        backward of each, the update. Returns the global gradient norm before clipping."""
        from dflash_offline.loss import loss_weight, step_normalizer

        cfg, s = self.cfg, self.s
        mark = self._warm_mark
        self.step_data = self.stream.state_dict()  # (a failed read: `read_failed` checkpoints this position)
        micros = [next_micro(cfg, s, self.acc, self.stream, self.step * s.accum + m, self.raw.cfg)
                  for m in range(s.accum)]
        self.step_data = None  # (drawn: from here on a failure is not a failed read)
        if self.stream.held_read is not None and not self.held_said:
            self._log_held_read()
        mark("batches")
        norm = step_normalizer([loss_weight(b["labels"], cfg.loss.gamma or None, cfg.loss.weighting) for b, _ in micros],
                               s.world)
        for m, (batch, wait_s) in enumerate(micros):
            out, sel = self.micro_batch(batch, norm, last=m == s.accum - 1)
            self.meter.add(out, batch["keep"], wait_s, sel)
        mark("forward/backward")
        grad_norm = self.optimizer_step()
        mark("optimizer")
        self.step += 1
        return grad_norm

    def _log_held_read(self) -> None:
        """With the cache resident, once its first batch is drawn (a failing first step still says it): how long
        reading it onto the device took — allocating, the files read and checked, the copies — once a run: a first
        drafter's batches took 20 s of its warm-up on an H100 where a later read of the same cache took 3 s."""
        from dflash_offline.progress import log

        r, self.held_said = self.stream.held_read, True
        read = r["seconds"] - r["alloc_s"] - r["copy_s"]
        log(f"[rank {self.acc.process_index}] the cache read onto {self.acc.device}: {r['bytes'] / 1e9:.2f} GB in "
            f"{r['seconds']:.1f}s ({r['bytes'] / 1e9 / max(r['seconds'], 1e-9):.2f} GB/s; allocating "
            f"{r['alloc_s']:.1f}s, the files read and checked {read:.1f}s, copied {r['copy_s']:.1f}s; "
            f"{r.get('threads', 1)} thread(s))")

    def _warm_mark(self, part: str) -> None:
        """In the warm-up step only (compiling): the seconds since the last mark, the device's work done, as `part`
        (where the first step's time goes — compiling, loading kernels, a first batch — said by its line)."""
        if self.warm_marks is None:
            return
        import torch

        if self.acc.device.type == "cuda":
            torch.cuda.synchronize(self.acc.device)
        now = time.time()
        self.warm_marks[part] = now - self.warm_marks.pop("_t", self.meter.t_loop)
        self.warm_marks["_t"] = now

    def micro_batch(self, batch: dict, norm, last: bool):
        """Forward and backward of a `next_micro` batch (`last`: the step's last), its loss divided by `norm`, the
        step's (`loss.step_normalizer`): the loss returned is its share of the step's loss (see `metrics.Meter.add`).
        Returns (that loss output, the selector's `dflash2.SelectorLoss` with its `norm` — DFlash2 — or None)."""
        import torch

        from dflash_offline.loss import block_ce_loss

        cfg, s, acc, raw = self.cfg, self.s, self.acc, self.raw
        a_BA, keep_BA = batch["anchors"], batch["keep"]
        masks = raw.build_masks(batch["doc_ids"], a_BA, keep_BA, s.attn)
        if s.sharded:  # reduce-scatter the gradients once, on the last micro-batch
            self.model.set_requires_gradient_sync(last)
        if s.master and s.reduced_accum:  # the last micro-batch's gradients go to the comm hook as they are
            self.opt.optimizer.reduce_next_backward(last)
        with acc.no_sync(self.model) if not last and not s.sharded else nullcontext():
            with torch.autocast(acc.device.type, dtype=torch.bfloat16, enabled=s.bf16):
                h = self.model(batch["hidden"], batch["input_ids"], batch["position_ids"], a_BA, keep_BA, self.embed,
                               masks, s.attn, scored_only=True, out_dtype=self.head.dtype)  # slots 1..L-1: scored
            out = block_ce_loss(h, self.head, batch["labels"], gamma=cfg.loss.gamma or None,
                                weighting=cfg.loss.weighting, dpace_alpha=cfg.loss.dpace_alpha,
                                chunk_tokens=cfg.loss.loss_chunk_tokens,
                                normalizer=norm, epilogue=s.epilogue, logits=cfg.loss.loss_logits)
            sel = self._selector_loss(h, batch, norm, out.weights_BAL)
            if sel is not None:
                out = out._replace(loss=out.loss + cfg.loss.selector_weight * sel.loss)
            acc.backward(out.loss)
        return out, (sel, batch["labels"], norm) if sel is not None else None

    def _selector_loss(self, h, batch: dict, norm, slot_w_BAL):
        """DFlash2: the candidate selector's CE (`dflash2.selector_ce_loss`), its slots weighed as the block CE
        weighed them (`slot_w_BAL`) under the same normalizer; None for a DFlash drafter."""
        if self.raw.candidate_selector is None:
            return None
        from dflash_offline.dflash2 import selector_ce_loss

        return selector_ce_loss(self.raw.candidate_selector, h, self.head, batch["labels"], batch["input_ids"],
                                batch["anchors"], gamma=self.cfg.loss.gamma or None, normalizer=norm,
                                chunk_tokens=self.cfg.loss.loss_chunk_tokens, weighting=self.cfg.loss.weighting,
                                slot_w_BAL=slot_w_BAL)

    def optimizer_step(self):
        """Clip, update, schedule, zero; returns the global gradient norm before clipping. A step whose norm is not
        finite is skipped (weights, moments and step counts unchanged) and counted, as MasterAdamW does: on CUDA by
        the fused AdamW's `found_inf` (no host sync), on a CPU by looking."""
        if self.s.master:
            grad_norm = self.opt.optimizer.step()  # clips and skips inside; the global norm before clipping
        else:
            grad_norm = self._plain_step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return grad_norm

    def _plain_step(self):
        """torch's AdamW after clipping (the norm computed also without clipping), skipping a non-finite step."""
        import torch

        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
            grad_norm = grad_norm.full_tensor()
        bad = (~torch.isfinite(grad_norm)).float()
        self.skipped.add_(bad)
        inner = self.opt.optimizer
        if inner.defaults.get("fused") and not self.s.sharded:  # (FSDP's DTensor parameters: not tried with found_inf)
            inner.found_inf = bad
            try:
                self.opt.step()
            finally:
                del inner.found_inf
        elif grad_norm.device.type == "cuda" or not bad.item():  # FSDP on CUDA: counted, not skipped (a host sync)
            self.opt.step()
        return grad_norm

    def save(self, data_state: dict | None = None) -> None:
        """A checkpoint of this step (every process takes part; rank 0 writes); `data_state`: the stream's position
        to record, if not its current one."""
        from dflash_offline.checkpoint import gather_full_state, save_checkpoint

        acc, raw = self.acc, self.raw
        acc.wait_for_everyone()
        states = gather_full_state(raw, self.opt) if self.s.sharded else None  # a collective: every rank
        if acc.process_index == 0:
            config = {"train": as_dict(self.cfg), "drafter": as_dict(raw.cfg),
                      **({"projection": self.projection} if self.projection else {})}
            save_checkpoint(self.run_dir, self.step, raw, self.opt, self.sched,
                            data_state=data_state or self.stream.state_dict(), config=config,
                            keep_last=self.cfg.schedule.keep_last, states=states)
        acc.wait_for_everyone()
        self.saved_step = self.step


# --- the pieces ------------------------------------------------------------------------------------------------


def shard(model) -> None:
    """FSDP2: one unit per decoder layer + the rest."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)


def new_optimizer(cfg: TrainConfig, s: TrainSetup, model, device):
    """MasterAdamW (bf16 matmul weights; fp32 masters, clipping and AdamW in one fused pass) or torch's AdamW."""
    import torch

    from dflash_offline.optim import MasterAdamW

    if s.master:
        o = cfg.optim
        opt = MasterAdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                          max_grad_norm=o.grad_clip, low_dtype=torch.bfloat16)
        if s.accum > 1:
            opt.accumulate_in_fp32()
        return opt
    o = cfg.optim
    return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                             fused=device.type == "cuda")


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
    batch["anchors"], batch["keep"], batch["labels"] = sample_blocks(batch, cfg.loss.num_anchors, dc.block_size, g)
    if cfg.loss.noise_std > 0:
        hidden = batch["hidden"]
        rms = hidden.float().pow(2).mean(-1, keepdim=True).sqrt()
        noise = random_rows(torch.randn, hidden.shape, g, acc.device)
        batch["hidden"] = (hidden.float() + cfg.loss.noise_std * rms * noise).to(hidden.dtype)
    return batch, wait_s


def micro_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7919 + 12345) % (2**63 - 1)


def check_same_drafter(start: Path, run_dir: Path, dc) -> None:
    """A resumed run must train the drafter it started: every setting its checkpoint records (`DrafterConfig`: the
    shape, DFlash2's conv and selector settings, the attention layout) equal to this run's. A setting that changes no
    tensor shape (selector_top_k, layer_types, ...) would otherwise continue silently and be exported with the new
    value. A field the checkpoint predates takes its default (as the run that wrote it did)."""
    import dataclasses

    recorded = json.loads((start / "meta.json").read_text())["config"]["drafter"]
    names = {f.name for f in dataclasses.fields(dc)}

    def as_json(c):  # (as meta.json holds it: lists, floats)
        return json.loads(json.dumps(as_dict(c)))

    then, now = as_json(type(dc)(**{k: v for k, v in recorded.items() if k in names})), as_json(dc)
    differ = [k for k in now if then[k] != now[k]]
    if differ:
        was = ", ".join(f"{k}={then[k]!r}" for k in differ)
        raise ValueError(f"{run_dir} trained a drafter with {was} ({start.name}) and this run asks for "
                         f"{', '.join(f'{k}={now[k]!r}' for k in differ)}: resume with the settings, cache and target "
                         f"it started with ({run_dir / 'config.json'} records them; make train RESUME=1 without RECIPE= "
                         f"takes its settings from there) or start a new RUN=")


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
