// minisgl's fused CPU kernels for float32 layers in eager steps (ext/cpu/native.py builds them,
// ext/cpu/fused.py calls them): each replaces 3-6 torch ops that pass over the activations one
// after another (a 1,000-token prompt's [1000, 3072] gate/up output is 12 MB, past L2) by one
// pass per row.
//   rotate:        RoPE from ext/cpu/speed.py's table rows, x cos + swap(x) sin with each
//                  product and the sum rounded as torch rounds them: the same bits;
//   silu_and_mul:  silu(gate) up = gate / (1 + exp(-gate)) up, exp within 2 ulp (torch's
//                  Sleef exp within 1): within float32 rounding, not bit for bit;
//   rms_norm:      w (x / sqrt(mean(x^2) + eps)), optionally after residual += x (the layer's
//                  add): the mean summed in another order than torch's.
// Rows are split over threads in fixed chunks; a row's bits do not depend on the thread count.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

namespace {

// e^x within 2 ulp: x = n ln2 + r (ln2 in two parts), e^r by its Taylor series to degree 7
// on |r| <= ln2 / 2, times 2^n; large x give inf, very negative x 0
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 first(int64_t count) {  // the first min(count, 16) lanes
  return count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
}

}  // namespace

extern "C" {

// out [rows, heads, dim] = x cos + swap(x) sin: x's heads dense, positions x_row floats apart;
// table [rows, 2, dim] holds (cos, cos) then (-sin, sin); swap exchanges the halves of a head
void rotate(const float* x, int64_t x_row, const float* table, float* out, int64_t rows,
            int heads, int dim, int threads) {
  const int half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < rows; t++) {
    const float* cos = table + t * 2 * dim;
    const float* sin = cos + dim;
    for (int h = 0; h < heads; h++) {
      const float* xh = x + t * x_row + h * dim;
      float* oh = out + (t * heads + h) * dim;
      for (int d = 0; d < dim; d += 16) {
        const __mmask16 m = first(dim - d);
        const int s = d < half ? d + half : d - half;  // half % 16 == 0: no lane straddles
        const __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xh + d), _mm512_maskz_loadu_ps(m, cos + d));
        const __m512 b = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xh + s), _mm512_maskz_loadu_ps(m, sin + d));
        _mm512_mask_storeu_ps(oh + d, m, _mm512_add_ps(a, b));
      }
    }
  }
}

// out [rows, cols] = silu(x[:, :cols]) x[:, cols:], x's rows x_row floats apart
void silu_and_mul(const float* x, int64_t x_row, float* out, int64_t rows, int64_t cols,
                  int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < rows; t++) {
    const float* gate = x + t * x_row;
    const float* up = gate + cols;
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 m = first(cols - c);
      const __m512 g = _mm512_maskz_loadu_ps(m, gate + c);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
      _mm512_mask_storeu_ps(out + t * cols + c, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, up + c)));
    }
  }
}

// out[t] = w x[t] / sqrt(mean(x[t]^2) + eps) for rows of `cols` floats, x's x_row apart; with a
// residual (rows of `cols`, dense), residual[t] += x[t] first and is the row normed
void rms_norm(const float* x, int64_t x_row, float* residual, const float* w, float eps,
              float* out, int64_t rows, int64_t cols, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < rows; t++) {
    const float* src = x + t * x_row;
    if (residual != nullptr) {
      float* res = residual + t * cols;
      for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 m = first(cols - c);
        const __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(m, src + c), _mm512_maskz_loadu_ps(m, res + c));
        _mm512_mask_storeu_ps(res + c, m, sum);
      }
      src = res;
    }
    __m512 squares = _mm512_setzero_ps();
    for (int64_t c = 0; c < cols; c += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(first(cols - c), src + c);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / cols + eps);
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 m = first(cols - c);
      const __m512 normed = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + c), sv);
      _mm512_mask_storeu_ps(out + t * cols + c, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + c), normed));
    }
  }
}

}  // extern "C"
