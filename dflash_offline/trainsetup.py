"""Training's settings, and what they mean on this machine: the settings derived from the config and the run's facts.

`TrainConfig` holds stage 2's settings: the run's own and, as groups declared beside the code that owns them, its
length, batch and cadence (`ScheduleSettings`, here), the drafter's (`drafter.DrafterSettings`), the loss's
(`loss.LossSettings`), the optimizer's (`optim.OptimSettings`) and the compute setup's (`ComputeSettings`, here); a
user names each by its own name (`config.compose`, `config.as_dict`).
`TrainConfig.resolve()` checks what the user typed; `resolve_train` turns it into what the run does, given what only
the run knows (CUDA or not, the number of processes, the cache's rows and their length): precision, attention,
compilation, the loss epilogue, gradient accumulation, FSDP sharding, master weights, the run's length (epochs →
steps) and warm-up. A setting this machine cannot honour is refused here, at start, before any weights load, naming
the setting and what to use instead. The result is logged and written into the run's config.json as its "derived"
block (`TrainSetup.derived`). Also derived here: what the cache says about the target (`cache_defaults`), the
drafter's shape (`drafter_config`), the learning-rate schedule; and `kept_process_state`, which puts back what a run
changes in its process (TF32, the recompile guard, GC state).

`BenchSwitches` hold a performance switch that measured within the run-to-run spread (docs/benchmarks.md), TF32: it
is not an option; the trainer runs without it and `bench.train` sets it for its A/B runs. One more is no
performance switch: `fp8_emulate` lets precision=fp8 run on the CPU (float8 casts, fp32 matmuls) for the tests and
`bench.train --tiny`; the trainer refuses fp8 without CUDA.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path

from dflash_offline.config import ConfigError, check_choice, flag
from dflash_offline.drafter import DrafterSettings
from dflash_offline.fp8 import RECIPE as FP8_RECIPE
from dflash_offline.loss import LossSettings
from dflash_offline.optim import OptimSettings


@dataclass
class ComputeSettings:
    """How the run computes (`train` settings; what they come to on a machine: `resolve_train`)."""

    fsdp: bool = False  # 1 = shard weights, gradients and AdamW state over the processes (FSDP2); 0 = replicate (DDP)
    precision: str = "auto"  # "bf16" (autocast), "fp32" or "fp8" (decoder linears + fc in float8 via torchao, bf16 elsewhere; CUDA only); auto = bf16 on CUDA, fp32 elsewhere
    master_weights: str = "auto"  # bf16: "on" = bf16 weights + fp32 masters, "off" = fp32; auto = on (off: FSDP, DDP+accum)
    attn: str = "auto"  # "flex" (compiled flex_attention; CUDA) or "dense" (SDPA reference); auto = flex on CUDA
    compile: str = "auto"  # "on" or "off"; auto = on with CUDA. After warm-up a recompile is an error
    profile_steps: int = 0  # > 0: profile the last that many steps (after warm-up) into RUN/profile.txt (rank 0)

    def resolve(self) -> ComputeSettings:
        check_choice("train.precision", self.precision, ("auto", "bf16", "fp32", "fp8"))
        check_choice("train.master_weights", self.master_weights, ("auto", "on", "off"))
        check_choice("train.attn", self.attn, ("auto", "flex", "dense"))
        check_choice("train.compile", self.compile, ("auto", "on", "off"))
        return self


@dataclass
class ScheduleSettings:
    """The run's length, batch and cadence (`train` settings; the optimizer steps they come to: `schedule`)."""

    steps: int = 1000  # optimizer steps (unused when epochs > 0)
    epochs: float = 0.0  # > 0: passes over the cache; sets steps = epochs × optimizer steps per epoch
    batch_rows: int = 1  # rows per micro-batch per process (fixed shape)
    global_batch_tokens: int = 0  # row tokens per optimizer step over all processes; 0 = one micro-batch each
    ckpt_every: int = 500  # checkpoint every N steps (and at the end)
    keep_last: int = 3  # checkpoints kept
    log_every: int = 10  # metrics line every N steps

    def resolve(self) -> ScheduleSettings:
        for name in ("steps", "batch_rows", "ckpt_every", "log_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name} must be > 0, got {getattr(self, name)}")
        if self.epochs < 0:
            raise ConfigError(f"train.epochs must be >= 0 (0 = run `steps` steps), got {self.epochs}")
        return self


@dataclass
class TrainConfig:
    """Stage 2's settings (the recipe's [train] table): the run's own, and the groups declared beside the code that
    owns them (flat everywhere a user meets them: `config.compose`, `config.as_dict`)."""

    cache: str  # hidden-state cache directory (the output of make extract)
    run: str = ""  # run directory (required; one trainer at a time, RUN/.run.lock): checkpoints, metrics, logs, config
    target: str = ""  # target checkpoint for the frozen embedding + lm_head; empty = the cache's target
    resume: bool = False  # continue the run in `run` from its latest checkpoint (exact data position and RNG)
    seed: int = 0  # data order, anchors, noise and init
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)  # length, batch, checkpoint and log cadence (here)
    drafter: DrafterSettings = field(default_factory=DrafterSettings)  # the drafter's shape (dflash_offline/drafter.py)
    loss: LossSettings = field(default_factory=LossSettings)  # the objective and its computation (dflash_offline/loss.py)
    optim: OptimSettings = field(default_factory=OptimSettings)  # AdamW and the learning-rate schedule (dflash_offline/optim.py)
    compute: ComputeSettings = field(default_factory=ComputeSettings)  # precision, attention, compilation, sharding (here)
    stop_grace_s: float = 25.0  # on SIGTERM/SIGINT: seconds to finish the step and write a checkpoint (exit 143/130); under torchrun and Slurm's default KillWait, SIGKILL follows after 30 s
    trackers: str = "tensorboard"  # accelerate trackers ("tensorboard", "wandb", comma list; "none" = JSONL only)
    require_verified: bool = False  # refuse a cache never verified (a cache that failed verify is always refused)

    @classmethod
    def of(cls, **settings) -> TrainConfig:
        """A TrainConfig from flat settings (`TrainConfig.of(cache=..., lr=3e-3, num_layers=2)`), not resolved."""
        from dflash_offline.config import compose

        return compose(cls, settings)

    def resolve(self) -> TrainConfig:
        """Each group checks its own settings; what spans groups, and the run's own, is checked here."""
        for group in (self.schedule, self.drafter, self.loss, self.optim, self.compute):
            group.resolve()
        d, lo = self.drafter, self.loss
        if d.variant == "dflash2" and (self.compute.fsdp or not lo.selector_weight >= 0):
            raise ConfigError(f"train.variant=dflash2 trains with fsdp=0 (got {int(self.compute.fsdp)}; its selector "
                              f"runs outside the sharded forward) and selector_weight >= 0 (got {lo.selector_weight})")
        if lo.gamma == 0 and d.block_size not in (8, 16) and lo.weighting == "decay":
            raise ConfigError(f"train.gamma: no default for block_size {d.block_size}; set gamma explicitly")
        return self


STEPS_DEFAULT = ScheduleSettings.steps


@dataclass(frozen=True)
class BenchSwitches:
    tf32: bool = False  # CUDA: TF32 tensor cores for fp32 matmuls (in bf16 runs: the dense block part of attn=flex)
    fp8_emulate: bool = False  # precision=fp8 without CUDA: float8 casts with fp32 matmuls (tests, CPU smoke runs)
    resident: bool = False  # the whole cache read once onto the device, batches gathered there (`HiddenStream`)
    reader_threads: int = 1  # threads reading the next batches at once (`HiddenStream`; one = the trainer's reader)
    final_checkpoint: bool = True  # the last step saves a checkpoint (bench.train: off; ≈ 25 GB at the 27B shapes)


@dataclass(frozen=True)
class TrainSetup:
    world: int  # processes
    precision: str  # "bf16" (autocast), "fp32" or "fp8" (a bf16 run whose linears compute in float8: `fp8.convert`)
    attn: str  # "flex" or "dense"
    compile: bool  # decoder layers, context projection and output norm compiled
    epilogue: str  # loss epilogue: "triton", "compiled" or "eager"
    tf32: bool  # TF32 for fp32 matmuls while the run runs
    accum: int  # micro-batches per optimizer step on each process
    sharded: bool  # FSDP-sharded (fsdp=1 and more than one process)
    master: bool  # bf16 weights with fp32 masters (MasterAdamW)
    reduced_accum: bool  # several unsharded processes accumulating: fp32 sums reduced by the DDP comm hook
    steps: int  # optimizer steps of the whole run (`steps`, or `epochs` × steps_per_epoch)
    warmup: int  # learning-rate warm-up steps
    steps_per_epoch: float  # optimizer steps in one pass over the cache (0: the cache's rows were not given)
    fp8_emulate: bool = False  # precision=fp8 emulated (no CUDA; tests only)
    resident: bool = False  # the cache held on the device (BenchSwitches.resident)
    reader_threads: int = 1  # the stream's reading threads (BenchSwitches.reader_threads)
    final_checkpoint: bool = True  # the last step saves a checkpoint (BenchSwitches.final_checkpoint)

    @property
    def bf16(self) -> bool:
        """bf16 autocast and a bf16 embedding and lm_head: bf16 runs and fp8 runs (whose linears are float8)."""
        return self.precision in ("bf16", "fp8")

    def derived(self, cfg: TrainConfig, cache_key: str) -> dict:
        """The run's config.json "derived" block."""
        return {"world_size": self.world, "grad_accum": self.accum, "fsdp_sharded": self.sharded,
                "precision": self.precision, "attn": self.attn, "compile": self.compile,
                "master_weights": self.master, "loss_epilogue": self.epilogue,
                "loss_logits": cfg.loss.loss_logits, "tf32": self.tf32,
                "global_batch_rows": cfg.schedule.batch_rows * self.world * self.accum, "cache_key": cache_key,
                "steps": self.steps, "warmup_steps": self.warmup, "steps_per_epoch": self.steps_per_epoch,
                "epochs": self.steps / self.steps_per_epoch if self.steps_per_epoch else None}

    def describe(self, cfg: TrainConfig) -> str:
        """One line for the log: processes, rows, accumulation and the compute path."""
        return (f"{self.world} process(es) × {cfg.schedule.batch_rows} rows × accum {self.accum}"
                f"{', FSDP-sharded' if self.sharded else ''}; {self.precision}"
                f"{f' ({FP8_RECIPE}, bf16 elsewhere)' if self.precision == 'fp8' else ''}"
                f"{' (bf16 weights, fp32 masters)' if self.master else ''}"
                f"{', TF32' if self.tf32 else ''}, attn {self.attn}, compile {self.compile}"
                f"{', the cache resident on the device' if self.resident else ''}"
                f"{f', {self.reader_threads} reader threads' if self.reader_threads > 1 else ''}")

    def describe_schedule(self, cfg: TrainConfig, seq_len: int) -> str:
        """One line for the log: the run's length in epochs and steps, the global batch, the warm-up; e.g.
        'schedule: 6 epochs × 1,234 steps = 7,404 steps (global batch 8 rows × 4096), warmup 296 (4 %)'."""
        per, sch = f"{self.steps_per_epoch:,.1f}".removesuffix(".0"), cfg.schedule
        if sch.epochs:
            length = f"{sch.epochs:g} epochs × {per} steps = {self.steps:,} steps"
        elif self.steps_per_epoch:
            length = f"{self.steps:,} steps = {self.steps / self.steps_per_epoch:.3g} epochs of {per} steps"
        else:
            length = f"{self.steps:,} steps"
        ignored = sch.epochs and sch.steps != STEPS_DEFAULT
        return (f"schedule: {length} (global batch {sch.batch_rows * self.world * self.accum} rows × {seq_len}), "
                f"warmup {self.warmup:,} ({100 * self.warmup / self.steps:.3g} %)"
                f"{f'; steps={sch.steps} ignored: epochs sets the length' if ignored else ''}")


def resolve_train(cfg: TrainConfig, *, cuda: bool, world: int, seq_len: int, rows: int = 0,
                  switches: BenchSwitches = BenchSwitches()) -> TrainSetup:
    """The run's settings from `cfg` on a machine with(out) CUDA running `world` processes over a cache of `rows`
    rows of `seq_len` tokens (`rows` is needed for `epochs`)."""
    from dflash_offline.loss import resolve_epilogue

    precision = cfg.compute.precision if cfg.compute.precision != "auto" else ("bf16" if cuda else "fp32")
    if precision == "fp8":
        from dflash_offline.fp8 import check_available, check_token_counts

        check_available(cuda, switches.fp8_emulate)
        check_token_counts(cfg.schedule.batch_rows, seq_len, cfg.loss.num_anchors, cfg.drafter.block_size)
    if cfg.loss.loss_logits == "fp8" and cuda and not switches.fp8_emulate:  # (its first step would fail, weights loaded)
        from dflash_offline.fp8 import check_gpu

        check_gpu("loss_logits=fp8 (float8 lm_head GEMMs)", "loss_logits=fp32 (and precision=bf16 if it is fp8)")
    attn, use_compile = attention(cfg, cuda)
    epilogue = resolve_epilogue(cfg.loss.loss_epilogue, cuda)  # fails here, at start, if this machine cannot run it
    if switches.tf32 and not cuda:
        raise ValueError("TF32 needs CUDA (TF32 tensor cores)")
    accum = grad_accum(cfg, world, seq_len)
    sharded = cfg.compute.fsdp and world > 1  # FSDP only shards over more than one process
    # several processes with gradient accumulation: fp32 sums reduced by the comm hook (`fp32_allreduce_hook`),
    # tested on the CPU (gloo) only so far, so `on` asks for it and `auto` keeps fp32 weights there
    reduced_accum = world > 1 and accum > 1 and not sharded
    master = master_weights(cfg, precision, sharded, reduced_accum)
    steps, warmup, per_epoch = schedule(cfg, world, accum, rows)
    return TrainSetup(world=world, precision=precision, attn=attn, compile=use_compile, epilogue=epilogue,
                      tf32=switches.tf32, accum=accum, sharded=sharded, master=master, reduced_accum=reduced_accum,
                      steps=steps, warmup=warmup, steps_per_epoch=per_epoch,
                      fp8_emulate=precision == "fp8" and switches.fp8_emulate, resident=switches.resident,
                      reader_threads=switches.reader_threads, final_checkpoint=switches.final_checkpoint)


def schedule(cfg: TrainConfig, world: int, accum: int, rows: int) -> tuple[int, int, float]:
    """(optimizer steps, warm-up steps, optimizer steps per epoch) of a run over a cache of `rows` rows.

    An epoch is what the stream (`dataset.HiddenStream`) makes of the cache: rows // (batch_rows × processes)
    micro-batches (the last, partial global batch is dropped), `accum` of them per optimizer step. `epochs` > 0
    rounds its steps up (the last may reach into the next epoch); the warm-up is warmup_ratio × steps rounded
    down (SpecForge's rule), at least 1 when the ratio is > 0."""
    sch = cfg.schedule
    micro_per_epoch = rows // (sch.batch_rows * world)
    per_epoch = micro_per_epoch / accum
    if sch.epochs and not micro_per_epoch:
        from dflash_offline.dataset import fewer_rows

        raise ValueError(f"epochs={sch.epochs:g}: the cache holds {rows} rows, fewer than one global batch of "
                         f"{sch.batch_rows * world} (batch_rows {sch.batch_rows} × {world} processes): extract more "
                         f"rows, {fewer_rows(rows, world)}")
    steps = max(1, math.ceil(sch.epochs * per_epoch - 1e-9)) if sch.epochs else sch.steps
    if cfg.optim.warmup_steps >= 0:
        warmup = cfg.optim.warmup_steps
    else:
        warmup = max(1, int(cfg.optim.warmup_ratio * steps)) if cfg.optim.warmup_ratio > 0 else 0
    return steps, warmup, per_epoch


def attention(cfg: TrainConfig, cuda: bool) -> tuple[str, bool]:
    """(attention implementation, compile or not); flex needs CUDA and compilation."""
    attn = cfg.compute.attn if cfg.compute.attn != "auto" else ("flex" if cuda else "dense")
    use_compile = cfg.compute.compile == "on" or (cfg.compute.compile == "auto" and cuda)
    if attn != "dense" and not cuda:
        raise ValueError(f"attn={attn} needs CUDA (flex_attention has no CPU backward); use attn=dense or auto on "
                         f"the CPU")
    if attn != "dense" and not use_compile:
        raise ValueError(f"attn={attn} needs compile=on: uncompiled flex_attention materializes the full score "
                         f"matrix")
    return attn, use_compile


def grad_accum(cfg: TrainConfig, world: int, seq_len: int) -> int:
    """Micro-batches per optimizer step on each process, from global_batch_tokens (0: one)."""
    sch = cfg.schedule
    if not sch.global_batch_tokens:
        return 1
    rows_per_micro = sch.batch_rows * seq_len
    accum, rem = divmod(sch.global_batch_tokens, rows_per_micro * world)
    if rem or accum < 1:
        unit, (rows, left) = rows_per_micro * world, divmod(sch.global_batch_tokens, rows_per_micro)
        fits = [str(w) for w in range(1, rows + 1) if rows % w == 0] if not left else []
        raise ValueError(
            f"global_batch_tokens={sch.global_batch_tokens} must be a multiple of batch_rows × seq_len × processes = "
            f"{unit} ({world} processes); " + (f"it fits {', '.join(fits)} processes; " if fits else "")
            + f"on {world}, pass --global_batch_tokens={-(-sch.global_batch_tokens // unit) * unit} (a step of other "
            f"tokens: match its lr and steps to it)")
    return accum


def master_weights(cfg: TrainConfig, precision: str, sharded: bool, reduced_accum: bool) -> bool:
    """bf16 weights with fp32 masters: `on` where possible (else refused), `auto` where tested, `off` never. An fp8
    run is a bf16 run here (its float8 linears cast the bf16 weights)."""
    bf16 = precision in ("bf16", "fp8")
    master = cfg.compute.master_weights == "on" or (cfg.compute.master_weights == "auto" and bf16)
    why_not = "precision is fp32" if not bf16 else "FSDP shards fp32 weights" if sharded else None
    if master and why_not:
        if cfg.compute.master_weights == "on":
            raise ValueError(f"master_weights=on is not available here: {why_not}; use master_weights=off/auto")
        return False
    return master and not (reduced_accum and cfg.compute.master_weights == "auto")


def cosine_schedule(step: int, warmup: int, total: int, floor: float) -> float:
    """The learning rate at optimizer step `step` as a fraction of the peak: linear warm-up, cosine down to `floor`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# --- the cache, the target and the drafter -----------------------------------------------------------------------


def cache_defaults(cfg: TrainConfig) -> dict:
    """What the cache says about the target: its checkpoint, tapped layers, mask token, sizes."""
    from dflash_offline.cache.manifest import read_manifest

    m = read_manifest(cfg.cache, need=("config.extract.target", "config.layer_ids", "config.mask_token_id",
                                       "producer.target.hidden_size", "producer.target.num_layers",
                                       "producer.target.vocab_size", "producer.tokens.producer.seq_len"),
                      kind="hidden")
    tgt = m["producer"]["target"]
    return {
        "target": cfg.target or m["config"]["extract"]["target"], "cache_target": m["config"]["extract"]["target"],
        "target_id": tgt,
        "layer_ids": list(cfg.drafter.layer_ids) or list(m["config"]["layer_ids"]),
        "mask_token_id": cfg.drafter.mask_token_id if cfg.drafter.mask_token_id >= 0 else m["config"]["mask_token_id"],
        "hidden_size": tgt["hidden_size"], "num_target_layers": tgt["num_layers"], "vocab_size": tgt["vocab_size"],
        "seq_len": m["producer"]["tokens"]["producer"]["seq_len"],
        # the chat template settings the corpus was rendered with: eval renders plain prompts with them (the token
        # cache's record of them, which adds regen's enable_thinking; else its key's template_kwargs)
        "template_kwargs": token_cache_settings(cfg.cache, m) or m["producer"]["tokens"]["producer"].get("template_kwargs")
        or {},
        # a projected cache: the fc reads k values a tap, and the run records the projection it trained on
        "tap_width": int((m["producer"].get("projection") or {}).get("dims", 0)),
        "projection": run_projection(m, cfg.cache) if m["producer"].get("projection") else None,
    }


def token_cache_settings(cache: str, m: dict) -> dict | None:
    """The chat template settings the token cache of hidden cache `cache` (manifest `m`) records its records were
    rendered with (stage 1a's `rendered_with`); None where it records none or is not there (the stream says so)."""
    from dflash_offline.cache.manifest import ManifestError, token_cache

    try:
        return token_cache(Path(cache), m)[1].get("rendered_with")
    except (ManifestError, OSError):
        return None


def check_recipe_taps(argv: list[str], cfg: TrainConfig) -> None:
    """`make train RECIPE=` on a cache extracted with other taps than the recipe's [extract] layer_ids (an extraction
    without the recipe takes the default spread) would train, and export for serving, a drafter on taps the recipe
    does not publish: refused, unless train.layer_ids says which taps to train on."""
    from dflash_offline.cache.manifest import read_manifest
    from dflash_offline.config import parse_overrides, read_recipe

    recipe = parse_overrides(argv)[0]
    want = (read_recipe(recipe).get("extract") or {}).get("layer_ids") if recipe else None
    if not want or cfg.drafter.layer_ids or not cfg.cache:
        return
    try:
        have = read_manifest(cfg.cache, kind="hidden")["config"]["layer_ids"]
    except (ValueError, KeyError, OSError):  # (said, naming the field, when the run opens the cache)
        return
    if list(have) != list(want):
        raise ConfigError(f"{cfg.cache} holds taps {list(have)}, not the layer_ids {list(want)} of {recipe}'s "
                          f"[extract]: the drafter would train and be served on other taps than the recipe's. Extract "
                          f"the cache with RECIPE={recipe}, or pass --layer_ids= (a subset of the cache's) to train on "
                          f"those knowingly")


def run_projection(m: dict, cache) -> dict:
    """What a run on a projected cache records of it (config.json, checkpoints): what export needs to fold fc'."""
    rec = m.get("projection") or {}
    return {"cache": str(Path(cache).resolve()), "dims": m["producer"]["projection"]["dims"], "file": rec.get("file"),
            "sha256": rec.get("sha256")}


def drafter_config(cfg: TrainConfig, c: dict):
    """The drafter's `DrafterConfig` from `cfg`, the cache's facts `c` and the target checkpoint's config."""
    from dflash_offline.drafter import DrafterConfig
    from dflash_offline.target import read_target_info
    from dflash_offline.targetid import check_mask_token, resolve_checkpoint

    ckpt = resolve_checkpoint(c["target"], field="train.target" if cfg.target else
                              f"train.target (empty: the target {cfg.cache} was extracted from)")
    info = read_target_info(ckpt)
    if c["mask_token_id"] is None:
        raise ValueError("no mask token: pass mask_token_id= (Qwen3 151669, Qwen3.5/3.6 248070)")
    check_mask_token(int(c["mask_token_id"]), ckpt, info, "train.mask_token_id" if cfg.drafter.mask_token_id >= 0 else
                     f"the mask token of {cfg.cache} (train.mask_token_id to override)")
    if info.hidden_size != c["hidden_size"] or info.num_layers != c["num_target_layers"]:
        raise ValueError(f"target {c['target']} (hidden {info.hidden_size}, {info.num_layers} layers) is not the "
                         f"target the cache was extracted from (hidden {c['hidden_size']}, "
                         f"{c['num_target_layers']} layers): pass target= the right checkpoint")
    d = cfg.drafter
    types = None
    if d.sliding_window:
        full = d.full_attention_layers
        types = ["sliding_attention"] * (d.num_layers - full) + ["full_attention"] * full
    return DrafterConfig(
        hidden_size=c["hidden_size"], intermediate_size=d.intermediate_size or info.intermediate_size,
        vocab_size=info.vocab_size, target_layer_ids=c["layer_ids"], num_target_layers=info.num_layers,
        mask_token_id=int(c["mask_token_id"]), num_layers=d.num_layers, num_heads=d.num_heads,
        num_kv_heads=d.num_kv_heads, head_dim=d.head_dim, rms_norm_eps=info.rms_norm_eps,
        rope_theta=info.rope_theta, block_size=d.block_size, sliding_window=d.sliding_window or None,
        layer_types=types, block_attention=d.block_attention, tap_width=c.get("tap_width", 0), variant=d.variant,
        conv_kernel_size=d.conv_kernel_size, conv_group_size=d.conv_group_size, selector_rank=d.selector_rank,
        selector_top_k=d.selector_top_k,
    )


CHECKPOINT_ROOM_GB = 1.0  # free space a run keeps beyond its checkpoints (metrics, logs, trackers)


def checkpoint_bytes(dc) -> int:
    """The bytes of one checkpoint of a drafter `dc` (counted on the meta device, nothing allocated): its weights as
    trained (fp32) and AdamW's two fp32 moments per trainable weight; the rest (RNG, JSON) is kilobytes."""
    import torch

    from dflash_offline.drafter import DFlashDrafter

    with torch.device("meta"):
        model = DFlashDrafter(dc)
    weights = sum(t.numel() for t in model.state_dict().values())
    return 4 * weights + 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_checkpoint_room(cfg: TrainConfig, dc, run_dir: Path, steps: int, final: bool = True) -> None:
    """Refuse, before any weight loads, a run whose checkpoints would not fit where RUN= is (the main process writes
    them): at most the newest `keep_last` (keep_last=0: every one the run's `steps` save) plus the one being written,
    less those already there (a resume), keeping CHECKPOINT_ROOM_GB for logs and metrics. A run that found no room at
    its first save would have trained ckpt_every steps for nothing."""
    import os

    from dflash_offline.cache.fsio import free_space, size
    from dflash_offline.checkpoint import list_checkpoints

    if int(os.environ.get("RANK", 0)) != 0:
        return
    every, keep = cfg.schedule.ckpt_every, cfg.schedule.keep_last
    saves = steps // every + int(final and steps % every > 0)  # a last step on a boundary saves once
    peak = min(saves, keep + 1) if keep else saves
    if peak == 0:
        return
    there = len(list_checkpoints(run_dir))
    per = checkpoint_bytes(dc)
    need = max(peak - there, 1) * per
    free = free_space(run_dir)
    if free - need < CHECKPOINT_ROOM_GB * 1e9:
        kept = f"keep_last={keep} kept plus the one being written" if keep else "keep_last=0: all kept"
        # the most checkpoints that would fit (keep_last=N holds N + 1 at a save): offered only where one does
        # (a save needs room for one more at least, however many are there: none fits where that one does not)
        more = int((free - CHECKPOINT_ROOM_GB * 1e9) // per)
        fits = more + there - 1
        fewer = f", or keep fewer checkpoints (keep_last={fits} fits)" if more >= 1 and 1 <= fits < (keep or saves) else ""
        raise ValueError(f"{run_dir}: its checkpoints need {size(need)} ({size(per)} each; {kept}"
                         f"{f', {there} there already' if there else ''}) but the filesystem has {size(free)} free, "
                         f"and a run keeps {CHECKPOINT_ROOM_GB:g} GB free beside them for its metrics and logs: free "
                         f"space or put RUN= elsewhere{fewer}")


def check_inputs(cfg: TrainConfig, run_dir, final_checkpoint: bool = True):
    """(cache facts, drafter config, opened cache): a cache, target or run directory that does not fit is refused."""
    import os

    from dflash_offline.dataset import open_hidden_cache
    from dflash_offline.export import check_servable_taps
    from dflash_offline.targetid import check_same_target

    c = cache_defaults(cfg)
    dc = drafter_config(cfg, c)
    check_servable_taps(dc)  # taps vLLM and SGLang could not serve as trained: refused now, not after training
    if cfg.loss.loss_logits == "fp8" and (dc.hidden_size % 16 or dc.vocab_size % 16):
        raise ValueError(f"train.loss_logits=fp8 runs the lm_head GEMMs in float8, which need the hidden size and the "
                         f"vocabulary to be multiples of 16: the target has {dc.hidden_size} and {dc.vocab_size}; use "
                         f"loss_logits=bf16 or fp32")
    check_same_target(c["target"], c["target_id"], cfg.cache, c["cache_target"])
    info = open_hidden_cache(cfg.cache, c["layer_ids"], hidden_size=c["hidden_size"], seq_len=c["seq_len"],
                             require_verified=cfg.require_verified)
    from dflash_offline.cache.fsio import remove_dead_temps
    from dflash_offline.checkpoint import list_checkpoints

    if (n := remove_dead_temps(run_dir / "checkpoints"))[0]:  # a checkpoint half-written by a killed run
        print(f"{run_dir}/checkpoints: removed {n[0]} unfinished checkpoint(s) of dead runs ({n[1] / 1e6:.1f} MB)",
              flush=True)
    if list_checkpoints(run_dir) and not cfg.resume:
        raise ValueError(f"{run_dir} already holds checkpoints: pass --resume=1 (make RESUME=1) to continue it, or "
                         f"choose another {flag('train', 'run')}")
    world = int(os.environ.get("WORLD_SIZE", 1))  # (the launcher's; the Accelerator is not made yet)
    steps = schedule(cfg, world, grad_accum(cfg, world, c["seq_len"]), info.num_rows)[0]
    check_checkpoint_room(cfg, dc, run_dir, steps, final_checkpoint)
    return c, dc, info


def same_start_on_every_rank(acc, start: Path | None, run_dir, info) -> None:
    """Refuse a run whose processes would read different caches or start from different steps, before any weight
    loads. Each process opens its cache and reads the run's checkpoint itself. Machines with their own copy of a cache
    must hold the same one: the same key, and for a projected cache the same P (two extractions with one key each
    calibrate their own, `projection.py`), else ranks would train one fc' on different bases. On machines that do not
    see the same run directory, a resume would start rank 0 at its checkpoint and the others from scratch, and DDP
    would average gradients of different weights until a collective hangs. `start`: the checkpoint this process
    resumes from (`checkpoint.intact_checkpoint`; None: step 0)."""
    if acc.num_processes == 1:
        return
    import hashlib
    import json

    import torch

    step = json.loads((start / "meta.json").read_text())["step"] if start else 0  # `start`: `intact_checkpoint`
    projection = (info.projection or {}).get("sha256", "")
    cache = int(hashlib.sha256(f"{info.key}:{projection}".encode()).hexdigest()[:15], 16)
    both = acc.gather(torch.tensor([[step, cache]], device=acc.device)).tolist()
    steps, caches = [s for s, _ in both], [c for _, c in both]
    if len(set(caches)) > 1:
        where = "; ".join(f"rank(s) {', '.join(str(r) for r, x in enumerate(caches) if x == c)}"
                          for c in dict.fromkeys(caches))
        raise ValueError(f"{info.cache_dir}: the processes read different caches ({where}; this one's key "
                         f"{info.key[:12]}{f', projection {projection[:12]}' if projection else ''}): every machine "
                         f"must read one cache, shared or copied from one extraction (two extractions with the same "
                         f"key calibrate different projections)")
    if len(set(steps)) > 1:
        where = "; ".join(f"step {s} on rank(s) {', '.join(str(r) for r, x in enumerate(steps) if x == s)}"
                          for s in sorted(set(steps), reverse=True))
        raise ValueError(f"{run_dir}: the processes would start from different steps ({where}): every machine must "
                         f"see the run directory ({flag('train', 'run')}) at the same path, with its checkpoints: a "
                         f"shared filesystem, or the checkpoint copied to each machine before resuming")


# --- the process -------------------------------------------------------------------------------------------------


_MAY_FREEZE: list[bool] = []  # per `kept_process_state` entered: whether its run may freeze the heap


@contextlib.contextmanager
def kept_process_state():
    """While a run runs, the GC clock counts; afterwards the process is as the run found it: the recompile guard and
    TF32 (set by the run, for its own matmuls), and the GC unfrozen where the run froze it (a caller's own frozen
    objects are left as they are), then collected: the run's model is a reference cycle (its compiled method), which
    only the cycle collector frees — before a next run in the process (a benchmark's) counts it in its memory."""
    import gc

    import torch

    from dflash_offline.metrics import GC_CLOCK, only_interpreter_frozen

    strict, tf32 = torch._dynamo.config.error_on_recompile, tf32_setting()
    ours = only_interpreter_frozen()  # decided once: where a caller froze, `end_warm_up` does not freeze
    _MAY_FREEZE.append(ours)
    gc.callbacks.append(GC_CLOCK)
    try:
        yield
    finally:
        _MAY_FREEZE.pop()
        gc.callbacks.remove(GC_CLOCK)
        torch._dynamo.config.error_on_recompile = strict
        setattr(torch.backends.cuda.matmul, *tf32)
        if ours and not only_interpreter_frozen():
            gc.unfreeze()
        gc.collect()


def tf32_setting() -> tuple[str, object]:
    """The process's TF32 setting for CUDA matmuls as (attribute, value) of `torch.backends.cuda.matmul`, to put back
    with setattr: torch's `allow_tf32` flag, which the run sets; or, where a caller has used torch's newer
    `fp32_precision` setting (the flag then cannot be read: torch refuses a mix of the two), that one."""
    import torch

    m = torch.backends.cuda.matmul
    try:
        return "allow_tf32", m.allow_tf32
    except RuntimeError:
        return "fp32_precision", m.fp32_precision


def end_warm_up(compiling: bool) -> None:
    """After the run's first step: everything built so far (modules, compiled graphs, the dynamo/inductor caches:
    millions of objects) lives until the end, so keep it out of the cyclic GC's full passes, which would otherwise
    walk it all every so often on the thread that feeds the GPU; with compilation, a recompile from now on is an
    error (a new shape is a bug, not a slowdown). `kept_process_state` undoes both; outside one, or where a caller
    had frozen a heap when it began, the heap is not frozen."""
    import gc

    import torch

    if _MAY_FREEZE and _MAY_FREEZE[-1]:
        gc.freeze()
    if compiling:
        torch._dynamo.config.error_on_recompile = True


def release_process_group() -> None:
    """Destroy the default process group, once the run's frame (and with it the DDP model) is gone.

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
