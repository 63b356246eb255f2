"""MasterAdamW = clip_grad_norm_ + torch AdamW on fp32 weights, with bf16 model weights, skip on non-finite norms,
torch AdamW's checkpoint layout, fp32 accumulation; compiled = eager."""

import pytest
import torch
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


@pytest.mark.parametrize("low", [None, torch.bfloat16])
def test_equals_clip_plus_torch_adamw(low):
    ref, ref_norms = reference_run(5, SCALES, 1.0, bf16_grads=low is not None)
    m, opt, norms = master_run(5, SCALES, 1.0, low=low)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert any(n > 1 for n in norms) and any(n < 1 for n in norms)
    for (name, r), p in zip(ref.named_parameters(), m.parameters(), strict=True):
        w = opt.state[p]["master"] if opt.lowered(p) else p
        assert w.dtype == torch.float32
        torch.testing.assert_close(w, r, rtol=1e-5, atol=1e-6, msg=name)
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
            torch.testing.assert_close(w, r, rtol=1e-4, atol=1e-5)


def test_compiled_equals_eager():
    pytest.importorskip("torch._inductor")
    try:
        m, opt, norms = master_run(5, SCALES, 1.0, compiled=True)
    except Exception as e:  # no C++ toolchain for Inductor's CPU backend on this machine
        pytest.skip(f"torch.compile unavailable on CPU here: {type(e).__name__}")
    e_m, e_opt, e_norms = master_run(5, SCALES, 1.0, compiled=False)
    assert norms == pytest.approx(e_norms, rel=1e-6)
    got, want = opt.master_state_dict(m), e_opt.master_state_dict(e_m)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


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
