"""What a training run measures, and where the measurements go.

A *window* is the steps between two log lines. `Window` accumulates a window's loss, per-slot accuracy and block τ
on the device (no host sync per step); `Window.report` reduces them over the processes and starts their copy to the
host; `Report.result` reads them once the next step is queued, so the device never idles for a log line. On CUDA a
window is timed by events on the compute stream (device time from the previous window's end to its own), so the
windows tile the run whatever the moment the host reads them. `Meter` drives the windows of a run and sends each
finished record to metrics.jsonl, the trackers, the progress bar and the log, and ends the run with one summary
line. Also here: the model FLOPs of a row (for the FLOP fraction), time spent in Python's GC and whether a run may
freeze its heap, the compiled-graph counter behind `recompiles`, and the profiler of the last steps.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

H200_DENSE_BF16 = 790e12  # FLOP/s the `flop_frac` metric divides by


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

@functools.cache
def interpreter_frozen() -> int:
    """The objects the interpreter itself keeps in gc.freeze's permanent generation: none on CPython 3.11 and 3.13;
    on 3.12 its static tuples (375 on 3.12.1), which every full collection puts back there. Counted in a fresh,
    isolated interpreter of the same executable, so that nothing this process or its caller froze is mistaken for
    them (once per process)."""
    out = subprocess.run([sys.executable, "-I", "-c", "import gc; gc.collect(); print(gc.get_freeze_count())"],
                         capture_output=True, text=True, timeout=60)
    return int(out.stdout) if out.returncode == 0 and out.stdout.strip().isdigit() else 0


def only_interpreter_frozen() -> bool:
    """Whether no caller has frozen a heap (gc.freeze): a run may then freeze its own after warm-up and unfreeze the
    permanent generation when it ends — the interpreter's objects with it, as CPython's own test of gc.freeze does.
    Where a caller froze, a run does neither and leaves the caller's objects as they are."""
    return gc.get_freeze_count() <= interpreter_frozen()


def compiled_graphs() -> int:
    """Graphs torch.compile has produced in this process so far (new frames and recompiles alike)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# torch.compile's phases as its own timers name them (seconds summed over this process's compiles; they nest):
# Dynamo tracing the Python, AOTAutograd building the joint graph and compiling the forward (a hit of its cache skips
# both), Inductor compiling a backward, loading compiled modules, and waiting for kernels compiled in parallel
COMPILE_PHASES = {"Dynamo": "bytecode_tracing", "AOTAutograd": "create_aot_dispatcher_function",
                  "backward": "compile_fx.<locals>.bw_compiler", "loading": "PyCodeCache.load_by_key_path",
                  "kernels": "async_compile.wait"}


def compile_state() -> dict[str, float]:
    """torch.compile's record in this process so far: hits and misses of Inductor's FX graph cache (a graph found
    there skips Inductor's lowering and its kernels' compilation: what a warm cache saves, 41 s → 6 s for the CPU
    test's drafter) and of AOTAutograd's cache (a hit also skips building the joint graph; a bypass: a graph it
    cannot cache), and the seconds of each of `COMPILE_PHASES`."""
    from torch._dynamo.utils import compile_times, counters

    try:
        names, secs = compile_times(repr="csv", aggregate=True)
        spent = dict(zip(names, map(float, secs), strict=True))
    except (TypeError, ValueError):  # (another torch's format: the counts still tell hits from misses)
        spent = {}
    fx, aot = counters["inductor"], counters["aot_autograd"]
    return {"hits": fx["fxgraph_cache_hit"], "misses": fx["fxgraph_cache_miss"], "aot_hits": aot["autograd_cache_hit"],
            "aot_misses": aot["autograd_cache_miss"], "aot_bypasses": aot["autograd_cache_bypass"],
            **{k: spent.get(v, 0.0) for k, v in COMPILE_PHASES.items()}}


def describe_compile(since: dict[str, float]) -> str:
    """What compiling did since `since` (a `compile_state`), for the warm-up step's line."""
    d = {k: v - since.get(k, 0) for k, v in compile_state().items()}
    phases = ", ".join(f"{k} {d[k]:.0f}s" for k in COMPILE_PHASES if d[k] >= 1)
    return (f"Inductor's graph cache: {d['hits']:.0f} hits, {d['misses']:.0f} misses; AOTAutograd's: "
            f"{d['aot_hits']:.0f} hits, {d['aot_misses']:.0f} misses, {d['aot_bypasses']:.0f} bypassed"
            + (f"; {phases}" if phases else ""))


def flops_per_row(dc, seq_len: int, num_anchors: int) -> float:
    """Model FLOPs of one training row, forward + backward: the sum of `flop_terms`."""
    return sum(flop_terms(dc, seq_len, num_anchors).values())


def flop_terms(dc, seq_len: int, num_anchors: int) -> dict[str, float]:
    """A training row's FLOPs by part, as the training step computes them (2 a multiply-add; backward twice the
    forward where weights and inputs both take a gradient): `layers` the decoder layers' linears on the block tokens
    (DFlash skips slot 0 before the last MLP, DFlash2 after it: its convolution reads slot 0), `context` the fc (no
    input gradient: the cache's states) and each layer's context K/V, `attention` an estimate (the block's queries
    see about half the row), `head` the lm_head's logits and input gradient (it is frozen) at the scored slots; a
    DFlash2 drafter adds `dflash2_flop_terms`. Every term but `attention` and `conv` is every matmul the step runs
    (tests/test_train.py counts them with torch's FLOP counter)."""
    H, L, layers = dc.hidden_size, dc.block_size, dc.num_layers
    Q, n = num_anchors * L, num_anchors * (L - 1)  # block tokens, scored slots
    k, qd, kvd = len(dc.target_layer_ids), dc.num_heads * dc.head_dim, dc.num_kv_heads * dc.head_dim
    attn, mlp = H * (qd + 2 * kvd) + qd * H, 3 * H * dc.intermediate_size
    d2 = dc.variant == "dflash2"
    last_mlp = Q if d2 else n  # the tokens of the last layer's MLP
    terms = {"layers": 6 * (Q * (attn + mlp) * (layers - 1) + Q * attn + last_mlp * mlp),
             "context": 6 * seq_len * H * 2 * kvd * layers
                        + 4 * seq_len * k * (getattr(dc, "tap_width", 0) or H) * H,  # (projected: k × tap_width)
             "attention": 3 * 4 * Q * (seq_len / 2 + L) * qd * layers,  # ~half the row visible on average
             "head": 4 * n * H * dc.vocab_size}
    return {**terms, **dflash2_flop_terms(dc, Q, n)} if d2 else terms


def dflash2_flop_terms(dc, Q: int, n: int) -> dict[str, float]:
    """What DFlash2 adds to a row of `Q` block tokens and `n` scored slots (`dflash2`): `conv_projection` the
    dynamic taps (a Linear(H, 2·J·G) around every attention and MLP), `conv` the depthwise convolutions themselves
    (pre and post around each sublayer, J multiply-adds a channel; elementwise ops, counted as a depthwise conv is),
    `selector` its CE: the top-k search over the full vocabulary (logits without gradient), the candidates'
    logits (gathered lm_head rows, input gradient only), hidden_projection, and the pair scores against the gathered
    codebook rows (the codebooks are gathered, never multiplied in full)."""
    H, J, K, R = dc.hidden_size, dc.conv_kernel_size, dc.selector_top_k, dc.selector_rank
    convs = 2 * dc.num_layers  # one around each attention and each MLP
    return {"conv_projection": convs * 6 * Q * H * 2 * J * (H // dc.conv_group_size),
            "conv": convs * 2 * 6 * Q * J * H,
            "selector": 2 * n * H * dc.vocab_size + 4 * n * K * H + 6 * n * H * R + 6 * n * K * R}


# --- a window of steps -------------------------------------------------------------------------------------------


class Window:
    """Metrics accumulated between two log lines (reduced over processes when reported)."""

    def __init__(self, start=None, t0: float | None = None):
        self.t0 = time.time() if t0 is None else t0  # (off CUDA) wall clock from here to the end of the window
        # on CUDA, the window's time is device time between two events on the compute stream: from `start` (the
        # previous window's end, or `begin`) to its report's; it does not depend on when the host looks
        self.start = start
        self.gc0 = GC_CLOCK.total
        self.loss_sum, self.steps, self.rows, self.wait_s, self.grad_norm = 0.0, 0, 0, 0.0, 0.0
        self.correct_L = self.valid_L = None
        self.tau_sum, self.blocks = 0.0, 0
        self.selector = None  # DFlash2: [weighted CE sum, weight, right picks, labelled slots, labels among candidates]
        self.graphs0: int | None = None  # compiled graphs at the end of the warm-up step (None: not compiling)

    def begin(self, device) -> Window:
        """(Re)start the window's clocks now: after a checkpoint, or at the first step."""
        import torch

        self.t0, self.gc0 = time.time(), GC_CLOCK.total
        if device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        return self

    def add(self, out, keep_BA, selector=None) -> None:
        """A micro-batch's loss output (its `loss`: its share of its step's loss, see `Meter.add`) and keep mask; a
        DFlash2 run's also (its `dflash2.SelectorLoss`, the labels, the step's normalizer)."""
        import torch

        from dflash_offline.loss import block_tau

        if selector is not None:
            sel, labels_BAL, norm = selector
            labelled = (labels_BAL[:, :, 1:] >= 0).sum().float()
            s = torch.stack([(sel.loss * norm).detach().float(), sel.weight.float(), sel.correct_BAL.sum().float(),
                             labelled, sel.recall.float() * labelled])
            self.selector = s if self.selector is None else self.selector + s

        c, v = out.correct_BAL.sum((0, 1)).float(), out.valid_BAL.sum((0, 1)).float()
        self.correct_L = c if self.correct_L is None else self.correct_L + c
        self.valid_L = v if self.valid_L is None else self.valid_L + v
        self.loss_sum += out.loss.detach()
        self.tau_sum += (block_tau(out.correct_BAL) * keep_BA).sum().float()
        self.blocks += keep_BA.sum()

    def report(self, acc, step: int, lr: float, seq_len: int, fpr: float, device, skipped=None) -> Report:
        """Start this window's report: reduce its metrics over the processes and copy them to the host, without
        waiting for the device. `Report.result()` waits (for the copy only) and builds the record; called after the
        next step has been queued, the device never idles for it."""
        import torch

        t = torch.stack([torch.as_tensor(self.loss_sum, device=device, dtype=torch.float32),
                         torch.tensor(float(self.steps), device=device), torch.as_tensor(self.tau_sum, device=device).float(),
                         torch.as_tensor(self.blocks, device=device).float()])
        t = acc.reduce(t, "sum")
        cl, vl = acc.reduce(self.correct_L, "sum"), acc.reduce(self.valid_L, "sum")
        local = torch.stack([torch.as_tensor(self.grad_norm, device=device, dtype=torch.float32),
                             torch.as_tensor(0.0 if skipped is None else skipped, device=device, dtype=torch.float32)])
        sel = acc.reduce(self.selector, "sum") if self.selector is not None else cl.new_zeros(0)
        vals = torch.cat([t, local, cl.float(), vl.float(), sel.float()])
        host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=device.type == "cuda")
        host.copy_(vals, non_blocking=device.type == "cuda")
        done = None
        if device.type == "cuda":
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        return Report(self, host, done, step=step, lr=lr, seq_len=seq_len, fpr=fpr, device=device,
                      graphs=compiled_graphs(), skipped=skipped is not None, selector=sel.numel())


class Report:
    """A window's metrics on their way to the host (see `Window.report`)."""

    def __init__(self, window: Window, host, done, **kw):
        self.w, self.host, self.done, self.kw = window, host, done, kw
        # off CUDA the work is done when the report is made: the window ends now (on CUDA: at the `done` event)
        self.t_end = time.time()
        self.gc_end = GC_CLOCK.total  # (the next window counts the GC from here on: not both)

    def result(self) -> dict:
        from dflash_offline.loss import simulated_acceptance_length, slot_accuracy

        if self.done is not None:
            self.done.synchronize()  # the window's last step has run on the device
        now = time.time()
        w, k, v = self.w, self.kw, self.host
        loss_sum, rank_steps, tau_sum, blocks, grad_norm, skipped = v[:6].tolist()
        n_sel = k["selector"]
        L = (v.numel() - 6 - n_sel) // 2
        acc_L = slot_accuracy(v[6 : 6 + L], v[6 + L : 6 + 2 * L])
        secs = (w.start.elapsed_time(self.done) / 1000 if w.start is not None and self.done is not None
                else self.t_end - w.t0)
        secs = max(secs, 1e-9)
        cuda = k["device"].type == "cuda"
        rec = {
            "step": k["step"], "loss": loss_sum / rank_steps, "acc": [round(a, 4) for a in acc_L[1:].tolist()],
            "sim_tau": 1 + simulated_acceptance_length(acc_L).item(),
            "block_tau": tau_sum / max(blocks, 1.0), "lr": k["lr"], "grad_norm": grad_norm,
            "tok_per_s": w.rows * k["seq_len"] / secs, "ms_per_step": 1000 * secs / max(w.steps, 1),
            "flop_frac": w.rows * k["fpr"] / secs / H200_DENSE_BF16 if cuda else 0.0,
            "data_wait_frac": w.wait_s / secs, "time": now if self.done is not None else self.t_end,
            "gc_frac": (self.gc_end - w.gc0) / secs,  # the feeding thread stopped for garbage collection
            # graphs compiled after the warm-up step (a recompile after it also raises; 0 in a healthy run)
            "recompiles": k["graphs"] - w.graphs0 if w.graphs0 is not None else 0,
        }
        if n_sel:  # DFlash2's selector on the window's slots, each scored after its true predecessor
            wce, wsum, right, labelled, among = v[-n_sel:].tolist()
            rec["selector_ce"] = wce / max(wsum, 1e-12)  # its CE over the slots whose label is a candidate (weighted)
            rec["selector_acc"] = right / max(among, 1.0)  # its pick is the label, over those slots (× recall: over all)
            rec["selector_recall"] = among / max(labelled, 1.0)  # the label is among the top-k candidates
        if k["skipped"]:  # steps whose gradient norm was not finite: skipped, weights untouched
            rec["skipped_steps"] = int(skipped)
        if cuda:
            import torch

            rec["reserved_gb"] = torch.cuda.memory_reserved(k["device"]) / 2**30
            rec["peak_gb"] = torch.cuda.max_memory_allocated(k["device"]) / 2**30
        return rec


# --- where the records go ----------------------------------------------------------------------------------------


def available_trackers(spec: str) -> list[str]:
    """The accelerate trackers of a comma list ("none" = none) that are installed; a missing one is a warning."""
    out = []
    for name in (t for t in spec.split(",") if t and t != "none"):
        if importlib.util.find_spec({"tensorboard": "tensorboard", "wandb": "wandb"}.get(name, name)) is None:
            print(f"warning: tracker {name!r} is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
        else:
            out.append(name)
    return out


def open_metrics(run_dir: Path, first_step: int):
    """metrics.jsonl opened for appending, after cutting it back to the records of steps ≤ `first_step` (the step the
    run starts from): records a killed run wrote past its last checkpoint are dropped, as that run's steps are done
    again (rewritten atomically; a torn last line is dropped too)."""
    import json

    from dflash_offline.cache.fsio import write_text_atomic

    path = run_dir / "metrics.jsonl"
    if path.exists():
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= first_step:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                continue
        write_text_atomic(path, "".join(f"{line}\n" for line in keep))
    return open(path, "a")


class Meter:
    """The run's metrics as it goes: the open window, the report of the last one on its way to the host, and where
    finished records go (rank 0: metrics.jsonl, the trackers, the progress bar and a log line); at the end, the
    summary line. A window ends every `log_every` steps and at a checkpoint; its report is read once the next step
    has been queued (the device never idles for a log line), or at once before a checkpoint or the end."""

    def __init__(self, run_dir: Path, acc, progress, first_step: int, seq_len: int, fpr: float):
        self.acc, self.progress, self.device, self.seq_len, self.fpr = acc, progress, acc.device, seq_len, fpr
        self.rank0 = acc.process_index == 0
        self.file = open_metrics(run_dir, first_step) if self.rank0 else None  # closed by `close`
        self.window, self.pending = Window().begin(self.device), None
        self.graphs0: int | None = None  # compiled graphs at the end of the warm-up step (None: not compiling)
        self.first_step = self.last_step = first_step
        self.t_loop, self.graphs_start, self.cache_start = time.time(), compiled_graphs(), compile_state()
        self.windows, self.last = [], None  # windows: (steps, seconds, tokens); the last record

    def add(self, out, keep_BA, wait_s: float, selector=None) -> None:
        """A micro-batch's loss output, its keep mask, the time its batch kept the host waiting, and (DFlash2) its
        selector's (`Trainer.micro_batch`'s second value: records get selector_ce, _acc, _recall). Its loss is its
        share of the step's loss: the shares of a step's micro-batches on all processes sum to the step's loss times
        the number of processes (`loss.step_normalizer`), so the record's `loss` is the mean over the window's steps
        of each step's loss: its weighted CE over all its micro-batches and processes / their total loss weight."""
        self.window.add(out, keep_BA, selector)
        self.window.wait_s += wait_s

    def step(self, rows: int, grad_norm) -> None:
        """An optimizer step of `rows` rows (all processes) has been queued: count it, and read the last window's
        report, which the device has finished by the time it runs this step."""
        w = self.window
        w.graphs0, w.steps, w.rows = self.graphs0, w.steps + 1, w.rows + rows
        w.grad_norm = grad_norm.detach() if grad_norm is not None else 0.0  # no host sync per step
        self.progress.update(1, tokens=rows * self.seq_len)
        self.read()

    def end_window(self, step: int, lr: float, skipped=None, read_now: bool = False) -> None:
        """Close the window at `step`; the next one starts where it ends. `read_now`: before a checkpoint (its time
        is not training time) or the end."""
        self.pending = self.window.report(self.acc, step, lr, self.seq_len, self.fpr, self.device, skipped=skipped)
        self.window = Window(start=self.pending.done, t0=self.pending.t_end)
        if read_now:
            self.read()

    def warmed_up(self, compiling: bool, parts: dict | None = None) -> None:
        """After the first step: from here on, a compiled graph is a recompile (reported as `recompiles`). `parts`:
        the step's seconds by part (`Trainer._warm_mark`), said after the compile's record."""
        from dflash_offline.progress import log

        if compiling:
            self.graphs0 = compiled_graphs()
            split = ", ".join(f"{k} {v:.1f}s" for k, v in (parts or {}).items() if not k.startswith("_"))
            log(f"[rank {self.acc.process_index}] warm-up step compiled {self.graphs0 - self.graphs_start} graphs in "
                f"{time.time() - self.t_loop:.0f}s ({describe_compile(self.cache_start)})"
                + (f"; the step's parts: {split}" if split else ""))

    def restart(self) -> None:
        """Start the open window's clocks again (after a checkpoint)."""
        self.window.begin(self.device)

    def read(self) -> None:
        if self.pending is not None:
            self.emit(self.pending.result())
            self.pending = None

    def emit(self, rec: dict) -> None:
        from dflash_offline.progress import log

        steps, self.last_step = rec["step"] - self.last_step, rec["step"]
        secs = steps * rec["ms_per_step"] / 1000
        self.windows.append((steps, secs, rec["tok_per_s"] * secs))
        self.last = rec
        if not self.rank0:
            return
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        self.acc.log({k: v for k, v in rec.items() if isinstance(v, int | float)}, step=rec["step"])
        self.progress.extra.update(loss=rec["loss"], tau=rec["sim_tau"])
        log(f"step {rec['step']}: loss {rec['loss']:.4f} acc1 {rec['acc'][0]:.3f} sim τ {rec['sim_tau']:.2f} "
            f"{rec['tok_per_s']:,.0f} tok/s mfu {rec['flop_frac']:.3f} wait {rec['data_wait_frac']:.3f} "
            f"gc {rec['gc_frac']:.3f}")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def summary(self, wall_s: float, checkpoint) -> str:
        """The run's last line: steps and tokens of this invocation (all processes), wall time, tok/s over the
        steady windows (every window but the first, which holds the compilation, when there are several), the last
        window's loss and simulated τ, recompiles, peak memory, and the newest checkpoint."""
        steady = self.windows[1:] or self.windows
        secs = sum(s for _, s, _ in steady)
        parts = [f"train done: {self.last_step - self.first_step} steps ({self.first_step} → {self.last_step}), "
                 f"{self.progress.tokens:,} tokens in {wall_s:,.1f}s"]
        if secs > 0:
            parts.append(f"{sum(t for _, _, t in steady) / secs:,.0f} tok/s over {sum(n for n, _, _ in steady)} "
                         f"steady steps")
        if self.last is not None:
            parts.append(f"loss {self.last['loss']:.4f}, sim τ {self.last['sim_tau']:.2f}, recompiles "
                         f"{self.last['recompiles']}")
        parts.append(peak_memory(self.device))
        parts.append(f"checkpoint {checkpoint}")
        return "; ".join(parts)


def peak_memory(device) -> str:
    """'peak 43.4 GB allocated' on CUDA; the process's peak resident memory elsewhere."""
    if device.type == "cuda":
        import torch

        return f"peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GB allocated"
    import resource

    return f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GB"


# --- profiling the last steps ------------------------------------------------------------------------------------


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
