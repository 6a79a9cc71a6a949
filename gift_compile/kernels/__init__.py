"""Explicit Triton kernels of the codec's hot path, registered as `torch.ops.gift_kernels.*`.

Layer (docs/architecture.md): above `gift_compile.codec`, whose tables and reference
arithmetic the kernels restate, and below `gift_compile.exchange`, whose per-item codec calls
them through `gift_compile.kernels.dispatch`. It imports only torch, Triton and the codec.

- `triton_codec`: the device code (block statistics, E4M3 scale codes, encode with packing,
  decode with the fp32 sum over senders; the low-rank map's projection and its expansion as a
  `tl.dot` epilogue, fp32 accumulation over TF32 or bf16 operands, alone or inside the block
  statistics and the encode);
- `triton_fp8`: the fp8 formats' device code (per-tensor/row/block scales, encode with the
  float8 bytes built from the fp32 bits, decode with the fp32 sum over senders);
- `ops`: each kernel as a `torch.library.triton_op` with its launch and its shape function
  (`ops_fp8` for the fp8 kernels);
- `formats`: which formats have kernels and their compile-time parameters;
- `dispatch`: the codec functions the exchange calls, kernels on CUDA and the reference codec
  (compiled by Inductor) elsewhere, with the choice logged once per format;
- `map_dispatch`: the same choice for the low-rank map's matmuls (`GiftConfig.map_precision`):
  the tensor-core kernels on CUDA, the exact fixed-order map elsewhere;
- `fused_sender`: a low-rank item's sender with the map's expansion computed inside the block
  statistics and the encode (the mapped gradient never written), where the map and the codec
  both run as kernels;
- `fused_receiver`: the all-reduce's receiver of a low-rank item with the inverse map's
  expansion decoding the gathered codes itself (the decoded result not read back by it);
- `traffic`: the bytes each kernel reads and writes, from its arguments.

The kernels are tested bit for bit against the reference codec on the CPU, in Triton's
interpreter (tests/test_kernels.py).
"""

from gift_compile.kernels.dispatch import (
    CodecPath, choose_scales, choose_scales_and_encode, codec_path, decode, decode_sum, encode, kernels_enabled,
    note_path, use_kernels,
)
from gift_compile.kernels.formats import KERNEL_FORMATS
from gift_compile.kernels.map_dispatch import MapPath, MapPrecision, map_path, note_map_path

__all__ = ["KERNEL_FORMATS", "CodecPath", "MapPath", "MapPrecision", "choose_scales", "choose_scales_and_encode",
           "codec_path", "decode",
           "decode_sum", "encode", "kernels_enabled", "map_path", "note_map_path", "note_path", "use_kernels"]
