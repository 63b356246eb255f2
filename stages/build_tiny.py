"""Build the embedded default: a tiny Qwen target + tokenizer trained locally, and the bundled demo corpus.

    python -m stages.build_tiny --out=build/tiny-qwen3_5 [--arch=qwen3_5] [--seed=0] [--train_steps=N] [--force=1]

Writes into OUT: the model (`config.json`, `model.safetensors`, `generation_config.json`), the tokenizer
(`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`), `dflash_target.json` (mask token id and the
build parameters) and `corpus/train.jsonl` + `corpus/eval.jsonl` (the demo corpus; eval uses another seed).
Idempotent: when OUT already holds a build with the same parameters it is left alone. The build happens in a
temporary sibling directory that is renamed onto OUT at the end, so OUT is either complete or absent.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_offline.cache.fsio import atomic_dir
from dflash_offline.cli import run_cli
from dflash_offline.config import ConfigError, check_choice, configs_from_argv
from fixtures import democorpus, tiny

log = functools.partial(print, flush=True)
EVAL_SEED_OFFSET = 1_000_003  # the eval corpus is drawn with seed + this, disjoint from the training seed


@dataclass(frozen=True)
class BuildTinyConfig:
    out: str  # directory to create, e.g. build/tiny-qwen3_5 (complete or absent: built elsewhere, then renamed)
    arch: str = "qwen3_5"  # "qwen3_5" (hybrid Gated DeltaNet, VL checkpoint layout) or "qwen3" (dense)
    seed: int = 0  # seeds the corpus, the tokenizer's training text, the init and the training order
    train_steps: int = 0  # >0: train the target this many steps of 8x256 tokens on the corpus (300 for non-degenerate demos); 0 = random init
    corpus_docs: int = 4000  # demo documents (tokenizer + target training text, written to corpus/train.jsonl)
    eval_docs: int = 200  # held-out demo documents (corpus/eval.jsonl)
    force: bool = False  # replace OUT if it holds a build with other parameters

    def resolve(self) -> BuildTinyConfig:
        check_choice("build_tiny.arch", self.arch, tiny.ARCHS)
        if self.train_steps < 0 or self.corpus_docs < 1 or self.eval_docs < 0:
            raise ConfigError("build_tiny: --train_steps must be >= 0, --corpus_docs >= 1, --eval_docs >= 0")
        return self


def parse_args(argv: list[str]) -> BuildTinyConfig:
    (cfg,) = configs_from_argv([(BuildTinyConfig, "build_tiny")], argv, __doc__)
    return cfg


def existing_params(out: Path) -> dict | None:
    """The build parameters recorded in OUT's sidecar, or None when OUT holds no complete build."""
    try:
        return tiny.read_sidecar(out).get("params")
    except ValueError:
        return None


def main(argv: list[str]) -> int:
    from dflash_offline.devices import quiet_cpu_kernel_notes

    cfg = parse_args(argv)
    quiet_cpu_kernel_notes(log)  # (the tiny build runs on the CPU)
    out = Path(cfg.out)
    params = {**tiny.build_params(cfg.arch, cfg.seed, cfg.train_steps, cfg.corpus_docs), "eval_docs": cfg.eval_docs}
    log(f"build_tiny: {asdict(cfg)}")

    # --- skip, refuse or (re)build
    if out.exists():
        have = existing_params(out)
        if have == params:
            log(f"{out} already holds this build (params {params}); nothing to do")
            return 0
        if not cfg.force:
            what = f"a build with other parameters {have}" if have is not None else "something that is no tiny build"
            raise SystemExit(f"error: {out} holds {what}; wanted {params}. Remove it or pass --force=1.")

    t0 = time.perf_counter()
    with atomic_dir(out) as tmp:  # published onto OUT when finished, removed when not
        # --- corpus
        democorpus.write_jsonl(tmp / "corpus" / "train.jsonl", cfg.corpus_docs, cfg.seed)
        democorpus.write_jsonl(tmp / "corpus" / "eval.jsonl", cfg.eval_docs, cfg.seed + EVAL_SEED_OFFSET)
        log(f"corpus: {cfg.corpus_docs} train + {cfg.eval_docs} eval documents")

        # --- tokenizer + model (+ training)
        tiny.build_target(tmp, cfg.arch, seed=cfg.seed, train_steps=cfg.train_steps, corpus_docs=cfg.corpus_docs,
                          log=log)
        sidecar = tiny.read_sidecar(tmp)
        sidecar["params"] = params
        sidecar["corpus"] = {"train": "corpus/train.jsonl", "eval": "corpus/eval.jsonl",
                             "eval_seed": cfg.seed + EVAL_SEED_OFFSET}
        tiny.write_json(tmp / tiny.SIDECAR, sidecar)
    log(f"done: {out} (mask_token_id {sidecar['mask_token_id']}, vocab {sidecar['vocab_size']}, "
        f"{time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    run_cli(main)
