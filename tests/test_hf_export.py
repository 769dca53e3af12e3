"""ray_jobs.export --format hf: a Qwen3 folder that transformers loads without trust_remote_code, whose logits
and greedy generations are minilm's, whose tokenizer is MiniMind's, and whose config fields and tensor names
are the ones vLLM's and llama.cpp's Qwen3 / Qwen3-MoE loaders read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import save_resume_state
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from minilm.checkpoint import MARKER, load_pretrained, verify
from minilm.config import ModelConfig
from minilm.model import MiniMindForCausalLM
from minilm.tokenizer import save_tokenizer, train_tokenizer
from ray_jobs import export

TEXTS = ["def read(path):\n    return open(path).read()\n", "The quick brown fox jumps over the lazy dog. " * 3,
         "Return the list of items, sorted by key.", "naïve café — 東京 🚀"] * 8
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
            max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5)
CONFIGS = {
    "dense": {},
    "dense-untied": {"tie_word_embeddings": False},
    "moe-top2": {"use_moe": True, "num_experts": 4, "num_experts_per_tok": 2},
    "moe-top1": {"use_moe": True, "num_experts": 4, "num_experts_per_tok": 1},
    "moe-top2-unnormalised": {"use_moe": True, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False},
}


def make_checkpoint(root: Path, **overrides) -> tuple[Path, MiniMindForCausalLM]:
    """A checkpoint folder as ray_jobs.pretrain writes it (resume state + weights/tokenizer.json).

    The weights are spread wider than the 0.02 init and every RMSNorm gain is moved off 1.0: a skipped or
    misplaced norm then changes the logits, and greedy decoding is not decided by rounding noise.
    """
    torch.manual_seed(0)
    config = ModelConfig(**{**TINY, **overrides})
    model = MiniMindForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    ckpt = root / "checkpoint_00000010"
    save_resume_state(ckpt, model=model, optimizer=torch.optim.AdamW(model.parameters()),
                      scaler=torch.amp.GradScaler("cpu", enabled=False),
                      state={"optimizer_step": 10, "model_config": config.to_dict()})
    (ckpt / "weights").mkdir()
    save_tokenizer(train_tokenizer(TEXTS, vocab_size=config.vocab_size), ckpt / "weights" / "tokenizer.json")
    return ckpt, model.eval()


def run_export(capsys, *argv: str) -> tuple[int, str, str]:
    code = export.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple[Path, Path, MiniMindForCausalLM]]:
    """Per config: (hf folder, minilm safetensors folder), both fp32 from the same checkpoint, and the model."""
    done = {}
    for name, overrides in CONFIGS.items():
        root = tmp_path_factory.mktemp(name)
        ckpt, model = make_checkpoint(root, **overrides)
        for fmt, out in (("hf", root / "hf"), ("safetensors", root / "minilm")):
            assert export.main(["--checkpoint", str(ckpt), "--output", str(out), "--format", fmt, "--dtype", "fp32"]) == 0
        done[name] = (root / "hf", root / "minilm", model)
    return done


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_load_pretrained_in_fp32(exports, name):
    hf_dir, minilm_dir, _ = exports[name]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()  # no trust_remote_code
    ours, _ = load_pretrained(minilm_dir)
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if "moe" in name else "Qwen3ForCausalLM")
    ids = torch.randint(0, 320, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = ours(ids).logits, hf(ids).logits
    assert expected.std() > 1.0  # logits that differ from token to token, not a flat near-zero field
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["dense", "moe-top2"])
def test_greedy_generate_matches_minilm_and_stops_at_eos(exports, name):
    hf_dir, _, model = exports[name]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert (hf.generation_config.bos_token_id, hf.generation_config.eos_token_id,
            hf.generation_config.pad_token_id) == (1, 2, 0)
    prompt = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        got = hf.generate(prompt, max_new_tokens=16, do_sample=False)
        expected = model.generate(prompt, max_new_tokens=16, temperature=0, eos_token_id=2)
    assert got.tolist() == expected.tolist()
    assert len(set(got[0, 5:].tolist())) > 1  # a continuation, not one token repeated
    # With <|im_end|> made the certain next token, generate stops right after it (eos from generation_config).
    with torch.no_grad():
        stop = hf.generate(prompt, max_new_tokens=8, do_sample=False, logits_processor=[ForceToken(2)])
    assert stop[0, -1].item() == 2 and stop.shape[1] == prompt.shape[1] + 1


class ForceToken:
    """A logits processor that makes one token id the only choice."""

    def __init__(self, token_id: int):
        self.token_id = token_id

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.token_id] = 0.0
        return forced


def test_tokenizer_is_minimind_s(exports):
    hf_dir, minilm_dir, _ = exports["dense"]
    tok = AutoTokenizer.from_pretrained(hf_dir)  # no trust_remote_code
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    _, ours = load_pretrained(minilm_dir)
    for text in TEXTS[:4] + ["<|im_start|>hello<|im_end|>"]:
        ids = tok(text)["input_ids"]
        assert ids == ours.encode(text).ids  # the same ids as the tokenizer the model was trained with
        assert tok.decode(ids) == text  # byte-level: decodes back unchanged
    assert tok("<|im_start|>x<|im_end|>")["input_ids"][0] == 1 and tok("<|im_start|>x<|im_end|>")["input_ids"][-1] == 2


@pytest.mark.parametrize("name", ["dense", "moe-top2"])
def test_config_fields_are_read_by_transformers_as_written(exports, name):
    """Every key of config.json is a field transformers' Qwen3(Moe)Config knows (a typo would be ignored silently)."""
    hf_dir, _, model = exports[name]
    raw = json.loads((hf_dir / "config.json").read_text())
    cfg = AutoConfig.from_pretrained(hf_dir)
    moved = {"rope_theta", "rope_scaling", "torch_dtype", "dtype"}  # transformers 5 folds these into rope_parameters / dtype
    for key, value in raw.items():
        if key not in moved:
            assert getattr(cfg, key) == value, key
    c = model.config
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": c.rope_theta}
    assert cfg.head_dim == c.hidden_size // c.num_attention_heads == 16  # Qwen3Config's default would be 128
    assert cfg.dtype == torch.float32


# What vLLM's and llama.cpp's Qwen3 / Qwen3-MoE loaders read, from their source (vllm/model_executor/models/qwen3.py,
# qwen3_moe.py; llama.cpp conversion/base.py TextModel.set_gguf_parameters, conversion/qwen.py, src/models/qwen3*.cpp).
VLLM_LLAMA_CPP_FIELDS = ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                         "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                         "max_position_embeddings", "rms_norm_eps", "rope_theta", "attention_bias",
                         "tie_word_embeddings", "bos_token_id", "eos_token_id"]
MOE_FIELDS = ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers"]


def qwen3_tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of a Qwen3 checkpoint on the Hub, by name, for this config (written from the Qwen3 layout)."""
    h, d, q, kv = c.hidden_size, c.hidden_size // c.num_attention_heads, c.num_attention_heads, c.num_key_value_heads
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                       p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, q * d),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        ffn = {"gate_proj": (c.intermediate_size, h), "up_proj": (c.intermediate_size, h),
               "down_proj": (h, c.intermediate_size)}
        if c.use_moe:
            shapes[p + "mlp.gate.weight"] = (c.num_experts, h)
            for j in range(c.num_experts):
                shapes.update({f"{p}mlp.experts.{j}.{k}.weight": s for k, s in ffn.items()})
        else:
            shapes.update({f"{p}mlp.{k}.weight": s for k, s in ffn.items()})
    return shapes


@pytest.mark.parametrize("name", ["dense", "moe-top2", "dense-untied"])
def test_fields_and_tensor_names_vllm_and_llama_cpp_read(exports, name):
    hf_dir, _, model = exports[name]
    c = model.config
    raw = json.loads((hf_dir / "config.json").read_text())
    expected = {"architectures": ["Qwen3MoeForCausalLM" if c.use_moe else "Qwen3ForCausalLM"],
                "model_type": "qwen3_moe" if c.use_moe else "qwen3", "vocab_size": 320, "hidden_size": 64,
                "intermediate_size": c.intermediate_size, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 128,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "attention_bias": False,
                "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": 1, "eos_token_id": 2}
    assert {k: raw.get(k) for k in VLLM_LLAMA_CPP_FIELDS} == expected
    if c.use_moe:
        assert {k: raw.get(k) for k in MOE_FIELDS} == {
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": c.intermediate_size,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        embed, head = f.get_tensor("model.embed_tokens.weight"), f.get_tensor("lm_head.weight")
    assert shapes == qwen3_tensor_shapes(c)
    # Tied: lm_head.weight is written anyway (loaders that ignore tie_word_embeddings get the right head).
    assert torch.equal(head, embed) == c.tie_word_embeddings
    assert torch.equal(head, model.lm_head.weight.detach())


def test_default_dtype_is_fp16_and_the_folder_is_complete(tmp_path, capsys):
    """Into a new folder; again over that export (replaced); never into a folder that holds anything else."""
    ckpt, model = make_checkpoint(tmp_path)
    out = tmp_path / "hf"
    for _ in range(2):
        code, stdout, _ = run_export(capsys, "--checkpoint", ckpt, "--output", out, "--format", "hf")
        assert code == 0 and "Qwen3ForCausalLM" in stdout
        assert sorted(p.name for p in out.iterdir()) == sorted([
            "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", MARKER])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", ckpt.name])  # no staging folder left
    (out / "notes.txt").write_text("mine")
    code, _, err = run_export(capsys, "--checkpoint", ckpt, "--output", out, "--format", "hf")
    assert code == 2 and err.startswith(f"error: --output {out} holds other files") and err.count("\n") == 1
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    verify(out)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model(ids).logits, atol=0.05, rtol=0.01)  # fp16 rounding only


def test_moe_with_unnormalised_router_weights_warns_about_llama_cpp(tmp_path, capsys):
    ckpt, _ = make_checkpoint(tmp_path, **CONFIGS["moe-top2-unnormalised"])
    code, stdout, _ = run_export(capsys, "--checkpoint", ckpt, "--output", tmp_path / "hf", "--format", "hf")
    assert code == 0 and "Qwen3MoeForCausalLM" in stdout
    assert "note: llama.cpp always renormalises the top-k router weights" in stdout


def test_tokenizer_flag_and_its_errors(tmp_path, capsys):
    ckpt, _ = make_checkpoint(tmp_path)
    tok = ckpt / "weights" / "tokenizer.json"
    moved = tmp_path / "data-tokenizer.json"
    tok.rename(moved)
    code, _, err = run_export(capsys, "--checkpoint", ckpt, "--output", tmp_path / "a", "--format", "hf")
    assert code == 2 and err.startswith("error: ") and "no weights/tokenizer.json" in err and "--tokenizer" in err
    assert err.count("\n") == 1 and not (tmp_path / "a").exists()

    code, _, _ = run_export(capsys, "--checkpoint", ckpt, "--output", tmp_path / "b", "--format", "hf",
                            "--tokenizer", moved)
    assert code == 0 and (tmp_path / "b" / "tokenizer.json").read_bytes() == moved.read_bytes()

    bad = tmp_path / "bad.json"
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(bad))  # no special tokens
    code, _, err = run_export(capsys, "--checkpoint", ckpt, "--output", tmp_path / "c", "--format", "hf",
                              "--tokenizer", bad)
    assert code == 2 and "special tokens" in err and err.count("\n") == 1

    big = tmp_path / "big.json"
    save_tokenizer(train_tokenizer([f"word{i} " * 3 for i in range(2000)], vocab_size=800), big)
    code, _, err = run_export(capsys, "--checkpoint", ckpt, "--output", tmp_path / "d", "--format", "hf",
                              "--tokenizer", big)
    assert code == 2 and "vocab_size=320" in err and err.count("\n") == 1
    assert not any((tmp_path / n).exists() for n in ("a", "c", "d"))
