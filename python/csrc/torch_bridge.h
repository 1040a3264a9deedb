// Tensor <-> fusednorm view conversion for the PyTorch operators: argument checks whose
// messages name the operator and the argument, the torch -> fusednorm dtype mapping (the
// only place it happens), and [..., D] tensors seen as rows x D views through their
// strides. Nothing here knows about a particular operator.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

#include "fusednorm/fusednorm.h"

namespace fusednorm::torch_ext {

// Raise a c10::Error (Python RuntimeError) reading
// "fusednorm::<op>: argument '<argument>': <message>", the same form as fusednorm::Error.
[[noreturn]] void fail(const char* op, const char* argument, const std::string& message);

// Run a core call, turning fusednorm::Error into c10::Error so Python gets RuntimeError.
template <typename F>
void call_core(F&& f) {
  try {
    f();
  } catch (const fusednorm::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

DType to_dtype(const char* op, const char* argument, const at::Tensor& t);
// The quantized outputs' dtypes: torch.int8 -> kInt8, torch.float8_e4m3fn -> kFloat8E4M3.
DType to_quant_dtype(const char* op, const char* argument, at::ScalarType t);

// A [..., D] tensor seen as rows x D. `tensor` is the input itself when its last dimension
// is contiguous and its leading dimensions collapse to one row stride (any slice, any
// transposition that keeps rows evenly spaced); otherwise it is a contiguous copy, the
// one copy the bindings ever make of an activation.
struct RowView {
  at::Tensor tensor;
  bool copied = false;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;
  DType dtype = DType::kFloat32;

  ConstMatrix const_matrix() const;
  Matrix matrix() const;
};

// Checks x (floating dtype, at least one dimension, D >= 1) without viewing it.
void check_input(const char* op, const char* argument, const at::Tensor& t);
// Checks x (floating dtype, at least one dimension, D >= 1) and views it as rows.
RowView input_rows(const char* op, const char* argument, const at::Tensor& t);
// Views without ever copying; std::nullopt when the strides do not allow it.
std::optional<RowView> rows_without_copy(const char* op, const char* argument, const at::Tensor& t);

// Another row-shaped argument (residual, dy): same shape and device as x.
void check_matching(const char* op, const char* argument, const at::Tensor& t, const at::Tensor& x);
RowView matching_rows(const char* op, const char* argument, const at::Tensor& t,
                      const at::Tensor& x);

// An optional row-shaped argument (dx_addend): absent, or as matching_rows.
std::optional<RowView> optional_rows(const char* op, const char* argument,
                                     const std::optional<at::Tensor>& t, const at::Tensor& x);

// t has x's dtype (an argument the core reads or writes as x's type).
void check_same_dtype(const char* op, const char* argument, const at::Tensor& t,
                      const at::Tensor& x);

// weight / bias: absent, or a 1-D tensor on x's device (copied if not contiguous). The
// dtype and length are checked by the core, which names the argument.
ConstVector optional_vector(const char* op, const char* argument,
                            const std::optional<at::Tensor>& t, const at::Tensor& x,
                            at::Tensor& keep_alive);

// Per-row fp32 statistics (rstd, mean): x.shape[:-1] elements on x's device.
const float* optional_row_stats(const char* op, const char* argument,
                                const std::optional<at::Tensor>& t, const at::Tensor& x,
                                std::int64_t rows, at::Tensor& keep_alive);

// The same for a statistic the operator requires.
const float* required_row_stats(const char* op, const char* argument, const at::Tensor& t,
                                const at::Tensor& x, std::int64_t rows, at::Tensor& keep_alive);

// A fresh contiguous tensor with x's shape and dtype (x already checked: `dtype` is its
// fusednorm dtype), and its rows x D view.
Matrix new_rows(const at::Tensor& x, DType dtype, at::Tensor& out);

// A row-shaped tensor the operator writes into, given by the caller: `out=` arguments, and
// residual (read and written). It must have x's shape, dtype and device and no internally
// overlapping memory. When its strides allow a rows x D view (the layouts the input path
// reads without a copy) the kernel writes it directly; otherwise the kernel writes a
// contiguous staging tensor (holding the current values when `keep_contents`, for a
// read-modify-write argument) and finish() copies the result back.
struct OutputRows {
  at::Tensor target;
  RowView view;

  Matrix matrix() const { return view.matrix(); }
  void finish() const;
};
OutputRows output_rows(const char* op, const char* argument, const at::Tensor& t,
                       const at::Tensor& x, bool keep_contents);

// The quantized output q of rms_norm_quant: as output_rows, but its dtype is int8 or FP8
// E4M3 (not x's) and it is write-only.
OutputRows quantized_output_rows(const char* op, const char* argument, const at::Tensor& t,
                                 const at::Tensor& x);

// Per-row fp32 statistics written into the caller's tensor: fp32, shape x.shape[:-1],
// contiguous, on x's device.
float* row_stats_out(const char* op, const char* argument, const at::Tensor& t,
                     const at::Tensor& x);

// Raises when the memory of `out` overlaps one of `inputs` (absent ones are skipped). An
// input that is exactly `out` (same data, sizes and strides) is allowed when its
// `may_be_out` is set: the kernels support y = x and dx = dy in place.
struct NamedInput {
  const char* name;
  const at::Tensor* tensor;  // nullptr or undefined: absent
  bool may_be_out = false;
};
void check_no_overlap(const char* op, const char* argument, const at::Tensor& out,
                      std::initializer_list<NamedInput> inputs);
inline const at::Tensor* optional_input(const std::optional<at::Tensor>& t) {
  return t.has_value() ? &*t : nullptr;
}

// Shape of per-row statistics: x.shape[:-1].
std::vector<std::int64_t> row_stats_shape(const at::Tensor& x);

Vector vector_view(at::Tensor& t);

}  // namespace fusednorm::torch_ext
