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
calibration rows), `residual(P, x)` the share lost on other rows (held out). `bench/projection.py` reports both per
layer and k for a cache, with the bytes per token each k would take.
"""

from __future__ import annotations

import torch


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


def bytes_per_token(k: int, taps: int, value_bytes: float = 2.0, scale_bytes: int = 0) -> float:
    """Stored bytes per token for k dims per tap: values (2 B bf16, 1 B fp8) plus a per-tap scale (fp8: 4 B)."""
    return taps * (k * value_bytes + scale_bytes)
