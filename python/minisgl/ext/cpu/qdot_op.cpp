// torch.ops.minisgl.qdot_mm's CPU kernel (the schema is defined in ext/cpu/native.py): qdot.cpp's
// qdot_mm on tensors, so that eager layers and the compiled (AOTInductor) steps call it without
// going through Python (a Python kernel cost 8 us a call more: 1 ms a SmolLM2 step).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" void qdot_mm(const uint16_t* x, int rows, int cols, const uint8_t* codes,
                        const uint16_t* scales, int bits, int half, uint16_t* y, int out,
                        int threads);

namespace {

constexpr int64_t kTile = 16;
constexpr int64_t kFourBitBytes = 256;  // a tile's codes of one block at 4 bits (512 at 8)

at::Tensor qdot(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2, "qdot_mm: x must be [rows, in]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "qdot_mm: x must be bfloat16 or float16");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous(),
              "qdot_mm: codes must be contiguous uint8 [out / 16, in / 32, bytes]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "qdot_mm: scales must be contiguous float16");
  TORCH_CHECK(x.size(1) == codes.size(1) * 32, "qdot_mm: x's columns do not fit the codes");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), out = codes.size(0) * kTile;
  at::Tensor y = at::empty({rows, out}, xc.options());
  if (rows > 0) {
    qdot_mm(static_cast<const uint16_t*>(xc.const_data_ptr()), rows, xc.size(1),
            codes.const_data_ptr<uint8_t>(), static_cast<const uint16_t*>(scales.const_data_ptr()),
            codes.size(2) == kFourBitBytes ? 4 : 8, xc.scalar_type() == at::kHalf,
            static_cast<uint16_t*>(y.data_ptr()), out, at::get_num_threads());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(minisgl, CPU, m) { m.impl("qdot_mm", &qdot); }
