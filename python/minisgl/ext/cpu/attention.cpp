// minisgl's CPU kernels for the attention of fresh prompts and of decode rows (ext/cpu/native.py
// builds and loads them; ext/cpu/speed.py calls them through torch.ops.minisgl.causal_attention
// and decode_attention; the latter is at the end of this file).
//
// out = softmax(scale q k^T, causal) v in float32 for a batch of prompts, packed: sequence b's
// new tokens are rows q_starts[b] .. q_starts[b + 1] of q [T, Hq, D], its keys (a cached prefix,
// then the new tokens') rows k_starts[b] .. k_starts[b + 1] of k and v [S, Hk, D]; a new token
// sees the prefix and the new tokens up to itself.
// A flash-attention loop: a work item is (sequence, kv head, 32 positions), its 32 x Hq / Hk
// query rows (every q head of the kv head: K and V are read once for the group) against keys in
// blocks of 64, up to its last position only, with an online softmax in base 2 (q is scaled by
// scale * log2 e once). The items run kv head by kv head (a head's K and V stay in the cores'
// L2: interleaving the heads cost 3 %), the most keys first within a head.
//   scores:  8 rows x 32 keys a tile in registers, K transposed per 32 keys ([D][32]: the loads
//            stay in one page), the sums starting at -m (the row's running maximum);
//   softmax: in the same registers, at once for the tile's 8 rows: their block maxima by one
//            transposing tree (not 8 reductions), m raised only where a block passes it by more
//            than 8 (weights then reach 2^8; a rare branch that predicted lets the exps run while
//            the maxima are found), the row sums kept per lane (reduced once, at the end);
//   exp:     2^u from a 16-entry table and a degree-3 polynomial (4 FMA-pipe ops; Zen 5 runs the
//            rest on its two other FP pipes; a degree-7 polynomial took 7);
//   weights: 4 rows x 64 dims a tile in registers over 64 keys, V read in place.
// The FMA pipes bound it: a layer's causal FMAs alone take ~2.0 ms at this VM's peak.
// Its outputs are within float32 rounding of SDPA's (tests/engine/test_native_kernel.py bounds
// both against float64): the exp is its own, and the sums run in another order. A row's bits
// depend on its own sequence and position only (tiles and blocks start at fixed positions), not
// on the batch or the threads.
// On the AMD EPYC (Zen 5) VM, 2 threads, a 1,000-token SmolLM2 layer (9 q heads, 3 kv heads,
// D 64) takes 2.5 ms against 3.0 for the kernel before (exact maxima and sums per row and 64-key
// block, a degree-7 exp, the heads interleaved); 2.7 against 3.2 ms inside a prompt.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#define INLINE inline __attribute__((always_inline))

namespace {

constexpr int kPositions = 32;  // positions of a work item (16: 1 % slower)
constexpr int kKeys = 32;       // keys of a score tile and of K's transposed tiles
constexpr int kBlock = 64;      // keys of a weight tile (p's rows)
constexpr int kTileRows = 8;    // rows of a score tile
constexpr float kSlack = 8.0f;  // how far a row's scores may pass its m (log2 units)

// 2^u for finite u: y = u rounded to 1/16, r = u - y in [-1/32, 1/32]; 2^y = 2^floor(y) times
// 2^(i/16) from a table (i: 16 y's last 4 bits), 2^r = 1 + r c(r), c of degree 2 (fitted; 0.9
// ulp at most in all, the degree-7 Taylor series 0.6); scalef takes floor(y) below -149 to 0.
// 4 ops on the FMA pipes, which the loops keep busy (a degree-6 polynomial takes 6, 1 % slower):
// Zen 5 runs the others on its two other FP pipes.
INLINE __m512 exp2_finite(__m512 u) {
  const __m512 table = _mm512_setr_ps(
      1.0f, 1.04427373f, 1.09050775f, 1.13878858f, 1.18920708f, 1.24185777f, 1.29683959f,
      1.35425556f, 1.41421354f, 1.47682619f, 1.54221082f, 1.61049032f, 1.68179286f, 1.75625217f,
      1.8340081f, 1.91520655f);
  const __m512 y = _mm512_roundscale_ps(u, 4 << 4 | _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(u, y);
  // y + 1.5 2^19 is exact, 16 y in its last bits, for |y| < 2^18 (below, 2^y is 0 whatever i;
  // above, only in masked lanes: the weights' u stay below kSlack)
  const __m512i i = _mm512_castps_si512(_mm512_add_ps(y, _mm512_set1_ps(786432.0f)));
  const __m512 t = _mm512_permutexvar_ps(i, table);
  __m512 c = _mm512_fmadd_ps(_mm512_set1_ps(5.5502135e-2f), r, _mm512_set1_ps(2.4023429e-1f));
  c = _mm512_fmadd_ps(c, r, _mm512_set1_ps(6.9314718e-1f));
  return _mm512_scalef_ps(_mm512_fmadd_ps(t, _mm512_mul_ps(r, c), t), y);
}

// The maxima of 8 vectors' lanes at once (a transposing tree, not 8 reductions): t[r]'s at lane
// 4r for r < 4, at lane 4 (r - 4) + 2 for r >= 4
INLINE __m512 row_maxima(const __m512* t) {
  __m512 u[4], w[2];
  for (int i = 0; i < 4; i++)  // halves: t[2i]'s in lanes 0..7, t[2i + 1]'s in 8..15
    u[i] = _mm512_max_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; i++)  // quarters: 128-bit lane j holds t[4i + j]'s
    w[i] = _mm512_max_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  const __m512 z = _mm512_max_ps(_mm512_shuffle_ps(w[0], w[1], 0x44),
                                 _mm512_shuffle_ps(w[0], w[1], 0xEE));
  return _mm512_max_ps(z, _mm512_permute_ps(z, 0xB1));
}

INLINE int max_lane(int r) { return r < 4 ? 4 * r : 4 * (r - 4) + 2; }

INLINE __m512 lane(__m512 x, int r) {  // row r's value of a packed vector, in every lane
  return _mm512_permutexvar_ps(_mm512_set1_epi32(max_lane(r)), x);
}

struct Rows {  // a work item's query rows (position-major, then the group's heads)
  float *q, *p, *o, *l, *m;  // scaled q, a block's weights, outputs, sums by lane, m (a score
                             // tile's 8 packed as row_maxima packs them)
  int *sees, *valid, *keys;  // keys a row sees: in all, of the score tile, of the block
  std::vector<float> buf;
  std::vector<int> counts;
  Rows(int rows, int dim) : buf(rows * (2 * dim + kBlock + 16) + (rows / kTileRows + 1) * 16 + 16),
                            counts(3 * rows) {
    float* at = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~63);
    q = at, o = q + rows * dim, p = o + rows * dim, l = p + rows * kBlock, m = l + rows * 16;
    sees = counts.data(), valid = sees + rows, keys = valid + rows;
  }
};

// The rows (packed lanes) in `grow` add z, their block's maximum less m, to m: returns that
// shift (0 in other lanes). o, l and the block's first `done` weights (p: the block's start) are
// rescaled by 2^-shift, unless they are still 0.
__attribute__((noinline)) __m512 raise_maxima(__m512 z, __mmask16 grow, int rows, bool rescale,
                                              float* m, float* l, float* o, int dim, float* p,
                                              int done) {
  const __m512 shift = _mm512_maskz_mov_ps(grow, z);
  _mm512_store_ps(m, _mm512_add_ps(_mm512_load_ps(m), shift));
  if (!rescale) return shift;
  const __m512 alpha = exp2_finite(_mm512_sub_ps(_mm512_setzero_ps(), shift));
  for (int r = 0; r < rows; r++) {
    if (!(grow >> max_lane(r) & 1)) continue;
    const __m512 a = lane(alpha, r);
    _mm512_store_ps(l + r * 16, _mm512_mul_ps(_mm512_load_ps(l + r * 16), a));
    for (int d = 0; d < dim; d += 16)
      _mm512_store_ps(o + r * dim + d, _mm512_mul_ps(_mm512_load_ps(o + r * dim + d), a));
    for (int j = 0; j < done; j += 16)  // the block's weights so far
      _mm512_store_ps(p + r * kBlock + j, _mm512_mul_ps(_mm512_load_ps(p + r * kBlock + j), a));
  }
  return shift;
}

// The online-softmax step of R rows' scores less m (acc, in registers) against 32 keys: m moves
// where needed (o, l and p so far rescaled), the weights 2^(s - m) go to p at `done`, their sums
// to l lane by lane. valid[r]: the keys row r sees (0 .. 32; all where kFull).
template <int R, bool kFull>
INLINE void softmax_tile(__m512 (&acc)[R][2], const int* valid, bool first, float* m, float* l,
                         float* p, int done, float* o, int dim) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __mmask16 mk[R][2];
  __m512 t[kTileRows];
  for (int r = 0; r < kTileRows; r++) {
    if (r >= R) { t[r] = ninf; continue; }
    const uint32_t bits = kFull || valid[r] >= kKeys ? ~0u : (1u << valid[r]) - 1;  // valid >= 0
    mk[r][0] = bits, mk[r][1] = bits >> 16;
    t[r] = _mm512_max_ps(_mm512_mask_mov_ps(ninf, mk[r][0], acc[r][0]),
                         _mm512_mask_mov_ps(ninf, mk[r][1], acc[r][1]));
  }
  // m moves only at the first block and where a block's maximum passes it by more than kSlack
  // (rare after a few blocks): predicted, the branch lets the exps run while the maxima are
  // still being found (m moving at every larger maximum cost ~3 %)
  const __m512 z = row_maxima(t);
  const __m512 bar = first ? ninf : _mm512_set1_ps(kSlack);
  const __mmask16 grow = _mm512_cmp_ps_mask(z, bar, _CMP_GT_OQ);
  if (grow) {
    const __m512 shift = raise_maxima(z, grow, R, !first, m, l, o, dim, p, done);
    for (int r = 0; r < R; r++) {
      const __m512 sr = lane(shift, r);
      acc[r][0] = _mm512_sub_ps(acc[r][0], sr), acc[r][1] = _mm512_sub_ps(acc[r][1], sr);
    }
  }
  for (int r = 0; r < R; r++) {
    const __m512 p0 = _mm512_maskz_mov_ps(mk[r][0], exp2_finite(acc[r][0]));
    const __m512 p1 = _mm512_maskz_mov_ps(mk[r][1], exp2_finite(acc[r][1]));
    _mm512_store_ps(p + r * kBlock + done, p0);
    _mm512_store_ps(p + r * kBlock + done + 16, p1);
    _mm512_store_ps(l + r * 16, _mm512_add_ps(_mm512_load_ps(l + r * 16), _mm512_add_ps(p0, p1)));
  }
}

// R rows' scores against 32 keys (kt: transposed, [dim][32]) less m (the sums start there), then
// their softmax step
template <int R>
INLINE void score_tile(const float* q, const float* kt, int dim, const int* valid, bool first,
                       float* m, float* l, float* p, int done, float* o) {
  const __m512 start = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_load_ps(m));
  __m512 acc[R][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = lane(start, r);
  for (int d = 0; d < dim; d++) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kKeys);
    const __m512 k1 = _mm512_loadu_ps(kt + d * kKeys + 16);
    for (int r = 0; r < R; r++) {
      const __m512 qd = _mm512_set1_ps(q[r * dim + d]);
      acc[r][0] = _mm512_fmadd_ps(qd, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qd, k1, acc[r][1]);
    }
  }
  if (valid[0] >= kKeys)  // rows ascend: the first sees the fewest keys
    softmax_tile<R, true>(acc, valid, first, m, l, p, done, o, dim);
  else
    softmax_tile<R, false>(acc, valid, first, m, l, p, done, o, dim);
}

// o[r] += sum over j < keys of p[r][j] v[j] for R rows (v's rows `v_row` floats apart)
template <int R>
INLINE void weight_tile(const float* p, const float* v, int64_t v_row, int keys, float* o,
                        int dim) {
  for (int c = 0; c < dim; c += 64) {
    __m512 acc[R][4];
    for (int r = 0; r < R; r++)
      for (int x = 0; x < 4; x++) acc[r][x] = _mm512_load_ps(o + r * dim + c + 16 * x);
    for (int j = 0; j < keys; j++) {
      const float* vj = v + j * v_row + c;
      const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
      const __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
      for (int r = 0; r < R; r++) {
        const __m512 pj = _mm512_set1_ps(p[r * kBlock + j]);
        acc[r][0] = _mm512_fmadd_ps(pj, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(pj, v1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(pj, v2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(pj, v3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; r++)
      for (int x = 0; x < 4; x++) _mm512_store_ps(o + r * dim + c + 16 * x, acc[r][x]);
  }
}

// D: the head size where fixed at compile time (64, 128), else 0
template <int D>
void score_rows(int rows, const Rows& w, const float* kt, int dim, bool first, int done) {
  if (D > 0) dim = D;
  for (int r = 0; r < rows; r += kTileRows) {
    const float* q = w.q + r * dim;
    float *m = w.m + r / kTileRows * 16, *l = w.l + r * 16, *p = w.p + r * kBlock;
    float* o = w.o + r * dim;
    const int* vr = w.valid + r;
    switch (std::min(kTileRows, rows - r)) {
      case 1: score_tile<1>(q, kt, dim, vr, first, m, l, p, done, o); break;
      case 2: score_tile<2>(q, kt, dim, vr, first, m, l, p, done, o); break;
      case 3: score_tile<3>(q, kt, dim, vr, first, m, l, p, done, o); break;
      case 4: score_tile<4>(q, kt, dim, vr, first, m, l, p, done, o); break;
      case 5: score_tile<5>(q, kt, dim, vr, first, m, l, p, done, o); break;
      case 6: score_tile<6>(q, kt, dim, vr, first, m, l, p, done, o); break;
      case 7: score_tile<7>(q, kt, dim, vr, first, m, l, p, done, o); break;
      default: score_tile<8>(q, kt, dim, vr, first, m, l, p, done, o); break;
    }
  }
}

// keys: a tile's rows see no key past the last row's
template <int D>
void weight_rows(int rows, const Rows& w, const float* v, int64_t v_row, int dim) {
  if (D > 0) dim = D;
  for (int r = 0; r < rows; r += 4) {
    const int n = std::min(4, rows - r), keys = w.keys[r + n - 1];
    const float* p = w.p + r * kBlock;
    float* o = w.o + r * dim;
    switch (n) {
      case 1: weight_tile<1>(p, v, v_row, keys, o, dim); break;
      case 2: weight_tile<2>(p, v, v_row, keys, o, dim); break;
      case 3: weight_tile<3>(p, v, v_row, keys, o, dim); break;
      default: weight_tile<4>(p, v, v_row, keys, o, dim); break;
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
  int64_t padded(int b) const { return (keys(b) + kKeys - 1) / kKeys * kKeys; }
};

// K transposed per (sequence, kv head) and per 32 keys, zero past the sequence's end
std::vector<float> transposed_keys(const float* k, const Shape& s, std::vector<int64_t>& at,
                                   int threads) {
  at.assign(static_cast<size_t>(s.batch) * s.kv_heads + 1, 0);
  for (int bh = 0; bh < s.batch * s.kv_heads; bh++)
    at[bh + 1] = at[bh] + s.padded(bh / s.kv_heads) * s.dim;
  std::vector<float> kt(at.back());
  const int64_t tiles = at.back() / (kKeys * s.dim);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < tiles; n++) {  // n: (sequence, head) bh's tile n - at[bh] / (32 dim)
    const int bh = static_cast<int>(std::upper_bound(at.begin(), at.end(), n * kKeys * s.dim) -
                                    at.begin()) - 1;
    const int b = bh / s.kv_heads, h = bh % s.kv_heads;
    const int64_t j0 = n * kKeys - at[bh] / s.dim;
    float* dst = kt.data() + n * kKeys * s.dim;
    for (int64_t j = j0; j < j0 + kKeys; j++) {
      const float* src = k + (s.k_starts[b] + j) * s.kv_row + h * s.dim;
      for (int d = 0; d < s.dim; d++) dst[d * kKeys + j - j0] = j < s.keys(b) ? src[d] : 0.0f;
    }
  }
  return kt;
}

template <int D>
void attend_item(const float* q, const float* kt, const float* v, float* out, const Shape& s,
                 int b, int h, int r0, float log2_scale, Rows& w) {
  const int group = s.group(), dim = D > 0 ? D : s.dim;
  const int64_t base = s.q_starts[b];
  const int prefix = static_cast<int>(s.keys(b) - s.length(b));  // keys before the new tokens
  const int r1 = static_cast<int>(std::min<int64_t>(r0 + kPositions, s.length(b)));
  const int rows = (r1 - r0) * group;
  for (int t = r0, i = 0; t < r1; t++) {
    for (int g = 0; g < group; g++, i++) {
      const float* src = q + (base + t) * s.q_row + (h * group + g) * dim;
      for (int d = 0; d < dim; d++) w.q[i * dim + d] = src[d] * log2_scale;
      w.sees[i] = prefix + t + 1;
    }
  }
  std::fill(w.o, w.o + rows * dim, 0.0f);
  std::fill(w.l, w.l + rows * 16, 0.0f);
  std::fill(w.m, w.m + (rows + kTileRows - 1) / kTileRows * 16, 0.0f);
  const float* vh = v + s.k_starts[b] * s.kv_row + h * dim;
  const int last = prefix + r1;  // keys up to the item's last position
  for (int k0 = 0; k0 < last; k0 += kBlock) {
    for (int k = k0; k < std::min(k0 + kBlock, last); k += kKeys) {
      for (int i = 0; i < rows; i++) w.valid[i] = std::clamp(w.sees[i] - k, 0, kKeys);
      score_rows<D>(rows, w, kt + k * dim, dim, k == 0, k - k0);
    }
    for (int i = 0; i < rows; i++) w.keys[i] = std::clamp(w.sees[i] - k0, 0, kBlock);
    weight_rows<D>(rows, w, vh + k0 * s.kv_row, s.kv_row, dim);
  }
  for (int t = r0, i = 0; t < r1; t++) {
    for (int g = 0; g < group; g++, i++) {
      float* dst = out + ((base + t) * s.q_heads + h * group + g) * dim;
      const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(w.l + i * 16));
      for (int d = 0; d < dim; d++) dst[d] = w.o[i * dim + d] * inv;
    }
  }
}

// A decode row's attention: one query a q head, its keys and values read where the pool holds
// them (16-bit or float32 rows, never gathered or widened into a copy). A work item is (row, kv
// head): the group's scores s = q k log2 e scale, one pass over the keys; 2^(s - max) and their
// sum; then one pass over the values, 64 dims and 4 heads at a time in registers.
struct Pool {
  const void* k;
  const void* v;
  int kind;     // 0 float32, 1 bfloat16, 2 float16
  int64_t row;  // elements from one slot to the next
};

template <int kKind>
INLINE __m512 load_row(const void* base, int64_t at) {  // 16 elements as float32
  if (kKind == 0) return _mm512_loadu_ps(static_cast<const float*>(base) + at);
  const __m256i h = _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + at));
  if (kKind == 2) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The sums of 16 vectors' lanes, key t's at lane t: a transposing tree of adds (15 adds and 30
// shuffles, not 16 reductions of 8 ops each)
INLINE __m512 sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; i++)  // 256-bit halves: v[2i]'s in lanes 0..7, v[2i + 1]'s in 8..15
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; i++)  // 128-bit lanes: v[4i + j]'s in lane j
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; i++)  // pairs: in 128-bit lane j, v[8i + j]'s at 0-1, v[8i + 4 + j]'s at 2-3
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  // in 128-bit lane j: v[j], v[4 + j], v[8 + j], v[12 + j]
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),
                                 _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, d);
}

// Every 64-byte line of `kBytes` from p on its way to L1 (one prefetch fetches one line: a
// 16-bit row of 64 dims is two, of 128 four)
template <int kBytes>
INLINE void prefetch_row(const char* p) {
  for (int b = 0; b < kBytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// group x 16 scores (base 2, scaled) of keys t0 .. t0 + 15 (rows `at[i]`, those past `n` not read)
template <int kKind, int kDim>
INLINE void score_keys(const float* q, const void* k, const int64_t* at, int n, int group,
                       float log2_scale, float* s, int padded) {
  for (int g = 0; g < group; g++) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) {
      acc[i] = _mm512_setzero_ps();
      if (i >= n) continue;
      for (int d = 0; d < kDim; d += 16)
        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * kDim + d), load_row<kKind>(k, at[i] + d),
                                 acc[i]);
    }
    _mm512_storeu_ps(s + g * padded, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(log2_scale)));
  }
}

template <int kKind, int kDim>
void decode_item(const float* q, const Pool& pool, const int64_t* slots, int len, int h,
                 int group, float log2_scale, float* out, std::vector<float>& s) {
  constexpr int kItem = kKind ? 2 : 4;  // bytes of a pool element
  const int padded = (len + 15) / 16 * 16;
  s.resize(static_cast<size_t>(group) * padded + group);  // the scores, then their sums
  float* sums = s.data() + static_cast<size_t>(group) * padded;
  for (int t0 = 0; t0 < len; t0 += 16) {
    int64_t at[16];
    for (int i = 0; i < 16 && t0 + i < len; i++) {
      at[i] = slots[t0 + i] * pool.row + static_cast<int64_t>(h) * kDim;
      if (t0 + i + 32 < len)  // the key rows two tiles on, on their way from memory
        prefetch_row<kItem * kDim>(reinterpret_cast<const char*>(pool.k) +
                                   (slots[t0 + i + 32] * pool.row + h * kDim) * kItem);
    }
    score_keys<kKind, kDim>(q, pool.k, at, len - t0, group, log2_scale, s.data() + t0, padded);
  }
  for (int g = 0; g < group; g++) {  // 2^(s - max), the tail's lanes 0
    float* sg = s.data() + static_cast<size_t>(g) * padded;
    for (int t = len; t < padded; t++) sg[t] = -INFINITY;
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < padded; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sg + t));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 l = _mm512_setzero_ps();
    for (int t = 0; t < padded; t += 16) {
      const __m512 u = _mm512_sub_ps(_mm512_loadu_ps(sg + t), top);
      const __mmask16 live = t + 16 <= len ? 0xFFFF : (1u << (len - t)) - 1;
      const __m512 p = _mm512_maskz_mov_ps(live, exp2_finite(_mm512_maskz_mov_ps(live, u)));
      _mm512_storeu_ps(sg + t, p);
      l = _mm512_add_ps(l, p);
    }
    sums[g] = _mm512_reduce_add_ps(l);
  }
  for (int g0 = 0; g0 < group; g0 += 4) {
    const int n = std::min(4, group - g0);
    for (int c = 0; c < kDim; c += 64) {
      __m512 acc[4][4];
      for (int g = 0; g < 4; g++)
        for (int x = 0; x < 4; x++) acc[g][x] = _mm512_setzero_ps();
      for (int t = 0; t < len; t++) {
        const int64_t at = slots[t] * pool.row + static_cast<int64_t>(h) * kDim + c;
        if (t + 16 < len)  // this chunk of the value row 16 keys on
          prefetch_row<kItem * 64>(reinterpret_cast<const char*>(pool.v) +
                                   (slots[t + 16] * pool.row + h * kDim + c) * kItem);
        __m512 vt[4];
        for (int x = 0; x < 4; x++) vt[x] = load_row<kKind>(pool.v, at + 16 * x);
        for (int g = 0; g < n; g++) {
          const __m512 p = _mm512_set1_ps(s[(g0 + g) * padded + t]);
          for (int x = 0; x < 4; x++) acc[g][x] = _mm512_fmadd_ps(p, vt[x], acc[g][x]);
        }
      }
      for (int g = 0; g < n; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sums[g0 + g]);
        for (int x = 0; x < 4; x++)
          _mm512_storeu_ps(out + (g0 + g) * kDim + c + 16 * x, _mm512_mul_ps(acc[g][x], inv));
      }
    }
  }
}

using DecodeItem = void (*)(const float*, const Pool&, const int64_t*, int, int, int, float,
                            float*, std::vector<float>&);

template <int kKind>
DecodeItem decode_item_for(int dim) {
  return dim == 64 ? decode_item<kKind, 64> : dim == 128 ? decode_item<kKind, 128>
                                                         : decode_item<kKind, 256>;
}

}  // namespace

extern "C" {

// out [B, Hq, D] (contiguous) = softmax(scale q k^T) v for each decode row b over its first
// lens[b] slots (slots: row b at b * slot_stride, int64); q [B, Hq, D] contiguous float32; the
// pools' rows (kind 0 float32, 1 bfloat16, 2 float16) `row` elements apart, head h at h * D;
// D 64, 128 or 256. A row's bits depend on its own query, keys and values only.
void decode_attention(const float* q, const void* k, const void* v, int kind, int64_t row,
                      const int64_t* slots, int64_t slot_stride, const int64_t* lens, float* out,
                      int batch, int q_heads, int kv_heads, int dim, float scale, int threads) {
  const Pool pool = {k, v, kind, row};
  const int group = q_heads / kv_heads;
  const float log2_scale = scale * 1.4426950408889634f;
  const DecodeItem item = kind == 0   ? decode_item_for<0>(dim)
                          : kind == 1 ? decode_item_for<1>(dim)
                                      : decode_item_for<2>(dim);
#pragma omp parallel num_threads(threads)
  {
    thread_local std::vector<float> s;  // OpenMP's threads persist: no allocation a call
#pragma omp for schedule(dynamic, 1)
    for (int n = 0; n < batch * kv_heads; n++) {
      const int b = n / kv_heads, h = n % kv_heads;
      const int64_t at = (static_cast<int64_t>(b) * q_heads + h * group) * dim;
      item(q + at, pool, slots + b * slot_stride, static_cast<int>(lens[b]), h, group, log2_scale,
           out + at, s);
    }
  }
}

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
  std::vector<Item> items;  // head by head, the most keys first: dynamic scheduling ends evenly
  for (int b = 0; b < batch; b++)
    for (int r0 = 0; r0 < s.length(b); r0 += kPositions)
      for (int h = 0; h < kv_heads; h++) items.push_back({b, h, r0, s.keys(b) - s.length(b) + r0});
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) {
    return x.h != y.h ? x.h < y.h : x.keys > y.keys;
  });
  const float log2_scale = scale * 1.4426950408889634f;
  const auto attend = dim == 64 ? attend_item<64> : dim == 128 ? attend_item<128> : attend_item<0>;
#pragma omp parallel num_threads(threads)
  {
    Rows w(kPositions * s.group(), dim);
#pragma omp for schedule(dynamic, 1)
    for (size_t n = 0; n < items.size(); n++) {
      const Item& it = items[n];
      attend(q, kt.data() + kt_at[it.b * kv_heads + it.h], v, out, s, it.b, it.h, it.r0,
             log2_scale, w);
    }
  }
}

}  // extern "C"
