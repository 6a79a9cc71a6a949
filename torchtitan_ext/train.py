"""Entry point: ``torchrun ... -m gift_compile.torchtitan_ext.train --module ... --config ...``.

Same arguments as ``python -m torchtitan.train``. It exists because ``torchtitan.train``
imports ``torchtitan.trainer`` (which imports Triton) before it reads ``--module``, so on
a machine without Triton nothing of ours could run first; this entry point applies
:func:`gift_compile.torchtitan_ext.cpu_compat.activate` and then calls torchtitan's own
``main``. Where Triton is installed (any CUDA box), ``-m torchtitan.train --module
gift_compile.torchtitan_ext --config <fn>`` works too.

Run as a program, a successful run leaves without interpreter finalization once torchtitan
has closed the trainer and destroyed the process group (`gift_compile.sync`): gloo's
worker threads releasing a collective's tensors during finalization aborted one rank of a
finished 4-rank run under load, which turned a completed run into a failed one.
"""

from __future__ import annotations

from . import cpu_compat


def main() -> None:
    """Apply the CPU shims (no-op on an accelerator box) and run torchtitan's trainer."""
    cpu_compat.activate()
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()
    from gift_compile.sync import exit_without_finalization

    exit_without_finalization(0)
