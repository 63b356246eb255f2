"""The README is the front door: its file tree lists every module and stage, its make table every target."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def listed_files() -> set[str]:
    """Paths in the '## Files' tree: `dir/a.py, b.py   comment` lists dir/a.py and dir/b.py."""
    paths = set()
    for line in readme_section("Files").splitlines():
        if not line or line.startswith(("#", "```")) or line[0] == " ":
            continue
        column = re.split(r"\s{2,}", line, maxsplit=1)[0]
        folder = ""
        for item in column.split(", "):
            if "/" in item:
                folder = item.rsplit("/", 1)[0] + "/" if not item.endswith("/") else item
                paths.add(item)
            else:
                paths.add(folder + item)
    return paths


def test_the_file_tree_lists_every_module_and_stage():
    listed = listed_files()
    modules = [f"{d}/{p.name}" for d in ("dflash_offline", "stages", "fixtures", "testbed")
               for p in sorted((ROOT / d).glob("*.py")) if p.name != "__init__.py"]
    missing = [m for m in modules if m not in listed]
    assert not missing, f"README.md's file tree does not list {missing}: add one line each"
    stale = [p for p in listed if not p.endswith("/") and not (ROOT / p).exists()]
    assert not stale, f"README.md's file tree lists files that do not exist: {stale}"


def test_the_make_table_lists_every_documented_target():
    makefile = (ROOT / "Makefile").read_text()
    targets = re.findall(r"^([a-z][a-z0-9-]*):[^=\n]*##", makefile, flags=re.M)
    assert len(targets) > 20
    table = readme_section("Make targets")
    named = {t.removeprefix("make ") for t in re.findall(r"`([^`]+)`", table)}
    missing = [t for t in targets if t not in named]
    assert not missing, f"README.md's make table does not name the targets {missing}"
