"""Run with TRITON_INTERPRET=1 (tests/test_attention.py does): the Triton attention backend on
CPU tensors through Triton's interpreter, against the torch backend. Exits non-zero with a
message naming the failing case."""

from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
import triton.runtime.interpreter as interp  # noqa: E402

_patch = interp._patch_lang_tensor


def _patch_index(tensor, scope):  # triton 3.6 calls int() on 1-element arrays (numpy >= 2.3)
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


interp._patch_lang_tensor = _patch_index

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from minisgl.attention import create_attention_backend  # noqa: E402
from minisgl.context import get_global_ctx  # noqa: E402
from minisgl.core import Batch  # noqa: E402
from minisgl.kernel import triton_attention as ta  # noqa: E402
from support.attn import (  # noqa: E402
    attend,
    make_problem,
    max_diff,
    rope_inside_vs_rotary_kernel,
    run_backend,
)

CPU = torch.device("cpu")
TOL = 1e-4
failures = []


def check(what: str, out: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    diff = max_diff(out, ref)
    print(f"{what}: max abs diff {diff:.2e}")
    if not diff <= tol:
        failures.append(f"{what}: max abs diff {diff} > {tol}")


def compare(
    what: str, lens, page_size: int, decode: bool, kv_dtype=None, head_dim=32, heads=(4, 2),
    dtype=torch.float32,
) -> None:  # fmt: skip
    b, q, k, v = make_problem(
        lens, page_size, head_dim, dtype, decode, CPU, *heads, kv_dtype=kv_dtype
    )
    check(
        f"{what} page {page_size} {dtype} q, kv {kv_dtype or dtype} head_dim {head_dim} heads "
        f"{heads}",
        run_backend("triton", b, q, k, v),
        run_backend("torch", b, q, k, v),
        TOL if dtype == torch.float32 else 2e-3,  # float16 outputs: half an ulp near 1 is 5e-4
    )


DECODE = [(0, 1), (4, 1), (63, 1), (64, 1), (200, 1)]
# (70, 100): query blocks whose KV starts with whole blocks before every row (no causal mask)
EXTEND = [(0, 37), (16, 16), (13, 20), (40, 1), (70, 100)]
for page_size in (1, 16):
    compare("decode, 5 requests (2 splits)", DECODE, page_size, True)
    compare("decode, 1 request (8 splits)", DECODE[-1:], page_size, True)
    compare("extend with prefixes", EXTEND, page_size, False)
compare("decode, 5 requests (2 splits), one part of head_dim", DECODE, 16, True, head_dim=16)
# the extend kernel at other GQA groups: 3 (not a power of two), 8, and 1 (no GQA)
for heads in ((6, 2), (8, 1), (2, 2)):
    compare("extend with prefixes", EXTEND, 16, False, heads=heads)
# an fp8 pool: both backends widen the same stored values
for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
    compare("decode, 5 requests (2 splits)", DECODE, 16, True, fp8)
    compare("extend with prefixes", EXTEND, 16, False, fp8)
# a 16-bit q over an e4m3 pool: the decode kernel reads int16 pairs of dims (ta.e4m3_pairs)
for head_dim in (32, 64):
    compare("decode, 5 requests (2 splits)", DECODE, 16, True, torch.float8_e4m3fn, head_dim,
            dtype=torch.float16)  # fmt: skip

# graph path: metadata in the static buffers, refilled for another batch of the same size
b1, q1, k1, v1 = make_problem([(5, 1), (150, 1), (30, 1)], 16, 32, torch.float32, True, CPU, 4, 2)
backend = create_attention_backend("triton", CPU)
backend.init_cuda_graph(4)
backend.prepare_for_capture(b1)
captured = b1.attn_metadata
check(
    "capture batch",
    attend(backend, b1, q1, k1, v1),
    run_backend("torch", b1, q1, k1, v1),
)
b2 = Batch(list(reversed(b1.reqs)), "decode")
table = get_global_ctx().page_table
for r, n in zip(b2.reqs, (160, 7, 64)):  # other lengths, other order
    r.cached_len = n - 1
b2.out_loc = torch.tensor(
    [int(table[r.table_idx, r.cached_len // 16]) * 16 + r.cached_len % 16 for r in b2.reqs]
)
backend.prepare_for_replay(b2)
assert b2.attn_metadata.kv_lens.data_ptr() == captured.kv_lens.data_ptr(), "not the buffers"
assert b2.attn_metadata.num_splits == captured.num_splits
q2, k2, v2 = q1.flip(0), k1.flip(0), v1.flip(0)
check(
    "replay batch",
    attend(backend, b2, q2, k2, v2),
    run_backend("torch", b2, q2, k2, v2),
)

# a GPU's split count (32): the merge loops over the splits each request used (4, 17, 24, 32)
b3, q3, k3, v3 = make_problem(
    [(199, 1), (2099, 1), (1499, 1), (2047, 1)], 16, 32, torch.float32, True, CPU, 4, 2
)
wide = create_attention_backend("triton", CPU)
wide.sm_count = 64  # 4 * 64 programs over 4 requests x 2 kv heads: 32 splits each
wide.prepare(b3)
assert b3.attn_metadata.num_splits == 32, b3.attn_metadata.num_splits
check("decode, 32 splits", attend(wide, b3, q3, k3, v3), run_backend("torch", b3, q3, k3, v3))

# the programs' request order (longest first in the engine) changes no bit of the output
b4, q4, k4, v4 = make_problem(DECODE, 16, 32, torch.float32, True, CPU, 4, 2)
run_backend("torch", b4, q4, k4, v4)  # stores the new tokens' K/V into the pool
ctx = get_global_ctx()
args = (q4, ctx.kv_cache.k_flat(0), ctx.kv_cache.v_flat(0), ctx.page_table)
rows4 = torch.tensor([r.table_idx for r in b4.reqs], dtype=torch.int32)
lens4 = torch.tensor([r.cached_len + 1 for r in b4.reqs], dtype=torch.int32)
outs = [
    ta.decode_attention(*args, rows4, lens4, 2, 16, 0.5, order=order)
    for order in (None, torch.argsort(lens4, descending=True).to(torch.int32))
]
if not torch.equal(*outs):
    failures.append("decode: the programs' order changed the output")


def check_decode_rope(dtype, kv_dtype, norm: bool, lens: list[int], head_dim: int = 32) -> None:
    """RoPE inside the decode kernel (kernel.DecodeRope) against the rotary kernel that stores
    k, v before it: the same output, the same pool, bit for bit."""
    what = f"decode with RoPE inside, {dtype} q, {kv_dtype} pool, norm {norm}, lens {lens}"
    what += f", head_dim {head_dim}"
    out_diff, same_pool = rope_inside_vs_rotary_kernel(
        dtype, kv_dtype, norm, lens, 3, CPU, head_dim=head_dim
    )
    print(f"{what}: output diff {out_diff:.2e}, pool {'identical' if same_pool else 'DIFFERENT'}")
    if out_diff != 0 or not same_pool:
        failures.append(f"{what}: differs from the rotary kernel + decode")


for norm in (False, True):
    check_decode_rope(torch.float32, torch.float32, norm, [1, 13, 70, 200])  # 1-2 splits used
check_decode_rope(torch.float16, torch.float16, True, [7, 33])
check_decode_rope(torch.float16, torch.float8_e4m3fn, True, [7, 300])
check_decode_rope(torch.float32, torch.float32, False, [5, 40], head_dim=16)  # one part

if failures:
    sys.exit("FAILED:\n" + "\n".join(failures))
print("ok")
