"""How far apart two computations of the same thing may be: bounds from float32 arithmetic, not from one CPU.

Two runs that do the same operations on the same shapes, with the same kernels and thread count, round alike: the
equivalence tests compare those with `torch.equal` (a resume; N processes = 1 process accumulating, where every
micro-batch holds the same rows either way). Where a float32 sum runs in another order (rows split otherwise over
processes or micro-batches, another CPU's kernels, oneDNN off, another thread count), the results differ by rounding,
and by how much depends on what the sum feeds:

- A scalar of the step (its loss, its gradient norm) is a sum of n terms of one sign. Rounding moves each partial
  sum by at most u (= 2⁻²⁴, float32's unit roundoff) relative; at random, the total moves by ≤ λ·√n·u relative
  except with probability ≤ 2n·exp(−λ²/2) (Higham & Mary 2019, "A new approach to probabilistic rounding error
  analysis"); λ = 5: ≤ n·7e-6. The gradient's elements themselves cancel (terms of both signs, their sum ~ √n times
  smaller than the sum of their sizes), which costs another √n in the norm: `scalar_rtol(n) = λ·n·u`. From a
  run's second step on, the weights differ too, which moves these scalars to first order by their gradient against
  that difference: at the fp32 update distances measured (< 1e-6, below) far inside λ·n·u.
- AdamW's update of an element is lr·m̂/(√v̂ + eps), ±lr whatever the gradient's size: no element-wise tolerance
  follows from the arithmetic. An element whose gradient lies within its rounding of zero can step the other way
  (2·lr apart); one whose momentum is near zero moves by its rounding / √v̂. The share of such elements is at most
  their rounding over the gradient's spread near zero: ≤ λ·√n·u·Σ|terms| · √n/(√(2π)·Σ|terms|) · 2 ≈ 4·n·u per
  step, each ≤ 2·lr off where a typical one moves lr, so over `steps` steps the updates differ in norm by
  ‖Δw₁ − Δw₂‖ / ‖Δw₁‖ ≤ 2·√(4·n·u·steps) = `adamw_rtol(n, steps)` (the worst case for independent steps; Adam's
  eps shields the smallest gradients, so a run lands far below it: ~1e-7 on the tiny drafter).
- A forward pass of the same weights in another order (packed rows vs documents alone, flex vs dense attention, a
  compiled piece vs eager, an export vs the training module, a float64 reference) is a chain of sums, each of one
  layer's width, whose roundings add rather than amplify (no sign decides a step): about λ·u·√(width·sums) of the
  activations' scale, element by element (`forward_rtol`; sums in quadrature, as one sum of width·sums terms).
- A bug is not rounding: a dropped or doubled micro-batch, anchors drawn for the wrong row or a resume that loses its
  data position move the updates by 0.2-0.8 of their norm and a step's gradient norm by 8-29 % (measured on
  tests/test_train.py's split test by planting each); a whole step's gradient doubled, which Adam and the clipping
  hide from the weights, doubles that norm.

n counts the terms of the longest sum of the step: its tokens, context and block (rows × (seq_len + anchors ×
block size)), which every projection's weight gradient sums over.
"""

import math

import torch

U32 = 2.0**-24  # float32's unit roundoff (half of torch.finfo(torch.float32).eps)
LAMBDA = 5.0  # the probabilistic bound's λ: it fails with probability ≤ 2n·exp(−λ²/2) ≈ n·7e-6
BF16_ULP = 2.0**-7  # bfloat16's spacing relative to a value (8 significant bits): at most, per rounding apart
K_ADAMW, A_ADAMW = 12, 1.2  # roundings of one AdamW update of an element; max |m̂|/√v̂ (`adamw_elementwise`)


def scalar_rtol(n: int) -> float:
    """Relative tolerance of a step's loss or gradient norm computed in another order: λ·n·u (see the module)."""
    return LAMBDA * n * U32


def loss_rtol(positions: int, vocab: int) -> float:
    """Relative tolerance of a weighted mean cross-entropy over `positions` computed in another order from the same
    weights: a sum of positive terms, each the log of a sum of `vocab` positive terms, λ·u·(√positions + √vocab)
    (the log turns its sum's relative rounding into an absolute one, smaller relative to a loss above 1)."""
    return LAMBDA * U32 * (math.sqrt(positions) + math.sqrt(vocab))


def adamw_rtol(n: int, steps: int) -> float:
    """Tolerance of `update_distance` after `steps` AdamW steps whose gradients are n-term sums in another order."""
    return 2 * math.sqrt(4 * n * U32 * steps)


def sum_rtol(n: int) -> float:
    """Relative tolerance of a sum of n terms of one sign (a norm², a mean of losses) in another order: λ·√n·u."""
    return LAMBDA * math.sqrt(n) * U32


def forward_rtol(width: int, sums: int) -> float:
    """Element-wise tolerance, relative to the activations' scale, of a forward pass through `sums` sums of at most
    `width` terms each, computed in another order: λ·u·√(width·sums) (see the module)."""
    return LAMBDA * U32 * math.sqrt(width * sums)


def adamw_elementwise(steps: int, lr: float) -> dict:
    """rtol / atol for the weights of two AdamW implementations (fused or not, compiled or not, clipping apart or
    inside) fed the same gradients, `steps` steps at most `lr`. Nothing cancels into a sign here, so element by
    element: each side's update m̂/(√v̂ + eps) is a chain of K ≈ 12 roundings (moments, bias corrections, root,
    quotient, the clip's product) in its own order, so the two are ≤ 2·K·u·A apart, A = max |m̂|/√v̂ ≤ 1.2 for
    β = (0.9, 0.95) (Cauchy-Schwarz over the moments' weights: ≤ (1 − β1)/(1 − β1ᵗ)·√(Σₖ (β1²/β2)ᵏ)·
    √((1 − β2ᵗ)/(1 − β2))); times lr, plus the weight's own two roundings on each side (decay, subtraction): per
    step |δw| ≤ 4u·|w| + 2·K·A·u·lr. A clip coefficient off by its norm's rounding scales m by c and v by c², which
    leaves m̂/√v̂ as it was but for eps."""
    return dict(rtol=4 * steps * U32, atol=2 * steps * K_ADAMW * A_ADAMW * U32 * lr)


def step_terms(rows: int, seq_len: int, anchors: int, block: int) -> int:
    """n of a step of `rows` rows: the tokens every projection's weight gradient sums over."""
    return rows * (seq_len + anchors * block)


def update_distance(w0: dict, w1: dict, w2: dict) -> float:
    """‖(w1 − w0) − (w2 − w0)‖ / ‖w1 − w0‖ over all tensors together: how far the second run's training moved from
    the first's, relative to how far the first moved from their common start `w0`."""
    assert w0.keys() == w1.keys() == w2.keys()
    diff = sum(float((w1[k].double() - w2[k].double()).pow(2).sum()) for k in w1)
    moved = sum(float((w1[k].double() - w0[k].double()).pow(2).sum()) for k in w1)
    return math.sqrt(diff / moved)


def rel_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (0 where both are zero)."""
    diff, ref = float((a.double() - b.double()).norm()), float(b.double().norm())
    return diff / ref if ref else diff


def rel_diffs(a: list[float], b: list[float]) -> list[float]:
    """|a − b| / |b|, element by element (the logged losses or gradient norms of two runs)."""
    assert len(a) == len(b), (a, b)
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


def check(what: str, value: float, bound: float) -> float:
    """Assert value ≤ bound, saying both: every equivalence test compares its distances here, so a run can list each
    margin (value / bound)."""
    assert value <= bound, f"{what}: {value:.3g} > bound {bound:.3g}"
    return value


def drafter_start(cfg) -> dict[str, torch.Tensor]:
    """The drafter's weights before step 1 of a run of `cfg` (the trainer seeds with cfg.seed right before it builds
    the model): the common start of two runs whose updates `update_distance` compares."""
    from dflash_offline.drafter import DFlashDrafter
    from dflash_offline.trainsetup import cache_defaults, drafter_config

    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(drafter_config(cfg, cache_defaults(cfg)))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
