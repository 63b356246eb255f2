"""A cache derived from another without the target (`[extract] from_cache=DIR`, make extract ARGS=--from_cache=DIR).

A complete bf16 cache of a bfloat16 target holds the target's tapped states exactly: the stored bf16 values are the
forward's outputs, unrounded. Every other cache of that target, corpus and token cache — `quant=fp8` or `fp4`,
`project_dims=k`, a subset of its taps — is a function of those values: the extraction encodes (and projects) the
forward's outputs. `CacheStates` stands in for the loaded target: its `tapped_layers` returns, for each row of a
batch, that row's states read from the source cache (each read checked against its row digest), so the extraction
loop, the projection's calibration, the writer, the claims and the manifest run unchanged: the shards are the
source's states encoded as an extraction encodes them, under the key a direct extraction gets (its bytes wherever the
forward reproduces the source's states, as on the CPU), from the source's reads instead of the target's forward.

Rows are found by content: the derived cache's token cache is the source's (its key is part of both producers), and a
row's token arrays name it. A source token shard is read and indexed only when a row is looked for: first the shard
the extraction says it computes (`begin_shard`, the same index in the source), then shards 0, 1, … until the row is
found — so a worker reads the token shards of the shards it claims (and, for a projection's calibration, those of its
first `project_rows` rows), not the whole token cache, and a row held by several shards is read from the same one
whatever order the shards are computed in. A padding row (no document token) gets zeros, which the writer never
stores.

`source_problem` says why a directory cannot be derived from (before the hidden cache is written): not a hidden
cache with every shard committed and on disk; not bf16, projected, or of a float32 target (its values are not the
bfloat16 forward's); another target, corpus, token cache, sequence length or layout (the producer fields named);
taps it lacks.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import xxhash

# producer fields a derived cache may change: each is a function of the source's states
DERIVABLE = ("quant", "projection", "layer_ids")


def exact_states(producer: dict) -> bool:
    """Whether a hidden cache of this producer holds its target's states exactly (so can be derived from)."""
    return producer.get("quant") == "bf16" and not producer.get("projection") and producer.get("dtype") == "bfloat16"


def source_problem(from_cache: str, plan) -> str | None:
    """Why `from_cache` cannot give the cache of `plan` (an `extract_plan.ExtractPlan`), or None. Reads the source's
    manifest (and, through `open_hidden_cache`, checks that every shard is committed and on disk), nothing more."""
    from .cache.manifest import has_manifest, read_manifest
    from .dataset import open_hidden_cache

    src = Path(from_cache)
    leave = "or compute the states from the target (ARGS=--from_cache=)"
    if not has_manifest(src):
        return f"{src} holds no manifest.json: give the directory of a hidden-state cache (make extract's output), {leave}"
    try:
        m = read_manifest(src, kind="hidden")
    except ValueError as e:
        return f"{e}; {leave}"
    prod = m.get("producer") or {}
    if plan.cache is not None and src.resolve() == Path(plan.cache).resolve():
        return f"{src} is the cache being written: name another (a bf16 cache of the same target and tokens)"
    if not exact_states(prod):
        return (f"{src} stores quant={prod.get('quant')!r}{', projected' if prod.get('projection') else ''} states of a "
                f"{prod.get('dtype')!r} target: only an unprojected bf16 cache of a bfloat16 target holds the target's "
                f"states exactly; derive from one, {leave}")
    if fields := producer_diff(prod, plan, src):
        return (f"{src}/manifest.json differs from this extraction in producer field(s) {', '.join(fields)}: it holds "
                f"the states of another target, corpus, token cache or layout; derive from a cache of this one, {leave}")
    if missing := sorted(set(plan.layer_ids) - {int(i) for i in prod.get("layer_ids", [])}):
        return f"{src} taps layers {prod.get('layer_ids')}, not {missing} that this cache needs; {leave}"
    if plan.key == m.get("key"):
        return f"{src} is this cache already (key {plan.key[:12]}): train on it as it is, or copy it"
    try:  # every shard committed and on disk, before anything is written
        open_hidden_cache(src, plan.layer_ids, plan.info.hidden_size, plan.seq_len)
    except ValueError as e:
        return f"{e}; {leave}"
    return None


def producer_diff(prod: dict, plan, src: Path) -> list[str]:
    """The producer fields in which source and plan differ beyond the derivable ones. The target's weights are
    compared in the source's own fingerprint scheme (`targetid.target_mismatch`: older caches fingerprinted them
    otherwise), and not at all in a dry run planned without weights (its fingerprint is None)."""
    from .cache.manifest import diff_producers
    from .targetid import FINGERPRINT_KEYS, target_mismatch

    skip = (*DERIVABLE, "target")
    fields = diff_producers({k: v for k, v in prod.items() if k not in skip},
                            {k: v for k, v in plan.producer.items() if k not in skip})
    have, want = prod.get("target") or {}, plan.producer["target"]
    weights = ("weights_fingerprint", "weights_hash")
    fields += [f"target.{k}" for k in sorted(set(have) | set(want)) if k not in weights and have.get(k) != want.get(k)]
    if plan.weights and not fields and any(have.get(k) != want.get(k) for k in FINGERPRINT_KEYS):
        if diff := target_mismatch(str(plan.ckpt), have, str(src)):  # (in the source's scheme and file set)
            fields += [f"target ({'; '.join(diff)})"]
    return fields


def row_key(input_ids: np.ndarray, position_ids: np.ndarray, doc_ids: np.ndarray) -> int:
    """A row's identity: its token arrays (as the token cache stores them, int32)."""
    h = xxhash.xxh3_128()
    for a in (input_ids, position_ids, doc_ids):
        h.update(np.ascontiguousarray(a, dtype=np.int32).tobytes())
    return h.intdigest()


class CacheStates:
    """The tapped states of `plan.layer_ids` read from the complete bf16 cache `from_cache`, as the loaded target's
    `tapped_layers` gives them: one [B, S, H] bfloat16 tensor per tap on `plan.device`. The source is the one
    `extract_plan.plan_run` accepted (`source_problem`); opening it here checks its manifest and shards again."""

    def __init__(self, from_cache: str, plan, log=print):
        from .dataset import open_hidden_cache

        self.info = open_hidden_cache(from_cache, plan.layer_ids, plan.info.hidden_size, plan.seq_len)
        self.device, self.log = plan.device, log
        self.by_shard: dict[int, dict[int, int]] = {}  # source token shard → {row key: its first row there}
        self.hint: int | None = None  # the shard the extraction computes now (`begin_shard`)
        self.files: OrderedDict = OrderedDict()  # shard → open HiddenShardFile (the last two)
        self.host = None  # the batch's states on the host, [taps, B, S, H] bf16
        log(f"states from {self.info.cache_dir} ({len(self.info.shard_rows)} shards, each shard's token rows indexed "
            f"when first needed): no target forward")

    def begin_shard(self, index: int) -> None:
        """The extraction computes its shard `index` next: its rows are looked for in the source's shard `index` first
        (the same rows: the token caches are one), then in shards 0, 1, … (a row found in several: the lowest)."""
        self.hint = index

    def _rows_of(self, shard: int) -> dict[int, int]:
        from .cache.shards import read_token_shard, token_shard_name

        if shard not in self.by_shard:
            t = read_token_shard(self.info.tokens_dir / token_shard_name(shard), self.info.tokens_sha256[shard],
                                 f"the token cache {self.info.tokens_dir} is corrupt: rebuild it")
            rows: dict[int, int] = {}
            for r in range(len(t["doc_ids"])):
                rows.setdefault(row_key(t["input_ids"][r], t["position_ids"][r], t["doc_ids"][r]), r)
            self.by_shard[shard] = rows
        return self.by_shard[shard]

    def _find(self, key: int) -> tuple[int, int] | None:
        """(source shard, row) of the row whose key is `key`, or None where no source shard holds it."""
        n = len(self.info.tokens_sha256)
        if self.hint is not None and self.hint < n and (r := self._rows_of(self.hint).get(key)) is not None:
            return self.hint, r
        for shard in range(n):
            if (r := self._rows_of(shard).get(key)) is not None:
                return shard, r
        return None

    def _file(self, shard: int):
        from .dataset import open_shard

        if shard not in self.files:
            self.files[shard] = open_shard(self.info, shard)
            while len(self.files) > 2:
                self.files.popitem(last=False)[1].close()
        self.files.move_to_end(shard)
        return self.files[shard]

    def tapped_layers(self, input_ids_BS, position_ids_BS, doc_ids_BS) -> list:
        import torch

        ids, pos, docs = (t.numpy() for t in (input_ids_BS, position_ids_BS, doc_ids_BS))
        B, S = ids.shape
        shape = (len(self.info.layer_ids), B, S, self.info.hidden_size)
        if self.host is None or self.host.shape != shape:  # (reused: every row is overwritten or zeroed below)
            with torch.inference_mode(False):  # (a normal tensor: the calibration reads under inference mode)
                self.host = torch.empty(shape, dtype=torch.bfloat16)
        out = self.host
        for b in range(B):
            if (docs[b] < 0).all():  # a padding row: never stored
                out[:, b].zero_()
                continue
            at = self._find(row_key(ids[b], pos[b], docs[b]))
            if at is None:
                raise ValueError(f"extract.from_cache: a row of the token cache is not in {self.info.cache_dir}'s "
                                 f"token cache {self.info.tokens_dir}: the two differ; derive from a cache of this "
                                 f"token cache, or compute the states from the target (ARGS=--from_cache=)")
            f = self._file(at[0])
            for j, lid in enumerate(self.info.layer_ids):
                f.read_row(f"hidden.L{lid}", at[1], out[j, b])
        # (on the CPU the taps are views of the reused buffer: the extraction and the calibration are done with them
        # before the next batch; to a GPU the copy from pageable memory completes before the call returns)
        return list(out.to(self.device).unbind(0))

    def close(self) -> None:
        while self.files:
            self.files.popitem()[1].close()
