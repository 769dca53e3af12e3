"""GGUF export: one `model.gguf` that llama.cpp loads as it is. MiniMind's blocks are Qwen3's, so no weight is
permuted (architecture `qwen3` or `qwen3moe`, tokenizer GGUF's `gpt2` byte-level BPE)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from .checkpoint.files import write_export
from .config import ModelConfig
from .data import file_sha256
from .errors import UsageError
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, TokenizerError

FILE = "model.gguf"
# --dtype: (numpy type of the matrices, GGUF file type); norms stay f32 as llama.cpp's converter writes them.
GGUF_DTYPES = {"fp32": (np.float32, 0), "fp16": (np.float16, 1), "bf16": (None, 32)}


def gguf_arch(config: ModelConfig) -> str:
    """llama.cpp's architecture for `config`; UsageError for an MoE that llama.cpp would compute differently."""
    if config.use_moe and not config.norm_topk_prob and config.num_experts_per_tok > 1:
        raise UsageError("--format gguf: llama.cpp's qwen3moe always renormalises the top-k router weights, and this "
                          "model has norm_topk_prob false with top-k > 1: export --format hf for transformers or vLLM")
    return "qwen3moe" if config.use_moe else "qwen3"


def gguf_tensors(state_dict: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights under llama.cpp's names (gguf's own name map), each MoE layer's experts stacked as
    (experts, out, in); no output.weight when tied (llama.cpp then reuses token_embd)."""
    import gguf

    arch = gguf.MODEL_ARCH.QWEN3MOE if config.use_moe else gguf.MODEL_ARCH.QWEN3
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    experts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    out = {}
    for key, t in state_dict.items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        expert = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight", key)
        if expert:  # the merged name gguf maps, e.g. model.layers.0.mlp.experts.gate_proj
            experts.setdefault(f"{expert[1]}.{expert[3]}", []).append((int(expert[2]), t))
            continue
        out[names.get_name(key, try_suffixes=(".weight",))] = t
    for key, parts in experts.items():
        out[names.get_name(key + ".weight", try_suffixes=(".weight",))] = torch.stack([t for _, t in sorted(parts)])
    return out


def tokenizer_metadata(path: Path, vocab_size: int) -> dict:
    """GGUF's tokenizer fields from a tokenizer.json; TokenizerError unless it is a byte-level BPE that GPT-2's split
    reproduces (minilm's and MiniMind's are): llama.cpp would tokenize anything else differently."""
    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if (model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or pre.get("add_prefix_space")
            or not pre.get("use_regex", True) or spec.get("normalizer")):
        raise TokenizerError(f"{path}: GGUF's gpt2 tokenizer is a byte-level BPE split as GPT-2 splits, with no "
                             f"normalizer; this one is {model.get('type')} after {pre.get('type')}")
    added = spec.get("added_tokens") or []
    by_id = {i: t for t, i in model["vocab"].items()} | {t["id"]: t["content"] for t in added}
    special = {t["id"] for t in added if t.get("special")}
    return {
        "tokens": [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)],  # rows the model embeds past the vocab
        "types": [3 if i in special else 1 if i in by_id else 5 for i in range(vocab_size)],  # control/normal/unused
        "merges": [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])],
    }


def write_gguf(f: Path, state_dict: dict[str, torch.Tensor], config: ModelConfig, tokenizer: dict, dtype: str) -> str:
    """Write the GGUF file `f` (new), fsync it; its SHA-256."""
    import gguf

    c, (np_dtype, file_type) = config, GGUF_DTYPES[dtype]
    w = gguf.GGUFWriter(f, gguf_arch(c))
    moe = {"expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok,
           "expert_feed_forward_length": c.intermediate_size} if c.use_moe else {}
    metadata = {  # each key's writer is GGUFWriter.add_<key>
        "context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
        "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
        "head_count": c.num_attention_heads, "head_count_kv": c.num_key_value_heads, "key_length": c.head_dim,
        "value_length": c.head_dim, "rope_freq_base": c.rope_theta, "layer_norm_rms_eps": c.rms_norm_eps,
        "file_type": file_type, **moe, "tokenizer_model": "gpt2", "tokenizer_pre": "gpt-2",
        "token_list": tokenizer["tokens"], "token_types": tokenizer["types"], "token_merges": tokenizer["merges"],
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "add_bos_token": True, "add_eos_token": False,  # minilm scores and generates after a BOS, as it packs documents
    }
    for key, value in metadata.items():
        getattr(w, f"add_{key}")(value)
    for name, t in gguf_tensors(state_dict, c).items():
        t = t.detach().cpu()
        if t.ndim == 1 or dtype == "fp32":
            w.add_tensor(name, t.float().numpy())
        elif np_dtype is None:  # bf16: numpy has no such type, so its bits as int16
            w.add_tensor(name, t.to(torch.bfloat16).view(torch.int16).numpy(), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, t.float().numpy().astype(np_dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(f, "rb") as written:
        os.fsync(written.fileno())
    return file_sha256(f)


def export_gguf(path: str | os.PathLike, state_dict: dict[str, torch.Tensor], config: ModelConfig,
                tokenizer_path: str | os.PathLike, dtype: str = "fp16") -> Path:
    """Write the folder `path` (new, empty, or an earlier export replaced) holding model.gguf; the model and
    tokenizer are checked first, so a refusal writes nothing."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UsageError("--format gguf needs the gguf package (llama.cpp's writer): pip install 'minilm[gguf]'") from None
    gguf_arch(config)
    tokenizer = tokenizer_metadata(Path(tokenizer_path), config.vocab_size)
    return write_export(Path(path), {FILE: lambda f: write_gguf(f, state_dict, config, tokenizer, dtype)}, "gguf")

