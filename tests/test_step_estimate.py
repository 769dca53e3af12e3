"""`python -m bench.step --estimate h200`: each phase of a compiled bf16 step at the rate it runs at, added up, and
the MFU range it predicts, for the GPU check's 26M and 104M rows, consistent with minilm's own FLOP count."""

from __future__ import annotations

import json

import pytest

from bench import step as S
from minilm.config import ModelConfig
from minilm.model import MiniMindForCausalLM


@pytest.mark.parametrize("hidden, layers, batch", [(512, 8, 32), (768, 16, 128)])
def test_the_phases_count_minilms_matmul_flops_and_add_their_times(hidden, layers, batch):
    cfg = ModelConfig(hidden_size=hidden, num_hidden_layers=layers, vocab_size=6400, max_position_embeddings=513)
    phases = S.estimate_phases(cfg, batch, 512, S.HARDWARE["h200"])
    model = MiniMindForCausalLM(cfg)
    tokens = batch * 512
    matmuls = sum(p["flops"] for p in phases if not p["phase"].startswith("attention"))
    # minilm's 6N per token (the matmul parameters: the blocks' and the tied head's) is what the matmul phases do
    assert matmuls == pytest.approx(6 * tokens * (model.num_params() - layers * (2 * hidden + 2 * cfg.head_dim)
                                                  - hidden), rel=1e-9)
    hw = S.HARDWARE["h200"]
    for p in phases[:-1]:  # each phase's compute and memory time added, never the larger of the two
        assert p["time_s"] == p["compute_s"] + p["memory_s"] > 0
        assert p["range_s"][0] < p["time_s"] < p["range_s"][1]
        assert (p["compute_s"] > 0) == (p["runs"] != "memory") and (p["memory_s"] > 0) == ("memory" in p["runs"])
    head = next(p for p in phases if p["phase"].startswith("head"))  # its matmuls, then its memory (not overlapped)
    assert head["compute_s"] > 0 and head["memory_s"] > 0
    gemm = next(p for p in phases if p["runs"] == "gemm")  # at the K = hidden rate, below the large-GEMM ceiling
    assert gemm["compute_s"] > gemm["flops"] / hw["bf16_measured"]


def test_estimate_prints_both_rows_with_their_predicted_mfu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINILM_BENCH_RESULTS", str(tmp_path))
    assert S.main(["--estimate", "h200"]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "step-estimate.json").read_text())
    assert [r["size"] for r in result["sizes"]] == ["26m", "104m"]
    for r in result["sizes"]:
        model = MiniMindForCausalLM(ModelConfig(hidden_size=r["hidden"], num_hidden_layers=r["layers"],
                                                vocab_size=6400, max_position_embeddings=513))
        mfu = model.flops_per_token(512) * r["tokens_per_s"] / 989.5e12
        assert r["mfu_datasheet"] == pytest.approx(mfu) and 0 < mfu < 1
        low, high = r["mfu_datasheet_range"]
        assert low < mfu < high and r["step_s_range"][0] < r["step_s"] < r["step_s_range"][1]
        assert f"predicted MFU {mfu:.1%} of the data sheet (range {low:.1%}-{high:.1%}" in out
    assert out.count("roofline") >= 1 and "attention (flash, causal)" in out
    # the 104M row: the phases added give a range, not the 53.4% ceiling the old roofline printed
    assert result["sizes"][1]["mfu_datasheet_range"][1] < 0.5
