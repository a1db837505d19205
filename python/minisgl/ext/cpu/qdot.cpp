// minisgl's CPU kernel for GGUF-quantized projections at decode sizes (ext/cpu/native.py builds
// and loads it; ext/cpu/quantized.py's VnniLinear holds the weights).
//
// y = x W^T for a few rows x (bf16 or fp16) and a weight in blocks of 32 along the input:
//   four-bit codes q in 0..15:    w = d q + mn           (GGUF Q4_0: mn = -8 d; Q4_1: mn = its min)
//   eight-bit codes u in 0..255:  w = d (u - 128) + mn   (GGUF Q8_0: u = q + 128, mn = 0)
// d and mn are the file's fp16 values. Each row's block of 32 activations is quantized to int8
// as llama.cpp does (dx = max |x| / 127, xq = round(x / dx)), so a block's dot product is an
// integer one on AVX512-VNNI (vpdpbusd: 64 multiply-adds an instruction, 4x float32 FMA's
// rate on the CPUs measured), scaled once a block:
//   y += d dx sum(q xq) + mn sum(x)          (eight-bit: d dx (sum(u xq) - 128 sum(xq)))
// sum(x) is the float sum of the activations themselves, not of their codes.
//
// Layout, per tile of 16 output rows t and block g (ext/cpu/quantized.py builds it):
//   four-bit: 4 chunks of 64 bytes; in chunk c, lane j (output 16t+j) byte b holds
//     q[k = 32g+8c+b] in its low nibble and q[k = 32g+8c+4+b] in its high nibble;
//   eight-bit: 8 chunks of 64 bytes; in chunk c, lane j byte b holds u[k = 32g+4c+b];
//   scales: fp16 d[16] then fp16 mn[16].
// One thread computes a tile's outputs for every row in a fixed order: the same bits on any
// thread count, and a row's bits do not depend on the other rows of its batch.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace {

constexpr int kBlock = 32;
constexpr int kTile = 16;
constexpr int kMaxRows = 8;  // rows a tile's pass holds in registers

struct Rows {           // the activations, quantized: per row m and block g
  const int8_t* xq;     // [M][K]
  const float* dx;      // [M][K / 32]
  const float* xsum;    // [M][K / 32]
  const int32_t* qsum;  // [M][K / 32]
};

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
      xsum[m * blocks + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
      qsum[m * blocks + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
  }
}

// `kRows` rows of x against output tile t: the codes of each block are unpacked once for all rows
template <int kRows, bool kFour>
void tile_rows(const Rows& x, int cols, const uint8_t* codes, const uint16_t* scales, bool half,
               uint16_t* y, int out, int t) {
  const int blocks = cols / kBlock;
  const int block_bytes = kFour ? 256 : 512;
  const uint8_t* c = codes + static_cast<size_t>(t) * blocks * block_bytes;
  const uint16_t* s = scales + static_cast<size_t>(t) * blocks * 2 * kTile;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[kRows];
  for (int m = 0; m < kRows; m++) acc[m] = _mm512_setzero_ps();
  for (int g = 0; g < blocks; g++) {
    __m512i w[8];  // chunk i holds k = 32g + 4i .. 32g + 4i + 3 of the 16 outputs
    for (int i = 0; i < (kFour ? 4 : 8); i++) {
      __m512i v = _mm512_loadu_si512(c + g * block_bytes + i * 64);
      if (kFour) {
        w[2 * i] = _mm512_and_si512(v, nibble);
        w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      } else {
        w[i] = v;
      }
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + g * 32)));
    __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + g * 32 + 16)));
    for (int m = 0; m < kRows; m++) {
      const size_t at = static_cast<size_t>(m) * blocks + g;
      int32_t quad[8];  // the row's codes of the block, 4 a lane
      memcpy(quad, x.xq + static_cast<size_t>(m) * cols + g * kBlock, sizeof quad);
      __m512i dot = _mm512_setzero_si512();
      for (int i = 0; i < 8; i++) dot = _mm512_dpbusd_epi32(dot, w[i], _mm512_set1_epi32(quad[i]));
      if (!kFour) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * x.qsum[at]));
      __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x.dx[at]));
      acc[m] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc[m]);
      acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.xsum[at]), acc[m]);
    }
  }
  for (int m = 0; m < kRows; m++) store16(y + static_cast<size_t>(m) * out + kTile * t, acc[m], half);
}

template <bool kFour>
void tile(const Rows& x, int rows, int cols, const uint8_t* codes, const uint16_t* scales,
          bool half, uint16_t* y, int out, int t) {
  const int blocks = cols / kBlock;
  for (int m = 0; m < rows; m += kMaxRows) {
    const Rows part = {x.xq + static_cast<size_t>(m) * cols, x.dx + m * blocks,
                       x.xsum + m * blocks, x.qsum + m * blocks};
    uint16_t* dst = y + static_cast<size_t>(m) * out;
    switch (rows - m < kMaxRows ? rows - m : kMaxRows) {
      case 1: tile_rows<1, kFour>(part, cols, codes, scales, half, dst, out, t); break;
      case 2: tile_rows<2, kFour>(part, cols, codes, scales, half, dst, out, t); break;
      case 3: tile_rows<3, kFour>(part, cols, codes, scales, half, dst, out, t); break;
      case 4: tile_rows<4, kFour>(part, cols, codes, scales, half, dst, out, t); break;
      case 5: tile_rows<5, kFour>(part, cols, codes, scales, half, dst, out, t); break;
      case 6: tile_rows<6, kFour>(part, cols, codes, scales, half, dst, out, t); break;
      case 7: tile_rows<7, kFour>(part, cols, codes, scales, half, dst, out, t); break;
      default: tile_rows<8, kFour>(part, cols, codes, scales, half, dst, out, t); break;
    }
  }
}

}  // namespace

extern "C" {

// 1 where this CPU runs the kernel (the build targets these extensions explicitly)
int qdot_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

// y [rows][out] = x [rows][cols] W^T; x and y bf16 (half = 0) or fp16 (half = 1), contiguous;
// cols a multiple of 32, out of 16; bits 4 or 8 (the layout above); threads: OpenMP's count
void qdot_mm(const uint16_t* x, int rows, int cols, const uint8_t* codes, const uint16_t* scales,
             int bits, int half, uint16_t* y, int out, int threads) {
  const int blocks = cols / kBlock;
  thread_local std::vector<char> work;
  work.resize(static_cast<size_t>(rows) * (cols + 12 * blocks));
  int8_t* xq = reinterpret_cast<int8_t*>(work.data());
  float* dx = reinterpret_cast<float*>(xq + static_cast<size_t>(rows) * cols);
  float* xsum = dx + rows * blocks;
  int32_t* qsum = reinterpret_cast<int32_t*>(xsum + rows * blocks);
  quantize_rows(x, rows, cols, half, xq, dx, xsum, qsum);
  const Rows quantized = {xq, dx, xsum, qsum};
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int t = 0; t < out / kTile; t++) {
    if (bits == 4) {
      tile<true>(quantized, rows, cols, codes, scales, half, y, out, t);
    } else {
      tile<false>(quantized, rows, cols, codes, scales, half, y, out, t);
    }
  }
}

}  // extern "C"
