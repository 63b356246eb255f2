"""AdamW over fp32 master weights for a model whose matmul weights are bf16, with gradient clipping folded in.

With fp32 parameters under bf16 autocast every step pays for: casting each weight to bf16 in the forward, casting
each bf16 weight gradient to fp32 in the backward, a norm pass and a scaling pass for clipping, then AdamW.
`MasterAdamW` instead keeps the model's matmul weights in bf16 (the values autocast would have produced from the
fp32 weights) and holds the fp32 weights itself, so gradients stay bf16 (the values the upcast would have received),
and a step is: the global gradient norm (one read of the gradients), then one fused pass per tensor — clip scale,
AdamW moments, fp32 master update, bf16 copy back into the model (compiled with torch.compile on CUDA; the same
code runs eager elsewhere). Numerically this is `clip_grad_norm_` + `torch.optim.AdamW` on the fp32 weights.

- A non-finite gradient norm skips the step (weights, moments and step counts unchanged) and counts it in
  `skipped` (a device tensor), instead of writing NaN into every weight.
- `state_dict()` has exactly torch AdamW's entries (`exp_avg`, `exp_avg_sq`, `step` per parameter); the fp32
  weights travel as the model's weights (`master_state_dict`, `load_masters`), so checkpoints are the same files as
  with fp32 parameters and a run can resume in either mode.
- With gradient accumulation, `accumulate_in_fp32()` moves each micro-batch's bf16 gradient into an fp32 buffer
  as soon as autograd has it (no bf16 summation). Under DDP, the micro-batch that DDP reduces keeps its gradient
  (`reduce_next_backward(True)`), and `fp32_allreduce_hook` with this optimizer as its state adds the fp32 sum of
  the earlier micro-batches to it before the fp32 all-reduce, and writes the reduced total into the fp32 buffers.

Shape-free: works on any list of parameters; matmul weights (ndim >= 2) are lowered, the rest (norm weights) stay
fp32 and are updated in place.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from dflash_offline.config import ConfigError


@dataclass
class OptimSettings:
    """The optimizer and its learning-rate schedule (`train` settings; `trainer.new_optimizer`,
    `trainsetup.schedule` and `trainsetup.cosine_schedule`)."""

    lr: float = 6e-4  # peak learning rate (AdamW)
    warmup_steps: int = -1  # linear warmup steps; -1 = warmup_ratio × the run's steps
    warmup_ratio: float = 0.04  # linear warmup as a fraction of the run's steps (when warmup_steps = -1)
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW (beta1, beta2); SpecForge uses torch's 0.9,0.999
    grad_clip: float = 1.0  # max global grad norm (0 = off)

    def resolve(self) -> OptimSettings:
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps < -1:
            raise ConfigError(f"train.warmup_steps must be >= 0 (or -1: warmup_ratio × steps), got "
                              f"{self.warmup_steps}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"train.betas={self.betas}: give two numbers in [0, 1), e.g. --betas=0.9,0.999")
        return self


def _grad_norm_coef(grads, skipped, max_norm: float):
    """(global grad norm, clip coefficient, finite flag) — all 0-dim device tensors — and `skipped` += not finite."""
    norm = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()
    ok = torch.isfinite(norm)
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s coefficient
    else:
        coef = torch.ones_like(norm)
    coef = torch.where(ok, coef, 0.0)  # keeps NaN/inf out of the arithmetic below; the step is discarded anyway
    skipped.add_(1.0 - ok.float())
    return norm, coef, ok


def _adamw_update(p32s, lows, grads, exp_avgs, exp_avg_sqs, steps, lr, coef, ok, beta1: float, beta2: float,
                  eps: float, weight_decay: float):
    """The AdamW update of each tensor with its gradient scaled by `coef`; nothing changes where `ok` is False.
    `lows[i]` is the model's low-precision weight to refresh, or None where `p32s[i]` is the model's own weight."""
    okf = ok.float()
    for p32, low, g, m, v, step in zip(p32s, lows, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        step_new = step + okf
        t = step_new.clamp(min=1.0)
        bc1 = 1 - beta1**t
        bc2_sqrt = (1 - beta2**t).sqrt()
        gf = g.float() * coef
        m_new = m + (gf - m) * (1 - beta1)  # lerp, as torch's AdamW
        v_new = v * beta2 + gf * gf * (1 - beta2)
        denom = v_new.sqrt() / bc2_sqrt + eps
        p_new = p32 * (1 - lr * weight_decay) - (lr / bc1) * m_new / denom
        p_new = torch.where(ok, p_new, p32)
        m.copy_(torch.where(ok, m_new, m))
        v.copy_(torch.where(ok, v_new, v))
        p32.copy_(p_new)
        step.copy_(step_new)
        if low is not None:
            low.copy_(p_new)


def _adamw_clip_step(p32s, lows, grads, exp_avgs, exp_avg_sqs, steps, lr, skipped, beta1: float, beta2: float,
                     eps: float, weight_decay: float, max_norm: float):
    """One clipped AdamW step over lists of tensors (see module doc); returns the global grad norm (fp32, 0-dim)."""
    norm, coef, ok = _grad_norm_coef(grads, skipped, max_norm)
    _adamw_update(p32s, lows, grads, exp_avgs, exp_avg_sqs, steps, lr, coef, ok, beta1, beta2, eps, weight_decay)
    return norm


@functools.cache
def _compiled(fn):
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)

    def call(*args):
        # one graph per parameter-group layout and gradient dtype: a process that builds several models (a sweep,
        # a test session) would reach dynamo's default of 8 graphs per function, a hard error under fullgraph
        with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
            return compiled(*args)

    return call


class MasterAdamW(torch.optim.Optimizer):
    """See the module doc. `low_dtype=None` keeps every parameter fp32 (clip + AdamW in one pass, no lowering);
    `compiled=None` compiles the step on CUDA."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, low_dtype: torch.dtype | None = torch.bfloat16,
                 compiled: bool | None = None):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.max_grad_norm = float(max_grad_norm)
        self.low_dtype = low_dtype
        self.compiled = compiled
        self._fp32_accum = False
        self._reduced_backward = False  # DDP: the next backward's gradients are left for the comm hook
        device = self.param_groups[0]["params"][0].device
        self.skipped = torch.zeros((), dtype=torch.float32, device=device)
        self._lr = torch.zeros((), dtype=torch.float32, device=device)
        for p in self._params():
            if p.dtype != torch.float32:
                raise ValueError(f"MasterAdamW wants fp32 parameters to lower (got {p.dtype}): build the model in "
                                 f"fp32, the optimizer keeps the fp32 copy and lowers the model's weights itself")
            st = self.state[p]
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            if low_dtype is not None and p.ndim >= 2:
                st["master"] = p.detach().clone()
                p.data = p.data.to(low_dtype)

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def lowered(self, p: torch.Tensor) -> bool:
        return "master" in self.state[p]

    def _lowered_ids(self) -> set[int]:
        return {id(p) for p in self._params() if self.lowered(p)}

    # --- gradient accumulation in fp32

    def accumulate_in_fp32(self) -> None:
        """Move every backward's low-precision gradient into an fp32 buffer (`p.main_grad`) at once."""
        if self._fp32_accum:
            return
        self._fp32_accum = True
        self._overwrite = self._lowered_ids()  # parameters whose next gradient starts a new sum

        def hook(p):
            if self._reduced_backward:  # DDP reduces this one: `fp32_allreduce_hook` adds the fp32 sum to it
                return
            if id(p) in self._overwrite:  # first gradient since the last step: no stale sum, no new allocation
                p.main_grad = p.grad.float() if getattr(p, "main_grad", None) is None else p.main_grad.copy_(p.grad)
                self._overwrite.discard(id(p))
            else:
                p.main_grad.add_(p.grad)
            p.grad = None

        for p in self._params():
            if self.lowered(p):
                p.register_post_accumulate_grad_hook(hook)

    def reduce_next_backward(self, flag: bool) -> None:
        """With `accumulate_in_fp32` under DDP: True before the backward that DDP reduces (the last micro-batch), False
        before the others. That backward's gradients stay where DDP reads them; `fp32_allreduce_hook`, registered
        with this optimizer as its state, adds the fp32 sum of the earlier micro-batches to them, reduces the total in
        fp32 and writes it into the fp32 buffers the step reads."""
        self._reduced_backward = flag

    def _take_reduced(self, p: torch.Tensor, total: torch.Tensor) -> None:
        """`fp32_allreduce_hook`: `total` (fp32, the reduced sum of every micro-batch) is p's gradient for the step."""
        if getattr(p, "main_grad", None) is None:
            p.main_grad = total.clone()
        else:  # in place, into the buffer of the earlier micro-batches or of the last step (no new allocation)
            p.main_grad.copy_(total)
        self._overwrite.discard(id(p))

    def _pending_sum(self, p: torch.Tensor) -> torch.Tensor | None:
        """`fp32_allreduce_hook`: the fp32 sum of p's earlier micro-batches since the last step, if any."""
        if not (self._fp32_accum and self.lowered(p)) or id(p) in self._overwrite:
            return None
        return p.main_grad

    # --- the step

    @torch.no_grad()
    def step(self, closure=None):
        """One clipped AdamW step; returns the global gradient norm (device tensor, before clipping)."""
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        if len(self.param_groups) != 1:
            raise ValueError("MasterAdamW supports one parameter group")
        group = self.param_groups[0]
        p32s, lows, grads, ms, vs, steps = [], [], [], [], [], []
        for p in group["params"]:
            if self._fp32_accum and self.lowered(p):  # its gradient since the last step, if any
                g = None if id(p) in self._overwrite else p.main_grad
            else:
                g = p.grad
            if g is None:
                continue
            st = self.state[p]
            lowered = "master" in st
            p32s.append(st["master"] if lowered else p)
            lows.append(p if lowered else None)
            grads.append(g)
            ms.append(st["exp_avg"])
            vs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        if not grads:
            return None
        self._lr.fill_(group["lr"])  # a kernel argument, no host->device copy and no sync
        b1, b2 = group["betas"]
        hyper = (float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]))
        compiled = self.compiled if self.compiled is not None else grads[0].is_cuda
        fn = _compiled(_adamw_clip_step) if compiled else _adamw_clip_step
        norm = fn(p32s, lows, grads, ms, vs, steps, self._lr, self.skipped, *hyper, self.max_grad_norm)
        if self._fp32_accum:
            self._overwrite = self._lowered_ids()
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self._fp32_accum:  # the fp32 sums too: the next gradient starts a new one
            self._overwrite = self._lowered_ids()

    # --- checkpoints: torch AdamW's state layout; the fp32 weights go with the model

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["state"] = {i: {k: v for k, v in st.items() if k != "master"} for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Moments and step counts by parameter index (torch AdamW's layout), kept fp32 on the parameter's device."""
        params = self._params()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or sum(len(g["params"]) for g in groups) != len(params):
            raise ValueError(f"optimizer state for {sum(len(g['params']) for g in groups)} parameters in "
                             f"{len(groups)} groups does not fit {len(params)} parameters in {len(self.param_groups)}")
        for i, p in enumerate(params):
            saved = state_dict["state"].get(i, state_dict["state"].get(str(i)))
            if saved is None:
                continue
            st = self.state[p]
            for k in ("exp_avg", "exp_avg_sq"):
                if tuple(saved[k].shape) != tuple(st[k].shape):
                    raise ValueError(f"optimizer state {i}.{k} has shape {tuple(saved[k].shape)}, the parameter "
                                     f"{tuple(st[k].shape)}")
                st[k].copy_(saved[k])
            st["step"].fill_(float(saved["step"]))
        for mine, saved in zip(self.param_groups, groups, strict=True):
            mine.update({k: v for k, v in saved.items() if k != "params"})

    @torch.no_grad()
    def broadcast_masters(self, src: int = 0) -> None:
        """Every process takes process `src`'s fp32 masters (and their low-precision copies)."""
        import torch.distributed as dist

        for p in self._params():
            if self.lowered(p):
                dist.broadcast(self.state[p]["master"], src)
                p.copy_(self.state[p]["master"])

    def master_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """`model.state_dict()` with every lowered weight replaced by its fp32 master."""
        sd = model.state_dict()
        for name, p in model.named_parameters():
            if p in self.state and self.lowered(p):
                sd[name] = self.state[p]["master"]
        return sd

    @torch.no_grad()
    def load_masters(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Set the fp32 masters (and the model's low-precision copies) from full-precision weights by name."""
        for name, p in model.named_parameters():
            if p in self.state and self.lowered(p):
                self.state[p]["master"].copy_(tensors[name])
                p.copy_(self.state[p]["master"])


def fp32_allreduce_hook(state, bucket):
    """DDP communication hook: average a bucket of low-precision gradients in fp32, write the result back.
    (`model.register_comm_hook(None, fp32_allreduce_hook)`; the gradients stay bf16, their sum is not rounded
    at every addition.) With a `MasterAdamW` accumulating in fp32 as `state`
    (`model.register_comm_hook(optimizer, fp32_allreduce_hook)`, see `MasterAdamW.reduce_next_backward`), each
    lowered parameter's fp32 sum of the earlier micro-batches is added first, and the reduced fp32 total goes into
    its fp32 buffer (what the step reads), not only into the bf16 gradient."""
    import torch.distributed as dist

    if not hasattr(bucket, "buffer"):
        raise TypeError("fp32_allreduce_hook is a DDP bucket hook (register_comm_hook), not a per-parameter one")
    buf = bucket.buffer()
    acc = buf.float()
    owners = []  # (parameter, offset in the bucket, shape): lowered parameters, whose fp32 total the step reads
    if state is not None and state._fp32_accum:
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            if not state.lowered(p):
                continue
            start = (g.data_ptr() - buf.data_ptr()) // buf.element_size()
            earlier = state._pending_sum(p)
            if earlier is not None:
                acc[start:start + g.numel()].view(g.shape).add_(earlier)
            owners.append((p, start, g.shape))
    acc.div_(dist.get_world_size())
    fut = dist.all_reduce(acc, async_op=True).get_future()

    def write_back(f):
        total = f.value()[0]
        for p, start, shape in owners:
            state._take_reduced(p, total[start:start + shape.numel()].view(shape))
        buf.copy_(total)
        return buf

    return fut.then(write_back)
