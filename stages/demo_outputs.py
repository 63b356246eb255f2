"""Keep `make demo` re-runnable across code changes: its outputs are stamped with a hash of the code and recipe that
made them; when the code changes, the outputs made by the old code are removed before the demo runs again (its
caches would otherwise carry another key and be refused, as any cache of another key is).

    python -m stages.demo_outputs --dir=build/demo

Only the demo's own outputs are touched (cache/, run/, export/, regen.jsonl*); the tiny target checks its own build
parameters and is kept. Unchanged code: nothing is removed, the demo resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.config import configs_from_argv

REPO = Path(__file__).resolve().parents[1]
STAMP = ".code-stamp"
OUTPUTS = ("cache", "run", "export", "regen.jsonl", "regen.jsonl.stats.json")


@dataclass(frozen=True)
class DemoOutputsConfig:
    dir: str  # the demo's directory: its outputs made by other code are removed, then it is stamped

    def resolve(self) -> DemoOutputsConfig:
        return self


def code_hash(repo: Path = REPO) -> str:
    h = hashlib.sha256()
    files = sorted([*repo.glob("dflash_offline/**/*.py"), *repo.glob("stages/*.py"), repo / "manifests" / "demo.toml",
                    repo / "Makefile"])
    for f in files:
        h.update(f.relative_to(repo).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def prepare(demo_dir: Path, current: str | None = None) -> list[str]:
    """Remove the outputs of a demo made by other code; stamp the directory. Returns what was removed."""
    from dflash_offline.progress import log

    current = current or code_hash()
    demo_dir.mkdir(parents=True, exist_ok=True)
    stamp = demo_dir / STAMP
    previous = stamp.read_text().strip() if stamp.is_file() else None
    removed = []
    if previous != current:
        for name in OUTPUTS:
            path = demo_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            else:
                continue
            removed.append(name)
        if removed:
            log(f"{demo_dir}: outputs of other code removed ({', '.join(removed)}); the demo starts them afresh")
    stamp.write_text(current + "\n")
    return removed


def main(argv: list[str]) -> None:
    (cfg,) = configs_from_argv([(DemoOutputsConfig, "demo_outputs")], argv, __doc__)
    prepare(Path(cfg.dir))


if __name__ == "__main__":
    from dflash_offline.cli import run_cli

    run_cli(main)
