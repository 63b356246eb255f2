"""Where code lives (docs/DESIGN: the cache package is the only writer and reader of a cache's files): stage files stay
thin, the library imports nothing above it, and no module outside the cache package renames files into place."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE_LINES = 250  # a stage parses its settings and calls the library; its logic lives there


def sources(*dirs: str) -> list[Path]:
    return [p for d in dirs for p in sorted((ROOT / d).rglob("*.py"))]


def test_every_stage_file_is_thin():
    long = {p.name: n for p in sources("stages") if (n := len(p.read_text().splitlines())) > STAGE_LINES}
    assert not long, f"stage files over {STAGE_LINES} lines (move their logic into dflash_offline/): {long}"


def test_the_library_imports_no_stage_testbed_bench_or_test_module():
    upward = []
    for p in sources("dflash_offline"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            upward += [f"{p.relative_to(ROOT)}: {n}" for n in names
                       if n.split(".")[0] in ("stages", "testbed", "bench", "tests", "fixtures")]
    assert not upward, f"the library imports modules above it: {upward}"


def test_files_are_renamed_into_place_only_by_the_cache_package():
    """An atomic write is `cache.fsio`'s (temp name, fsync, rename, the directory's fsync): a hand-made one elsewhere
    is a fifth temp-name scheme and a missing fsync."""
    cache = ROOT / "dflash_offline" / "cache"
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sources("dflash_offline", "stages", "testbed", "bench", "fixtures")
             if cache not in p.parents for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bos\.(replace|rename)\(|\.rename\(", line)]
    assert not found, f"renames outside dflash_offline/cache/ (use cache.fsio's atomic writes): {found}"


def imports_of(p: Path, module: str) -> set[str]:
    """The modules `p` (module `module`) imports anywhere in it, function-local imports included, relative ones
    resolved; `from X import y` also names X.y (a submodule, where it is one)."""
    pkg = module if p.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(p.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return out


def test_the_librarys_import_graph_has_no_cycle():
    """A cycle, even through a function-local import, is two modules that cannot be understood (or moved) apart."""
    mods = {}
    for p in sources("dflash_offline"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    graph = {m: {t for t in imports_of(p, m) if t in mods and t != m} for m, p in mods.items()}
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:  # depth-first; a module met again on the path closes a cycle
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles in dflash_offline: {cycles}"


def test_no_module_outside_the_cache_package_reads_a_manifest_raw():
    """`cache.manifest.read_manifest` checks the schema and the version; a raw `json.loads` of manifest.json does not."""
    cache = ROOT / "dflash_offline" / "cache"
    raw = [f"{p.relative_to(ROOT)}:{i}" for p in sources("dflash_offline", "stages", "testbed", "bench", "fixtures")
           if cache not in p.parents for i, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"manifest|MANIFEST", line) and re.search(r"read_text\(|json\.load|\bopen\(", line)]
    assert not raw, f"manifest.json read outside dflash_offline/cache/ (use cache.manifest.read_manifest): {raw}"


def test_the_cache_package_imports_nothing_of_the_library_outside_it():
    """The cache contract is one unit that stage 1 writes through and stage 2 reads through: it depends on no other
    module of the library (which may depend on it), function-local imports included."""
    found = {f"{p.relative_to(ROOT)}: {t}" for p in sources("dflash_offline/cache")
             for t in imports_of(p, ".".join(p.relative_to(ROOT).with_suffix("").parts))
             if t.startswith("dflash_offline") and not t.startswith("dflash_offline.cache")}
    assert not found, f"the cache package imports library modules outside it: {sorted(found)}"
