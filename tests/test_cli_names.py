"""One name per concept on every stage's command line, recipe and make target: `--cache` (CACHE=) a hidden-state
cache wherever a stage reads or writes one, `--tokens` (TOKENS=) a token cache, `--export` (EXPORT=) an export
directory, `--out` only a file a stage writes that is none of these. An old name is refused in one line naming the new.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_offline.config import (
    RENAMED,
    ConfigError,
    ExtractConfig,
    TokenizeConfig,
    VerifyConfig,
    config_from_argv,
    configs_from_argv,
    describe,
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
# each stage's configs, as its command line reads them
STAGES = {"tokenize": [(TokenizeConfig, "tokenize")],
          "extract": [(ExtractConfig, "extract"), (TokenizeConfig, "tokenize")],
          "verify": [(VerifyConfig, "verify")], "train": [(TrainConfig, "train")],
          "evaluate": [(EvalConfig, "eval")], "export": [(ExportConfig, "export")],
          "regen": [(RegenConfig, "regen")], "report": [(ReportConfig, "report")],
          "build_tiny": [(BuildTinyConfig, "build_tiny")], "demo_outputs": [(DemoOutputsConfig, "demo_outputs")],
          "status": [(StatusConfig, "status")]}


def help_flags(specs) -> dict[str, str]:
    """--flag → its help line, over every config the stage reads."""
    lines = [line for cls, sec in specs for line in describe(cls, sec).splitlines()[1:]]
    return {line.split()[0]: line for line in lines}


@pytest.mark.parametrize("stage", list(STAGES))
def test_help_has_one_name_per_concept(stage):
    """A hidden-state cache is --cache, a token cache --tokens, an export --export; no old name is listed."""
    flags = help_flags(STAGES[stage])
    old = {f"--{o}" for _, sec in STAGES[stage] for o in RENAMED.get(sec, {})}
    assert not old & set(flags), old & set(flags)
    hidden = {f for f, line in flags.items() if "hidden" in line and "cache" in line and f != "--cache_root"}
    assert hidden <= {"--cache"}, hidden
    token_dirs = {f for f, line in flags.items() if "token cache directory" in line}
    assert token_dirs <= {"--tokens"}, token_dirs
    exports = {f for f, line in flags.items() if "export directory" in line}
    assert exports <= {"--export"}, exports
    if stage in ("tokenize", "extract", "export"):
        assert "--out" not in flags  # (evaluate's --out is its JSON report: a file, not a cache or export)


def test_status_takes_its_cache_as_cache(hidden_cache):
    run = [sys.executable, "-m", "stages.status"]
    ok = subprocess.run([*run, f"--cache={hidden_cache}", "--json=1"], cwd=REPO, capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0 and json.loads(ok.stdout), ok.stderr
    bare = subprocess.run([*run, f"--cache={hidden_cache}", "--json"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert bare.returncode == 2 and bare.stderr == ("error: status: --json is now --json=1 (every setting is "
                                                    "--key=value; a switch's value is 1 or 0)\n"), bare.stderr
    old = subprocess.run([*run, str(hidden_cache)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert old.returncode == 2 and f"status: the cache is now --cache={hidden_cache}" in old.stderr, old.stderr
    assert old.stderr.count("\n") == 1


def test_report_takes_its_run_as_run(tmp_path):
    from stages import report

    with pytest.raises(ConfigError) as e:
        report.main([str(tmp_path / "run")])
    assert str(e.value) == f"report: the run is now --run={tmp_path / 'run'} (a positional directory is not read)"
    with pytest.raises(ConfigError, match="^report: the run is now --run=runs/x "):
        report.main(["--smooth=3", "runs/x"])


@pytest.mark.parametrize("stage", ["report", "regen", "build_tiny", "demo_outputs", "status"])
def test_every_stage_takes_key_equals_value_only(stage):
    """One argv style: `--run X` (a space) is refused naming the one form; a recipe is refused where the stage's
    settings are command-line only."""
    specs = STAGES[stage]
    with pytest.raises(ConfigError, match=r"^argument '--out': expected --out=VALUE, one argument"):
        configs_from_argv(specs, ["--out", "x"], "")
    with pytest.raises(ConfigError, match=rf"^{stage}: --recipe is not read"):
        configs_from_argv(specs, ["--recipe=manifests/demo.toml"], "")


@pytest.mark.parametrize(("stage", "old", "new", "what"), [
    ("extract", "hidden_out", "cache", "the hidden cache written"),
    ("extract", "out", "tokens", "the token cache written"),
    ("tokenize", "out", "tokens", "the token cache written"),
    ("export", "out", "export", "the export directory written"),
])
def test_an_old_flag_is_refused_naming_the_new_one(stage, old, new, what):
    msg = f"{stage}: --{old} is now --{new} ({what})"
    with pytest.raises(ConfigError) as e:
        configs_from_argv(STAGES[stage], [f"--{old}=x"], "")
    assert str(e.value) == msg
    if len(STAGES[stage]) == 1:
        with pytest.raises(ConfigError) as e:
            config_from_argv(*STAGES[stage][0], [f"--{old}=x"], "")
        assert str(e.value) == msg


@pytest.mark.parametrize(("stage", "arg", "name"), [
    ("train", "--global-batch-tokens=4096", "global_batch_tokens"),
    ("tokenize", "--seq-len=64", "seq_len"),
    ("extract", "--batch-rows=2", "batch_rows"),
    ("evaluate", "--max-new-tokens", "max_new_tokens"),  # (no value: the name is what is told)
])
def test_a_hyphenated_setting_is_refused_naming_the_underscore_one(stage, arg, name):
    """One name per setting on every stage: `--a-b=` is refused in one line, never read as `--a_b=`."""
    sec = STAGES[stage][0][1]
    msg = f"{sec}: --{name.replace('_', '-')} is now --{name} (underscores, as every stage)"
    with pytest.raises(ConfigError) as e:
        configs_from_argv(STAGES[stage], ["--run=r", arg], "")
    assert str(e.value) == msg
    with pytest.raises(ConfigError) as e:
        config_from_argv(*STAGES[stage][0], [arg], "")
    assert str(e.value) == msg


@pytest.mark.parametrize(("stage", "switch"), [("status", "json"), ("status", "all"), ("build_tiny", "force"),
                                               ("extract", "dry_run"), ("train", "resume")])
def test_a_bare_switch_is_refused_naming_its_value(stage, switch):
    """A 0/1 setting takes a value as every setting does (`--json=1`); a bare `--json` is told so in one line."""
    sec = STAGES[stage][0][1]
    with pytest.raises(ConfigError) as e:
        configs_from_argv(STAGES[stage], [f"--{switch}"], "")
    assert str(e.value) == f"{sec}: --{switch} is now --{switch}=1 (every setting is --key=value; a switch's value " \
                           f"is 1 or 0)"


def test_status_reads_its_switches(hidden_cache, capsys, monkeypatch):
    """--all=1 lists every shard of a cache with more than a compact table's 20; --json=1 prints JSON instead."""
    from stages import status

    def doubled(cache):  # (the fixture's 19 shards listed twice: 38)
        r = real(cache)
        return {**r, "shards": r["shards"] * 2}

    real = status.report
    monkeypatch.setattr(status, "report", doubled)
    status.main([f"--cache={hidden_cache}"])
    assert "  … 23 more (use --all=1)\n" in capsys.readouterr().out
    status.main([f"--cache={hidden_cache}", "--all=1", "--json=0"])
    table = capsys.readouterr().out
    assert table.startswith(f"{hidden_cache}  [hidden cache, key ") and "more (use" not in table
    assert sum(" committed " in line for line in table.splitlines()) == 38
    status.main([f"--cache={hidden_cache}", "--json=1", "--all=0"])
    assert len(json.loads(capsys.readouterr().out)["shards"]) == 38


def test_a_value_keeps_its_hyphens():
    assert configs_from_argv(STAGES["extract"], ["--target=t", "--corpus=a", "--tokenizer=t", "--shards=0-4"],
                             "")[0].shards == "0-4"


def test_a_hyphenated_setting_on_extracts_command_line_is_one_line_and_exit_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "stages.extract", f"--cache={tmp_path}", "--dry-run=1"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == "error: extract: --dry-run is now --dry_run (underscores, as every stage)", res.stderr


def test_an_old_flag_on_the_command_line_is_one_line_and_exit_2():
    res = subprocess.run([sys.executable, "-m", "stages.extract", "--hidden_out=/nowhere"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "extract: --hidden_out is now --cache (the hidden cache written)" in res.stderr
    assert res.stderr.strip().count("\n") == 0, res.stderr


def test_an_old_recipe_key_is_refused_naming_the_new_one(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[extract]\nhidden_out = "c"\n')
    with pytest.raises(ConfigError, match=r"\[extract\]: hidden_out is now cache \(the hidden cache written\)$"):
        configs_from_argv(STAGES["extract"], [f"--recipe={recipe}", "--target=t", "--corpus=a"], "")


def test_the_recipes_use_no_old_name():
    import tomllib

    for path in sorted((REPO / "manifests").glob("*.toml")):
        tables = tomllib.loads(path.read_text())
        for sec, renamed in RENAMED.items():
            assert not set(tables.get(sec, {})) & set(renamed), (path.name, sec)


def test_a_manifest_recorded_under_the_old_name_is_rerun(tmp_path, hidden_cache, copy_cache):
    """A cache made before the rename records `hidden_out` in its extract config: the repair command
    (`make extract CACHE=DIR`, no recipe) still reads it."""
    from dflash_offline.extract_plan import recorded_config

    cache = copy_cache(hidden_cache, tmp_path / "old")
    m = json.loads((cache / "manifest.json").read_text())
    ext = m["config"]["extract"]
    ext["hidden_out"] = ext.pop("cache")
    (cache / "manifest.json").write_text(json.dumps(m))
    cfg = recorded_config([f"--cache={cache}"])
    assert cfg is not None and cfg.cache == str(cache) and not hasattr(cfg, "hidden_out")


def test_an_existing_cache_refuses_stage_1a_settings_it_was_not_made_with(tmp_path, hidden_cache, chat_corpus):
    """`make extract CACHE=DIR CORPUS=new` (no recipe) continues DIR from its token cache: another corpus or any
    stage 1a setting that makes the tokens would be ignored ("nothing to do", then training on the old corpus), so it is
    refused naming it; the same corpus (spelt relative) and settings that only say how tokens are made pass."""
    from dflash_offline.config import ConfigError
    from dflash_offline.extract_plan import recorded_config

    cache = hidden_cache
    other = tmp_path / "more.jsonl"
    other.write_text(Path(chat_corpus).read_text() * 2)
    for arg, said in ((f"--corpus={other}", "corpus="), ("--seq_len=256", "seq_len=256 (made with 128)"),
                      ('--template_kwargs={"a": 1}', "template_kwargs=")):
        with pytest.raises(ConfigError, match=rf"{cache} continues from its token cache .* made with other settings: "
                                              rf"{re.escape(said)}.*drop them to continue or repair this cache"):
            recorded_config([f"--cache={cache}", arg])
    rel = os.path.relpath(chat_corpus)
    for arg in (f"--corpus={rel}", f"--corpus={Path(chat_corpus).parent}/*{Path(chat_corpus).suffix}", "--workers=3",
                "--seq_len=128", "--shards=1"):
        assert recorded_config([f"--cache={cache}", arg]).cache == str(cache)


def test_extract_tokens_names_where_stage_1a_writes_and_what_it_reads(tmp_path, qwen35_dir, chat_corpus,
                                                                        capsys):
    """`--tokens=DIR` in extract: stage 1a writes the token cache there when DIR holds none; a later run reads it."""
    from stages import extract

    tokens = tmp_path / "tok"
    argv = [f"--target={qwen35_dir}", f"--corpus={chat_corpus}", f"--tokenizer={qwen35_dir}", f"--tokens={tokens}",
            f"--cache={tmp_path / 'hid'}", f"--cache_root={tmp_path / 'root'}", "--seq_len=128", "--rows_per_shard=8",
            "--max_docs=24", "--workers=1", "--num_draft_layers=2", "--device=cpu", "--batch_rows=4"]
    ext, tok = configs_from_argv(STAGES["extract"], argv, "")
    assert ext.tokens == tok.tokens == str(tokens)
    out = extract.run(ext, tok)
    assert out == tmp_path / "hid" and json.loads((tokens / "manifest.json").read_text())["complete"]
    assert not (tmp_path / "root").exists()
    # a complete cache of other settings is read as it is and said so; a directory of other files (a typo, a cache
    # root) is never tokenized into
    other = [a if not a.startswith("--seq_len=") else "--seq_len=64" for a in argv]
    extract.run(*configs_from_argv(STAGES["extract"], [*other, f"--cache={tmp_path / 'hid2'}"], ""))
    said = capsys.readouterr()
    assert f"--tokens={tokens}: its token cache (key " in said.out + said.err
    assert json.loads((tmp_path / "hid2" / "manifest.json").read_text())["producer"]["tokens"]["producer"][
        "seq_len"] == 128
    # … but CORPUS= named on the command line beside a token cache of another corpus is refused: the extraction would
    # hold that corpus's tokens (make extract CORPUS=b.jsonl TOKENS=<a's cache>)
    named = tmp_path / "named.jsonl"
    named.write_text(Path(chat_corpus).read_text().splitlines()[0] + "\n")
    other_corpus = [a if not a.startswith("--corpus=") else f"--corpus={named}" for a in argv]
    with pytest.raises(ConfigError, match=rf"--tokens={tokens} \(TOKENS=\) holds the token cache of other corpus "
                                          rf"files \({chat_corpus}\), not of CORPUS={named}: .*leave CORPUS= empty"):
        extract.main([*other_corpus, f"--cache={tmp_path / 'hid4'}", "--dry_run=1"])
    assert not (tmp_path / "hid4").exists()
    # the same files, changed since (a regen still appending, --partial_regen): read as it is, as before
    from dflash_offline.extract_plan import check_named_corpus

    grown = tmp_path / "grown.jsonl"
    grown.write_text(Path(chat_corpus).read_text())
    check_named_corpus(tokens, dataclasses.replace(tok, corpus=[str(grown)]))  # (the same contents elsewhere)
    m = json.loads((tokens / "manifest.json").read_text())
    (tokens / "manifest.json").write_text(json.dumps({**m, "config": {**m["config"], "corpus": [str(grown)]}}))
    with open(grown, "a") as f:
        f.write(Path(chat_corpus).read_text().splitlines()[0] + "\n")
    check_named_corpus(tokens, dataclasses.replace(tok, corpus=[str(grown)]))
    (tokens / "manifest.json").write_text(json.dumps(m))
    # a complete token cache copied to a machine without the corpus: read as it is, said so
    gone = [a if not a.startswith("--corpus=") else f"--corpus={tmp_path / 'not-here.jsonl'}" for a in argv]
    assert extract.run(*configs_from_argv(STAGES["extract"], [*gone, "--dry_run=1"], "")) is None
    said = capsys.readouterr()
    assert "the corpus and [tokenize] settings were not compared with it (corpus" in said.out + said.err
    root = tmp_path / "cache-root"
    (root / "hidden-abc").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"holds no token cache \(no manifest.json\) and is not empty"):
        extract.run(*configs_from_argv(STAGES["extract"], [*argv, f"--tokens={root}", f"--cache={tmp_path / 'h3'}"],
                                       ""))
    assert sorted(p.name for p in root.iterdir()) == ["hidden-abc"]


def test_template_kwargs_reach_the_stages_through_make_as_typed():
    """TEMPLATE_KWARGS= (a JSON object with spaces and quotes) arrives as one --template_kwargs, as typed; unset, none
    is passed (a recipe's own [tokenize] template_kwargs stands)."""
    echo = f"{sys.executable} -c \"import sys, json; print(json.dumps(sys.argv[1:]))\""
    value = '{"enable_thinking": true, "system": "it\'s mine"}'
    for target in ("eval", "regen", "tokenize", "extract"):
        got = subprocess.run(["make", "-s", "-o", ".venv/.installed", target, "RUN=r", f"PYTHON={echo}",
                              f"LAUNCH={echo} -m", f"TEMPLATE_KWARGS={value}"], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
        argv = json.loads(got.stdout.strip().splitlines()[-1])
        assert f"--template_kwargs={value}" in argv, (target, got.stdout, got.stderr)
        got = subprocess.run(["make", "-s", "-o", ".venv/.installed", target, "RUN=r", f"PYTHON={echo}",
                              f"LAUNCH={echo} -m"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert not [a for a in json.loads(got.stdout.strip().splitlines()[-1]) if a.startswith("--template_kwargs")]


def test_make_variables_name_what_they_hold():
    def make(*args):
        return subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    for target, old, new in (("eval", "OUT", "EXPORT"), ("export", "OUT", "EXPORT"), ("tokenize", "CACHE", "TOKENS")):
        res = make(target, f"{old}=x")
        assert res.returncode != 0 and f"make {target}: {old}= is now {new}= (" in res.stderr, (target, res.stderr)
    assert "--export=e " in make("export", "RUN=r", "EXPORT=e").stdout
    assert "--export=e " in make("eval", "RUN=r", "EXPORT=e").stdout
    assert "--tokens=t " in make("tokenize", "TOKENS=t").stdout
    line = make("extract", "CACHE=c", "TOKENS=t").stdout
    assert "--cache=c " in line and "--tokens=t " in line and "hidden_out" not in line
    assert "stages.status --cache=c" in make("status", "CACHE=c").stdout
    assert "stages.status --cache=c --json=1" in make("status", "CACHE=c", "JSON=1").stdout
    # only a command line's old variable is refused, and not beside the new one (a shell's OUT or CACHE is left alone)
    env = {**os.environ, "OUT": "/tmp/out", "CACHE": "/tmp/c"}
    assert subprocess.run(["make", "-n", "-o", ".venv/.installed", "eval", "RUN=r"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120).returncode == 0
    assert make("tokenize", "extract", "TOKENS=t", "CACHE=h").returncode == 0


def test_a_stage_piped_into_head_ends_without_a_traceback():
    """`make status ... | head`: the reader closes the pipe while the stage still writes; the stage (its front door,
    run_cli) ends quietly with the shell's SIGPIPE status, not a BrokenPipeError traceback."""
    stage = ("from dflash_offline.cli import run_cli\n"
             "def main(argv):\n    for i in range(100000):\n        print('shard', i, 'ok' * 20)\n    return 0\n"
             "run_cli(main)")
    res = subprocess.run(f"{sys.executable} -c \"{stage}\" | head -1; echo \"status ${{PIPESTATUS[0]}}\"", shell=True,
                         executable="/bin/bash", capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.stdout.splitlines()[-1] == "status 141" and "Traceback" not in res.stderr, (res.stdout, res.stderr)


@pytest.mark.parametrize("sig,status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_stage_stopped_by_ctrl_c_or_sigterm_says_so_in_one_line(sig, status):
    """SIGINT or SIGTERM in a stage that does not stop between steps itself (regen, eval): one line and the shell's
    130 / 143, not a KeyboardInterrupt traceback (SIGTERM: not a silent death), and its `finally` blocks ran."""
    stage = ("import os, signal\nfrom dflash_offline.cli import run_cli\n"
             "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # (as from a shell; an xdist worker ignores it)
             f"def main(argv):\n    try:\n        os.kill(os.getpid(), signal.{sig})\n"
             "        import time; time.sleep(30)\n    finally:\n        print('cleaned up')\n"
             "run_cli(main)")
    res = subprocess.run([sys.executable, "-c", stage], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == status and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1] == f"stopped on {sig}: nothing it committed is lost; rerun the same command"
    assert res.stdout == "cleaned up\n"


def test_a_sigterm_while_a_finished_stage_exits_is_one_line_not_an_ignored_exception():
    """A stage that ended (its status 0) and is running its atexit handlers when SIGTERM comes: they finish, the
    status stays the stage's, and stderr has one line instead of Python's "Exception ignored in atexit callback"."""
    stage = ("import atexit, os, signal, time\nfrom dflash_offline.cli import run_cli\n"
             "def flush():\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(0.2)\n    print('flushed', flush=True)\n"
             "def main(argv):\n    atexit.register(flush)\n    return 0\n"
             "run_cli(main)")
    res = subprocess.run([sys.executable, "-c", stage], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0 and res.stdout == "flushed\n", (res.returncode, res.stderr)
    assert res.stderr == "SIGTERM: already exiting (a second one ends it at once)\n", res.stderr
    # … the same after a Ctrl-C that exits at once past a thread still blocked (regen's requests in flight)
    ctrl_c = ("import atexit, os, signal, threading, time\nfrom dflash_offline.cli import run_cli\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "def flush():\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(0.2)\n    print('flushed', flush=True)\n"
              "def main(argv):\n    atexit.register(flush)\n    threading.Thread(target=time.sleep, args=(30,)).start()\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(30)\n"
              "run_cli(main)")
    res = subprocess.run([sys.executable, "-c", ctrl_c], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 130 and res.stdout == "flushed\n" and "Exception ignored" not in res.stderr, res.stderr
    # … and a second SIGTERM ends an exit that hangs (here on a thread the interpreter waits for) at once
    hang = ("import os, signal, threading, time\nfrom dflash_offline.cli import run_cli\n"
            "def main(argv):\n    def stop():\n        time.sleep(0.3)\n        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        time.sleep(0.3)\n        os.kill(os.getpid(), signal.SIGTERM)\n        time.sleep(30)\n"
            "    threading.Thread(target=stop).start()\n    return 0\n"
            "run_cli(main)")
    t0 = time.time()
    res = subprocess.run([sys.executable, "-c", hang], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 143 and time.time() - t0 < 15, (res.returncode, res.stderr)


def test_a_warning_is_printed_once_where_stdout_and_stderr_are_one_file(tmp_path):
    """`progress.warn`: the log line and stderr, for logs kept apart; once where both go to one terminal or file
    (`make … 2>&1 | tee`), not twice."""
    code = "from dflash_offline.progress import warn; warn('WARNING: look')"
    both = tmp_path / "both.log"
    with open(both, "w") as f:
        subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, cwd=REPO, timeout=120)
    assert both.read_text().count("WARNING: look") == 1
    apart = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "WARNING: look" in apart.stdout and apart.stderr == "WARNING: look\n"


def test_a_second_signal_does_not_cut_a_sigterm_stop_short_and_the_testbed_stops_at_once():
    """SIGTERM, then Ctrl-C while the stop unwinds: the cleanup finishes and the stop is SIGTERM's (143), the second
    said in one line. The testbed (run_cli(..., stop_on_sigterm=False)) ends at once on SIGTERM: a rerun resumes, and
    unwinding would wait for the drafter in flight."""
    stage = ("import os, signal, time\nfrom dflash_offline.cli import run_cli\n"
             "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
             "def main(argv):\n    try:\n        os.kill(os.getpid(), signal.SIGTERM)\n        time.sleep(30)\n"
             "    finally:\n        os.kill(os.getpid(), signal.SIGINT)\n        time.sleep(0.2)\n"
             "        print('cleaned up', flush=True)\n"
             "run_cli(main{})")
    res = subprocess.run([sys.executable, "-c", stage.format("")], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert res.returncode == 143 and res.stdout == "cleaned up\n" and "SIGINT: already stopping" in res.stderr
    res = subprocess.run([sys.executable, "-c", stage.format(", stop_on_sigterm=False")], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert res.returncode == -15 and res.stdout == "", (res.returncode, res.stderr)
