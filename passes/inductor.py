"""Hook the GIFT rewrite into Inductor's post-grad custom passes.

The pass goes into `torch._inductor.config.post_grad_custom_post_pass` (turned into a list if
the user already installed one, so theirs keeps running). It runs after Inductor's own
post-grad pattern passes and before re-inplacing, on the functional post-grad graph.

Scope: `torch.compile(model)` after `gift_compile.apply` must work with no extra argument, and
Inductor compiles lazily (the backward graph at the first backward pass, again at every
recompilation), so no context around a call of the user's can cover every compile; the only
per-compile route, `torch.compile(model, options={"post_grad_custom_post_pass": ...})`, needs
the user to pass it. So the pass is installed in Inductor's config while a model with GIFT
applied is alive: `hold_inductor_pass(model)` installs it (once, whatever the number of
models), and it is removed when the last holder is released by `gift_compile.remove` or
garbage-collected. Importing this package changes nothing. The pass is inert on graphs
without a `gift::mark` (it returns before touching them).

Its `uuid` covers this package's own modules (found through the import system, whatever the
folder layout): the pass is a pure function of the graph (every managed gradient's plan is
an argument of its `gift::mark` node, and the rank is a tensor), so the FX graph cache key
already distinguishes formats and layers, and one cached artifact serves every rank.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import pkgutil
import weakref
from typing import Any

import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from gift_compile.passes.gift_pass import rewrite_gradient_collectives

__all__ = ["GiftGraphPass", "hold_inductor_pass", "register_inductor_pass", "release_inductor_pass",
           "unregister_inductor_pass"]


@functools.cache
def package_sources() -> tuple[str, ...]:
    """Source files of the modules of `gift_compile` (its layer subpackages included) and
    `gift_compile.passes`, located by the import system (`pkgutil.walk_packages` over each
    package's `__path__`, recursing into subpackages, `find_spec` for each module)."""
    files = set()
    # Specs, not imports: this module sits below `gift_compile`'s top (`api` imports it) and
    # inside `gift_compile.passes`, so importing either package here would import upward.
    for package in (importlib.util.find_spec("gift_compile"), importlib.util.find_spec(__package__)):
        files.add(package.origin)
        for info in pkgutil.walk_packages(package.submodule_search_locations, package.name + "."):
            spec = importlib.util.find_spec(info.name)
            if spec is not None and spec.origin is not None and spec.origin.endswith(".py"):
                files.add(spec.origin)
    return tuple(sorted(files))


class GiftGraphPass(CustomGraphPass):
    """`CustomGraphPass` running `rewrite_gradient_collectives` on post-grad graphs."""

    def __call__(self, graph: fx.Graph) -> None:
        rewrite_gradient_collectives(graph)

    def uuid(self) -> Any:
        return hashlib.sha256(get_hash_for_files(package_sources())).hexdigest()


_PASS = GiftGraphPass()


def register_inductor_pass() -> None:
    """Install the pass once, after any post-grad custom pass already configured."""
    current = inductor_config.post_grad_custom_post_pass
    passes = list(current) if isinstance(current, (list, tuple)) else ([] if current is None else [current])
    if any(isinstance(p, GiftGraphPass) for p in passes):
        return
    inductor_config.post_grad_custom_post_pass = [*passes, _PASS] if passes else _PASS


def unregister_inductor_pass() -> None:
    """Remove the pass, leaving any other configured pass as it was."""
    current = inductor_config.post_grad_custom_post_pass
    passes = list(current) if isinstance(current, (list, tuple)) else ([] if current is None else [current])
    kept = [p for p in passes if not isinstance(p, GiftGraphPass)]
    inductor_config.post_grad_custom_post_pass = kept if len(kept) > 1 else (kept[0] if kept else None)


# Holders of the pass (ids of live models with GIFT applied) and their finalizers.
_HELD: dict[int, weakref.finalize] = {}


def _release(key: int) -> None:
    _HELD.pop(key, None)
    if not _HELD:
        unregister_inductor_pass()


def hold_inductor_pass(owner: object) -> None:
    """Install the pass for as long as `owner` is alive and not released (idempotent)."""
    key = id(owner)
    if key not in _HELD:
        fin = weakref.finalize(owner, _release, key)
        fin.atexit = False
        _HELD[key] = fin
    register_inductor_pass()


def release_inductor_pass(owner: object) -> None:
    """`owner` no longer needs the pass; the last release removes it from Inductor's config."""
    fin = _HELD.get(id(owner))
    if fin is not None:
        fin()
