"""The testbed's settings: `TestbedConfig` (each field a `--key=value` of `python -m testbed`), its size presets
(`PRESETS`, filled in where the command line is silent: `apply_preset`) and the A/B sweeps' presets (`SWEEPS`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dflash_offline.config import ConfigError, check_choice

from .runs import PHASES

SWEEPS = {  # --sweep=NAME[,NAME…]: the union of their arms, the recipe first
    "options": ["", "gamma=5", "gamma=inf", "num_anchors=256", "num_anchors=1024", "noise_std=0.05",
                "weighting=dpace", "quant=fp8"],
    "encodings": ["", "quant=fp8", "quant=fp4", "project_dims=384", "project_dims=384 quant=fp8",
                  "project_dims=192 quant=fp8"],
    "fp8": ["", "precision=fp8", "loss_logits=fp8", "precision=fp8 loss_logits=fp8"],
    # DFlash2 against the recipe's DFlash at the recipe's block 16, γ, anchors and steps: the variant alone differs
    "dflash2": ["", "variant=dflash2"],
}
PRESETS = {  # sizes: full (make testbed), short (the GPU test, ≈ 5 min), micro (the CPU test: the pipeline's logic)
    "full": {},
    "short": {"source_mb": 16, "tokenizer_mb": 4, "target_s": 70, "regen_docs": 512, "train_steps": 80, "eval_prompts": 16, "eval_tokens": 48},
    "micro": {"packages": [], "source_mb": 2, "tokenizer_mb": 1, "vocab": 1024, "dims": "tiny", "target_rows": 128,
              "target_batch": 4, "target_s": 5, "target_steps": 8, "regen_docs": 12, "regen_tokens": 24,
              "regen_batch": 12, "train_steps": 6, "eval_prompts": 3, "untrained_prompts": 2, "check_prompts": 2, "eval_tokens": 12,
              "recipe_seq_len": 256,
              "train_args": "num_layers=2 num_heads=4 num_kv_heads=2 head_dim=16 num_anchors=16 batch_rows=2 "
                            "log_every=2"},
}


@dataclass
class TestbedConfig:
    dir: str = "build/testbed"  # everything goes here (target, corpora, caches, runs, results)
    from_phase: str = ""  # redo this phase and the later ones: target | regen | extract | train | export | eval
    preset: str = "full"  # full (make testbed) | short (GPU test, ≈ 5 min) | micro (CPU test of the logic)
    drafter_recipe: str = "manifests/testbed.toml"  # tokenize/extract/train settings of the drafter part
    train_args: str = ""  # extra train settings for every drafter (space-separated key=value)
    packages: list[str] = field(default_factory=lambda: ["torch", "transformers", "numpy", "huggingface_hub",
                                                         "accelerate", "pyarrow", "jinja2", "safetensors", "triton"])  # packages whose sources join the standard library's
    source_mb: int = 96  # training source text taken (MB, in name-hash order)
    heldout_every: int = 32  # one file in this many is held out (by name hash)
    tokenizer_mb: int = 24  # source text the BPE is trained on
    vocab: int = 16384  # tokenizer size (BPE + added tokens)
    dims: str = "testbed"  # target shape: testbed (hidden 768, 12 layers) | tiny (the embedded demo's)
    target_rows: int = 1024  # target training row length (tokens)
    target_batch: int = 64  # target training rows per step
    target_micro_batch: int = 0  # rows a forward/backward of the target's training (its gradient accumulated over the step's batch); 0 = the whole batch, halved while it runs out of GPU memory (64 rows fit an H200, not an H100)
    target_lr: float = 1e-3  # target peak learning rate
    target_s: float = 150.0  # target training time budget (seconds; the step count is fitted to it)
    target_steps: int = 4000  # target training steps at most
    regen_docs: int = 4000  # prompts the target answers (the drafter's corpus)
    regen_tokens: int = 192  # new tokens per answer
    regen_batch: int = 512  # prompts per generate call
    regen_temperature: float = 0.8  # the corpus's answers are sampled at this temperature (0 = greedy: a small target's greedy answers loop)
    regen_top_p: float = 0.95  # nucleus mass of that sampling
    eval_candidates: int = 4  # held-out prompts answered greedily per evaluation prompt; the non-looping ones are chosen
    train_steps: int = 0  # drafter steps; 0 = the recipe's
    eval_prompts: int = 64  # held-out prompts evaluated
    eval_tokens: int = 64  # new tokens per prompt
    untrained_prompts: int = 16  # prompts the untrained drafter decodes (τ ≈ 1: every token a verify step); all of them make the baseline
    recipe_seq_len: int = 0  # token row length for the drafter's cache; 0 = the recipe's
    device: str = "auto"  # auto | cuda | cpu
    seed: int = 0  # target build and the first drafter seed
    arms: str = ""  # A/B: arms separated by ';', each space-separated key=value settings ('' = the recipe)
    sweep: str = ""  # A/B presets, comma-separated: options (γ, anchors, noise, D-PACE, fp8 cache) | encodings | fp8 | dflash2
    seeds: int = 2  # A/B: drafter seeds per arm
    parallel: int = 0  # A/B: drafter jobs at once; 0 = one per GPU of --gpus (on one GPU, processes take turns: two at once were slower)
    gpus: int = 0  # A/B: GPUs the drafters' trainings are spread over, each training on a free one (its worker sees only it); 0 = every visible GPU
    overlap_eval: bool = True  # a drafter's evaluation (another process) runs beside the next drafter's training, not before it (still `parallel` trainings at once; 0 = one after the other)
    eval_queue: int = 1  # bench switch, with overlap_eval: evaluations pending (running or waiting) per training slot that a training may start beside (1: an arm's first's evaluation holds back the training after its repeat's; 2: the repeat's evaluation waits instead)
    label: str = ""  # A/B: result name (DIR/ab/<label>.json: letters, digits, . _ + -); empty = sweep name or 'ab'
    replay: bool = True  # A/B: τ replayed on the target's greedy outputs (one target forward per prompt, not one or two per step: the same steps); each graph setting's first drafter (not the null's nor the known-bad arm's) also decodes check_prompts for real
    eval_worker: bool = True  # every evaluation of an invocation in one long-lived process (start-up and the target's loading paid once); 0 = a process each
    train_worker: bool = True  # every drafter's training of an invocation in one long-lived process (start-up paid once; one per concurrent job with --parallel); 0 = a process each
    derive_caches: bool = False  # 1 = an arm's cache that only encodes or projects the testbed's bf16 states is derived from them (extract --from_cache: no target forward; no faster on this 124M target); 0 = extracted from the target
    resident: bool = False  # bench switch: each drafter's training reads its cache once onto the device and gathers its batches there instead of streaming them (BenchSwitches.resident: the same batches; needs train_worker, which keeps them there for its next drafter on that cache)
    precompile: str = "auto"  # on | off | auto (= on where the drafters compile: CUDA, or compile=on in train_args): while the target trains, regenerates and is extracted, compile each drafter setting's graphs on a stand-in of its shapes (random weights and states), so that the drafters load them from the compile caches (testbed/precompile.py)
    ahead: bool = True  # where the extraction starts, start beside it the evaluation worker, the first training's (one training at a time on one GPU) and, in the former, the target-alone decodes every evaluation reuses (the untrained evaluation made them beside the first training, and the first drafter's evaluation waited); 0 = each when first needed
    kernels_ahead: str = "auto"  # on | off | auto (= on with CUDA): the extraction's kernel check (stages.extract --dry_run=1) run beside the regeneration, so that the extraction finds its kernels in the Triton cache
    check_prompts: int = 8  # A/B with replay: prompts each arm's first drafter also decodes for real (lossless check, replay = decode checked; the null and known-bad arms, the recipe's graphs, only replay)
    replay_batch: int = 64  # A/B replays draft up to N anchors in one batched forward (eval.replay_batch; 0: a drafting call a step, 2-3x slower on an H100); each arm's first drafter's check_prompts real decodes check it
    checks: bool = True  # A/B: add the null arm (the recipe under other seeds) and the known-bad arm (¼ of the steps); rank arms only when both behave
    stop_after_s: float = 0.0  # A drafter is not started when its expected time (the longest drafter of this invocation; before one ended, 140 s where a stand-in compiled its graphs, else 240 s; an arm's further seed: the longest repeat of its settings, before one the longest repeat and at least 0.6 of its first; none after a base drafter not started before the target-alone decodes exist) would end past this many seconds of it: the call stops early (exit 3), a rerun resumes; 0 = no limit
    summarize: bool = False  # A/B: train and evaluate nothing; rank the arms whose every seed is evaluated already (a stopped sweep's) and write the results
    results: str = ""  # A/B: also write the sweep's verdicts here (e.g. bench/results/testbed-sweep-h200.json)

    def resolve(self) -> TestbedConfig:
        check_choice("testbed.preset", self.preset, tuple(PRESETS))
        if self.from_phase:
            check_choice("testbed.from_phase", self.from_phase, PHASES)
        check_choice("testbed.dims", self.dims, ("testbed", "tiny"))
        if self.sweep:
            for name in self.sweep.split(","):
                check_choice("testbed.sweep", name, tuple(SWEEPS))
        if self.seeds < 1 or self.eval_prompts < 1 or self.regen_docs < 1 or self.eval_candidates < 1:
            raise ConfigError("testbed.seeds, eval_prompts, eval_candidates and regen_docs must be >= 1")
        if min(self.untrained_prompts, self.check_prompts, self.replay_batch) < 0:
            raise ConfigError(f"testbed.untrained_prompts, check_prompts and replay_batch must be >= 0, got "
                              f"{self.untrained_prompts}, {self.check_prompts}, {self.replay_batch}")
        if self.eval_tokens < 2:  # (the evaluation's own check, made before the target trains)
            raise ConfigError(f"testbed.eval_tokens must be >= 2 (the first new token comes from the target's "
                              f"prefill, the drafter is measured from the second), got {self.eval_tokens}")
        check_choice("testbed.precompile", self.precompile, ("auto", "on", "off"))
        check_choice("testbed.kernels_ahead", self.kernels_ahead, ("auto", "on", "off"))
        if self.label and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}", self.label):
            raise ConfigError(f"testbed.label={self.label}: it names DIR/ab/<label>.json, so letters, digits and . _ + - "
                              f"only, 100 at most (e.g. --label=fp8)")
        if self.gpus < 0:
            raise ConfigError(f"testbed.gpus must be >= 0 (0 = every visible GPU), got {self.gpus}")
        if not 0 <= self.seed < 2**20 - self.seeds:
            raise ConfigError(f"testbed.seed={self.seed}: give 0 … {2**20 - self.seeds - 1} (the recipe takes seed … "
                              f"seed + seeds − 1; the other arms draw theirs above 2^20)")
        if self.eval_queue < 1:
            raise ConfigError(f"testbed.eval_queue must be >= 1 (evaluations a training may start beside), got "
                              f"{self.eval_queue}")
        if self.resident and not self.train_worker:
            raise ConfigError("testbed.resident is a switch of the training worker: keep train_worker=1 with it")
        return self


def apply_preset(cfg: TestbedConfig, argv: list[str]) -> TestbedConfig:
    """The preset's values for every field the command line did not set."""
    given = {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}
    for k, v in PRESETS[cfg.preset].items():
        if k not in given:
            setattr(cfg, k, v)
    return cfg
