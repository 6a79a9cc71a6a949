"""Compile every codec kernel for a Hopper GPU (sm_90) with Triton's own compiler, on any machine,
and read what Inductor's analysis of each registered operator finds it writes.

Run as a script by tests/test_kernels.py, in a process without `TRITON_INTERPRET` (in the test
process the kernels are the interpreter's functions, which accept code the compiler rejects).
Triton's wheel carries `ptxas`, so the whole pipeline (TTIR, TTGIR, LLVM IR, PTX, cubin) runs
without a GPU or a driver: what the interpreter tests cannot tell, that the kernels compile, and
with which constexprs, is checked here for every kernel format (each decode mode; the fused
sender and receiver kernels for the formats they serve, at TF32 operands; the fp8 formats at
each scaling, their fused sender and receiver kernels included)
and every precision of the map's kernels. Prints one line per compiled kernel: its name, format
and the cubin's size; exits non-zero on the first failure.

Then each operator is functionalized on fake CUDA tensors as AOTAutograd does under
`torch.compile`: the operator becomes Triton's kernel-call higher-order op, whose
`tensors_to_clone` are the arguments torch's TTIR analysis finds the kernel stores to (Inductor
copies each of those before the call, extra traffic, unless it is a fresh output buffer). The
analysis asks the active Triton driver for its target; with no GPU here a stand-in driver
answers sm_90. Prints `mutates <op>: <argument names>`.
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
from gift_compile.kernels import triton_fp8 as k8  # noqa: E402
from gift_compile.kernels.formats import (  # noqa: E402
    FP8_KERNEL_FORMATS, KERNEL_FORMATS, fp8_kernel_format, kernel_format,
)
from gift_compile.kernels.ops import fused_reason  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
ROW = {"cols": "i32", "nblocks": "i32", "row_stride": "i32"}


def compile_kernel(fn: object, signature: dict[str, str], constexprs: dict[str, object]) -> int:
    """Bytes of the cubin `fn` compiles to with these argument types and constexprs."""
    src = ASTSource(fn, {**signature, **{name: "constexpr" for name in constexprs}}, constexprs=constexprs)
    return len(triton.compile(src, target=TARGET).asm["cubin"])


class _Sm90:
    """Stands in for the CUDA driver where torch's analysis only asks which target to compile for."""

    def get_current_target(self) -> GPUTarget:
        return TARGET


def mutated_arguments() -> dict[str, list[str]]:
    """Per operator, the kernel arguments the functionalized call clones (the ones it stores to)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    from gift_compile.kernels import ops, ops_fp8

    triton.runtime.driver.set_active(_Sm90())
    mode = FakeTensorMode()

    def fake(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device("cuda"))

    f32, u8 = torch.float32, torch.uint8
    lowrank = [((8, 40), f32), ((8, 4), f32), ((40,), f32), ((4,), f32), ((40, 4), f32), ((40,), f32)]
    calls = {
        "block_stat": (lambda x: ops.block_stat(x, "ternary", 32), [((8, 40), f32)]),
        "scale_codes": (lambda s, t: ops.scale_codes(s, t, "nvfp4", 16), [((8, 3), f32), ((1,), f32)]),
        "encode": (lambda x, s, t: ops.encode(x, s, t, "int3", 32), [((8, 40), f32), ((8, 2), u8), ((1,), f32)]),
        "decode": (lambda p, s, t: ops.decode(p, s, t, "nvfp4", 16, 40, True, True),
                   [((4, 8, 24), u8), ((4, 8, 3), u8), ((4,), f32)]),
        "lowrank_expand": (lambda g, p, d, c, b, q: ops.lowrank_expand(g, p, d, c, b, q, "tf32"),
                           [((8, 40), f32), ((8, 4), f32), ((40,), f32), ((4,), f32), ((40, 4), f32), ((40,), f32)]),
        "lowrank_project": (lambda g, b: ops.lowrank_project(g, b, "bf16"), [((8, 40), f32), ((40, 4), f32)]),
        "lowrank_block_stat": (lambda g, p, d, c, b, q: ops.lowrank_block_stat(g, p, d, c, b, q, "tf32", "int2", 16),
                               [((8, 40), f32), ((8, 4), f32), ((40,), f32), ((4,), f32), ((40, 4), f32),
                                ((40,), f32)]),
        "lowrank_encode": (lambda g, p, d, c, b, q, s, t: ops.lowrank_encode(g, p, d, c, b, q, s, t, "tf32", "int3",
                                                                              32),
                           [((8, 40), f32), ((8, 4), f32), ((40,), f32), ((4,), f32), ((40, 4), f32), ((40,), f32),
                            ((8, 2), u8), ((1,), f32)]),
        "fp8_scales": (lambda x: ops_fp8.fp8_scales(x, "fp8_e4m3", "row", 32), [((8, 40), f32)]),
        "fp8_scales[block]": (lambda x: ops_fp8.fp8_scales(x, "fp8_e5m2", "block", 16), [((8, 40), f32)]),
        "fp8_scale_encode": (lambda x: ops_fp8.fp8_scale_encode(x, "fp8_e4m3", "row", 32), [((8, 40), f32)]),
        "fp8_scale_encode[block]": (lambda x: ops_fp8.fp8_scale_encode(x, "fp8_e5m2", "block", 16),
                                    [((8, 40), f32)]),
        "fp8_encode": (lambda x, s: ops_fp8.fp8_encode(x, s, "fp8_e4m3", "block", 16), [((8, 40), f32),
                                                                                       ((8, 3), f32)]),
        "fp8_decode": (lambda p, s: ops_fp8.fp8_decode(p, s, "fp8_e4m3", "row", 32, 40, True, True),
                       [((4, 8, 40), u8), ((4, 8), f32)]),
        "lowrank_fp8_scales": (lambda *a: ops_fp8.lowrank_fp8_scales(*a, "tf32", "fp8_e4m3", "row", 32), lowrank),
        "lowrank_fp8_scales[block]": (lambda *a: ops_fp8.lowrank_fp8_scales(*a, "tf32", "fp8_e5m2", "block", 16),
                                      lowrank),
        "lowrank_fp8_encode": (lambda *a: ops_fp8.lowrank_fp8_encode(*a, "tf32", "fp8_e4m3", "row", 32),
                               [*lowrank, ((8,), f32)]),
        "lowrank_decode_expand": (lambda *a: ops.lowrank_decode_expand(*a, "tf32", "nvfp4", 16, 40),
                                  [((8, 24), u8), ((8, 3), u8), ((2,), f32), *lowrank[1:]]),
        "lowrank_fp8_decode_expand": (lambda *a: ops_fp8.lowrank_fp8_decode_expand(*a, "tf32", "fp8_e4m3", "tensor",
                                                                                   32, 40),
                                      [((8, 40), u8), ((2,), f32), *lowrank[1:]]),
    }
    out = {}
    for name, (fn, shapes) in calls.items():
        with mode:
            gm = make_fx(dispatch_functionalize(fn))(*[fake(shape, dtype) for shape, dtype in shapes])
        (node,) = [n for n in gm.graph.nodes if "triton_kernel_wrapper_functional" in str(n.target)]
        out[name] = list(node.kwargs["tensors_to_clone"])
    return out


def compile_fp8() -> None:
    """Every fp8 kernel for both fp8 formats: the scale kernels (a row's scale, a row's amax for
    the tensor scale, a block's scale with a block that is not a power of two), the scales and
    codes in one kernel (row, block), the encoder and the decoder (each decode mode) at each
    scaling."""
    for fmt in FP8_KERNEL_FORMATS:
        for scaling, block in (("tensor", 32), ("row", 32), ("block", 24)):
            f = fp8_kernel_format(FormatSpec(fmt, scaling, block))
            elements = dict(MBITS=f.mbits, EMIN=f.emin)
            layout = dict(SCALING=f.scaling, BLOCK=max(f.block, 1))
            sizes = {}
            pow2 = {"MAX_EXP": f.max_exp, "MAX_MANT": f.max_mant}
            codes = {**elements, "FMAX": f.fmax}
            fused = {"x_ptr": "*fp32", "scale_ptr": "*fp32", "out_ptr": "*u8"}
            if scaling == "block":
                tiles = {"BLOCK": f.block, "BLOCK_P2": 32, "TILE": 32}
                sizes["scales"] = compile_kernel(
                    k8.fp8_block_scale_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", **ROW}, {**pow2, **tiles})
                sizes["scales + encode"] = compile_kernel(
                    k8.fp8_block_scale_encode_kernel, {**fused, **ROW}, {**pow2, **codes, **tiles})
            else:
                row = {"cols": "i32", "row_stride": "i32"}
                sizes["scales"] = compile_kernel(
                    k8.fp8_row_scale_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", **row},
                    {**pow2, "AMAX_ONLY": scaling == "tensor", "CHUNK": 1024, "STEPS": 3})
            if scaling == "row":
                sizes["scales + encode"] = compile_kernel(
                    k8.fp8_row_scale_encode_kernel, {**fused, **row}, {**pow2, **codes, "CHUNK": 1024, "STEPS": 3})
            sizes["encode"] = compile_kernel(
                k8.fp8_encode_kernel, {"x_ptr": "*fp32", "scale_ptr": "*fp32", "out_ptr": "*u8", "cols": "i32",
                                       "cp": "i32", "nblocks": "i32", "row_stride": "i32"},
                {**layout, **codes, "TILE": 1024})
            for reduce, average in ((True, True), (True, False), (False, False)):
                sizes[f"decode sum={reduce} average={average}"] = compile_kernel(
                    k8.fp8_decode_kernel, {"payload_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*fp32",
                                           "rows": "i32", "cols": "i32", "cp": "i32", "nblocks": "i32"},
                    {"SENDERS": 8, **layout, **elements, "IEEE_SPECIALS": f.ieee_specials, "TILE": 1024,
                     "SUM": reduce, "AVERAGE": average})
            sizes.update(_compile_fused_fp8(fmt, scaling, pow2, codes))
            sizes["lowrank decode + expand"] = compile_kernel(  # the receiver's, at every block (24 here)
                k8.lowrank_fp8_decode_expand_kernel, {"payload_ptr": "*u8", "scale_ptr": "*fp32"}
                | {name: "*fp32" for name in ("p_ptr", "dinv_ptr", "coef_ptr", "basis_ptr", "dsq_ptr", "out_ptr")}
                | {name: "i32" for name in ("rows", "cols", "rank", "cp", "nblocks", "rows_per_sender")},
                {**layout, **elements, "IEEE_SPECIALS": f.ieee_specials, "BM": 64, "BN": 128, "BR": 32,
                 "PRECISION": "tf32"})
            for name, size in sizes.items():
                print(f"{fmt} {scaling} {name}: cubin {size} bytes", flush=True)


def _compile_fused_fp8(fmt: str, scaling: str, pow2: dict[str, object], codes: dict[str, object]) -> dict[str, int]:
    """The fused fp8 sender's two kernels at `scaling` (TF32 operands, the CUDA default; block
    scaling at a block of 32, one that divides the fused tile's 128 columns)."""
    f = fp8_kernel_format(FormatSpec(fmt, scaling, 32))
    maps = {name: "*fp32" for name in ("g_ptr", "p_ptr", "dinv_ptr", "coef_ptr", "basis_ptr", "dsq_ptr")}
    dims = {"rows": "i32", "cols": "i32", "rank": "i32"}
    tiles = {"BM": 64, "BN": 128, "BR": 32, "PRECISION": "tf32"}
    if scaling == "block":
        scales = compile_kernel(k8.lowrank_fp8_block_scale_kernel, maps | {"out_ptr": "*fp32"} | dims
                                | {"nblocks": "i32"}, {**pow2, "BLOCK": f.block, **tiles})
    else:
        scales = compile_kernel(k8.lowrank_fp8_row_scale_kernel, maps | {"out_ptr": "*fp32"} | dims,
                                {**pow2, "AMAX_ONLY": scaling == "tensor", **tiles, "STEPS": 3})
    encode = compile_kernel(k8.lowrank_fp8_encode_kernel, maps | {"scale_ptr": "*fp32", "out_ptr": "*u8"} | dims
                            | {"cp": "i32", "nblocks": "i32"},
                            {"SCALING": f.scaling, "BLOCK": max(f.block, 1), **codes, **tiles})
    return {"lowrank scales": scales, "lowrank encode": encode}


def main() -> int:
    for fmt in KERNEL_FORMATS:
        for block in ((16,) if fmt == "nvfp4" else (16, 32)):
            f = kernel_format(FormatSpec(fmt, block_size=block))
            digits = dict(KIND=f.kind, BITS=f.bits, PER=f.per, PER_P2=f.per_p2, NBYTES=f.nbytes, BLOCK=f.block,
                          TILE=1024 // f.per_p2)
            sizes = {
                "block_stat": compile_kernel(
                    k.block_stat_kernel, {"x_ptr": "*fp32", "stat_ptr": "*fp32", **ROW},
                    {"STEP": f.mean_abs_step or 0.0, "MEAN_ABS": f.mean_abs_step is not None, "BLOCK": f.block,
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
            if fused_reason(fmt, block) is None:  # the fused sender kernels, at the CUDA default's operands
                maps = {name: "*fp32" for name in ("g_ptr", "p_ptr", "dinv_ptr", "coef_ptr", "basis_ptr", "dsq_ptr")}
                tiles = {"BLOCK": f.block, "BM": 64, "BN": 128, "BR": 32, "PRECISION": "tf32"}
                sizes["lowrank_block_stat"] = compile_kernel(
                    k.lowrank_block_stat_kernel, maps | {"stat_ptr": "*fp32", "rows": "i32", "cols": "i32",
                                                         "rank": "i32", "nblocks": "i32"},
                    {"STEP": f.mean_abs_step or 0.0, "MEAN_ABS": f.mean_abs_step is not None, **tiles})
                sizes["lowrank_decode_expand"] = compile_kernel(
                    k.lowrank_decode_expand_kernel, {"payload_ptr": "*u8", "code_ptr": "*u8", "tscale_ptr": "*fp32"}
                    | {name: "*fp32" for name in ("p_ptr", "dinv_ptr", "coef_ptr", "basis_ptr", "dsq_ptr", "out_ptr")}
                    | {name: "i32" for name in ("rows", "cols", "rank", "nblocks", "pcols", "rows_per_sender")},
                    {"KIND": f.kind, "BITS": f.bits, "PER": f.per, "NBYTES": f.nbytes, **tiles})
                sizes["lowrank_encode"] = compile_kernel(
                    k.lowrank_encode_kernel, maps | {"code_ptr": "*u8", "tscale_ptr": "*fp32", "out_ptr": "*u8"}
                    | {name: "i32" for name in ("rows", "cols", "rank", "cp", "nblocks", "nwords", "out_cols")},
                    {"KIND": f.kind, "BITS": f.bits, "PER": f.per, "NBYTES": f.nbytes, "IMAX": f.imax, **tiles})
            for name, size in sizes.items():
                print(f"{fmt} b{block} {name}: cubin {size} bytes", flush=True)
    compile_fp8()
    from gift_compile.kernels.ops import MAP_PRECISIONS

    dims = {"rows": "i32", "cols": "i32", "rank": "i32"}
    for precision in MAP_PRECISIONS:
        size = compile_kernel(
            k.lowrank_expand_kernel, {name: "*fp32" for name in ("g_ptr", "p_ptr", "dinv_ptr", "coef_ptr", "basis_ptr",
                                                                 "dsq_ptr", "out_ptr")} | dims,
            {"BM": 64, "BN": 128, "BR": 32, "PRECISION": precision})
        print(f"lowrank_expand {precision}: cubin {size} bytes", flush=True)
        size = compile_kernel(k.lowrank_project_kernel, {"g_ptr": "*fp32", "basis_ptr": "*fp32", "p_ptr": "*fp32"} | dims,
                              {"BM": 32, "BK": 128, "BR": 32, "STEPS": 3, "PRECISION": precision})
        print(f"lowrank_project {precision}: cubin {size} bytes", flush=True)
    for name, args in mutated_arguments().items():
        print(f"mutates {name}: {' '.join(args)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
