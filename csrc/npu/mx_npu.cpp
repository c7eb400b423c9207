// The NPU adapter: zrw's MX ops for the PrivateUse1 key (Ascend NPUs under torch_npu), built on
// torch_npu's MX operators, which are called through the dispatcher (npu_operator.h) so that this
// file needs no torch_npu or CANN headers and builds into zrw._C everywhere. The kernels return
// exactly what the CPU kernels return (docs/design.md §3): torch_npu's paired uint8 scales are
// converted to zrw's canonical float8_e8m0fnu ones inside each kernel (mx_layout.h), and back for
// npu_quant_matmul.
//
// Copies, unlike the CPU emulation (whose mx_matmul never copies an FP8 operand):
//  - npu_quant_matmul in MX mode needs K % 64 == 0, so for other K both FP8 operands are copied
//    into zero-padded ones (zero elements add nothing whatever their scale). For K % 64 == 0 the
//    row-major operands and the .t() views training passes (W_bwd.t(), Q_M(dy).t(), Q_M(x).t())
//    go to the operator as they are, as operands with the transpose attribute; any other strided
//    operand is made contiguous first.
//  - every call converts the scales it passes or returns (1/32 of the data) between layouts.
//
// Every kernel looks its torch_npu operator up before touching a tensor, so without torch_npu the
// first error is the one that says which operator and which torch_npu are needed.
//
// Verified only on CPU, against stand-in npu:: operators built from the documented semantics
// (tests/npu), whose schemas and output dtypes/shapes the tests hold to the real torch_npu 2.13.0
// wheel (its codegen yaml and meta functions); nothing here has run on an NPU (docs/npu.md §7).
//
// This file registers nothing: zrw._C registers these kernels for PrivateUse1
// (mx_npu_registration.cpp), and the test library for the CPU key of its mirror namespace
// (npu_test_ops.cpp); both link the same compiled code (CMakeLists.txt, zrw_npu_adapter).
#include "mx_npu.h"

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

#include "../common/checks.h"
#include "../common/mx_format.h"
#include "mx_layout.h"
#include "npu_operator.h"

namespace zrw::npu {
namespace {

using mx::kBlock;
using mx::ScaleMode;

// torch_npu's dtype codes (docs/npu.md §5.3): below 256 they are PyTorch ScalarType values;
// 293 is torch_npu.float8_e8m0fnu (256 + ACL_FLOAT8_E8M0), which tells npu_quant_matmul that its
// uint8 scales hold E8M0 bytes.
constexpr int64_t kNpuFloat8E8M0 = 293;
static_assert(static_cast<int>(at::ScalarType::Float8_e5m2) == 23 &&
                  static_cast<int>(at::ScalarType::Float8_e4m3fn) == 24 &&
                  static_cast<int>(at::ScalarType::BFloat16) == 15 &&
                  static_cast<int>(at::ScalarType::Half) == 5 &&
                  static_cast<int>(at::ScalarType::Float) == 6,
              "torch_npu's dtype codes below 256 are these ScalarType values");

int64_t dtype_code(at::ScalarType t) { return static_cast<int64_t>(t); }

// scale_alg: 0 is the OCP floor rule, 1 the cuBLAS-style rounded-up exponent (= zrw's rceil).
int64_t scale_alg(ScaleMode mode) { return mode == ScaleMode::Floor ? 0 : 1; }

// npu_quant_matmul in MX mode: two 32-blocks per scale pair, so K must be a multiple of 64.
constexpr int64_t kMatmulKAlign = 64;

void check_same_device(const char* op, const char* arg, const at::Tensor& t, const char* ref_arg,
                       const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", arg, " must be on the device of ", ref_arg,
              " (", ref.device(), "), got a tensor on ", t.device());
}

// The arguments every torch_npu MX quantization operator takes (arguments are placed by name, so
// callers add their own before call()): the element dtype explicitly — the default dst_type,
// 296, is FP4 — round-to-nearest-even, and the scale rule.
NpuOperator& mx_quant_args(NpuOperator& npu_op, const at::Tensor& input, at::ScalarType elem_dtype,
                           ScaleMode mode) {
  return npu_op.arg("input", input)
      .arg("dst_type", dtype_code(elem_dtype))
      .arg_or_default("round_mode", std::string("rint"), true)
      .arg_or_default("scale_alg", scale_alg(mode), mode == ScaleMode::Floor);
}

// What an npu:: operator returned, checked before zrw trusts it: a torch_npu that ignored
// dst_type (FP4 comes back as uint8 of half the width) or changed a layout fails here, naming the
// operator, instead of corrupting what comes after.
void check_outputs(const char* op, const char* npu_op, const std::vector<c10::IValue>& out,
                   size_t n) {
  bool ok = out.size() == n;
  for (const auto& v : out) ok = ok && v.isTensor();
  TORCH_CHECK(ok, op, ": npu::", npu_op, " returned ", out.size(), " values, expected ", n,
              " tensors. zrw needs ", kTorchNpuNeeded);
}

at::Tensor returned(const char* op, const char* npu_op, const char* what, const c10::IValue& v,
                    at::ScalarType dtype, at::IntArrayRef shape) {
  at::Tensor t = v.toTensor();
  TORCH_CHECK(t.scalar_type() == dtype && t.sizes() == shape, op, ": npu::", npu_op, " returned ",
              what, " of dtype ", t.scalar_type(), " and shape ", t.sizes(), ", expected ", dtype,
              " and ", shape, ". zrw needs ", kTorchNpuNeeded);
  return t;
}

// torch_npu returns scales as uint8 (every documented release); float8_e8m0fnu is taken too.
at::Tensor returned_scale(const char* op, const char* npu_op, const char* what,
                          const c10::IValue& v, at::IntArrayRef shape) {
  at::Tensor t = v.toTensor();
  TORCH_CHECK((t.scalar_type() == at::kByte || t.scalar_type() == at::kFloat8_e8m0fnu) &&
                  t.sizes() == shape,
              op, ": npu::", npu_op, " returned ", what, " of dtype ", t.scalar_type(),
              " and shape ", t.sizes(), ", expected torch.uint8 pairs of shape ", shape,
              ". zrw needs ", kTorchNpuNeeded);
  return t;
}

at::Tensor empty_scale(at::IntArrayRef shape, const at::Tensor& like) {
  return at::empty(shape, like.options().dtype(at::kFloat8_e8m0fnu));
}

// ---------------------------------------------------------------------------------------------
// Quantization.

// One-axis quantization with npu_dynamic_mx_quant. x is handed over as (outer, D) blocked along
// -1 or (outer, D, inner) blocked along -2, the two documented cases of the operator
// (docs/npu.md §5.4), which also keeps any rank within its 1-7 dims. A float32 x needs at least 32
// elements along the quantized axis (torch_npu 2.13.0's docstring of the operator): a shorter
// axis is zero-padded to one block, which changes no block's amax (zrw counts the missing
// elements of a partial block as 0, docs/design.md §3), and the data narrowed back.
std::tuple<at::Tensor, at::Tensor> quantize_along(const char* op, const at::Tensor& x, int64_t d,
                                                  at::ScalarType elem_dtype, ScaleMode mode) {
  constexpr const char* npu_name = "npu_dynamic_mx_quant";
  NpuOperator npu_op(op, npu_name);
  const auto scale_shape = checks::scale_shape_along(x.sizes(), d);
  if (x.numel() == 0) {
    return {at::empty(x.sizes(), x.options().dtype(elem_dtype)), empty_scale(scale_shape, x)};
  }
  const int64_t D = x.size(d), blocks = mx::ceil_div(D, kBlock);
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < d; ++i) outer *= x.size(i);
  for (int64_t i = d + 1; i < x.dim(); ++i) inner *= x.size(i);
  const bool tail = inner == 1;
  const std::vector<int64_t> shape =
      tail ? std::vector<int64_t>{outer, D} : std::vector<int64_t>{outer, D, inner};
  std::vector<int64_t> canonical = shape;
  canonical[1] = blocks;
  const int64_t axis = tail ? -1 : -2;
  at::Tensor input = x.reshape(shape);
  std::vector<int64_t> input_shape = shape;
  const bool pad = x.scalar_type() == at::kFloat && D < kBlock;
  if (pad) {
    input_shape[1] = kBlock;
    input = tail ? at::constant_pad_nd(input, {0, kBlock - D})
                 : at::constant_pad_nd(input, {0, 0, 0, kBlock - D});
  }

  const auto out = mx_quant_args(npu_op, input, elem_dtype, mode)
                       .arg_or_default("axis", axis, axis == -1)
                       .arg_or_default("block_size", kBlock, true)
                       .call();
  check_outputs(op, npu_name, out, 2);
  at::Tensor data = returned(op, npu_name, "data", out[0], elem_dtype, input_shape);
  const at::Tensor paired =
      returned_scale(op, npu_name, "the scale", out[1], paired_scale_shape(canonical, 1));
  if (pad) data = data.narrow(1, 0, D).contiguous();
  return {data.reshape(x.sizes()), scale_from_paired(paired, 1, blocks).reshape(scale_shape)};
}

std::tuple<at::Tensor, at::Tensor> mx_quantize_npu(const at::Tensor& x, int64_t dim,
                                                   at::ScalarType elem_dtype,
                                                   c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize";
  checks::check_float_input(op, "x", x);
  checks::check_elem_dtype(op, "elem_dtype", elem_dtype);
  const ScaleMode mode = checks::parse_scale_mode(op, std::string(scale_mode));
  const int64_t d = checks::wrap_dim(op, "x", dim, x.dim());
  return quantize_along(op, x, d, elem_dtype, mode);
}

// Both axes of a checked weight w (op names the zrw op in errors).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_dual(const char* op,
                                                                         const at::Tensor& w,
                                                                         at::ScalarType elem_dtype,
                                                                         ScaleMode mode) {
  constexpr const char* npu_name = "npu_dynamic_mx_quant_with_dual_axis";
  const int64_t nd = w.dim();

  if (w.scalar_type() == at::kFloat) {
    // The dual-axis operator takes float16/bfloat16 only; the one-axis one takes float32 too.
    // Two calls read w twice but give the same bytes.
    auto [data_fwd, scale_fwd] = quantize_along(op, w, nd - 1, elem_dtype, mode);
    auto [data_bwd, scale_bwd] = quantize_along(op, w, nd - 2, elem_dtype, mode);
    return {data_fwd, scale_fwd, data_bwd, scale_bwd};
  }

  NpuOperator npu_op(op, npu_name);
  const auto fwd_shape = checks::scale_shape_along(w.sizes(), nd - 1);
  const auto bwd_shape = checks::scale_shape_along(w.sizes(), nd - 2);
  const auto fp8 = w.options().dtype(elem_dtype);
  if (w.numel() == 0) {
    return {at::empty(w.sizes(), fp8), empty_scale(fwd_shape, w), at::empty(w.sizes(), fp8),
            empty_scale(bwd_shape, w)};
  }
  const auto out = mx_quant_args(npu_op, w, elem_dtype, mode).call();
  check_outputs(op, npu_name, out, 4);
  // y1/mxscale1 are blocked along -1 (K: forward), y2/mxscale2 along -2 (N: backward).
  const at::Tensor data_fwd = returned(op, npu_name, "y1", out[0], elem_dtype, w.sizes());
  const at::Tensor s1 =
      returned_scale(op, npu_name, "mxscale1", out[1], paired_scale_shape(fwd_shape, nd - 1));
  const at::Tensor data_bwd = returned(op, npu_name, "y2", out[2], elem_dtype, w.sizes());
  const at::Tensor s2 =
      returned_scale(op, npu_name, "mxscale2", out[3], paired_scale_shape(bwd_shape, nd - 2));
  return {data_fwd, scale_from_paired(s1, nd - 1, fwd_shape[nd - 1]), data_bwd,
          scale_from_paired(s2, nd - 2, bwd_shape[nd - 2])};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mx_quantize_dual_npu(
    const at::Tensor& w, at::ScalarType elem_dtype, c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize_dual";
  const ScaleMode mode = checks::check_weight_quantize_args(op, w, elem_dtype, scale_mode);
  return quantize_dual(op, w, elem_dtype, mode);
}

// 32x32 tiles of a checked bf16/fp16 weight w.
std::tuple<at::Tensor, at::Tensor> quantize_block(const char* op, const at::Tensor& w,
                                                  at::ScalarType elem_dtype, ScaleMode mode) {
  constexpr const char* npu_name = "npu_dynamic_block_mx_quant";
  NpuOperator npu_op(op, npu_name);
  const int64_t nd = w.dim(), N = w.size(nd - 2), K = w.size(nd - 1);
  const auto fwd_shape = checks::scale_shape_along(w.sizes(), nd - 1);  // (..., N, KB)
  const auto bwd_shape = checks::scale_shape_along(w.sizes(), nd - 2);  // (..., NB, K)
  std::vector<int64_t> block_shape = fwd_shape;
  block_shape[nd - 2] = mx::ceil_div(N, kBlock);
  if (w.numel() == 0) {
    return {at::empty(w.sizes(), w.options().dtype(elem_dtype)), empty_scale(block_shape, w)};
  }
  const auto out = mx_quant_args(npu_op, w, elem_dtype, mode).call();
  check_outputs(op, npu_name, out, 3);
  const at::Tensor data = returned(op, npu_name, "y", out[0], elem_dtype, w.sizes());
  const at::Tensor s1 =
      returned_scale(op, npu_name, "scale1", out[1], paired_scale_shape(fwd_shape, nd - 1));
  returned_scale(op, npu_name, "scale2", out[2], paired_scale_shape(bwd_shape, nd - 2));
  // scale1 is each tile's scale broadcast over the tile's 32 rows (scale2 over its 32 columns,
  // the same bytes): the block scale is every 32nd row of scale1.
  const at::Tensor rows = scale_from_paired(s1, nd - 1, mx::ceil_div(K, kBlock)).view(at::kByte);
  return {data, rows.slice(nd - 2, 0, N, kBlock).contiguous().view(at::kFloat8_e8m0fnu)};
}

std::tuple<at::Tensor, at::Tensor> mx_quantize_block_npu(const at::Tensor& w,
                                                         at::ScalarType elem_dtype,
                                                         c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize_block";
  const ScaleMode mode = checks::check_weight_quantize_args(op, w, elem_dtype, scale_mode);
  TORCH_CHECK_TYPE(w.scalar_type() != at::kFloat, op,
                   ": on NPU, w must be torch.bfloat16 or torch.float16 (torch_npu's "
                   "npu_dynamic_block_mx_quant takes no float32), got torch.float32: cast the "
                   "weight first, use mx_quantize_block_from_master, or use the \"mxfp8\" recipe, "
                   "which takes float32 on NPU too");
  return quantize_block(op, w, elem_dtype, mode);
}

// ---------------------------------------------------------------------------------------------
// Quantization from an FP32 master. torch_npu has no MX quantization that rounds fp32 to the
// parameter dtype on the way, so on NPU these are cast + quantize, two passes: master.to(
// param_dtype) (one aten kernel, the rounding torch applies everywhere) materializes the rounded
// weight for the duration of the call, and the bf16/fp16 path above quantizes it, so the bytes
// are those of the CPU kernels' fused pass (docs/npu.md §4). The operator is looked up before the
// cast, so that without torch_npu the first error is still the one that names it.

at::Tensor master_as_param(const char* op, const char* npu_name, const at::Tensor& master,
                           at::ScalarType param_dtype) {
  NpuOperator lookup(op, npu_name);
  (void)lookup;
  return master.to(param_dtype);
}

std::tuple<at::Tensor, at::Tensor> mx_quantize_from_master_npu(const at::Tensor& master,
                                                               int64_t dim,
                                                               at::ScalarType param_dtype,
                                                               at::ScalarType elem_dtype,
                                                               c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize_from_master";
  constexpr const char* npu_name = "npu_dynamic_mx_quant";
  const auto [mode, d] = checks::check_mx_quantize_from_master_args(op, master, dim, param_dtype,
                                                                    elem_dtype, scale_mode);
  const at::Tensor w = master_as_param(op, npu_name, master, param_dtype);
  return quantize_along(op, w, d, elem_dtype, mode);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mx_quantize_dual_from_master_npu(
    const at::Tensor& master, at::ScalarType param_dtype, at::ScalarType elem_dtype,
    c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize_dual_from_master";
  constexpr const char* npu_name = "npu_dynamic_mx_quant_with_dual_axis";
  const ScaleMode mode =
      checks::check_master_weight_quantize_args(op, master, param_dtype, elem_dtype, scale_mode);
  const at::Tensor w = master_as_param(op, npu_name, master, param_dtype);
  return quantize_dual(op, w, elem_dtype, mode);
}

std::tuple<at::Tensor, at::Tensor> mx_quantize_block_from_master_npu(const at::Tensor& master,
                                                                     at::ScalarType param_dtype,
                                                                     at::ScalarType elem_dtype,
                                                                     c10::string_view scale_mode) {
  constexpr const char* op = "zrw.mx_quantize_block_from_master";
  constexpr const char* npu_name = "npu_dynamic_block_mx_quant";
  const ScaleMode mode =
      checks::check_master_weight_quantize_args(op, master, param_dtype, elem_dtype, scale_mode);
  const at::Tensor w = master_as_param(op, npu_name, master, param_dtype);
  return quantize_block(op, w, elem_dtype, mode);
}

// ---------------------------------------------------------------------------------------------
// Dequantization: ATen ops, exact like the CPU kernel. The element in fp32 times 2^(byte - 127)
// built from its bit pattern (byte << 23; byte 0 is the fp32 subnormal 2^-127, 0xFF NaN): an
// IEEE fp32 product rounds the exact product once, as the reference does, then to out_dtype.
// (An NPU that flushed fp32 subnormals would differ for scale byte 0; unverified.) torch_npu's
// npu_anti_mx_quant would do it in one kernel, but torch_npu 2.13.0 settles neither its scale
// layout (its meta function takes any mxscale shape; it has no docstring) nor its rounding or
// NaN handling (docs/npu.md §4.1).

at::Tensor mx_dequantize_npu(const at::Tensor& data, const at::Tensor& scale, int64_t dim,
                             at::ScalarType out_dtype) {
  constexpr const char* op = "zrw.mx_dequantize";
  check_same_device(op, "scale", scale, "data", data);
  const int64_t d = checks::check_mx_dequantize_args(op, data, scale, dim, out_dtype);
  if (data.numel() == 0) return at::empty(data.sizes(), data.options().dtype(out_dtype));

  const at::Tensor bytes = scale.view(at::kByte).to(at::kInt);
  at::Tensor bits = at::bitwise_left_shift(bytes, 23);
  bits = at::where(bytes == 0, 0x00400000, bits);              // 2^-127
  bits = at::where(bytes == mx::kScaleNaN, 0x7FC00000, bits);  // NaN
  const at::Tensor factor =
      bits.view(at::kFloat).repeat_interleave(kBlock, d).narrow(d, 0, data.size(d));
  return (data.to(at::kFloat) * factor).to(out_dtype).contiguous();
}

// ---------------------------------------------------------------------------------------------
// mx_matmul on npu_quant_matmul in MX mode (group_sizes [1, 1, 32]).

struct NpuOperand {
  at::Tensor data;    // (R, k_padded), row-major or column-major
  at::Tensor paired;  // (R, k_padded / 64, 2), with the same transpose attribute as data
};

// An operand as zrw passes it, (R, K) blocked along K with scale (R, ceil(K/32)), as
// npu_quant_matmul takes it. A column-major operand is the .t() of a tensor blocked along dim 0,
// whose paired scale (P, R, 2) is built along that dim and transposed back, so that data and
// scale share the transpose attribute (op-plugin refuses "Input x2 tensor and scale tensor's
// transpose are not same", docs/npu.md §5.7). The scale needs no padding: ceil(K/32) blocks pair up
// into ceil(K/64) = k_padded/64 pairs, and an odd count's pad byte, 0x00, scales zero elements
// only. Strides are made standard (with_standard_strides) so that op-plugin, which reads the
// attribute from them, sees what zrw decided even where a size-1 dim leaves contiguity ambiguous.
NpuOperand npu_operand(const at::Tensor& data, const at::Tensor& scale, int64_t k_padded) {
  const bool col_major = is_column_major(data);
  const at::Tensor d =
      col_major ? with_standard_strides(data.t()).t() : with_standard_strides(data.contiguous());
  const at::Tensor paired =
      col_major ? scale_to_paired(scale.t(), 0).transpose(0, 1) : scale_to_paired(scale, 1);
  return {pad_k(d, k_padded), paired};
}

at::Tensor mx_matmul_npu(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                         const at::Tensor& b_scale, at::ScalarType out_dtype) {
  constexpr const char* op = "zrw.mx_matmul";
  constexpr const char* npu_name = "npu_quant_matmul";
  check_same_device(op, "a_scale", a_scale, "a", a);
  check_same_device(op, "b", b, "a", a);
  check_same_device(op, "b_scale", b_scale, "a", a);
  checks::check_mx_matmul_args(op, a, a_scale, b, b_scale, out_dtype);

  NpuOperator npu_op(op, npu_name);
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  if (M == 0 || N == 0 || K == 0) return at::zeros({M, N}, a.options().dtype(out_dtype));
  const int64_t k_padded = mx::ceil_div(K, kMatmulKAlign) * kMatmulKAlign;
  const NpuOperand x1 = npu_operand(a, a_scale, k_padded);
  const NpuOperand w = npu_operand(b, b_scale, k_padded);
  // out = x1 (M, K) @ x2 (K, N) with x2 = b.t(), whose scale (K/64, N, 2) is b's paired scale
  // transposed: data and scale flip their transpose attribute together.
  const auto out = npu_op.arg("x1", x1.data)
                       .arg("x2", w.data.t())
                       .arg("scale", w.paired.transpose(0, 1))
                       .arg("pertoken_scale", x1.paired)
                       .arg("output_dtype", dtype_code(out_dtype))
                       .arg("scale_dtype", kNpuFloat8E8M0)
                       .arg("pertoken_scale_dtype", kNpuFloat8E8M0)
                       .arg("group_sizes", std::vector<int64_t>{1, 1, kBlock})
                       .call();
  check_outputs(op, npu_name, out, 1);
  return returned(op, npu_name, "the product", out[0], out_dtype, {M, N});
}

}  // namespace

void impl_mx_npu_kernels(torch::Library& m) {
  m.impl("mx_quantize", &mx_quantize_npu);
  m.impl("mx_quantize_dual", &mx_quantize_dual_npu);
  m.impl("mx_quantize_block", &mx_quantize_block_npu);
  m.impl("mx_quantize_from_master", &mx_quantize_from_master_npu);
  m.impl("mx_quantize_dual_from_master", &mx_quantize_dual_from_master_npu);
  m.impl("mx_quantize_block_from_master", &mx_quantize_block_from_master_npu);
  m.impl("mx_dequantize", &mx_dequantize_npu);
  m.impl("mx_matmul", &mx_matmul_npu);
}

}  // namespace zrw::npu
