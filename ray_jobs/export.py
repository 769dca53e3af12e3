"""Export the weights of a checkpoint for inference.

    python -m ray_jobs.export --checkpoint runs/demo/checkpoint_00000200 --output out/
    python -m ray_jobs.export --checkpoint ... --output out/ --format minimind   # + pretrain_<hidden>[_moe].pth

Writes a half-precision safetensors export (model.safetensors + config.json + tokenizer.json) that
`minilm.load_pretrained(DIR)` loads; with --format minimind also MiniMind's `.pth` state dict.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from minilm import checkpoint as C
from minilm.config import ConfigError, ModelConfig
from minilm.model import MiniMindForCausalLM

from .cli import fail

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ray_jobs.export", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder written by ray_jobs.pretrain")
    p.add_argument("--output", required=True, help="folder to write the export into")
    p.add_argument("--format", choices=["safetensors", "minimind"], default="safetensors",
                   help="minimind: also write MiniMind's pretrain_<hidden>[_moe].pth")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    args = p.parse_args(argv)
    try:
        resume = C.load_resume_state(args.checkpoint)
        config = ModelConfig.from_dict(resume.state["model_config"])
        model = MiniMindForCausalLM(config)
        model.load_state_dict(resume.model_state, strict=True)
        tokenizer = Path(args.checkpoint) / "weights" / "tokenizer.json"
        out = C.export_weights(args.output, model, config, tokenizer if tokenizer.is_file() else None,
                               dtype=DTYPES[args.dtype])
        print(f"weights: {out} ({model.num_params() / 1e6:.2f}M parameters, {args.dtype})")
        if args.format == "minimind":
            name = f"pretrain_{config.hidden_size}{'_moe' if config.use_moe else ''}.pth"
            C.export_minimind_pth(out / name, model.state_dict())
            print(f"minimind: {out / name}")
    except (C.CheckpointError, ConfigError) as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"cannot write {args.output}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


