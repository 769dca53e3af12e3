"""Tokenizer training/loading and the built-in demo corpus (no Ray)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minilm import tokenizer as T
from minilm.corpus import MAX_BYTES, demo_corpus_documents, write_demo_corpus

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Packing puts documents end to end, each followed by an end-of-sequence token.",
    "小型语言模型从零开始训练。这是一个中文句子，用来测试分词器。",
    "Emoji survive a byte-level tokenizer: 😀🎉🚀 and flags 🇫🇷, even ZWJ 👩‍💻.",
    "Mixed 混合 text with numbers 12345 and symbols <>[]{}\\ and tabs\tand\nnewlines\n",
] * 20
ROUND_TRIP = [
    "hello world",
    "  leading and trailing spaces  ",
    "中文测试，你好，世界！日本語のテキスト、한국어 텍스트",
    "emoji 😀🎉 mixed 混合 👩‍👩‍👧‍👦 🇯🇵",
    "tabs\tand\nnewlines\r\nand NUL \x00 and é ü ß",
    "rare: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q",
]
TRAIN_SCRIPT = """
import hashlib, json, sys
from minilm.tokenizer import train_tokenizer, tokenizer_to_str
texts = json.loads(sys.stdin.read())
print(hashlib.sha256(tokenizer_to_str(train_tokenizer(texts, 300)).encode()).hexdigest())
"""


@pytest.fixture(scope="module")
def tok():
    return T.train_tokenizer(TEXTS, 300)


def test_special_token_ids(tok):
    assert T.special_ids(tok) == {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    assert [tok.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.get_vocab_size() == 300 == T.vocab_size_of(tok)
    # literal special-token strings in a text encode to their ids (MiniMind's pretrain data has them)
    ids = tok.encode("<|im_start|>hi<|im_end|>").ids
    assert (ids[0], ids[-1]) == (1, 2)
    # nothing is added around a document: packing adds the EOS itself
    assert 2 not in tok.encode("plain text").ids


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids and all(0 <= i < 300 for i in ids)
    assert tok.decode(ids) == text


def test_round_trip_with_special_tokens(tok):
    text = "<|im_start|>你好 😀<|im_end|>"
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_training_is_deterministic_in_this_process_and_across_processes(tok):
    assert T.tokenizer_to_str(T.train_tokenizer(TEXTS, 300)) == T.tokenizer_to_str(tok)
    # hash maps in the Rust trainer are seeded per process: compare with a fresh interpreter too
    want = hashlib.sha256(T.tokenizer_to_str(tok).encode()).hexdigest()
    out = subprocess.run([sys.executable, "-c", TRAIN_SCRIPT], input=json.dumps(TEXTS),
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == want


def test_training_caps_the_text(tok):
    capped = T.train_tokenizer(TEXTS + ["zzzz qqqq " * 1000], 300, max_bytes=sum(len(t.encode()) for t in TEXTS))
    assert T.tokenizer_to_str(capped) == T.tokenizer_to_str(tok)


def test_small_corpus_gives_smaller_vocab():
    small = T.train_tokenizer(["abc abc abd"], 6400)
    assert T.special_ids(small)["eos_token_id"] == 2
    assert T.MIN_VOCAB_SIZE <= small.get_vocab_size() < 6400


@pytest.mark.parametrize("bad", [2, 100, 258])
def test_vocab_too_small(bad):
    with pytest.raises(T.TokenizerError, match="too small"):
        T.train_tokenizer(TEXTS, bad)


def test_save_and_load(tok, tmp_path):
    path = T.save_tokenizer(tok, tmp_path / "tokenizer.json")
    loaded = T.load_tokenizer(path)
    assert T.tokenizer_to_str(loaded) == T.tokenizer_to_str(tok)
    assert T.load_tokenizer(tmp_path).encode(ROUND_TRIP[3]).ids == tok.encode(ROUND_TRIP[3]).ids  # a folder
    # saving is byte-identical
    assert T.save_tokenizer(tok, tmp_path / "again.json").read_bytes() == path.read_bytes()


def test_load_existing_tokenizer_json(tok, tmp_path):
    """Any tokenizer.json with MiniMind's special tokens loads, e.g. one written elsewhere by hand."""
    data = json.loads(T.tokenizer_to_str(tok))
    data["truncation"] = None
    (tmp_path / "other.json").write_text(json.dumps(data))
    other = T.load_tokenizer(tmp_path / "other.json")
    assert other.encode("hello 你好").ids == tok.encode("hello 你好").ids


def test_load_refuses_wrong_special_tokens(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|im_end|>"],
                                                     show_progress=False))
    t.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(T.TokenizerError, match=r"<\|im_end\|> is id 1.*|<\|endoftext\|> is missing"):
        T.load_tokenizer(tmp_path / "tokenizer.json")


def test_load_errors(tmp_path):
    with pytest.raises(T.TokenizerError, match="does not exist"):
        T.load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(T.TokenizerError, match="not a tokenizers JSON"):
        T.load_tokenizer(tmp_path / "bad.json")


# ---- the demo corpus --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_docs():
    return list(demo_corpus_documents())


def test_demo_corpus_is_a_few_mb_of_prose(demo_docs):
    total = sum(len(d.encode()) for d in demo_docs)
    assert 1_500_000 < total <= MAX_BYTES
    assert len(demo_docs) > 1000
    assert len(set(demo_docs)) == len(demo_docs)
    assert all(len(d) >= 80 and d == d.strip() for d in demo_docs)
    words = " ".join(demo_docs[:500]).split()
    assert sum(w.lower() in {"the", "a", "of", "to", "is", "and"} for w in words) / len(words) > 0.08  # English
    assert any("Return" in d for d in demo_docs)


@pytest.mark.slow  # builds the corpus a second time (~6 s)
def test_demo_corpus_is_deterministic(demo_docs, tmp_path):
    # write_demo_corpus walks the stdlib afresh: same documents, same order
    info = write_demo_corpus(tmp_path / "a.jsonl")
    assert info["documents"] == len(demo_docs)
    lines = (tmp_path / "a.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["text"] for line in lines] == demo_docs


def test_demo_corpus_cap(demo_docs):
    small = list(demo_corpus_documents(max_bytes=100_000))
    assert small == demo_docs[:len(small)]
    assert 90_000 < sum(len(d.encode()) for d in small) <= 100_000


def test_demo_corpus_trains_a_tokenizer(demo_docs):
    tok = T.train_tokenizer(demo_docs[:400], 500)
    assert T.special_ids(tok)["eos_token_id"] == 2
    assert tok.decode(tok.encode(demo_docs[0]).ids) == demo_docs[0]


def test_demo_corpus_root_is_the_stdlib():
    import sysconfig

    from minilm.corpus import stdlib_dir

    assert stdlib_dir() == Path(sysconfig.get_paths()["stdlib"])
    assert (stdlib_dir() / "os.py").is_file()
