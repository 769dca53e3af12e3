"""Export the weights of a checkpoint for inference.

    python -m ray_jobs.export --checkpoint runs/demo/checkpoint_00000200 --output out/
    python -m ray_jobs.export --checkpoint runs/demo/best --output out/         # the best by the run's eval metric
    python -m ray_jobs.export --checkpoint ... --output out/ --format minimind   # + pretrain_<hidden>[_moe].pth
    python -m ray_jobs.export --checkpoint ... --output out-hf/ --format hf      # a Hugging Face Qwen3 folder
    python -m ray_jobs.export --checkpoint ... --output out-gguf/ --format gguf  # model.gguf for llama.cpp

safetensors is what `minilm.load_pretrained(DIR)` loads, minimind adds MiniMind's `.pth`, hf is a Qwen3
folder for transformers and lm-eval, and gguf a file llama.cpp loads as it is (docs/export.md). The flags every command shares: minilm.cli.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minilm import checkpoint as C
from minilm.config import ConfigError, ModelConfig
from minilm.gguf_export import FILE as GGUF_FILE
from minilm.gguf_export import export_gguf, gguf_arch
from minilm.hf import export_hf
from minilm.step import TORCH_DTYPES
from minilm.tokenizer import TokenizerError

from .cli import ArgumentParser, UsageError, command, fail


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m ray_jobs.export", description=__doc__.split("\n")[0], epilog=__doc__)
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder written by training, or RUN_DIR/best: "
                                                       "the run's best checkpoint (docs/evaluation.md)")
    p.add_argument("--output", required=True, help="a new or empty folder, or an earlier export to replace (a folder "
                                                   "holding anything else is refused)")
    p.add_argument("--format", choices=["safetensors", "minimind", "hf", "gguf"], default="safetensors",
                   help="safetensors: minilm's export (minilm.load_pretrained); minimind: that plus MiniMind's "
                        "pretrain_<hidden>[_moe].pth; hf: a Hugging Face Qwen3 folder (transformers, lm-eval); "
                        "gguf: model.gguf with its tokenizer (llama.cpp, pip install 'minilm[gguf]')")
    p.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="fp16", help="precision of the exported weights")
    p.add_argument("--tokenizer", help="tokenizer.json to ship with the weights (default: the checkpoint's "
                                       "weights/tokenizer.json); --format hf and gguf need one")
    return p


@command(C.CheckpointError, ConfigError, TokenizerError, UsageError)
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.checkpoint = C.resolve(args.checkpoint)  # RUN/best: the checkpoint its best.json names
        C.check_output(Path(args.output))  # refused before the checkpoint is read
        model, _ = C.open_weights(args.checkpoint)
        config = model.config
        tokenizer = tokenizer_path(args, config)
        params = f"{model.num_params() / 1e6:.2f}M parameters, {args.dtype}"
        if args.format == "hf":
            out = export_hf(args.output, model.state_dict(), config, tokenizer, dtype=TORCH_DTYPES[args.dtype])
            arch = "Qwen3MoeForCausalLM" if config.use_moe else "Qwen3ForCausalLM"
            print(f"hf: {out} ({arch}, {params}): transformers.AutoModelForCausalLM.from_pretrained, "
                  f"lm_eval --model hf")
            if config.use_moe and not config.norm_topk_prob and config.num_experts_per_tok > 1:
                print("note: llama.cpp always renormalises the top-k router weights; with norm_topk_prob false "
                      "its output will differ from transformers' and vLLM's")
        elif args.format == "gguf":
            out = export_gguf(args.output, model.state_dict(), config, tokenizer, dtype=args.dtype)
            print(f"gguf: {out / GGUF_FILE} ({gguf_arch(config)}, {params}): llama-cli -m, llama_cpp.Llama")
        else:
            out = C.export_weights(args.output, model, config, tokenizer, dtype=TORCH_DTYPES[args.dtype],
                                   minimind_pth=args.format == "minimind")
            print(f"weights: {out} ({params})")
            for pth in out.glob("*.pth"):
                print(f"minimind: {pth}")
    except OSError as e:
        return fail(f"cannot write {args.output}: {e}")
    return 0


def tokenizer_path(args: argparse.Namespace, config: ModelConfig) -> Path | None:
    """--tokenizer, else the checkpoint's weights/tokenizer.json (None if neither exists); a --tokenizer, and
    any of an hf or gguf export (whose loaders trust it), is checked against the model."""
    if args.tokenizer:
        path = Path(args.tokenizer)
    else:
        path = Path(args.checkpoint) / "weights" / "tokenizer.json"
        if not path.is_file():
            if args.format in ("hf", "gguf"):
                raise TokenizerError(f"{args.checkpoint} has no weights/tokenizer.json, and --format {args.format} "
                                     f"ships one: "
                                     f"give --tokenizer (the tokenizer.json of the data the model was trained on)")
            return None
        if args.format not in ("hf", "gguf"):
            return path  # the run's own tokenizer, checked when the data was prepared
    C.open_tokenizer(path, config)
    return path


if __name__ == "__main__":
    sys.exit(main())
