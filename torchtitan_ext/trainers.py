"""torchtitan trainers with a ``gift`` config section.

``GiftTrainer`` (stock trainer, FSDP2 ``fully_shard``) and ``GiftGraphTrainer``
(graph_trainer: SimpleFSDP + whole-step ``aot_fx_trace``) subclass torchtitan's trainers to

* add ``Config.gift`` (:class:`.section.GiftSection`, ``--gift.*``);
* wrap the model spec's ``parallelize_fn``: torchtitan calls it with a fixed signature
  that carries no GIFT settings, so the trainer wraps it with the final, CLI-parsed
  config before ``Trainer.__init__`` runs it. After parallelization the wrapper registers
  the model's linear weights with a ``GiftState`` (:mod:`.layers`) and, for FSDP2,
  installs GIFT's reduce-scatter (:mod:`.fsdp2`); graph_trainer's ``gift`` pass pipeline
  (:mod:`.pipeline`) rewrites the traced reduce-scatters instead;
* advance the state once per optimizer step (its refresh rebuilds the geometry);
* log GIFT telemetry through :class:`.telemetry.GiftMetricsProcessor`;
* checkpoint the GIFT state with DCP as part of the trainer's own ``train_state``.

GIFT covers pure data parallelism (FSDP over the ``fsdp`` mesh); other parallelisms are
rejected when ``gift.enable`` is set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from gift_compile.passes import last_reports
from gift_compile.state import GiftState
from torchtitan.distributed import ParallelDims
from torchtitan.experiments.graph_trainer.trainer import GraphTrainer
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from . import cpu_compat, fsdp2
from .layers import manage_linears
from .pipeline import GIFT_PASS_PIPELINE
from .section import GiftSection
from .telemetry import GiftMetricsProcessor

__all__ = ["GiftGraphTrainer", "GiftTrainer"]

_GIFT_KEY = "gift"


def _wrap_parallelize(config: Any, after: Callable[[nn.Module], None]) -> None:
    """Make ``config.model_spec.parallelize_fn`` call ``after(model)`` once it returns."""
    inner = config.model_spec.parallelize_fn

    def parallelize_then_gift(model: nn.Module, **kwargs: Any) -> nn.Module:
        model = inner(model, **kwargs)
        after(model)
        return model

    config.model_spec = replace(config.model_spec, parallelize_fn=parallelize_then_gift)


def _data_parallel_group(parallel_dims: ParallelDims) -> dist.ProcessGroup:
    """The FSDP group GIFT reduces over; other parallelisms are not supported."""
    others = {
        "tensor": parallel_dims.tp,
        "context": parallel_dims.cp,
        "pipeline": parallel_dims.pp,
        "expert": parallel_dims.ep,
        "data-replicate (HSDP/DDP)": parallel_dims.dp_replicate,
    }
    unsupported = [name for name, degree in others.items() if degree > 1]
    if unsupported:
        raise ValueError(f"gift.enable supports pure FSDP data parallelism; {', '.join(unsupported)} parallelism is on")
    return parallel_dims.get_mesh("fsdp").get_group()


class _GiftMixin:
    """GIFT state, stepping, telemetry and checkpointing shared by both trainers."""

    config: Any
    parallel_dims: ParallelDims
    step: int
    device: torch.device
    metrics_processor: Any
    model_parts: list[nn.Module]

    _gift: GiftState | None
    _gift_counters: fsdp2.WireCounters | None
    _gift_logged_step: int
    _gift_reported_refreshes: int
    # Defined by each trainer: what to do with the parallelized model, and its gradient
    # communication per step: the bytes this rank hands to gradient collectives
    # (gift/wire_bytes_per_step, gift/fp32_bytes_per_step, gift/bf16_bytes_per_step) plus
    # any path-specific counters.
    _gift_after_parallelize: Callable[[nn.Module], None]
    _gift_comm: Callable[[], dict[str, float]]

    def _gift_init(self, config: Any) -> None:
        cpu_compat.activate()
        self._gift = None
        self._gift_counters = None
        self._gift_logged_step = 0
        self._gift_reported_refreshes = 0
        _wrap_parallelize(config, self._gift_after_parallelize)

    def _gift_manage(self, model: nn.Module, *, tag_gradients: bool) -> GiftState:
        group = _data_parallel_group(self.parallel_dims)
        state = manage_linears(
            model, self.config.gift.to_gift_config(), group, device=self.device, tag_gradients=tag_gradients
        )
        logger.info(f"GIFT: {len(state.layers)} weights managed ({', '.join(state.layers) or 'none'})")
        self._gift = state
        return state

    def _gift_connect_metrics(self) -> None:
        if self._gift is None:
            return
        if not isinstance(self.metrics_processor, GiftMetricsProcessor):
            raise TypeError("gift.enable needs metrics=GiftMetricsProcessor.Config(...) to log its telemetry")
        self.metrics_processor.telemetry = self._gift_telemetry

    def _gift_step(self) -> None:
        if self._gift is not None:
            self._gift.step()

    def _gift_telemetry(self) -> dict[str, float]:
        state = self._gift
        assert state is not None
        comm = self._gift_comm()
        wire, fp32, bf16 = (comm[f"gift/{k}_bytes_per_step"] for k in ("wire", "fp32", "bf16"))
        out: dict[str, float] = {
            "gift/managed_layers": float(len(state.layers)),
            "gift/selected_layers": float(sum(layer.selected for layer in state.layers.values())),
            **comm,
            "gift/compression_vs_fp32": fp32 / wire if wire else float("nan"),
            "gift/compression_vs_bf16": bf16 / wire if wire else float("nan"),
        }
        if len(state.history) > self._gift_reported_refreshes:
            record = state.history[-1]
            self._gift_reported_refreshes = len(state.history)
            out["gift/refresh_step"] = float(record.step)
            out["gift/refresh_s"] = record.seconds
            rows = list(record.layers.values())
            if rows:
                out["gift/err_euclidean_mean"] = sum(float(r["err_euclidean"]) for r in rows) / len(rows)
                out["gift/err_transformed_mean"] = sum(float(r["err_transformed"]) for r in rows) / len(rows)
            for fqn, row in record.layers.items():
                out[f"gift/err_euclidean/{fqn}"] = float(row["err_euclidean"])
                out[f"gift/err_transformed/{fqn}"] = float(row["err_transformed"])
                out[f"gift/selected/{fqn}"] = float(row["selected"])
        return out

    def _gift_state_dict(self, base: dict[str, Any]) -> dict[str, Any]:
        """Add the GIFT state under a per-rank key.

        Residuals, probes and statistics accumulators differ between ranks; DCP treats a
        plain tensor saved under the same key on every rank as replicated and keeps one
        copy, so each rank saves its state under ``gift.rank<r>`` (like torchtitan's
        dataloader state). Resuming therefore needs the same data-parallel size.
        """
        if self._gift is not None:
            base[_GIFT_KEY] = {f"rank{dist.get_rank()}": self._gift.state_dict()}
        return base

    def _gift_load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._gift is None:
            return
        key = f"rank{dist.get_rank()}"
        saved = state_dict.get(_GIFT_KEY, {}).get(key)
        if saved is None:
            raise ValueError(f"checkpoint has no GIFT state for {key}; it was saved without gift.enable or with another world size")
        self._gift.load_state_dict(saved)


class GiftTrainer(_GiftMixin, Trainer):
    """Stock torchtitan trainer (FSDP2) plus the ``gift`` section."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        gift: GiftSection = field(default_factory=GiftSection)

    def __init__(self, config: Config) -> None:
        self._gift_init(config)
        super().__init__(config)
        self._gift_connect_metrics()

    def _gift_after_parallelize(self, model: nn.Module) -> None:
        cpu_compat.after_fsdp2(model)
        if self.config.gift.enable:
            state = self._gift_manage(model, tag_gradients=False)
            self._gift_counters = fsdp2.install(model, state, compiled=self.config.gift.fuse)

    def _gift_comm(self) -> dict[str, float]:
        assert self._gift_counters is not None
        steps = max(self.step - self._gift_logged_step, 1)
        self._gift_logged_step = self.step
        counts = self._gift_counters.take()
        return {
            "gift/wire_bytes_per_step": counts.wire / steps,
            "gift/fp32_bytes_per_step": counts.fp32 / steps,
            "gift/bf16_bytes_per_step": counts.bf16 / steps,
            "gift/fsdp2_unmapped_calls": float(counts.unmapped_calls),
            "gift/comm_s_per_step": counts.seconds / steps,
        }

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        super().train_step(data_iterator)
        self._gift_step()

    def state_dict(self) -> dict[str, Any]:
        return self._gift_state_dict(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._gift_load_state_dict(state_dict)


class GiftGraphTrainer(_GiftMixin, GraphTrainer):
    """graph_trainer (SimpleFSDP, whole-step trace) plus the ``gift`` section."""

    @dataclass(kw_only=True, slots=True)
    class Config(GraphTrainer.Config):
        gift: GiftSection = field(default_factory=GiftSection)

    def __init__(self, config: Config) -> None:
        if config.gift.enable and config.compile.pass_pipeline != GIFT_PASS_PIPELINE:
            raise ValueError(
                f"gift.enable on graph_trainer needs --compile.pass_pipeline {GIFT_PASS_PIPELINE} "
                f"(got {config.compile.pass_pipeline!r}): that pipeline rewrites the gradient collectives"
            )
        if config.gift.enable and not (config.compile.enable and config.compile.mode == "aot_fx_trace"):
            raise ValueError("gift.enable on graph_trainer needs --compile.enable with compile.mode aot_fx_trace")
        if config.gift.enable and config.compile.inductor_compilation == "full" and not cpu_compat.accelerator_available():
            # full_inductor_compilation_pass moves every CPU graph constant to CUDA
            # (_migrate_cpu_get_attrs_to_cuda); GIFT's state tensors are such constants.
            raise ValueError(
                "gift.enable with --compile.inductor_compilation full needs CUDA; on CPU keep the "
                "default regional compilation (GIFT's own ops are still compiled with gift.fuse)"
            )
        self._gift_init(config)
        super().__init__(config)
        self._gift_connect_metrics()

    def _gift_after_parallelize(self, model: nn.Module) -> None:
        if self.config.gift.enable:
            self._gift_manage(model, tag_gradients=True)

    def _gift_comm(self) -> dict[str, float]:
        # The rewritten graph is fixed, so the bytes per step are too: the managed weights'
        # quantized reduce-scatters plus every other gradient at fp32.
        report = last_reports()[-1]
        total = 4.0 * sum(p.numel() for m in self.model_parts for p in m.parameters() if p.requires_grad)
        wire = report.wire_bytes + (total - report.fp32_bytes)
        return {"gift/wire_bytes_per_step": wire, "gift/fp32_bytes_per_step": total,
                "gift/bf16_bytes_per_step": total / 2}

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        super().train_step(data_iterator)
        self._gift_step()

    def state_dict(self) -> dict[str, Any]:
        return self._gift_state_dict(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._gift_load_state_dict(state_dict)
