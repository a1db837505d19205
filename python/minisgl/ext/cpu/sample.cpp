// Gumbel-max sampling in one pass over each row of logits (ext/cpu/native.py builds it, the
// torch.ops.minisgl.gumbel_argmax op calls it; ext/cpu/sampling.py hands it to the engine's
// `sample`): the torch path (engine/sample.py) makes [B, V] tensors in ~20 passes (the counter
// hash in int32, the uniforms, two logs, the subtraction, two argmaxes): 0.25 ms a row of 49,152
// logits on 2 cores, 1 ms at 8 rows. Here each 16 logits are scored in registers.
//   The noise is the torch path's bit for bit (the same uint32 counter hash of seed, step and
//   token id, the same uniforms); the two logs are log_ps below (within 2 ulp; torch's Sleef
//   within 1), so a draw is the torch path's up to float rounding: two scores within a few
//   ulp may order differently. Rows at temperature <= 0 take the argmax of the logits.
// Ties keep the first token, as torch's argmax. Work is split into fixed chunks of a row, so
// the result does not depend on the thread count.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

namespace {

constexpr int64_t kChunk = 8192;  // tokens a task

inline uint32_t hash32(uint32_t x) {
  for (int i = 0; i < 3; i++) x = ((x >> 16) ^ x) * 0x45D9F3Bu;
  return (x >> 16) ^ x;
}

inline __m512i hash32_ps(__m512i x) {
  const __m512i mult = _mm512_set1_epi32(0x45D9F3B);
  for (int i = 0; i < 3; i++) {
    x = _mm512_mullo_epi32(_mm512_xor_si512(_mm512_srli_epi32(x, 16), x), mult);
  }
  return _mm512_xor_si512(_mm512_srli_epi32(x, 16), x);
}

// log x for positive normal x within 2 ulp: x = 2^e m with m in [sqrt(1/2), sqrt(2)), log m =
// 2 atanh(f) for f = (m - 1) / (m + 1), |f| <= 0.172, by its series to f^9 (the next term is
// below 1e-9 of log m)
inline __m512 log_ps(__m512 x) {
  __m512 e = _mm512_getexp_ps(x);
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __mmask16 high = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, high, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, high, e, _mm512_set1_ps(1.0f));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 f = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one));
  const __m512 f2 = _mm512_mul_ps(f, f);
  __m512 p = _mm512_set1_ps(2.0f / 9);
  p = _mm512_fmadd_ps(p, f2, _mm512_set1_ps(2.0f / 7));
  p = _mm512_fmadd_ps(p, f2, _mm512_set1_ps(2.0f / 5));
  p = _mm512_fmadd_ps(p, f2, _mm512_set1_ps(2.0f / 3));
  p = _mm512_fmadd_ps(p, f2, _mm512_set1_ps(2.0f));
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693147181f), _mm512_mul_ps(p, f));
}

// 16 logits as float32 from float32 (0), bfloat16 (1) or float16 (2); lanes past m are -inf
inline __m512 load_logits(const void* row, int64_t v, __mmask16 m, int dtype) {
  __m512 x;
  if (dtype == 0) {
    x = _mm512_maskz_loadu_ps(m, static_cast<const float*>(row) + v);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + v);
    x = dtype == 2 ? _mm512_cvtph_ps(h)
                   : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), x);
}

struct Best {
  float value;
  int64_t index;
};

// the best (score, token) of tokens [begin, end) of one row: the first of equal scores
Best best_of(const void* row, int dtype, int64_t begin, int64_t end, float temperature,
             uint32_t row_key) {
  const bool draw = temperature > 0;
  const __m512 temp = _mm512_set1_ps(draw ? temperature : 1.0f);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_at = _mm512_set1_epi32(static_cast<int>(begin));
  for (int64_t v = begin; v < end; v += 16) {
    const __mmask16 m = end - v >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (end - v)) - 1);
    const __m512i token = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(v)), lanes);
    __m512 score = load_logits(row, v, m, dtype);
    if (draw) {
      const __m512i key = _mm512_mullo_epi32(token, _mm512_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
      const __m512i bits = hash32_ps(_mm512_xor_si512(_mm512_set1_epi32(static_cast<int>(row_key)), key));
      const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bits, 9)),
                                                   _mm512_set1_ps(0.5f)), _mm512_set1_ps(1.0f / 8388608));
      const __m512 gumbel = log_ps(_mm512_sub_ps(_mm512_setzero_ps(), log_ps(u)));
      score = _mm512_mask_blend_ps(m, score, _mm512_sub_ps(_mm512_div_ps(score, temp), gumbel));
    }
    const __mmask16 better = _mm512_cmp_ps_mask(score, best, _CMP_GT_OQ);
    best = _mm512_mask_blend_ps(better, best, score);
    best_at = _mm512_mask_blend_epi32(better, best_at, token);
  }
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  const int first = _mm512_mask_reduce_min_epi32(at_top, best_at);
  return {top, at_top ? first : begin};
}

}  // namespace

extern "C" {

// ids[r] = argmax over v of logits[r, v] / t_r - log(-log u(seed_r, step_r, v)) where t_r > 0,
// else of logits[r, v]; logits rows row_stride elements apart (dtype as load_logits)
void gumbel_argmax(const void* logits, int dtype, int64_t row_stride, int64_t rows, int64_t vocab,
                   const float* temperature, const int64_t* seed, const int64_t* step,
                   int64_t* ids, int threads) {
  const int64_t chunks = (vocab + kChunk - 1) / kChunk, tasks = rows * chunks;
  const int64_t elem = dtype == 0 ? 4 : 2;
  std::vector<Best> found(tasks);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tasks; t++) {
    const int64_t r = t / chunks, begin = (t % chunks) * kChunk;
    const uint32_t mixed = hash32(static_cast<uint32_t>(seed[r])) ^
                           static_cast<uint32_t>(static_cast<uint64_t>(step[r]) * 0x9E3779B1u);
    const char* row = static_cast<const char*>(logits) + r * row_stride * elem;
    const int64_t end = begin + kChunk < vocab ? begin + kChunk : vocab;
    found[t] = best_of(row, dtype, begin, end, temperature[r], hash32(mixed));
  }
  for (int64_t r = 0; r < rows; r++) {  // chunks in order: an equal later score does not win
    Best best = found[r * chunks];
    for (int64_t c = 1; c < chunks; c++) {
      if (found[r * chunks + c].value > best.value) best = found[r * chunks + c];
    }
    ids[r] = best.index;
  }
}

}  // extern "C"
