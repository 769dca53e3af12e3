"""Hugging Face export: a folder that transformers, vLLM and llama.cpp's converter open as Qwen3 (or Qwen3-MoE),
whose architecture and parameter names MiniMind's are; loading needs no trust_remote_code (docs/export.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .checkpoint.files import write_bytes, write_export, write_safetensors
from .config import ModelConfig
from .tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS


def hf_config(config: ModelConfig, dtype: torch.dtype = torch.float16) -> dict:
    """config.json of the Qwen3 (or Qwen3-MoE) model that computes what MiniMindForCausalLM computes: every field,
    since Qwen3Config's defaults are Qwen3-8B's."""
    c = config
    d = {
        "architectures": ["Qwen3MoeForCausalLM" if c.use_moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if c.use_moe else "qwen3",
        **{k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                      "rms_norm_eps", "rope_theta", "tie_word_embeddings", "bos_token_id",
                                      "eos_token_id", "pad_token_id")},
        "head_dim": c.head_dim,  # MiniMind's is hidden / heads; Qwen3Config would assume 128
        "hidden_act": "silu", "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": c.num_hidden_layers,
        "initializer_range": 0.02, "use_cache": True,
        # transformers 4.x and vLLM read torch_dtype, transformers 5 dtype
        "torch_dtype": str(dtype).removeprefix("torch."), "dtype": str(dtype).removeprefix("torch."),
    }
    if c.use_moe:
        d.update({
            "num_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "moe_intermediate_size": c.intermediate_size,  # every layer is MoE: experts have MiniMind's FFN width
            "norm_topk_prob": c.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": c.router_aux_loss_coef, "output_router_logits": False,
        })
    return d


def hf_tensors(state_dict: dict[str, torch.Tensor], config: ModelConfig,
               dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The weights (MiniMind's names are Qwen3's), each its own contiguous copy; lm_head.weight even when tied, for
    loaders that ignore tie_word_embeddings."""
    tensors = {k: v.detach().to(dtype=dtype, device="cpu").contiguous().clone() for k, v in state_dict.items()}
    if "lm_head.weight" not in tensors and config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    return tensors


def tokenizer_config(config: ModelConfig) -> dict:
    """tokenizer_config.json: what AutoTokenizer needs to build a PreTrainedTokenizerFast from tokenizer.json."""
    ids = {PAD_TOKEN: config.pad_token_id, BOS_TOKEN: config.bos_token_id, EOS_TOKEN: config.eos_token_id}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", **special_tokens_map(),
        "unk_token": None,  # byte-level: every string encodes, nothing is unknown
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,  # would change decoded text (" ." -> ".")
        "added_tokens_decoder": {str(ids[t]): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                               "normalized": False, "single_word": False} for t in SPECIAL_TOKENS},
    }


def special_tokens_map() -> dict:
    return {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}


def generation_config(config: ModelConfig) -> dict:
    return {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id}


def export_hf(path: str | os.PathLike, state_dict: dict[str, torch.Tensor], config: ModelConfig,
              tokenizer_path: str | os.PathLike, dtype: torch.dtype = torch.float16) -> Path:
    """Write the Hugging Face folder `path` (new, empty, or an earlier export replaced); CheckpointError if it holds
    anything else or a write fails."""
    writers = {
        "config.json": lambda f: _write_json(f, hf_config(config, dtype)),
        "generation_config.json": lambda f: _write_json(f, generation_config(config)),
        "model.safetensors": lambda f: write_safetensors(f, hf_tensors(state_dict, config, dtype), {"format": "pt"}),
        "tokenizer.json": lambda f: write_bytes(f, Path(tokenizer_path).read_bytes()),
        "tokenizer_config.json": lambda f: _write_json(f, tokenizer_config(config)),
        "special_tokens_map.json": lambda f: _write_json(f, special_tokens_map()),
    }
    return write_export(Path(path), writers, "hf")


def _write_json(f: Path, d: dict) -> str:
    return write_bytes(f, (json.dumps(d, indent=2, sort_keys=True) + "\n").encode())

