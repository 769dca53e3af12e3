"""Row builders (minilm.rows) and document-masked attention: minilm's packing,
BOS-aligned best-fit rows (property tests of the rule), and a model that does not attend across a
document boundary when `document_mask` is on."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minilm.config import ModelConfig
from minilm.model import MiniMindForCausalLM
from minilm.rows import (
    BestFitStats,
    best_fit_rows,
    bos_aligned_rows,
    iter_bos_aligned_rows,
    rows_note,
)

BOS, EOS = 1, 2
docs_strategy = st.lists(st.lists(st.integers(3, 99), min_size=0, max_size=60), min_size=0, max_size=40)


def segments(row: list[int]) -> list[list[int]]:
    """A BOS-aligned row cut at its BOS tokens."""
    starts = [i for i, t in enumerate(row) if t == BOS]
    return [row[a:b] for a, b in zip(starts, [*starts[1:], len(row)], strict=True)]


@settings(max_examples=150, deadline=None)
@given(docs=docs_strategy, row_len=st.integers(2, 40), buffer_docs=st.integers(1, 50))
def test_bos_aligned_rows_follow_the_rule(docs, row_len, buffer_docs):
    docs = [[100 + i, *d] for i, d in enumerate(docs)]  # a unique first token names each document
    rows, stats = bos_aligned_rows(docs, row_len, buffer_docs=buffer_docs)
    full = [[BOS, *d, EOS] for d in docs]
    assert rows.shape == (stats.rows, row_len)
    used: set[int] = set()
    bos_only = 0
    for row in rows.tolist():
        assert row[0] == BOS  # every row starts at a document start
        segs = segments(row)
        for k, seg in enumerate(segs):
            if len(seg) == 1:  # a document cropped to its BOS: it can only close the row
                assert k == len(segs) - 1
                bos_only += 1
                continue
            # Each segment is one document read from its beginning: BOS appears only where a document starts.
            i = seg[1] - 100
            assert i not in used and seg == full[i][:len(seg)]
            used.add(i)
            if len(seg) < len(full[i]):  # cropped: only the last segment of a row; its rest goes nowhere
                assert k == len(segs) - 1
    assert len(used) + bos_only == stats.documents
    # Every token is in a row, cropped off, or left over at the end (fewer than a row's worth).
    assert sum(map(len, full)) == rows.size + stats.cropped_tokens + stats.leftover_tokens
    assert stats.documents + stats.leftover_documents == len(docs)
    assert stats.leftover_tokens < row_len


def test_best_fit_takes_the_longest_document_that_fits_then_crops_the_shortest():
    # Lengths with BOS and EOS: a 6, b 4, c 3, d 9.  Rows of 8.
    a, b, c, d = [10] * 4, [11] * 2, [12], [13] * 7
    rows, stats = bos_aligned_rows([a, b, c, d], 8, buffer_docs=10)
    # Row 1: longest that fits 8 is d? no (9); a (6); then 2 left: nothing fits, crop the shortest (c).
    # Row 2: b (4); 4 left: nothing fits (d is 9), crop d to 4.
    assert rows.tolist() == [[BOS, *a, EOS, BOS, 12], [BOS, *b, EOS, BOS, 13, 13, 13]]
    assert stats == BestFitStats(rows=2, documents=4, cropped_documents=2, cropped_tokens=1 + 5,
                                 leftover_documents=0, leftover_tokens=0)


@settings(max_examples=150, deadline=None)
@given(docs=docs_strategy, row_len=st.integers(2, 40), buffer_docs=st.integers(1, 50))
def test_best_fit_rows_drop_nothing_and_cut_documents_only_at_row_ends(docs, row_len, buffer_docs):
    # Token 1000 + 100 * i + j is token j of document i: every token says where it comes from.
    docs = [[1000 + 100 * i + j for j in range(len(d))] for i, d in enumerate(docs)]
    full = [[BOS, *d, EOS] for d in docs]
    rows, stats = best_fit_rows(docs, row_len, buffer_docs=buffer_docs)
    assert rows.shape == (stats.rows, row_len)
    assert sum(map(len, full)) == rows.size + stats.leftover_tokens  # nothing cropped
    assert stats.cropped_tokens == stats.cropped_documents == 0 and stats.leftover_tokens < row_len
    # Read the rows in order: each document's own tokens come back in order (a prefix: the rest is left over).
    stream = rows.reshape(-1).tolist()
    for i, d in enumerate(docs):
        mine = [t for t in stream if 1000 + 100 * i <= t < 1100 + 100 * i]
        assert mine == d[:len(mine)], i
    # A document is cut only at a row end: a row that starts inside a document continues where an earlier row
    # stopped (after its previous token, or after its BOS).
    ends = []
    for row in rows.tolist():
        t = row[0]
        if t >= 1000:
            i, j = divmod(t - 1000, 100)
            assert (j > 0 and 1000 + 100 * i + j - 1 in ends) or (j == 0 and BOS in ends), row
        ends.append(row[-1])
    # A document longer than a row fills a row of its own first.
    heads = {tuple(r) for r in rows.tolist()}
    for f in full:
        if len(f) > row_len:
            assert tuple(f[:row_len]) in heads
    assert stats.split_documents == sum(len(f) > row_len for f in full)
    assert int((rows == BOS).sum()) == stats.documents  # each document counted once, where its BOS is placed


def test_best_fit_rows_of_short_documents_are_bos_aligned_rows():
    """Documents that each fit a row, placed without a crop, give the same rows in both layouts."""
    docs = [[10 + i] * n for i, n in enumerate([5, 2, 3, 1, 6, 4, 2, 5])]  # with BOS + EOS: 7 4 5 3 8 6 4 7 = 44
    a, _ = best_fit_rows(docs, 11, buffer_docs=100)
    b, _ = bos_aligned_rows(docs, 11, buffer_docs=100)
    assert a.tolist() == b.tolist()


def test_rows_note_names_only_the_packed_format():
    assert rows_note({"rows": "best-fit"}, "d") is None and rows_note({"rows": "bos-aligned"}, "d") is None
    for manifest in ({"rows": "packed"}, {}):  # a manifest without "rows" was written before the key existed
        note = rows_note(manifest, "data/tok")
        assert note.startswith("note: data/tok was prepared with --rows packed") and "\n" not in note


def test_rows_stream_with_a_bounded_buffer():
    docs = [[3 + i % 50] * (i % 23) for i in range(500)]
    consumed = []

    def source():
        for i, doc in enumerate(docs):
            consumed.append(i)
            yield doc

    it = iter_bos_aligned_rows(source(), 32, buffer_docs=16)
    next(it)
    assert len(consumed) <= 16 + 32  # the window plus at most a row's worth of tokens, not the corpus
    rest = list(it)
    assert len(rest) + 1 == bos_aligned_rows(docs, 32, buffer_docs=16)[0].shape[0]


# ---- document-masked attention --------------------------------------------------------------------

def tiny(document_mask: bool) -> MiniMindForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=64, max_position_embeddings=64, document_mask=document_mask)
    return MiniMindForCausalLM(cfg).eval()


def test_attention_mask_is_causal_within_documents():
    ids = torch.tensor([[BOS, 5, 6, EOS, BOS, 7, EOS, 9]])
    mask = tiny(True).model.attention_mask(ids)[0, 0].int()
    doc = [0, 0, 0, 0, 1, 1, 1, 2]  # a new document at a BOS and after an EOS
    want = [[int(j <= i and doc[i] == doc[j]) for j in range(8)] for i in range(8)]
    assert mask.tolist() == want


def test_document_mask_reads_each_document_as_if_alone():
    first, second = [BOS, 5, 6, 7, EOS], [BOS, 8, 9, 10, 11, EOS]
    row = torch.tensor([first + second])
    masked, plain = tiny(True), tiny(False)
    with torch.no_grad():
        alone = plain(torch.tensor([second])).logits[0]
        packed_masked = masked(row).logits[0, len(first):]
        packed_plain = plain(row).logits[0, len(first):]
    # RoPE is relative, so the shift of 5 positions changes only rounding.
    torch.testing.assert_close(packed_masked, alone, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(packed_plain, alone, rtol=1e-3, atol=1e-4)  # without the mask it reads the first document
    # The first document, and generation with a cache (one document), are unchanged by the option.
    with torch.no_grad():
        torch.testing.assert_close(masked(row).logits[0, :len(first)], plain(row).logits[0, :len(first)])
        prompt = torch.tensor([[BOS, 5, 6]])
        assert torch.equal(masked.generate(prompt, max_new_tokens=5, temperature=0),
                           plain.generate(prompt, max_new_tokens=5, temperature=0))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_document_mask_trains_with_gradients_confined_to_documents(checkpointing):
    model = tiny(True).train()
    model.model.activation_checkpointing = checkpointing
    ids = torch.tensor([[BOS, 5, 6, 7, EOS, BOS, 8, 9, 10, 11, EOS]])
    emb = model.model.embed_tokens
    inputs = emb(ids).detach().requires_grad_(True)

    def hook(_module, _args, _output):  # the embedding's output becomes a leaf we can read the gradient of
        return inputs

    handle = emb.register_forward_hook(hook)
    loss = model(ids).logits[0, 5:].float().sum()  # outputs of the second document only
    loss.backward()
    handle.remove()
    assert inputs.grad[0, :5].abs().max() == 0  # nothing flows into the first document
    assert inputs.grad[0, 5:].abs().max() > 0
