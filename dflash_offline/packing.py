"""Deterministic streaming packing of documents into fixed-length rows.

Rule "best-fit-open-rows": keep up to `open_rows` partly filled rows. Each document (in corpus order) goes into the
open row with the least room that still fits it; if none fits, the fullest open row is closed (emitted) when the
window is full, and the document starts a new row. A row that becomes exactly full is emitted at once. At the end
the open rows are emitted in the order they were opened. Every token appears exactly once; order inside a row is
arrival order; the same input always gives the same rows. Memory is bounded by `open_rows × seq_len`.

Documents longer than a row follow `long_doc`: "split" into `seq_len` chunks (each chunk a document of its own,
positions restarting at 0), "truncate" to the first `seq_len` tokens, or "skip".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PACKING_RULE = "best-fit-open-rows/v1"


@dataclass(eq=False)
class Doc:
    input_ids: np.ndarray  # [n] int32
    loss_mask: np.ndarray  # [n] uint8, 1 = supervised
    source: int  # ordinal of the record in the corpus stream


@dataclass(eq=False)
class Row:
    docs: list[Doc] = field(default_factory=list)
    used: int = 0
    opened: int = 0  # order in which rows were opened (tie-break and final flush order)


def split_long(doc: Doc, seq_len: int, policy: str) -> tuple[list[Doc], str | None, int]:
    """Apply the long-document policy: the pieces to pack, a skip reason (or None), and the tokens left out —
    `truncate`: past seq_len (a kept start with no supervised token skips the document, `truncated_unsupervised`);
    `split`: the pieces with no supervised token (each piece is a document of its own: its positions restart)."""
    n = len(doc.input_ids)
    if n <= seq_len:
        return [doc], None, 0
    if policy == "skip":
        return [], "too_long", n
    if policy == "truncate":
        if not doc.loss_mask[:seq_len].any():
            return [], "truncated_unsupervised", n
        return [Doc(doc.input_ids[:seq_len], doc.loss_mask[:seq_len], doc.source)], None, n - seq_len
    pieces = [
        Doc(doc.input_ids[i : i + seq_len], doc.loss_mask[i : i + seq_len], doc.source) for i in range(0, n, seq_len)
    ]
    kept = [p for p in pieces if p.loss_mask.any()]
    return kept, None, n - sum(len(p.input_ids) for p in kept)


class Packer:
    """Feed documents with `add`, collect finished rows; `flush` at the end."""

    def __init__(self, seq_len: int, open_rows: int):
        self.seq_len, self.open_rows = seq_len, open_rows
        self.rows: list[Row] = []
        self.opened = 0

    def add(self, doc: Doc) -> list[Row]:
        n = len(doc.input_ids)
        assert 0 < n <= self.seq_len, "split long documents before packing"
        best = None
        for row in self.rows:
            room = self.seq_len - row.used
            if room >= n and (best is None or room < self.seq_len - best.used):
                best = row
        out = []
        if best is None:
            if len(self.rows) >= self.open_rows:
                fullest = max(self.rows, key=lambda r: (r.used, -r.opened))
                self.rows.remove(fullest)
                out.append(fullest)
            best = Row(opened=self.opened)
            self.opened += 1
            self.rows.append(best)
        best.docs.append(doc)
        best.used += n
        if best.used == self.seq_len:
            self.rows.remove(best)
            out.append(best)
        return out

    def flush(self) -> list[Row]:
        out = sorted(self.rows, key=lambda r: r.opened)
        self.rows = []
        return out


def materialize(rows: list[Row], seq_len: int, pad_id: int) -> tuple[dict[str, np.ndarray], list[list[int]]]:
    """Rows → fixed-shape arrays [R, S]: input_ids (pad_id on the tail), loss_mask, position_ids, doc_ids (-1 tail)."""
    r = len(rows)
    out = {
        "input_ids": np.full((r, seq_len), pad_id, dtype=np.int32),
        "loss_mask": np.zeros((r, seq_len), dtype=np.uint8),
        "position_ids": np.zeros((r, seq_len), dtype=np.int32),
        "doc_ids": np.full((r, seq_len), -1, dtype=np.int32),
    }
    sources = []
    for i, row in enumerate(rows):
        at = 0
        for d, doc in enumerate(row.docs):
            n = len(doc.input_ids)
            out["input_ids"][i, at : at + n] = doc.input_ids
            out["loss_mask"][i, at : at + n] = doc.loss_mask
            out["position_ids"][i, at : at + n] = np.arange(n, dtype=np.int32)
            out["doc_ids"][i, at : at + n] = d
            at += n
        sources.append([doc.source for doc in row.docs])
    return out, sources


def unpack_row(arrays: dict[str, np.ndarray], i: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The documents of row `i` as (input_ids, loss_mask) pairs, in order (inverse of `materialize`)."""
    doc_ids = arrays["doc_ids"][i]
    out = []
    for d in range(int(doc_ids.max()) + 1 if (doc_ids >= 0).any() else 0):
        sel = doc_ids == d
        out.append((arrays["input_ids"][i][sel], arrays["loss_mask"][i][sel]))
    return out
