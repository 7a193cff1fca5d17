// AdamW on compressed optimizer states, one pass per 256-value block (lohan/runtime/format_kernel.py).
//
// The torch version (format_adamw._piece_torch) decodes, updates and encodes with a dozen whole-tensor ops, each a
// pass over memory; this kernel does the same arithmetic block by block in cache: decode m and v (8-bit codes times
// the block's absmax, or bf16), AdamW as torch's fused kernel computes it, the new absmax and nearest codes (the
// same bucket table as quant._nearest_codes), the master stored fp32 or stochastically rounded to bf16 (the same
// noise hash as quant.rounding_noise), and the P16 copy. Blocks are independent, so the result does not depend on
// the thread count.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t QBLOCK = 256;
constexpr uint64_t M32 = 0xFFFFFFFFull;

constexpr uint32_t TINY_BUCKET = 0x322BC;  // quant._TINY_BUCKET: magnitude 1e-8
constexpr uint32_t ONE_BUCKET = 0x3F800;   // quant._ONE_BUCKET: magnitude 1
constexpr uint32_t SPAN = ONE_BUCKET - TINY_BUCKET + 1;

struct Codebook {
  const float* qmap;      // 256 map entries
  const float* mids;      // 255 midpoints between them, then +inf
  const uint8_t* table;   // quant.compact_code_table: midpoints at or below each bucket's smallest value
};

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// the nearest map entry of x in [-1, 1] (ties to the larger), as quant._nearest_codes finds it
inline uint8_t nearest(float x, const Codebook& cb) {
  const uint32_t bucket = bits_of(x) >> 12;
  const uint32_t magnitude = std::min(std::max(bucket & 0x7FFFFu, TINY_BUCKET), ONE_BUCKET);
  const uint32_t code = cb.table[magnitude - TINY_BUCKET + (bucket >> 19 ? SPAN : 0)];
  return static_cast<uint8_t>(code + (cb.mids[code] <= x ? 1 : 0));
}

inline uint32_t noise16(int64_t index, uint64_t key) {
  uint64_t x = ((static_cast<uint64_t>(index) & M32) * 0x5BD1E995ull + key) & M32;
  x ^= x >> 15;
  x = (x * 0x27D4EB2Dull) & M32;
  x ^= x >> 13;
  return static_cast<uint32_t>(x & 0xFFFF);
}

inline float stochastic_bf16(float x, int64_t index, uint64_t key) {
  const float rounded = float_of((bits_of(x) + noise16(index, key)) & ~0xFFFFu);
  return (std::isfinite(rounded) && std::isfinite(x)) ? rounded : x;  // then to bf16: exact, or to nearest
}

inline float from_bf16(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// round to nearest even, as at::BFloat16(float) does (NaN stays NaN), in plain integer ops that vectorize
inline uint16_t to_bf16(float x) {
  const uint32_t u = bits_of(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Moment {
  float* f32 = nullptr;
  uint16_t* bf16 = nullptr;
  uint8_t* codes = nullptr;
  float* absmax = nullptr;
  Codebook book{};

  void decode(int64_t at, int64_t n, int64_t block, float* out) const {
    if (codes != nullptr) {
      const float scale = absmax[block];
      const uint8_t* c = codes + at;
      for (int64_t i = 0; i < n; ++i) out[i] = book.qmap[c[i]] * scale;
    } else if (bf16 != nullptr) {
      const uint16_t* h = bf16 + at;
      for (int64_t i = 0; i < n; ++i) out[i] = from_bf16(h[i]);
    } else {
      std::memcpy(out, f32 + at, n * sizeof(float));
    }
  }

  void encode(int64_t at, int64_t n, int64_t block, const float* x) const {
    if (codes != nullptr) {
      float amax = 0.f;
      for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
      absmax[block] = amax;
      const float div = amax > 0.f ? amax : 1.f;
      uint8_t* c = codes + at;
      for (int64_t i = 0; i < n; ++i) c[i] = nearest(x[i] / div, book);
    } else if (bf16 != nullptr) {
      uint16_t* h = bf16 + at;
      for (int64_t i = 0; i < n; ++i) h[i] = to_bf16(x[i]);
    } else {
      std::memcpy(f32 + at, x, n * sizeof(float));
    }
  }
};

Moment moment_of(const torch::Tensor& x, const c10::optional<torch::Tensor>& absmax, const torch::Tensor& qmap,
                 const torch::Tensor& mids, const torch::Tensor& table) {
  Moment m;
  if (x.scalar_type() == at::kByte) {
    TORCH_CHECK(absmax.has_value(), "8-bit moments need their absmax");
    m.codes = x.data_ptr<uint8_t>();
    m.absmax = absmax->data_ptr<float>();
    TORCH_CHECK(table.numel() == 2 * SPAN && mids.numel() == 256, "the code table does not match the kernel");
    m.book = {qmap.data_ptr<float>(), mids.data_ptr<float>(), table.data_ptr<uint8_t>()};
  } else if (x.scalar_type() == at::kBFloat16) {
    m.bf16 = reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>());
  } else {
    m.f32 = x.data_ptr<float>();
  }
  return m;
}

}  // namespace

// One piece of one parameter (its first element `at` in the block's vector, a multiple of 256 from the parameter's
// start): master (fp32 or bf16), m and v (fp32, bf16 or 8-bit codes with an absmax per 256 values), p16 (an empty
// tensor: none, the master is it), grad (fp32, clipped).
void adamw_piece(torch::Tensor master, torch::Tensor m, c10::optional<torch::Tensor> m_absmax, torch::Tensor v,
                 c10::optional<torch::Tensor> v_absmax, torch::Tensor p16, torch::Tensor grad, double lr,
                 double beta1, double beta2, double eps, double weight_decay, int64_t step, int64_t at, int64_t key,
                 torch::Tensor qmap_s, torch::Tensor mids_s, torch::Tensor table_s, torch::Tensor qmap_u,
                 torch::Tensor mids_u, torch::Tensor table_u) {
  const int64_t n = grad.numel();
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.is_contiguous(), "grad must be contiguous fp32");
  TORCH_CHECK(master.numel() == n && m.numel() == n && v.numel() == n, "states and gradient differ in size");
  const Moment mm = moment_of(m, m_absmax, qmap_s, mids_s, table_s);
  const Moment vv = moment_of(v, v_absmax, qmap_u, mids_u, table_u);
  const bool bf16_master = master.scalar_type() == at::kBFloat16;
  float* p32 = bf16_master ? nullptr : master.data_ptr<float>();
  uint16_t* pb = bf16_master ? reinterpret_cast<uint16_t*>(master.data_ptr<at::BFloat16>()) : nullptr;
  const float* g = grad.data_ptr<float>();
  const bool has_p16 = p16.numel() > 0;
  const auto p16_type = has_p16 ? p16.scalar_type() : at::kFloat;
  uint16_t* p16b = has_p16 && p16_type == at::kBFloat16 ? reinterpret_cast<uint16_t*>(p16.data_ptr<at::BFloat16>())
                                                         : nullptr;
  at::Half* p16h = has_p16 && p16_type == at::kHalf ? p16.data_ptr<at::Half>() : nullptr;
  float* p16f = has_p16 && p16_type == at::kFloat ? p16.data_ptr<float>() : nullptr;
  // the scalars as torch's fused AdamW computes them (double, then used in float arithmetic)
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step)));
  const float step_size = static_cast<float>(lr / bc1), decay = static_cast<float>(1.0 - lr * weight_decay);
  const float b1 = static_cast<float>(beta1), b2 = static_cast<float>(beta2), e = static_cast<float>(eps);
  const float omb1 = static_cast<float>(1.0 - beta1), omb2 = static_cast<float>(1.0 - beta2);
  const float bc2s = static_cast<float>(bc2_sqrt);
  const uint64_t k = static_cast<uint64_t>(key);
  const int64_t blocks = (n + QBLOCK - 1) / QBLOCK;
  at::parallel_for(0, blocks, 16, [&](int64_t first, int64_t end) {
    float mb[QBLOCK], vb[QBLOCK], pw[QBLOCK];
    for (int64_t blk = first; blk < end; ++blk) {
      const int64_t lo = blk * QBLOCK, len = std::min(QBLOCK, n - lo);
      mm.decode(lo, len, blk, mb);
      vv.decode(lo, len, blk, vb);
      if (bf16_master) {
        for (int64_t i = 0; i < len; ++i) pw[i] = from_bf16(pb[lo + i]);
      } else {
        std::memcpy(pw, p32 + lo, len * sizeof(float));
      }
      const float* gi = g + lo;
      for (int64_t i = 0; i < len; ++i) {  // torch's fused AdamW, elementwise (vectorizes)
        mb[i] = mb[i] * b1 + gi[i] * omb1;
        vb[i] = vb[i] * b2 + gi[i] * gi[i] * omb2;
        pw[i] = pw[i] * decay - step_size * mb[i] / (std::sqrt(vb[i]) / bc2s + e);
      }
      mm.encode(lo, len, blk, mb);
      vv.encode(lo, len, blk, vb);
      if (bf16_master) {
        for (int64_t i = 0; i < len; ++i) pb[lo + i] = to_bf16(stochastic_bf16(pw[i], at + lo + i, k));
      } else {
        std::memcpy(p32 + lo, pw, len * sizeof(float));
      }
      if (p16_type == at::kBFloat16) {
        for (int64_t i = 0; i < len; ++i) p16b[lo + i] = to_bf16(pw[i]);
      } else if (p16_type == at::kHalf) {
        for (int64_t i = 0; i < len; ++i) p16h[lo + i] = at::Half(pw[i]);
      } else if (p16f != nullptr) {
        std::memcpy(p16f + lo, pw, len * sizeof(float));
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // the GIL released while it runs (it touches no Python object): held, it stalled the compute thread's kernel
  // launches and the I/O threads for the whole update of a piece
  mod.def("adamw_piece", &adamw_piece, "AdamW on one piece of compressed states (lohan/runtime/format_kernel.py)",
          py::call_guard<py::gil_scoped_release>());
}
