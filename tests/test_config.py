"""Config validation: every rule produces its own message, and all problems come back at once."""

from __future__ import annotations

import math

import pytest

from minilm.config import (
    ConfigError,
    ModelConfig,
    TrainConfig,
    accumulation_steps,
    field_kinds,
)

# (overrides, substring the message must contain)
MODEL_CASES = [
    ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
    ({"hidden_size": -64}, "hidden_size must be a positive integer, got -64"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"num_key_value_heads": -1}, "num_key_value_heads must be a positive integer"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"vocab_size": True}, "vocab_size must be a positive integer, got True"),
    ({"intermediate_size": 0}, "intermediate_size must be a positive integer"),
    ({"max_position_embeddings": 2.5}, "max_position_embeddings must be a positive integer, got 2.5"),
    ({"hidden_size": 64, "num_attention_heads": 6, "num_key_value_heads": 3},
     "num_attention_heads (6) must divide hidden_size (64)"),
    ({"hidden_size": 60, "num_attention_heads": 4, "num_key_value_heads": 2},
     "head_dim = hidden_size / num_attention_heads = 15 must be even for RoPE"),
    ({"num_attention_heads": 8, "num_key_value_heads": 3},
     "num_key_value_heads (3) must divide num_attention_heads (8)"),
    ({"rope_theta": 0.0}, "rope_theta must be > 0"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be > 0"),
    ({"dropout": 1.0}, "dropout must be in [0, 1)"),
    ({"dropout": -0.1}, "dropout must be in [0, 1)"),
    ({"use_moe": True, "num_experts": 0}, "num_experts must be >= 1, got 0"),
    ({"use_moe": True, "num_experts": 4, "num_experts_per_tok": 5},
     "num_experts_per_tok must be in [1, num_experts=4], got 5"),
    ({"use_moe": True, "num_experts_per_tok": 0}, "num_experts_per_tok must be in [1, num_experts=4], got 0"),
    ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef must be >= 0"),
    # a mistyped size: refused before torch overflows int64 (or a float) deep inside the model's build. By hand:
    # 8 layers of 3h^2 (attention, 8 heads, 4 kv) + 3h x intermediate, with intermediate 4h past 1e13
    ({"hidden_size": 2**60}, "the model would have 1.6e+38 parameters, more than 1e+13: check hidden_size"),
    ({"hidden_size": 10**400}, "the model would have ~1e+802 parameters, more than 1e+13"),
    ({"num_hidden_layers": 10**11}, "the model would have 7.37e+17 parameters"),
    ({"vocab_size": 2**63}, "the model would have 7.08e+21 parameters"),
    ({"use_moe": True, "num_experts": 10**30}, "the model would have 4.48e+37 parameters"),
    ({"max_position_embeddings": 2**63 - 1},
     "max_position_embeddings (9223372036854775807) x head_dim (96) is past 5e+12: RoPE tables that long cannot"),
]

TRAIN_CASES = [
    ({"lr": -1.0}, "lr must be a positive number, got -1.0"),
    ({"lr": 0.0}, "lr must be a positive number"),
    ({"lr": math.nan}, "lr must be a finite number"),
    ({"lr": math.inf}, "lr must be a finite number"),
    ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
    ({"warmup_steps": 1.5}, "warmup_steps must be an integer >= 0"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio must be in [0, 1]"),
    ({"min_lr_ratio": -0.1}, "min_lr_ratio must be in [0, 1]"),
    ({"schedule": "linear"}, "schedule must be one of cosine, wsd, got 'linear'"),
    ({"decay_fraction": 0.0}, "decay_fraction must be in (0, 1]"),
    ({"decay_fraction": 1.5}, "decay_fraction must be in (0, 1]"),
    ({"epochs": 0}, "epochs must be an integer >= 1"),
    ({"max_steps": 0}, "max_steps must be an integer >= 1"),
    ({"micro_batch_size": 0}, "micro_batch_size must be an integer >= 1, or auto, got 0"),
    ({"micro_batch_size": "eight"}, "micro_batch_size must be an integer >= 1, or auto, got 'eight'"),
    ({"global_batch_size": -8}, "global_batch_size must be an integer >= 1"),
    ({"seq_len": 0}, "seq_len must be an integer >= 1"),
    ({"log_every": 0}, "log_every must be an integer >= 1"),
    ({"checkpoint_every": 0}, "checkpoint_every must be an integer >= 1"),
    ({"max_nonfinite_steps": 0}, "max_nonfinite_steps must be an integer >= 1"),
    ({"global_batch_size": 0, "micro_batch_size": 16}, "global_batch_size must be an integer >= 1, got 0"),
    ({"grad_clip": 0.0}, "grad_clip must be > 0"),
    ({"dtype": "fp8"}, "dtype must be one of auto, bf16, fp16, fp32, got 'fp8'"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    ({"betas": (0.9, 1.0)}, "betas must be two numbers in [0, 1)"),
    ({"betas": (0.9,)}, "betas must be two numbers in [0, 1)"),
    ({"betas": (-0.1, 0.95)}, "betas must be two numbers in [0, 1)"),
    ({"warmup_steps": 10, "max_steps": 10},
     "warmup_steps (10) must be smaller than the total optimizer steps (10)"),
    ({"optimizer": "sgd"}, "optimizer must be one of auto, adamw, muon"),
    ({"optimizer": "muon", "muon_lr": 0}, "muon_lr must be a positive number"),
    ({"embedding_lr_ratio": 0.0}, "embedding_lr_ratio must be a positive number"),
    ({"muon_momentum": 1.0}, "muon_momentum must be in"),
]


CASES = [(ModelConfig, *c) for c in MODEL_CASES] + [(TrainConfig, *c) for c in TRAIN_CASES]


@pytest.mark.parametrize("cls,overrides,message", CASES, ids=[f"{c[0].__name__}-{c[1]}" for c in CASES])
def test_each_config_rule_reports_its_message(cls, overrides, message):
    with pytest.raises(ConfigError) as ei:
        cls(**overrides).validate()
    assert any(message in p for p in ei.value.problems), ei.value.problems
    assert message in str(ei.value)


def test_defaults_are_valid():
    assert ModelConfig().validate().problems() == []
    assert ModelConfig(use_moe=True).validate().problems() == []
    assert TrainConfig().validate().problems() == [] and accumulation_steps(64, 16, 4) == 1
    assert TrainConfig().steps_problems(100) == []


def test_warmup_checked_against_total_steps_argument():
    cfg = TrainConfig(warmup_steps=50)
    assert cfg.steps_problems(51) == []
    assert cfg.steps_problems(50) == ["warmup_steps (50) must be smaller than the total optimizer steps (50)"]


def test_world_size_not_dividing_takes_uneven_slices():
    # 64 sequences per step, micro-batch 4: any world size 1..64 keeps them (uneven sizes take uneven slices)
    accumulation_steps(64, 4, 8)
    accumulation_steps(64, 4, 3)
    with pytest.raises(ConfigError) as ei:
        accumulation_steps(64, 4, 65)
    (problem,) = ei.value.problems
    assert "world size 65" in problem
    assert "world sizes that keep it: 1-64" in problem
    # micro_batch_size need not divide the global batch: a smaller last micro-batch
    assert TrainConfig(global_batch_size=30, micro_batch_size=8).validate().problems() == []
    assert accumulation_steps(30, 8, 4) == 1


def test_accumulation_steps():
    assert accumulation_steps(64, 4, 1) == 16
    assert accumulation_steps(64, 4, 8) == 2
    assert accumulation_steps(64, 4, 16) == 1
    assert accumulation_steps(64, 16, 3) == 2  # rank 0: 22 sequences, micro-batches of 16 and 6
    assert accumulation_steps(30, 8, 1) == 4
    with pytest.raises(ConfigError, match="world sizes that keep it: 1-64$"):
        accumulation_steps(64, 16, 65)
    with pytest.raises(ConfigError, match="world size 0"):
        accumulation_steps(64, 16, 0)


def test_several_bad_fields_reported_in_one_error():
    with pytest.raises(ConfigError) as ei:
        TrainConfig(lr=-1.0, dtype="fp64", grad_clip=-1.0, betas=(2.0, 0.9)).validate()
    problems = ei.value.problems
    assert len(problems) == 4
    for needle in ("lr must be", "dtype must be", "grad_clip must be", "betas must be"):
        assert sum(needle in p for p in problems) == 1, (needle, problems)
        assert needle in str(ei.value)

    with pytest.raises(ConfigError) as ei:
        ModelConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=3, dropout=2.0,
                    rope_theta=-1.0).validate()
    assert len(ei.value.problems) == 3


def test_intermediate_size_default():
    assert ModelConfig(hidden_size=768).intermediate_size == 2432  # ceil(768*pi/64)*64 = 38*64
    assert ModelConfig(hidden_size=512).intermediate_size == 1664  # ceil(25.13)=26
    assert ModelConfig(hidden_size=64).intermediate_size == 256  # ceil(3.14)=4
    for h in (32, 64, 96, 128, 640, 1024):
        assert ModelConfig(hidden_size=h).intermediate_size == math.ceil(h * math.pi / 64) * 64
    assert ModelConfig(hidden_size=64, intermediate_size=100).intermediate_size == 100  # explicit wins


def test_num_params_from_the_sizes_is_the_built_models():
    from minilm.model import MiniMindForCausalLM

    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 256}
    for extra in ({}, {"tie_word_embeddings": False}, {"num_key_value_heads": 1, "intermediate_size": 96},
                  {"use_moe": True, "num_experts": 3, "num_experts_per_tok": 2},
                  {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "num_hidden_layers": 3}):
        cfg = ModelConfig(**{**small, **extra}).validate()
        assert cfg.num_params() == MiniMindForCausalLM(cfg).num_params(), extra
    assert ModelConfig().num_params() == 63_912_192  # the default: MiniMind's 768 x 8, counted once by torch
    assert ModelConfig(hidden_size=2**18, num_hidden_layers=1).validate()  # big, not absurd: memory decides


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ConfigError, match="unknown model config field.*hiden_size"):
        ModelConfig.from_dict({"hiden_size": 64})
    with pytest.raises(ConfigError, match="unknown train config field.*learning_rate"):
        TrainConfig.from_dict({"lr": 1e-3, "learning_rate": 1e-3})


def test_to_dict_from_dict_round_trip():
    m = ModelConfig(hidden_size=64, num_hidden_layers=2, vocab_size=256, use_moe=True)
    assert ModelConfig.from_dict(m.to_dict()) == m
    t = TrainConfig(lr=3e-4, betas=(0.8, 0.9), warmup_steps=5)
    d = t.to_dict()
    assert d["betas"] == [0.8, 0.9]  # JSON-friendly
    back = TrainConfig.from_dict(d)
    assert back == t and back.betas == (0.8, 0.9)


def test_every_float_field_refuses_inf_and_nan():
    """No float field gives inf or nan a meaning: each is refused by name (--rms-norm-eps inf trained and learned
    nothing; --weight-decay inf ended in NaN weights)."""
    for cls in (ModelConfig, TrainConfig):
        floats = [n for n, kinds in field_kinds(cls).items() if float in kinds]
        assert len(floats) >= 4, floats
        for name in floats:
            for bad in (float("inf"), float("-inf"), float("nan")):
                problems = cls(**{name: bad}).problems()
                assert any(p.startswith(f"{name} must be a finite number") for p in problems), (name, bad, problems)
