"""What a language-model run reads from the corpus (`.corpus`): deterministic next-token batches
sliced per rank, and the held-out bits-per-byte metric.

Kept apart from `.corpus`, which builds the data (plays -> jsonl splits, the tokenizer, cached
token streams): the tests, the benchmarks and the reference runs train on these batches and
score with this metric without caring how the files were made.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .corpus import CorpusPaths, Split, load_tokenizer, prepare, token_stream

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["batches", "bits_per_byte", "token_byte_lengths"]


def token_byte_lengths(tokenizer: Tokenizer) -> torch.Tensor:
    """Number of UTF-8 bytes each token id stands for (0 for special tokens), shape [vocab].

    The ByteLevel pre-tokenizer maps every byte to exactly one printable character, so a
    token's byte count is the length of its vocabulary string; summing this table over an
    encoding gives exactly the UTF-8 size of the encoded text (a token may hold part of a
    multi-byte character, so decoding single tokens would miscount).
    """
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    lengths = torch.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=torch.long)
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    for token, idx in vocab.items():
        lengths[idx] = 0 if token in specials else len(token)
    return lengths


def batches(
    tokens: torch.Tensor,
    batch_size: int,
    seq_len: int,
    *,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    steps: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic ``(inputs, labels)`` batches for next-token prediction, sliced per rank.

    ``batch_size`` is the GLOBAL batch (sequences summed over all ranks); rank ``r`` gets rows
    ``[r * b, (r + 1) * b)`` with ``b = batch_size // world_size``, both ``[b, seq_len]`` int64.
    Hence the concatenation of all ranks' slices equals the ``world_size=1`` batch for the same
    seed: a simulated N-rank run and a single-process run see identical data, which is what
    makes fp32-vs-quantized and 1-vs-N-rank comparisons exact.

    Each epoch cuts the stream into non-overlapping windows of ``seq_len + 1`` tokens (labels
    are inputs shifted by one) at a random phase, shuffles them with a generator seeded from
    ``(seed, epoch)``, and drops the incomplete last batch. ``steps=None`` iterates forever.
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    if batch_size % world_size:
        raise ValueError(f"global batch_size {batch_size} not divisible by world_size {world_size}")
    span = seq_len + 1
    if tokens.numel() < (batch_size + 1) * span:
        raise ValueError(
            f"{tokens.numel()} tokens are too few for one batch of {batch_size} x {span}"
        )
    local = batch_size // world_size
    offsets = torch.arange(span)
    step, epoch = 0, 0
    while steps is None or step < steps:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        phase = int(torch.randint(0, span, (1,), generator=gen))
        n_windows = (tokens.numel() - phase) // span
        order = torch.randperm(n_windows, generator=gen)
        for first in range(0, n_windows - batch_size + 1, batch_size):
            if steps is not None and step >= steps:
                return
            rows = order[first + rank * local : first + (rank + 1) * local]
            windows = tokens[phase + rows[:, None] * span + offsets]
            yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
            step += 1
        epoch += 1


@torch.no_grad()
def bits_per_byte(
    model: nn.Module,
    split: Split = "val",
    paths: CorpusPaths | None = None,
    *,
    seq_len: int = 128,
    max_tokens: int = 16384,
    batch_size: int = 16,
) -> float:
    """Bits per UTF-8 byte of ``model`` on a fixed, evenly spread subset of ``split``.

    ``sum(token NLL in nats) / ln 2 / (UTF-8 bytes of the predicted tokens)``. Unlike loss per
    token it does not depend on the tokenizer, so models with different vocabularies compare.
    The subset is ``max_tokens // seq_len`` non-overlapping windows spread evenly over the whole
    split (every held-out play contributes), identical on every call; each window predicts its
    last ``seq_len`` tokens from the preceding ones. Predicting BOS/EOS adds their NLL but no
    bytes (they are not text). ``model(tokens [B, S]) -> logits [B, S, V]``; it runs in eval
    mode on the device of its parameters and its previous train/eval mode is restored.
    """
    paths = paths if paths is not None else prepare()
    tokens = token_stream(split, paths)
    byte_len = token_byte_lengths(load_tokenizer(paths))
    n_windows = max(1, min(max_tokens // seq_len, (tokens.numel() - 1) // seq_len))
    starts = torch.linspace(0, tokens.numel() - seq_len - 1, n_windows).long()
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll, n_bytes = 0.0, 0
    try:
        for chunk in windows.split(batch_size):
            inputs, labels = chunk[:, :-1].to(device), chunk[:, 1:]
            logits = model(inputs).float()
            nll += F.cross_entropy(
                logits.flatten(0, 1), labels.to(device).flatten(), reduction="sum"
            ).item()
            n_bytes += int(byte_len[labels].sum())
    finally:
        model.train(was_training)
    return nll / math.log(2) / n_bytes
