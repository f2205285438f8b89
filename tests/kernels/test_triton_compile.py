"""Every Triton kernel variant compiles to a cubin for an sm_90 GPU, without a GPU (the interpreter parity tests
cannot catch what only the compiler rejects: loop-carried types, scalar control flow, layouts). Uses the ptxas
bundled with the triton wheel; skipped when triton or its NVIDIA backend is missing, or when already on CUDA
(the parity tests compile there)."""

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the parity tests compile on the real device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter mode"),
]

VERIFY_ARGS = dict(m_ptr="*fp32", s_ptr="*fp32", thr_ptr="*i64", am_ptr="*i64")


def compile_for_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(signature, **{k: "constexpr" for k in constexprs})
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},
    )
    assert kernel.asm.get("cubin")


@pytest.mark.parametrize("dtype", ["*fp32", "*bf16"])
def test_verify_kernels_compile(dtype: str) -> None:
    from kernels import triton_stats as ts
    from kernels import triton_verify as tv

    for top_k, top_p in ((False, False), (True, True)):
        sig = dict(logits_ptr=dtype, num_nodes_ptr="*i64", **VERIFY_ARGS, N="i32", V="i32", inv_t="fp32",
                   top_k="i32", top_p="fp32")  # fmt: skip
        compile_for_sm90(ts.row_stats_kernel, sig, dict(USE_TOP_K=top_k, USE_TOP_P=top_p, BLOCK_V=1024))
    sig = dict(logits_ptr=dtype, num_nodes_ptr="*i64", pm_ptr="*fp32", ps_ptr="*fp32", pa_ptr="*i64", N="i32",
               V="i32", SPLITS="i32")  # fmt: skip
    # the settings kernels.bench --greedy-settings times
    for chunk, block, warps in ((8192, 8192, 8), (4096, 1024, 4), (4096, 4096, 8), (2048, 2048, 4)):
        compile_for_sm90(ts.greedy_stats_kernel, sig, dict(CHUNK=chunk, BLOCK_V=block), num_warps=warps)
    sig = dict(tokens_ptr="*i64", parents_ptr="*i64", num_nodes_ptr="*i64", logits_ptr=dtype, dp_ptr=dtype,
               coins_ptr="*fp32", fcoins_ptr="*fp32", **VERIFY_ARGS, scratch_ptr="*fp32", acc_ptr="*i8",
               nprob_ptr="*fp32", next_ptr="*i64", path_ptr="*i64", alen_ptr="*i64", pm_ptr="*fp32",
               ps_ptr="*fp32", pa_ptr="*i64", N="i32", V="i32", inv_t="fp32", SPLITS="i32")  # fmt: skip
    # greedy with the parallel walk (up to 64 nodes) and the serial one above; the two sampling modes
    for mode, block_n, parallel in ((0, 64, True), (0, 128, False), (1, 64, False), (2, 64, False)):
        for write_path in (False, True):  # True: into preallocated buffers (kernels.VerifyBuffers)
            consts = dict(MODE=mode, BLOCK_N=block_n, BLOCK_V=256, WRITE_PATH=write_path, SPLITS_P2=16,
                          LOG_N=block_n.bit_length() - 1, PARALLEL=parallel)  # fmt: skip
            # as verify_triton launches them
            compile_for_sm90(
                tv._walk_kernel, sig, consts, num_warps=(tv.WALK_WARPS if parallel else 1) if mode == 0 else 4
            )


def test_tree_and_kv_kernels_compile() -> None:
    from kernels import triton_kv as tk
    from kernels import triton_tree as tt

    sig = dict(parents_ptr="*i64", num_nodes_ptr="*i64", depth_ptr="*i64", anc_ptr="*i8", fc_ptr="*i64",
               ns_ptr="*i64", paths_ptr="*i64", nleaves_ptr="*i64", N="i32")  # fmt: skip
    compile_for_sm90(tt._tree_kernel, sig, dict(BLOCK_N=64))
    sig = dict(kv_ptr="*i16", path_ptr="*i64", S="i32", H="i32", D="i32", start="i32", stride_b="i32",
               stride_h="i32", stride_l="i32", stride_d="i32")  # fmt: skip
    compile_for_sm90(tk._compact_kernel, sig, dict(BLOCK_D=64))


@pytest.mark.parametrize("dtype", ["*fp32", "*bf16"])
def test_attention_kernels_compile(dtype: str) -> None:
    from kernels import triton_attention as ta

    strides = {
        f"s{x}": "i32" for x in ("qb", "qh", "qq", "qd", "kb", "kh", "ks", "kd", "vb", "vh", "vs", "vd")
    }
    sig = dict(q_ptr=dtype, k_ptr=dtype, v_ptr=dtype, mask_ptr="*u8", pm_ptr="*fp32", pl_ptr="*fp32",
               pacc_ptr="*fp32", HKV="i32", G="i32", Q="i32", S="i32", scale="fp32", SPLITS="i32", **strides,
               smb="i32", smq="i32", sms="i32")  # fmt: skip
    for chunk in (64, 128):  # one key block a program, and two
        consts = dict(CHUNK=chunk, BLOCK_S=64, BLOCK_M=16, D=64, IEEE=dtype == "*fp32")
        compile_for_sm90(ta._split_kernel, sig, consts)
    sig = dict(pm_ptr="*fp32", pl_ptr="*fp32", pacc_ptr="*fp32", o_ptr=dtype, HKV="i32", G="i32", Q="i32",
               SPLITS="i32", sob="i32", soq="i32", soh="i32", sod="i32")  # fmt: skip
    for splits_p2 in (1, 8, 32):
        for merge in (ta._combine_kernel, ta._combine_rows_kernel):
            compile_for_sm90(merge, sig, dict(BLOCK_M=16, D=64, SPLITS_P2=splits_p2))
