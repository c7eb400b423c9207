// CPU kernels of the MX ops: the reference backend. Argument checks and output allocation live
// here; the quantization and dequantization loops are in mx_cpu_quant_kernel.cpp and
// mx_cpu_dequant_kernel.cpp, compiled once per instruction set.
//
// mx_matmul is emulated: operands are dequantized to fp32 (exact), the weight-side operand tile
// by tile, and multiplied with the fp32 GEMM (MKL). On CPUs without fast bf16 GEMM that is
// several times faster than a bf16 matmul of the same shape.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../common/checks.h"
#include "../common/mx_format.h"
#include "mx_cpu_kernels.h"


namespace zrw {
namespace {

using mx::ElemFormat;
using mx::ScaleMode;
using mx::kBlock;

ElemFormat elem_format(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn ? ElemFormat::E4M3 : ElemFormat::E5M2;
}

uint8_t* bytes_of(at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

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

  const at::Tensor xc = x.contiguous();
  auto data = at::empty(x.sizes(), x.options().dtype(elem_dtype));
  auto scale = at::empty(checks::scale_shape_along(x.sizes(), d),
                         x.options().dtype(at::kFloat8_e8m0fnu));
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
    cpu::quantize_matrices(xc.const_data_ptr(), xc.scalar_type(), 1, outer, D, fmt, mode, o);
  } else {
    // Blocks run across rows: `outer` matrices (D, inner), blocks down their columns.
    o.col_data = dp;
    o.col_scale = sp;
    cpu::quantize_matrices(xc.const_data_ptr(), xc.scalar_type(), outer, D, inner, fmt, mode, o);
  }
  return {data, scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mx_quantize_dual_cpu(
    const at::Tensor& w, at::ScalarType elem_dtype, c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize_dual";
  checks::check_device(op, "w", w, c10::DeviceType::CPU);
  const ScaleMode mode = checks::check_weight_quantize_args(op, w, elem_dtype, scale_mode);

  const at::Tensor wc = w.contiguous();
  const int64_t nd = w.dim();
  const int64_t E = nd == 3 ? w.size(0) : 1, N = w.size(nd - 2), K = w.size(nd - 1);
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
  cpu::quantize_matrices(wc.const_data_ptr(), wc.scalar_type(), E, N, K, elem_format(elem_dtype),
                         mode, o);
  return {data_fwd, scale_fwd, data_bwd, scale_bwd};
}

std::tuple<at::Tensor, at::Tensor> mx_quantize_block_cpu(const at::Tensor& w,
                                                          at::ScalarType elem_dtype,
                                                          c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize_block";
  checks::check_device(op, "w", w, c10::DeviceType::CPU);
  const ScaleMode mode = checks::check_weight_quantize_args(op, w, elem_dtype, scale_mode);

  const at::Tensor wc = w.contiguous();
  const int64_t nd = w.dim();
  const int64_t E = nd == 3 ? w.size(0) : 1, N = w.size(nd - 2), K = w.size(nd - 1);
  const int64_t NB = mx::ceil_div(N, kBlock), KB = mx::ceil_div(K, kBlock);
  auto data = at::empty(w.sizes(), w.options().dtype(elem_dtype));
  std::vector<int64_t> bshape(w.sizes().begin(), w.sizes().end());
  bshape[nd - 2] = NB;
  bshape[nd - 1] = KB;
  auto block_scale = at::empty(bshape, w.options().dtype(at::kFloat8_e8m0fnu));
  cpu::QuantOutputs o;
  o.tile_data = bytes_of(data);
  o.tile_scale = bytes_of(block_scale);
  cpu::quantize_matrices(wc.const_data_ptr(), wc.scalar_type(), E, N, K, elem_format(elem_dtype),
                         mode, o);
  return {data, block_scale};
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
                                    sp + ((g / D) * DB + (g % D) / kBlock) * inner, inner,
                                    op_ + g * inner);
      }
    });
  }
  return out_dtype == at::kFloat ? out : out.to(out_dtype);
}

// ---------------------------------------------------------------------------------------------
// mx_matmul.

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
        rows(d.size(0)), k(d.size(1)), s_row(d.stride(0)), s_k(d.stride(1)),
        scale(static_cast<const uint8_t*>(s.const_data_ptr())),
        ss_row(s.stride(0)), ss_kb(s.stride(1)),
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

  // Rows [r0, r0 + nr) into `buf` as fp32 (exact): row-major (nr, K), or, when col_major(),
  // in the bytes' own order (K, nr).
  void dequantize_rows(int64_t r0, int64_t nr, float* buf) const {
    if (col_major()) {
      // Column kk of the rows: contiguous bytes, one scale per row (contiguous when the scale
      // is the .t() of a contiguous tensor, as the layers pass it).
      at::parallel_for(0, k, 64, [&](int64_t kb, int64_t ke) {
        for (int64_t kk = kb; kk < ke; ++kk) {
          const uint8_t* d = data + kk * s_k + r0;
          const uint8_t* s = scale + (kk / kBlock) * ss_kb + r0 * ss_row;
          float* o = buf + kk * nr;
          if (ss_row == 1) {
            cpu::dequantize_per_element(fmt, d, s, nr, o);
          } else {
            for (int64_t r = 0; r < nr; ++r) o[r] = value(r0 + r, kk);
          }
        }
      });
    } else {
      at::parallel_for(0, nr, 8, [&](int64_t rb, int64_t re) {
        for (int64_t r = rb; r < re; ++r) {
          float* o = buf + r * k;
          if (s_k == 1 && ss_kb == 1) {
            cpu::dequantize_row_blocks(fmt, data + (r0 + r) * s_row, scale + (r0 + r) * ss_row,
                                       k, o);
          } else {
            for (int64_t kk = 0; kk < k; ++kk) o[kk] = value(r0 + r, kk);
          }
        }
      });
    }
  }
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
  auto c = at::empty({M, N}, a.options().dtype(out_dtype));
  if (M == 0 || N == 0 || K == 0) return c.zero_();
  const MxOperand A(a, a_scale), B(b, b_scale);
  const auto f32 = a.options().dtype(at::kFloat);

  // Both operands are dequantized in row tiles, A's of at most 2^22 fp32 elements (16 MiB), B's
  // of 2^21 (8 MiB), and each A tile is multiplied by every B tile: no operand ever exists whole
  // in fp32. B is dequantized again for every A tile (unless it fits one tile), which costs little
  // next to the GEMM (dequantization runs at a few bytes per ns, the GEMM does K flops per byte).
  auto rows_per_tile = [&](int64_t rows, int64_t elems) {
    return std::min(rows, std::max<int64_t>(64, elems / K / 64 * 64));
  };
  const int64_t a_tile = rows_per_tile(M, int64_t{1} << 22);
  const int64_t b_tile = rows_per_tile(N, int64_t{1} << 21);
  at::Tensor a32 = at::empty({a_tile * K}, f32);
  at::Tensor b32 = at::empty({b_tile * K}, f32);
  // For a bf16/fp16 result, each tile's fp32 product is cast into it: no (M, N) fp32 copy.
  const bool fp32_out = out_dtype == at::kFloat;
  at::Tensor c32 = fp32_out ? at::Tensor() : at::empty({a_tile * b_tile}, f32);
  // (rows, K) tile as a GEMM operand: row-major, or a column-major tile (K, rows) transposed.
  auto tile_rows_by_k = [&](const MxOperand& op, at::Tensor& buf, int64_t rows) {
    const at::Tensor t = buf.narrow(0, 0, rows * K);
    return op.col_major() ? t.view({K, rows}).t() : t.view({rows, K});
  };
  const bool b_once = b_tile == N;
  if (b_once) B.dequantize_rows(0, N, b32.data_ptr<float>());
  for (int64_t m0 = 0; m0 < M; m0 += a_tile) {
    const int64_t mb = std::min(a_tile, M - m0);
    A.dequantize_rows(m0, mb, a32.data_ptr<float>());
    const at::Tensor a_mat = tile_rows_by_k(A, a32, mb);
    for (int64_t n0 = 0; n0 < N; n0 += b_tile) {
      const int64_t nb = std::min(b_tile, N - n0);
      if (!b_once) B.dequantize_rows(n0, nb, b32.data_ptr<float>());
      const at::Tensor b_mat = tile_rows_by_k(B, b32, nb).t();  // (K, nb)
      at::Tensor c_tile = c.narrow(0, m0, mb).narrow(1, n0, nb);
      if (fp32_out) {
        at::mm_out(c_tile, a_mat, b_mat);
      } else {
        at::Tensor p = c32.narrow(0, 0, mb * nb).view({mb, nb});
        at::mm_out(p, a_mat, b_mat);
        c_tile.copy_(p);
      }
    }
  }
  return c;
}

}  // namespace

TORCH_LIBRARY_IMPL(zrw, CPU, m) {
  m.impl("mx_quantize", &mx_quantize_cpu);
  m.impl("mx_quantize_dual", &mx_quantize_dual_cpu);
  m.impl("mx_quantize_block", &mx_quantize_block_cpu);
  m.impl("mx_dequantize", &mx_dequantize_cpu);
  m.impl("mx_matmul", &mx_matmul_cpu);
}

}  // namespace zrw
