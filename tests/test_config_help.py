"""`--help` of every stage: each setting has a one-line help (the comment at the end of its line in the config
dataclass), `--help` shows it, and a setting with a fixed set of values names every one of them."""

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from dflash_offline.config import (
    ExtractConfig,
    TokenizeConfig,
    VerifyConfig,
    compose,
    describe,
    field_help,
    setting_names,
    setting_types,
    settings,
)
from dflash_offline.evalrun import EvalConfig
from dflash_offline.export import ExportConfig
from dflash_offline.regenrun import RegenConfig
from dflash_offline.trainsetup import TrainConfig
from stages.build_tiny import BuildTinyConfig
from stages.demo_outputs import DemoOutputsConfig
from stages.report import ReportConfig
from stages.status import StatusConfig

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [(TokenizeConfig, "tokenize"), (ExtractConfig, "extract"), (VerifyConfig, "verify"),
           (TrainConfig, "train"), (EvalConfig, "eval"), (ExportConfig, "export"), (RegenConfig, "regen"),
           (BuildTinyConfig, "build_tiny"), (ReportConfig, "report"), (DemoOutputsConfig, "demo_outputs"),
           (StatusConfig, "status")]
IDS = [section for _, section in CONFIGS]
# the configs with a setting of fixed values (report's, demo_outputs' and status' have none)
CHOICES = [(cls, section) for cls, section in CONFIGS if section not in ("report", "demo_outputs", "status")]


def required(cls) -> dict:
    """Placeholder values for the fields without a default."""
    hints = setting_types(cls)
    return {f.name: ["x"] if typing.get_origin(hints[f.name]) is list else "x" for f, _, _ in settings(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


@pytest.mark.parametrize(("cls", "section"), CONFIGS, ids=IDS)
def test_every_setting_has_a_one_line_help_that_help_shows(cls, section):
    helps = field_help(cls)
    names = setting_names(cls)
    assert [n for n in names if not helps.get(n)] == [], f"{cls.__name__}: fields without a help comment"
    shown = {line.split()[0]: line for line in describe(cls, section).splitlines()[1:]}
    assert list(shown) == [f"--{n}" for n in names]
    for n in names:
        assert helps[n] in shown[f"--{n}"]


@pytest.mark.parametrize(("cls", "section"), CHOICES, ids=[section for _, section in CHOICES])
def test_the_help_of_a_setting_with_fixed_values_names_them_all(cls, section):
    """The allowed values are the ones `resolve()` names when it refuses a wrong one."""
    hints, helps, checked = setting_types(cls), field_help(cls), 0
    for f, _, _ in settings(cls):
        if hints[f.name] is not str or f.name in required(cls):
            continue
        try:
            compose(cls, {**required(cls), f.name: "no-such-value"}).resolve()
        except ValueError as e:
            m = re.search(r"(?:is not one of|expected one of) (.+)$", str(e))
            if m:
                checked += 1
                for value in m.group(1).split(", "):
                    assert re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", helps[f.name]), (f.name, value)
    assert checked > 0  # (every stage has settings with fixed values)


def test_help_lists_the_settings_with_defaults_and_make_variables():
    out = subprocess.run([sys.executable, "-m", "stages.train", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("  --")}
    assert lines["--cache"].endswith("[REQUIRED; make CACHE=]") and lines["--run"].endswith("; make RUN=]")
    assert lines["--fsdp"].endswith("[0]") and lines["--loss_chunk_tokens"].endswith("[4096]")
    assert '"flex"' in lines["--attn"] and '"dense"' in lines["--attn"] and "auto" in lines["--attn"]
    for gone in ("--optimizer_overlap", "--tf32", "--compile_scope", "--fp8_recipe"):  # bench switches or removed
        assert gone not in lines


@pytest.mark.parametrize("stage", ["regen", "tokenize", "extract", "verify", "status", "train", "export", "evaluate",
                                   "report"])
def test_every_stage_a_user_runs_answers_help(stage, capsys):
    """`python -m stages.NAME --help` prints the stage's doc and options and exits 0 (extract once refused it: its
    tokenizer hook read the command line before --help was looked at)."""
    import importlib

    main = importlib.import_module(f"stages.{stage}").main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code in (0, None)
    assert "--" in capsys.readouterr().out
