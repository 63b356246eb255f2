"""Faults a user makes in recipes, on the command line and in TARGET=, refused early in one line that names the fix.

A misspelled recipe section or key is an error naming the nearest valid one (never silently ignored); a target or
tokenizer path that is missing, empty or without weights is one line naming the path and what is expected; the
trainer refuses a cache extracted from a target of the same shapes but other weights, before its run directory
exists.
"""

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_offline.config import (
    ConfigError,
    ExtractConfig,
    TokenizeConfig,
    VerifyConfig,
    config_from_argv,
    configs_from_argv,
)
from dflash_offline.evalrun import EvalConfig
from dflash_offline.export import ExportConfig
from dflash_offline.targetid import TargetError, resolve_checkpoint
from dflash_offline.trainsetup import TrainConfig
from stages import train

REPO = Path(__file__).resolve().parents[1]
TINY = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_anchors=8, batch_rows=2, log_every=1,
            trackers="none", lr=3e-3, warmup_steps=1, steps=1, ckpt_every=1)
EXTRACT_SPECS = [(ExtractConfig, "extract"), (TokenizeConfig, "tokenize")]


def recipe(tmp_path, text: str) -> str:
    path = tmp_path / "x.toml"
    path.write_text(text)
    return f"--recipe={path}"


def train_cfg(cache, run, **kw):
    return TrainConfig.of(cache=str(cache), run=str(run), **{**TINY, **kw}).resolve()


# --- recipes and the command line --------------------------------------------------------------------------------


def test_misspelled_recipe_section_is_refused_naming_the_nearest(tmp_path):
    arg = recipe(tmp_path, "[trian]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"x\.toml: unknown section \[trian\]; did you mean \[train\]\? \(sections: "
                                          r"\[tokenize\], \[extract\]"):
        configs_from_argv([(TrainConfig, "train")], [arg, "--cache=c"], "")


def test_recipe_key_outside_any_section_is_refused(tmp_path):
    arg = recipe(tmp_path, "steps = 3\n[train]\nlr = 1e-3\n")
    with pytest.raises(ConfigError, match=r"steps = 3 is outside any section"):
        configs_from_argv([(TrainConfig, "train")], [arg, "--cache=c"], "")


@pytest.mark.parametrize("entry", ["configs_from_argv", "config_from_argv"])
def test_misspelled_recipe_key_is_refused_naming_the_nearest(tmp_path, entry):
    arg = recipe(tmp_path, "[train]\nstesp = 3\n")
    with pytest.raises(ConfigError, match=r"x\.toml: unknown setting stesp in \[train\]; did you mean steps\?"):
        if entry == "configs_from_argv":
            configs_from_argv([(TrainConfig, "train")], [arg, "--cache=c"], "")
        else:
            config_from_argv(TrainConfig, "train", [arg, "--cache=c"], "")


def test_misspelled_command_line_key_is_refused_naming_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"--stesp: unknown setting; did you mean --steps\?"):
        configs_from_argv([(TrainConfig, "train")], ["--cache=c", "--stesp=3"], "")
    with pytest.raises(ConfigError, match=r"--corpsu: unknown setting; did you mean --corpus\?"):
        config_from_argv(TokenizeConfig, "tokenize", ["--corpsu=a.jsonl", "--tokenizer=t"], "")
    with pytest.raises(ConfigError, match=r"--taget: unknown setting; did you mean --target\?"):  # even when empty
        configs_from_argv(EXTRACT_SPECS, ["--taget=", "--target=t", "--corpus=a"], "")


def test_every_stage_reads_its_section_of_one_recipe_and_accepts_the_others(tmp_path):
    arg = recipe(tmp_path, """
[tokenize]
corpus = ["a.jsonl"]
tokenizer = "tok"
[extract]
target = "tgt"
[verify]
rows = 3
[train]
steps = 7
[eval]
num_prompts = 5
[export]
dtype = "float32"
""")
    ext, tok = configs_from_argv(EXTRACT_SPECS, [arg], "")
    assert (ext.target, tok.corpus, tok.tokenizer) == ("tgt", ["a.jsonl"], "tok")
    assert config_from_argv(TokenizeConfig, "tokenize", [arg], "").tokenizer == "tok"
    assert config_from_argv(VerifyConfig, "verify", [arg, "--cache=c"], "").rows == 3
    assert configs_from_argv([(TrainConfig, "train")], [arg, "--cache=c"], "")[0].schedule.steps == 7
    assert config_from_argv(EvalConfig, "eval", [arg, "--run=r"], "").num_prompts == 5
    assert configs_from_argv([(ExportConfig, "export")], [arg, "--run=r", "--export=o"], "")[0].dtype == "float32"


@pytest.mark.parametrize("path", sorted((REPO / "manifests").glob("*.toml")), ids=lambda p: p.name)
def test_committed_recipes_load_in_every_stage(path):
    arg = f"--recipe={path}"
    ext, tok = configs_from_argv(EXTRACT_SPECS, [arg], "")
    assert ext.target and tok.tokenizer and tok.corpus
    assert configs_from_argv([(TrainConfig, "train")], [arg, "--cache=c"], "")[0].drafter.num_layers >= 1


def test_a_missing_setting_names_the_flag_and_the_make_variable():
    """A make user who left RUN=, CACHE=, CORPUS= or TARGET= empty reads the variable to set, not only the flag."""
    with pytest.raises(ConfigError, match=r"^missing required train setting\(s\): --cache \(make CACHE=\)$"):
        configs_from_argv([(TrainConfig, "train")], ["--cache=", "--run=r"], "")  # (as make passes an empty CACHE=)
    with pytest.raises(ConfigError, match=r": --corpus \(make CORPUS=\), --tokenizer \(make TARGET=\)$"):
        config_from_argv(TokenizeConfig, "tokenize", [], "")
    with pytest.raises(ConfigError, match=r"extract setting\(s\): --target \(make TARGET=\)$"):
        configs_from_argv(EXTRACT_SPECS, ["--corpus=a"], "")
    with pytest.raises(ConfigError, match=r"verify setting\(s\): --cache \(make CACHE=\)$"):
        config_from_argv(VerifyConfig, "verify", [], "")
    with pytest.raises(ConfigError, match=r"eval setting\(s\): --run \(make RUN=\)$"):
        config_from_argv(EvalConfig, "eval", [], "")
    with pytest.raises(ConfigError, match=r"export setting\(s\): --run \(make RUN=\), --export \(make EXPORT=\)$"):
        configs_from_argv([(ExportConfig, "export")], [], "")


def test_an_unreadable_value_names_the_flag_and_the_make_variable():
    with pytest.raises(ConfigError, match=r"^--resume \(make RESUME=\): expected 0 or 1, got 'yes please'$"):
        configs_from_argv([(TrainConfig, "train")], ["--cache=c", "--resume=yes please"], "")
    with pytest.raises(ConfigError, match=r"^--steps: expected an integer, got '1e3'$"):
        configs_from_argv([(TrainConfig, "train")], ["--cache=c", "--steps=1e3"], "")


@pytest.mark.parametrize("gone", ["optimizer_overlap", "tf32", "compile_scope", "fp8_recipe"])
def test_removed_train_options_are_refused(tmp_path, gone):
    """Performance switches that measured within the run-to-run spread are bench.train flags, not options: a recipe
    or command line that still sets one is told so (unknown setting), not silently ignored."""
    with pytest.raises(ConfigError, match=rf"--{gone}: unknown setting"):
        configs_from_argv([(TrainConfig, "train")], ["--cache=c", f"--{gone}=on"], "")
    with pytest.raises(ConfigError, match=rf"unknown setting {gone} in \[train\]"):
        configs_from_argv([(TrainConfig, "train")], [recipe(tmp_path, f"[train]\n{gone} = 'on'\n"), "--cache=c"], "")
    with pytest.raises(ConfigError, match=r"train\.attn='flex_joint' is not one of auto, flex, dense"):
        configs_from_argv([(TrainConfig, "train")], ["--cache=c", "--attn=flex_joint"], "")


def test_removed_switches_say_what_the_code_does_now(tmp_path):
    """The optimizer update overlapping the forward and the joint flex call lost their A/Bs and were removed, and so
    was the choice of float8 scaling (rowwise could not win): one line says so and what runs instead, from a command
    line, a recipe and bench.train."""
    import subprocess

    for argv in (["--cache=c", "--optimizer_overlap=on"], [recipe(tmp_path, "[train]\noptimizer_overlap = 'on'\n")]):
        with pytest.raises(ConfigError, match=r"unknown setting:? (optimizer_overlap in \[train\]: )?the optimizer "
                                              r"update overlapping the next forward was removed .*: the update runs "
                                              r"after the backward"):
            configs_from_argv([(TrainConfig, "train")], argv, "")
    for argv in (["--cache=c", "--fp8_recipe=rowwise"], ["--cache=c", "--fp8_recipe=tensorwise"],
                 [recipe(tmp_path, "[train]\nprecision = 'fp8'\nfp8_recipe = 'tensorwise'\n")]):
        with pytest.raises(ConfigError, match=r"^(--fp8_recipe: unknown setting|recipe .*: unknown setting fp8_recipe "
                                              r"in \[train\]): the choice of float8 scaling was removed \(rowwise ran "
                                              r"the 27B drafter's linears at 1\.11x bf16 against tensorwise's 1\.51x "
                                              r"on an H200, docs/benchmarks\.md\): precision=fp8 scales tensorwise; "
                                              r"drop the setting$"):
            configs_from_argv([(TrainConfig, "train")], argv, "")
    with pytest.raises(ConfigError, match=r"^train\.attn='flex_joint' is not one of auto, flex, dense: the joint flex "
                                          r"call .* was removed .*: attn=flex runs flex over the context keys"):
        configs_from_argv([(TrainConfig, "train")], ["--cache=c", "--attn=flex_joint"], "")
    for arg, what in (("--optimizer_overlap=on", "the update runs after the backward"),
                      ("--attn=flex_joint", "attn=flex runs flex over the context keys"),
                      ("--fp8_recipe=rowwise", "precision=fp8 scales tensorwise")):
        r = subprocess.run([sys.executable, "-m", "bench.train", "--tiny", arg], capture_output=True, text=True)
        assert r.returncode == 2 and what in r.stderr.splitlines()[-1], r.stderr


# --- target and tokenizer paths ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["missing", "hub_shaped_missing", "empty", "config_only", "file"])
def test_unusable_target_is_one_line_naming_the_path_and_what_is_expected(tmp_path, qwen35_dir, case):
    target = {"missing": str(tmp_path / "build" / "no" / "target"), "hub_shaped_missing": "dflash-tests/no-such-model",
              "empty": str(tmp_path / "empty"), "config_only": str(tmp_path / "cfg"),
              "file": str(tmp_path / "weights.bin")}[case]
    (tmp_path / "empty").mkdir()
    (tmp_path / "cfg").mkdir()
    shutil.copy(qwen35_dir / "config.json", tmp_path / "cfg")
    (tmp_path / "weights.bin").write_bytes(b"x")
    why = {"missing": "no such directory", "hub_shaped_missing": "not in the local HF cache",
           "empty": r"has no config\.json and no \*\.safetensors weights", "config_only": r"has no \*\.safetensors",
           "file": "is a file"}[case]
    with pytest.raises(TargetError) as e:
        resolve_checkpoint(target, field="extract.target")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"extract.target {target!r}") and re.search(why, msg)
    assert "expected a directory with config.json and *.safetensors weights, or a hub id already in the local HF " \
           "cache" in msg


def test_tokenizer_path_needs_tokenizer_files_not_weights(tmp_path, qwen35_dir):
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen35_dir / name, tok)
    assert resolve_checkpoint(str(tok), need=("tokenizer",), field="tokenize.tokenizer") == tok
    with pytest.raises(TargetError, match=r"^tokenize\.tokenizer '.*nowhere': no such directory; expected a directory "
                                          r"with tokenizer\.json or tokenizer_config\.json"):
        resolve_checkpoint(str(tmp_path / "nowhere"), need=("tokenizer",), field="tokenize.tokenizer")


@pytest.mark.parametrize("case", ["missing", "empty", "no_weights"])
def test_train_refuses_an_unusable_target_before_the_run_dir_exists(tmp_path, hidden_cache, qwen35_dir, case):
    target = tmp_path / "target"
    if case != "missing":
        target.mkdir()
    if case == "no_weights":
        shutil.copy(qwen35_dir / "config.json", target)
    why = {"missing": "no such directory", "empty": r"no config\.json", "no_weights": r"no \*\.safetensors weights"}
    with pytest.raises(TargetError, match=rf"^train\.target '{re.escape(str(target))}'.*{why[case]}"):
        train.run(train_cfg(hidden_cache, tmp_path / "run", target=str(target)))
    assert not (tmp_path / "run").exists()


# --- a target of the same shapes but other weights -----------------------------------------------------------------


def retrained_copy(src: Path, dst: Path, change: bool) -> Path:
    """`src` copied to `dst` with its weights rewritten: every tensor but the embedding and lm_head changed (a
    fine-tune that kept its embeddings: the trainer's frozen tables are equal, the hidden states are not)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    if change:
        keep = ("embed_tokens", "lm_head")
        tensors = {k: v if any(s in k for s in keep) else (v.float() * 1.25 + 0.01).to(v.dtype)
                   for k, v in tensors.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_train_refuses_a_cache_from_a_same_shape_target_with_other_weights(tmp_path, hidden_cache, qwen35_dir):
    other = retrained_copy(qwen35_dir, tmp_path / "finetuned", change=True)
    assert torch.equal(load_file(str(other / "model.safetensors"))["lm_head.weight"],
                       load_file(str(qwen35_dir / "model.safetensors"))["lm_head.weight"])
    with pytest.raises(TargetError) as e:
        train.run(train_cfg(hidden_cache, tmp_path / "run", target=str(other)))
    msg = str(e.value)
    assert f"target {other} is not the target {hidden_cache} was extracted from ({qwen35_dir})" in msg
    assert "weights_fingerprint" in msg and "config_sha256" not in msg  # names what differs, and only that
    assert "re-extract" in msg and f"TARGET={other}" in msg
    assert not (tmp_path / "run").exists()


def test_train_refuses_a_cache_whose_own_target_changed_since_extraction(tmp_path, hidden_cache, qwen35_dir,
                                                                       copy_cache):
    other = retrained_copy(qwen35_dir, tmp_path / "finetuned", change=True)
    cache = copy_cache(hidden_cache, tmp_path / "cache")
    m = json.loads((cache / "manifest.json").read_text())
    m["config"]["extract"]["target"] = str(other)  # as if the checkpoint at the cache's path had been replaced
    (cache / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TargetError, match=re.escape(f"target {other} has changed since {cache} was extracted from it: "
                                                          "weights_fingerprint")):
        train.run(train_cfg(cache, tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_train_accepts_a_copy_of_the_cache_target_at_another_path(tmp_path, hidden_cache, qwen35_dir):
    same = retrained_copy(qwen35_dir, tmp_path / "copy", change=False)
    assert (train.run(train_cfg(hidden_cache, tmp_path / "run", target=str(same))) / "config.json").is_file()


def test_the_dead_tokenize_block_size_knob_is_gone():
    """[tokenize].block_size was checked but never used (not in the key): a recipe that still sets it is told so."""
    from dflash_offline.config import ConfigError, TokenizeConfig, build_config

    with pytest.raises(ConfigError, match="block_size"):
        build_config(TokenizeConfig, "tokenize", {"corpus": ["x.jsonl"], "tokenizer": "t", "block_size": 16})


@pytest.mark.parametrize("gamma", [-7.0, float("nan")])
def test_a_negative_or_nan_gamma_is_refused(gamma):
    """A negative decay length would make the weights grow along the block (SpecForge reads ≤ 0 as "no decay"; here
    that is gamma=inf, and 0 is the default)."""
    with pytest.raises(ConfigError, match=r"train.gamma=.*: give a decay length > 0, inf for no decay, or 0 for the "
                                          r"default"):
        TrainConfig.of(cache="c", gamma=gamma).resolve()
    assert TrainConfig.of(cache="c", gamma=float("inf")).resolve().loss.gamma == float("inf")


def test_train_settings_stay_flat_for_users_and_live_in_their_owners_groups(tmp_path):
    """A [train] key, a --key=value and a run's recorded config.json name each setting by its own name (unique over
    the groups); each lands in the group declared beside the code that owns it; a recorded config reads back."""
    from dflash_offline.config import as_dict, compose, setting_names
    from dflash_offline.drafter import DrafterSettings
    from dflash_offline.loss import LossSettings
    from dflash_offline.optim import OptimSettings
    from dflash_offline.trainsetup import ComputeSettings, ScheduleSettings

    names = setting_names(TrainConfig)
    assert len(names) == len(set(names))
    assert len(dataclasses.fields(TrainConfig)) <= 15  # its groups included: the rest is declared by their owners
    (cfg,) = configs_from_argv([(TrainConfig, "train")], [
        recipe(tmp_path, "[train]\nnum_layers = 3\ngamma = 5.0\nlr = 1e-3\nprecision = 'fp32'\n"), "--cache=c",
        "--betas=0.9,0.999", "--loss_logits=bf16", "--head_dim=64", "--steps=7"], "")
    assert (type(cfg.schedule), type(cfg.drafter), type(cfg.loss), type(cfg.optim), type(cfg.compute)) == (
        ScheduleSettings, DrafterSettings, LossSettings, OptimSettings, ComputeSettings)
    assert (cfg.drafter.num_layers, cfg.drafter.head_dim, cfg.loss.gamma, cfg.loss.loss_logits, cfg.optim.lr,
            cfg.optim.betas, cfg.compute.precision, cfg.schedule.steps) == (3, 64, 5.0, "bf16", 1e-3, [0.9, 0.999], "fp32", 7)
    flat = as_dict(cfg)
    assert list(flat) == names and (flat["num_layers"], flat["lr"], flat["precision"]) == (3, 1e-3, "fp32")
    assert compose(TrainConfig, json.loads(json.dumps(flat))).resolve() == cfg


def test_block_attention_is_checked_when_the_train_config_resolves():
    """An unknown in-block attention, or a bidirectional block wider than the sliding window (the block would see
    past the window), is refused in one line when the settings resolve — before any cache is opened."""
    with pytest.raises(ConfigError, match=r"train\.block_attention.*'sideways'"):
        TrainConfig.of(cache="c", block_attention="sideways").resolve()
    with pytest.raises(ConfigError, match=r"bidirectional needs sliding_window >= block_size \(got 8 < 16\)"):
        TrainConfig.of(cache="c", block_attention="bidirectional", sliding_window=8, block_size=16).resolve()
    assert TrainConfig.of(cache="c", block_attention="bidirectional", sliding_window=16, block_size=16).resolve()


def test_template_kwargs_as_a_toml_table_is_the_json_object_it_spells(tmp_path):
    """`template_kwargs = {reasoning_effort = "low"}` (TOML's own table) was refused "expected str"; it is the
    same setting as the JSON string, in every recipe section that takes one, and a table of other values is still refused."""
    from dflash_offline.chat import parse_settings

    required = {"tokenize": ["--corpus=c", "--tokenizer=t"], "eval": ["--run=r"]}
    for cls, section in ((TokenizeConfig, "tokenize"), (EvalConfig, "eval")):  # (regen has no recipe section)
        table = recipe(tmp_path, f'[{section}]\ntemplate_kwargs = {{reasoning_effort = "low", x = 1}}\n')
        cfg = config_from_argv(cls, section, [table, *required[section]], "")
        as_json = recipe(tmp_path, f"[{section}]\ntemplate_kwargs = '{{\"x\": 1, \"reasoning_effort\": \"low\"}}'\n")
        assert parse_settings(cfg.template_kwargs) == parse_settings(config_from_argv(
            cls, section, [as_json, *required[section]], "").template_kwargs) == {"reasoning_effort": "low", "x": 1}
    nested = recipe(tmp_path, "[tokenize]\ntemplate_kwargs = {a = {b = 1}}\n")
    with pytest.raises((ConfigError, ValueError), match=r"template_kwargs.*not an object of strings, booleans"):
        config_from_argv(TokenizeConfig, "tokenize", [nested, "--corpus=c", "--tokenizer=t"], "").resolve()


def test_a_path_given_with_a_tilde_after_the_equals_sign_is_under_home(tmp_path, monkeypatch):
    """`--run=~/runs/a` reaches the stage with `~` as typed (a shell expands `~` only at a word's start or, bash
    outside POSIX mode, in an assignment such as make's RUN=~/…; quoted, from dash or the environment, never), and the
    run was made in a directory named `~` under the working directory. Every item of a list, a recipe's paths and
    the recipe's own path are expanded too; with a directory named `~` here, `~/…` is refused as ambiguous."""
    from dflash_offline.config import parse_overrides

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    cfg = config_from_argv(VerifyConfig, "verify", ["--cache=~/caches/c"], "")
    assert cfg.cache == str(home / "caches" / "c")
    (train_cfg,) = configs_from_argv([(TrainConfig, "train")], ["--cache=~", "--run=~/runs/a"], "")
    assert (train_cfg.cache, train_cfg.run) == (str(home), str(home / "runs" / "a"))
    assert config_from_argv(VerifyConfig, "verify", ["--cache=a~/b"], "").cache == "a~/b"  # (only a leading ~)
    tok = config_from_argv(TokenizeConfig, "tokenize", ["--corpus=~/a.jsonl,~/b.jsonl", "--tokenizer=t"], "")
    assert tok.corpus == [str(home / "a.jsonl"), str(home / "b.jsonl")]
    assert config_from_argv(TokenizeConfig, "tokenize", ['--corpus=["~/a.jsonl"]', "--tokenizer=t"], "").corpus == \
        [str(home / "a.jsonl")]
    (home / "r.toml").parent.mkdir(parents=True)
    (home / "r.toml").write_text('[tokenize]\ncorpus = ["~/x.jsonl", "y.jsonl"]\ntokenizer = "~/tok"\n')
    assert parse_overrides(["--recipe=~/r.toml"])[0] == str(home / "r.toml")
    tok = config_from_argv(TokenizeConfig, "tokenize", ["--recipe=~/r.toml"], "")
    assert (tok.corpus, tok.tokenizer) == ([str(home / "x.jsonl"), "y.jsonl"], str(home / "tok"))
    (tmp_path / "~").mkdir()  # (made by a `--run=~/…` before ~ was expanded)
    with pytest.raises(ConfigError, match=r"^--run=~/runs/a: there is a directory named ~ in .*; give "
                                          rf"{re.escape(str(home / 'runs' / 'a'))} or \./~/runs/a"):
        configs_from_argv([(TrainConfig, "train")], ["--cache=c", "--run=~/runs/a"], "")


def test_a_progress_bar_setting_names_the_environment_variable_that_switches_it_off(tmp_path, monkeypatch):
    """`make train ARGS=--progress=0` (or a recipe's `progress = false`) is no setting: the refusal says that
    DFLASH_NO_BAR=1 switches the bar off, and the bar is off under it while status.json is still written."""
    from dflash_offline.config import ExtractConfig
    from dflash_offline.progress import Progress

    for argv, classes in ((["--cache=c", "--progress=0"], [(TrainConfig, "train")]),
                          (["--target=t", "--no_bar=1"], [(ExtractConfig, "extract")]),
                          (["--cache=c", "--quiet"], [(TrainConfig, "train")]),
                          ([recipe(tmp_path, "[train]\nprogress = false\n"), "--cache=c"], [(TrainConfig, "train")])):
        with pytest.raises(ConfigError, match=r"unknown setting:? (progress in \[train\]: )?the progress bar \(stderr\) "
                                              r"is switched off by the environment: DFLASH_NO_BAR=1"):
            configs_from_argv(classes, argv, "")
    monkeypatch.setenv("DFLASH_NO_BAR", "1")
    p = Progress("train", 10, "step", tmp_path / "status.json", every_s=0)
    p.update(3)
    p.close()
    assert p.bar.disable and json.loads((tmp_path / "status.json").read_text())["done"] == 3
