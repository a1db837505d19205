// minisgl's CPU kernel for GGUF-quantized projections at decode sizes (ext/cpu/native.py builds
// and loads it; ext/cpu/quantized.py's VnniLinear holds the weights).
//
// y = x W^T for a few rows x (bf16 or fp16) and a weight in blocks of 32 along the input:
//   four-bit codes q in 0..15:    w = d q + mn, or d (q - 8) without mn  (GGUF Q4_1; Q4_0)
//   eight-bit codes u in 0..255:  w = d (u - 128) + mn   (GGUF Q8_0: u = q + 128, mn = 0)
//   six-bit codes u in 0..63, a d for each 16:  w = d_h (u - 32) + mn, h the block's half
//                                 (GGUF Q6_K: u = q, d_h = d sc_h, mn = 0; Q4_K: u = q + 32)
// d and mn are the file's fp16 values. Each row's block of 32 activations is quantized to int8
// as llama.cpp does (dx = max |x| / 127, xq = round(x / dx)), so a block's dot product is an
// integer one on AVX512-VNNI (vpdpbusd: 64 multiply-adds an instruction, 4x float32 FMA's
// rate on the CPUs measured) or, built without AVX512's flags (native.py: CPUs without it, such
// as most laptops'), on AVX-VNNI (vpdpbusd on 8 lanes) or AVX2 (vpmaddubsw, vpmaddwd), scaled
// once a block:
//   y += d dx sum(q xq) + mn sum(x)          (eight-bit: d dx (sum(u xq) - 128 sum(xq)); four-bit
//                                             without mn: d dx (sum(q xq) - 8 sum(xq)))
//   (six-bit: d_0 dx (sum(u xq) - 32 sum(xq))_0 + d_1 dx (...)_1 + mn sum(x), by halves)
// sum(x) is the float sum of the activations themselves, not of their codes.
//
// Layout, per tile of 16 output rows t and block g (ext/cpu/quantized.py builds it):
//   four-bit: 4 chunks of 64 bytes; in chunk c, lane j (output 16t+j) byte b holds
//     q[k = 32g+8c+b] in its low nibble and q[k = 32g+8c+4+b] in its high nibble;
//   eight-bit: 8 chunks of 64 bytes; in chunk c, lane j byte b holds u[k = 32g+4c+b];
//   six-bit: the four-bit layout of u's low 4 bits, then 2 chunks of 64 bytes of their top 2:
//     in chunk h, lane j byte b bits 2s, 2s+1 hold those of u[k = 32g+4(4h+s)+b] (s 0..3);
//   scales: fp16 d[16] then fp16 mn[16]; six-bit: d_0[16], d_1[16] (weights 0-15, 16-31 of
//     the block: chunks 0-3, 4-7 of the eight-bit layout), mn[16]. Codes whose mn are all 0,
//     or -8 d at four bits (Q6_K, Q8_0, Q4_0), may go without the mn row (`min` 0: half a bit
//     a weight fewer to read).
//   or the K-quants' scales (`super` 1; Q4_K, Q5_K, Q6_K): per 8 blocks (256 weights) a head of
//     fp16 rows D[16] (and M[16] with mn), then each block's int8 rows sc[16] (six-bit: sc_0,
//     sc_1) (and m[16] with mn); d = D sc, mn = M m, exact in float32 (the file's own products;
//     Q4_K: 4 + 5/8 bits a weight against the fp16 rows' 5).
// One thread computes a tile's outputs for every row in a fixed order: the same bits on any
// thread count, and a row's bits do not depend on the other rows of its batch. All builds
// compute the same integers and the same float operations in the same order: the same bits.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int kBlock = 32;
constexpr int kTile = 16;
#ifdef __AVX512VNNI__
constexpr int kMaxRows = 8;  // rows a tile's pass holds in registers
#else
constexpr int kMaxRows = 4;  // AVX2 has 16 vector registers: half a tile's codes and 4 sums
#endif

struct Rows {           // the activations, quantized: per row m and block g
  const int8_t* xq;     // [M][K]
  const float* dx;      // [M][K / 32]
  const float* xsum;    // [M][K / 32]
  const int32_t* qsum;  // [M][K / 16]: the codes' sums of each half block
};

// the kernel's layouts of codes and scales (`bits` of qdot_mm)
constexpr int kFourBit = 4, kSixBit = 6, kEightBit = 8;
constexpr int code_bytes(int bits) { return bits * 64; }
constexpr int scale_halves(int bits, bool min) {  // a tile's scales of one block
  return (bits == kSixBit ? 32 : 16) + (min ? 16 : 0);
}
// the codes' offset, taken off through the activation codes' sums (four-bit: only without mn)
constexpr int code_offset(int bits, bool min) {
  return bits == kSixBit ? 32 : bits == kEightBit ? 128 : min ? 0 : 8;
}
// the K-quants' scales (`super`): a head of fp16 rows per 8 blocks, int8 rows per block
constexpr int kSuperBlocks = 8;
constexpr int super_head_bytes(bool min) { return min ? 64 : 32; }
constexpr int super_block_bytes(int bits, bool min) {
  return 16 * ((bits == kSixBit ? 2 : 1) + (min ? 1 : 0));
}
constexpr int super_bytes(int bits, bool min) {
  return super_head_bytes(min) + kSuperBlocks * super_block_bytes(bits, min);
}
// a tile's scale bytes over `blocks` blocks
template <int kBits, bool kMin, bool kSuper>
constexpr size_t tile_scale_bytes(int blocks) {
  return kSuper ? static_cast<size_t>(blocks / kSuperBlocks) * super_bytes(kBits, kMin)
                : static_cast<size_t>(blocks) * scale_halves(kBits, kMin) * 2;
}
// block g's scale rows: (its fp16 d row, or the head's D; its int8 sc row or null)
struct ScaleRows {
  const uint16_t* d;  // fp16 [16]: d (then d_1 16 halves on, at six bits), or D
  const uint16_t* mn;  // fp16 [16]: mn, or M (read with kMin)
  const int8_t* sc;    // int8 [16]: sc (then sc_1), then m; null without kSuper
};
template <int kBits, bool kMin, bool kSuper>
inline ScaleRows scale_rows(const uint8_t* s, int g) {
  if (!kSuper) {
    const uint16_t* sg = reinterpret_cast<const uint16_t*>(s) + g * scale_halves(kBits, kMin);
    return {sg, sg + scale_halves(kBits, kMin) - 16, nullptr};
  }
  const uint8_t* head = s + static_cast<size_t>(g / kSuperBlocks) * super_bytes(kBits, kMin);
  const uint8_t* sub = head + super_head_bytes(kMin) +
                       (g % kSuperBlocks) * super_block_bytes(kBits, kMin);
  const uint16_t* d = reinterpret_cast<const uint16_t*>(head);
  return {d, d + 16, reinterpret_cast<const int8_t*>(sub)};
}

// the sum of 8 floats in the order of GCC's _mm512_reduce_add_ps after its first halving,
// spelled out so that both builds (and other compilers) sum a block's activations alike
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  s = _mm_add_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(s) + _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
}

#ifdef __AVX512VNNI__

inline __m512 load16(const uint16_t* p, bool half) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (half) return _mm512_cvtph_ps(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline void store16(uint16_t* p, __m512 v, bool half) {
  __m256i out;
  if (half) {
    out = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {  // round to nearest even, as torch's float -> bfloat16 (inputs are finite)
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    out = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), out);
}

void quantize_rows(const uint16_t* x, int rows, int cols, bool half, int8_t* xq, float* dx,
                   float* xsum, int32_t* qsum) {
  const int blocks = cols / kBlock;
  for (int m = 0; m < rows; m++) {
    for (int g = 0; g < blocks; g++) {
      const size_t at = static_cast<size_t>(m) * cols + g * kBlock;
      __m512 a = load16(x + at, half), b = load16(x + at + 16, half);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
      __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  // nearest even
      __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + at), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + at + 16), _mm512_cvtepi32_epi8(qb));
      dx[m * blocks + g] = amax / 127.0f;
      const __m512 ab = _mm512_add_ps(a, b);
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ab), 1));
      xsum[m * blocks + g] = sum8(_mm256_add_ps(hi, _mm512_castps512_ps256(ab)));
      qsum[2 * (m * blocks + g)] = _mm512_reduce_add_epi32(qa);
      qsum[2 * (m * blocks + g) + 1] = _mm512_reduce_add_epi32(qb);
    }
  }
}

// `kRows` rows of x against output tile t: the codes of each block are unpacked once for all rows
inline __m512 int8x16(const int8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

// block g's d (d_hi: of weights 16-31 at six bits, else d) and mn for the tile's 16 outputs;
// with kSuper the head's D and M, loaded at each 8 blocks' first
template <int kBits, bool kMin, bool kSuper>
inline void block_scales(const uint8_t* s, int g, __m512& big_d, __m512& big_m, __m512& d,
                         __m512& d_hi, __m512& mn) {
  const ScaleRows r = scale_rows<kBits, kMin, kSuper>(s, g);
  constexpr int kDRows = kBits == kSixBit ? 2 : 1;
  if (kSuper) {
    if (g % kSuperBlocks == 0) {
      big_d = load16(r.d, true);
      big_m = kMin ? load16(r.mn, true) : big_d;
    }
    d = _mm512_mul_ps(big_d, int8x16(r.sc));
    d_hi = kBits == kSixBit ? _mm512_mul_ps(big_d, int8x16(r.sc + 16)) : d;
    mn = kMin ? _mm512_mul_ps(big_m, int8x16(r.sc + 16 * kDRows)) : _mm512_setzero_ps();
  } else {
    d = load16(r.d, true);
    d_hi = kBits == kSixBit ? load16(r.d + 16, true) : d;
    mn = kMin ? load16(r.mn, true) : _mm512_setzero_ps();
  }
}

template <int kRows, int kBits, bool kMin, bool kSuper>
void tile_rows(const Rows& x, int cols, const uint8_t* codes, const uint8_t* scales, bool half,
               uint16_t* y, int out, int t) {
  constexpr int kOffset = code_offset(kBits, kMin);
  const int blocks = cols / kBlock;
  const uint8_t* c = codes + static_cast<size_t>(t) * blocks * code_bytes(kBits);
  const uint8_t* s = scales + t * tile_scale_bytes<kBits, kMin, kSuper>(blocks);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[kRows];
  for (int m = 0; m < kRows; m++) acc[m] = _mm512_setzero_ps();
  __m512 big_d = _mm512_setzero_ps(), big_m = big_d;  // kSuper's head
  for (int g = 0; g < blocks; g++) {
    __m512i w[8];  // chunk i holds k = 32g + 4i .. 32g + 4i + 3 of the 16 outputs
    const uint8_t* cg = c + g * code_bytes(kBits);
    for (int i = 0; i < (kBits == kEightBit ? 8 : 4); i++) {
      __m512i v = _mm512_loadu_si512(cg + i * 64);
      if (kBits == kEightBit) {
        w[i] = v;
      } else {
        w[2 * i] = _mm512_and_si512(v, nibble);
        w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
    }
    if (kBits == kSixBit) {  // the top two bits: (top >> 2s) & 3, moved up to bits 4-5
      const __m512i three = _mm512_set1_epi8(3);
      for (int h = 0; h < 2; h++) {
        const __m512i top = _mm512_loadu_si512(cg + 256 + h * 64);
        for (int k = 0; k < 4; k++) {
          const __m512i bits = _mm512_and_si512(_mm512_srli_epi16(top, 2 * k), three);
          w[4 * h + k] = _mm512_or_si512(w[4 * h + k], _mm512_slli_epi16(bits, 4));
        }
      }
    }
    __m512 d, d_hi, mn;
    block_scales<kBits, kMin, kSuper>(s, g, big_d, big_m, d, d_hi, mn);
    for (int m = 0; m < kRows; m++) {
      const size_t at = static_cast<size_t>(m) * blocks + g;
      int32_t quad[8];  // the row's codes of the block, 4 a lane
      memcpy(quad, x.xq + static_cast<size_t>(m) * cols + g * kBlock, sizeof quad);
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();  // the halves' dots
      for (int i = 0; i < 4; i++) lo = _mm512_dpbusd_epi32(lo, w[i], _mm512_set1_epi32(quad[i]));
      for (int i = 4; i < 8; i++) hi = _mm512_dpbusd_epi32(hi, w[i], _mm512_set1_epi32(quad[i]));
      const __m512 dx = _mm512_set1_ps(x.dx[at]);
      if (kBits == kSixBit) {
        lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(kOffset * x.qsum[2 * at]));
        hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(kOffset * x.qsum[2 * at + 1]));
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(lo), acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d_hi, dx), _mm512_cvtepi32_ps(hi), acc[m]);
      } else {
        __m512i dot = _mm512_add_epi32(lo, hi);
        const int32_t qsum = x.qsum[2 * at] + x.qsum[2 * at + 1];
        if (kOffset) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(kOffset * qsum));
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(dot), acc[m]);
      }
      if (kMin) acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.xsum[at]), acc[m]);
    }
  }
  for (int m = 0; m < kRows; m++) store16(y + static_cast<size_t>(m) * out + kTile * t, acc[m], half);
}

#else  // AVX2 (AVX-VNNI in its build), FMA, F16C: 8 lanes, a tile's 16 outputs in two halves

inline __m256 load8(const uint16_t* p, bool half) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (half) return _mm256_cvtph_ps(v);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline void store8(uint16_t* p, __m256 v, bool half) {
  __m128i out;
  if (half) {
    out = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {  // round to nearest even, as store16
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    u = _mm256_srli_epi32(u, 16);
    out = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), out);
}

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)));
}

inline int32_t isum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(s) + _mm_extract_epi32(s, 1);
}

void quantize_rows(const uint16_t* x, int rows, int cols, bool half, int8_t* xq, float* dx,
                   float* xsum, int32_t* qsum) {
  const int blocks = cols / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lanes
  for (int m = 0; m < rows; m++) {
    for (int g = 0; g < blocks; g++) {
      const size_t at = static_cast<size_t>(m) * cols + g * kBlock;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; i++) {
        v[i] = load8(x + at + 8 * i, half);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      }
      const float top = max8(amax);
      const __m256 inv = _mm256_set1_ps(top > 0 ? 127.0f / top : 0.0f);
      __m256i q[4];
      for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                         _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + at),
                          _mm256_permutevar8x32_epi32(bytes, order));
      dx[m * blocks + g] = top / 127.0f;
      // AVX512's order: lanes i and 16 + i first, then the upper 8 sums and the lower 8
      xsum[m * blocks + g] =
          sum8(_mm256_add_ps(_mm256_add_ps(v[1], v[3]), _mm256_add_ps(v[0], v[2])));
      qsum[2 * (m * blocks + g)] = isum8(_mm256_add_epi32(q[0], q[1]));
      qsum[2 * (m * blocks + g) + 1] = isum8(_mm256_add_epi32(q[2], q[3]));
    }
  }
}

// sum(w xq) of `kChunks` chunks of a block (all 8, or a half's 4) for 8 outputs, less the
// codes' offset `kOffset` (code_offset) times `qsum` (the sum of the chunks' xq). With AVX-VNNI
// (vpdpbusd on 8 lanes) as on AVX512; on AVX2 alone four-bit codes as they are (pairs of at
// most 2 x 15 x 127, and 8 chunks of them, fit int16), six-bit ones so a chunk at a time (pairs
// of at most 2 x 63 x 127), eight-bit ones as u - 128 with its sign moved onto xq (pairs of at
// most 2 x 128 x 127); each chunk but four-bit ones widened to int32 at once
template <int kBits, int kChunks, int kOffset>
inline __m256i block_dot(const __m256i* w, const int32_t* quad, int32_t qsum) {
  __m256i dot = _mm256_setzero_si256();
#ifdef __AVXVNNI__
  for (int i = 0; i < kChunks; i++)
    dot = _mm256_dpbusd_avx_epi32(dot, w[i], _mm256_set1_epi32(quad[i]));
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if (kBits == kFourBit) {
    __m256i sum = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(quad[0]));
    for (int i = 1; i < kChunks; i++)
      sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(quad[i])));
    dot = _mm256_madd_epi16(sum, ones);
  }
  for (int i = 0; kBits != kFourBit && i < kChunks; i++) {
    __m256i pairs;
    if (kBits == kSixBit) {
      pairs = _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(quad[i]));
    } else {
      const __m256i q = _mm256_xor_si256(w[i], _mm256_set1_epi8(-128));  // u - 128 as int8
      const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(quad[i]), q);
      pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), signed_x);
    }
    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
  }
  if (kBits == kEightBit) return dot;  // its pairs are of u - 128 already
#endif
  if (kOffset) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(kOffset * qsum));
  return dot;
}

// `kRows` rows of x against output tile t, one half (8 outputs) at a time; each half's pass
// reads its 32 bytes of every 64-byte chunk (the second pass from cache)
inline __m256 half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 int8x8(const int8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

// half h of block g's d, d_hi and mn (as block_scales on AVX512, 8 outputs)
template <int kBits, bool kMin, bool kSuper>
inline void block_scales(const uint8_t* s, int g, int h, __m256& big_d, __m256& big_m, __m256& d,
                         __m256& d_hi, __m256& mn) {
  const ScaleRows r = scale_rows<kBits, kMin, kSuper>(s, g);
  constexpr int kDRows = kBits == kSixBit ? 2 : 1;
  if (kSuper) {
    if (g % kSuperBlocks == 0) {
      big_d = half8(r.d + 8 * h);
      big_m = kMin ? half8(r.mn + 8 * h) : big_d;
    }
    d = _mm256_mul_ps(big_d, int8x8(r.sc + 8 * h));
    d_hi = kBits == kSixBit ? _mm256_mul_ps(big_d, int8x8(r.sc + 16 + 8 * h)) : d;
    mn = kMin ? _mm256_mul_ps(big_m, int8x8(r.sc + 16 * kDRows + 8 * h)) : _mm256_setzero_ps();
  } else {
    d = half8(r.d + 8 * h);
    d_hi = kBits == kSixBit ? half8(r.d + 16 + 8 * h) : d;
    mn = kMin ? half8(r.mn + 8 * h) : _mm256_setzero_ps();
  }
}

template <int kRows, int kBits, bool kMin, bool kSuper>
void tile_rows(const Rows& x, int cols, const uint8_t* codes, const uint8_t* scales, bool half,
               uint16_t* y, int out, int t) {
  constexpr int kOffset = code_offset(kBits, kMin);
  const int blocks = cols / kBlock;
  const uint8_t* c = codes + static_cast<size_t>(t) * blocks * code_bytes(kBits);
  const uint8_t* s = scales + t * tile_scale_bytes<kBits, kMin, kSuper>(blocks);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; h++) {
    __m256 acc[kRows];
    for (int m = 0; m < kRows; m++) acc[m] = _mm256_setzero_ps();
    __m256 big_d = _mm256_setzero_ps(), big_m = big_d;  // kSuper's head
    for (int g = 0; g < blocks; g++) {
      __m256i w[8];  // as tile_rows' chunks above, this half's 8 outputs
      const uint8_t* cg = c + g * code_bytes(kBits) + h * 32;
      for (int i = 0; i < (kBits == kEightBit ? 8 : 4); i++) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + i * 64));
        if (kBits == kEightBit) {
          w[i] = v;
        } else {
          w[2 * i] = _mm256_and_si256(v, nibble);
          w[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        }
      }
      if (kBits == kSixBit) {  // the top two bits, as on AVX512
        const __m256i three = _mm256_set1_epi8(3);
        for (int e = 0; e < 2; e++) {
          const __m256i top =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + 256 + e * 64));
          for (int k = 0; k < 4; k++) {
            const __m256i bits = _mm256_and_si256(_mm256_srli_epi16(top, 2 * k), three);
            w[4 * e + k] = _mm256_or_si256(w[4 * e + k], _mm256_slli_epi16(bits, 4));
          }
        }
      }
      __m256 d, d_hi, mn;
      block_scales<kBits, kMin, kSuper>(s, g, h, big_d, big_m, d, d_hi, mn);
      for (int m = 0; m < kRows; m++) {
        const size_t at = static_cast<size_t>(m) * blocks + g;
        int32_t quad[8];  // the row's codes of the block, 4 a lane
        memcpy(quad, x.xq + static_cast<size_t>(m) * cols + g * kBlock, sizeof quad);
        const __m256 dx = _mm256_set1_ps(x.dx[at]);
        if (kBits == kSixBit) {
          const __m256i lo = block_dot<kBits, 4, kOffset>(w, quad, x.qsum[2 * at]);
          const __m256i hi = block_dot<kBits, 4, kOffset>(w + 4, quad + 4, x.qsum[2 * at + 1]);
          acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(lo), acc[m]);
          acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d_hi, dx), _mm256_cvtepi32_ps(hi), acc[m]);
        } else {
          const int32_t qsum = x.qsum[2 * at] + x.qsum[2 * at + 1];
          const __m256i dot = block_dot<kBits, 8, kOffset>(w, quad, qsum);
          acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(dot), acc[m]);
        }
        if (kMin) acc[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x.xsum[at]), acc[m]);
      }
    }
    for (int m = 0; m < kRows; m++)
      store8(y + static_cast<size_t>(m) * out + kTile * t + 8 * h, acc[m], half);
  }
}

#endif

template <int kBits, bool kMin, bool kSuper>
void tile(const Rows& x, int rows, int cols, const uint8_t* codes, const uint8_t* scales,
          bool half, uint16_t* y, int out, int t) {
  const int blocks = cols / kBlock;
  for (int m = 0; m < rows; m += kMaxRows) {
    const Rows part = {x.xq + static_cast<size_t>(m) * cols, x.dx + m * blocks,
                       x.xsum + m * blocks, x.qsum + 2 * m * blocks};
    uint16_t* dst = y + static_cast<size_t>(m) * out;
    using Pass = void (*)(const Rows&, int, const uint8_t*, const uint8_t*, bool, uint16_t*, int,
                          int);
    static constexpr Pass kPasses[] = {
        tile_rows<1, kBits, kMin, kSuper>, tile_rows<2, kBits, kMin, kSuper>,
        tile_rows<3, kBits, kMin, kSuper>, tile_rows<4, kBits, kMin, kSuper>,
        tile_rows<5, kBits, kMin, kSuper>, tile_rows<6, kBits, kMin, kSuper>,
        tile_rows<7, kBits, kMin, kSuper>, tile_rows<8, kBits, kMin, kSuper>};
    kPasses[std::min(rows - m, kMaxRows) - 1](part, cols, codes, scales, half, dst, out, t);
  }
}

// one tile in the layout that bits, min and kSuper name
template <bool kSuper>
void tile_of(int bits, bool min, const Rows& x, int rows, int cols, const uint8_t* codes,
             const uint8_t* scales, bool half, uint16_t* y, int out, int t) {
  if (bits == kFourBit && min) {
    tile<kFourBit, true, kSuper>(x, rows, cols, codes, scales, half, y, out, t);
  } else if (bits == kFourBit) {
    tile<kFourBit, false, kSuper>(x, rows, cols, codes, scales, half, y, out, t);
  } else if (bits == kSixBit && min) {
    tile<kSixBit, true, kSuper>(x, rows, cols, codes, scales, half, y, out, t);
  } else if (bits == kSixBit) {
    tile<kSixBit, false, kSuper>(x, rows, cols, codes, scales, half, y, out, t);
  } else if (min) {
    tile<kEightBit, true, kSuper>(x, rows, cols, codes, scales, half, y, out, t);
  } else {
    tile<kEightBit, false, kSuper>(x, rows, cols, codes, scales, half, y, out, t);
  }
}

}  // namespace

extern "C" {

// 1 where this CPU runs the kernel (the build targets these extensions explicitly)
int qdot_supported() {
  __builtin_cpu_init();
#ifdef __AVX512VNNI__
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  bool vnni = true;
#ifdef __AVXVNNI__
  vnni = __builtin_cpu_supports("avxvnni");
#endif
  return vnni && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#endif
}

// y [rows][out] = x [rows][cols] W^T; x and y bf16 (half = 0) or fp16 (half = 1), contiguous;
// cols a multiple of 32 (of 256 with super), out of 16; bits 4, 6 or 8 (the layouts above), min
// 1 where the scales have the mn rows, super 1 for the K-quants' scales; threads: OpenMP's count
void qdot_mm(const uint16_t* x, int rows, int cols, const uint8_t* codes, const uint8_t* scales,
             int bits, int min, int super, int half, uint16_t* y, int out, int threads) {
  const int blocks = cols / kBlock;
  thread_local std::vector<char> work;
  work.resize(static_cast<size_t>(rows) * (cols + 16 * blocks));
  int8_t* xq = reinterpret_cast<int8_t*>(work.data());
  float* dx = reinterpret_cast<float*>(xq + static_cast<size_t>(rows) * cols);
  float* xsum = dx + rows * blocks;
  int32_t* qsum = reinterpret_cast<int32_t*>(xsum + rows * blocks);
  quantize_rows(x, rows, cols, half, xq, dx, xsum, qsum);
  const Rows quantized = {xq, dx, xsum, qsum};
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int t = 0; t < out / kTile; t++) {
    if (super) {
      tile_of<true>(bits, min, quantized, rows, cols, codes, scales, half, y, out, t);
    } else {
      tile_of<false>(bits, min, quantized, rows, cols, codes, scales, half, y, out, t);
    }
  }
}

}  // extern "C"
