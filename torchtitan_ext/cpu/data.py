"""The embedded Shakespeare corpus as torchtitan datasets (no download needed).

torchtitan looks datasets up by name in ``torchtitan.hf_datasets.text_datasets.DATASETS``
(``--dataloader.dataset``); each entry has a default ``path``, a ``loader(path)`` and a
``sample_processor(sample) -> str``, and ``--dataloader.dataset-path`` replaces the path.
Importing this module registers:

* ``gift_shakespeare``     training split of :func:`gift_compile.torchtitan_ext.cpu.corpus.prepare`
* ``gift_shakespeare_val`` held-out plays (for ``validator.dataloader``)

The default path of the Shakespeare entries is a ``gift-corpus:`` reference that the
loader resolves through ``prepare()`` (cached), so the corpus is only built by the ranks
that load it, and a user's ``--dataloader.dataset-path file.jsonl`` bypasses it. jsonl
files are read into an in-memory map-style ``datasets.Dataset``: no Hugging Face cache
is written (two ranks would otherwise contend for its lock), and map-style datasets
resume exactly from torchtitan's checkpointed sample index.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from datasets import Dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

__all__ = ["CORPUS_TRAIN", "CORPUS_VAL", "corpus_paths", "load_jsonl", "register_datasets"]

CORPUS_TRAIN = "gift-corpus:train"
CORPUS_VAL = "gift-corpus:val"


def corpus_paths() -> Any:
    """``gift_compile.torchtitan_ext.cpu.corpus.prepare()``: train/val jsonl and tokenizer dir (cached)."""
    from gift_compile.torchtitan_ext.cpu.corpus import prepare

    return prepare()


def _resolve(path: str) -> str:
    if path == CORPUS_TRAIN:
        return str(corpus_paths().train_jsonl)
    if path == CORPUS_VAL:
        return str(corpus_paths().val_jsonl)
    return path


def load_jsonl(path: str) -> Dataset:
    """A jsonl file, a directory of ``*.jsonl`` files or a glob, as an in-memory Dataset."""
    path = _resolve(path)
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.jsonl")))
    else:
        files = sorted(glob.glob(path))
    if not files:
        raise FileNotFoundError(f"no jsonl file at {path!r} (--dataloader.dataset-path)")
    rows: list[dict[str, Any]] = []
    for file in files:
        with open(file, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row.get("text"), str):
                    raise ValueError(f'{file}:{line_no}: every line needs a string "text" field')
                rows.append({"text": row["text"]})
    return Dataset.from_list(rows)


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_datasets() -> None:
    """Add the GIFT datasets to torchtitan's registry (idempotent)."""
    DATASETS["gift_shakespeare"] = DatasetConfig(path=CORPUS_TRAIN, loader=load_jsonl, sample_processor=_text)
    DATASETS["gift_shakespeare_val"] = DatasetConfig(path=CORPUS_VAL, loader=load_jsonl, sample_processor=_text)


register_datasets()
