"""`make demo` stays re-runnable: outputs made by other code are removed, outputs of the same code are kept."""

from stages.demo_outputs import OUTPUTS, code_hash, prepare


def test_outputs_of_other_code_are_removed_and_the_same_code_keeps_them(tmp_path):
    demo = tmp_path / "demo"
    (demo / "cache" / "tokens").mkdir(parents=True)
    (demo / "run").mkdir()
    (demo / "regen.jsonl").write_text("{}\n")
    (demo / "target").mkdir()
    assert prepare(demo, "code-a") == ["cache", "run", "regen.jsonl"]  # no stamp yet: made by unknown code
    (demo / "cache").mkdir()
    (demo / "regen.jsonl").write_text("{}\n")
    assert prepare(demo, "code-a") == []  # same code: the demo resumes
    assert (demo / "cache").is_dir() and (demo / "regen.jsonl").is_file()
    assert prepare(demo, "code-b") == ["cache", "regen.jsonl"]
    assert (demo / "target").is_dir()  # the tiny target checks its own build parameters: never removed here
    assert all(not (demo / n).exists() for n in OUTPUTS)


def test_code_hash_changes_with_the_code_and_recipe(tmp_path):
    for name in ("dflash_offline/a.py", "stages/b.py", "manifests/demo.toml", "Makefile"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    first = code_hash(tmp_path)
    assert code_hash(tmp_path) == first
    for name in ("dflash_offline/a.py", "manifests/demo.toml"):
        (tmp_path / name).write_text("changed")
        assert code_hash(tmp_path) != first
        first = code_hash(tmp_path)
