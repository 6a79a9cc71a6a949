"""Entry point: ``torchrun ... -m gift_compile.torchtitan_ext.train --module ... --config ...``.

Same arguments as ``python -m torchtitan.train``. It exists because ``torchtitan.train``
imports ``torchtitan.trainer`` (which imports Triton) before it reads ``--module``, so on
a machine without Triton nothing of ours could run first; this entry point applies
:func:`gift_compile.torchtitan_ext.cpu.cpu_compat.activate` and then calls torchtitan's own
``main``. Where Triton is installed (any CUDA box), ``-m torchtitan.train --module
gift_compile.torchtitan_ext.cpu --config <fn>`` works too.

This is the one place besides the launcher where the integration reaches the CPU stand-in: a
process entry point must apply the platform shims before torchtitan is imported, and only the
entry point runs that early. The import is inside `main` (the package's modules import no
stand-in; tests/test_architecture.py allows exactly these launcher-side imports), and
`activate` is inert on an accelerator box apart from the torch-version gaps it fills.

Run as a program, a successful run leaves without interpreter finalization once torchtitan
has closed the trainer and destroyed the process group (`gift_compile.sync`): gloo's
worker threads releasing a collective's tensors during finalization aborted one rank of a
finished 4-rank run under load, which turned a completed run into a failed one.
"""

from __future__ import annotations


def main() -> None:
    """Apply the CPU shims (no-op on an accelerator box), expand a ``--gift.recipe`` typed on this
    command line (`keys.expand_argv_recipe`: gift-train expands it before it launches, a
    direct launch here) and run torchtitan's trainer."""
    import sys

    from .cpu import cpu_compat  # launcher side: the shims must precede torchtitan's import (see above)
    from .keys import expand_argv_recipe

    sys.argv[1:] = expand_argv_recipe(sys.argv[1:])
    cpu_compat.activate()
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()
    from gift_compile.sync import exit_without_finalization

    exit_without_finalization(0)
