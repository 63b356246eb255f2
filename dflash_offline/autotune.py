"""Triton autotuner choices: recorded from one run, pinned for the next.

On a cold machine, fla's Triton kernels autotune every shape they meet: each candidate config of each kernel is
compiled and timed (extraction's first kernel check spent 111 s of 129 there on an H200, the exact-mode evaluation's
float32 kernels ≈ 160 s). The choice depends on the GPU, the Triton and fla versions and the shape, not on the data,
so it can be made once and kept:

- `DFLASH_AUTOTUNE_RECORD=DIR`: at exit, every autotuner of the process that chose a config writes its choices to
  `DIR/<pid>.json` (`record`); `merge` folds such files into one table.
- `DFLASH_AUTOTUNE_PIN=FILE` (or a directory of such tables: the one recorded with this machine's versions and GPU):
  the table is loaded before the first kernel runs; an autotuner meeting a key the table holds takes its config
  without timing the candidates (`pin`); any other key (another shape: some keys hold a batch or block count)
  autotunes as before. A table made with other Triton or fla versions, or on another GPU, is ignored with a warning.

Both hook `triton.runtime.autotuner.Autotuner.run` (fla's caching autotuner derives from it), so they work whatever
imports the kernels and whenever. Nothing here runs unless one of the two variables is set (`from_env`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CONFIG_FIELDS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def tuner_name(tuner) -> str:
    fn = getattr(tuner, "base_fn", None) or getattr(tuner, "fn", None)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', type(fn).__name__)}"


def versions() -> dict:
    from importlib import metadata

    import torch

    try:
        import triton
    except ImportError:  # (no kernels to pin here)
        return {"triton": None, "fla": None, "gpu": "cpu"}
    try:
        fla = metadata.version("fla-core")
    except metadata.PackageNotFoundError:
        fla = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"triton": triton.__version__, "fla": fla, "gpu": gpu}


def config_record(cfg) -> dict:
    return {"kwargs": dict(cfg.kwargs), **{k: getattr(cfg, k, None) for k in CONFIG_FIELDS}}


def choices() -> dict:
    """{kernel: [[key, config], …]} of every autotuner of this process that has chosen (its cache)."""
    import gc

    from triton.runtime.autotuner import Autotuner

    out: dict[str, list] = {}
    for obj in gc.get_objects():  # (type(), not isinstance: a dead weak proxy raises on __class__)
        if issubclass(type(obj), Autotuner) and getattr(obj, "cache", None):
            rows = out.setdefault(tuner_name(obj), [])
            rows += [[list(k), config_record(c)] for k, c in obj.cache.items() if [list(k), config_record(c)] not in rows]
    return out


def record(directory: str) -> None:
    """Write this process's choices to `directory/<pid>.json` (at exit; nothing when none was made)."""
    try:
        table = choices()
    except ImportError:
        return
    if table:
        Path(directory).mkdir(parents=True, exist_ok=True)
        Path(directory, f"{os.getpid()}.json").write_text(json.dumps({**versions(), "kernels": table}, sort_keys=True))


def merge(files: list[Path], first_wins: bool = False) -> dict:
    """One table from the `record` files of one machine (their versions must agree). Two records choosing differently
    for one key (the candidates timed within noise of each other) raise — or, with `first_wins`, the earlier file's
    choice is kept and the key listed under "unsettled"."""
    out: dict = {}
    for f in files:
        t = json.loads(Path(f).read_text())
        head = {k: t[k] for k in ("triton", "fla", "gpu")}
        if out and {k: out[k] for k in head} != head:
            raise ValueError(f"{f}: recorded with {head}, the others with {({k: out[k] for k in head})}")
        out.update(head)
        for u in t.get("unsettled", []):  # (a merged table merged again keeps what it found unsettled)
            if u not in out.setdefault("unsettled", []):
                out["unsettled"].append(u)
        for name, rows in t["kernels"].items():
            have = out.setdefault("kernels", {}).setdefault(name, [])
            for key, cfg in rows:
                other = next((c for k, c in have if k == key), None)
                if other is None:
                    have.append([key, cfg])
                elif other != cfg and first_wins:
                    if [name, key] not in out.setdefault("unsettled", []):
                        out["unsettled"].append([name, key])
                elif other != cfg:
                    raise ValueError(f"{f}: {name} chose {cfg} for {key}, another record {other}: autotuning is "
                                     f"not settled there; keep one record of that kernel (or merge --first_wins)")
    return out


def table_for(path: str, warn: bool = True) -> tuple[Path | None, dict]:
    """(the table file, its contents) that `DFLASH_AUTOTUNE_PIN` names for this machine: the file itself, or in a
    directory of tables the one recorded with this machine's Triton, fla and GPU; (None, {}) when none matches —
    then the kernels autotune, and a warning says why."""
    here = versions()
    files = sorted(Path(path).glob("*.json")) if Path(path).is_dir() else [Path(path)]
    seen, found = [], []
    for f in files:
        try:
            table = json.loads(f.read_text())
            if not isinstance(table, dict) or not isinstance(table.get("kernels"), dict):
                raise ValueError("not an autotuner table")
        except (OSError, ValueError) as e:  # (a stray or half-written file is passed over, and named)
            seen.append(f"{f.name}: unreadable ({type(e).__name__}: {e})"[:200])
            continue
        if {k: table.get(k) for k in here} == here:
            found.append((f, table))
        else:
            seen.append(f"{f.name}: {({k: table.get(k) for k in here})}")
    if len(found) > 1 and warn:
        print(f"warning: {len(found)} autotuner tables in {path} match {here}: {found[0][0].name} pinned",
              file=sys.stderr)
    if found:
        return found[0]
    if warn:
        print(f"warning: no autotuner table in {path} was recorded with this machine's {here} ({'; '.join(seen) or 'none'}"
              f"): not pinned, the kernels autotune", file=sys.stderr)
    return None, {}


def pin(table_file: str) -> int:
    """Make every autotuner take the recorded config for a key the table (`table_for`: a file, or a directory of
    them) holds; returns the number of keys (0 when no table was made with these versions on this GPU: then none is
    pinned, and that is said)."""
    import inspect

    if versions()["triton"] is None:  # (no Triton here: no kernel to pin)
        return 0
    import triton
    from triton.runtime.autotuner import Autotuner
    found, table = table_for(table_file)
    if found is None:
        return 0
    accepted = set(inspect.signature(triton.Config).parameters)
    pinned = {name: [(tuple(k), c) for k, c in rows] for name, rows in table["kernels"].items()}
    original = Autotuner.run

    def run(self, *args, **kwargs):
        if not getattr(self, "_dflash_pinned", False):
            self._dflash_pinned = True
            for key, c in pinned.get(tuner_name(self), []):
                extra = {k: c[k] for k in CONFIG_FIELDS if k in accepted and c.get(k) is not None}
                self.cache.setdefault(key, triton.Config(c["kwargs"], **extra))
        return original(self, *args, **kwargs)

    Autotuner.run = run
    pin.file = found
    return sum(len(rows) for rows in pinned.values())


def pinned_table() -> str | None:
    """SHA-256 of the table `DFLASH_AUTOTUNE_PIN` names (None when none): a kernel config can change float rounding,
    so what keys results on the numerics (the evaluation's reused baseline) names it."""
    from .cache.fsio import sha256_file

    path = os.environ.get("DFLASH_AUTOTUNE_PIN")
    found = table_for(path, warn=False)[0] if path else None
    return sha256_file(found) if found else None


def from_env() -> None:
    """What `DFLASH_AUTOTUNE_RECORD` / `DFLASH_AUTOTUNE_PIN` ask for (every stage's `run_cli` calls this)."""
    if path := os.environ.get("DFLASH_AUTOTUNE_PIN"):
        n = pin(path)
        if n:
            print(f"[autotune] {n} kernel configs pinned from {pin.file}", file=sys.stderr, flush=True)
    if directory := os.environ.get("DFLASH_AUTOTUNE_RECORD"):
        import atexit

        atexit.register(record, directory)


def main(argv: list[str]) -> int:
    """`python -m dflash_offline.autotune merge --out=TABLE [--first_wins=1] RECORD.json…`: one pinnable table from a
    machine's records (`DFLASH_AUTOTUNE_RECORD`, named by process id: give them in the order they were made, e.g.
    `ls DIR | sort -n`), or from tables merged before; with --first_wins, the first record's choice is kept where
    two records chose differently."""
    args = [a for a in argv if not a.startswith("--")]
    flags = dict(a[2:].split("=", 1) if "=" in a else (a[2:], "1") for a in argv if a.startswith("--"))
    out, first_wins = flags.pop("out", None), flags.pop("first_wins", "0") not in ("0", "false", "False")
    if args[:1] != ["merge"] or not out or len(args) < 2 or flags:
        print(f"error: {'unknown ' + ', '.join('--' + k for k in flags) if flags else 'usage'}\n{main.__doc__}",
              file=sys.stderr)
        return 2
    try:
        table = merge([Path(a) for a in args[1:]], first_wins=first_wins)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    Path(out).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    n = sum(len(r) for r in table.get("kernels", {}).values())
    print(f"{out}: {n} keys of {len(table.get('kernels', {}))} kernels ({table['gpu']}, Triton {table['triton']}, fla "
          f"{table['fla']}); {len(table.get('unsettled', []))} unsettled (the first record's choice kept)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
