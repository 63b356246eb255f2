"""Projected taps (dflash_offline/projection.py, bench/projection.py): the fold is exact, the spectrum finds the
subspace the states live in, and the bench reports a cache's retained energy per k."""

import torch

from dflash_offline.projection import SecondMoment, fold, residual, retained


def test_fold_gives_the_full_tap_linear_of_the_projected_one():
    g = torch.Generator().manual_seed(0)
    H, ks, out_dim = 48, [8, 16, 12], 32
    Ps = [torch.linalg.qr(torch.randn(H, k, generator=g, dtype=torch.float64))[0] for k in ks]
    fc_prime = torch.randn(out_dim, sum(ks), generator=g, dtype=torch.float64)
    fc = fold(fc_prime, Ps)
    assert fc.shape == (out_dim, len(ks) * H)
    h = [torch.randn(5, H, generator=g, dtype=torch.float64) for _ in ks]
    z = torch.cat([x @ P for x, P in zip(h, Ps, strict=True)], dim=1)
    torch.testing.assert_close(torch.cat(h, dim=1) @ fc.t(), z @ fc_prime.t(), rtol=1e-12, atol=1e-10)
    try:
        fold(fc_prime[:, :-1], Ps)
    except ValueError as e:
        assert "input features" in str(e)
    else:
        raise AssertionError("a width mismatch must be refused")


def test_the_spectrum_finds_a_low_rank_subspace_and_held_out_rows_confirm_it():
    g = torch.Generator().manual_seed(1)
    H, r = 64, 6
    basis = torch.linalg.qr(torch.randn(H, r, generator=g))[0]
    scale = torch.tensor([40.0, 10, 5, 3, 2, 1])  # one dominant direction, as massive activations give

    def draw(n):
        return (torch.randn(n, r, generator=g) * scale) @ basis.t() + 0.01 * torch.randn(n, H, generator=g)

    mom = SecondMoment(H)
    for _ in range(4):
        mom.add(draw(256))
    evals, evecs = mom.spectrum()
    assert mom.n == 1024 and bool((evals[:-1] >= evals[1:]).all())
    assert retained(evals, r) > 0.9999 and retained(evals, 1) < 0.95 and retained(evals, H) == 1.0
    held = draw(512)
    assert residual(evecs[:, :r], held) < 1e-4 < residual(evecs[:, : r - 1], held)
    assert residual(evecs, held) < 1e-20


def test_the_bench_reports_every_tap_and_width_of_a_cache(hidden_cache, tmp_path):
    import json

    from bench import projection

    out = tmp_path / "p.json"
    r = projection.main([f"--cache={hidden_cache}", "--ks=4,16", "--calib_shards=2", f"--out={out}"])
    assert json.loads(out.read_text())["hidden_size"] == r["hidden_size"]
    H = r["hidden_size"]
    for rec in r["layers"].values():
        kept = [rec["retained"][k] for k in (4, 16, H)]
        lost = [rec["heldout_loss"][k] for k in (4, 16, H)]
        assert kept == sorted(kept) and kept[-1] > 1 - 1e-9 and lost == sorted(lost, reverse=True) and lost[-1] < 1e-9
        assert rec["calib_tokens"] > 0 and rec["heldout_tokens"] > 0
    assert r["bytes_per_token"][4]["bf16"] == 4 * 2 * len(r["layers"])
