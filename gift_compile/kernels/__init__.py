"""Explicit Triton kernels of the codec's hot path, registered as `torch.ops.gift_kernels.*`.

Layer (docs/architecture.md): above `gift_compile.codec`, whose tables and reference
arithmetic the kernels restate, and below `gift_compile.exchange`, whose per-item codec calls
them through `gift_compile.kernels.dispatch`. It imports only torch, Triton and the codec.

- `triton_codec`: the device code (block statistics, E4M3 scale codes, encode with packing,
  decode with the fp32 sum over senders; the low-rank map's expansion as a `tl.dot` epilogue,
  which `bench.gpu_check` measures before the exchange uses it);
- `ops`: each kernel as a `torch.library.triton_op` with its launch and its shape function;
- `formats`: which formats have kernels and their compile-time parameters;
- `dispatch`: the codec functions the exchange calls, kernels on CUDA and the reference codec
  (compiled by Inductor) elsewhere, with the choice logged once per format;
- `traffic`: the bytes each kernel reads and writes, from its arguments.

The kernels are tested bit for bit against the reference codec on the CPU, in Triton's
interpreter (tests/test_kernels.py).
"""

from gift_compile.kernels.dispatch import (
    CodecPath, choose_scales, codec_path, decode, decode_sum, encode, kernels_enabled, note_path, use_kernels,
)
from gift_compile.kernels.formats import KERNEL_FORMATS

__all__ = ["KERNEL_FORMATS", "CodecPath", "choose_scales", "codec_path", "decode", "decode_sum", "encode",
           "kernels_enabled", "note_path", "use_kernels"]
