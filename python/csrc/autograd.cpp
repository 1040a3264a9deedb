// Autograd of the differentiable fusednorm operators (rms_norm, rms_norm_fwd, layer_norm,
// layer_norm_fwd), registered in C++ for the Autograd dispatch key. Their backward is the
// fused backward operator, which is not differentiable itself: a double backward raises when
// it reaches it (once_differentiable_kernel, below), and forward-mode AD is refused.
//
// Why C++ and not torch.library.register_autograd: a Python autograd registration puts a
// Python kernel on every call, with or without gradients. Measured with callgrind on the
// 1 x 4096 fp32 decode call (1000 calls of torch.ops.fusednorm.rms_norm, AVX2, 2 threads):
// 61.9 M instructions, 49.4 M of them inside torch's PythonKernelHolder, against 25.9 M for
// torch.add(x, 1). Here a call without gradients costs one GradMode / requires_grad check.
//
// Each kernel calls the operators below autograd through the dispatcher, so the same code
// serves CPU, CUDA and fake tensors (torch.compile traces it like any C++ autograd kernel).
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include "ops.h"

namespace fusednorm::torch_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptTensor&,
                                                            double, double)>
rms_norm_fwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusednorm::rms_norm_fwd", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(
                                 const at::Tensor&, const OptTensor&, double, double)>();
  return op;
}

c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const OptTensor&, double, double)>
rms_norm_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fusednorm::rms_norm", "")
          .typed<at::Tensor(const at::Tensor&, const OptTensor&, double, double)>();
  return op;
}

using RmsNormBackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                              const OptTensor&, const OptTensor&,
                                                              double, double, bool,
                                                              const OptTensor&);
c10::TypedOperatorHandle<RmsNormBackwardSig> rms_norm_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusednorm::rms_norm_backward", "")
                             .typed<RmsNormBackwardSig>();
  return op;
}

using LayerNormFwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&,
                                                                       const OptTensor&,
                                                                       const OptTensor&, double);
c10::TypedOperatorHandle<LayerNormFwdSig> layer_norm_fwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusednorm::layer_norm_fwd", "")
                             .typed<LayerNormFwdSig>();
  return op;
}

using LayerNormSig = at::Tensor(const at::Tensor&, const OptTensor&, const OptTensor&, double);
c10::TypedOperatorHandle<LayerNormSig> layer_norm_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusednorm::layer_norm", "")
                             .typed<LayerNormSig>();
  return op;
}

using LayerNormBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
    double, bool, bool);
c10::TypedOperatorHandle<LayerNormBackwardSig> layer_norm_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusednorm::layer_norm_backward", "")
                             .typed<LayerNormBackwardSig>();
  return op;
}

bool requires_grad(const OptTensor& t) {
  return t.has_value() && t->defined() && t->requires_grad();
}

bool needs_grad(const at::Tensor& x, const OptTensor& a, const OptTensor& b = std::nullopt) {
  return at::GradMode::is_enabled() && (x.requires_grad() || requires_grad(a) || requires_grad(b));
}

// Forward-mode AD (torch.autograd.forward_ad, torch.func.jvp and jacfwd) has no formula in
// fusednorm: an input carrying a tangent is refused. Without this check its tangent was
// dropped and the output's came out as zeros (jacfwd gave a zero Jacobian), silently.
// op: the operator's full name ("fusednorm::rms_norm"); nothing is built unless it fails
// (these checks run on every call of the forward).
void refuse_tangent(const char* op, const char* argument, const at::Tensor& t) {
  if (t.defined() && t._fw_grad(/*level=*/0).defined()) {
    TORCH_CHECK(false, op, ": argument '", argument,
                "' carries a forward-mode tangent: forward-mode AD (torch.func.jvp, jacfwd, "
                "torch.autograd.forward_ad) is not supported; reverse mode is");
  }
}
void refuse_tangents(const char* op, const at::Tensor& x, const OptTensor& weight,
                     const OptTensor& bias = std::nullopt) {
  refuse_tangent(op, "x", x);
  if (weight.has_value()) refuse_tangent(op, "weight", *weight);
  if (bias.has_value()) refuse_tangent(op, "bias", *bias);
}

OptTensor present(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// The incoming gradient in x's dtype (an upstream op may hand back another float dtype).
at::Tensor as_dtype_of(const at::Tensor& dy, const at::Tensor& x) {
  return dy.scalar_type() == x.scalar_type() ? dy : dy.to(x.scalar_type());
}

// y, rstd = rms_norm_fwd(x, weight); the backward reads the saved rstd instead of
// recomputing the statistics.
class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptTensor& weight,
                               double eps, double weight_offset) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd] = rms_norm_fwd_op().call(x, weight, eps, weight_offset);
    ctx->save_for_backward({x, weight.value_or(at::Tensor()), rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["weight_offset"] = weight_offset;
    ctx->mark_non_differentiable({rstd});
    return {y, rstd};
  }

  // The gradient arriving for rstd is ignored: it is an auxiliary, non-differentiable output.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const OptTensor weight = present(saved[1]);
    // needs_input_grad counts the tensors actually passed (an absent weight has no edge).
    const bool want_dx = ctx->needs_input_grad(0);
    const bool want_dw = weight.has_value() && ctx->needs_input_grad(1);
    auto [dx, dw] = rms_norm_backward_op().call(
        as_dtype_of(grads[0], x), x, weight, saved[2], ctx->saved_data["eps"].toDouble(),
        ctx->saved_data["weight_offset"].toDouble(), want_dw, /*dx_addend=*/std::nullopt);
    return {want_dx ? dx : at::Tensor(), want_dw ? dw : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// y, mean, rstd = layer_norm_fwd(x, weight, bias).
class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptTensor& weight,
                               const OptTensor& bias, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, mean, rstd] = layer_norm_fwd_op().call(x, weight, bias, eps);
    ctx->save_for_backward({x, weight.value_or(at::Tensor()), mean, rstd});
    ctx->saved_data["eps"] = eps;
    // db comes back in the weight's dtype (else x's); the bias may differ (fp32 bias with
    // a bf16 weight), and its gradient must have its dtype.
    if (bias.has_value() && bias->defined()) ctx->saved_data["bias_dtype"] = bias->scalar_type();
    ctx->mark_non_differentiable({mean, rstd});
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const OptTensor weight = present(saved[1]);
    // needs_input_grad counts the tensors actually passed (absent optionals have no edge).
    const bool want_dx = ctx->needs_input_grad(0);
    const bool want_dw = weight.has_value() && ctx->needs_input_grad(1);
    const bool has_bias = ctx->saved_data.count("bias_dtype") != 0;
    const bool want_db = has_bias && ctx->needs_input_grad(weight.has_value() ? 2 : 1);
    auto [dx, dw, db] =
        layer_norm_backward_op().call(as_dtype_of(grads[0], x), x, weight, saved[2], saved[3],
                                      ctx->saved_data["eps"].toDouble(), want_dw, want_db);
    if (want_db) {
      const auto bias_dtype = ctx->saved_data["bias_dtype"].toScalarType();
      if (db.scalar_type() != bias_dtype) db = db.to(bias_dtype);
    }
    return {want_dx ? dx : at::Tensor(), want_dw ? dw : at::Tensor(), want_db ? db : at::Tensor(),
            at::Tensor()};
  }
};

// Autograd kernel of every .out overload: like torch's own out= functions they record no
// gradient, so an input that requires grad under grad mode is refused (instead of a result
// silently cut from the graph); otherwise the call goes straight to the backend.
void out_records_no_gradient(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                             torch::jit::Stack* stack) {
  if (at::GradMode::is_enabled()) {
    const auto& arguments = op.schema().arguments();
    const std::size_t first = stack->size() - arguments.size();
    for (std::size_t i = 0; i < arguments.size(); ++i) {
      const c10::IValue& v = (*stack)[first + i];
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad()) {
        TORCH_CHECK(false, op.schema().operator_name(), ": argument '", arguments[i].name(),
                    "': requires grad, but out= records no gradient; call it without out= "
                    "(or under torch.no_grad())");
      }
    }
  }
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

// Autograd kernel of the operators that have no derivative: the backward operators and
// the two-phase ones. Under grad mode with an input that requires grad (a backward run with
// create_graph=True on its way to a double backward), the floating-point outputs get a
// grad_fn that raises when reached (as torch's once_differentiable does); the autograd
// fallback's outputs would instead have given silently zero second derivatives (checked:
// tests/python/test_ops.py). A forward-mode tangent is refused.
void once_differentiable_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                                torch::jit::Stack* stack) {
  const std::string& name = op.schema().operator_name().name;
  const auto& arguments = op.schema().arguments();
  const std::size_t first = stack->size() - arguments.size();
  variable_list inputs;  // those that require grad
  for (std::size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (!v.isTensor()) continue;
    refuse_tangent(name.c_str(), arguments[i].name().c_str(), v.toTensor());
    if (v.toTensor().requires_grad()) inputs.push_back(v.toTensor());
  }
  const bool wants_grad = !inputs.empty() && at::GradMode::is_enabled();
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  if (!wants_grad) return;
  // One node whose edges lead to the inputs (so that they are reachable from the outputs,
  // and autograd.grad gets as far as the node) and which raises when run.
  auto error = std::make_shared<torch::autograd::Error>(
      name +
          " has no derivative: differentiating through fusednorm's backward (double "
          "backward, e.g. autograd.grad with create_graph=True, then grad again) is not "
          "supported",
      torch::autograd::collect_next_edges(inputs));
  const std::size_t outputs = op.schema().returns().size();
  for (std::size_t j = stack->size() - outputs; j < stack->size(); ++j) {
    const c10::IValue& v = (*stack)[j];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_floating_point()) {
      torch::autograd::set_history(v.toTensor(), error);
    }
  }
}

}  // namespace
}  // namespace fusednorm::torch_ext

TORCH_LIBRARY_IMPL(fusednorm, Autograd, m) {
  using namespace fusednorm::torch_ext;
  m.impl("rms_norm",
         [](const at::Tensor& x, const OptTensor& weight, double eps, double weight_offset) {
           refuse_tangents("fusednorm::rms_norm", x, weight);
           if (!needs_grad(x, weight)) {
             at::AutoDispatchBelowADInplaceOrView guard;
             return rms_norm_op().call(x, weight, eps, weight_offset);
           }
           return RmsNormFunction::apply(x, weight, eps, weight_offset)[0];
         });
  m.impl("rms_norm_fwd",
         [](const at::Tensor& x, const OptTensor& weight, double eps, double weight_offset) {
           refuse_tangents("fusednorm::rms_norm_fwd", x, weight);
           auto out = RmsNormFunction::apply(x, weight, eps, weight_offset);
           return std::make_tuple(out[0], out[1]);
         });
  m.impl("layer_norm",
         [](const at::Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps) {
           refuse_tangents("fusednorm::layer_norm", x, weight, bias);
           if (!needs_grad(x, weight, bias)) {
             at::AutoDispatchBelowADInplaceOrView guard;
             return layer_norm_op().call(x, weight, bias, eps);
           }
           return LayerNormFunction::apply(x, weight, bias, eps)[0];
         });
  m.impl("layer_norm_fwd",
         [](const at::Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps) {
           refuse_tangents("fusednorm::layer_norm_fwd", x, weight, bias);
           auto out = LayerNormFunction::apply(x, weight, bias, eps);
           return std::make_tuple(out[0], out[1], out[2]);
         });
  for (const char* name : {"rms_norm.out", "rms_norm_fwd.out", "fused_add_rms_norm.out",
                           "layer_norm.out", "layer_norm_fwd.out"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&out_records_no_gradient>());
  }
  for (const char* name :
       {"rms_norm_backward", "rms_norm_partial_sum_squares", "fused_add_partial_sum_squares",
        "rms_norm_from_sum_squares", "rms_norm_backward_partial_sums",
        "rms_norm_backward_from_sums", "layer_norm_backward", "layer_norm_partial_sums",
        "layer_norm_partial_squared_deviations", "layer_norm_from_sums",
        "layer_norm_backward_partial_sums", "layer_norm_backward_from_sums"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&once_differentiable_kernel>());
  }
}
