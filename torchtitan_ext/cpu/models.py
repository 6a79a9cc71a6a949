"""Small Llama3 and DeepSeek-V3 (MoE) model specs for GIFT runs under torchtitan.

torchtitan's ``debugmodel`` (dim 256, 6 layers, vocab 2048) is sized for a GPU smoke
test; GIFT's CPU runs need something that trains in seconds per step on one core per
rank, with the 4096-token byte-level BPE vocabulary of the embedded Shakespeare corpus.
The layer configs come from torchtitan's own Llama3 builder (``_build_llama3_layers``,
private in torchtitan 0.3.0, which ``pyproject.toml`` pins), so initialisation, fused QKV
and RoPE match the stock debug model exactly; only the sizes differ.

``gift_moe_debug`` is the mixture-of-experts model of the expert-parallel runs: torchtitan's
DeepSeek-V3 builder (``_build_dsv3_layers``, also private in 0.3.0) at the smallest sizes its
debug model's layout keeps: one dense block, then MoE blocks of multi-head latent attention,
a softmax top-k router, grouped-GEMM routed experts (``GroupedExperts``, 3-D weights; torch's
``_grouped_mm`` has a CPU path) and one shared expert.
"""

from __future__ import annotations

from dataclasses import fields, replace

from torchtitan.experiments.graph_trainer.common_utils import build_decoder_config_for_backend
from torchtitan.experiments.graph_trainer.deepseek_v3 import model_registry as graph_deepseek_v3_registry
from torchtitan.experiments.graph_trainer.deepseek_v3.model import GraphTrainerDeepSeekV3Model
from torchtitan.experiments.graph_trainer.llama3 import model_registry as graph_llama3_registry
from torchtitan.experiments.graph_trainer.llama3.model import GraphTrainerLlama3Model
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.deepseek_v3 import (
    _EMBEDDING_INIT as _DSV3_EMBEDDING_INIT,
    _NORM_INIT as _DSV3_NORM_INIT,
    _build_dsv3_layers,
    _output_linear_init as _dsv3_output_linear_init,
    model_registry as deepseek_v3_registry,
)
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    _build_llama3_layers,
    _output_linear_init,
    model_registry as llama3_registry,
)
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.protocols.model_spec import ModelSpec

__all__ = ["FLAVORS", "MOE_FLAVORS", "gift_model_spec", "gift_moe_model_spec"]

FLAVORS: dict[str, dict[str, int]] = {
    # ~1.9M parameters: 4 layers of dim 128 (4 heads of 32), SwiGLU hidden 384.
    "gift_debug": {"dim": 128, "n_layers": 4, "n_heads": 4, "multiple_of": 128, "vocab_size": 4096},
}
"""Model sizes by flavor name."""

MOE_FLAVORS: dict[str, dict[str, int]] = {
    # ~1.0M parameters: dim 64, 3 layers (layer 0 dense FFN 192; layers 1-2 MoE: 4 routed experts
    # of hidden 64, top-2, one shared expert of hidden 64), MLA with 2 heads (kv_lora_rank 32).
    "gift_moe_debug": {"dim": 64, "n_layers": 3, "n_dense_layers": 1, "n_heads": 2, "kv_lora_rank": 32,
                       "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "dense_hidden_dim": 192,
                       "moe_hidden_dim": 64, "num_experts": 4, "num_shared_experts": 1, "top_k": 2,
                       "vocab_size": 4096},
}
"""MoE model sizes by flavor name (DeepSeek-V3 layout)."""

_MAX_SEQ_LEN = 2048


def _model_config(flavor: str, attn_backend: str) -> Llama3Model.Config:
    """Llama3 config of ``flavor``; ``attn_backend`` is "flex" or "sdpa" (CPU)."""

    def build(*, attn_backend: str) -> Llama3Model.Config:
        size = FLAVORS[flavor]
        dim, vocab = size["dim"], size["vocab_size"]
        return Llama3Model.Config(
            dim=dim,
            vocab_size=vocab,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
            layers=_build_llama3_layers(
                fuse_qkv=True,
                n_layers=size["n_layers"],
                dim=dim,
                n_heads=size["n_heads"],
                hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=size["multiple_of"]),
                rope=ComplexRoPE.Config(
                    dim=dim // size["n_heads"], max_seq_len=_MAX_SEQ_LEN, theta=500000, scaling="llama"
                ),
                attn_backend=attn_backend,
            ),
        )

    # torchtitan rejects "sdpa" for language models (it cannot consume per-document
    # positions); graph_trainer's helper builds the flex config and swaps the inner
    # attention, which is what its own CPU-capable tests do. Attention then spans
    # document boundaries inside a packed sequence (plain causal LM).
    if flavor not in FLAVORS:
        raise ValueError(f"unknown model flavor {flavor!r}; known: {sorted(FLAVORS)}")
    return build_decoder_config_for_backend(build, attn_backend)


def gift_model_spec(flavor: str, *, attn_backend: str, graph_trainer: bool) -> ModelSpec:
    """ModelSpec for the stock trainer (FSDP2) or for graph_trainer (SimpleFSDP).

    The stock spec reuses torchtitan's Llama3 parallelize/pipelining functions; the
    graph spec reuses graph_trainer's (SimpleFSDP + aot_fx_trace) and its model class,
    which initialises weights outside the SimpleFSDP parametrization.
    """
    model = _model_config(flavor, attn_backend)
    stock = llama3_registry("debugmodel")
    if not graph_trainer:
        return replace(stock, flavor=flavor, model=model)
    graph = graph_llama3_registry("debugmodel")
    graph_model = GraphTrainerLlama3Model.Config(**{f.name: getattr(model, f.name) for f in fields(model)})
    return replace(graph, flavor=flavor, model=graph_model)


def _moe_model_config(flavor: str, attn_backend: str) -> DeepSeekV3Model.Config:
    """DeepSeek-V3 config of MoE ``flavor`` (torchtitan's debug model's layout and inits, smaller)."""
    if flavor not in MOE_FLAVORS:
        raise ValueError(f"unknown MoE model flavor {flavor!r}; known: {sorted(MOE_FLAVORS)}")
    size = MOE_FLAVORS[flavor]

    def build(*, attn_backend: str) -> DeepSeekV3Model.Config:
        dim, vocab, rope_dim = size["dim"], size["vocab_size"], size["qk_rope_head_dim"]
        layers = _build_dsv3_layers(
            n_layers=size["n_layers"], n_dense_layers=size["n_dense_layers"], dim=dim, n_heads=size["n_heads"],
            q_lora_rank=0, kv_lora_rank=size["kv_lora_rank"], qk_nope_head_dim=size["qk_nope_head_dim"],
            qk_rope_head_dim=rope_dim, v_head_dim=size["v_head_dim"], mscale=0.70,
            dense_hidden_dim=size["dense_hidden_dim"], moe_hidden_dim=size["moe_hidden_dim"],
            num_experts=size["num_experts"], num_shared_experts=size["num_shared_experts"],
            router_top_k=size["top_k"], router_score_func="softmax", attn_backend=attn_backend,
            moe_comm_backend="standard", non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=_MAX_SEQ_LEN, theta=10000.0, scaling="yarn",
                                    rope_factor=40.0, beta_fast=32.0, beta_slow=1.0, original_seq_len=_MAX_SEQ_LEN),
        )
        return DeepSeekV3Model.Config(
            vocab_size=vocab,
            dim=dim,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_DSV3_EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=_DSV3_NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_dsv3_output_linear_init(dim)),
            layers=layers,
        )

    # as for Llama3: "sdpa" (CPU) is built as flex with each layer's inner attention swapped
    return build_decoder_config_for_backend(build, attn_backend)


def gift_moe_model_spec(flavor: str, *, attn_backend: str, graph_trainer: bool = False) -> ModelSpec:
    """ModelSpec of an MoE flavor for the stock trainer (FSDP2) or for graph_trainer (SimpleFSDP,
    routed experts wrapped on the efsdp mesh under expert parallelism): torchtitan's or
    graph_trainer's DeepSeek-V3 parallelize/pipelining functions and the MoE load-balancing hook;
    graph_trainer's model class initialises weights outside the SimpleFSDP parametrization."""
    model = _moe_model_config(flavor, attn_backend)
    if not graph_trainer:
        return replace(deepseek_v3_registry("debugmodel"), flavor=flavor, model=model)
    graph_model = GraphTrainerDeepSeekV3Model.Config(**{f.name: getattr(model, f.name) for f in fields(model)})
    return replace(graph_deepseek_v3_registry("debugmodel"), flavor=flavor, model=graph_model)
