"""MasterAdamW = clip_grad_norm_ + torch AdamW on fp32 weights, with bf16 model weights, skip on non-finite norms,
torch AdamW's checkpoint layout, fp32 accumulation; compiled = eager."""

import pytest
import torch
from equivalence import BF16_ULP, adamw_elementwise, sum_rtol
from torch import nn

from dflash_offline.optim import MasterAdamW

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.LayerNorm(32), nn.Linear(32, 8, bias=False))


def grads_for(step, params, scale):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * scale for p in params]


def reference_run(steps, scales, max_norm, bf16_grads=True):
    m = model()
    opt = torch.optim.AdamW(m.parameters(), **HP)
    norms = []
    for s in range(steps):
        for p, g in zip(m.parameters(), grads_for(s, list(m.parameters()), scales[s]), strict=True):
            # with bf16 matmul weights, what autocast's upcast of the bf16 weight gradient delivers
            p.grad = g.to(torch.bfloat16).float() if p.ndim >= 2 and bf16_grads else g
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return m, norms


def master_run(steps, scales, max_norm, compiled=False, low=torch.bfloat16):
    m = model()
    opt = MasterAdamW(m.parameters(), max_grad_norm=max_norm, low_dtype=low, compiled=compiled, **HP)
    norms = []
    for s in range(steps):
        for p, g in zip(m.parameters(), grads_for(s, list(m.parameters()), scales[s]), strict=True):
            p.grad = g.to(p.dtype)
        norms.append(float(opt.step()))
        opt.zero_grad()
    return m, opt, norms


SCALES = [0.01, 5.0, 0.02, 3.0, 0.01]  # some steps clipped (norm > 1), some not
N_PARAMS = 16 * 32 + 2 * 32 + 32 * 8  # the terms of the gradient norm


@pytest.mark.parametrize("low", [None, torch.bfloat16])
def test_equals_clip_plus_torch_adamw(low):
    """The same gradients through MasterAdamW and through clip_grad_norm_ + torch's AdamW: the gradient norms to the
    rounding of a sum of 832 squares in another order (`equivalence.sum_rtol`: 8.6e-6), the fp32 weights element by
    element to `equivalence.adamw_elementwise` (5 steps: rtol 1.2e-6, atol 2.6e-8)."""
    ref, ref_norms = reference_run(5, SCALES, 1.0, bf16_grads=low is not None)
    m, opt, norms = master_run(5, SCALES, 1.0, low=low)
    assert norms == pytest.approx(ref_norms, rel=sum_rtol(N_PARAMS))
    assert any(n > 1 for n in norms) and any(n < 1 for n in norms)
    for (name, r), p in zip(ref.named_parameters(), m.parameters(), strict=True):
        w = opt.state[p]["master"] if opt.lowered(p) else p
        assert w.dtype == torch.float32
        torch.testing.assert_close(w, r, **adamw_elementwise(5, HP["lr"]), msg=name)
        if opt.lowered(p):  # the model's weight is the master rounded to bf16, exactly
            assert p.dtype == torch.bfloat16 and torch.equal(p, w.to(torch.bfloat16))
    assert [opt.lowered(p) for p in m.parameters()] == [low is not None, False, False, low is not None]


def test_non_finite_norm_skips_the_step():
    m, opt, _ = master_run(2, SCALES, 1.0)
    before = {k: v.clone() for k, v in opt.master_state_dict(m).items()}
    moments = [opt.state[p]["exp_avg"].clone() for p in m.parameters()]
    for i, p in enumerate(m.parameters()):
        p.grad = torch.full_like(p, float("inf") if i == 1 else 0.1)
    opt.step()
    opt.zero_grad()
    assert float(opt.skipped) == 1
    after = opt.master_state_dict(m)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(a, opt.state[p]["exp_avg"]) for a, p in zip(moments, m.parameters(), strict=True))
    assert all(float(opt.state[p]["step"]) == 2 for p in m.parameters())
    for p in m.parameters():
        p.grad = torch.full_like(p, 0.1)
    opt.step()  # a finite step afterwards proceeds
    assert float(opt.skipped) == 1 and all(float(opt.state[p]["step"]) == 3 for p in m.parameters())
    assert all(torch.isfinite(v).all() for v in opt.master_state_dict(m).values())


def test_state_dict_is_torch_adamw_layout_and_resume_is_exact():
    full = master_run(5, SCALES, 1.0)
    m, opt, _ = master_run(3, SCALES, 1.0)
    sd = opt.state_dict()
    torch_sd = torch.optim.AdamW(model().parameters(), **HP).state_dict()
    assert sd["param_groups"][0].keys() >= {"lr", "betas", "eps", "weight_decay", "params"}
    assert set(torch_sd["param_groups"][0]) - set(sd["param_groups"][0]) <= {"amsgrad", "maximize", "foreach",
                                                                               "capturable", "differentiable",
                                                                               "fused", "decoupled_weight_decay"}
    assert all(set(st) == {"exp_avg", "exp_avg_sq", "step"} for st in sd["state"].values())
    weights = {k: v.clone() for k, v in opt.master_state_dict(m).items()}
    # a fresh process: model from the fp32 weights, optimizer from its state dict, masters from the weights
    m2 = model(seed=1)
    opt2 = MasterAdamW(m2.parameters(), max_grad_norm=1.0, **HP)
    m2.load_state_dict(weights)  # the lowered weights take the (rounded) values ...
    opt2.load_state_dict(sd)
    opt2.load_masters(m2, weights)  # ... and the masters the exact ones
    for s in (3, 4):
        for p, g in zip(m2.parameters(), grads_for(s, list(m2.parameters()), SCALES[s]), strict=True):
            p.grad = g.to(p.dtype)
        opt2.step()
        opt2.zero_grad()
    got, want = opt2.master_state_dict(m2), full[1].master_state_dict(full[0])
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_fp32_accumulation_equals_summed_gradients():
    """bf16 weights + fp32 accumulation = fp32 weights under autocast accumulating in .grad: the same bf16 GEMMs on
    the same values, the same fp32 sums; the weights apart by the two AdamW implementations
    (`equivalence.adamw_elementwise`), and, where a master lands on the other side of a bf16 rounding boundary
    than the reference's weight, by that weight's bf16 step (≤ 2⁻⁷) in the next step's gradients, which moves an
    update by ≤ 2⁻⁷ of its size (its gradient's relative change, A ≤ 1.2): atol + lr·2⁻⁷·1.2 a step."""
    m, opt, _ = master_run(0, SCALES, 0.0)
    opt.accumulate_in_fp32()
    x = torch.randn(4, 16)
    ref = model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(2):
        for micro in range(3):
            xb = x + micro + step
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(xb).float().pow(2).mean()
            loss.backward()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref_loss = ref(xb).float().pow(2).mean()
            ref_loss.backward()
        assert all(p.grad is None for p in m.parameters() if opt.lowered(p))  # moved into main_grad
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        for p, r in zip(m.parameters(), ref.parameters(), strict=True):
            w = opt.state[p]["master"] if opt.lowered(p) else p
            tol = adamw_elementwise(step + 1, HP["lr"])
            torch.testing.assert_close(w, r, rtol=tol["rtol"], atol=tol["atol"] + step * HP["lr"] * BF16_ULP * 1.2)


class FakeBucket:
    """DDP's GradBucket for `fp32_allreduce_hook`: one flat buffer holding the parameters' gradients."""

    def __init__(self, params, grads):
        self.params, self.buf = params, torch.cat([g.reshape(-1) for g in grads])
        starts = torch.tensor([0] + [g.numel() for g in grads]).cumsum(0).tolist()
        self.views = [self.buf[a:b].view(g.shape) for a, b, g in zip(starts[:-1], starts[1:], grads, strict=True)]

    def buffer(self):
        return self.buf

    def parameters(self):
        return self.params

    def gradients(self):
        return self.views


def reduce_alone(opt, params, store) -> FakeBucket:
    """`fp32_allreduce_hook` over the parameters' gradients as one bucket, in a 1-process gloo group."""
    import torch.distributed as dist

    from dflash_offline.optim import fp32_allreduce_hook

    bucket = FakeBucket(params, [p.grad for p in params])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        fp32_allreduce_hook(opt, bucket).wait()
    finally:
        dist.destroy_process_group()
    return bucket


def test_reduced_backward_keeps_its_gradient_and_the_hook_reduces_the_fp32_sum(tmp_path):
    """DDP with fp32 accumulation: the backward DDP reduces (`reduce_next_backward(True)`) leaves its bf16 gradient
    where DDP reads it, and `fp32_allreduce_hook` with the optimizer as state reduces it plus the fp32 sum of the
    earlier micro-batches into the fp32 buffer the step reads (one gloo process: the reduction is the identity)."""
    m, opt, _ = master_run(0, SCALES, 0.0)
    opt.accumulate_in_fp32()
    low = [p for p in m.parameters() if opt.lowered(p)]
    seen = []
    for micro in range(3):
        opt.reduce_next_backward(micro == 2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(torch.randn(4, 16, generator=torch.Generator().manual_seed(micro))).float().pow(2).mean()
        loss.backward()
        seen.append([p.grad.clone() if p.grad is not None else p.main_grad.clone() for p in low])
        if micro < 2:
            assert all(p.grad is None for p in low)  # moved into the fp32 sum
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in low)  # kept for DDP
    earlier = seen[1]  # the fp32 sum after micro-batch 1
    assert all(torch.equal(p.main_grad, e) for p, e in zip(low, earlier, strict=True))
    bucket = reduce_alone(opt, low, tmp_path / "pg")
    for p, e in zip(low, earlier, strict=True):
        total = e + p.grad.float()
        assert torch.equal(p.main_grad, total) and p.main_grad.dtype == torch.float32
    assert torch.equal(bucket.buf, torch.cat([p.main_grad.reshape(-1) for p in low]).to(torch.bfloat16))
    opt.step()
    opt.zero_grad()
    # the next step's only micro-batch is the reduced one: no earlier sum, the total goes into the same buffers
    buffers = [p.main_grad.data_ptr() for p in low]
    assert all(opt._pending_sum(p) is None for p in low)
    opt.reduce_next_backward(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(torch.randn(4, 16)).float().pow(2).mean().backward()
    reduce_alone(opt, low, tmp_path / "pg2")
    assert all(torch.equal(p.main_grad, p.grad.float()) for p in low)
    assert [p.main_grad.data_ptr() for p in low] == buffers and all(opt._pending_sum(p) is not None for p in low)


def test_compiled_equals_eager():
    pytest.importorskip("torch._inductor")
    try:
        m, opt, norms = master_run(5, SCALES, 1.0, compiled=True)
    except Exception as e:  # no C++ toolchain for Inductor's CPU backend on this machine
        pytest.skip(f"torch.compile unavailable on CPU here: {type(e).__name__}")
    e_m, e_opt, e_norms = master_run(5, SCALES, 1.0, compiled=False)
    assert norms == pytest.approx(e_norms, rel=sum_rtol(N_PARAMS))  # Inductor's vectorised sum: another order
    got, want = opt.master_state_dict(m), e_opt.master_state_dict(e_m)
    for k in want:  # fused, FMA-contracted arithmetic in its own order (`equivalence.adamw_elementwise`)
        torch.testing.assert_close(got[k], want[k], **adamw_elementwise(5, HP["lr"]))


def test_norm_then_update_equals_the_one_pass_step():
    """The overlapped step runs the norm and then the update group by group: the same arithmetic as one pass."""
    from dflash_offline.optim import _adamw_clip_step, _adamw_update, _grad_norm_coef

    def state(seed):
        g = torch.Generator().manual_seed(seed)
        shapes = [(8, 4), (4,), (3, 5)]
        return [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]

    p32, grads, m = state(0)
    v = [x.abs() for x in state(1)[0]]
    lows = [x.to(torch.bfloat16) if x.ndim >= 2 else None for x in p32]
    steps = [torch.tensor(3.0) for _ in p32]
    lr, hyper = torch.tensor(1e-2), (0.9, 0.95, 1e-8, 0.01)
    one = [[t.clone() if t is not None else None for t in lst] for lst in (p32, lows, grads, m, v, steps)]
    two = [[t.clone() if t is not None else None for t in lst] for lst in (p32, lows, grads, m, v, steps)]
    sk1, sk2 = torch.zeros(()), torch.zeros(())
    n1 = _adamw_clip_step(*one, lr, sk1, *hyper, 0.5)
    n2, coef, ok = _grad_norm_coef(two[2], sk2, 0.5)
    for pick in ([2, 0], [1]):  # two groups, out of list order
        _adamw_update(*([lst[i] for i in pick] for lst in two), lr, coef, ok, *hyper)
    assert n1 == n2 and coef < 1  # clipped
    for a, b in zip(one, two, strict=True):
        for x, y in zip(a, b, strict=True):
            if x is not None:
                assert torch.equal(x, y)
    assert not torch.equal(one[0][0], p32[0])  # it did move


def test_compiled_steps_outlast_dynamos_default_graph_limit():
    """One graph per parameter layout: a process building several models would hit dynamo's default of 8 graphs per
    function, a hard error under fullgraph. The steps raise the limit around their own calls."""
    from dflash_offline.optim import _compiled

    def bump(xs, y):
        for x in xs:
            x.add_(y)

    fn = _compiled(bump)
    for n in range(1, 11):  # 10 layouts (on CPU, ~2 s each to compile)
        x = torch.zeros(n)
        try:
            fn([x], torch.ones(()))
        except Exception as e:
            if n == 1 and "Recompile" not in type(e).__name__:  # no C++ toolchain for Inductor's CPU backend here
                pytest.skip(f"torch.compile unavailable on CPU here: {type(e).__name__}")
            raise
        assert torch.equal(x, torch.ones(n))


def test_refuses_low_precision_parameters():
    m = model().to(torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 parameters"):
        MasterAdamW(m.parameters(), lr=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_compiled_equals_eager_and_lowers_to_bf16():
    def run(compiled):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(256, 512, bias=False), nn.LayerNorm(512), nn.Linear(512, 64, bias=False)).cuda()
        opt = MasterAdamW(m.parameters(), max_grad_norm=1.0, compiled=compiled, **HP)
        norms = []
        for s in range(5):
            for p, g in zip(m.parameters(), grads_for(s, list(m.parameters()), SCALES[s]), strict=True):
                p.grad = g.cuda().to(p.dtype)
            norms.append(float(opt.step()))
            opt.zero_grad()
        return m, opt, norms

    m, opt, norms = run(True)
    e_m, e_opt, e_norms = run(False)
    assert m[0].weight.dtype == torch.bfloat16 and m[1].weight.dtype == torch.float32
    assert norms == pytest.approx(e_norms, rel=1e-5)
    got, want = opt.master_state_dict(m), e_opt.master_state_dict(e_m)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_zero_grad_also_clears_the_fp32_accumulation():
    """With fp32 accumulation, a backward, `zero_grad()`, then another backward: the sum holds the second gradient
    alone (a discarded micro-batch or an evaluation's backward does not leak into the next step)."""
    from dflash_offline.optim import MasterAdamW

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3, bias=False)
    opt = MasterAdamW(m.parameters(), lr=1e-2, compiled=False)
    opt.accumulate_in_fp32()
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    m(x).sum().backward()
    opt.zero_grad()
    m(x).sum().backward()
    p = next(m.parameters())
    torch.testing.assert_close(p.main_grad, torch.ones(3, 1) * x.float().sum(0), rtol=1e-2, atol=1e-2)
