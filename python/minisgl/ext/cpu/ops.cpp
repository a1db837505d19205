// The CPU kernels of the torch.ops.minisgl ops (their schemas are defined in ext/cpu/native.py):
// qdot.cpp's, attention.cpp's and fused.cpp's functions on tensors,
// so that eager layers and the compiled (AOTInductor) steps call them without going through
// Python (a Python kernel cost 8 us a call more: 1 ms a SmolLM2 step).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" void qdot_mm(const uint16_t* x, int rows, int cols, const uint8_t* codes,
                        const uint8_t* scales, int bits, int min, int super, int half, uint16_t* y,
                        int out, int threads);
#ifdef __AVX512F__  // attention.cpp and fused.cpp: built only with AVX512 (native.py)
extern "C" void causal_attention(const float* q, int64_t q_row, const float* k, const float* v,
                                 int64_t kv_row, float* out, const int64_t* q_starts,
                                 const int64_t* k_starts, int batch, int q_heads, int kv_heads,
                                 int dim, float scale, int threads);
extern "C" void decode_attention(const float* q, const void* k, const void* v, int kind,
                                 int64_t row, const int64_t* slots, int64_t slot_stride,
                                 const int64_t* lens, float* out, int batch, int q_heads,
                                 int kv_heads, int dim, float scale, int threads);
extern "C" void rotate(const float* x, int64_t x_row, const float* table, float* out, int64_t rows,
                       int heads, int dim, int threads);
extern "C" void silu_and_mul(const float* x, int64_t x_row, float* out, int64_t rows, int64_t cols,
                             int threads);
extern "C" void rms_norm(const float* x, int64_t x_row, float* residual, const float* w, float eps,
                         float* out, int64_t rows, int64_t cols, int threads);
extern "C" void gumbel_argmax(const void* logits, int dtype, int64_t row_stride, int64_t rows,
                              int64_t vocab, const float* temperature, const int64_t* seed,
                              const int64_t* step, int64_t* ids, int threads);
#endif

namespace {

constexpr int64_t kTile = 16;
constexpr int64_t kBytesPerBit = 64;  // a tile's codes of one block (256 bytes at 4 bits)

// The fp16 scales: d (two rows at six bits: a d per 16 weights), then mn (rows of 16 halves a
// tile's block), which codes may go without (then mn = 0, at four bits -8 d). Whether mn is there.
bool fp16_min(const at::Tensor& codes, const at::Tensor& scales, int64_t bits) {
  const int64_t d_rows = bits == 6 ? 2 : 1, rows = scales.dim() == 4 ? scales.size(2) : 0;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                  (rows == d_rows + 1 || rows == d_rows) && scales.size(3) == kTile,
              "qdot_mm: scales must be contiguous float16 [out / 16, in / 32, rows, 16]: d (two "
              "rows at six bits, a d per 16 weights), then mn (which codes may leave out), or "
              "uint8 [out / 16, in / 256, bytes] (the K-quants')");
  return rows > d_rows;
}

// The K-quants' scales, uint8 [out / 16, in / 256, bytes]: per 8 blocks fp16 D (and M) rows of
// 16, then each block's int8 rows (sc, sc_1 at six bits; m with M). Whether M and m are there.
bool super_min(const at::Tensor& codes, const at::Tensor& scales, int64_t bits) {
  const int64_t d_rows = bits == 6 ? 2 : 1, bytes = scales.dim() == 3 ? scales.size(2) : 0;
  const int64_t without = 32 + 8 * 16 * d_rows, with = 64 + 8 * 16 * (d_rows + 1);
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == codes.size(0) &&
                  codes.size(1) % 8 == 0 && scales.size(1) * 8 == codes.size(1) &&
                  (bytes == without || bytes == with),
              "qdot_mm: the K-quants' scales must be contiguous uint8 [out / 16, in / 256, ",
              without, " or ", with, "] at ", bits, " bits");
  return bytes == with;
}

at::Tensor qdot(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2, "qdot_mm: x must be [rows, in]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "qdot_mm: x must be bfloat16 or float16");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous(),
              "qdot_mm: codes must be contiguous uint8 [out / 16, in / 32, bytes]");
  const int64_t bits = codes.size(2) / kBytesPerBit;
  TORCH_CHECK(codes.size(2) % kBytesPerBit == 0 && (bits == 4 || bits == 6 || bits == 8),
              "qdot_mm: codes must hold 256, 384 or 512 bytes a block (4, 6 or 8 bits)");
  const bool super = scales.scalar_type() == at::kByte;
  const bool min = super ? super_min(codes, scales, bits) : fp16_min(codes, scales, bits);
  TORCH_CHECK(x.size(1) == codes.size(1) * 32, "qdot_mm: x's columns do not fit the codes");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), out = codes.size(0) * kTile;
  at::Tensor y = at::empty({rows, out}, xc.options());
  if (rows > 0) {
    qdot_mm(static_cast<const uint16_t*>(xc.const_data_ptr()), rows, xc.size(1),
            codes.const_data_ptr<uint8_t>(), static_cast<const uint8_t*>(scales.const_data_ptr()),
            static_cast<int>(bits), min, super, xc.scalar_type() == at::kHalf,
            static_cast<uint16_t*>(y.data_ptr()), out, at::get_num_threads());
  }
  return y;
}

#ifdef __AVX512F__
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& q_starts, const at::Tensor& k_starts, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
              "causal_attention: q must be [T, Hq, D], k and v [S, Hk, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat, "causal_attention: q, k and v must be float32");
  const int64_t tokens = q.size(0), q_heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  TORCH_CHECK(k.size(2) == dim && dim % 64 == 0 && q_heads % kv_heads == 0,
              "causal_attention: shapes do not fit");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == dim && v.strides() == k.strides(),
              "causal_attention: k's and v's heads must be dense, with the same strides");
  for (const at::Tensor* starts : {&q_starts, &k_starts}) {
    TORCH_CHECK(starts->scalar_type() == at::kLong && starts->dim() == 1 &&
                    starts->is_contiguous() && starts->size(0) == q_starts.size(0) &&
                    starts->size(0) >= 2, "causal_attention: starts must be int64 [B + 1]");
  }
  const int64_t batch = q_starts.size(0) - 1;
  const int64_t *qs = q_starts.const_data_ptr<int64_t>(), *ks = k_starts.const_data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[batch] == tokens && ks[0] == 0 && ks[batch] == k.size(0),
              "causal_attention: starts must run from 0 to T (q) and to S (k)");
  for (int64_t b = 0; b < batch; b++) {
    TORCH_CHECK(qs[b + 1] >= qs[b] && ks[b + 1] - ks[b] >= qs[b + 1] - qs[b],
                "causal_attention: a sequence has fewer keys than new tokens");
  }
  // q may be a view of the QKV projection's output: its positions need not be adjacent
  const bool dense = q.stride(2) == 1 && q.stride(1) == dim;
  const at::Tensor qd = dense ? q : q.contiguous();
  at::Tensor out = at::empty({tokens, q_heads, dim}, q.options());
  causal_attention(qd.const_data_ptr<float>(), qd.stride(0), k.const_data_ptr<float>(),
                   v.const_data_ptr<float>(), k.stride(0), out.data_ptr<float>(), qs, ks, batch,
                   q_heads, kv_heads, dim, static_cast<float>(scale), at::get_num_threads());
  return out;
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& slots, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.is_contiguous() &&
                  q.scalar_type() == at::kFloat,
              "decode_attention: q must be contiguous float32 [B, Hq, D], k and v [S, Hk, D]");
  const at::ScalarType kind = k.scalar_type();
  TORCH_CHECK(v.scalar_type() == kind &&
                  (kind == at::kFloat || kind == at::kBFloat16 || kind == at::kHalf),
              "decode_attention: k and v must share float32, bfloat16 or float16");
  const int64_t batch = q.size(0), q_heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  TORCH_CHECK(k.size(2) == dim && (dim == 64 || dim == 128 || dim == 256) &&
                  q_heads % kv_heads == 0,
              "decode_attention: shapes do not fit (head size 64, 128 or 256)");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == dim && v.strides() == k.strides(),
              "decode_attention: k's and v's heads must be dense, with the same strides");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == batch &&
                  slots.stride(1) == 1 && lens.scalar_type() == at::kLong &&
                  lens.dim() == 1 && lens.size(0) == batch && lens.is_contiguous(),
              "decode_attention: slots must be int64 [B, L] (unit stride), lens int64 [B]");
  const int64_t* n = lens.const_data_ptr<int64_t>();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; b++) {
    TORCH_CHECK(n[b] >= 1 && n[b] <= slots.size(1), "decode_attention: lens must be 1..L");
    for (int64_t t = 0; t < n[b]; t++)
      TORCH_CHECK(slot[b * slots.stride(0) + t] >= 0 && slot[b * slots.stride(0) + t] < k.size(0),
                  "decode_attention: a slot is outside the pools");
  }
  at::Tensor out = at::empty({batch, q_heads, dim}, q.options());
  const int code = kind == at::kFloat ? 0 : kind == at::kBFloat16 ? 1 : 2;
  if (batch > 0) {
    decode_attention(q.const_data_ptr<float>(), k.const_data_ptr(), v.const_data_ptr(), code,
                     k.stride(0), slot, slots.stride(0), n, out.data_ptr<float>(), batch, q_heads,
                     kv_heads, dim, static_cast<float>(scale), at::get_num_threads());
  }
  return out;
}

void check_float(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.stride(-1) == 1, op, ": ", name,
              " must be float32 with a dense last dim");
}

// rows of a tensor whose last dim is dense: [rows, last] with one row stride (a copy if needed)
at::Tensor as_rows(const at::Tensor& x) {
  const at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

at::Tensor rotate_op(const at::Tensor& x, const at::Tensor& table) {
  check_float(x, "rotate", "x");
  TORCH_CHECK(x.dim() == 3, "rotate: x must be [T, H, D]");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(x.stride(1) == dim && dim % 32 == 0,
              "rotate: x's heads must be dense, D % 32 == 0");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() &&
                  table.sizes() == at::IntArrayRef({rows, 2, dim}),
              "rotate: table must be contiguous float32 [T, 2, D]");
  at::Tensor out = at::empty({rows, heads, dim}, x.options());
  rotate(x.const_data_ptr<float>(), x.stride(0), table.const_data_ptr<float>(),
         out.data_ptr<float>(), rows, heads, dim, at::get_num_threads());
  return out;
}

at::Tensor silu_and_mul_op(const at::Tensor& x) {
  check_float(x, "silu_and_mul", "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2 I]");
  const int64_t rows = x.size(0), cols = x.size(1) / 2;
  at::Tensor out = at::empty({rows, cols}, x.options());
  silu_and_mul(x.const_data_ptr<float>(), x.stride(0), out.data_ptr<float>(), rows, cols,
               at::get_num_threads());
  return out;
}

at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "rms_norm", "x");
  check_float(weight, "rms_norm", "weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight must be [N]");
  const at::Tensor rows = as_rows(x);
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm(rows.const_data_ptr<float>(), rows.stride(0), nullptr, weight.const_data_ptr<float>(),
           static_cast<float>(eps), out.data_ptr<float>(), rows.size(0), rows.size(1),
           at::get_num_threads());
  return out;
}

void add_rms_norm_op(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_float(x, "add_rms_norm_", "x");
  check_float(weight, "add_rms_norm_", "weight");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.dim() == 2 &&
                  residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat,
              "add_rms_norm_: x and residual must be contiguous float32 [T, N]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "add_rms_norm_: weight must be [N]");
  // residual += x, then x = the normed sum: each row read before it is written
  rms_norm(x.const_data_ptr<float>(), x.size(1), residual.data_ptr<float>(),
           weight.const_data_ptr<float>(), static_cast<float>(eps), x.data_ptr<float>(), x.size(0),
           x.size(1), at::get_num_threads());
}

at::Tensor gumbel_argmax_op(const at::Tensor& logits, const at::Tensor& temperature,
                            const at::Tensor& seed, const at::Tensor& step) {
  const auto type = logits.scalar_type();
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 &&
                  (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf),
              "gumbel_argmax: logits must be float32, bfloat16 or float16 [B, V], rows dense");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab < (int64_t{1} << 31), "gumbel_argmax: over 2^31 logits a row");
  const at::Tensor t = temperature.to(at::kFloat).contiguous();
  const at::Tensor s = seed.to(at::kLong).contiguous(), st = step.to(at::kLong).contiguous();
  TORCH_CHECK(t.numel() == rows && s.numel() == rows && st.numel() == rows,
              "gumbel_argmax: temperature, seed and step need one value a row");
  at::Tensor ids = at::empty({rows}, logits.options().dtype(at::kLong));
  if (rows > 0 && vocab > 0) {
    const int dtype = type == at::kFloat ? 0 : type == at::kBFloat16 ? 1 : 2;
    gumbel_argmax(logits.const_data_ptr(), dtype, logits.stride(0), rows, vocab,
                  t.const_data_ptr<float>(), s.const_data_ptr<int64_t>(),
                  st.const_data_ptr<int64_t>(), ids.data_ptr<int64_t>(), at::get_num_threads());
  }
  return ids;
}
#endif

}  // namespace

// 1 where the float32 ops below are registered (the AVX512 build), 0 in the AVX2 one
extern "C" int float32_supported() {
#ifdef __AVX512F__
  return 1;
#else
  return 0;
#endif
}

TORCH_LIBRARY_IMPL(minisgl, CPU, m) {
  m.impl("qdot_mm", &qdot);
#ifdef __AVX512F__
  m.impl("causal_attention", &attention);
  m.impl("decode_attention", &decode);
  m.impl("rotate", &rotate_op);
  m.impl("silu_and_mul", &silu_and_mul_op);
  m.impl("rms_norm", &rms_norm_op);
  m.impl("add_rms_norm_", &add_rms_norm_op);
  m.impl("gumbel_argmax", &gumbel_argmax_op);
#endif
}
