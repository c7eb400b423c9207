// Calling torch_npu's operators (namespace `npu`) through the dispatcher, without torch_npu's or
// CANN's headers.
//
// The schemas of torch_npu's MX operators differ between releases (docs/npu.md §5.2: 26.0.0
// lacks `dst_type_max` in the dual-axis op, 26.0.0/26.1.0 lack `max_low_bound`, 7.x has no MX ops
// and another npu_quant_matmul). A typed call (`findSchemaOrThrow(...).typed<Sig>()`) must match
// the installed schema exactly, so NpuOperator reads the schema found at run time instead: it
// places each argument by NAME, fills everything it was not given from the schema's defaults, and
// calls boxed. A missing operator, a missing argument that matters, or an argument of another
// type is a clear error naming the operator, the argument and the torch_npu needed.
//
// The operator is looked up on every call, never cached: a handle outlives neither the library
// that defined the schema (the CPU tests define and remove stand-ins) nor a torch_npu reload, and
// one hash lookup is nothing next to an NPU kernel launch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <vector>

namespace zrw::npu {

// The torch_npu zrw is checked against, as messages name it: 2.13.0, the one release for torch
// 2.13 (its wheel requires torch==2.13.0.*), built from Ascend Extension for PyTorch 26.2.0
// (branch v2.13.0-26.2.0). Its operator schemas and meta functions are the ones the CPU tests
// hold the adapter to (tests/npu/test_real_torch_npu.py). Ascend numbers the releases that carry
// the MX operators by op-plugin tag (7.x: none; 26.0.0: all of them), not by torch_npu's pip
// version (which follows torch's).
constexpr const char* kTorchNpuNeeded =
    "torch_npu 2.13.0 (the release for torch 2.13, from Ascend Extension for PyTorch 26.2.0; "
    "op-plugin 26.0.0 was the first with the MX operators, 7.x releases have none) on an Ascend "
    "950PR/950DT";

class NpuOperator {
 public:
  // Finds npu::<name>; `caller` (e.g. "zrw.mx_quantize") is named in every error.
  NpuOperator(const char* caller, const char* name);

  // An argument the call cannot do without: an error if the installed schema lacks it.
  NpuOperator& arg(const char* name, c10::IValue value);

  // An argument whose absence from the installed schema is fine when `value` is what the
  // operator does without it (its documented default); an error otherwise, saying that this
  // torch_npu cannot do what was asked.
  NpuOperator& arg_or_default(const char* name, c10::IValue value, bool value_is_default);

  // Fills the unset arguments from the schema's defaults and calls the operator boxed, below the
  // autograd keys (the outputs are FP8 data, never part of a graph). Returns its outputs.
  std::vector<c10::IValue> call();

  const c10::FunctionSchema& schema() const { return op_.schema(); }

 private:
  std::optional<size_t> index_of(const char* name) const;
  [[noreturn]] void fail_missing(const char* name, const char* why) const;

  std::string caller_;
  std::string name_;
  c10::OperatorHandle op_;
  std::vector<std::optional<c10::IValue>> values_;
};

}  // namespace zrw::npu
