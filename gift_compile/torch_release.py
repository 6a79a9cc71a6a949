"""The torch releases GIFT's readers of private torch internals were tested on, checked one way.

`frameworks.fsdp_internals` (FSDP2's parameter groups) and `passes.inductor_internals` (the
splice of the codec into Inductor's graphs) each read internals that may change between
releases; each names its own tested releases and what to use instead, and both refuse an
untested torch with the same kind of message before touching them.
"""

from __future__ import annotations

import torch

__all__ = ["require_tested_torch"]


def require_tested_torch(tested: tuple[tuple[int, int], ...], internals: str, instead: str,
                         version: str = torch.__version__) -> None:
    """Raise unless `version`'s (major, minor) is in `tested`: "`internals` tested on torch
    <tested>; this is torch <version>. `instead`"."""
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) not in tested:
        releases = ", ".join(f"{a}.{b}" for a, b in tested)
        raise RuntimeError(f"{internals} tested on torch {releases}; this is torch {version}. {instead}")
