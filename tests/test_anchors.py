"""Anchor sampling and label alignment: the off-by-one contract of DFlash training."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_offline.anchors import (
    IGNORE,
    block_input_ids,
    block_labels,
    block_position_ids,
    sample_anchors,
    valid_anchor_mask,
)


def packed_row(doc_specs, seq_len, seed=0):
    """One row from (length, n_prompt) per document: prompt tokens unsupervised, the rest supervised."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (seq_len,), generator=g)
    doc = torch.full((seq_len,), -1)
    lm = torch.zeros(seq_len, dtype=torch.long)
    pos = torch.zeros(seq_len, dtype=torch.long)
    start = 0
    for d, (n, n_prompt) in enumerate(doc_specs):
        doc[start : start + n] = d
        pos[start : start + n] = torch.arange(n)
        lm[start + n_prompt : start + n] = 1
        start += n
    assert start <= seq_len
    return ids, lm, doc, pos


def batch(rows, seq_len):
    cols = list(zip(*(packed_row(r, seq_len, seed=i) for i, r in enumerate(rows)), strict=True))
    return [torch.stack(c) for c in cols]


ROWS = [[(20, 5), (30, 8), (10, 3)], [(40, 10), (20, 20)], [(64, 0)]]  # row 1: doc 1 fully unsupervised + padding


def expected_valid(lm, doc):
    B, S = lm.shape
    ok = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        for p in range(S - 1):
            ok[b, p] = bool(lm[b, p] and lm[b, p + 1] and doc[b, p] == doc[b, p + 1] and doc[b, p] >= 0)
    return ok


def test_valid_anchor_mask_matches_rule():
    ids, lm, doc, pos = batch(ROWS, 64)
    lm[0, 19:21] = 1  # supervised across a document boundary: position 19 must still not be an anchor
    assert torch.equal(valid_anchor_mask(lm, doc), expected_valid(lm, doc))
    assert not valid_anchor_mask(lm, doc)[0, 19]


def test_anchors_only_at_valid_positions_and_padding():
    ids, lm, doc, pos = batch(ROWS, 64)
    ok = expected_valid(lm, doc)
    n_valid = ok.sum(1)
    A = 40  # rows have 41, 29 and 63 valid positions: row 1 gets padded anchors
    for seed in range(20):
        anc, keep = sample_anchors(lm, doc, A, 4, torch.Generator().manual_seed(seed))
        assert anc.shape == keep.shape == (3, A) and anc.dtype == torch.long
        for b in range(3):
            k = keep[b]
            assert k.sum() == min(A, int(n_valid[b]))
            assert torch.all(k[: int(k.sum())]) and not torch.any(k[int(k.sum()) :])  # kept first
            kept = anc[b][k]
            assert torch.all(ok[b, kept])
            assert torch.all(kept[1:] > kept[:-1])  # distinct, ascending
            assert torch.all(anc[b][~k] == 0)


def test_resampling_changes_and_seed_reproduces():
    ids, lm, doc, pos = batch(ROWS, 64)
    g = torch.Generator().manual_seed(1)
    a1, _ = sample_anchors(lm, doc, 8, 4, g)
    a2, _ = sample_anchors(lm, doc, 8, 4, g)  # same generator, advanced state
    assert not torch.equal(a1, a2)
    b1, _ = sample_anchors(lm, doc, 8, 4, torch.Generator().manual_seed(1))
    assert torch.equal(a1, b1)


def test_sampling_is_uniform_over_valid_positions():
    ids, lm, doc, pos = batch([[(64, 32)]], 64)
    ok = expected_valid(lm, doc)[0]
    n, A, draws = int(ok.sum()), 8, 3000
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(64)
    for _ in range(draws):
        anc, keep = sample_anchors(lm, doc, A, 4, g)
        counts.index_add_(0, anc[0][keep[0]], torch.ones(int(keep.sum())))
    expect = draws * A / n
    assert torch.all(counts[~ok] == 0)
    assert torch.all((counts[ok] - expect).abs() < 5 * expect**0.5)  # ~5 sigma


def reference_labels(ids, lm, doc, anc, keep, L):
    B, A = anc.shape
    S = ids.shape[1]
    out = torch.full((B, A, L), IGNORE)
    for b in range(B):
        for a in range(A):
            p = int(anc[b, a])
            for k in range(1, L):
                t = p + k
                if keep[b, a] and t < S and doc[b, t] == doc[b, p] and lm[b, t]:
                    out[b, a, k] = ids[b, t]
    return out


def test_labels_are_same_position_tokens():
    ids, lm, doc, pos = batch(ROWS, 64)
    L = 8
    anc, keep = sample_anchors(lm, doc, 12, L, torch.Generator().manual_seed(3))
    labels = block_labels(ids, lm, doc, anc, keep, L)
    assert torch.equal(labels, reference_labels(ids, lm, doc, anc, keep, L))
    assert torch.all(labels[:, :, 0] == IGNORE)
    # slot k is token[anchor + k] itself, not token[anchor + k + 1]
    b, a = 0, 0
    p = int(anc[b, a])
    assert labels[b, a, 1] == ids[b, p + 1]


def test_labels_stop_at_document_row_end_and_unsupervised():
    L = 6
    ids, lm, doc, pos = batch([[(10, 2), (8, 4), (4, 0)]], 24)  # 2 pad tokens at the end
    lm[0, 6] = 0  # an unsupervised hole inside doc 0
    anc = torch.tensor([[7, 8, 16, 20, 4]])
    keep = torch.tensor([[True, True, True, True, False]])
    lab = block_labels(ids, lm, doc, anc, keep, L)
    # anchor 7 (doc 0 = 0..9): slots 1, 2 -> tokens 8, 9; slots 3.. cross into doc 1 -> none
    assert lab[0, 0].tolist() == [IGNORE, ids[0, 8], ids[0, 9], IGNORE, IGNORE, IGNORE]
    # anchor 16 (doc 1 = 10..17): slot 1 -> 17, then doc 2
    assert lab[0, 2].tolist() == [IGNORE, ids[0, 17]] + [IGNORE] * 4
    # anchor 20 (doc 2 = 18..21): slot 1 -> 21, then padding (doc -1) and the row end
    assert lab[0, 3].tolist() == [IGNORE, ids[0, 21]] + [IGNORE] * 4
    # a dropped anchor has no labels at all
    assert torch.all(lab[0, 4] == IGNORE)
    # anchor 4: slot 2 is position 6, unsupervised
    anc2 = torch.tensor([[4]])
    lab2 = block_labels(ids, lm, doc, anc2, torch.tensor([[True]]), L)
    assert lab2[0, 0, 2] == IGNORE and lab2[0, 0, 1] == ids[0, 5] and lab2[0, 0, 3] == ids[0, 7]


def test_block_inputs_and_positions():
    ids, lm, doc, pos = batch(ROWS, 64)
    anc = torch.tensor([[3, 25, 55], [45, 0, 0], [10, 62, 0]])
    keep = torch.tensor([[True, True, True], [True, False, False], [True, True, False]])
    x = block_input_ids(ids, anc, keep, 4, mask_token_id=7777).view(3, 3, 4)
    assert torch.all(x[:, :, 1:] == 7777)
    assert torch.equal(x[:, :, 0], torch.where(keep, ids.gather(1, anc), 7777))
    p = block_position_ids(pos, anc, 4).view(3, 3, 4)
    assert p[0, 1].tolist() == [5, 6, 7, 8]  # row index 25 is position 5 of doc 1 (starts at 20)
    assert p[2, 1].tolist() == [62, 63, 64, 65]  # may run past the row: positions only feed RoPE


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    prompt_frac=st.floats(0, 1),
    A=st.integers(1, 16),
    L=st.integers(2, 6),
    seed=st.integers(0, 2**16),
)
def test_labels_property(lengths, prompt_frac, A, L, seed):
    S = 48
    specs, total = [], 0
    for n in lengths:
        n = min(n, S - total)
        if n == 0:
            break
        specs.append((n, int(n * prompt_frac)))
        total += n
    ids, lm, doc, pos = batch([specs], S)
    anc, keep = sample_anchors(lm, doc, A, L, torch.Generator().manual_seed(seed))
    ok = expected_valid(lm, doc)
    assert keep.sum() == min(A, int(ok.sum()))
    assert torch.all(ok[0, anc[0][keep[0]]])
    labels = block_labels(ids, lm, doc, anc, keep, L)
    assert torch.equal(labels, reference_labels(ids, lm, doc, anc, keep, L))
    assert torch.all((labels[..., 1] >= 0) == keep)  # every kept anchor has its slot-1 label
