"""ray_jobs.export --format gguf: the file read back with gguf's own reader (llama.cpp's writer and reader) holds
the model's config, MiniMind's tokenizer and every weight under llama.cpp's qwen3 / qwen3moe names; a numpy forward
pass written from llama.cpp's qwen3 graph, reading only the GGUF, gives minilm's next-token logits; and, when
llama-cpp-python is installed (nightly), llama.cpp itself does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_hf_export import make_checkpoint

from minilm.checkpoint import MARKER
from minilm.data import file_sha256
from minilm.gguf_export import tokenizer_metadata
from minilm.tokenizer import BOS_ID, load_tokenizer
from ray_jobs import export

gguf = pytest.importorskip("gguf", reason="pip install 'minilm[gguf]'")

CONFIGS = {"dense": {}, "dense-untied": {"tie_word_embeddings": False},
           "moe-top2": {"use_moe": True, "num_experts": 4, "num_experts_per_tok": 2}}
PROMPT = "The quick brown fox"
# minilm's parameter names -> llama.cpp's, written out here rather than taken from gguf's name map
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Per config: (checkpoint, model, {dtype: model.gguf}); fp16 and bf16 for the dense model only."""
    done = {}
    for name, overrides in CONFIGS.items():
        root = tmp_path_factory.mktemp(name)
        ckpt, model = make_checkpoint(root, **overrides)
        files = {}
        for dtype in ("fp32", "fp16", "bf16") if name == "dense" else ("fp32",):
            assert export.main(["--checkpoint", str(ckpt), "--output", str(root / dtype), "--format", "gguf",
                                "--dtype", dtype]) == 0
            marker = json.loads((root / dtype / MARKER).read_text())
            assert marker == {"kind": "gguf", "files": {"model.gguf": file_sha256(root / dtype / "model.gguf")}}
            files[dtype] = root / dtype / "model.gguf"
        done[name] = ckpt, model, files
    return done


def read(path: Path) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """(metadata, tensors as float32 in numpy's order, GGUF type of each) of a GGUF file."""
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
               .astype(np.float32) for t in reader.tensors}
    return meta, tensors, {t.name: t.tensor_type.name for t in reader.tensors}


def expected_tensors(model) -> dict[str, torch.Tensor]:
    c, out = model.config, {}
    for key, t in model.state_dict().items():
        if key == "model.embed_tokens.weight":
            out["token_embd.weight"] = t
        elif key == "model.norm.weight":
            out["output_norm.weight"] = t
        elif key == "lm_head.weight":
            if not c.tie_word_embeddings:
                out["output.weight"] = t
        elif ".experts." not in key:
            i, rest = key.removeprefix("model.layers.").split(".", 1)
            out[f"blk.{i}.{LAYER_NAMES[rest.removesuffix('.weight')]}.weight"] = t
    for i in range(c.num_hidden_layers if c.use_moe else 0):
        experts = model.model.layers[i].mlp.experts
        for proj, name in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            out[f"blk.{i}.ffn_{name}_exps.weight"] = torch.stack([getattr(e, proj).weight for e in experts]).detach()
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_metadata_and_tokenizer(exports, name):
    ckpt, model, files = exports[name]
    meta, _, _ = read(files["fp32"])
    c, arch = model.config, "qwen3moe" if "moe" in name else "qwen3"
    assert meta["general.architecture"] == arch and meta["general.file_type"] == 0
    assert {k.removeprefix(arch + "."): v for k, v in meta.items() if k.startswith(arch + ".")} == {
        "context_length": 128, "embedding_length": 64, "block_count": 2, "feed_forward_length": c.intermediate_size,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
        "attention.value_length": 16, "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": pytest.approx(1e-5),
        **({"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": c.intermediate_size}
           if "moe" in name else {})}
    tok = load_tokenizer(ckpt / "weights" / "tokenizer.json")
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == c.vocab_size == len(vocab) and all(tokens[i] == t for t, i in vocab.items())
    assert meta["tokenizer.ggml.token_type"] == [3, 3, 3] + [1] * (c.vocab_size - 3)
    wider = tokenizer_metadata(ckpt / "weights" / "tokenizer.json", c.vocab_size + 2)  # rows past the tokenizer's ids
    assert wider["tokens"][-2:] == [f"[PAD{c.vocab_size}]", f"[PAD{c.vocab_size + 1}]"] and wider["types"][-2:] == [5, 5]
    merges = json.loads((ckpt / "weights" / "tokenizer.json").read_text())["model"]["merges"]
    assert meta["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    assert [meta[f"tokenizer.ggml.{k}"] for k in ("bos_token_id", "eos_token_id", "padding_token_id",
                                                  "add_bos_token", "add_eos_token")] == [1, 2, 0, True, False]


@pytest.mark.parametrize("name,dtype", [("dense", "fp32"), ("dense", "fp16"), ("dense", "bf16"),
                                        ("dense-untied", "fp32"), ("moe-top2", "fp32")])
def test_every_tensor_is_the_models(exports, name, dtype):
    _, model, files = exports[name]
    _, tensors, types = read(files[dtype])
    want = expected_tensors(model)
    assert sorted(tensors) == sorted(want)
    gguf_type = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}[dtype]
    for key, t in want.items():
        assert types[key] == ("F32" if t.ndim == 1 else gguf_type), key  # norms stay f32, as llama.cpp writes them
        rounded = t if t.ndim == 1 else t.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
        np.testing.assert_array_equal(tensors[key], rounded.float().numpy(), err_msg=key)


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def neox_rope(x, theta):
    """llama.cpp's NEOX RoPE on (tokens, heads, head_dim): dimension j rotates with j + head_dim / 2."""
    t, _, d = x.shape
    angles = np.outer(np.arange(t), theta ** (-np.arange(0, d, 2) / d))
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    a, b = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def numpy_logits(path: Path, ids: list[int]) -> np.ndarray:
    """(tokens, vocab) logits of llama.cpp's qwen3 / qwen3moe graph in float64, from the GGUF file alone."""
    meta, w, _ = read(path)
    arch = meta["general.architecture"]
    hp = {k.removeprefix(arch + "."): v for k, v in meta.items() if k.startswith(arch + ".")}
    heads, kv, d, eps = (hp["attention.head_count"], hp["attention.head_count_kv"], hp["attention.key_length"],
                         hp["attention.layer_norm_rms_epsilon"])
    w = {k: v.astype(np.float64) for k, v in w.items()}
    x, t = w["token_embd.weight"][ids], len(ids)
    causal = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(hp["block_count"]):
        p = {k.split(".")[2]: v for k, v in w.items() if k.startswith(f"blk.{i}.")}
        h = rms(x, p["attn_norm"], eps)
        q = neox_rope(rms((h @ p["attn_q"].T).reshape(t, heads, d), p["attn_q_norm"], eps), hp["rope.freq_base"])
        k = neox_rope(rms((h @ p["attn_k"].T).reshape(t, kv, d), p["attn_k_norm"], eps), hp["rope.freq_base"])
        k, v = np.repeat(k, heads // kv, 1), np.repeat((h @ p["attn_v"].T).reshape(t, kv, d), heads // kv, 1)
        att = softmax(np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + causal)
        x = x + np.einsum("hqk,khd->qhd", att, v).reshape(t, heads * d) @ p["attn_output"].T
        h = rms(x, p["ffn_norm"], eps)
        if "ffn_gate_inp" in p:  # softmax router, top-k weights renormalised (llama.cpp's qwen3moe)
            probs = softmax(h @ p["ffn_gate_inp"].T)
            for r in range(t):
                top = np.argsort(-probs[r])[:hp["expert_used_count"]]
                for e in top:
                    y = (h[r] @ p["ffn_gate_exps"][e].T) / (1 + np.exp(-(h[r] @ p["ffn_gate_exps"][e].T)))
                    x[r] += probs[r, e] / probs[r, top].sum() * ((y * (h[r] @ p["ffn_up_exps"][e].T)) @ p["ffn_down_exps"][e].T)
        else:
            g = h @ p["ffn_gate"].T
            x = x + (g / (1 + np.exp(-g)) * (h @ p["ffn_up"].T)) @ p["ffn_down"].T
    return rms(x, w["output_norm.weight"], eps) @ w.get("output.weight", w["token_embd.weight"]).T


def prompt_ids(ckpt: Path) -> list[int]:
    return [BOS_ID, *load_tokenizer(ckpt / "weights" / "tokenizer.json").encode(PROMPT).ids]


@pytest.mark.parametrize("name", CONFIGS)
def test_numpy_forward_from_the_gguf_gives_minilms_logits(exports, name):
    ckpt, model, files = exports[name]
    ids = prompt_ids(ckpt)
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0].double().numpy()
    theirs = numpy_logits(files["fp32"], ids)
    diff = np.abs(theirs - ours).max()
    print(f"{name}: max |logit difference| numpy-from-GGUF vs minilm = {diff:.2e}")
    assert diff < 1e-4 and (theirs.argmax(-1) == ours.argmax(-1)).all()


def test_refusals_write_nothing(exports, tmp_path, capsys):
    ckpt, _, files = exports["dense"]
    out = files["fp32"].parent
    assert export.main(["--checkpoint", str(ckpt), "--output", str(out), "--format", "gguf", "--dtype", "fp32"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "model.gguf"]  # its own earlier export: replaced
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    unnormalised = make_checkpoint(tmp_path / "moe", use_moe=True, num_experts=4, num_experts_per_tok=2,
                                   norm_topk_prob=False)[0]
    capsys.readouterr()
    for argv, why in (([ckpt, tmp_path / "other"], "holds other files"),
                      ([unnormalised, tmp_path / "new"], "always renormalises the top-k router weights")):
        assert export.main(["--checkpoint", str(argv[0]), "--output", str(argv[1]), "--format", "gguf"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and why in err
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_llama_cpp_loads_the_gguf_and_computes_minilms_logits(exports, name):
    """llama.cpp itself (llama-cpp-python: a 5-minute source build on 2 cores, docs/export.md), f32 KV cache."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp is not installed: pip install llama-cpp-python")
    ckpt, model, files = exports[name]
    llm = llama_cpp.Llama(model_path=str(files["fp32"]), n_ctx=128, logits_all=True, n_threads=2, type_k=0,
                          type_v=0, verbose=False)  # type 0: GGML_TYPE_F32
    ids = prompt_ids(ckpt)
    assert llm.tokenize(PROMPT.encode(), add_bos=True, special=False) == ids  # the embedded tokenizer is minilm's
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)], dtype=np.float64)
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0].double().numpy()
    diff = np.abs(theirs - ours).max()
    print(f"{name}: max |logit difference| llama.cpp vs minilm = {diff:.2e}")
    assert diff < 1e-3
    greedy = []  # llama.cpp's own decoding loop, through its KV cache
    for _ in range(20):
        greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        if greedy[-1] == 2:
            break
        llm.eval(greedy[-1:])
    want = model.generate(torch.tensor([ids]), max_new_tokens=20, temperature=0, eos_token_id=2)[0, len(ids):]
    assert greedy == want.tolist()
    # a random model's bytes are rarely UTF-8: llama.cpp returns them raw, tokenizers replaces each bad sequence
    text = load_tokenizer(ckpt / "weights" / "tokenizer.json").decode(greedy)
    assert llm.detokenize(greedy).decode("utf-8", "replace") == text
