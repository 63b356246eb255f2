"""Projected taps: how much of a tapped layer's hidden state a k-dimensional projection keeps, and the fold that
makes a drafter trained on projected taps an ordinary z-lab drafter.

The drafter's first op is `fc`, a bias-free linear on the concatenated taps [h_1 … h_T]. Storing z_t = P_tᵀ h_t
(P_t: [H, k], orthonormal columns, the top-k eigenvectors of the uncentered second moment E[h_t h_tᵀ]) and training
fc' on [z_1 … z_T] gives, at export, fc = [fc'_1 P_1ᵀ … fc'_T P_Tᵀ] (`fold`): the same function of h as fc' of
the projection, so an engine feeding full hidden states sees exactly what training saw wherever h lies in the span
of P, and loses only the part of h outside it. The uncentered moment is the right one: fc has no bias, so the mean
is a direction like any other.

`SecondMoment` accumulates Σ h hᵀ in fp64 over rows streamed from a hidden cache; `spectrum` gives the eigenvalues
(descending) and eigenvectors; `retained(eigenvalues, k)` is the share of E‖h‖² the top-k directions hold (on the
calibration rows), `residual(P, x)` the share lost on other rows (held out). `measure_taps` gives both per layer and
k for a cache, with the bytes per token each k would take (`bench/projection.py` prints them, the testbed records them).

The cache side (`[extract] project_dims=k`): extraction estimates P_t on its first `project_rows` rows (`projection_for`,
once the weights are loaded: the manifest's P, else `calibrate`'s, recorded under the cache's lock; `top_k`:
the top-k eigenvectors, each column's sign fixed so that its largest-magnitude component is positive, so the same
moment gives the same bytes), writes them to CACHE/projection.safetensors (`cache.projection_file.write_projection`:
`P.L{id}` float32 [H, k], metadata k, rows, tokens and the energy each layer keeps) and records the file's SHA-256 in
the manifest (`projection`); every reader (`cache.projection_file.read_projection`) checks the file against that
record. Training reads z, export and the untrained drafter fold fc' with P (`fold`, `fold_state`), and the
teacher-forced estimate of a full-width drafter on a projected cache lifts z back to P z (`lift`: fc(P z) = fc' Pᵀ P z
= fc' z).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .cache.manifest import PROJECTION_FILE
from .cache.projection_file import ProjectionError, read_projection, write_projection
from .progress import log

PROJECTION_ALIGN = 32  # project_dims must be a multiple of it: whole fp4 blocks and bytes, as for the hidden size
PROJECTION_WAIT_S = 1800.0  # how long ranks > 0 wait for rank 0 to record the cache's projection


class SecondMoment:
    """Σ x xᵀ and the row count, accumulated in fp64 from [N, H] batches."""

    def __init__(self, hidden: int, device="cpu"):
        self.S = torch.zeros(hidden, hidden, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, x_NH: torch.Tensor) -> None:
        x = x_NH.to(self.S.device, torch.float64)
        self.S.addmm_(x.t(), x)
        self.n += x.shape[0]

    def spectrum(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(eigenvalues [H] descending, eigenvectors [H, H] as columns) of E[x xᵀ]."""
        if self.n == 0:
            raise ValueError("no rows accumulated")
        evals, evecs = torch.linalg.eigh(self.S / self.n)
        order = torch.argsort(evals, descending=True)
        return evals[order].clamp(min=0), evecs[:, order]


def retained(evals: torch.Tensor, k: int) -> float:
    """Share of E‖x‖² in the top-k eigen-directions."""
    total = float(evals.sum())
    return float(evals[:k].sum()) / total if total > 0 else 1.0


def residual(P_Hk: torch.Tensor, x_NH: torch.Tensor) -> float:
    """Σ‖x − P Pᵀ x‖² / Σ‖x‖² over the rows of x (fp64): the share a projection onto P loses."""
    x = x_NH.to(P_Hk.device, torch.float64)
    P = P_Hk.to(torch.float64)
    err = x - (x @ P) @ P.t()
    den = float(x.pow(2).sum())
    return float(err.pow(2).sum()) / den if den > 0 else 0.0


def fold(fc_prime: torch.Tensor, projections: list[torch.Tensor]) -> torch.Tensor:
    """fc' [O, Σk_t] trained on projected taps → fc [O, T·H] on the full taps: block t is fc'_t P_tᵀ."""
    if (width := sum(P.shape[1] for P in projections)) != fc_prime.shape[1]:
        raise ValueError(f"fc' has {fc_prime.shape[1]} input features, the projections give {width}")
    blocks, start = [], 0
    for P in projections:
        k = P.shape[1]
        blocks.append(fc_prime[:, start:start + k].to(torch.float64) @ P.to(torch.float64).t())
        start += k
    return torch.cat(blocks, dim=1).to(fc_prime.dtype)


def top_k(mom: SecondMoment, k: int) -> tuple[torch.Tensor, float]:
    """(P [H, k] float32, the share of E‖x‖² it keeps): the top-k eigenvectors of the accumulated moment, each column's
    sign fixed deterministically (its largest-magnitude component positive, the first of ties)."""
    evals, evecs = mom.spectrum()
    P = evecs[:, :k]
    pivot = P.abs().argmax(dim=0)
    sign = torch.sign(P[pivot, torch.arange(k, device=P.device)])
    P = P * torch.where(sign == 0, 1.0, sign).to(P.dtype)
    return P.to(torch.float32).cpu().contiguous(), retained(evals, k)


def run_projections(rec: dict, layer_ids, run_dir=None) -> list[torch.Tensor]:
    """P of each of `layer_ids` for a run trained on a projected cache: `rec` is what the run recorded (its cache,
    the projection file's SHA-256). The run's own copy (RUN/projection.safetensors, made when training started) is
    used when it is that file, so folding needs no cache (export, the untrained drafter; evaluation's teacher-forced
    estimate still reads the cache); else the cache's file must still be that one."""
    from .cache.fsio import sha256_file
    from .cache.manifest import has_manifest, read_manifest

    if run_dir is not None and (copy := Path(run_dir) / PROJECTION_FILE).is_file() and sha256_file(copy) == rec["sha256"]:
        return read_projection(Path(run_dir), layer_ids, {"sha256": rec["sha256"]})
    cache = Path(rec["cache"])
    have = read_manifest(cache).get("projection") if has_manifest(cache) else None
    if have is None:
        raise ProjectionError(f"the run trained on projected taps of {cache}, which is gone or records no projection: "
                              f"folding its fc needs that cache's {PROJECTION_FILE} (SHA-256 {rec['sha256'][:12]}…), "
                              f"or the run's copy of it; restore either")
    if have["sha256"] != rec["sha256"]:
        raise ProjectionError(f"{cache}/{PROJECTION_FILE} is {have['sha256'][:12]}…, the run trained on "
                              f"{rec['sha256'][:12]}…: the cache was extracted again since; restore the run's cache")
    return read_projection(cache, layer_ids, have)


def fold_state(state: dict[str, torch.Tensor], projections: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A drafter state dict trained on projected taps → the same drafter on full taps: `fc.weight` folded, the rest
    as they are."""
    return dict(state, **{"fc.weight": fold(state["fc.weight"], projections)})


def lift(z_BSK: torch.Tensor, projections: list[torch.Tensor]) -> torch.Tensor:
    """Projected taps [..., Σk_t] → [..., T·H]: P_t z_t per tap (in fp32), so a full-width fc sees fc'(z)."""
    parts, start = [], 0
    for P in projections:
        k = P.shape[1]
        parts.append(z_BSK[..., start:start + k].float() @ P.to(z_BSK.device, torch.float32).t())
        start += k
    return torch.cat(parts, dim=-1)


# --- the calibration pass of a projected extraction ------------------------------------------------------


def projection_for(cfg, plan, model, rank: int) -> dict:
    """{"P": layer id → P [H, k] float32 on the device, "sha256": its file's}: the projection the manifest of
    `plan.cache` (an `extract_plan.ExtractPlan`) records (its file checked), else the calibration's, recorded first (rank 0 of a job calibrates, the
    other ranks wait for its record). `cfg`: the ExtractConfig, `plan`: its `extract_plan.ExtractPlan`, `model`: the loaded
    target."""
    from .cache.manifest import read_manifest

    cache = plan.cache
    rec = read_manifest(cache).get("projection")
    if rec is None and rank == 0:
        rec = calibrate(cfg, plan, model)
    t = time.time()
    while rec is None:
        if time.time() - t > PROJECTION_WAIT_S:
            raise ValueError(f"[rank {rank}] waited {PROJECTION_WAIT_S:.0f}s for rank 0 to record {cache}/"
                             f"projection.safetensors in the manifest: rank 0 failed or is stuck (see its log); "
                             f"run the extraction again")
        time.sleep(1)
        rec = read_manifest(cache).get("projection")
    Ps = read_projection(cache, plan.layer_ids, rec)
    log(f"[rank {rank}] projection {rec['sha256'][:12]}: {rec['dims']} of {plan.info.hidden_size} dims a tap, "
        f"retained energy " + ", ".join(f"L{lid} {rec['retained'][str(lid)]:.4f}" for lid in plan.layer_ids))
    return {"P": {lid: P.to(plan.device) for lid, P in zip(plan.layer_ids, Ps, strict=True)},
            "sha256": rec["sha256"]}


def calibration_batches(cfg, plan):
    """The token cache's first `project_rows` rows (shard order, row order), as (padded batch, real rows) of the
    extraction's `batch_rows`."""
    import numpy as np

    from .cache.manifest import committed
    from .cache.shards import ROW_FILL, pad_rows, read_token_shard, token_shard_name

    entries, want, taken = committed(plan.tokens_manifest), cfg.project_rows, []
    for i in sorted(entries):
        if sum(len(t["doc_ids"]) for t in taken) >= want:
            break
        sha = entries[i]["files"][token_shard_name(i)]["sha256"]
        rows = read_token_shard(plan.tokens_dir / token_shard_name(i), sha, "the token cache is corrupt: rebuild it")
        taken.append({k: rows[k] for k, _ in ROW_FILL})
    rows = {k: np.concatenate([t[k] for t in taken])[:want] for k, _ in ROW_FILL}
    n = len(rows["doc_ids"])
    for r0 in range(0, n, cfg.batch_rows):
        real = min(cfg.batch_rows, n - r0)
        yield [torch.from_numpy(pad_rows(rows[k][r0:r0 + real], cfg.batch_rows, f)) for k, f in ROW_FILL], real


def calibrate(cfg, plan, model) -> dict:
    """Estimate E[h hᵀ] of each tapped layer over the real tokens of the calibration rows (fp64), write its top-k
    eigenvectors to CACHE/projection.safetensors and record them in the manifest; returns the record (another
    process's, when one recorded first)."""
    from .cache.manifest import record_once

    t0, ids, H, k, cache = time.time(), plan.layer_ids, plan.info.hidden_size, cfg.project_dims, plan.cache
    moments, rows = {lid: SecondMoment(H, plan.device) for lid in ids}, 0
    with torch.inference_mode():
        for batch, real in calibration_batches(cfg, plan):
            keep = (batch[2][:real] >= 0).to(plan.device)  # doc_ids: the real tokens
            for lid, x in zip(ids, model.tapped_layers(*batch), strict=True):
                moments[lid].add(x[:real][keep])
            rows += real
    if moments[ids[0]].n < k:  # fewer samples than directions: P's last columns would be arbitrary
        raise ValueError(f"extract.project_rows={cfg.project_rows}: the calibration rows hold {moments[ids[0]].n} real "
                         f"tokens, fewer than project_dims={k}: raise project_rows (nothing was written)")
    tops = {lid: top_k(moments[lid], k) for lid in ids}
    meta = {"dims": k, "rows": rows, "tokens": moments[ids[0]].n, "layer_ids": sorted(ids),
            "retained": {str(lid): tops[lid][1] for lid in ids}}

    def record() -> dict:  # (another process may have recorded the cache's projection first: that one it is)
        rec = write_projection(cache, {lid: tops[lid][0] for lid in ids}, meta)
        return dict(meta, file=PROJECTION_FILE, bytes=rec["bytes"], sha256=rec["sha256"])

    projection = record_once(cache, "projection", record)
    log(f"projection: {k} of {H} dims a tap from {rows} rows ({meta['tokens']:,} tokens) in {time.time() - t0:.1f}s")
    return projection


# --- how many dimensions a cache's taps need (bench.projection prints it, the testbed records it) ----------------


def real_tokens(info, shard: int, layer: int, device, max_rows: int) -> torch.Tensor:
    """[N, H] hidden states of `layer` at the real tokens (doc_ids >= 0) of the first `max_rows` rows of `shard`."""
    from .cache.shards import hidden_shard_name, read_hidden, read_token_shard, token_shard_name

    rows = min(info.shard_rows[shard], max_rows)
    x = read_hidden(info.cache_dir / hidden_shard_name(shard), [layer], slice(0, rows), torch.float32, device)
    tok = read_token_shard(info.tokens_dir / token_shard_name(shard), sha256=info.tokens_sha256[shard])
    keep = torch.from_numpy(tok["doc_ids"][:rows] >= 0).to(device)
    return x[keep]


def measure_taps(info, ks, calib_shards: int = 4, heldout_shards: int = 1, max_rows: int = 256, device=None) -> dict:
    """Per layer of an opened hidden cache (`info`: `dataset.open_hidden_cache`'s, its layers those measured): E[h hᵀ]
    over the real tokens of the first `calib_shards` shards, and for each k of `ks` (and the full width) the share its
    top-k directions keep there (`retained`) and the share a projection onto them loses on the last `heldout_shards`
    shards (`residual`); the bytes per token each k would store (bf16, fp8) against the cache's own."""
    from .cache import encodings

    layers = list(info.layer_ids)
    n = len(info.shard_rows)
    calib = list(range(min(calib_shards, max(n - heldout_shards, 1))))
    held = [i for i in range(max(n - heldout_shards, 0), n) if i not in calib]
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    H = info.width  # the hidden size (a projected cache: its stored k, measured in that space)
    ks = sorted({k for k in ks if 0 < k <= H} | {H})
    result = {"hidden_size": H, "layers": {}, "calib_shards": calib, "heldout_shards": held, "quant": info.quant,
              "device": str(device)}
    for lid in layers:
        mom = SecondMoment(H, device)
        for s in calib:
            mom.add(real_tokens(info, s, lid, device, max_rows))
        evals, evecs = mom.spectrum()
        x_held = torch.cat([real_tokens(info, s, lid, device, max_rows) for s in held]) if held else None
        result["layers"][lid] = {
            "calib_tokens": mom.n, "heldout_tokens": 0 if x_held is None else x_held.shape[0],
            "retained": {k: retained(evals, k) for k in ks},
            "heldout_loss": {k: residual(evecs[:, :k], x_held) for k in ks} if x_held is not None else {},
            "top_eigenvalue_share": retained(evals, 1),
        }
    stored = encodings.bytes_per_token(info.quant, len(layers), H)  # (the cache's own encoding and width)
    result["bytes_per_token"] = {"cache": stored, **{
        k: {q: encodings.bytes_per_token(q, len(layers), k) for q in ("bf16", "fp8")} for k in ks}}
    return result
