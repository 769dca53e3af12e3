"""Model and training configuration, validated before any work starts: `ModelConfig` mirrors MiniMind's
`MiniMindConfig` fields and defaults; each raises one `ConfigError` that lists every bad field at once."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from .schedule import SCHEDULES

DTYPES = ("auto", "bf16", "fp16", "fp32")  # "auto" and the names of minilm.step.TORCH_DTYPES
OPTIMIZERS = ("auto", "adamw", "muon")  # "auto": minilm.step.choose_optimizer's rule
CHECKPOINT_MODES = ("async", "sync")  # how rank 0 writes a checkpoint: minilm.checkpoint.manager
COMPILE_MODES = ("off", "blocks", "model")  # what minilm.step.prepare_model compiles
CHOICES = {"schedule": SCHEDULES, "dtype": DTYPES, "checkpoint_mode": CHECKPOINT_MODES, "optimizer": OPTIMIZERS,
           "compile": COMPILE_MODES}
# A field that was true/false before it had choices: the choices its old false and true mean, so that older YAML,
# flags (a bare --compile) and checkpoints' state.json keep their meaning.
WAS_BOOL = {"compile": ("off", "blocks")}


def from_bool(name: str, value: Any) -> Any:
    """`value` of field `name`, an old true/false spelled as today's choice (WAS_BOOL)."""
    return WAS_BOOL[name][value] if name in WAS_BOOL and isinstance(value, bool) else value

# What each ModelConfig / TrainConfig field means: its flag's help (minilm.options.add_config_flags).
FIELD_HELP = {
    "hidden_size": "width of the residual stream", "num_hidden_layers": "transformer blocks",
    "num_attention_heads": "query heads", "num_key_value_heads": "key/value heads (grouped-query attention)",
    "vocab_size": "token ids the model embeds (the tokenizer's, or more)",
    "intermediate_size": "SwiGLU width (unset: ceil(hidden_size * pi / 64) * 64, MiniMind's)",
    "max_position_embeddings": "longest sequence RoPE tables are built for", "rope_theta": "RoPE base",
    "rms_norm_eps": "RMSNorm epsilon", "tie_word_embeddings": "the output head shares the embedding's weights",
    "dropout": "dropout probability", "use_moe": "mixture-of-experts feed-forward layers",
    "num_experts": "MoE: experts per layer", "num_experts_per_tok": "MoE: experts each token is routed to",
    "norm_topk_prob": "MoE: renormalise the top-k router weights",
    "router_aux_loss_coef": "MoE: weight of the load-balancing loss",
    "bos_token_id": "begin-of-document id", "eos_token_id": "end-of-document id", "pad_token_id": "padding id",
    "document_mask": "packed rows: attend only within the same document (a BOS, or the token after an EOS, "
                     "starts one)",
    "lr": "peak learning rate (AdamW's)", "warmup_steps": "optimizer steps of linear warmup",
    "min_lr_ratio": "the lr decays to lr x this", "decay_fraction": "wsd: the share of the steps after warmup "
                                                                     "spent decaying",
    "schedule": "wsd: warmup, lr held, then a linear decay; cosine: MiniMind's cosine decay",
    "epochs": "passes over the data (when --max-steps is unset)",
    "max_steps": "optimizer steps of the run (unset: --epochs full epochs)",
    "micro_batch_size": "sequences per forward/backward of one rank; auto: on a GPU the largest whose measured peak "
                        "memory leaves a tenth of the device free (the least over ranks, probed at every start), "
                        "on a CPU 16",
    "global_batch_size": "sequences per optimizer step, the same at every world size",
    "grad_clip": "gradient norm clipped to this", "dtype": "autocast precision (auto: bf16 on a GPU with it, "
                                                           "else fp16; on CPUs bf16 where faster, else fp32)",
    "seq_len": "tokens per training sequence (rows hold seq_len + 1)",
    "log_every": "optimizer steps between metric records", "checkpoint_every": "optimizer steps between checkpoints",
    "checkpoint_every_minutes": "also checkpoint when this many minutes passed since the last",
    "checkpoint_mode": "async: a snapshot written in the background; sync: training waits for the write",
    "export_every": "the half-precision weights/ export with every N-th checkpoint (and always the last)",
    "val_samples": "held-out sequences for val_loss and val_bpb (0: no validation)",
    "eval_every": "optimizer steps between validations (unset: --checkpoint-every)",
    "seed": "seed of the initial weights and the data order", "weight_decay": "decoupled weight decay",
    "betas": "AdamW's beta1 and beta2", "max_nonfinite_steps": "this many non-finite gradient steps in a row stop "
                                                               "the run",
    "compile": "torch.compile: blocks, each transformer block; model, the whole forward with the loss's chunked head "
               "(one graph); off",
    "activation_checkpointing": "recompute each block in backward: less memory, ~1/3 more compute",
    "optimizer": "muon: Muon for the blocks' weight matrices, AdamW for the rest; adamw: AdamW for everything; "
                 "auto: muon unless its Newton-Schulz, timed at start, costs over half a step (a resume: "
                 "the checkpoint's)",
    "muon_lr": "Muon's peak lr (the schedule scales it like lr)", "muon_momentum": "Muon's momentum",
    # Beside matrices moving at muon_lr, an embedding at MiniMind's lr is what holds the loss back (docs/quality.md)
    "embedding_lr_ratio": "with Muon: the embedding and tied head (and MoE routers) at lr x this",
}


class ConfigError(ValueError):
    """A configuration a user wrote is wrong; the message names every bad field."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


def _int_from(low: int):
    return lambda v: _is_int(v) and v >= low


# What a value must be, in an error's words, and its test. The float fields' type (a finite number) is checked before
# (`_type_problems`); the int fields' tests take a value of any type.
RULES = {"a positive integer": _int_from(1), "an integer >= 0": _int_from(0), "an integer >= 1": _int_from(1),
         "an integer >= 0 (and < 2**32)": lambda v: _int_from(0)(v) and v < 1 << 32,
         "an integer >= 1, or auto": lambda v: v == "auto" or _int_from(1)(v),
         "a positive number": lambda v: v > 0, "> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0,
         "in [0, 1)": lambda v: 0 <= v < 1, "in [0, 1]": lambda v: 0 <= v <= 1, "in (0, 1]": lambda v: 0 < v <= 1}
# Each field's rule; a field that may be unset (None) is checked only when set.
MODEL_SIZES = dict.fromkeys(("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                             "vocab_size", "intermediate_size", "max_position_embeddings"), "a positive integer")
MODEL_RANGES = {"bos_token_id": "an integer >= 0", "eos_token_id": "an integer >= 0", "pad_token_id": "an integer >= 0",
                "rope_theta": "> 0", "rms_norm_eps": "> 0", "dropout": "in [0, 1)", "router_aux_loss_coef": ">= 0"}
TRAIN_RANGES = {"seed": "an integer >= 0 (and < 2**32)", "lr": "a positive number", "muon_lr": "a positive number",
                "embedding_lr_ratio": "a positive number", "warmup_steps": "an integer >= 0",
                "min_lr_ratio": "in [0, 1]", "decay_fraction": "in (0, 1]",
                "micro_batch_size": "an integer >= 1, or auto",
                **dict.fromkeys(("epochs", "max_steps", "global_batch_size", "seq_len", "log_every",
                                 "checkpoint_every", "max_nonfinite_steps", "export_every", "eval_every"),
                                "an integer >= 1"),
                "val_samples": "an integer >= 0", "grad_clip": "> 0", "weight_decay": ">= 0",
                "checkpoint_every_minutes": "a positive number", "muon_momentum": "in [0, 1)"}
UNSET_OK = frozenset({"max_steps", "eval_every", "checkpoint_every_minutes"})


def _range_problems(cfg, rules: dict[str, str]) -> list[str]:
    values = {name: getattr(cfg, name) for name in rules}
    return [f"{name} must be {rule}, got {values[name]!r}" for name, rule in rules.items()
            if not (values[name] is None and name in UNSET_OK) and not RULES[rule](values[name])]


# The most numbers one model may hold: far past any model minilm trains, well inside torch's int64 sizes.
MAX_NUMBERS = 10**13


def _rough(n: int) -> str:
    """A count as 5.1e+39, also past a float's range."""
    return f"{n:.3g}" if n < 10**300 else f"~1e+{len(str(n)) - 1}"


class _Config:
    """What both configs share: one ConfigError naming every problem, and plain dicts in and out."""

    def validate(self) -> typing.Self:
        problems = self.problems()
        if problems:
            raise ConfigError(problems)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> typing.Self:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            what = cls.__name__.removesuffix("Config").lower()
            raise ConfigError([f"unknown {what} config field(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})"])
        return cls(**d)


@dataclass
class ModelConfig(_Config):
    hidden_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    vocab_size: int = 6400
    intermediate_size: int | None = None
    max_position_embeddings: int = 32768
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    dropout: float = 0.0
    use_moe: bool = False
    num_experts: int = 4
    num_experts_per_tok: int = 1
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 5e-4
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    document_mask: bool = False

    def __post_init__(self) -> None:
        # MiniMind's SwiGLU width: ~pi * hidden, rounded up to a multiple of 64; a mistyped size (refused by
        # problems()) takes 4 x hidden, which past a float's range still is one
        h = self.hidden_size
        if self.intermediate_size is None and isinstance(h, int) and h > 0:
            self.intermediate_size = h * 4 if h > MAX_NUMBERS else math.ceil(h * math.pi / 64) * 64

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def problems(self) -> list[str]:
        p = _type_problems(self)
        if p:
            return p  # the checks below compare values, which a value of the wrong type cannot
        p = _range_problems(self, MODEL_SIZES)
        if not p:
            if self.hidden_size % self.num_attention_heads:
                p.append(f"num_attention_heads ({self.num_attention_heads}) must divide hidden_size "
                         f"({self.hidden_size})")
            elif self.head_dim % 2:
                p.append(f"head_dim = hidden_size / num_attention_heads = {self.head_dim} must be even for RoPE")
            if self.num_attention_heads % self.num_key_value_heads:
                p.append(f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                         f"({self.num_attention_heads})")
        p += _range_problems(self, MODEL_RANGES)
        if self.use_moe:
            if not isinstance(self.num_experts, int) or self.num_experts < 1:
                p.append(f"num_experts must be >= 1, got {self.num_experts!r}")
            elif not isinstance(self.num_experts_per_tok, int) or not 1 <= self.num_experts_per_tok <= self.num_experts:
                p.append(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                         f"got {self.num_experts_per_tok!r}")
        if not p:  # a mistyped size (an extra digit or ten) is refused here, not by torch's overflow deep inside
            if (n := self.num_params()) > MAX_NUMBERS:
                p.append(f"the model would have {_rough(n)} parameters, more than {MAX_NUMBERS:.0e}: "
                         "check hidden_size, intermediate_size, num_hidden_layers, vocab_size and num_experts")
            elif 2 * self.max_position_embeddings * self.head_dim > MAX_NUMBERS:
                p.append(f"max_position_embeddings ({self.max_position_embeddings}) x head_dim ({self.head_dim}) is "
                         f"past {MAX_NUMBERS // 2:.0e}: RoPE tables that long cannot be built")
        return p

    def num_params(self) -> int:
        """The parameters the model builds (MiniMindForCausalLM.num_params()), from the sizes alone."""
        h, d, layers = self.hidden_size, self.head_dim, self.num_hidden_layers
        attention = 2 * h * self.num_attention_heads * d + 2 * h * self.num_key_value_heads * d + 2 * d
        mlp = 3 * h * self.intermediate_size
        if self.use_moe:
            mlp = self.num_experts * (mlp + h)  # each expert, and its column of the router
        embedding = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * (attention + mlp + 2 * h) + h + embedding


@dataclass
class TrainConfig(_Config):
    lr: float = 5e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    schedule: str = "wsd"
    decay_fraction: float = 0.2
    epochs: int = 1
    max_steps: int | None = None
    micro_batch_size: int | str = 16  # "auto": minilm.microbatch
    global_batch_size: int = 64
    grad_clip: float = 1.0
    dtype: str = "auto"
    seq_len: int = 512
    log_every: int = 10
    checkpoint_every: int = 100
    checkpoint_every_minutes: float | None = None
    checkpoint_mode: str = "async"
    export_every: int = 1
    val_samples: int = 0
    eval_every: int | None = None
    seed: int = 42
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    max_nonfinite_steps: int = 5
    compile: str = "off"
    activation_checkpointing: bool = False
    optimizer: str = "auto"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    embedding_lr_ratio: float = 3.0

    def __post_init__(self) -> None:
        if isinstance(self.betas, list):  # YAML, JSON and state.json give a list
            self.betas = tuple(self.betas)
        self.compile = from_bool("compile", self.compile)

    def inert(self) -> frozenset[str]:
        """The fields that change nothing in this config: Muon's settings when AdamW moves everything."""
        return frozenset({"muon_lr", "muon_momentum", "embedding_lr_ratio"}) if self.optimizer == "adamw" \
            else frozenset()

    def problems(self) -> list[str]:
        p = _type_problems(self)
        if p:
            return p
        p = _range_problems(self, TRAIN_RANGES)
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                p.append(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        betas = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else ()
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
            p.append(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        return p + self.steps_problems(self.max_steps)

    def steps_problems(self, total_steps: int | None) -> list[str]:
        """What a run of `total_steps` optimizer steps (None: not known yet) finds wrong with this config."""
        if total_steps is not None and _is_int(self.warmup_steps) and _is_int(total_steps) and \
                self.warmup_steps >= total_steps:
            return [f"warmup_steps ({self.warmup_steps}) must be smaller than the total optimizer steps ({total_steps})"]
        return []

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "betas": list(self.betas)}


def check_fits(model: ModelConfig, train: TrainConfig) -> None:
    """Cross-checks between the two configs: a row of seq_len + 1 tokens goes through the model."""
    if _is_int(train.seq_len) and _is_int(model.max_position_embeddings) and \
            train.seq_len + 1 > model.max_position_embeddings:
        raise ConfigError([f"seq_len + 1 ({train.seq_len + 1}) exceeds max_position_embeddings "
                           f"({model.max_position_embeddings}): each packed row holds seq_len + 1 tokens"])


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches of rank 0 (the most of any rank) per optimizer step of `global_batch_size` sequences: its slice
    of ceil(G / W) sequences in micro-batches of at most `micro_batch_size` (minilm.data.rank_micro_batches)."""
    if not 1 <= world_size <= global_batch_size:
        raise ConfigError([f"world size {world_size} does not fit global_batch_size {global_batch_size}: every "
                           f"worker needs at least one sequence; world sizes that keep it: 1-{global_batch_size}"])
    per_rank = -(-global_batch_size // world_size)
    return -(-per_rank // micro_batch_size)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# A float field takes an int that math.* takes; inf and nan mean nothing in any field (rms_norm_eps inf learns nothing,
# weight_decay inf ends in NaN weights).
_KINDS = {bool: ("true or false", lambda v: isinstance(v, bool)),
          float: ("a finite number", lambda v: isinstance(v, float) and math.isfinite(v) or _is_int(v) and abs(v) < 1e300)}


def field_kinds(cls) -> dict[str, set]:
    """Each dataclass field's types: {int, NoneType} for `int | None`, {str} for `str`."""
    return {name: set(typing.get_args(hint)) if isinstance(hint, types.UnionType) else {hint}
            for name, hint in typing.get_type_hints(cls).items()}


def _type_problems(cfg) -> list[str]:
    """A float or bool field of the wrong type (a YAML string, a list), named once: the value checks after it
    compare and do arithmetic. The int, str and tuple fields' own checks take a value of any type."""
    p = []
    for name, kinds in field_kinds(type(cfg)).items():
        value = getattr(cfg, name)
        if value is None and type(None) in kinds or not kinds & _KINDS.keys():
            continue
        word, ok = _KINDS[float if float in kinds else bool]
        if not ok(value):
            p.append(f"{name} must be {word}, got {value!r}"[:200])
    return p

