// minisgl's CPU kernel for the attention of fresh prompts (ext/cpu/native.py builds and loads
// it; ext/cpu/speed.py calls it through torch.ops.minisgl.causal_attention).
//
// out = softmax(scale q k^T, causal) v in float32 for a batch of prompts, packed: sequence b's
// new tokens are rows q_starts[b] .. q_starts[b + 1] of q [T, Hq, D], its keys (a cached prefix,
// then the new tokens') rows k_starts[b] .. k_starts[b + 1] of k and v [S, Hk, D]; a new token
// sees the prefix and the new tokens up to itself.
// A flash-attention loop: a work item is (sequence, kv head, 16 positions), its 16 x Hq / Hk
// query rows (every q head of the kv head: K and V are read once for the group) against keys in
// blocks of 64, up to its last position only (torch's CPU kernel computes whole 256 x 512 blocks
// above the diagonal), with an online softmax in base 2 (q is scaled by scale * log2 e once).
//   scores:  8 rows x 32 keys a tile in registers, K transposed per 32 keys ([D][32]: the loads
//            stay in one page; a [D][T] layout's 4 KiB stride missed L1 on every load);
//   weights: 4 rows x 64 dims a tile in registers, V read in place.
// Its outputs are within float32 rounding of SDPA's (tests/engine/test_native_kernel.py bounds
// both against float64): the exp is its own polynomial, and the sums run in another order.
// On one core of the Intel VM it took 10.4 ms for a 1,000-token SmolLM2 layer against 15.9 ms
// for torch's flash kernel.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int kPositions = 16;  // positions of a work item
constexpr int kKeys = 64;       // keys of a block (the scores buffer's row length)
constexpr int kTileKeys = 32;   // keys of a score tile and of K's transposed tiles

// 2^x for x <= 0: 2^n 2^f with f in [-0.5, 0.5] (a degree-7 polynomial, within 2 ulp); below
// -126 it is flushed toward 0, where softmax weights no longer count
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5252734e-5f);  // (ln 2)^i / i!, i = 7 .. 0
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-4f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// s[r][0..32) = q[r] . k[0..32) for R rows; kt holds the 32 keys transposed, [dim][32]
template <int R>
void score_tile(const float* q, int dim, const float* kt, float* s) {
  __m512 acc[R][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int d = 0; d < dim; d++) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kTileKeys);
    const __m512 k1 = _mm512_loadu_ps(kt + d * kTileKeys + 16);
    for (int r = 0; r < R; r++) {
      const __m512 qd = _mm512_set1_ps(q[r * dim + d]);
      acc[r][0] = _mm512_fmadd_ps(qd, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qd, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; r++) {
    _mm512_storeu_ps(s + r * kKeys, acc[r][0]);
    _mm512_storeu_ps(s + r * kKeys + 16, acc[r][1]);
  }
}

// o[r] += sum over j < keys of p[r][j] v[j] for R rows (v's rows `v_row` floats apart)
template <int R>
void weight_tile(const float* p, const float* v, int64_t v_row, int keys, float* o, int dim) {
  for (int c = 0; c < dim; c += 64) {
    __m512 acc[R][4];
    for (int r = 0; r < R; r++)
      for (int x = 0; x < 4; x++) acc[r][x] = _mm512_loadu_ps(o + r * dim + c + 16 * x);
    for (int j = 0; j < keys; j++) {
      const float* vj = v + j * v_row + c;
      const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
      const __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
      for (int r = 0; r < R; r++) {
        const __m512 pj = _mm512_set1_ps(p[r * kKeys + j]);
        acc[r][0] = _mm512_fmadd_ps(pj, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(pj, v1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(pj, v2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(pj, v3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; r++)
      for (int x = 0; x < 4; x++) _mm512_storeu_ps(o + r * dim + c + 16 * x, acc[r][x]);
  }
}

void score_rows(int rows, const float* q, int dim, const float* kt, float* s) {
  for (int r = 0; r < rows; r += 8) {
    const float* qr = q + r * dim;
    float* sr = s + r * kKeys;
    switch (std::min(8, rows - r)) {
      case 1: score_tile<1>(qr, dim, kt, sr); break;
      case 2: score_tile<2>(qr, dim, kt, sr); break;
      case 3: score_tile<3>(qr, dim, kt, sr); break;
      case 4: score_tile<4>(qr, dim, kt, sr); break;
      case 5: score_tile<5>(qr, dim, kt, sr); break;
      case 6: score_tile<6>(qr, dim, kt, sr); break;
      case 7: score_tile<7>(qr, dim, kt, sr); break;
      default: score_tile<8>(qr, dim, kt, sr); break;
    }
  }
}

void weight_rows(int rows, const float* p, const float* v, int64_t v_row, int keys, float* o,
                 int dim) {
  for (int r = 0; r < rows; r += 4) {
    switch (std::min(4, rows - r)) {
      case 1: weight_tile<1>(p + r * kKeys, v, v_row, keys, o + r * dim, dim); break;
      case 2: weight_tile<2>(p + r * kKeys, v, v_row, keys, o + r * dim, dim); break;
      case 3: weight_tile<3>(p + r * kKeys, v, v_row, keys, o + r * dim, dim); break;
      default: weight_tile<4>(p + r * kKeys, v, v_row, keys, o + r * dim, dim); break;
    }
  }
}

struct Shape {
  const int64_t *q_starts, *k_starts;
  int batch, q_heads, kv_heads, dim;
  int64_t q_row, kv_row;  // floats between positions of q and of k, v
  int group() const { return q_heads / kv_heads; }
  int64_t length(int b) const { return q_starts[b + 1] - q_starts[b]; }  // new tokens
  int64_t keys(int b) const { return k_starts[b + 1] - k_starts[b]; }  // prefix + new tokens
  int64_t padded(int b) const { return (keys(b) + kTileKeys - 1) / kTileKeys * kTileKeys; }
};

// K transposed per (sequence, kv head) and per 32 keys, zero past the sequence's end
std::vector<float> transposed_keys(const float* k, const Shape& s, std::vector<int64_t>& at,
                                   int threads) {
  at.assign(static_cast<size_t>(s.batch) * s.kv_heads + 1, 0);
  for (int bh = 0; bh < s.batch * s.kv_heads; bh++)
    at[bh + 1] = at[bh] + s.padded(bh / s.kv_heads) * s.dim;
  std::vector<float> kt(at.back());
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int bh = 0; bh < s.batch * s.kv_heads; bh++) {
    const int b = bh / s.kv_heads, h = bh % s.kv_heads;
    for (int64_t j = 0; j < s.padded(b); j++) {
      const float* src = k + (s.k_starts[b] + j) * s.kv_row + h * s.dim;
      float* dst = kt.data() + at[bh] + (j / kTileKeys) * kTileKeys * s.dim + j % kTileKeys;
      for (int d = 0; d < s.dim; d++) dst[d * kTileKeys] = j < s.keys(b) ? src[d] : 0.0f;
    }
  }
  return kt;
}

struct Rows {  // a work item's query rows (position-major, then the group's heads)
  std::vector<float> q, s, o, m, l;  // scaled q, scores / weights, outputs, running max and sum
  explicit Rows(int rows, int dim)
      : q(rows * dim), s(rows * kKeys), o(rows * dim), m(rows), l(rows) {}
};

// one row's online-softmax step over a block's scores (log2 units): the weights replace them
void softmax_step(Rows& w, int i, int valid, int keys, int dim) {
  float* si = &w.s[i * kKeys];
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int j = 0; j < valid; j += 16) {
    const __mmask16 mk = valid - j >= 16 ? 0xFFFF : (1u << (valid - j)) - 1;
    mx = _mm512_mask_max_ps(mx, mk, mx, _mm512_maskz_loadu_ps(mk, si + j));
  }
  const float m_new = std::max(w.m[i], _mm512_reduce_max_ps(mx));
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < keys; j += 16) {  // weights past `valid` are 0 (masked by causality)
    const int left = valid - j;
    const __mmask16 mk = left >= 16 ? 0xFFFF : left > 0 ? (1u << left) - 1 : 0;
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(si + j), mv);
    const __m512 p = _mm512_maskz_mov_ps(mk, exp2_nonpositive(x));
    _mm512_storeu_ps(si + j, p);
    sum = _mm512_add_ps(sum, p);
  }
  const float alpha = w.m[i] == -INFINITY ? 0.0f : exp2f(w.m[i] - m_new);
  w.l[i] = w.l[i] * alpha + _mm512_reduce_add_ps(sum);
  w.m[i] = m_new;
  if (alpha != 1.0f)
    for (int d = 0; d < dim; d++) w.o[i * dim + d] *= alpha;
}

void attend_item(const float* q, const float* kt, const float* v, float* out, const Shape& s,
                 int b, int h, int r0, float log2_scale, Rows& w) {
  const int group = s.group(), dim = s.dim;
  const int64_t base = s.q_starts[b];
  const int prefix = static_cast<int>(s.keys(b) - s.length(b));  // keys before the new tokens
  const int r1 = static_cast<int>(std::min<int64_t>(r0 + kPositions, s.length(b)));
  const int rows = (r1 - r0) * group;
  for (int i = 0; i < rows; i++) {
    const float* src = q + (base + r0 + i / group) * s.q_row + (h * group + i % group) * dim;
    for (int d = 0; d < dim; d++) w.q[i * dim + d] = src[d] * log2_scale;
  }
  std::fill(w.o.begin(), w.o.begin() + rows * dim, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, -INFINITY);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
  const float* vh = v + s.k_starts[b] * s.kv_row + h * dim;
  const int last = prefix + r1;  // keys up to the item's last position
  for (int k0 = 0; k0 < last; k0 += kKeys) {
    const int keys = std::min(kKeys, last - k0);
    for (int t = 0; t * kTileKeys < keys; t++)
      score_rows(rows, w.q.data(), dim, kt + (k0 + t * kTileKeys) * dim, &w.s[t * kTileKeys]);
    for (int i = 0; i < rows; i++) {
      const int valid = std::min(keys, prefix + r0 + i / group - k0 + 1);
      if (valid > 0) {
        softmax_step(w, i, valid, keys, dim);
      } else {  // the block lies after this row's position
        memset(&w.s[i * kKeys], 0, keys * sizeof(float));
      }
    }
    weight_rows(rows, w.s.data(), vh + k0 * s.kv_row, s.kv_row, keys, w.o.data(), dim);
  }
  for (int i = 0; i < rows; i++) {
    float* dst = out + (base + r0 + i / group) * s.q_heads * dim + (h * group + i % group) * dim;
    const float inv = 1.0f / w.l[i];
    for (int d = 0; d < dim; d++) dst[d] = w.o[i * dim + d] * inv;
  }
}

}  // namespace

extern "C" {

// out [T, Hq, D] (contiguous); q's positions q_row floats apart, k's and v's kv_row; D % 64 == 0;
// each sequence has at least as many keys as new tokens
void causal_attention(const float* q, int64_t q_row, const float* k, const float* v,
                      int64_t kv_row, float* out, const int64_t* q_starts,
                      const int64_t* k_starts, int batch, int q_heads, int kv_heads, int dim,
                      float scale, int threads) {
  const Shape s = {q_starts, k_starts, batch, q_heads, kv_heads, dim, q_row, kv_row};
  std::vector<int64_t> kt_at;
  const std::vector<float> kt = transposed_keys(k, s, kt_at, threads);
  struct Item { int b, h, r0; int64_t keys; };
  std::vector<Item> items;  // the most keys first: dynamic scheduling then ends evenly
  for (int b = 0; b < batch; b++)
    for (int r0 = 0; r0 < s.length(b); r0 += kPositions)
      for (int h = 0; h < kv_heads; h++) items.push_back({b, h, r0, s.keys(b) - s.length(b) + r0});
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.keys > y.keys; });
  const float log2_scale = scale * 1.4426950408889634f;
#pragma omp parallel num_threads(threads)
  {
    Rows w(kPositions * s.group(), dim);
#pragma omp for schedule(dynamic, 1)
    for (size_t n = 0; n < items.size(); n++) {
      const Item& it = items[n];
      attend_item(q, kt.data() + kt_at[it.b * kv_heads + it.h], v, out, s, it.b, it.h, it.r0,
                  log2_scale, w);
    }
  }
}

}  // extern "C"
