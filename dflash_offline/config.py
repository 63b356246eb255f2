"""Stage configs: one dataclass per stage, loaded from a TOML recipe and overridden by `--key=value`.

A recipe (manifests/*.toml) has one table per stage (`[tokenize]`, `[extract]`, `[train]`, ...). Every field has a
one-line comment, which `--help` shows (`field_help`); required fields have no default. `resolve()` checks a config.

A config may be composed of groups of settings declared beside the code that owns them (a field whose default is
another config dataclass: `is_group`); training's `TrainConfig` (`dflash_offline.trainsetup`) is, with the drafter's
settings in `drafter.py`, the loss's in `loss.py`, the optimizer's in `optim.py`, the schedule's and the compute
setup's in `trainsetup.py`. Settings stay flat wherever a user meets them: a recipe's table, `--key=value`, `--help`
and a run's recorded config (`as_dict`) name each by its own name, unique over the groups (`settings`), and `compose`
routes each to the group that declares it; code reads them by their group (`cfg.optim.lr`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config, recipe or command-line value is wrong; the message says which and what to do."""


# every recipe table some stage reads (tokenize; extract reads [extract] + [tokenize]; verify; train; evaluate reads
# [eval]; export): any other section in a recipe is a typo, refused rather than silently ignored
RECIPE_SECTIONS = ("tokenize", "extract", "verify", "train", "eval", "export", "testbed")
# the configs of stages whose settings come from the command line only (no recipe table: `--recipe` is refused)
COMMAND_LINE_SECTIONS = ("regen", "report", "build_tiny", "demo_outputs", "status")

# the make variable that sets a field (Makefile): messages about that field name both spellings. One name per
# concept on every stage: --cache (CACHE=) a hidden-state cache, read or written; --tokens (TOKENS=) a token cache;
# --run (RUN=) a run directory; --export (EXPORT=) an export directory; --target (TARGET=) the target checkpoint;
# --out only a file or directory a stage writes that is none of these (regen's JSONL: OUT=; eval's JSON report:
# ARGS=--out=, since make eval's OUT= named the export before)
MAKE_VARS = {
    "tokenize": {"corpus": "CORPUS", "tokenizer": "TARGET", "tokens": "TOKENS"},
    "extract": {"target": "TARGET", "tokens": "TOKENS", "cache": "CACHE", "shards": "SHARD", "dry_run": "DRY_RUN"},
    "verify": {"cache": "CACHE", "rows": "ROWS"},
    "train": {"cache": "CACHE", "run": "RUN", "resume": "RESUME"},
    "eval": {"run": "RUN", "export": "EXPORT", "prompts": "PROMPTS", "untrained": "UNTRAINED", "cache": "CACHE"},
    "export": {"run": "RUN", "export": "EXPORT", "step": "STEP", "dtype": "DTYPE"},
    "testbed": {"dir": "TESTBED_DIR", "from_phase": "TESTBED_FROM", "seeds": "SEEDS"},
    "regen": {"target": "TARGET", "engine": "ENGINE", "model": "MODEL", "corpus": "CORPUS", "out": "OUT",
              "thinking": "THINKING"},
    "report": {"run": "RUN"},
    "status": {"cache": "CACHE", "json": "JSON"},
    "demo_outputs": {"dir": "DEMO_DIR"},
}


# settings that are gone, by section: what the code does instead, told to a recipe or command line that still sets one
REMOVED = {
    "train": {
        "optimizer_overlap": "the optimizer update overlapping the next forward was removed (within the run-to-run "
                             "spread, docs/benchmarks.md): the update runs after the backward, before the next step",
        "fp8_recipe": "the choice of float8 scaling was removed (rowwise ran the 27B drafter's linears at 1.11x bf16 "
                      "against tensorwise's 1.51x on an H200, docs/benchmarks.md): precision=fp8 scales tensorwise; "
                      "drop the setting",
    },
}
# choices that are gone, by "section.field": what to use instead
REMOVED_CHOICES = {
    "train.attn": {
        "flex_joint": "the joint flex call over [context | block] keys was removed (within the run-to-run spread, ~2 "
                      "min more compile): attn=flex runs flex over the context keys plus a dense block part",
    },
}


# names a user may try as a setting for what the environment controls: what to set instead
BY_ENVIRONMENT = dict.fromkeys(
    ("progress", "progress_bar", "bar", "no_bar", "tqdm", "quiet"),
    "the progress bar (stderr) is switched off by the environment: DFLASH_NO_BAR=1 make ... (status.json and the "
    "timed log lines stay)")


def removed(section: str, name: str) -> str:
    """': <what happened to it>' for a removed setting of `section` (or one the environment sets), else ''."""
    why = REMOVED.get(section, {}).get(name) or BY_ENVIRONMENT.get(name)
    return f": {why}" if why else ""


# settings renamed, by recipe section: old name → (new name, what it names). An old name on a command line or in a
# recipe is refused in one line naming the new one; a manifest recorded with an old name is read under the new one.
RENAMED = {
    "tokenize": {"out": ("tokens", "the token cache written")},
    "extract": {"hidden_out": ("cache", "the hidden cache written")},
    "export": {"out": ("export", "the export directory written")},
}


def check_renamed(names, specs: list, where: str) -> None:
    """Refuse an old setting name of one of `specs` ((cls, section) pairs) that no config there still has, in one
    line: '<where>: --hidden_out is now --cache (the hidden cache written)'. `where`: the stage, or 'recipe X: [sec]'."""
    current = {name for cls, _ in specs for name in setting_names(cls)}
    for sec in (sec for _, sec in specs):
        for old in sorted(set(names) & set(RENAMED.get(sec, {})) - current):
            new, what = RENAMED[sec][old]
            dash = "" if where.startswith("recipe") else "--"
            raise is_now(where, f"{dash}{old}", f"{dash}{new}", what)


def is_now(where: str, old: str, new: str, what: str) -> ConfigError:
    """The one-line refusal of an old spelling, naming the one to use: '<where>: <old> is now <new> (<what>)'."""
    return ConfigError(f"{where + ': ' if where else ''}{old} is now {new} ({what})")


def upgrade_recorded(section: str, values: dict) -> dict:
    """A config recorded (in a manifest) under old setting names, with the current ones."""
    renamed = RENAMED.get(section, {})
    return {renamed[k][0] if k in renamed else k: v for k, v in values.items()}


def flag(section: str, name: str) -> str:
    """How a user sets a field: '--run (make RUN=)' where make has a variable for it, else '--steps'."""
    var = MAKE_VARS.get(section, {}).get(name)
    return f"--{name} (make {var}=)" if var else f"--{name}"


@dataclass
class TokenizeConfig:
    corpus: list[str]  # chat JSONL/Parquet or pre-tokenized Arrow/Parquet files; globs allowed
    tokenizer: str  # directory holding the target's tokenizer (usually the target checkpoint itself)
    cache_root: str = "cache"  # where caches live; a token cache goes to <cache_root>/tokens-<key12>
    tokens: str = ""  # token cache directory written (overrides the content-addressed default under cache_root)
    seq_len: int = 4096  # fixed row length in tokens
    rows_per_shard: int = 256  # rows per token shard (the last shard may hold fewer)
    long_doc: str = "split"  # documents longer than seq_len: "split" into seq_len chunks, "truncate", or "skip"
    thinking: str = "keep"  # assistant reasoning: "keep" (rendered by the chat template) or "strip"
    turns: str = "last"  # samples per chat: "last" (the whole conversation) or "each" (one per assistant turn)
    empty_think: str = "prompt"  # an empty think block the template inserts: "prompt" (unsupervised) or "supervise"
    strict: bool = False  # stop at the first malformed record instead of skipping and counting it
    partial_regen: bool = False  # tokenize a make regen output whose run has not finished (OUT.stats.json: complete false) instead of refusing it
    open_rows: int = 64  # packing window: rows kept open for best-fit placement (more = less padding)
    workers: int = 0  # tokenizer processes; 0 = one per CPU this process may use (affinity, cgroup CPU quota)
    chunk_docs: int = 256  # documents per unit of work sent to a tokenizer process
    max_docs: int = 0  # stop after this many records (0 = all); part of the cache key
    template_kwargs: str = ""  # chat template settings the corpus was generated with, a JSON object, e.g. '{"reasoning_effort": "low"}' (Qwen3.8); part of the cache key

    def resolve(self) -> TokenizeConfig:
        if self.seq_len <= 0:
            raise ConfigError(f"tokenize.seq_len must be > 0, got {self.seq_len}")
        check_choice("tokenize.long_doc", self.long_doc, ("split", "truncate", "skip"))
        check_choice("tokenize.thinking", self.thinking, ("keep", "strip"))
        check_choice("tokenize.turns", self.turns, ("last", "each"))
        check_choice("tokenize.empty_think", self.empty_think, ("prompt", "supervise"))
        if not self.corpus:
            raise ConfigError("tokenize.corpus is empty: give at least one file or glob (CORPUS=...)")
        from .chat import parse_settings

        try:
            parse_settings(self.template_kwargs)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name in ("rows_per_shard", "open_rows", "chunk_docs"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"tokenize.{name} must be > 0, got {getattr(self, name)}")
        return self


@dataclass
class ExtractConfig:
    target: str  # target checkpoint: a local directory (or a hub id already in the local HF cache)
    tokens: str = ""  # token cache directory: a complete one is read as it is; else (or empty) stage 1a writes it with this recipe's [tokenize] table
    cache_root: str = "cache"  # a hidden-state cache goes to <cache_root>/hidden-<key12>
    cache: str = ""  # hidden-state cache directory written (overrides the content-addressed default under cache_root)
    num_draft_layers: int = 5  # drafter depth, for the default tapped-layer formula
    layer_ids: list[int] = field(default_factory=list)  # tapped 0-based layer outputs; empty = DFlash default
    quant: str = "bf16"  # stored hidden states: "bf16", "fp8" (e4m3 with per-token, per-layer scales) or "fp4" (4-bit e2m1 + e4m3 scale per 16 values + float32 per token and layer)
    dtype: str = "bfloat16"  # compute dtype of the target: "bfloat16" (real runs) or "float32" (exactness tests)
    project_dims: int = 0  # projected taps: store z = Pᵀh, k values per tapped layer (multiple of 32, ≤ hidden); 0 = full states
    project_rows: int = 64  # projected taps: rows (the token cache's first) whose E[h hᵀ] gives P, its top-k eigenvectors
    from_cache: str = ""  # derive this cache (quant, project_dims, fewer taps) from a complete bf16 cache of the same bfloat16 target and tokens, reading its states instead of running the target (its key; empty: from the target)
    mask_token_id: int = -1  # the drafter's mask token, validated here (-1 = read from the target's sidecar)
    batch_rows: int = 1  # rows per target forward (fixed shape)
    shards: str = ""  # redo exactly these shards ("3", "0-4,7"), even if committed; empty = every uncommitted one
    device: str = "auto"  # "auto" (cuda when available), "cuda" or "cpu"
    mode: str = "auto"  # document isolation: "auto", "packed" (fla varlen kernels, GPU) or "per_doc"
    lease_s: float = 900.0  # a claimed shard not committed within this many seconds may be taken over
    wait_claims: bool = False  # at the end, wait for shards other live processes hold (else exit 2 naming them)
    dry_run: bool = False  # validate, estimate size and time, check kernels, then stop before loading weights
    min_free_gb: float = 2.0  # refuse to start unless the cache's filesystem keeps this much room after the run
    allow_overfill: bool = False  # start even when the shards to do do not fit in free space (less min_free_gb)
    write_queue: int = 3  # shards being written in the background at once (pinned host memory: one shard more)
    plan_gpus: int = 8  # GPUs the dry run's storage plan sizes training's read bandwidth and wall time for
    plan_extract_tok_s: float = 0.0  # plan: extraction tok/s per GPU; 0 = measured on an H200, scaled to the target
    plan_train_tok_s: float = 0.0  # plan: training context tok/s per GPU; 0 = measured on an H200, scaled to the drafter
    plan_regen_tok_s: float = 0.0  # plan: the engine's generated tok/s per GPU for regen; 0 = not measured (no GPU-hours)
    plan_read_gb_s: float = 0.0  # plan: verify's re-hash rate, GB/s (the filesystem's read rate); 0 = SHA-256 × 8 threads

    def resolve(self) -> ExtractConfig:
        from .cache.encodings import ENCODINGS  # (torch: imported when an extraction is configured)

        check_choice("extract.quant", self.quant, tuple(ENCODINGS))
        check_choice("extract.dtype", self.dtype, ("bfloat16", "float32"))
        check_choice("extract.device", self.device, ("auto", "cuda", "cpu"))
        check_choice("extract.mode", self.mode, ("auto", "packed", "per_doc"))
        if self.batch_rows <= 0:
            raise ConfigError(f"extract.batch_rows must be > 0, got {self.batch_rows}")
        if self.write_queue <= 0:
            raise ConfigError(f"extract.write_queue must be > 0, got {self.write_queue}")
        if self.plan_gpus <= 0:
            raise ConfigError(f"extract.plan_gpus must be > 0, got {self.plan_gpus}")
        if min(self.plan_extract_tok_s, self.plan_train_tok_s, self.plan_regen_tok_s, self.plan_read_gb_s) < 0:
            raise ConfigError("extract.plan_extract_tok_s, plan_train_tok_s, plan_regen_tok_s and plan_read_gb_s must "
                              "be >= 0 (0 = the measured or estimated rate)")
        if self.layer_ids and len(set(self.layer_ids)) != len(self.layer_ids):
            raise ConfigError(f"extract.layer_ids {self.layer_ids} has duplicates")
        if self.project_dims < 0 or self.project_dims % 32:
            raise ConfigError(f"extract.project_dims={self.project_dims}: give a multiple of 32 (whole fp4 blocks and "
                              f"bytes, for every quant), e.g. 256 or 512, or 0 to store full states")
        if self.project_dims and self.project_rows <= 0:
            raise ConfigError(f"extract.project_rows must be > 0 with project_dims set, got {self.project_rows}")
        parse_shard_list(self.shards)
        return self


@dataclass
class VerifyConfig:
    cache: str  # hidden-state cache directory to verify
    target: str = ""  # target checkpoint; empty = the one the cache was extracted from
    rows: int = 2  # rows per shard recomputed with the target (0 = hashes only)
    tol: float = 0.02  # max relative L2 error per layer, bf16 recompute vs stored (FP8 caches: at least 0.06, FP4: 0.15)
    device: str = "auto"  # "auto", "cuda" or "cpu"
    mode: str = "auto"  # document isolation for the recompute: "auto", "packed" or "per_doc"

    def resolve(self) -> VerifyConfig:
        check_choice("verify.device", self.device, ("auto", "cuda", "cpu"))
        check_choice("verify.mode", self.mode, ("auto", "packed", "per_doc"))
        return self


def is_group(f: dataclasses.Field) -> bool:
    """A field holding a group of settings (another config dataclass, declared beside the code that owns them)."""
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)


def settings(cls) -> list[tuple[dataclasses.Field, type, str]]:
    """Every setting of `cls` as (field, the class that declares it, the group field holding that class; '' for
    `cls`'s own), in order, a group's settings where the group is declared. Names are unique over the groups."""
    out = []
    for f in dataclasses.fields(cls):
        if is_group(f):
            out += [(g, owner, f.name) for g, owner, _ in settings(f.default_factory)]
        else:
            out.append((f, cls, ""))
    names = [f.name for f, _, _ in out]
    assert len(set(names)) == len(names), f"{cls.__name__}: a setting name repeats across its groups"
    return out


def setting_names(cls) -> list[str]:
    return [f.name for f, _, _ in settings(cls)]


def setting_types(cls) -> dict:
    """Each setting's type, from the class that declares it."""
    hints = {}
    for _, owner, _ in settings(cls):
        if owner not in hints:
            hints[owner] = typing.get_type_hints(owner)
    return {f.name: hints[owner][f.name] for f, owner, _ in settings(cls)}


def compose(cls, values: dict):
    """`cls` from flat settings, each given to the group that declares it (not resolved)."""
    groups = {f.name: f.default_factory for f in dataclasses.fields(cls) if is_group(f)}
    where = {f.name: group for f, _, group in settings(cls)}
    unknown = sorted(set(values) - set(where))
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting {unknown[0]!r}")
    parts: dict[str, dict] = {g: {} for g in groups}
    own = {}
    for k, v in values.items():
        (parts[where[k]] if where[k] else own)[k] = v
    return cls(**own, **{g: groups[g](**kw) for g, kw in parts.items()})


def parse_shard_list(text: str, num_shards: int | None = None) -> list[int]:
    """'0-3,7' → [0, 1, 2, 3, 7] (the SHARD= syntax; `cache.manifest.shard_list` writes it); with `num_shards`, a
    number past the cache's last shard is refused (before a range is expanded: SHARD=0-99999999999 is one line)."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        try:
            a, b = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part),) * 2
            if b < a or a < 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"SHARD={text!r}: expected shard numbers and ranges like 3 or 0-4,7") from None
        if num_shards is not None and b >= num_shards:
            raise ConfigError(f"SHARD={text}: the cache has shards 0..{num_shards - 1}")
        out += range(a, b + 1) if num_shards is not None or b - a < 1 << 20 else (a, b)  # (checked, not listed)
    return sorted(set(out))


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        why = REMOVED_CHOICES.get(name, {}).get(value)
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}{f': {why}' if why else ''}")


# --- loading -------------------------------------------------------------------------------------------------


def _coerce(name: str, text: str, typ, section: str = "") -> object:
    """Turn a command-line string into the field's type."""
    origin = typing.get_origin(typ)
    if origin in (list, tuple):
        (inner,) = typing.get_args(typ)[:1]
        if text.strip().startswith("["):
            items = json.loads(text)
        else:
            items = [t for t in text.split(",") if t.strip()]
        return [_coerce(name, str(t), inner, section) for t in items]
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        return _coerce(name, text, args[0], section)
    try:
        if typ is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if typ is str:  # (an item of a comma-separated list: `--corpus=~/a.jsonl,~/b.jsonl`)
            return home(text, flag(section, name))
        if typ in (int, float):
            return typ(text)
    except ValueError:
        what = {bool: "0 or 1", int: "an integer", float: "a number"}.get(typ, f"a {typ.__name__}")
        raise ConfigError(f"{flag(section, name)}: expected {what}, got {text!r}") from None
    raise ConfigError(f"--{name}: unsupported field type {typ}")


def _check_type(section: str, name: str, value, typ) -> object:
    if typ is str and name == "template_kwargs" and isinstance(value, dict):  # a TOML table: the JSON object it is
        return json.dumps(value, sort_keys=True)
    if isinstance(value, str):  # (a recipe's path with ~; the command line's are expanded in `parse_overrides`)
        value = home(value, flag(section, name))
    if isinstance(value, str) and typ is not str:
        return _coerce(name, value, typ, section)
    origin = typing.get_origin(typ) or typ
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin in (list, tuple):
        if isinstance(value, str):
            return [value]
        if isinstance(value, list):
            value = [home(v, flag(section, name)) if isinstance(v, str) else v for v in value]
        if not isinstance(value, list):
            raise ConfigError(f"[{section}] {name} = {value!r}: expected a list")
        return list(value)
    if isinstance(origin, type) and not isinstance(value, origin):
        raise ConfigError(f"[{section}] {name} = {value!r}: expected {origin.__name__}")
    return value


def parse_overrides(argv: list[str], specs: list = ()) -> tuple[str | None, dict[str, str]]:
    """Split `--recipe=path` and `--key=value` arguments; anything else is an error. One spelling per setting on
    every stage: a hyphenated name (`--eval-docs=3`) or a bare switch (`--json`, a 0/1 setting of `specs`) is refused
    in one line naming the one to use (`--eval_docs=3`, `--json=1`), prefixed by the stage (`specs`: its (cls,
    section) pairs)."""
    where = specs[0][1] if specs else ""
    switches = {name for cls, _ in specs for name, typ in setting_types(cls).items() if typ is bool}
    recipe, out = None, {}
    for arg in argv:
        if arg.startswith("--") and "-" in (name := arg[2:].split("=", 1)[0]):
            raise is_now(where, f"--{name}", f"--{name.replace('-', '_')}", "underscores, as every stage")
        if arg.startswith("--") and arg[2:] in switches:
            raise is_now(where, arg, f"{arg}=1", "every setting is --key=value; a switch's value is 1 or 0")
        if arg.startswith("--") and arg[2:] in BY_ENVIRONMENT and arg[2:] not in {n for c, _ in specs
                                                                               for n in setting_names(c)}:
            raise ConfigError(f"{arg}: unknown setting{removed('', arg[2:])}")
        if not arg.startswith("--") or "=" not in arg:
            form = f"{arg}=VALUE, one argument" if arg.startswith("--") else "--key=value"
            raise ConfigError(f"argument {arg!r}: expected {form} (see --help)")
        key, value = arg[2:].split("=", 1)
        if key == "recipe":
            recipe = home(value, "--recipe")
        else:
            out[key] = home(value, f"--{key}")
    return recipe, out


def home(text: str, where: str) -> str:
    """`text` with a leading `~` or `~/` as the user's home: the shell expands `~` only at a word's start, so in
    `--run=~/r` it reaches the stage as typed (and in a recipe, or quoted, always). A directory named `~` here
    (what a path spelt so made before it was expanded) makes `~/…` ambiguous: refused, naming both."""
    if text != "~" and not text.startswith("~/"):
        return text
    if Path("~").exists():
        raise ConfigError(f"{where}={text}: there is a directory named ~ in {Path.cwd()}; give "
                          f"{Path(text).expanduser()} or ./{text} (rename that directory to make ~/… mean the home "
                          f"directory again)")
    return str(Path(text).expanduser())


def did_you_mean(name: str, choices, fmt: str = "{}") -> str:
    """'; did you mean X?' naming the nearest valid choice, or '' when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {fmt.format(close[0])}?" if close else ""


def read_recipe(recipe: str) -> dict:
    """A recipe's tables by section; a section no stage reads, or a key outside any section, is an error."""
    path = Path(recipe)
    if not path.is_file():
        raise ConfigError(f"recipe {recipe} not found: pass --recipe=manifests/<name>.toml (RECIPE= in make)")
    try:
        tables = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"recipe {recipe}: invalid TOML: {e}") from None
    sections = ", ".join(f"[{s}]" for s in RECIPE_SECTIONS)
    for name, value in tables.items():
        if not isinstance(value, dict):
            raise ConfigError(f"recipe {recipe}: {name} = {value!r} is outside any section: move it under the section "
                              f"of the stage that reads it ({sections})")
        if name not in RECIPE_SECTIONS:
            raise ConfigError(f"recipe {recipe}: unknown section [{name}]{did_you_mean(name, RECIPE_SECTIONS, '[{}]')} "
                              f"(sections: {sections})")
    return tables


def recipe_values(tables: dict, recipe: str | None, cls, section: str) -> dict:
    """The recipe's `[section]` table for `cls`; a key that is not one of its fields is an error."""
    table = dict(tables.get(section, {}))
    check_renamed(table, [(cls, section)], f"recipe {recipe}: [{section}]")
    known = setting_names(cls)
    unknown = sorted(set(table) - set(known))
    if unknown:
        if why := removed(section, unknown[0]):
            raise ConfigError(f"recipe {recipe}: unknown setting {unknown[0]} in [{section}]{why}")
        raise ConfigError(f"recipe {recipe}: unknown setting {unknown[0]} in [{section}]"
                          f"{did_you_mean(unknown[0], known)} (settings of [{section}]: {', '.join(known)})")
    return table


def check_overrides(overrides: dict[str, str], classes: list, sections: tuple[str, ...] = ()) -> None:
    """Every `--key=value` must name a field of one of the stage's configs (of `sections`: a removed one is told so)."""
    known = [name for cls in classes for name in setting_names(cls)]
    unknown = sorted(set(overrides) - set(known))
    for sec in sections:
        if unknown and (why := removed(sec, unknown[0])):
            raise ConfigError(f"--{unknown[0]}: unknown setting{why}")
    if unknown and unknown[0] in BY_ENVIRONMENT:
        raise ConfigError(f"--{unknown[0]}: unknown setting{removed('', unknown[0])}")
    if unknown:
        raise ConfigError(f"--{unknown[0]}: unknown setting{did_you_mean(unknown[0], known, '--{}')} (see --help "
                          f"for the settings)")


def build_config(cls, section: str, values: dict):
    """`cls` from checked values: types coerced, required fields present, each in its group, then `resolve()`."""
    assert section in RECIPE_SECTIONS + COMMAND_LINE_SECTIONS, \
        f"[{section}] is read by a stage: add it to RECIPE_SECTIONS (or COMMAND_LINE_SECTIONS)"
    known = setting_names(cls)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown {section} setting {unknown[0]}{did_you_mean(unknown[0], known)} (settings: "
                          f"{', '.join(known)})")
    hints = setting_types(cls)
    kwargs = {k: _check_type(section, k, v, hints[k]) for k, v in values.items()}
    missing = [
        f.name
        for f, _, _ in settings(cls)
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing required {section} setting(s): {', '.join(flag(section, m) for m in missing)}")
    return compose(cls, kwargs).resolve()


def load_config(cls, section: str, recipe: str | None, overrides: dict[str, str], base: dict | None = None):
    """Build `cls` from `base` (values from elsewhere, e.g. a cache's manifest), updated by a recipe's `[section]`
    table, then by `--key=value` overrides; empty override = keep."""
    tables = read_recipe(recipe) if recipe else {}
    check_renamed(overrides, [(cls, section)], section)
    check_overrides(overrides, [cls], (section,))
    values = dict(base or {})
    values.update(recipe_values(tables, recipe, cls, section))
    values.update({k: v for k, v in overrides.items() if v != ""})
    return build_config(cls, section, values)


# settings whose empty override (`--key=`) clears a recipe's value instead of keeping it: the Makefile never passes
# them empty, so an empty one is the user's (ARGS=--from_cache=: compute from the target, not a recipe's source)
EMPTY_CLEARS = {("extract", "from_cache")}


def applied_overrides(section: str, overrides: dict[str, str], names) -> dict[str, str]:
    """The overrides of `section`'s settings `names` that replace a recipe's (or a recorded) value: every one given
    non-empty, and an empty one where EMPTY_CLEARS says it clears."""
    return {k: v for k, v in overrides.items() if k in names and (v != "" or (section, k) in EMPTY_CLEARS)}


def configs_from_argv(specs: list[tuple[type, str]], argv: list[str], doc: str, defaults=None) -> list:
    """Several stage configs from one command line: each `--key=value` goes to every config that has that field.

    `defaults(section, values, earlier)` may fill fields from configs resolved before it (e.g. tokenizer =
    extract.target); `earlier` maps section → config.
    """
    if any(a in ("-h", "--help") for a in argv):
        print(doc.strip() + "\n\n" + "\n\n".join(f"[{sec}] " * (len(specs) > 1) + describe(cls, sec)
                                               for cls, sec in specs))
        sys.exit(0)
    where = specs[0][1]
    recipe, overrides = parse_overrides(argv, specs)
    if recipe is not None and not any(sec in RECIPE_SECTIONS for _, sec in specs):
        raise ConfigError(f"{where}: --recipe is not read (its settings are given on the command line only: see "
                          f"--help)")
    check_renamed(overrides, specs, where)
    check_overrides(overrides, [cls for cls, _ in specs], tuple(sec for _, sec in specs))
    check_repeated(argv, specs, where)
    tables = read_recipe(recipe) if recipe else {}
    out, earlier = [], {}
    for cls, sec in specs:
        names = set(setting_names(cls))
        values = recipe_values(tables, recipe, cls, sec)
        values.update(applied_overrides(sec, overrides, names))
        if defaults:
            defaults(sec, values, earlier)
        earlier[sec] = build_config(cls, sec, values)
        out.append(earlier[sec])
    return out


def check_repeated(argv: list[str], specs: list, where: str) -> None:
    """Refuse a list setting given twice (the later one would silently replace the earlier), in one line:
    '<where>: --corpus is given 2 times: give its values comma separated in one, --corpus=a,b'."""
    lists = {name for cls, _ in specs for name, typ in setting_types(cls).items()
             if typing.get_origin(typ) in (list, tuple)}
    given = [a[2:].split("=", 1)[0] for a in argv]
    for name in sorted(lists):
        if given.count(name) > 1:
            raise ConfigError(f"{where}: --{name} is given {given.count(name)} times: give its values comma separated "
                              f"in one, --{name}=a,b")


def config_from_argv(cls, section: str, argv: list[str], doc: str):
    """One stage config from its command line: `configs_from_argv` with one config."""
    return configs_from_argv([(cls, section)], argv, doc)[0]


def field_help(cls) -> dict[str, str]:
    """Each field's help: the comment at the end of its line in `cls`'s source ('' where there is none); with the
    settings of its groups, from theirs."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize as tok

    source = textwrap.dedent(inspect.getsource(cls))
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tok.generate_tokens(io.StringIO(source).readline) if t.type == tok.COMMENT}
    (node,) = ast.parse(source).body
    out = {f.target.id: comments.get(f.end_lineno, "") for f in node.body
           if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}
    for f in dataclasses.fields(cls):
        if is_group(f):
            out.update(field_help(f.default_factory))
    return out


def describe(cls, section: str = "") -> str:
    """Field list with each field's help, default (or REQUIRED) and make variable."""
    helps = field_help(cls)
    fields = [f for f, _, _ in settings(cls)]
    width = max(len(f.name) for f in fields) + 2
    recipe = "" if section in COMMAND_LINE_SECTIONS else ", or --recipe=manifests/NAME.toml for a recipe"
    rows = [f"options (--key=value{recipe}):"]
    for f in fields:
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            default = "REQUIRED"
        else:
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = int(value) if isinstance(value, bool) else repr(value)
        var = MAKE_VARS.get(section, {}).get(f.name)
        rows.append(f"  {'--' + f.name:<{width}} {helps.get(f.name, '')}  [{default}{f'; make {var}=' if var else ''}]")
    return "\n".join(rows)


def as_dict(cfg) -> dict:
    """The config's settings as a flat dict (a group's settings in its place): what a run records and a recipe's
    table holds."""
    full, out = dataclasses.asdict(cfg), {}
    for f in dataclasses.fields(cfg):
        out.update(as_dict(getattr(cfg, f.name)) if is_group(f) else {f.name: full[f.name]})
    return out


__all__ = [
    "COMMAND_LINE_SECTIONS",
    "ConfigError",
    "ExtractConfig",
    "RECIPE_SECTIONS",
    "RENAMED",
    "TokenizeConfig",
    "VerifyConfig",
    "configs_from_argv",
    "parse_shard_list",
    "as_dict",
    "check_renamed",
    "check_repeated",
    "compose",
    "is_group",
    "setting_names",
    "setting_types",
    "settings",
    "config_from_argv",
    "describe",
    "field",
    "field_help",
    "flag",
    "load_config",
    "parse_overrides",
    "upgrade_recorded",
]
