"""Training progress as Ray gauges tagged with the run name (`ray_minilm_loss{run="run1"}` in Prometheus), since Ray
Train exports no loss or throughput; metrics never stop training (outside Ray, or on any error, nothing is done)."""

from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)

PREFIX = "minilm_"
TAG_KEYS = ("run",)

# key of the worker's metrics dict -> description; the gauge is PREFIX + key
GAUGES: dict[str, str] = {
    "tokens_per_s": "Training throughput over the last log interval, tokens per second summed over workers",
    "loss": "Training loss (mean over workers) at the latest log step",
    "lr": "Learning rate of the latest optimizer step",
    "mfu": "Model FLOPs utilization over the last log interval, a fraction of the device's peak",
    "grad_norm": "Gradient norm before clipping at the latest log step",
    "optimizer_step": "Optimizer steps done",
    "total_steps": "Optimizer steps the run will do",
    "samples_seen": "Training sequences consumed",
    "tokens_seen": "Training tokens consumed",
    "world_size": "Training workers",
    "accumulation_steps": "Micro-batches per optimizer step on each worker (global batch / (micro-batch x world size))",
    "redone_steps": "Optimizer steps recomputed after restarts and resizes of this run, in all",
    "data_wait_frac": "Fraction of the last log interval spent waiting for data",
    "eta_s": "Estimated seconds to the last step",
    "cuda_peak_allocated_gib": "GiB of GPU memory tensors held at most over the last log interval (rank 0's GPU)",
    "cuda_peak_reserved_gib": "GiB of GPU memory PyTorch's allocator reserved at most over the last log interval "
                              "(rank 0's GPU)",
}

_gauges: dict | None = None
_disabled = False


def metric_names() -> list[str]:
    """The Prometheus names the gauges appear under (Ray adds the `ray_` prefix)."""
    return ["ray_" + PREFIX + key for key in GAUGES]


def publish(metrics: dict, run_name: str) -> None:
    """Set every known gauge present in `metrics` (finite numbers only), tagged run=run_name."""
    global _gauges, _disabled
    if _disabled:
        return
    try:
        if _gauges is None:
            from ray.util.metrics import Gauge

            _gauges = {key: Gauge(PREFIX + key, description=desc, tag_keys=TAG_KEYS)
                       for key, desc in GAUGES.items()}
        tags = {"run": str(run_name)}
        for key, gauge in _gauges.items():
            value = metrics.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            gauge.set(float(value), tags=tags)
    except Exception as e:  # never fail a training step for a metric
        _disabled = True
        logger.warning("dashboard metrics disabled in this process: %s: %s", type(e).__name__, e)


_eval_gauge = None
EVAL_GAUGE = "eval"  # minilm_eval{run, task, metric}: the scores of checkpoints evaluated beside training


def publish_eval(records: list[dict], run_name: str) -> None:
    """The scores of one checkpoint (minilm.evaluate records) as minilm_eval{run, task, metric}; never raises."""
    global _eval_gauge
    try:
        if _eval_gauge is None:
            from ray.util.metrics import Gauge

            _eval_gauge = Gauge(PREFIX + EVAL_GAUGE, description="Score of the newest checkpoint evaluated beside "
                                "training, by task and metric", tag_keys=("run", "task", "metric"))
        for r in records:
            for key, value in (r.get("metrics") or {}).items():
                if r.get("kind") != "generate" and isinstance(value, (int, float)) and math.isfinite(value):
                    _eval_gauge.set(float(value), tags={"run": str(run_name), "task": r["task"], "metric": key})
    except Exception as e:
        logger.warning("dashboard metrics of evaluations not published: %s: %s", type(e).__name__, e)
