"""Export a trained drafter in the z-lab DFlash checkpoint format (what vLLM, SGLang and transformers load).

`export(run_dir, out_dir)` writes, atomically (temp directory beside `out_dir`, then rename):

| file | holds |
| --- | --- |
| `config.json` | a Qwen3Config (`model_type` "qwen3", `architectures` ["DFlashDraftModel"], `auto_map` AutoModel → `dflash.DFlashDraftModel`) with the drafter's shapes, `block_size`, `dflash_config` {mask_token_id, mask_token (the target tokenizer's string for it, which SGLang checks), target_layer_ids, block_size; a DFlash2 drafter: `architectures` ["DFlash2DraftModel"], auto_map → `dflash.DFlash2DraftModel`, and conv_kernel_size, conv_group_size, selector_rank, selector_top_k}, `num_target_layers`, `layer_types`, sliding window (and `is_causal` false for a drafter trained with `block_attention` "bidirectional"), RoPE (`rope_parameters` and the legacy `rope_theta`) and `max_position_embeddings` of the target |
| `model.safetensors` | exactly the drafter's tensors under the z-lab names (`fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.{i}.…`; DFlash2 adds `layers.{i}.{attention_conv,mlp_conv}.{base_kernel,kernel_projection.weight}` and `candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection.weight}`, the codebooks without `.weight`, as z-lab names them), in `dtype`; never the target's embedding or lm_head |
| `dflash.py` | the modeling file `auto_map` names (a copy of `dflash_offline/zlab_dflash.py`, which holds both `DFlashDraftModel` and `DFlash2DraftModel`: torch + transformers only) |
| `dflash_export.json` | provenance: run, step, checkpoint, dtype, target, sha256 of the weights and of dflash.py (and the projection a run on projected taps was folded with); no absolute path of the exporting machine: the run relative to the export, the target (a hub id as named) and the projection's cache relative to the run (`provenance_paths` reads them back) |

A run trained on a projected cache (`[extract] project_dims`, `projection.py`) has an fc' of k inputs a tap: its
export folds it with the cache's P (the file checked against the manifest and against the SHA-256 the run recorded)
into the full-width fc, fc_t = fc'_t P_tᵀ, so its tensors and config.json are those of any other export.

Every file is a pure function of (checkpoint, dtype, target config[, projection]) and, for config.json, the
transformers version it records and the target tokenizer's mask token: exporting the same step again in the same
environment gives the same bytes (the weights' bytes in any). An existing `out_dir` is replaced only if it is empty or an earlier export of the same run (its
`dflash_export.json` names the same run directory); an export of another run only with `force=True`; a directory that
is not an export (no `dflash_export.json`: a cache, a run, files of its own), or the run itself or one above it, never;
nor an export that also holds files it did not write (a README, a `.git` added to publish it): the directory is
replaced whole.

Engines: vLLM `--speculative-config '{"method": "dflash", "model": OUT, "num_speculative_tokens": block_size-1}'`;
SGLang `--speculative-algorithm DFLASH --speculative-draft-model-path OUT` (`--speculative-dflash-block-size`
defaults to the config's block_size).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .cache.fsio import atomic_dir, sha256_file
from .cache.manifest import read_manifest

FORMAT = "dflash-offline-export"
FORMAT_VERSION = 1
MODELING_FILE = "dflash.py"
PROVENANCE = "dflash_export.json"
DTYPES = ("bfloat16", "float16", "float32")
FILES = ("config.json", "model.safetensors", MODELING_FILE, PROVENANCE)


class ExportError(ValueError):
    """The run, checkpoint, target or output directory does not allow an export; the message says what to do."""


@dataclass
class ExportConfig:
    run: str  # training run directory (make train RUN=...)
    export: str  # export directory written: the z-lab-format checkpoint
    step: int = -1  # checkpoint step to export; -1 = the latest
    dtype: str = "bfloat16"  # weight dtype: "bfloat16", "float16" or "float32"
    target: str = ""  # target checkpoint (for max_position_embeddings, token ids); empty = the run's target
    force: bool = False  # replace `export` where it is an export of another run (never a directory that is not an export)

    def resolve(self) -> ExportConfig:
        if self.dtype not in DTYPES:
            raise ExportError(f"export.dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not self.run or not self.export:
            raise ExportError("export needs --run=RUN (a training run directory) and --export=DIR (make EXPORT=)")
        return self


def modeling_source() -> str:
    return (Path(__file__).with_name("zlab_dflash.py")).read_text()


# --- reading the run -------------------------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"{path} does not exist: {what}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: unreadable ({e}); {what}") from None


def run_cache(run_cfg: dict) -> str | None:
    """The run's training cache where it is: as the run named it, else the absolute path its config.json records
    (read from another working directory); None when it is gone."""
    from .cache.manifest import has_manifest

    names = ((run_cfg.get("train") or {}).get("cache"), run_cfg.get("cache_dir"))
    return next((c for c in names if c and has_manifest(c)), None)


def run_target(run_dir: Path, run_cfg: dict, override: str = "") -> str:
    """The target checkpoint a run trained against: explicit > the one its config.json records (an absolute path) >
    its train.target > its cache's target (a run made before config.json recorded it: while the cache is there)."""
    if override:
        return override
    train = run_cfg.get("train") or {}
    if run_cfg.get("target") or train.get("target"):
        return run_cfg.get("target") or train["target"]
    cache = train.get("cache")
    if where := run_cache(run_cfg):
        try:
            return read_manifest(where)["config"]["extract"]["target"]
        except (OSError, ValueError, KeyError):
            pass
    raise ExportError(f"{run_dir}: cannot tell which target the run trained against (its cache {cache!r} is gone "
                      f"or unreadable); pass --target=/path/to/target/checkpoint (make export TARGET=)")


def check_trained_target(run_cfg: dict, cache, target_dir: Path, run_dir: Path, log, use: str, make: str) -> None:
    """`target_dir` must be the target the run's cache was extracted from (its drafter learned that target's states;
    Qwen3.5- and Qwen3.6-27B have one shape): its fingerprint against the one RUN/config.json records, else the
    training cache's while it is there; one line naming both and the fix (`use`: the stage, `make`: its make
    variable), before anything loads. A copy of the target elsewhere passes."""
    from dflash_offline.cache.manifest import ManifestError, has_manifest
    from dflash_offline.targetid import TargetError, target_mismatch

    recorded, where = run_cfg.get("target_id"), f"{run_dir}/config.json"
    if recorded is None and cache and has_manifest(cache):
        try:
            recorded, where = read_manifest(cache, kind="hidden")["producer"]["target"], f"{cache}"
        except (ManifestError, KeyError, TypeError):
            recorded = None
    if recorded is None:
        log(f"{run_dir} records no fingerprint of its target and its cache is gone: {target_dir} is not checked")
        return
    if not (diff := target_mismatch(str(target_dir), recorded, where)):
        return
    trained = run_cfg.get("target") or (run_cfg.get("train") or {}).get("target") or ""
    if trained and (trained == str(target_dir) or Path(trained).resolve() == Path(target_dir).resolve()):
        raise TargetError(f"target {target_dir} has changed since {run_dir} was trained for it ({'; '.join(diff)}): "
                          f"its drafter learned the states of the weights it held then; put them back")
    named = trained or "its cache's target"
    raise TargetError(f"{use} target {target_dir} is not the target {run_dir} was trained for ({named}; "
                      f"{'; '.join(diff)}): its drafter learned that target's states. Pass --target= ({make}) the "
                      f"run's target, or leave it empty")


def target_fields(target: str) -> dict:
    """The target's values the export copies: max_position_embeddings, RoPE theta, bos/eos/pad ids."""
    from dflash_offline.targetid import resolve_checkpoint

    try:
        path = resolve_checkpoint(target, need=("config",))
    except ValueError as e:
        raise ExportError(f"{e} (the export reads the target's config.json; pass --target=PATH: make export TARGET=)") from None
    raw = _read_json(path / "config.json", "the target checkpoint needs its config.json")
    text = raw.get("text_config") or raw

    def pick(name):
        return text.get(name, raw.get(name))

    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if pick("max_position_embeddings") is None:
        raise ExportError(f"{path}/config.json has no max_position_embeddings")
    return {"path": str(path), "max_position_embeddings": int(pick("max_position_embeddings")),
            "tokenizer": str(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else None,
            "rope_theta": None if theta is None else float(theta), "bos_token_id": pick("bos_token_id"),
            "eos_token_id": pick("eos_token_id"), "pad_token_id": pick("pad_token_id"),
            "shape": {"hidden_size": pick("hidden_size"), "vocab_size": pick("vocab_size"),
                      "num_target_layers": pick("num_hidden_layers")}}


SGLANG_MASK_TOKEN = "<|MASK|>"  # what SGLang adds to a tokenizer that has no mask token (at id len(tokenizer))


def mask_token_for(tokenizer_json: str | None, mask_id: int) -> str | None:
    """`dflash_config.mask_token`, the string SGLang maps back to an id and checks against `mask_token_id`: the
    tokenizer's own token at `mask_id`, or SGLANG_MASK_TOKEN when `mask_id` is the first row past the tokenizer
    (Qwen3's 151669: SGLang adds that token there). None without a tokenizer.json; an id further past the
    tokenizer has no string an engine can resolve, which is refused."""
    if tokenizer_json is None:
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    size = tok.get_vocab_size(with_added_tokens=True)
    if mask_id == size:
        return SGLANG_MASK_TOKEN
    if mask_id > size or tok.id_to_token(mask_id) is None:
        raise ExportError(f"mask_token_id {mask_id} is past the target tokenizer's {size} tokens by more than one: "
                          f"SGLang cannot resolve it to a token (it adds {SGLANG_MASK_TOKEN} at id {size}); "
                          f"train with a mask token inside the vocabulary or at {size}")
    return tok.id_to_token(mask_id)


# --- the z-lab config ------------------------------------------------------------------------------------------


def check_servable_taps(dc) -> None:
    """Refuse taps that vLLM and SGLang cannot feed the drafter as it was trained. Both capture the target's states
    walking its layers in order, each once, so `target_layer_ids` must be ascending; neither has the last layer's
    *normed* output, which a tap of layer N-1 holds here (as transformers' hidden_states[N]): vLLM takes that layer's
    output before the final norm, SGLang captures only before a layer (tests/test_engine_rules.py)."""
    ids, last = list(dc.target_layer_ids), dc.num_target_layers - 1
    if ids != sorted(set(ids)):
        raise ExportError(f"target_layer_ids {ids} are not ascending: vLLM and SGLang feed the tapped states to the "
                          f"drafter in ascending layer order, not in the order it was trained on; train with "
                          f"train.layer_ids={sorted(set(ids))}")
    if max(ids) >= last:
        raise ExportError(f"target_layer_ids {ids} tap the target's last layer {last}: vLLM feeds it before the "
                          f"final norm and SGLang cannot capture it, so no engine serves this drafter as trained; "
                          f"train on taps below {last} (train.layer_ids=...)")


# the architecture config.json names for each drafter variant (the class of the shipped dflash.py auto_map points at)
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
# DFlash2's settings in dflash_config, as z-lab's DFlash2 configs hold them (z-lab/dflash
# tests/fixtures/dflash2-config.json): flat keys beside block_size, mask_token_id and target_layer_ids
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def transformers_version() -> str:
    """The installed transformers' version, from its package metadata: importing transformers takes seconds (the
    testbed's first export of a call paid them); a copy without metadata (a source tree on the path) is imported."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        import transformers

        return transformers.__version__


def zlab_config(dc, tgt: dict, dtype: str) -> dict:
    """config.json of the exported drafter (`dc`: DrafterConfig; `tgt`: `target_fields`); taps no engine serves as
    trained are refused (`check_servable_taps`). A DFlash2 drafter names `DFlash2DraftModel` (architectures and
    auto_map) and adds `DFLASH2_FIELDS` to dflash_config."""
    check_servable_taps(dc)
    sliding = "sliding_attention" in dc.layer_types
    arch = ARCHITECTURES[dc.variant]
    cfg = {
        "architectures": [arch],
        "auto_map": {"AutoModel": f"{Path(MODELING_FILE).stem}.{arch}"},
        "model_type": "qwen3",
        "block_size": dc.block_size,
        "dflash_config": {"mask_token_id": dc.mask_token_id, "target_layer_ids": list(dc.target_layer_ids),
                          "block_size": dc.block_size,
                          **({"mask_token": tgt["mask_token"]} if tgt.get("mask_token") else {}),
                          **({k: getattr(dc, k) for k in DFLASH2_FIELDS} if dc.variant == "dflash2" else {})},
        "num_target_layers": dc.num_target_layers,
        "layer_types": list(dc.layer_types),
        "hidden_size": dc.hidden_size,
        "intermediate_size": dc.intermediate_size,
        "num_hidden_layers": dc.num_layers,
        "num_attention_heads": dc.num_heads,
        "num_key_value_heads": dc.num_kv_heads,
        "head_dim": dc.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": dc.rms_norm_eps,
        "initializer_range": dc.initializer_range,
        "vocab_size": dc.vocab_size,
        "max_position_embeddings": tgt["max_position_embeddings"],
        "rope_parameters": {"rope_type": "default", "rope_theta": float(dc.rope_theta)},
        "rope_theta": float(dc.rope_theta),
        "use_sliding_window": sliding,
        "sliding_window": dc.sliding_window if sliding else None,
        "max_window_layers": dc.num_layers,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": tgt["bos_token_id"],
        "eos_token_id": tgt["eos_token_id"],
        "pad_token_id": tgt["pad_token_id"],
        "dtype": dtype,
        "torch_dtype": dtype,
        "transformers_version": transformers_version(),
    }
    if dc.block_attention == "bidirectional":
        # every layer sees its whole block: the top-level flag z-lab's DFlash2DraftModel, vLLM and SGLang read for all
        # layers (without it they serve sliding layers block-causal; docs/serving.md)
        cfg["is_causal"] = False
    return cfg


# --- export ----------------------------------------------------------------------------------------------------


def _same_run(out: Path, run_dir: Path) -> bool:
    try:
        prov = json.loads((out / PROVENANCE).read_text())
    except (OSError, ValueError):
        return False
    return prov.get("format") == FORMAT and provenance_paths(out, prov)["run"] == run_dir


def _relative(path: str | Path, start: Path) -> str:
    return os.path.relpath(Path(path).resolve(), start)


def provenance(run_dir: Path, out: Path, target: str, target_dir: Path, projection: dict | None) -> dict:
    """The paths `dflash_export.json` records, none absolute: the run relative to the export directory `out`; the
    target as the run named it when that is a hub id, else its directory relative to the run; the projection's cache
    relative to the run."""
    from dflash_offline.targetid import is_hub_id

    hub = is_hub_id(target) and not Path(target).expanduser().is_dir()
    paths = {"run": _relative(run_dir, out), "target": target if hub else _relative(target_dir, run_dir)}
    if projection:
        paths["projection"] = dict(projection, cache=_relative(projection["cache"], run_dir)) \
            if projection.get("cache") else projection
    return paths


def provenance_paths(export_dir: Path, prov: dict) -> dict:
    """{"run": the run's directory, "target": the target's directory or hub id} read back from an export's
    provenance (an absolute path in an older export is taken as it is)."""
    run = (Path(export_dir) / prov.get("run", "")).resolve()
    target = prov.get("target") or ""
    local = run / target
    return {"run": run, "target": str(local.resolve()) if target and local.exists() else target}


def _check_out(out: Path, run_dir: Path, force: bool) -> None:
    """Refuse an `out` the export would replace (the directory goes, whole, for the new one) unless it is new, empty,
    an earlier export of this run, or (`force`) of another run: never the run, a directory holding it, or one whose
    files are not an export's — `--force` replaces exports, nothing else."""
    if out == run_dir or out in run_dir.parents:
        raise ExportError(f"{out} is the run {run_dir}" + ("" if out == run_dir else "'s parent directory")
                          + ": an export replaces its directory whole; choose a new EXPORT= (e.g. RUN/export)")
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory; choose another EXPORT=")
    names = sorted(f.name for f in out.iterdir())
    if not names:
        return
    # (its modeling file's bytecode, where Python imported it from there, is the export's own)
    if PROVENANCE in names and (extra := [n for n in names if n not in (*FILES, "__pycache__")]):
        raise ExportError(f"{out} is an export that now also holds {', '.join(extra[:3])}"
                          f"{', ...' if len(extra) > 3 else ''}, which the export did not write: an export replaces its "
                          f"directory whole, so they would be lost; move them out (e.g. copy the export into the "
                          f"repository you publish from) or choose another EXPORT=")
    if _same_run(out, run_dir):
        return
    if PROVENANCE in names:
        if force:
            return
        raise ExportError(f"{out} already exists and is an export of another run; choose another EXPORT= or pass "
                          f"--force=1 (make export ARGS=--force=1) to replace it")
    kind = ("a hidden-state or token cache (it holds manifest.json)" if (out / "manifest.json").is_file() else
            "a training run (it holds config.json and checkpoints)" if (out / "config.json").is_file()
            and (out / "checkpoints").is_dir() else
            "not an export: it holds " + ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))
    raise ExportError(f"{out} already exists and is {kind}; an export replaces its directory whole, so it is never "
                      f"written there (--force=1 replaces only an earlier export): choose a new or empty EXPORT=")


def export(run_dir, out_dir, step: int | None = None, dtype: str = "bfloat16", target: str = "",
           force: bool = False) -> Path:
    """Write the z-lab-format checkpoint of `run_dir`'s checkpoint `step` (default: latest) to `out_dir`."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    run_dir, out = Path(run_dir).resolve(), Path(out_dir).resolve()
    if not run_dir.is_dir():
        raise ExportError(f"run {run_dir} does not exist: pass RUN= a training run directory (make train RUN=...)")
    run_cfg = _read_json(run_dir / "config.json", "is RUN= a training run directory (make train RUN=...)?")
    _check_out(out, run_dir, force)

    import torch
    from safetensors.torch import load_file, save_file

    from dflash_offline.checkpoint import damage, find_checkpoint, list_checkpoints
    from dflash_offline.drafter import DFlashDrafter, DrafterConfig

    ckpt = find_checkpoint(run_dir, None if step is None or step < 0 else step)
    if why := damage(ckpt, only=("model.safetensors",)):  # (an export of damaged weights serves what no one trained)
        have = ", ".join(str(s) for _, s, d in list_checkpoints(run_dir) if d != ckpt) or "none"
        raise ExportError(f"{ckpt} is damaged: {why}; export another step (--step=N; others: {have})")
    meta = _read_json(ckpt / "meta.json", "the checkpoint is incomplete; export an older step")
    if _same_run(out, run_dir) and (before := json.loads((out / PROVENANCE).read_text()).get("step")) != meta.get("step"):
        from dflash_offline.progress import log  # (an eval.json may name the export replaced: say so)

        log(f"{out}: replacing its export of step {before} with step {meta.get('step')}")
    drafter = ((meta.get("config") or {}).get("drafter")) or run_cfg.get("drafter")
    if not drafter:
        raise ExportError(f"{ckpt}/meta.json and {run_dir}/config.json hold no drafter config")
    known = {f.name for f in dataclasses.fields(DrafterConfig)}
    dc = DrafterConfig(**{k: v for k, v in drafter.items() if k in known})

    # weights: exactly the drafter's tensors, checked against the architecture before anything is written
    with torch.device("meta"):
        expected = {k: (tuple(v.shape)) for k, v in DFlashDrafter(dc).state_dict().items()}
    try:
        sd = load_file(str(ckpt / "model.safetensors"))
    except Exception as e:  # safetensors raises several types for a bad file
        raise ExportError(f"{ckpt}/model.safetensors: unreadable ({e}); export an older step") from None
    missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    bad = [k for k in expected if k in sd and tuple(sd[k].shape) != expected[k]]
    if missing or extra or bad:
        raise ExportError(f"{ckpt}/model.safetensors does not fit the run's drafter config: missing {missing[:5]}, "
                          f"unexpected {extra[:5]}, wrong shape {bad[:5]}")
    projection = (meta.get("config") or {}).get("projection") or run_cfg.get("projection")
    if dc.tap_width:  # trained on projected taps: fc' folded into the full-width fc (in fp64)
        from dflash_offline.cache.projection_file import ProjectionError
        from dflash_offline.projection import fold_state, run_projections

        if not projection:
            raise ExportError(f"{ckpt}: the drafter reads {dc.tap_width} values a tap (projected taps) but neither its "
                              f"meta.json nor {run_dir}/config.json records the projection to fold it with")
        try:
            sd = fold_state(sd, run_projections(projection, dc.target_layer_ids, run_dir))
        except ProjectionError as e:
            raise ExportError(str(e)) from None
        dc = dataclasses.replace(dc, tap_width=0)
    tdtype = getattr(torch, dtype)
    tensors = {k: sd[k].to(tdtype).contiguous() for k in sorted(expected)}

    tgt_name = run_target(run_dir, run_cfg, target)
    tgt = target_fields(tgt_name)
    if target:  # (another location of the run's target, as when it moved: the same weights, or refused)
        from dflash_offline.progress import log

        check_trained_target(run_cfg, run_cache(run_cfg), Path(tgt["path"]), run_dir, log, "export",
                             "make export TARGET=")
    if tgt["rope_theta"] is not None and abs(tgt["rope_theta"] - dc.rope_theta) > 1e-6 * tgt["rope_theta"]:
        raise ExportError(f"the drafter was trained with rope_theta={dc.rope_theta} but target {tgt['path']} has "
                          f"{tgt['rope_theta']}: wrong --target=?")
    if other := [f"{k} {v} (the drafter's {getattr(dc, k)})" for k, v in tgt.pop("shape").items()
                 if v is not None and int(v) != getattr(dc, k)]:
        raise ExportError(f"target {tgt['path']} is not the one the drafter was trained on: {', '.join(other)}; "
                          f"wrong --target=?")
    tgt["mask_token"] = mask_token_for(tgt["tokenizer"], dc.mask_token_id)
    config = zlab_config(dc, tgt, dtype)

    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / MODELING_FILE).write_text(modeling_source())
        prov = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": meta.get("step"),
                "checkpoint": ckpt.name, "checkpoint_time": meta.get("time"), "dtype": dtype,
                "drafter": dataclasses.asdict(dc), "weights_sha256": sha256_file(tmp / "model.safetensors"),
                "modeling_sha256": sha256_file(tmp / MODELING_FILE),
                **provenance(run_dir, out, tgt_name, Path(tgt["path"]), projection)}
        (tmp / PROVENANCE).write_text(json.dumps(prov, indent=1, sort_keys=True) + "\n")
        for name in FILES:
            os.chmod(tmp / name, 0o644)  # safetensors writes 0600; exports are meant to be served and shared
    return out


def usage(out: Path, drafter: dict, target: str = "TARGET") -> list[str]:
    """How to serve the export (vLLM, SGLang, transformers); `drafter` is the DrafterConfig as a dict."""
    block = drafter["block_size"]
    spec = json.dumps({"method": "dflash", "model": str(out), "num_speculative_tokens": block - 1})
    # vLLM runs drafters mixing sliding and full attention layers, and DFlash2 drafters (its selector walk is a V2
    # speculator: v1/worker/gpu/spec_decode/dflash2), only on its V2 model runner
    mixed = len(set(drafter.get("layer_types") or [])) > 1
    v2 = "VLLM_USE_V2_MODEL_RUNNER=1 " if mixed or drafter.get("variant") == "dflash2" else ""
    return [
        f"vLLM:    {v2}vllm serve {target} --speculative-config '{spec}'",
        f"SGLang:  python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {out} [--speculative-dflash-block-size {block}]",
        f"HF:      AutoModel.from_pretrained('{out}', trust_remote_code=True)",
    ]




