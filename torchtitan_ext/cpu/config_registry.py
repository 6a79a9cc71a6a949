"""Config functions for ``--module gift_compile.torchtitan_ext.cpu --config <fn>``.

torchtitan's ``ConfigManager`` imports ``<module>.config_registry`` and calls the
function named by ``--config``; ``--section.key value`` then overrides fields (tyro).

==========================  ==============================================  ==========
config function             trainer                                          GIFT
==========================  ==============================================  ==========
llama3_debug_gift_graph     graph_trainer: SimpleFSDP + aot_fx_trace         on
llama3_debug_nogift_graph   graph_trainer: SimpleFSDP + aot_fx_trace         off
llama3_debug_gift_fsdp2     stock trainer, FSDP2 ``fully_shard``             on
llama3_debug_nogift_fsdp2   stock trainer, FSDP2 ``fully_shard``             off
moe_debug_gift_fsdp2        stock trainer, FSDP2, MoE (expert parallelism)   on
moe_debug_nogift_fsdp2      stock trainer, FSDP2, MoE (expert parallelism)   off
moe_debug_gift_graph        graph_trainer, SimpleFSDP, MoE (expert par.)     on
moe_debug_nogift_graph      graph_trainer, SimpleFSDP, MoE (expert par.)     off
==========================  ==============================================  ==========

The ``llama3_debug`` configs train the ``gift_debug`` Llama3 (see :mod:`.models`) on the embedded Shakespeare
corpus with its 4096-token BPE tokenizer, so no download is needed. GIFT-off and GIFT-on
variants of a trainer differ only in ``gift.enable`` (same seed, data order, init), so
their losses are directly comparable. The four ``moe_debug`` configs train the ``gift_moe_debug``
DeepSeek-V3 MoE (see :mod:`.models`) the same way; set
``--parallelism.expert-parallel-degree`` for expert parallelism. The graph configs select the ``gift`` pass
pipeline, which is the default pipeline plus the GIFT rewrite when ``gift.enable``.
On a machine without an accelerator, :mod:`.cpu_compat` adds its config-level choices.
"""

from __future__ import annotations

from dataclasses import fields

from . import cpu_compat

# Before the torchtitan imports below: on a CPU box without Triton they only import
# through cpu_compat (see its docstring); on an accelerator box this is a no-op.
cpu_compat.activate()

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from ..checkpoint import GiftCheckpointManager
from .data import corpus_paths
from .models import gift_model_spec, gift_moe_model_spec
from ..pipeline import GIFT_PASS_PIPELINE
from ..section import GiftSection
from ..telemetry import GiftMetricsProcessor
from ..job_config import GiftGraphTrainerConfig, GiftTrainerConfig

__all__ = [
    "llama3_debug_gift_fsdp2",
    "llama3_debug_gift_graph",
    "llama3_debug_nogift_fsdp2",
    "llama3_debug_nogift_graph",
    "moe_debug_gift_fsdp2",
    "moe_debug_gift_graph",
    "moe_debug_nogift_fsdp2",
    "moe_debug_nogift_graph",
]

_FLAVOR = "gift_debug"
_MOE_FLAVOR = "gift_moe_debug"
# graph_trainer's deduplicate_fsdp_unshard_chains_pass (torchtitan 0.3.0) breaks the MoE at fp32
# parameters (mixed_precision_param float32, which these configs use so that GIFT at fp32
# reproduces GIFT off exactly): GroupedExperts casts each routed-expert weight with ``.bfloat16()``
# right after SimpleFSDP's all-gather, the trace holds more than one unshard chain of those
# weights, and the pass's chain walk (fsdp_patterns._find_last_user_in_wait_chain) runs on through
# that single-input cast, so it canonicalizes an fp32 chain and a bf16 one to one value and the
# step stops in ``aten._grouped_mm`` ("expected m1 and m2 to have the same dtype, but got:
# c10::BFloat16 != float"). Every later pass, the bucketing included, runs without it.
_MOE_DISABLED_GRAPH_PASSES = ("deduplicate_fsdp_unshard_chains_pass",)


def _stock_config(*, gift: bool, moe: bool = False) -> GiftTrainerConfig:
    model_spec = (gift_moe_model_spec(_MOE_FLAVOR, attn_backend=cpu_compat.attention_backend()) if moe else
                  gift_model_spec(_FLAVOR, attn_backend=cpu_compat.attention_backend(), graph_trainer=False))
    config = GiftTrainerConfig(
        model_spec=model_spec,
        hf_assets_path=str(corpus_paths().tokenizer_dir),
        dump_folder=f"./outputs/{_MOE_FLAVOR if moe else _FLAVOR}",
        loss=CrossEntropyLoss.Config(global_vocab_size=model_spec.model.vocab_size),
        optimizer=default_adamw(lr=2e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=5, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=4, seq_len=128, steps=20, mixed_precision_param="float32"),
        # graph_trainer requires partial_dtensor (to_graph_trainer_config forces it); the
        # FSDP2 configs use it too so both trainers shard alike (with torch 2.13 the
        # spmd_types default rejects this model: "all parameters must be DTensors").
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="gift_shakespeare"),
        metrics=GiftMetricsProcessor.Config(log_freq=1),
        checkpoint=GiftCheckpointManager.Config(interval=10, last_save_model_only=False),
        # The model is tiny; graph_trainer's parallelize_fn ignores this field anyway (its
        # activation memory policy is a graph pass).
        activation_checkpoint=None,
        validator=Validator.Config(
            enable=True,
            freq=10,
            steps=4,
            dataloader=HuggingFaceTextDataLoader.Config(dataset="gift_shakespeare_val", infinite=False),
        ),
        debug=DebugConfig(seed=0),
        gift=GiftSection(enable=gift),
    )
    return cpu_compat.apply_config_defaults(config)


def _graph_config(*, gift: bool, moe: bool = False) -> GiftGraphTrainerConfig:
    stock = _stock_config(gift=gift, moe=moe)
    values = {f.name: getattr(stock, f.name) for f in fields(stock)}
    values["model_spec"] = (
        gift_moe_model_spec(_MOE_FLAVOR, attn_backend=cpu_compat.attention_backend(), graph_trainer=True) if moe else
        gift_model_spec(_FLAVOR, attn_backend=cpu_compat.attention_backend(), graph_trainer=True))
    values["compile"] = GraphTrainerCompileConfig(enable=True, pass_pipeline=GIFT_PASS_PIPELINE,
                                                  disable_passes=list(_MOE_DISABLED_GRAPH_PASSES if moe else ()))
    return cpu_compat.apply_config_defaults(GiftGraphTrainerConfig(**values))


def llama3_debug_gift_graph() -> GiftGraphTrainerConfig:
    """graph_trainer (SimpleFSDP + whole-step trace), gradient collectives rewritten by GIFT."""
    return _graph_config(gift=True)


def llama3_debug_nogift_graph() -> GiftGraphTrainerConfig:
    """graph_trainer, fp32 gradient reduce-scatters (the GIFT-off reference)."""
    return _graph_config(gift=False)


def llama3_debug_gift_fsdp2() -> GiftTrainerConfig:
    """Stock trainer with FSDP2; GIFT through FSDP2's custom reduce-scatter hook."""
    return _stock_config(gift=True)


def llama3_debug_nogift_fsdp2() -> GiftTrainerConfig:
    """Stock trainer with FSDP2, fp32 reduce-scatters (the GIFT-off reference)."""
    return _stock_config(gift=False)


def moe_debug_gift_fsdp2() -> GiftTrainerConfig:
    """Stock trainer with FSDP2 on the ``gift_moe_debug`` MoE; GIFT on its dense linears."""
    return _stock_config(gift=True, moe=True)


def moe_debug_nogift_fsdp2() -> GiftTrainerConfig:
    """Stock trainer with FSDP2 on the ``gift_moe_debug`` MoE, fp32 reduce-scatters (GIFT off)."""
    return _stock_config(gift=False, moe=True)


def moe_debug_gift_graph() -> GiftGraphTrainerConfig:
    """graph_trainer on the ``gift_moe_debug`` MoE; GIFT rewrites its dense linears' reduce-scatters."""
    return _graph_config(gift=True, moe=True)


def moe_debug_nogift_graph() -> GiftGraphTrainerConfig:
    """graph_trainer on the ``gift_moe_debug`` MoE, fp32 reduce-scatters (GIFT off)."""
    return _graph_config(gift=False, moe=True)
