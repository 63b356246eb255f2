"""A cache derived from a bf16 cache without the target (`[extract] from_cache=DIR`): byte for byte the cache a direct
extraction writes — fp8, fp4, projected, fewer taps — under the same key, and the sources that cannot give it refused
before anything is written."""

import json

import pytest
import torch

from dflash_offline.cache.manifest import committed, read_manifest
from dflash_offline.config import ConfigError, ExtractConfig, TokenizeConfig
from stages import extract


def configs(root, target, corpus, max_docs=12, **kw):
    """(extract, tokenize) configs: 4 token shards of 4 rows; batches of 2 rows (3: the last of a shard padded)."""
    tok = TokenizeConfig(corpus=[str(corpus)], tokenizer=str(target), cache_root=str(root), seq_len=128,
                         rows_per_shard=4, workers=1, max_docs=max_docs).resolve()
    ext = ExtractConfig(target=str(target), cache_root=str(root), num_draft_layers=3,
                        **{"device": "cpu", "batch_rows": 2, **kw}).resolve()
    return ext, tok


@pytest.fixture(scope="module")
def source(tmp_path_factory, qwen35_dir, chat_corpus):
    """(root, the bf16 cache of the tiny Qwen3.5 target over 3 token shards)."""
    root = tmp_path_factory.mktemp("derive")
    return root, extract.run(*configs(root, qwen35_dir, chat_corpus, cache=str(root / "bf16")))


def files(cache) -> dict:
    """Every committed shard's files (name → SHA-256), and the projection file's, if any."""
    m = read_manifest(cache)
    out = {f"{i}/{name}": rec["sha256"] for i, e in committed(m).items() for name, rec in e["files"].items()}
    return out | ({"projection": m["projection"]["sha256"]} if m.get("projection") else {})


@pytest.mark.parametrize("settings", [dict(quant="fp8"), dict(quant="fp4"),
                                      dict(project_dims=32, project_rows=5, quant="fp8", batch_rows=3),
                                      dict(layer_ids=[5, 1], batch_rows=3)],
                         ids=["fp8", "fp4", "projected-fp8-padded", "fewer-taps-reordered-padded"])
def test_a_derived_cache_is_the_direct_extraction_byte_for_byte(source, qwen35_dir, chat_corpus, settings):
    root, bf16 = source
    name = "-".join(f"{k}{v}" for k, v in settings.items()).replace(" ", "").replace(",", "_")
    direct = extract.run(*configs(root, qwen35_dir, chat_corpus, cache=str(root / f"direct-{name}"), **settings))
    derived = extract.run(*configs(root, qwen35_dir, chat_corpus, cache=str(root / f"derived-{name}"),
                                   from_cache=str(bf16), **settings))
    assert read_manifest(derived)["key"] == read_manifest(direct)["key"] != read_manifest(bf16)["key"]
    want = files(direct)
    assert len(want) >= 3 and files(derived) == want
    assert len(committed(read_manifest(derived))) == len(committed(read_manifest(bf16))) == 4


def test_sources_that_cannot_give_the_cache_are_refused_before_anything_is_written(source, qwen35_dir, chat_corpus,
                                                                                    copy_cache):
    root, bf16 = source
    fp8 = extract.run(*configs(root, qwen35_dir, chat_corpus, cache=str(root / "src-fp8"), quant="fp8"))
    f32 = extract.run(*configs(root, qwen35_dir, chat_corpus, cache=str(root / "src-f32"), dtype="float32"))
    other = extract.run(*configs(root / "other", qwen35_dir, chat_corpus, max_docs=6, cache=str(root / "src-other")))
    incomplete = copy_cache(bf16, root / "src-incomplete")
    m = json.loads((incomplete / "manifest.json").read_text())
    (incomplete / "manifest.json").write_text(json.dumps(dict(m, shards=[s for s in m["shards"] if s["index"] != 3])))
    # a dry run checks the source too, and writes nothing either way
    assert extract.run(*configs(root, qwen35_dir, chat_corpus, cache=str(root / "dry"), dry_run=True,
                                from_cache=str(bf16), quant="fp8")) is None
    assert not (root / "dry").exists()
    refusals = [
        (dict(from_cache=str(fp8), quant="fp4"), "quant='fp8'"),
        (dict(from_cache=str(f32), quant="fp8", dtype="float32"), "'float32' target"),
        (dict(from_cache=str(other), quant="fp8"), "tokens.key"),
        (dict(from_cache=str(bf16), layer_ids=[1, 4]), "not [4]"),
        (dict(from_cache=str(bf16)), "is this cache already"),
        (dict(from_cache=str(root / "nowhere"), quant="fp8"), "holds no manifest.json"),
        (dict(from_cache=str(incomplete), quant="fp8"), "shards 3 of 4 are not committed"),
        (dict(from_cache=str(other), quant="fp8", dry_run=True), "tokens.key"),
    ]
    for n, (kw, says) in enumerate(refusals):
        out = root / f"refused-{n}"
        with pytest.raises(ConfigError, match="extract.from_cache") as e:
            extract.run(*configs(root, qwen35_dir, chat_corpus, cache=str(out), **kw))
        assert says in str(e.value), (kw, str(e.value))
        assert not out.exists()  # nothing written: no directory, no manifest
    assert len(committed(json.loads((bf16 / "manifest.json").read_text()))) == 4  # the source untouched


def test_a_derived_shard_is_repaired_from_its_source_and_from_the_target_alike(source, qwen35_dir, chat_corpus,
                                                                               monkeypatch):
    """The repair command training prints (`make extract CACHE=DIR SHARD=k`: the manifest's recorded settings, its
    source among them) redoes a lost shard from the source, reading that shard's token rows alone (a worker indexes
    the token shards of the shards it computes, not the whole token cache); with the source gone, the recipe's run
    without from_cache computes it from the target — the same bytes both ways."""
    from dflash_offline.cache import shards

    root, bf16 = source
    derived = extract.run(*configs(root, qwen35_dir, chat_corpus, cache=str(root / "repaired"), quant="fp8",
                                   from_cache=str(bf16)))
    want = files(derived)
    assert read_manifest(derived)["config"]["extract"]["from_cache"] == str(bf16.resolve())
    (derived / "hidden-00001.safetensors").unlink()
    read, real = [], shards.read_token_shard
    monkeypatch.setattr(shards, "read_token_shard", lambda path, *a, **k: read.append(path.name) or real(path, *a, **k))
    assert extract.main([f"--cache={derived}", "--shards=1"]) == 0
    monkeypatch.undo()
    assert files(derived) == want
    assert read == ["tokens-00001.arrow"], read  # (the derivation's; the extraction's own read is bound at import)
    (derived / "hidden-00002.safetensors").unlink()
    moved = bf16.rename(root / "bf16-moved")
    try:
        with pytest.raises(ConfigError, match=r"compute the states from the target \(ARGS=--from_cache=\)"):
            extract.main([f"--cache={derived}"])
        assert extract.main([f"--cache={derived}", "--from_cache="]) == 0
        assert files(derived) == want
        (derived / "hidden-00003.safetensors").unlink()
        assert extract.run(*configs(root, qwen35_dir, chat_corpus, cache=str(derived), quant="fp8")) == derived
        assert extract.main([f"--cache={derived}"]) == 0  # complete: nothing to do, no source needed
    finally:
        moved.rename(bf16)
    assert files(derived) == want


def test_a_row_is_read_from_the_shard_computed_else_the_lowest_whatever_order_shards_come_in(tmp_path, monkeypatch):
    """Rows are looked up in the source's token shards as they are needed: a row two shards hold (a duplicated
    document's) is read from the shard being computed if it holds it, else from the lowest one that does, in any
    order of computing; a row no shard holds is None (tapped_layers refuses it); each token shard is read once."""
    from types import SimpleNamespace

    import numpy as np

    from dflash_offline.cache import shards
    from dflash_offline.derive import CacheStates, row_key

    def rows(*firsts):  # token rows of 4 tokens, one per first token
        ids = np.array([[f, 1, 2, 3] for f in firsts], dtype=np.int32)
        return {"input_ids": ids, "position_ids": np.tile(np.arange(4, dtype=np.int32), (len(firsts), 1)),
                "doc_ids": np.zeros_like(ids)}

    source = {"tokens-00000.arrow": rows(10, 11), "tokens-00001.arrow": rows(12, 10), "tokens-00002.arrow": rows(13)}
    read = []
    monkeypatch.setattr(shards, "read_token_shard", lambda path, sha, fix: read.append(path.name) or source[path.name])

    def key(first):
        r = rows(first)
        return row_key(r["input_ids"][0], r["position_ids"][0], r["doc_ids"][0])

    answers = []
    for order in ([1, 2, 0], [2, 0, 1]):
        read.clear()
        states = CacheStates.__new__(CacheStates)
        states.info, states.by_shard, states.hint = SimpleNamespace(tokens_dir=tmp_path, tokens_sha256=["-"] * 3), {}, None
        found = {}
        for shard in order:
            states.begin_shard(shard)
            found[shard] = states._find(key(10))
        assert states._find(key(99)) is None
        assert sorted(read) == sorted(source)  # every shard read, once
        answers.append(found)
    assert answers[0] == answers[1] == {0: (0, 0), 1: (1, 1), 2: (0, 0)}
    assert states._find(key(13)) == (2, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_derived_cache_is_its_source_encoded_and_the_same_every_time(tmp_path, qwen35_dir, chat_corpus,
                                                                               record_property):
    """The CUDA path (the packed target's bf16 cache; the states copied to the device, encoded on the writer's side
    stream): the direct extraction's key, its states within fp8's error of the source's, and two derivations the
    same bytes. (Bytes equal to a direct CUDA extraction are not asserted: the kernels need not reproduce the
    source's bits.)"""
    from dflash_offline.cache.shards import hidden_shard_name, read_hidden

    cuda = dict(device="cuda", batch_rows=3)
    bf16 = extract.run(*configs(tmp_path, qwen35_dir, chat_corpus, cache=str(tmp_path / "bf16"), **cuda))
    direct = extract.run(*configs(tmp_path, qwen35_dir, chat_corpus, cache=str(tmp_path / "direct"), quant="fp8",
                                  **cuda))
    a, b = (extract.run(*configs(tmp_path, qwen35_dir, chat_corpus, cache=str(tmp_path / d), quant="fp8",
                                 from_cache=str(bf16), **cuda)) for d in ("a", "b"))
    assert read_manifest(a)["key"] == read_manifest(direct)["key"] and files(a) == files(b)
    ids = read_manifest(a)["config"]["layer_ids"]
    worst = {"source": 0.0, "direct": 0.0}
    for i in committed(read_manifest(a)):
        x = read_hidden(bf16 / hidden_shard_name(i), ids, dtype=torch.float32)
        y = read_hidden(a / hidden_shard_name(i), ids, dtype=torch.float32)
        z = read_hidden(direct / hidden_shard_name(i), ids, dtype=torch.float32)
        for k, ref in (("source", x), ("direct", z)):
            worst[k] = max(worst[k], ((ref - y).norm() / ref.norm()).item())
        assert ((x - y).norm() / x.norm()).item() < 0.05, i
    # (measured, for the record (JUnit properties): the derived states' distance to the direct fp8 extraction's, and
    # whether the two caches are the same bytes on this GPU)
    record_property("rel_err_vs_source", worst["source"])
    record_property("rel_err_vs_direct", worst["direct"])
    record_property("bytes_equal_direct", files(a) == files(direct))


def test_an_empty_from_cache_given_clears_a_recipes_while_other_empty_settings_keep_theirs(tmp_path):
    """`ARGS=--from_cache=` computes from the target even where the recipe names a source; other settings given empty
    (the Makefile passes CORPUS=, TOKENS=, … empty when unset) keep the recipe's value."""
    from dflash_offline.config import configs_from_argv

    recipe = tmp_path / "r.toml"
    recipe.write_text('[extract]\ntarget = "/models/t"\nfrom_cache = "/data/bf16"\nquant = "fp8"\n')
    specs = [(ExtractConfig, "extract")]
    (ext,) = configs_from_argv(specs, [f"--recipe={recipe}"], "")
    assert (ext.from_cache, ext.quant) == ("/data/bf16", "fp8")
    (ext,) = configs_from_argv(specs, [f"--recipe={recipe}", "--from_cache=", "--quant="], "")
    assert (ext.from_cache, ext.quant) == ("", "fp8")


def test_a_dry_run_from_config_and_tokenizer_alone_plans_a_derivation(source, qwen35_dir, chat_corpus, tmp_path):
    """`DRY_RUN=1` plans from the target's config.json and tokenizer alone (its weights elsewhere): with `from_cache`
    it plans the derivation, checks the source, writes nothing — and still refuses a source that cannot give it."""
    import shutil

    root, bf16 = source
    bare = tmp_path / "config-only"
    shutil.copytree(qwen35_dir, bare, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    assert not list(bare.glob("*.safetensors"))
    assert extract.run(*configs(root, bare, chat_corpus, cache=str(root / "dry-bare"), dry_run=True,
                                from_cache=str(bf16), quant="fp8")) is None
    assert not (root / "dry-bare").exists()
    with pytest.raises(ConfigError, match="holds no manifest.json"):
        extract.run(*configs(root, bare, chat_corpus, cache=str(root / "dry-bare"), dry_run=True,
                             from_cache=str(root / "nowhere"), quant="fp8"))
