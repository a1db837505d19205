"""Fused mixture-of-experts in Triton: the (token, k) pairs are sorted by expert on the device,
each expert's run padded to a multiple of BLOCK_M, and one grouped GEMM launch serves every
expert (each program: one BLOCK_M block of one expert's pairs x one BLOCK_N tile of its weight).

    x [T, H] --gemm(w13, rows id // top_k)--> [T*k, 2I] --silu_and_mul--> [T*k, I]
             --gemm(w2, times the routing weight)--> [T*k, H] --sum over k--> [T, H]

No host sync and every size derives from T, top_k and E alone, so it can be captured in a CUDA
graph. The torch reference is `layers/moe.py: moe_forward_torch`. Imported only when the triton
MoE backend runs (see `minisgl.kernel.resolve_moe_backend`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel import flags
from minisgl.kernel.fused import silu_and_mul


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T*top_k flat pair ids (t * top_k + k) by expert, each expert's run padded to a
    multiple of `block_m`. Returns (all int32, sized by an upper bound, not by the routing):
    - sorted_ids [max_padded]: pair ids; padding slots hold T*top_k
    - expert_ids [max_padded // block_m]: each block's expert; num_experts past the used blocks
    - num_post_padded [1]: the length of the used prefix of sorted_ids
    Within an expert the pairs keep their flat order."""
    flat = topk_ids.flatten()
    pairs = flat.numel()
    dev = flat.device
    # every non-empty expert pads at most block_m - 1 slots, and at most `pairs` are non-empty
    max_padded = pairs + min(num_experts, pairs) * (block_m - 1)
    max_blocks = max_padded // block_m
    # scatter_add, not bincount: bincount on CUDA reads the max value back to the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order].long()
    # position of a sorted pair = its expert's padded start + its rank among that expert's pairs
    rank = torch.arange(pairs, device=dev) - (counts.cumsum(0) - counts)[expert]
    dest = (padded_end - padded)[expert] + rank
    sorted_ids = torch.full((max_padded,), pairs, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=dev) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(
    a,  # [rows, K]: row id // A_DIV of each sorted pair id
    w,  # [E, N, K]
    c,  # [T * top_k, N]: row = pair id
    topk_weights,  # [T * top_k], read when MUL_WEIGHT
    sorted_ids,
    expert_ids,
    num_post_padded,
    num_pairs,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    N: tl.constexpr,  # model constants: one compiled variant per GEMM of a model
    K: tl.constexpr,
    A_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # axis 0 varies fastest, so programs launched together share one expert's weight tile
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded):
        return  # a block past the used ones (the grid is sized by the upper bound)
    ids = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = ids < num_pairs  # padding slots hold num_pairs
    expert = tl.load(expert_ids + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a + (ids // A_DIV)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a_tile = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a_tile, w_tile = a_tile.to(tl.float32), w_tile.to(tl.float32)
        acc = tl.dot(a_tile, w_tile, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c + ids[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _config(pairs: int, num_experts: int) -> dict[str, int]:
    """Tile sizes by the average number of pairs per expert: small blocks for decode, where
    each expert sees a few tokens and the weights' bandwidth is the cost."""
    if pairs <= 16 * num_experts:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def _gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_div: int,
    topk_weights: torch.Tensor | None,
    config: dict[str, int],
) -> None:
    sorted_ids, expert_ids, num_post_padded = routing
    _, n, k = w.shape
    grid = (expert_ids.numel(), triton.cdiv(n, config["BLOCK_N"]))
    interpret = flags.triton_interpret()
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        out if topk_weights is None else topk_weights,  # unused pointer without weights
        sorted_ids,
        expert_ids,
        num_post_padded,
        out.shape[0],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        N=n,
        K=k,
        A_DIV=a_div,
        MUL_WEIGHT=topk_weights is not None,
        # fp32 stays exact (the GPU would round its inputs to tf32); 16-bit inputs ignore it
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        # Triton's CPU interpreter multiplies bf16 tiles as raw bits; float32 products of bf16
        # values are exact, so this gives what the GPU's bf16 dot gives
        UPCAST=interpret and a.dtype == torch.bfloat16,
        **config,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate then up), w2 [E, H, I], topk_weights / topk_ids [T, k]
    -> [T, H] = sum over k of topk_weights * expert MLP(x); same contract as moe_forward_torch."""
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    assert w13.shape == (num_experts, two_i, hidden) and w2.shape == (
        num_experts,
        hidden,
        two_i // 2,
    ), f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
    assert topk_weights.shape == topk_ids.shape == (tokens, top_k), (
        f"fused_moe: topk_weights {tuple(topk_weights.shape)}, ids {tuple(topk_ids.shape)}"
    )
    assert x.dtype == w13.dtype == w2.dtype, f"fused_moe: {x.dtype}, {w13.dtype}, {w2.dtype}"
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    config = _config(pairs, num_experts)
    routing = align_block_size(topk_ids, num_experts, config["BLOCK_M"])
    gate_up = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    _gemm(x, w13, gate_up, routing, top_k, None, config)
    h = silu_and_mul(gate_up)
    down = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _gemm(h, w2, down, routing, 1, topk_weights.contiguous().flatten(), config)
    return down.view(tokens, top_k, hidden).sum(dim=1)
