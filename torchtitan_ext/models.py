"""Small Llama3 model specs for GIFT runs under torchtitan.

torchtitan's ``debugmodel`` (dim 256, 6 layers, vocab 2048) is sized for a GPU smoke
test; GIFT's CPU runs need something that trains in seconds per step on one core per
rank, with the 4096-token byte-level BPE vocabulary of the embedded Shakespeare corpus.
The layer configs come from torchtitan's own Llama3 builder (``_build_llama3_layers``,
private in torchtitan 0.3.0, which ``pyproject.toml`` pins), so initialisation, fused QKV
and RoPE match the stock debug model exactly; only the sizes differ.
"""

from __future__ import annotations

from dataclasses import fields, replace

from torchtitan.experiments.graph_trainer.common_utils import build_decoder_config_for_backend
from torchtitan.experiments.graph_trainer.llama3 import model_registry as graph_llama3_registry
from torchtitan.experiments.graph_trainer.llama3.model import GraphTrainerLlama3Model
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    _build_llama3_layers,
    _output_linear_init,
    model_registry as llama3_registry,
)
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.protocols.model_spec import ModelSpec

__all__ = ["FLAVORS", "gift_model_spec"]

FLAVORS: dict[str, dict[str, int]] = {
    # ~1.9M parameters: 4 layers of dim 128 (4 heads of 32), SwiGLU hidden 384.
    "gift_debug": {"dim": 128, "n_layers": 4, "n_heads": 4, "multiple_of": 128, "vocab_size": 4096},
}
"""Model sizes by flavor name."""

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
