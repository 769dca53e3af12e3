"""Print a sampled continuation from a weights export or a checkpoint.

    python -m minilm.sample --checkpoint runs/demo/weights --prompt "The os module" --max-new-tokens 60
    python -m minilm.sample --checkpoint runs/demo/best --prompt "The os module"   # the run's best checkpoint

The flags every command shares: minilm.cli (`--weights` is the old spelling of `--checkpoint`).
"""

from __future__ import annotations

import sys

import torch

from . import checkpoint as C
from .cli import ArgumentParser, command, fail
from .config import ConfigError
from .evaluate import TaskError, find_tokenizer, identify
from .tokenizer import TokenizerError


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m minilm.sample", description=__doc__.split("\n")[0], epilog=__doc__)
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder, RUN_DIR/best (the run's best "
                                                       "checkpoint) or a weights export (model.safetensors + config.json)")
    p.rename("--checkpoint", "--weights")
    p.add_argument("--tokenizer", help="tokenizer.json, for weights without one (default: the folder's own, else "
                                       "that of another checkpoint of the run)")
    p.add_argument("--prompt", default="", help="text to continue (default: none, from the BOS token alone)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate, at least 1")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, 0: greedy")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling: the smallest set of tokens of this "
                                                            "much probability, in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    return p


@command(C.CheckpointError, TaskError, TokenizerError)
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        return fail("need --max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
    try:
        model, tokenizer = load(args.checkpoint, args.tokenizer)
    except C.CheckpointError:  # already its one line (a ValueError too)
        raise
    except (ConfigError, OSError, ValueError, TypeError, RuntimeError) as e:  # a config.json or weights that do not fit
        return fail(f"{args.checkpoint}: cannot load these weights ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:300]})")
    ids = [model.config.bos_token_id] + tokenizer.encode(args.prompt).ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         top_p=args.top_p, eos_token_id=model.config.eos_token_id,
                         generator=torch.Generator().manual_seed(args.seed))
    print(tokenizer.decode(out[0, 1:].tolist()))
    return 0


def load(path: str, tokenizer: str | None = None):
    """(model in eval mode, tokenizer) of a weights export or a resume checkpoint (RUN/best resolved): a checkpoint's
    own weights/ export when it has one, else its fp32 weights; the tokenizer found as ray_jobs.evaluate finds it."""
    checkpoint = identify(C.resolve(path))
    export = checkpoint.path / "weights"
    model, state = C.open_weights(export if checkpoint.resume and (export / C.MARKER).is_file() else checkpoint.path)
    return model, C.open_tokenizer(find_tokenizer(checkpoint, tokenizer), model.config,
                                   (state or {}).get("tokenizer_sha256"))


if __name__ == "__main__":
    sys.exit(main())
