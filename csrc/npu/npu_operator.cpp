// Boxed calls of torch_npu's operators by argument name; see npu_operator.h.
#include "npu_operator.h"

#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <sstream>

namespace zrw::npu {
namespace {

c10::OperatorHandle find_operator(const std::string& caller, const std::string& name) {
  auto op = c10::Dispatcher::singleton().findSchema({"npu::" + name, ""});
  TORCH_CHECK(op.has_value(), caller, " on an NPU tensor calls torch_npu's operator npu::", name,
              ", which is not registered in this process: `import torch_npu` before calling zrw "
              "on NPU tensors. zrw needs ",
              kTorchNpuNeeded);
  return *op;
}

}  // namespace

NpuOperator::NpuOperator(const char* caller, const char* name)
    : caller_(caller),
      name_(name),
      op_(find_operator(caller_, name_)),
      values_(op_.schema().arguments().size()) {}

std::optional<size_t> NpuOperator::index_of(const char* name) const {
  const auto& args = schema().arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() == name) return i;
  }
  return std::nullopt;
}

void NpuOperator::fail_missing(const char* name, const char* why) const {
  std::ostringstream s;
  s << schema();
  TORCH_CHECK(false, caller_, ": the installed torch_npu's npu::", name_, " has no argument '",
              name, "', which ", why, "; installed schema: ", s.str(), ". zrw needs ",
              kTorchNpuNeeded);
}

NpuOperator& NpuOperator::arg(const char* name, c10::IValue value) {
  const auto i = index_of(name);
  if (!i) fail_missing(name, "zrw must pass");
  const c10::Argument& a = schema().arguments()[*i];
  // The unboxing wrapper trusts the stack; a value of another type must not reach it.
  TORCH_CHECK(value.type()->isSubtypeOf(*a.type()), caller_,
              ": the installed torch_npu's npu::", name_, " takes argument '", name, "' as ",
              a.type()->repr_str(), ", but zrw passes ", value.type()->repr_str(), ". zrw needs ",
              kTorchNpuNeeded);
  values_[*i] = std::move(value);
  return *this;
}

NpuOperator& NpuOperator::arg_or_default(const char* name, c10::IValue value,
                                         bool value_is_default) {
  if (index_of(name)) return arg(name, std::move(value));
  if (!value_is_default) fail_missing(name, "the requested behaviour needs");
  return *this;
}

std::vector<c10::IValue> NpuOperator::call() {
  const auto& args = schema().arguments();
  torch::jit::Stack stack;
  stack.reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    if (values_[i]) {
      stack.push_back(*values_[i]);
    } else if (args[i].default_value()) {
      stack.push_back(*args[i].default_value());
    } else {
      std::ostringstream s;
      s << schema();
      TORCH_CHECK(false, caller_, ": the installed torch_npu's npu::", name_,
                  " has a required argument '", args[i].name(),
                  "' that zrw does not know; installed schema: ", s.str(), ". zrw was written for ",
                  kTorchNpuNeeded);
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op_.callBoxed(stack);
  }
  return std::vector<c10::IValue>(std::make_move_iterator(stack.begin()),
                                  std::make_move_iterator(stack.end()));
}

}  // namespace zrw::npu
