"""The optional-extra guard of `conftest.require`: a skip on a developer box, a failure in CI."""

from __future__ import annotations

import pytest

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
