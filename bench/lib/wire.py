"""Wire bytes per step: what each format puts on the network, for three model sizes.

Counted with the product's own accounting (`gift_compile.exchange.collectives.wire_bytes_per_rank`,
i.e. `gift_compile.codec.wire_bytes_for` of the codes plus every scale), per rank and per
optimizer step, for the managed linear weights; the parameters GIFT leaves at full precision
(embeddings, output head, norms: `GiftConfig.exclude` and `min_numel`) are counted at fp32.
The fp32 and bf16 baselines use the same convention (`numel * 4`, `numel * 2`). That
convention counts the bytes handed *to* collectives; `sent_bytes` converts them into bytes a
rank actually transmits, which is what link time depends on (an all-reduce moves twice its
buffer, our all-reduce's all-gather only its shard).

Shapes assumed for the paper-scale models (Llama architecture, SwiGLU, no biases, untied
head, vocabulary 32000, full multi-head attention):
- Llama-300M: hidden 1024, FFN 2816, 24 layers.
- Llama-600M: hidden 1280, FFN 3456, 32 layers (the paper's 32-layer model).

`MODEL_CONFIGS` holds the same Llama-600M and Meta's Llama-3-8B / 70B as `TinyLlamaConfig`s
(`meta_model` builds them on the meta device), for the sections that instantiate the real
`GiftState` (`bench.fidelity.memory`) or the code's selection rules (`bench.step_model.cpu`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.lib.reference import managed_linears
from gift_compile.codec import FormatSpec
from gift_compile.exchange.collectives import wire_bytes_per_rank
from bench.lib.tiny_llama import TinyLlama, TinyLlamaConfig

# (label, format, scaling) of the wire table; fp32 / bf16 are the baselines.
WIRE_FORMATS: tuple[tuple[str, str, str], ...] = (
    ("fp32", "fp32", "row"),
    ("bf16", "bf16", "row"),
    ("fp8 tensor", "fp8_e4m3", "tensor"),
    ("fp8 row", "fp8_e4m3", "row"),
    ("fp8 block32", "fp8_e4m3", "block"),
    ("mxfp8", "mxfp8", "row"),
    ("nvfp4", "nvfp4", "row"),
)


@dataclass(frozen=True)
class ModelShapes:
    """Gradient shapes of one model: managed `(name, rows, cols, count)` and the rest."""

    name: str
    managed: tuple[tuple[str, int, int, int], ...]
    other_params: int
    description: str

    @property
    def managed_params(self) -> int:
        return sum(r * c * n for _, r, c, n in self.managed)

    @property
    def params(self) -> int:
        return self.managed_params + self.other_params


def llama(name: str, dim: int, ffn: int, layers: int, vocab: int = 32000) -> ModelShapes:
    """Shapes of a Llama with `layers` blocks (wq/wk/wv/wo, w1/w3 [ffn, dim], w2 [dim, ffn])."""
    managed = (
        ("attention.wq/wk/wv/wo", dim, dim, 4 * layers),
        ("feed_forward.w1/w3 (fc1)", ffn, dim, 2 * layers),
        ("feed_forward.w2 (fc2)", dim, ffn, layers),
    )
    other = 2 * vocab * dim + (2 * layers + 1) * dim
    return ModelShapes(name, managed, other, f"hidden {dim}, FFN {ffn}, {layers} layers, vocab {vocab}")


def tiny_llama_shapes(config: TinyLlamaConfig, name: str) -> ModelShapes:
    """Shapes of a `TinyLlama` (built on the meta device), managed by GiftConfig's defaults."""
    model = meta_model(config)
    counts: dict[tuple[int, int], list[str]] = {}
    for fqn, mod in managed_linears(model).items():
        counts.setdefault(tuple(mod.weight.shape), []).append(fqn.split(".")[-2])
    managed = tuple(("/".join(sorted(set(names))), r, c, len(names)) for (r, c), names in counts.items())
    total = sum(p.numel() for p in model.parameters())
    other = total - sum(r * c * n for _, r, c, n in managed)
    desc = f"hidden {config.dim}, FFN {config.ffn_hidden}, {config.n_layers} layers, vocab {config.vocab_size}"
    return ModelShapes(name, managed, other, desc)


# Llama shapes as `TinyLlamaConfig`s. TinyLlama's FFN width is int(8 dim / 3) rounded up to
# `multiple_of`; Llama 3's 1.3x FFN multiplier is reproduced by choosing `multiple_of` so that
# the rounding lands on the published width (8B: 14336, 70B: 28672).
MODEL_CONFIGS: dict[str, TinyLlamaConfig] = {
    "Llama-600M": TinyLlamaConfig(dim=1280, n_layers=32, n_heads=10, vocab_size=32000, multiple_of=128),
    "Llama-3-8B": TinyLlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                  multiple_of=7168),
    "Llama-3-70B": TinyLlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                                   multiple_of=14336),
}


def meta_model(config: TinyLlamaConfig) -> TinyLlama:
    """A `TinyLlama` on the meta device: real module tree and parameter shapes, no storage."""
    with torch.device("meta"):
        return TinyLlama(config)


def describe_config(config: TinyLlamaConfig) -> str:
    kv = "" if config.n_kv_heads is None else f", GQA kv {config.kv_heads * config.head_dim}"
    return (f"hidden {config.dim}, FFN {config.ffn_hidden}, {config.n_layers} layers, {config.n_heads} heads{kv}, "
            f"vocab {config.vocab_size}")


def models() -> list[ModelShapes]:
    return [
        tiny_llama_shapes(TinyLlamaConfig.small(), "small (reference)"),
        llama("Llama-300M", 1024, 2816, 24),
        llama("Llama-600M", 1280, 3456, 32),
    ]


def managed_bytes(model: ModelShapes, spec: FormatSpec, op: str, world: int) -> int:
    """Bytes one rank hands to collectives per step for the managed weights in `spec`."""
    if spec.passthrough:
        return model.managed_params * (4 if spec.name == "fp32" else 2)
    return sum(wire_bytes_per_rank(op, (r, c), spec, world) * n for _, r, c, n in model.managed)


def step_bytes(model: ModelShapes, spec: FormatSpec, op: str, world: int) -> int:
    """Bytes one rank hands to gradient collectives per step (managed in `spec`, rest fp32;
    everything in `spec` for the fp32/bf16 baselines)."""
    if spec.passthrough:
        return model.params * (4 if spec.name == "fp32" else 2)
    return managed_bytes(model, spec, op, world) + 4 * model.other_params


def sent_bytes(model: ModelShapes, spec: FormatSpec, op: str, world: int) -> float:
    """Bytes one rank transmits per step with bandwidth-optimal algorithms.

    Ring all-reduce sends `2 (P-1)/P` of its buffer, ring reduce-scatter and pairwise
    all-to-all `(P-1)/P`, ring all-gather `(P-1)` times its shard. Our reduce-scatter is one
    all-to-all of the codes (scale agreement counted with them; it is < 1% of the bytes); our
    all-reduce adds the all-gather of the re-quantized shard. Unmanaged parameters (and the
    baselines) take the ring collective at fp32 / bf16.
    """
    f = (world - 1) / world
    ring = 2 * f if op == "all_reduce" else f
    if spec.passthrough:
        return ring * model.params * (4 if spec.name == "fp32" else 2)
    total = ring * 4 * model.other_params
    for _, r, c, n in model.managed:
        rows = r + (-r) % world
        full = wire_bytes_per_rank("reduce_scatter", (rows, c), spec, world)
        total += n * f * full
        if op == "all_reduce":
            total += n * (world - 1) * (wire_bytes_per_rank("all_reduce", (r, c), spec, world) - full)
    return total


def run(worlds: tuple[int, ...] = (2, 64)) -> dict[str, object]:
    """Bytes per step for every model x format x collective x world size."""
    rows = []
    for model in models():
        for world in worlds:
            for op in ("all_reduce", "reduce_scatter"):
                fp32 = step_bytes(model, FormatSpec("fp32"), op, world)
                bf16 = step_bytes(model, FormatSpec("bf16"), op, world)
                fp32_sent = sent_bytes(model, FormatSpec("fp32"), op, world)
                for label, fmt, sc in WIRE_FORMATS:
                    spec = FormatSpec(fmt, sc)
                    total = step_bytes(model, spec, op, world)
                    sent = sent_bytes(model, spec, op, world)
                    rows.append({
                        "model": model.name, "world": world, "op": op, "format": label, "bytes": total,
                        "vs_fp32": total / fp32, "vs_bf16": total / bf16,
                        "sent_bytes": sent, "sent_vs_fp32": sent / fp32_sent,
                        "managed_bits_per_element": 8.0 * managed_bytes(model, spec, op, world) / model.managed_params,
                    })
    return {
        "models": [{"name": m.name, "description": m.description, "params": m.params,
                    "managed_params": m.managed_params, "managed": [list(x) for x in m.managed]}
                   for m in models()],
        "rows": rows,
    }
