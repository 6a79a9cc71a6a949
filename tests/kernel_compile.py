"""Compile every codec kernel for a Hopper GPU (sm_90) with Triton's own compiler, on any machine.

Run as a script by tests/test_kernels.py, in a process without `TRITON_INTERPRET` (in the test
process the kernels are the interpreter's functions, which accept code the compiler rejects).
Triton's wheel carries `ptxas`, so the whole pipeline (TTIR, TTGIR, LLVM IR, PTX, cubin) runs
without a GPU or a driver: what the interpreter tests cannot tell, that the kernels compile, and
with which constexprs, is checked here for every kernel format (both decode modes) and both
precisions of the expansion. Prints one line per compiled kernel: its name, format and the
cubin's size; exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compile in a process without the interpreter"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from gift_compile.codec import FormatSpec  # noqa: E402
from gift_compile.kernels import triton_codec as k  # noqa: E402
from gift_compile.kernels.formats import KERNEL_FORMATS, kernel_format  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
ROW = {"cols": "i32", "nblocks": "i32", "row_stride": "i32"}


def compile_kernel(fn: object, signature: dict[str, str], constexprs: dict[str, object]) -> int:
    """Bytes of the cubin `fn` compiles to with these argument types and constexprs."""
    src = ASTSource(fn, {**signature, **{name: "constexpr" for name in constexprs}}, constexprs=constexprs)
    return len(triton.compile(src, target=TARGET).asm["cubin"])


def main() -> int:
    for fmt in KERNEL_FORMATS:
        for block in ((16,) if fmt == "nvfp4" else (16, 32)):
            f = kernel_format(FormatSpec(fmt, block_size=block))
            digits = dict(KIND=f.kind, BITS=f.bits, PER=f.per, PER_P2=f.per_p2, NBYTES=f.nbytes, BLOCK=f.block,
                          TILE=1024 // f.per_p2)
            sizes = {
                "block_stat": compile_kernel(
                    k.block_stat_kernel, {"x_ptr": "*fp32", "stat_ptr": "*fp32", **ROW},
                    {"FACTOR": f.mean_abs_factor or 0.0, "MEAN_ABS": f.mean_abs_factor is not None, "BLOCK": f.block,
                     "TILE": 1024 // f.block}),
                "scale_codes": compile_kernel(
                    k.scale_code_kernel, {"stat_ptr": "*fp32", "tscale_ptr": "*fp32", "code_ptr": "*u8", "n": "i32"},
                    {"INV_LEVEL": f.inv_level, "TILE": 1024}),
                "encode": compile_kernel(
                    k.encode_kernel, {"x_ptr": "*fp32", "code_ptr": "*u8", "tscale_ptr": "*fp32", "out_ptr": "*u8",
                                      "cols": "i32", "cp": "i32", "nblocks": "i32", "nwords": "i32",
                                      "out_cols": "i32", "row_stride": "i32"}, {**digits, "IMAX": f.imax}),
            }
            for reduce, average in ((True, True), (True, False), (False, False)):
                sizes[f"decode sum={reduce} average={average}"] = compile_kernel(
                    k.decode_kernel, {"payload_ptr": "*u8", "code_ptr": "*u8", "tscale_ptr": "*fp32",
                                      "out_ptr": "*fp32", "rows": "i32", "cols": "i32", "nblocks": "i32",
                                      "nwords": "i32", "pcols": "i32"},
                    {"SENDERS": 8, **digits, "SUM": reduce, "AVERAGE": average})
            for name, size in sizes.items():
                print(f"{fmt} b{block} {name}: cubin {size} bytes", flush=True)
    for precision in ("ieee", "tf32"):
        size = compile_kernel(
            k.lowrank_expand_kernel, {name: "*fp32" for name in ("g_ptr", "p_ptr", "dinv_ptr", "coef_ptr", "basis_ptr",
                                                                 "dsq_ptr", "out_ptr")}
            | {"rows": "i32", "cols": "i32", "rank": "i32"},
            {"BM": 64, "BN": 128, "BR": 32, "PRECISION": precision})
        print(f"lowrank_expand {precision}: cubin {size} bytes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
