"""--micro-batch-size auto (minilm.microbatch) on the CUDA stand-in given a memory limit: the probe's choice runs,
a micro-batch one larger runs out of memory under the same limit, the global batch is kept, the least over ranks
is taken, and the run is the run of the chosen number given explicitly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from cuda_standin import CudaRules

from minilm import microbatch
from minilm.config import ModelConfig, TrainConfig
from minilm.distributed import Collectives
from minilm.model import Attention, MiniMindForCausalLM
from minilm.step import make_optimizer
from minilm.train import LocalLauncher
from minilm.trainer import Dataset, RunOptions, Trainer

pytestmark = pytest.mark.timeout(300)
SEQ_LEN = 256  # long rows: a sequence's activations outweigh the model's bytes, so one more crosses the limit
MODEL = ModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=512, max_position_embeddings=SEQ_LEN + 1)
GLOBAL_BATCH = 16
DATA = Dataset.in_memory(np.random.default_rng(0).integers(0, MODEL.vocab_size, (3 * GLOBAL_BATCH, SEQ_LEN + 1)))


@pytest.fixture(autouse=True)
def one_attention_path(monkeypatch):
    """The GQA path fixed: timed (per process, on "cuda"), it could differ between a probe and the run it sizes."""
    monkeypatch.setattr(Attention, "gqa", "sdpa")


def train_config(micro_batch_size) -> TrainConfig:
    return TrainConfig(micro_batch_size=micro_batch_size, global_batch_size=GLOBAL_BATCH, seq_len=SEQ_LEN,
                       max_steps=2, log_every=1, dtype="fp32", optimizer="adamw", lr=1e-3)


def run(micro_batch_size, limit: int | None, run_dir=None, **options) -> tuple[Trainer, list[str], int]:
    """A 2-step run on "cuda" under the stand-in's memory limit: (trainer, its lines, the peak bytes)."""
    lines: list[str] = []
    with CudaRules(memory_limit=limit) as rules:
        trainer = Trainer(MODEL, train_config(micro_batch_size), RunOptions(name="auto", run_dir=run_dir, **options),
                          DATA, LocalLauncher(DATA, micro_batch_size, device="cuda", run_dir=run_dir,
                                              say=lines.append))
        trainer.fit()
    return trainer, lines, rules.peak


def measured_peaks(model_cfg: ModelConfig) -> tuple[int, int]:
    """The probe's own measurement with no limit: the peak at one sequence, and what each more adds."""
    with CudaRules():
        model = MiniMindForCausalLM(model_cfg).to("cuda")
        optimizer, cfg = make_optimizer(model, train_config(1)), train_config(1)
        microbatch.measured_peak(model, optimizer, cfg, torch.device("cuda"), 1)  # the gradients and state made
        one = microbatch.measured_peak(model, optimizer, cfg, torch.device("cuda"), 1)
        return one, microbatch.measured_peak(model, optimizer, cfg, torch.device("cuda"), 2) - one


def limit_for(m: int, model_cfg: ModelConfig = MODEL) -> int:
    """A device whose usable share (less the margin) holds m sequences and half of one more."""
    one, per_row = measured_peaks(model_cfg)
    return int((one + (m - 0.5) * per_row) / (1 - microbatch.MEMORY_MARGIN))


@pytest.mark.parametrize("fits", [1, 2])
def test_auto_takes_the_largest_micro_batch_that_fits_and_one_more_runs_out_of_memory(fits):
    limit = limit_for(fits)
    trainer, lines, peak = run("auto", limit)
    m = trainer.micro_batch_size
    assert m == fits and peak <= limit
    assert trainer.accumulation == -(-GLOBAL_BATCH // m) and sum(trainer.shares) == 1  # the global batch kept
    assert f"x accumulation {trainer.accumulation} x micro-batch {m} (auto: peak " in lines[0]
    assert trainer.checkpoint_state({"loss": 0.0})["micro_batch_size"] == m
    assert trainer.checkpoint_state({"loss": 0.0})["train_config"]["micro_batch_size"] == "auto"  # a resume probes
    with pytest.raises(torch.OutOfMemoryError):
        run(m + 1, limit)  # not merely conservative: a notch larger does not fit the same device


def test_a_smaller_device_gets_a_smaller_micro_batch():
    small, large = (run("auto", limit_for(k))[0].micro_batch_size for k in (1, 3))
    assert small < large


def test_a_run_with_auto_is_the_run_of_its_number_given_explicitly():
    auto, _, _ = run("auto", limit_for(2))
    given, _, _ = run(auto.micro_batch_size, None)
    assert [h["loss"] for h in auto.history] == [h["loss"] for h in given.history]
    for (name, a), b in zip(auto.raw_model.state_dict().items(), given.raw_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_restart_probes_again_and_the_checkpoint_keeps_auto(tmp_path):
    first, _, _ = run("auto", limit_for(3), str(tmp_path), exit_after_steps=1)
    second, lines, _ = run("auto", limit_for(1), str(tmp_path))  # the same run on a smaller device
    assert (first.micro_batch_size, second.micro_batch_size, second.step) == (3, 1, 2)
    assert lines[0].startswith("resumed run auto at optimizer step 1") and ", micro-batch 1 (auto: peak " in lines[0]


class OtherRankFitsOne(Collectives):
    """The min over two ranks, the other rank's device holding one sequence (the collective stubbed)."""

    def __init__(self):
        super().__init__("cuda")
        self.ops = []

    def all_reduce(self, tensor, op=None, async_op=False):
        self.ops.append(op)
        return torch.minimum(tensor, torch.ones_like(tensor)), None


def test_the_probe_leaves_the_model_and_rng_as_they_were_and_ranks_take_the_least():
    cfg, model_cfg = train_config("auto"), ModelConfig(**{**MODEL.to_dict(), "dropout": 0.1})  # dropout draws
    with CudaRules(memory_limit=limit_for(3, model_cfg)):
        torch.manual_seed(0)
        model = MiniMindForCausalLM(model_cfg).to("cuda")
        before, rng = {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()
        collectives = OtherRankFitsOne()
        m, why = microbatch.resolve_micro_batch(model, cfg, torch.device("cuda"), 2, collectives)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert all(p.grad is None for p in model.parameters()) and torch.equal(torch.get_rng_state(), rng)
    assert (m, collectives.ops) == (1, [dist.ReduceOp.MIN]) and why.endswith("; 1, the least over ranks")


def test_on_a_cpu_auto_is_sixteen_at_most_the_ranks_slice():
    model = MiniMindForCausalLM(MODEL)
    for global_batch, world_size, want in ((64, 1, 16), (64, 2, 16), (16, 4, 4), (15, 2, 8)):
        cfg = TrainConfig(micro_batch_size="auto", global_batch_size=global_batch)
        m, why = microbatch.resolve_micro_batch(model, cfg, torch.device("cpu"), world_size, Collectives("cpu"))
        assert m == want and why.startswith("auto: 16 on a CPU")
