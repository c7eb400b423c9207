// CPU kernels of the MX ops: the reference backend. Argument checks and output allocation live
// here; the quantization and dequantization loops are in mx_cpu_quant_kernel.cpp and
// mx_cpu_dequant_kernel.cpp, compiled once per instruction set.
//
// mx_matmul is emulated: operands are dequantized tile by tile (exact) and multiplied by a GEMM
// that accumulates in fp32: the fp32 GEMM (MKL), or, where the CPU has native BF16 dot products
// and the result is bf16, torch's BF16 GEMM on bf16 tiles (cpu::gemm_path; the extremes of the
// e8m0 range fall back to fp32, see bf16_exact).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "../common/checks.h"
#include "../common/mx_format.h"
#include "mx_cpu_kernels.h"

namespace zrw {
namespace {

using mx::ElemFormat;
using mx::kBlock;
using mx::ScaleMode;

ElemFormat elem_format(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn ? ElemFormat::E4M3 : ElemFormat::E5M2;
}

uint8_t* bytes_of(at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// ---------------------------------------------------------------------------------------------
// The three quantization layouts (the input made contiguous first), shared by the ops on a
// bf16/fp16/fp32 tensor (round_to Undefined) and the *_from_master ops on an FP32 master
// (round_to = the parameter dtype: each element is rounded to it as it is read,
// mx_cpu_kernels.h).

std::tuple<at::Tensor, at::Tensor> quantize_along(const at::Tensor& x, int64_t d,
                                                  at::ScalarType elem_dtype, ScaleMode mode,
                                                  at::ScalarType round_to) {
  const at::Tensor xc = x.contiguous();
  auto data = at::empty(x.sizes(), x.options().dtype(elem_dtype));
  auto scale =
      at::empty(checks::scale_shape_along(x.sizes(), d), x.options().dtype(at::kFloat8_e8m0fnu));
  const int64_t D = x.size(d);
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < d; ++i) outer *= x.size(i);
  for (int64_t i = d + 1; i < x.dim(); ++i) inner *= x.size(i);
  const ElemFormat fmt = elem_format(elem_dtype);
  uint8_t* dp = bytes_of(data);
  uint8_t* sp = bytes_of(scale);
  cpu::QuantOutputs o;
  if (inner == 1) {
    // Blocks run along the contiguous axis: one matrix (outer, D), blocks along its rows.
    o.row_data = dp;
    o.row_scale = sp;
    cpu::quantize_matrices(xc.const_data_ptr(), xc.scalar_type(), round_to, 1, outer, D, fmt, mode,
                           o);
  } else {
    // Blocks run across rows: `outer` matrices (D, inner), blocks down their columns.
    o.col_data = dp;
    o.col_scale = sp;
    cpu::quantize_matrices(xc.const_data_ptr(), xc.scalar_type(), round_to, outer, D, inner, fmt,
                           mode, o);
  }
  return {data, scale};
}

// (E, N, K) or (N, K) as E matrices.
struct WeightDims {
  int64_t E, N, K;
  explicit WeightDims(const at::Tensor& w)
      : E(w.dim() == 3 ? w.size(0) : 1), N(w.size(w.dim() - 2)), K(w.size(w.dim() - 1)) {}
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_dual(const at::Tensor& w,
                                                                         at::ScalarType elem_dtype,
                                                                         ScaleMode mode,
                                                                         at::ScalarType round_to) {
  const at::Tensor wc = w.contiguous();
  const int64_t nd = w.dim();
  const WeightDims dims(w);
  const auto fp8 = w.options().dtype(elem_dtype);
  const auto e8 = w.options().dtype(at::kFloat8_e8m0fnu);
  auto data_fwd = at::empty(w.sizes(), fp8);
  auto scale_fwd = at::empty(checks::scale_shape_along(w.sizes(), nd - 1), e8);
  auto data_bwd = at::empty(w.sizes(), fp8);
  auto scale_bwd = at::empty(checks::scale_shape_along(w.sizes(), nd - 2), e8);
  cpu::QuantOutputs o;
  o.row_data = bytes_of(data_fwd);
  o.row_scale = bytes_of(scale_fwd);
  o.col_data = bytes_of(data_bwd);
  o.col_scale = bytes_of(scale_bwd);
  cpu::quantize_matrices(wc.const_data_ptr(), wc.scalar_type(), round_to, dims.E, dims.N, dims.K,
                         elem_format(elem_dtype), mode, o);
  return {data_fwd, scale_fwd, data_bwd, scale_bwd};
}

std::tuple<at::Tensor, at::Tensor> quantize_block(const at::Tensor& w, at::ScalarType elem_dtype,
                                                  ScaleMode mode, at::ScalarType round_to) {
  const at::Tensor wc = w.contiguous();
  const int64_t nd = w.dim();
  const WeightDims dims(w);
  auto data = at::empty(w.sizes(), w.options().dtype(elem_dtype));
  std::vector<int64_t> bshape(w.sizes().begin(), w.sizes().end());
  bshape[nd - 2] = mx::ceil_div(dims.N, kBlock);
  bshape[nd - 1] = mx::ceil_div(dims.K, kBlock);
  auto block_scale = at::empty(bshape, w.options().dtype(at::kFloat8_e8m0fnu));
  cpu::QuantOutputs o;
  o.tile_data = bytes_of(data);
  o.tile_scale = bytes_of(block_scale);
  cpu::quantize_matrices(wc.const_data_ptr(), wc.scalar_type(), round_to, dims.E, dims.N, dims.K,
                         elem_format(elem_dtype), mode, o);
  return {data, block_scale};
}

constexpr at::ScalarType kNoRounding = at::ScalarType::Undefined;

// ---------------------------------------------------------------------------------------------
// Ops.

std::tuple<at::Tensor, at::Tensor> mx_quantize_cpu(const at::Tensor& x, int64_t dim,
                                                   at::ScalarType elem_dtype,
                                                   c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize";
  checks::check_device(op, "x", x, c10::DeviceType::CPU);
  checks::check_float_input(op, "x", x);
  checks::check_elem_dtype(op, "elem_dtype", elem_dtype);
  const ScaleMode mode = checks::parse_scale_mode(op, std::string(scale_mode));
  const int64_t d = checks::wrap_dim(op, "x", dim, x.dim());
  return quantize_along(x, d, elem_dtype, mode, kNoRounding);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mx_quantize_dual_cpu(
    const at::Tensor& w, at::ScalarType elem_dtype, c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize_dual";
  checks::check_device(op, "w", w, c10::DeviceType::CPU);
  const ScaleMode mode = checks::check_weight_quantize_args(op, w, elem_dtype, scale_mode);
  return quantize_dual(w, elem_dtype, mode, kNoRounding);
}

std::tuple<at::Tensor, at::Tensor> mx_quantize_block_cpu(const at::Tensor& w,
                                                         at::ScalarType elem_dtype,
                                                         c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize_block";
  checks::check_device(op, "w", w, c10::DeviceType::CPU);
  const ScaleMode mode = checks::check_weight_quantize_args(op, w, elem_dtype, scale_mode);
  return quantize_block(w, elem_dtype, mode, kNoRounding);
}

// Quantization straight from an FP32 master (docs/design.md §5, the BF16-free step): the bytes of
// mx_quantize*(master.to(param_dtype), ...), with the rounding done in the kernel's one read.

std::tuple<at::Tensor, at::Tensor> mx_quantize_from_master_cpu(const at::Tensor& master,
                                                               int64_t dim,
                                                               at::ScalarType param_dtype,
                                                               at::ScalarType elem_dtype,
                                                               c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize_from_master";
  checks::check_device(op, "master", master, c10::DeviceType::CPU);
  const auto [mode, d] = checks::check_mx_quantize_from_master_args(op, master, dim, param_dtype,
                                                                    elem_dtype, scale_mode);
  return quantize_along(master, d, elem_dtype, mode, param_dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mx_quantize_dual_from_master_cpu(
    const at::Tensor& master, at::ScalarType param_dtype, at::ScalarType elem_dtype,
    c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize_dual_from_master";
  checks::check_device(op, "master", master, c10::DeviceType::CPU);
  const ScaleMode mode =
      checks::check_master_weight_quantize_args(op, master, param_dtype, elem_dtype, scale_mode);
  return quantize_dual(master, elem_dtype, mode, param_dtype);
}

std::tuple<at::Tensor, at::Tensor> mx_quantize_block_from_master_cpu(const at::Tensor& master,
                                                                     at::ScalarType param_dtype,
                                                                     at::ScalarType elem_dtype,
                                                                     c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize_block_from_master";
  checks::check_device(op, "master", master, c10::DeviceType::CPU);
  const ScaleMode mode =
      checks::check_master_weight_quantize_args(op, master, param_dtype, elem_dtype, scale_mode);
  return quantize_block(master, elem_dtype, mode, param_dtype);
}

at::Tensor mx_dequantize_cpu(const at::Tensor& data, const at::Tensor& scale, int64_t dim,
                             at::ScalarType out_dtype) {
  constexpr const char* op = "zrw.mx_dequantize";
  checks::check_device(op, "data", data, c10::DeviceType::CPU);
  checks::check_device(op, "scale", scale, c10::DeviceType::CPU);
  const int64_t d = checks::check_mx_dequantize_args(op, data, scale, dim, out_dtype);

  const at::Tensor dc = data.contiguous(), sc = scale.contiguous();
  auto out = at::empty(data.sizes(), data.options().dtype(at::kFloat));
  const int64_t D = data.size(d);
  const int64_t DB = mx::ceil_div(D, kBlock);
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < d; ++i) outer *= data.size(i);
  for (int64_t i = d + 1; i < data.dim(); ++i) inner *= data.size(i);
  const ElemFormat fmt = elem_format(data.scalar_type());
  const uint8_t* dp = static_cast<const uint8_t*>(dc.const_data_ptr());
  const uint8_t* sp = static_cast<const uint8_t*>(sc.const_data_ptr());
  float* op_ = out.data_ptr<float>();
  if (out.numel() == 0) return out_dtype == at::kFloat ? out : out.to(out_dtype);
  if (inner == 1) {
    // Blocks along the contiguous axis: `outer` rows of D, each with its DB scales.
    at::parallel_for(0, outer, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, D)),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t g = begin; g < end; ++g) {
                         cpu::dequantize_row_blocks(fmt, dp + g * D, sp + g * DB, D, op_ + g * D);
                       }
                     });
  } else {
    // Row g of the (outer * D, inner) view uses scale row (g / D) * DB + (g % D) / 32.
    at::parallel_for(0, outer * D, std::max<int64_t>(1, 16384 / inner),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t g = begin; g < end; ++g) {
                         cpu::dequantize_per_element(fmt, dp + g * inner,
                                                     sp + ((g / D) * DB + (g % D) / kBlock) * inner,
                                                     inner, op_ + g * inner);
                       }
                     });
  }
  return out_dtype == at::kFloat ? out : out.to(out_dtype);
}

// ---------------------------------------------------------------------------------------------
// mx_matmul.

// A bf16 value's bits from an fp32 value that is exactly a bf16 value (the BF16 path only runs
// when every dequantized element is one): the top half of its bits.
inline uint16_t bf16_bits_exact(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}

// n elements along K, blocks of 32 from scales[0], into an fp32 or a bf16 tile (the per-ISA
// kernels write either directly).
inline void row_blocks_into(ElemFormat fmt, const uint8_t* d, const uint8_t* s, int64_t n,
                            float* o) {
  cpu::dequantize_row_blocks(fmt, d, s, n, o);
}
inline void row_blocks_into(ElemFormat fmt, const uint8_t* d, const uint8_t* s, int64_t n,
                            uint16_t* o) {
  cpu::dequantize_row_blocks_bf16(fmt, d, s, n, o);
}
// n elements, one scale byte each.
inline void per_element_into(ElemFormat fmt, const uint8_t* d, const uint8_t* s, int64_t n,
                             float* o) {
  cpu::dequantize_per_element(fmt, d, s, n, o);
}
inline void per_element_into(ElemFormat fmt, const uint8_t* d, const uint8_t* s, int64_t n,
                             uint16_t* o) {
  cpu::dequantize_per_element_bf16(fmt, d, s, n, o);
}
inline void store(float v, float* o) { *o = v; }
inline void store(float v, uint16_t* o) { *o = bf16_bits_exact(v); }

// One MX operand (R, K) blocked along K: fp8 bytes and e8m0 scale (R, ceil(K/32)) with arbitrary
// strides. Nothing is copied: tiles are dequantized straight from the strided bytes.
struct MxOperand {
  const uint8_t* data;
  int64_t rows, k, s_row, s_k;
  const uint8_t* scale;
  int64_t ss_row, ss_kb;
  ElemFormat fmt;

  MxOperand(const at::Tensor& d, const at::Tensor& s)
      : data(static_cast<const uint8_t*>(d.const_data_ptr())),
        rows(d.size(0)),
        k(d.size(1)),
        s_row(d.stride(0)),
        s_k(d.stride(1)),
        scale(static_cast<const uint8_t*>(s.const_data_ptr())),
        ss_row(s.stride(0)),
        ss_kb(s.stride(1)),
        fmt(elem_format(d.scalar_type())) {}

  // Row-major along K unless the bytes are column-major (the .t() of a tensor blocked along
  // its other axis), which is dequantized in its own memory order and handed to the GEMM
  // transposed.
  bool col_major() const { return s_k != 1 && s_row == 1; }

  // Any other strides: one element at a time.
  float value(int64_t r, int64_t kk) const {
    const uint8_t byte = data[r * s_row + kk * s_k];
    const float v = fmt == ElemFormat::E4M3 ? mx::decode_elem<ElemFormat::E4M3>(byte)
                                            : mx::decode_elem<ElemFormat::E5M2>(byte);
    return v * mx::scale_from_byte(scale[r * ss_row + (kk / kBlock) * ss_kb]);
  }

  // Rows [r0, r0 + nr) into `buf` as fp32 or bf16 (exact either way, see bf16_exact):
  // row-major (nr, K), or, when col_major(), in the bytes' own order (K, nr).
  template <typename Out>
  void dequantize_rows(int64_t r0, int64_t nr, Out* buf) const {
    if (col_major()) {
      // Column kk of the rows: contiguous bytes, one scale per row (contiguous when the scale
      // is the .t() of a contiguous tensor, as the layers pass it).
      at::parallel_for(0, k, 64, [&](int64_t kb, int64_t ke) {
        for (int64_t kk = kb; kk < ke; ++kk) {
          const uint8_t* d = data + kk * s_k + r0;
          const uint8_t* s = scale + (kk / kBlock) * ss_kb + r0 * ss_row;
          Out* o = buf + kk * nr;
          if (ss_row == 1) {
            per_element_into(fmt, d, s, nr, o);
          } else {
            for (int64_t r = 0; r < nr; ++r) store(value(r0 + r, kk), o + r);
          }
        }
      });
    } else {
      at::parallel_for(0, nr, 8, [&](int64_t rb, int64_t re) {
        for (int64_t r = rb; r < re; ++r) {
          Out* o = buf + r * k;
          if (s_k == 1 && ss_kb == 1) {
            row_blocks_into(fmt, data + (r0 + r) * s_row, scale + (r0 + r) * ss_row, k, o);
          } else {
            for (int64_t kk = 0; kk < k; ++kk) store(value(r0 + r, kk), o + kk);
          }
        }
      });
    }
  }

  // Whether block (r, kb) holds only zeros (+0 or -0).
  bool block_is_zero(int64_t r, int64_t kb) const {
    const int64_t k0 = kb * kBlock, k1 = std::min(k, k0 + kBlock);
    for (int64_t kk = k0; kk < k1; ++kk) {
      if ((data[r * s_row + kk * s_k] & 0x7F) != 0) return false;
    }
    return true;
  }

  // The smallest and largest scale byte over the blocks that hold a nonzero element: a block
  // with scale byte 0 is skipped when all its elements are zero (an all-zero block, e.g. the
  // gradient of a masked token); `nonfinite` is set for a 0xFF (NaN/Inf) block. Reads the scale
  // bytes in their memory order, and the data of scale-0 blocks only.
  void scale_range(int& lo, int& hi, bool& nonfinite) const {
    lo = 255;
    hi = 0;
    nonfinite = false;
    const int64_t kbs = mx::ceil_div(k, kBlock);
    auto visit = [&](int64_t r, int64_t kb) {
      const int s = scale[r * ss_row + kb * ss_kb];
      if (s == 0xFF) nonfinite = true;
      if (s == 0 && block_is_zero(r, kb)) return;
      lo = std::min(lo, s);
      hi = std::max(hi, s);
    };
    if (ss_row == 1) {
      for (int64_t kb = 0; kb < kbs; ++kb) {
        for (int64_t r = 0; r < rows; ++r) visit(r, kb);
      }
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t kb = 0; kb < kbs; ++kb) visit(r, kb);
      }
    }
  }
};

// log2 bounds of an element format's nonzero magnitudes: 2^lo <= |x| < 2^hi.
void elem_log2_range(ElemFormat f, int& lo, int& hi) {
  if (f == ElemFormat::E4M3) {
    lo = -9;  // smallest subnormal 2^-9; largest 448 < 2^9
    hi = 9;
  } else {
    lo = -16;  // 2^-16; 57344 < 2^16
    hi = 16;
  }
}

// Whether the BF16 path computes exactly what the FP32 path does (up to the order of the fp32
// sums): every dequantized element is a normal bf16 number or zero (so the tiles hold the exact
// values, and BF16 dot products, which treat subnormal inputs as zero, see them), and every
// product of two nonzero elements is a normal, finite fp32 number (the dot products accumulate
// in fp32 and flush subnormal products). False at the extremes of the e8m0 range and for blocks
// holding NaN/Inf: those calls take the FP32 path instead of flushing.
bool bf16_exact(const MxOperand& a, const MxOperand& b) {
  int a_lo, a_hi, b_lo, b_hi, ea_lo, ea_hi, eb_lo, eb_hi;
  bool a_nf, b_nf;
  a.scale_range(a_lo, a_hi, a_nf);
  b.scale_range(b_lo, b_hi, b_nf);
  if (a_nf || b_nf) return false;
  if (a_lo > a_hi || b_lo > b_hi) return true;  // an all-zero operand: a zero product
  elem_log2_range(a.fmt, ea_lo, ea_hi);
  elem_log2_range(b.fmt, eb_lo, eb_hi);
  const int a_min = a_lo - 127 + ea_lo, a_max = a_hi - 127 + ea_hi;  // 2^a_min <= |a| < 2^a_max
  const int b_min = b_lo - 127 + eb_lo, b_max = b_hi - 127 + eb_hi;
  constexpr int kMinNormal = -126, kMaxExp = 127;  // fp32 and bf16 share the exponent range
  return a_min >= kMinNormal && b_min >= kMinNormal && a_max <= kMaxExp && b_max <= kMaxExp &&
         a_min + b_min >= kMinNormal && a_max + b_max <= kMaxExp;
}

std::atomic<int64_t> g_fp32{0}, g_bf16{0}, g_bf16_to_fp32{0};

// mx_matmul's tile buffers persist between calls: one byte buffer, grown to the largest tiles a
// call has needed (never past the tile bound below: 40 MiB, 24 MiB on the BF16 path) and kept,
// so that a training step does not allocate (and, once the allocator has returned the pages,
// fault in) its tiles for every GEMM. It comes from the CPU allocator like any tensor
// (zrw.memory counts it) and is freed by zrw.ops.free_matmul_workspace(). One call at a time
// holds it; a call made while another thread holds it allocates its own tiles for that call.
class TileWorkspace {
 public:
  static TileWorkspace& get() {
    static auto* ws = new TileWorkspace;  // never destroyed: the allocator may be gone at exit
    return *ws;
  }

  // A buffer of at least `bytes` for one call, released when the Lease ends.
  class Lease {
   public:
    Lease(TileWorkspace& ws, int64_t bytes, const at::TensorOptions& opts) : ws_(ws) {
      uint64_t generation = 0;
      {
        std::lock_guard<std::mutex> lock(ws_.mu_);
        if (!ws_.busy_) {
          ws_.busy_ = held_ = true;
          if (ws_.buf_.defined() && ws_.buf_.numel() >= bytes) {
            buf_ = ws_.buf_;
          } else {
            ws_.buf_ = at::Tensor();  // free a buffer too small before allocating (below)
          }
          generation = ws_.generation_;
        }
      }
      if (buf_.defined()) return;
      try {
        buf_ = at::empty({bytes}, opts.dtype(at::kByte));
      } catch (...) {
        done();
        throw;
      }
      if (held_) {
        // A free() that ran while this buffer was being allocated wins: the buffer then serves
        // this call only.
        std::lock_guard<std::mutex> lock(ws_.mu_);
        if (ws_.generation_ == generation) ws_.buf_ = buf_;
      }
    }
    ~Lease() { done(); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    const at::Tensor& tensor() const { return buf_; }

   private:
    void done() {
      if (!held_) return;
      held_ = false;
      std::lock_guard<std::mutex> lock(ws_.mu_);
      ws_.busy_ = false;
    }
    TileWorkspace& ws_;
    at::Tensor buf_;
    bool held_ = false;
  };

  int64_t bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return buf_.defined() ? buf_.numel() : 0;
  }

  // Drops the persistent buffer (a call holding it keeps its reference until it returns).
  int64_t free() {
    at::Tensor dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dropped = std::move(buf_);
      buf_ = at::Tensor();
      ++generation_;  // a call growing the buffer now does not register it
    }
    return dropped.defined() ? dropped.numel() : 0;
  }

 private:
  std::mutex mu_;
  at::Tensor buf_;
  bool busy_ = false;
  uint64_t generation_ = 0;  // counts free() calls
};

at::Tensor mx_matmul_cpu(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                         const at::Tensor& b_scale, at::ScalarType out_dtype) {
  constexpr const char* op = "zrw.mx_matmul";
  checks::check_device(op, "a", a, c10::DeviceType::CPU);
  checks::check_device(op, "a_scale", a_scale, c10::DeviceType::CPU);
  checks::check_device(op, "b", b, c10::DeviceType::CPU);
  checks::check_device(op, "b_scale", b_scale, c10::DeviceType::CPU);
  checks::check_mx_matmul_args(op, a, a_scale, b, b_scale, out_dtype);

  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  // A tile row is never split along K: a tile holds at least min(rows, 64) whole rows. Past
  // kMaxK (2^23) one such fp32 tile would exceed 2 GiB, so the call is refused here, before
  // the result is allocated or any scale is read (unrefused, K = 2^33 scanned every block for
  // minutes, then ran out of memory).
  constexpr int64_t kMaxK = int64_t{1} << 23;
  TORCH_CHECK_VALUE(K <= kMaxK, op,
                    ": the reduction dimension K (a's and b's dim 1) must be at "
                    "most ",
                    kMaxK,
                    " (2^23: the CPU kernel dequantizes whole rows of K into its "
                    "tiles, and 64 fp32 rows of a longer K exceed 2 GiB), got K = ",
                    K, "; split the product along K and add the partial results");
  // Below the autograd and view-tracking keys (this kernel is registered for CPU, so its caller
  // is already there): the tiles, views and GEMMs below dispatch straight to their CPU kernels,
  // without autograd view metadata, which at the shapes of a small layer costs more than the
  // arithmetic (the host time per layer: bench linear's `host` row).
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  auto c = at::empty({M, N}, a.options().dtype(out_dtype));
  if (M == 0 || N == 0 || K == 0) return c.zero_();
  const MxOperand A(a, a_scale), B(b, b_scale);

  // The BF16 GEMM (torch's, oneDNN where the CPU has BF16 dot products) accumulates in fp32 and
  // rounds once into a bf16 result: the FP32 path's result up to the order of the fp32 sums.
  // torch offers it with a bf16 result only, so fp16/fp32 results keep the FP32 GEMM.
  const bool bf16_wanted = out_dtype == at::kBFloat16 && cpu::gemm_path() == cpu::Gemm::BF16;
  const bool bf16 = bf16_wanted && bf16_exact(A, B);
  (bf16 ? g_bf16 : bf16_wanted ? g_bf16_to_fp32 : g_fp32).fetch_add(1, std::memory_order_relaxed);
  const at::ScalarType tile_dtype = bf16 ? at::kBFloat16 : at::kFloat;
  const int64_t elem_bytes = bf16 ? 2 : 4;

  // Both operands are dequantized in row tiles, A's of at most 16 MiB (2^22 fp32 or 2^23 bf16
  // elements), B's of 8 MiB, and each A tile is multiplied by every B tile: no operand ever
  // exists whole in fp32 (or bf16). B is dequantized again for every A tile (unless it fits one
  // tile), which costs little next to the GEMM. The GEMM writes each product tile straight into
  // its block of the result (a column slice is a BLAS output with a leading dimension), except
  // an fp32 product for a bf16/fp16 result, which goes through a product tile of at most 2^22
  // elements (16 MiB): A's tile shrinks when B's is wide (a weight gradient from few tokens: K
  // small, M and N large).
  auto rows_per_tile = [&](int64_t rows, int64_t bytes) {
    return std::min(rows, std::max<int64_t>(64, bytes / elem_bytes / K / 64 * 64));
  };
  const int64_t b_tile = rows_per_tile(N, int64_t{8} << 20);
  const bool direct = out_dtype == at::kFloat || bf16;
  int64_t a_tile = rows_per_tile(M, int64_t{16} << 20);
  if (!direct) {
    a_tile = std::min(a_tile, std::max<int64_t>(64, (int64_t{1} << 22) / b_tile / 64 * 64));
  }
  // The tiles live in the persistent workspace, each at a 64-byte boundary.
  auto aligned = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t a_bytes = aligned(a_tile * K * elem_bytes);
  const int64_t b_bytes = aligned(b_tile * K * elem_bytes);
  const int64_t p_bytes = direct ? 0 : aligned(std::min(a_tile, M) * b_tile * 4);
  TileWorkspace::Lease lease(TileWorkspace::get(), a_bytes + b_bytes + p_bytes, a.options());
  // Tiles are views of the leased bytes made with from_blob (no dispatch; the lease keeps the
  // bytes alive until the call returns).
  uint8_t* const ws = static_cast<uint8_t*>(lease.tensor().data_ptr());
  uint8_t* const a_buf = ws;
  uint8_t* const b_buf = ws + a_bytes;
  const at::TensorOptions tile_opts = a.options().dtype(tile_dtype);
  // (rows, K) tile as a GEMM operand, transposed when `transposed` (then (K, rows)): row-major
  // along K, or a column-major tile (the bytes' own order, (K, rows) in memory).
  auto tile = [&](const MxOperand& o, uint8_t* buf, int64_t rows, bool transposed) {
    const int64_t r_stride = o.col_major() ? 1 : K, k_stride = o.col_major() ? rows : 1;
    return transposed ? at::from_blob(buf, {K, rows}, {k_stride, r_stride}, tile_opts)
                      : at::from_blob(buf, {rows, K}, {r_stride, k_stride}, tile_opts);
  };
  auto dequantize = [&](const MxOperand& o, int64_t r0, int64_t nr, uint8_t* buf) {
    if (bf16) {
      o.dequantize_rows(r0, nr, reinterpret_cast<uint16_t*>(buf));
    } else {
      o.dequantize_rows(r0, nr, reinterpret_cast<float*>(buf));
    }
  };
  const bool b_once = b_tile == N;
  if (b_once) dequantize(B, 0, N, b_buf);
  for (int64_t m0 = 0; m0 < M; m0 += a_tile) {
    const int64_t mb = std::min(a_tile, M - m0);
    dequantize(A, m0, mb, a_buf);
    const at::Tensor a_mat = tile(A, a_buf, mb, false);
    for (int64_t n0 = 0; n0 < N; n0 += b_tile) {
      const int64_t nb = std::min(b_tile, N - n0);
      if (!b_once) dequantize(B, n0, nb, b_buf);
      const at::Tensor b_mat = tile(B, b_buf, nb, true);  // (K, nb)
      at::Tensor c_tile = mb == M && nb == N ? c : c.narrow(0, m0, mb).narrow(1, n0, nb);
      if (direct) {
        at::mm_out(c_tile, a_mat, b_mat);
      } else {
        at::Tensor p =
            at::from_blob(ws + a_bytes + b_bytes, {mb, nb}, a.options().dtype(at::kFloat));
        at::mm_out(p, a_mat, b_mat);
        c_tile.copy_(p);
      }
    }
  }
  return c;
}

}  // namespace

namespace cpu {
GemmCounts gemm_counts() {
  GemmCounts c;
  c.fp32 = g_fp32.load();
  c.bf16 = g_bf16.load();
  c.bf16_to_fp32 = g_bf16_to_fp32.load();
  return c;
}
int64_t matmul_workspace_bytes() { return TileWorkspace::get().bytes(); }
int64_t free_matmul_workspace() { return TileWorkspace::get().free(); }
void reset_gemm_counts() {
  g_fp32 = 0;
  g_bf16 = 0;
  g_bf16_to_fp32 = 0;
}
}  // namespace cpu

TORCH_LIBRARY_IMPL(zrw, CPU, m) {
  m.impl("mx_quantize", &mx_quantize_cpu);
  m.impl("mx_quantize_dual", &mx_quantize_dual_cpu);
  m.impl("mx_quantize_block", &mx_quantize_block_cpu);
  m.impl("mx_quantize_from_master", &mx_quantize_from_master_cpu);
  m.impl("mx_quantize_dual_from_master", &mx_quantize_dual_from_master_cpu);
  m.impl("mx_quantize_block_from_master", &mx_quantize_block_from_master_cpu);
  m.impl("mx_dequantize", &mx_dequantize_cpu);
  m.impl("mx_matmul", &mx_matmul_cpu);
}

}  // namespace zrw
