"""GEMV for small decode batches: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M up to
GEMV_KERNEL_MAX_M (the layers use it up to `kernel.gemv_max_m()` rows, 8 by default),
W row-major as nn.Linear keeps it, float32 accumulation, one rounding to x's dtype.

At such M a linear layer is a pure weight read (cuBLAS's batch-1 GEMMs reach under half of the
memory bandwidth), so the kernel is built to stream W: each program owns BLOCK_N rows of W (and
of y), walks its share of K in tiles loaded along K (16-byte vectors) and applies each tile to
all M rows of x, so W is read from memory once. Two inner products:
- FMA (M 1..2 by default): a tile row per (W row, x row) pair; float32 products accumulate
  elementwise in the loads' own layout and are summed over K once at the end, so the loop has
  no shuffles, barriers or layout changes (checked in the sm_90 TTGIR/PTX).
- `dot` (M > 2): tl.dot of x padded to 16 rows with the W tile on tensor cores; Triton pipelines
  the W loads (cp.async, num_stages).
With PDL (kernel/pdl.py) a program reads its first W tile before waiting for the kernel
before it, so that read overlaps the norm or attention whose output x is.
When N / BLOCK_N programs cannot fill the GPU, K is split: each program writes float32 partial
sums [splits, M, N] and a small second kernel adds them (no atomics: deterministic, nothing to
zero first).

`gemv_silu_and_mul` is the MLP's gate_up projection with SiLU-and-mul in the epilogue: a program
owns matching rows of the gate half [0, I) and the up half [I, 2I) of W and writes
silu(gate) * up [M, I], one launch instead of GEMM + silu_and_mul.

Configs are fixed per shape: autotuning at run time would sync and break CUDA-graph capture.
`CONFIGS` holds the measured ones (`benchmark/kernels/gemv_bench.py` times candidates and prints
entries to paste), `heuristic` the rest. Launches depend only on shapes, so they can be
captured in CUDA graphs. The layers reach this module through `minisgl.kernel.gemv_ops`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from minisgl.kernel import GEMV_KERNEL_MAX_M, flags, gemv_dtypes, pdl
from minisgl.kernel.pdl import wait_for_previous


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int = 1  # an upper bound: K is cut in multiples of block_k
    num_warps: int = 4
    num_stages: int = 1
    dot: bool = False  # tl.dot on x padded to 16 rows (block_n, block_k >= 16)

    def __post_init__(self) -> None:
        pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
        ok = pow2(self.block_n) and pow2(self.block_k) and pow2(self.num_warps)
        ok = ok and self.split_k >= 1 and self.num_stages >= 1
        if not ok or (self.dot and min(self.block_n, self.block_k) < 16):
            raise ValueError(
                f"bad {self}: block sizes and warps must be powers of two (at least 16 for "
                "dot), split_k and num_stages at least 1"
            )


# (rows of W, K, BLOCK_M = M rounded up to a power of two) -> config. Rows of W: 2I for the
# gate_up weight of gemv_silu_and_mul. Measured for Qwen3-0.6B on an H100 (2026-11-22) with
# benchmark/kernels/gemv_bench.py, whose output is pasted here, and Qwen3-8B's at M = 1 on an
# H200 (2026-11-29: the layers' 3.98 ms a token under `heuristic` -> 3.43 ms); `heuristic`
# covers the rest.
G = GemvConfig
CONFIGS: dict[tuple[int, int, int], GemvConfig] = {
    (4096, 1024, 1): G(block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=1, dot=False),
    (4096, 1024, 2): G(block_n=16, block_k=256, split_k=1, num_warps=4, num_stages=3, dot=True),
    (4096, 1024, 4): G(block_n=16, block_k=256, split_k=1, num_warps=4, num_stages=3, dot=True),
    (4096, 1024, 8): G(block_n=16, block_k=256, split_k=1, num_warps=4, num_stages=3, dot=True),
    (1024, 2048, 1): G(block_n=2, block_k=1024, split_k=1, num_warps=4, num_stages=1, dot=False),
    (1024, 2048, 2): G(block_n=1, block_k=1024, split_k=1, num_warps=4, num_stages=1, dot=False),
    (1024, 2048, 4): G(block_n=1, block_k=512, split_k=1, num_warps=4, num_stages=1, dot=False),
    (1024, 2048, 8): G(block_n=16, block_k=256, split_k=1, num_warps=4, num_stages=3, dot=True),
    (6144, 1024, 1): G(block_n=2, block_k=512, split_k=1, num_warps=4, num_stages=1, dot=False),
    (6144, 1024, 2): G(block_n=2, block_k=256, split_k=1, num_warps=4, num_stages=1, dot=False),
    (6144, 1024, 4): G(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=3, dot=True),
    (6144, 1024, 8): G(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=3, dot=True),
    (1024, 3072, 1): G(block_n=2, block_k=1024, split_k=1, num_warps=4, num_stages=1, dot=False),
    (1024, 3072, 2): G(block_n=1, block_k=1024, split_k=1, num_warps=4, num_stages=1, dot=False),
    (1024, 3072, 4): G(block_n=1, block_k=512, split_k=1, num_warps=4, num_stages=1, dot=False),
    (1024, 3072, 8): G(block_n=32, block_k=256, split_k=8, num_warps=4, num_stages=3, dot=True),
    (151936, 1024, 1): G(block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=1, dot=False),
    (151936, 1024, 2): G(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=3, dot=True),
    (151936, 1024, 4): G(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=3, dot=True),
    (151936, 1024, 8): G(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=3, dot=True),
    (6144, 4096, 1): G(block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=2, dot=False),
    (4096, 4096, 1): G(block_n=4, block_k=1024, split_k=1, num_warps=4, num_stages=2, dot=False),
    (24576, 4096, 1): G(block_n=1, block_k=1024, split_k=1, num_warps=4, num_stages=1, dot=False),
    (4096, 12288, 1): G(block_n=4, block_k=1024, split_k=1, num_warps=4, num_stages=2, dot=False),
    (151936, 4096, 1): G(block_n=2, block_k=1024, split_k=1, num_warps=4, num_stages=1, dot=False),
}
del G

_REDUCE_BLOCK = 128


@triton.jit
def _finish(
    acc,
    acc_up,
    bias,
    out,
    out_offs,
    cols,
    mask,
    N,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    """Bias, SiLU-and-mul, one rounding, store: the epilogue of both kernels. `out_offs` and
    `cols` (the output column of each element) have acc's shape."""
    dtype = out.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=mask, other=0.0).to(tl.float32)
        if SILU:
            acc_up += tl.load(bias + N + cols, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        # gate and up rounded to the dtype first, as the GEMM -> silu_and_mul path has them
        gate = acc.to(dtype).to(tl.float32)
        acc = gate * tl.sigmoid(gate) * acc_up.to(dtype).to(tl.float32)
    tl.store(out + out_offs, acc.to(dtype), mask=mask)


@triton.jit
def _k_mask(offs_k, K, k, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[1, BLOCK_K] mask of the K tile at offset k (all true when EVEN_K)."""
    if EVEN_K:
        return tl.arange(0, BLOCK_K)[None, :] < BLOCK_K
    return (offs_k < K - k)[None, :]


@triton.jit
def _load_w(w_ptrs, mask, UP_OFFSET, SILU: tl.constexpr):
    """A weight tile, and with SILU the matching tile of the up half (else the same tile)."""
    wt = tl.load(w_ptrs, mask=mask, other=0.0)
    ut = wt
    if SILU:
        ut = tl.load(w_ptrs + UP_OFFSET, mask=mask, other=0.0)
    return wt, ut


@triton.jit
def _accumulate(
    acc,
    acc_up,
    xt,
    wt,
    ut,
    SILU: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Add one K tile's products: tl.dot into [BLOCK_M, BLOCK_N] accumulators, or elementwise
    into the FMA path's [pairs, BLOCK_K] ones (summed over K after the loop)."""
    if DOT:
        if UPCAST:  # the CPU interpreter multiplies bf16 dot tiles as raw bits
            xt, wt = xt.to(tl.float32), wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
        if SILU:
            acc_up = tl.dot(xt, tl.trans(ut.to(xt.dtype)), acc_up, input_precision=PRECISION)
    else:
        xt = xt.to(tl.float32)
        acc += xt * wt.to(tl.float32)
        if SILU:
            acc_up += xt * ut.to(tl.float32)
    return acc, acc_up


@triton.jit
def _store_partial(partial, acc, acc_up, out_m, out_n, mask, M, N, SILU: tl.constexpr):
    """This program's float32 sums over its split of K, for _reduce_kernel."""
    width = 2 * N if SILU else N
    p_ptrs = partial + (tl.program_id(1) * M + out_m) * width + out_n
    tl.store(p_ptrs, acc, mask=mask)
    if SILU:
        tl.store(p_ptrs + N, acc_up, mask=mask)


@triton.jit
def _gemv_kernel(
    x,  # [M, K], unit stride along K
    w,  # [N, K] or, when SILU, [2N, K]: gate rows then up rows; contiguous
    bias,  # [N] or [2N], read when HAS_BIAS
    out,  # [M, N], written unless PARTIAL
    partial,  # [splits, M, N or 2N] float32, written when PARTIAL
    M,
    N,  # output columns
    K,
    K_SPLIT,  # K elements per split, a multiple of BLOCK_K
    UP_OFFSET,  # N * K when SILU: where the up half of the weight starts
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr,  # K is split: write partial sums for _reduce_kernel
    EVEN_K: tl.constexpr,  # every split is whole BLOCK_K tiles inside K: no K mask
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    TWO_EARLY: tl.constexpr,  # two weight tiles before the PDL wait (K_SPLIT >= 2 BLOCK_K)
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    k_start = tl.program_id(1) * K_SPLIT
    offs_k = k_start + tl.arange(0, BLOCK_K)
    if DOT:  # x [BLOCK_M, BLOCK_K] and W [BLOCK_N, BLOCK_K] tiles, acc [BLOCK_M, BLOCK_N]
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        x_rows, w_rows = offs_m, offs_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        # a tile row per (n, m) pair, m fastest: a pair's rows load the same W row (repeats hit
        # L1); all 2D in the loads' layout, acc [pairs, BLOCK_K] summed once after the loop
        pairs = tl.arange(0, BLOCK_N * BLOCK_M)
        x_rows = pairs % BLOCK_M
        w_rows = pid_n * BLOCK_N + pairs // BLOCK_M
        acc = tl.zeros((BLOCK_N * BLOCK_M, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
    x_offs = x_rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w + w_rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    x_mask = (x_rows < M)[:, None]  # rows masks: constant along K, loads stay vectorised
    w_mask = (w_rows < N)[:, None]
    # the first weight tiles are read before the PDL wait: weights are no kernel's output, so
    # that read overlaps the kernel before (the norm or attention this GEMV waits for)
    k_mask = _k_mask(offs_k, K, 0, EVEN_K, BLOCK_K)
    wt, ut = _load_w(w_ptrs, w_mask & k_mask, UP_OFFSET, SILU)
    if TWO_EARLY:
        k_mask_1 = _k_mask(offs_k, K, BLOCK_K, EVEN_K, BLOCK_K)
        wt_1, ut_1 = _load_w(w_ptrs + BLOCK_K, w_mask & k_mask_1, UP_OFFSET, SILU)
    wait_for_previous(PDL)
    xt = tl.load(x + x_offs, mask=x_mask & k_mask, other=0.0)
    acc, acc_up = _accumulate(acc, acc_up, xt, wt, ut, SILU, DOT, PRECISION, UPCAST)
    if TWO_EARLY:
        w_ptrs += BLOCK_K
        x_offs += BLOCK_K
        xt = tl.load(x + x_offs, mask=x_mask & k_mask_1, other=0.0)
        acc, acc_up = _accumulate(acc, acc_up, xt, wt_1, ut_1, SILU, DOT, PRECISION, UPCAST)
    for k in range((2 if TWO_EARLY else 1) * BLOCK_K, K_SPLIT, BLOCK_K):
        w_ptrs += BLOCK_K
        x_offs += BLOCK_K
        k_mask = _k_mask(offs_k, K, k, EVEN_K, BLOCK_K)
        wt, ut = _load_w(w_ptrs, w_mask & k_mask, UP_OFFSET, SILU)  # the DRAM stream first
        xt = tl.load(x + x_offs, mask=x_mask & k_mask, other=0.0)
        acc, acc_up = _accumulate(acc, acc_up, xt, wt, ut, SILU, DOT, PRECISION, UPCAST)
    if DOT:
        out_m = tl.broadcast_to(offs_m[:, None], (BLOCK_M, BLOCK_N))
        out_n = tl.broadcast_to(offs_n[None, :], (BLOCK_M, BLOCK_N))
    else:
        acc = tl.sum(acc, axis=1)
        acc_up = tl.sum(acc_up, axis=1)
        out_m, out_n = x_rows, w_rows
    mask = (out_m < M) & (out_n < N)
    if PARTIAL:
        _store_partial(partial, acc, acc_up, out_m, out_n, mask, M, N, SILU)
    else:
        _finish(acc, acc_up, bias, out, out_m * stride_om + out_n, out_n, mask, N, HAS_BIAS, SILU)


@triton.jit
def _reduce_kernel(
    partial,
    bias,
    out,
    M,
    N,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = epilogue(sum of the SPLIT_K partial sums), one program per BLOCK_N columns."""
    wait_for_previous(PDL)
    rows = tl.broadcast_to(tl.arange(0, BLOCK_M)[:, None], (BLOCK_M, BLOCK_N))
    cols = tl.broadcast_to(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], rows.shape)
    mask = (rows < M) & (cols < N)
    width = 2 * N if SILU else N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        p_ptrs = partial + (s * M + rows) * width + cols
        acc += tl.load(p_ptrs, mask=mask, other=0.0)
        if SILU:
            acc_up += tl.load(p_ptrs + N, mask=mask, other=0.0)
    _finish(acc, acc_up, bias, out, rows * stride_om + cols, cols, mask, N, HAS_BIAS, SILU)


def two_early(cfg: GemvConfig, k_split: int) -> bool:
    """Read two weight tiles before the PDL wait when a program's K is two or three tiles (the
    FMA path): then the wait hides most of its weights. On an H200, one request: Qwen3-0.6B
    (every K this short) 1,472 against 1,430 tok/s with one tile; Qwen3-8B with it on all its
    longer K 247.5 against 251.1 (the second tile's registers cost more than it hides)."""
    return not cfg.dot and 2 * cfg.block_k <= k_split <= 3 * cfg.block_k


def block_m(m: int) -> int:
    """The M tile: M rounded up to a power of two (the config table's third key)."""
    return triton.next_power_of_2(max(m, 1))


def split_for(programs: int, k: int, block_k: int, num_sms: int) -> int:
    """Split K (in powers of two, at least a BLOCK_K tile each) until the programs cover about
    twice the SMs."""
    split = 1
    while programs * split < 2 * num_sms and split * 2 <= triton.cdiv(k, block_k):
        split *= 2
    return split


def heuristic(rows: int, k: int, bm: int, num_sms: int, silu: bool = False) -> GemvConfig:
    """An untuned config for a weight of `rows` x `k` at M tile `bm`. FMA up to bm 2 with 4096
    accumulators a program (about 80 registers a thread at 4 warps, so several programs share
    an SM and keep their loads in flight); tensor cores beyond, where the FMA path would load
    each W row bm times, with shorter K tiles and more W rows a program from 16 rows of x (each
    program reads all of x's rows from L2: more W rows a program, fewer such reads)."""
    tiles = 2 if silu else 1
    pow2_k = max(16, triton.next_power_of_2(k))
    if bm <= 2:
        block_k = min(512, triton.next_power_of_2(k))
        block_n = max(1, min(64, 4096 // (bm * block_k * tiles)))
        cfg = GemvConfig(block_n, block_k)
    elif bm <= 8:
        cfg = GemvConfig(16, min(256, pow2_k), num_stages=3, dot=True)
    else:
        cfg = GemvConfig(32, min(128, pow2_k), num_stages=3, dot=True)
    programs = triton.cdiv(rows // tiles, cfg.block_n)
    return replace(cfg, split_k=split_for(programs, k, cfg.block_k, num_sms))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any figure will do (tests pass their own configs)
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache  # the table is fixed at import; this spares eager launches the heuristic
def config_for(rows: int, k: int, m: int, device: torch.device, silu: bool) -> GemvConfig:
    bm = block_m(m)
    return CONFIGS.get((rows, k, bm)) or heuristic(rows, k, bm, _num_sms(device), silu)


def _validate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> None:
    what = "gemv_silu_and_mul" if silu else "gemv"
    assert weight.dim() == 2 and weight.is_contiguous(), (
        f"{what}: weight must be a contiguous [N, K] matrix, got {tuple(weight.shape)} strides "
        f"{weight.stride()}"
    )
    rows, k = weight.shape
    assert x.shape[-1] == k and k > 0, f"{what}: x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert x.dtype == weight.dtype and x.dtype in gemv_dtypes(), (
        f"{what}: x {x.dtype} and weight {weight.dtype} must share one of {gemv_dtypes()}"
    )
    assert not silu or rows % 2 == 0, f"{what}: the gate_up weight has an odd {rows} rows"
    assert bias is None or (bias.shape == (rows,) and bias.is_contiguous()), (
        f"{what}: bias {None if bias is None else tuple(bias.shape)} for {rows} rows"
    )
    m = x.shape[:-1].numel()
    assert m <= GEMV_KERNEL_MAX_M, (
        f"{what}: {m} rows of x, more than GEMV_KERNEL_MAX_M = {GEMV_KERNEL_MAX_M}"
    )


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    config: GemvConfig | None,
) -> torch.Tensor:
    _validate(x, weight, bias, silu)
    rows, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    n = rows // 2 if silu else rows
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or config_for(rows, k, m, x.device, silu)
    bm = max(16, block_m(m)) if cfg.dot else block_m(m)
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_split)  # no empty splits
    partial = out  # unused when there is no split
    if split > 1:
        partial = torch.empty(split, m, rows, dtype=torch.float32, device=x.device)
    has_bias = bias is not None
    bias_arg = bias if has_bias else out  # unused pointer without a bias
    launch = pdl.options(x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x2,
        weight,
        bias_arg,
        out,
        partial,
        m,
        n,
        k,
        k_split,
        n * k if silu else 0,
        x2.stride(0),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PARTIAL=split > 1,
        EVEN_K=k % k_split == 0,
        HAS_BIAS=has_bias,
        SILU=silu,
        DOT=cfg.dot,
        # fp32 stays exact (the GPU would round its inputs to tf32); 16-bit inputs ignore it
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        # the CPU interpreter multiplies bf16 dot tiles as raw bits (see kernel/moe.py)
        UPCAST=flags.triton_interpret() and x.dtype == torch.bfloat16,
        TWO_EARLY=two_early(cfg, k_split),
        **launch,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split > 1:
        _reduce_splits(partial, bias, out, silu, launch)
    return out.view(*x.shape[:-1], n)


def _reduce_splits(
    partial: torch.Tensor,  # [split, M, rows] float32
    bias: torch.Tensor | None,
    out: torch.Tensor,  # [M, N]
    silu: bool,
    launch: dict[str, bool],
) -> None:
    """The second kernel of a split K: the partial sums added (with the bias, then SiLU-and-mul)
    into `out`."""
    split, m = partial.shape[:2]
    n = out.shape[1]
    _reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK),)](
        partial,
        out if bias is None else bias,  # unused pointer without a bias
        out,
        m,
        n,
        out.stride(0),
        BLOCK_M=block_m(m),
        BLOCK_N=_REDUCE_BLOCK,
        SPLIT_K=split,
        HAS_BIAS=bias is not None,
        SILU=silu,
        **launch,
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [..., K] (at most GEMV_MAX_M rows) @ weight [N, K]^T + bias [N] -> [..., N], as
    F.linear. `config` overrides the table (tests, the benchmark)."""
    return _launch(x, weight, bias, False, config)


def gemv_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) -> [..., I] for weight [2I, K] = [gate; up] (+ bias [2I]):
    silu_and_mul(F.linear(x, weight, bias)) in one kernel."""
    return _launch(x, weight, bias, True, config)
