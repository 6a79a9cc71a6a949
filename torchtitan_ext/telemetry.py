"""GIFT telemetry in torchtitan's metrics logger, plus a JSON-lines record of every step.

torchtitan's ``MetricsProcessor.log`` prints one console line per logged step and forwards
a metrics dict to TensorBoard / W&B. :class:`GiftMetricsProcessor` adds the GIFT
counters (wire bytes, managed layers, per-layer error at the last refresh) to that dict,
prints a second console line with them, and appends every logged step and validation to
``<dump_folder>/<jsonl_file>`` on rank 0, so scripts and tests read losses and telemetry
without scraping logs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

__all__ = ["GiftMetricsProcessor", "read_jsonl"]


class GiftMetricsProcessor(MetricsProcessor):
    """``MetricsProcessor`` that also logs ``telemetry()`` and writes a JSONL record."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl_file: str = "gift_metrics.jsonl"
        """File under dump_folder for one JSON record per logged step (rank 0); "" disables."""

    def __init__(self, config: Config, *, dump_folder: str = "./outputs", **kwargs: Any) -> None:
        super().__init__(config, dump_folder=dump_folder, **kwargs)
        self.telemetry: Callable[[], dict[str, float]] | None = None
        """Set by the trainer: returns the GIFT counters to log for the current step."""
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self._jsonl_path = os.path.join(dump_folder, config.jsonl_file) if config.jsonl_file and rank0 else None
        if self._jsonl_path:
            os.makedirs(os.path.dirname(self._jsonl_path) or ".", exist_ok=True)

    def _write(self, record: dict[str, Any]) -> None:
        if self._jsonl_path:
            with open(self._jsonl_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"time": time.time(), **record}) + "\n")

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        extra = dict(extra_metrics or {})
        gift = self.telemetry() if self.telemetry is not None else {}
        extra.update(gift)
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
        # Per-layer entries (gift/<metric>/<layer>) go to the loggers and the JSONL only.
        summary = {k.removeprefix("gift/"): v for k, v in gift.items() if k.count("/") == 1}
        if summary:
            logger.info("gift step %d: %s", step, "  ".join(f"{k}={_fmt(v)}" for k, v in summary.items()))
        self._write({"step": step, "loss": global_avg_loss, "max_loss": global_max_loss, "grad_norm": grad_norm, **extra})

    def log_validation(self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None) -> None:
        super().log_validation(loss, step, extra_metrics=extra_metrics)
        self._write({"step": step, "validation_loss": loss, **(extra_metrics or {})})


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Records of a ``gift_metrics.jsonl`` file, in file order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
