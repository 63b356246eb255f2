"""Export a trained drafter in the z-lab DFlash format (config.json + model.safetensors + dflash.py).

    python -m stages.export --run=RUN --export=DIR [--step=N] [--dtype=bfloat16] [--target=PATH] [--force=1]
    make export RUN=runs/x EXPORT=export/x

Reads the run's checkpoint (the latest, or `--step`), writes the export directory atomically and prints how to serve
it with vLLM and SGLang. DIR may be new, empty, or an earlier export of the same run (replaced); an export of another run
needs `--force=1`; a directory that is not an export (a cache, a run, files of its own), or an export that also holds
files it did not write, is refused: DIR is replaced whole. `make eval EXPORT=DIR` measures it.
The target checkpoint (for max_position_embeddings and token ids) defaults to the one the run trained against.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_offline.config import configs_from_argv
from dflash_offline.export import PROVENANCE, ExportConfig, export, provenance_paths, usage


def run(cfg: ExportConfig) -> Path:
    out = export(cfg.run, cfg.export, step=None if cfg.step < 0 else cfg.step, dtype=cfg.dtype, target=cfg.target,
                 force=cfg.force)
    prov = json.loads((out / PROVENANCE).read_text())
    print(f"exported {Path(cfg.run)} step {prov['step']} ({cfg.dtype}) -> {out}")
    for line in usage(out, prov["drafter"], provenance_paths(out, prov)["target"]):
        print("  " + line)
    return out


def main(argv: list[str]) -> None:
    from dflash_offline.cli import unbuffered

    unbuffered()
    (cfg,) = configs_from_argv([(ExportConfig, "export")], argv, __doc__)
    run(cfg)


if __name__ == "__main__":
    from dflash_offline.cli import run_cli

    run_cli(main)
