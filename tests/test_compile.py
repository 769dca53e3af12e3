"""--compile off|blocks|model: the whole-model mode compiles the forward with the loss's chunked head and trains as
the eager model does; the old true/false spellings (YAML, flags, a checkpoint's state.json) mean blocks and off."""

from __future__ import annotations

import copy

import pytest
import torch
from test_step import batch, make_model

from minilm import checkpoint as C
from minilm import train
from minilm.config import TrainConfig
from minilm.options import build_configs, load_yaml
from minilm.step import make_grad_scaler, make_optimizer, optimizer_step, prepare_model


def compiled(module: torch.nn.Module) -> bool:
    return module._compiled_call_impl is not None  # what nn.Module.compile() sets


@pytest.mark.parametrize("mode, whole, blocks", [("off", False, False), ("blocks", False, True),
                                                 ("model", True, False)])
def test_each_mode_compiles_its_region(mode, whole, blocks):
    model = prepare_model(make_model(), TrainConfig(compile=mode), "cpu")  # lazy: nothing compiles before a forward
    assert compiled(model) == whole and all(compiled(b) == blocks for b in model.model.layers)


@pytest.mark.slow  # ~30 s on 2 cores (a few from Inductor's cache): one compilation of the training graph
def test_a_whole_model_compiled_run_has_the_eager_runs_losses_and_gradients():
    eager = make_model()
    model = prepare_model(copy.deepcopy(eager), TrainConfig(compile="model"), "cpu")
    assert compiled(model)  # one region: the forward and, inside it, the loss
    rows = batch(4, seed=1)
    for m in (eager, model):
        m(rows[:, :-1], targets=rows[:, 1:]).loss.backward()
    for (name, a), b in zip(eager.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    optimizers = [make_optimizer(m, TrainConfig(optimizer="adamw")) for m in (eager, model)]
    scaler = make_grad_scaler(torch.float32, "cpu")
    for i in range(3):
        rows = batch(4, seed=10 + i)
        a, b = (optimizer_step(m, o, scaler, [rows], lr=1e-3, grad_clip=1.0)
                for m, o in zip((eager, model), optimizers, strict=True))
        torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.grad_norm, a.grad_norm, rtol=1e-4, atol=1e-6)
    for a, b in zip(eager.parameters(), model.parameters(), strict=True):  # AdamW moves near-zero gradients by ~lr
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_the_old_true_false_spellings_mean_blocks_and_off(tmp_path):
    parse = lambda *flags: build_configs(train.build_parser().parse_args(list(flags)), {},  # noqa: E731
                                         train.LocalOptions).train.compile
    assert [parse(), parse("--compile"), parse("--no-compile"), parse("--compile", "model")] == \
        ["off", "blocks", "off", "model"]
    for text, mode in (("true", "blocks"), ("false", "off"), ("model", "model")):
        (tmp_path / "c.yaml").write_text(f"compile: {text}\n")
        assert load_yaml(str(tmp_path / "c.yaml")) == {"compile": mode}
    assert TrainConfig.from_dict({"compile": True}).compile == "blocks"  # an older checkpoint's state.json
    assert TrainConfig(compile=False).compile == "off"
    assert TrainConfig(compile="all").problems() == ["compile must be one of off, blocks, model, got 'all'"]


def test_resuming_a_checkpoint_of_the_bool_days_notes_only_a_real_change():
    state = {"train_config": {"compile": False}}
    assert C.config_changes(state, TrainConfig(compile="off")) == []
    assert [str(c) for c in C.config_changes(state, TrainConfig(compile="model"))] == ["compile off -> model"]
    assert C.config_changes({"train_config": {"compile": True}}, TrainConfig(compile="blocks")) == []
