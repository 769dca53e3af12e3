"""Bits per byte (minilm.bpb): the token byte table against real decoded text, the formula, the
sliding windows, and the batched scorers against one-window-at-a-time forwards."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minilm.bpb import (
    bits_per_byte,
    document_windows,
    evaluate_documents,
    token_byte_lengths,
    token_bytes,
)
from minilm.config import ModelConfig
from minilm.corpus import demo_corpus_documents
from minilm.model import MiniMindForCausalLM
from minilm.rows import pack_documents
from minilm.tokenizer import BOS_ID, EOS_ID, SPECIAL_TOKENS, save_tokenizer, train_tokenizer

UNICODE_TEXTS = ["naïve café, Übergrößenträger — 日本語のテキスト, emoji 🎉🐍 and a tab\there.",
                 "Ελληνικά και русский текст; ½ ≠ ∞", "<|im_end|> is a special token written in text"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = list(demo_corpus_documents(max_bytes=200_000)) + UNICODE_TEXTS[:2]
    tok = train_tokenizer(texts, 800)
    # the byte lengths as minilm.bpb reads them: from the saved tokenizer.json
    return tok, token_byte_lengths(save_tokenizer(tok, tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def test_byte_lengths_sum_to_the_utf8_bytes_of_real_text(tokenizer):
    tok, lengths = tokenizer
    texts = list(demo_corpus_documents(max_bytes=60_000)) + UNICODE_TEXTS[:2]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
        # Token by token, the bytes are the text's bytes in order (also inside multi-byte characters).
        assert b"".join(token_bytes(tok.id_to_token(i)) for i in ids) == text.encode("utf-8")
        assert tok.decode(ids) == text


def test_special_tokens_spell_no_bytes(tokenizer):
    tok, lengths = tokenizer
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i and lengths[i] == 0
    assert (lengths[len(SPECIAL_TOKENS):] > 0).all()
    # A special-token string in a text encodes to its id, which counts no bytes: only the rest is text.
    text = UNICODE_TEXTS[2]
    ids = tok.encode(text, add_special_tokens=False).ids
    assert EOS_ID in ids
    assert int(lengths[ids].sum()) == len(text.replace(SPECIAL_TOKENS[EOS_ID], "").encode())


def test_packed_rows_carry_the_bytes_of_their_documents(tokenizer):
    """The table gives the bytes a packed row scores, which keeping text bytes in the manifest would give."""
    tok, lengths = tokenizer
    texts = list(demo_corpus_documents(max_bytes=30_000))
    docs = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    rows, dropped = pack_documents(docs, 63)
    stream = np.concatenate([np.append(d, EOS_ID) for d in docs])
    tail = stream[len(stream) - dropped:]
    assert int(lengths[rows].sum() + lengths[tail].sum()) == sum(len(t.encode()) for t in texts)


def test_non_byte_level_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a b c"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="byte-level BPE"):
        token_byte_lengths(tmp_path / "tokenizer.json")


def test_bits_per_byte_formula():
    assert bits_per_byte(math.log(2) * 10, 5) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 0)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 120), window=st.integers(2, 40), data=st.data())
def test_windows_score_every_target_once_with_context(n, window, data):
    stride = data.draw(st.integers(1, window - 1))
    ids = list(range(n))
    windows = document_windows(ids, window, stride)
    scored = []
    start = 0
    for i, (toks, first) in enumerate(windows):
        assert 1 <= len(toks) <= window
        start = toks[0]  # ids are their own positions
        assert toks == ids[start:start + len(toks)]
        targets = list(range(start + first, start + len(toks) - 1))
        if i > 0:  # every scored target sees at least window - stride tokens (itself included)
            assert first + 1 >= window - stride
        scored += targets
    assert scored == list(range(n - 1))


def uniform_model(vocab: int) -> MiniMindForCausalLM:
    """lm_head = 0 gives logits 0: cross-entropy ln(vocab) at every position."""
    cfg = ModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=False)
    model = MiniMindForCausalLM(cfg)
    torch.nn.init.zeros_(model.lm_head.weight)
    return model


def test_uniform_model_has_log2_vocab_bits_per_token(tokenizer):
    tok, lengths = tokenizer
    vocab = len(lengths)
    docs = [tok.encode(t, add_special_tokens=False).ids for t in demo_corpus_documents(max_bytes=8_000)]
    r = evaluate_documents(uniform_model(vocab), docs, lengths, prefix=[BOS_ID], window=32, stride=16)
    tokens = sum(map(len, docs))
    assert r["tokens"] == tokens
    assert r["bytes"] == int(sum(lengths[d].sum() for d in docs))
    assert r["bpb"] == pytest.approx(tokens * math.log2(vocab) / r["bytes"], rel=1e-6)


def tiny_model(vocab: int, seed: int = 0, **kw) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=vocab, max_position_embeddings=64, **kw)
    return MiniMindForCausalLM(cfg).eval()


def window_nats(model, toks: list[int], first: int, lengths: np.ndarray) -> tuple[float, int]:
    """CE of one unpadded window, targets first.. only, special targets left out."""
    ids = torch.tensor([toks])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
    nats = nbytes = 0
    for j in range(first, len(toks) - 1):
        target = toks[j + 1]
        if lengths[target] > 0:
            nats -= float(logp[j, target])
            nbytes += int(lengths[target])
    return nats, nbytes


def test_batched_windows_equal_one_window_at_a_time(tokenizer):
    tok, lengths = tokenizer
    model = tiny_model(len(lengths))
    texts = list(itertools.islice(demo_corpus_documents(max_bytes=60_000), 6))
    docs = [tok.encode(t, add_special_tokens=False).ids[:30] for t in texts]
    docs.append(tok.encode(" ".join(texts), add_special_tokens=False).ids[:150])  # a long one: several windows
    r = evaluate_documents(model, docs, lengths, prefix=[BOS_ID], window=48, stride=20, batch_size=7)
    assert r["windows"] > len(docs)  # some documents need several windows
    nats = nbytes = 0
    for doc in docs:
        for toks, first in document_windows([BOS_ID, *doc], 48, 20):
            a, b = window_nats(model, toks, first, lengths)
            nats, nbytes = nats + a, nbytes + b
    assert r["bytes"] == nbytes
    assert r["nats"] == pytest.approx(nats, rel=1e-5)


def test_packed_rows_score_their_text_targets_only(tokenizer):
    """A packed row (seq_len + 1 tokens, EOS between documents) as one window: the special targets count nothing."""
    tok, lengths = tokenizer
    model = tiny_model(len(lengths), seed=1)
    docs = [tok.encode(t, add_special_tokens=False).ids for t in demo_corpus_documents(max_bytes=4_000)]
    rows, _ = pack_documents(docs, 31)
    rows = rows.astype(np.int64).tolist()
    r = evaluate_documents(model, rows, lengths, prefix=[], window=len(rows[0]))
    want_nats = want_bytes = 0
    for row in rows:
        a, b = window_nats(model, row, 0, lengths)
        want_nats, want_bytes = want_nats + a, want_bytes + b
    assert r["windows"] == len(rows) and r["bytes"] == want_bytes
    assert r["nats"] == pytest.approx(want_nats, rel=1e-5)
