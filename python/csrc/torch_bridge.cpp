#include "torch_bridge.h"

#include <ATen/MemoryOverlap.h>

#include <cstdint>
#include <sstream>

#include "core/problem.h"

namespace fusednorm::torch_ext {

using detail::ByteRange;

void fail(const char* op, const char* argument, const std::string& message) {
  TORCH_CHECK(false, "fusednorm::", op, ": argument '", argument, "': ", message);
}

DType to_dtype(const char* op, const char* argument, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kDouble:
      return DType::kFloat64;  // verification / gradcheck (fusednorm.h, Numerics)
    default:
      break;
  }
  fail(op, argument,
       std::string("dtype ") + c10::toString(t.scalar_type()) +
           " is not supported (expected float32, float16, bfloat16 or float64)");
}

DType to_quant_dtype(const char* op, const char* argument, at::ScalarType t) {
  switch (t) {
    case at::kChar:
      return DType::kInt8;
    case at::kFloat8_e4m3fn:
      return DType::kFloat8E4M3;
    default:
      break;
  }
  fail(op, argument,
       std::string("dtype ") + c10::toString(t) +
           " is not supported (expected torch.int8 or torch.float8_e4m3fn)");
}

ConstMatrix RowView::const_matrix() const {
  return {tensor.data_ptr(), dtype, rows, cols, row_stride};
}

Matrix RowView::matrix() const { return {tensor.data_ptr(), dtype, rows, cols, row_stride}; }

namespace {

void check_shape(const char* op, const char* argument, const at::Tensor& t) {
  if (!t.defined()) fail(op, argument, "is an undefined tensor");
  if (t.dim() == 0) fail(op, argument, "must have at least one dimension [..., D], got a scalar");
  if (t.size(-1) == 0) fail(op, argument, "last dimension D must be >= 1, got 0");
  if (t.layout() != at::kStrided) fail(op, argument, "must be a strided (dense) tensor");
}

}  // namespace

namespace {

std::optional<RowView> rows_without_copy_as(const char* op, const char* argument,
                                            const at::Tensor& t, DType dtype) {
  check_shape(op, argument, t);
  RowView v;
  v.dtype = dtype;
  v.cols = t.size(-1);
  v.rows = t.numel() / v.cols;
  v.row_stride = v.cols;
  v.tensor = t;
  if (v.cols > 1 && t.stride(-1) != 1) return std::nullopt;
  // The leading dimensions of size > 1 must form one arithmetic progression of rows.
  std::int64_t next = -1;  // stride the next-outer dimension must have
  bool first = true;
  for (std::int64_t i = t.dim() - 2; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (first) {
      v.row_stride = t.stride(i);
      first = false;
    } else if (t.stride(i) != next) {
      return std::nullopt;
    }
    next = t.stride(i) * t.size(i);
  }
  if (v.rows <= 1) v.row_stride = v.cols;
  if (v.row_stride < v.cols) return std::nullopt;  // broadcast (stride 0) or overlapping rows
  return v;
}

}  // namespace

std::optional<RowView> rows_without_copy(const char* op, const char* argument,
                                         const at::Tensor& t) {
  check_shape(op, argument, t);
  return rows_without_copy_as(op, argument, t, to_dtype(op, argument, t));
}

void check_input(const char* op, const char* argument, const at::Tensor& t) {
  check_shape(op, argument, t);
  to_dtype(op, argument, t);
}

RowView input_rows(const char* op, const char* argument, const at::Tensor& t) {
  if (auto v = rows_without_copy(op, argument, t)) return *v;
  RowView v;
  v.tensor = t.contiguous();
  v.copied = true;
  v.dtype = to_dtype(op, argument, t);
  v.cols = t.size(-1);
  v.rows = t.numel() / v.cols;
  v.row_stride = v.cols;
  return v;
}

void check_matching(const char* op, const char* argument, const at::Tensor& t,
                    const at::Tensor& x) {
  check_shape(op, argument, t);
  if (t.sizes() != x.sizes()) {
    std::ostringstream msg;
    msg << "shape " << t.sizes() << " does not match x's " << x.sizes();
    fail(op, argument, msg.str());
  }
  if (t.device() != x.device()) {
    fail(op, argument, "is on " + t.device().str() + " but x is on " + x.device().str());
  }
}

RowView matching_rows(const char* op, const char* argument, const at::Tensor& t,
                      const at::Tensor& x) {
  check_matching(op, argument, t, x);
  return input_rows(op, argument, t);
}

void check_same_dtype(const char* op, const char* argument, const at::Tensor& t,
                      const at::Tensor& x) {
  if (t.scalar_type() != x.scalar_type()) {
    fail(op, argument,
         std::string("dtype ") + c10::toString(t.scalar_type()) + " does not match x's " +
             c10::toString(x.scalar_type()));
  }
}

std::optional<RowView> optional_rows(const char* op, const char* argument,
                                     const std::optional<at::Tensor>& t, const at::Tensor& x) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  check_same_dtype(op, argument, *t, x);
  return matching_rows(op, argument, *t, x);
}

ConstVector optional_vector(const char* op, const char* argument,
                            const std::optional<at::Tensor>& t, const at::Tensor& x,
                            at::Tensor& keep_alive) {
  if (!t.has_value() || !t->defined()) return {};
  const at::Tensor& v = *t;
  if (v.dim() != 1) {
    fail(op, argument,
         "must be 1-D with D = " + std::to_string(x.size(-1)) + " elements, got " +
             std::to_string(v.dim()) + " dimensions");
  }
  if (v.device() != x.device()) {
    fail(op, argument, "is on " + v.device().str() + " but x is on " + x.device().str());
  }
  // Checked here as well as in the core: an empty tensor has no address, and a null
  // pointer there means "no weight".
  if (x.dim() > 0 && v.numel() != x.size(-1)) {
    fail(op, argument,
         "size " + std::to_string(v.numel()) + " does not match D = " + std::to_string(x.size(-1)));
  }
  const DType dtype = to_dtype(op, argument, v);
  keep_alive = v.contiguous();  // D elements; a strided weight is rare and cheap to copy
  return {keep_alive.data_ptr(), dtype, keep_alive.numel()};
}

const float* optional_row_stats(const char* op, const char* argument,
                                const std::optional<at::Tensor>& t, const at::Tensor& x,
                                std::int64_t rows, at::Tensor& keep_alive) {
  if (!t.has_value() || !t->defined()) return nullptr;
  const at::Tensor& s = *t;
  if (s.scalar_type() != at::kFloat) {
    fail(op, argument, std::string("dtype must be float32, got ") + c10::toString(s.scalar_type()));
  }
  if (s.device() != x.device()) {
    fail(op, argument, "is on " + s.device().str() + " but x is on " + x.device().str());
  }
  if (s.numel() != rows) {
    fail(op, argument,
         "must have one element per row of x (" + std::to_string(rows) + "), got " +
             std::to_string(s.numel()));
  }
  keep_alive = s.contiguous();
  return keep_alive.data_ptr<float>();
}

const float* required_row_stats(const char* op, const char* argument, const at::Tensor& t,
                                const at::Tensor& x, std::int64_t rows, at::Tensor& keep_alive) {
  if (!t.defined()) fail(op, argument, "is required");
  return optional_row_stats(op, argument, t, x, rows, keep_alive);
}

Matrix new_rows(const at::Tensor& x, DType dtype, at::Tensor& out) {
  out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const std::int64_t cols = x.size(-1);
  return {out.data_ptr(), dtype, out.numel() / cols, cols, cols};
}

namespace {

OutputRows output_rows_as(const char* op, const char* argument, const at::Tensor& t,
                          bool keep_contents, DType dtype) {
  if (at::has_internal_overlap(t) == at::MemOverlap::Yes) {
    fail(op, argument,
         "has internally overlapping memory (e.g. from expand()): its elements cannot all be "
         "written");
  }
  OutputRows o;
  o.target = t;
  if (auto v = rows_without_copy_as(op, argument, t, dtype)) {
    o.view = *v;
    return o;
  }
  o.view.tensor =
      keep_contents ? t.contiguous()
                    : at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  o.view.copied = true;
  o.view.dtype = dtype;
  o.view.cols = t.size(-1);
  o.view.rows = t.numel() / o.view.cols;
  o.view.row_stride = o.view.cols;
  return o;
}

}  // namespace

OutputRows output_rows(const char* op, const char* argument, const at::Tensor& t,
                       const at::Tensor& x, bool keep_contents) {
  check_matching(op, argument, t, x);
  if (t.scalar_type() != x.scalar_type()) {
    fail(op, argument,
         std::string("dtype ") + c10::toString(t.scalar_type()) + " does not match x's " +
             c10::toString(x.scalar_type()));
  }
  return output_rows_as(op, argument, t, keep_contents, to_dtype(op, argument, t));
}

OutputRows quantized_output_rows(const char* op, const char* argument, const at::Tensor& t,
                                 const at::Tensor& x) {
  check_matching(op, argument, t, x);
  return output_rows_as(op, argument, t, /*keep_contents=*/false,
                        to_quant_dtype(op, argument, t.scalar_type()));
}

void OutputRows::finish() const {
  if (view.copied) target.copy_(view.tensor);
}

float* row_stats_out(const char* op, const char* argument, const at::Tensor& t,
                     const at::Tensor& x) {
  if (!t.defined()) fail(op, argument, "is an undefined tensor");
  if (t.scalar_type() != at::kFloat) {
    fail(op, argument, std::string("dtype must be float32, got ") + c10::toString(t.scalar_type()));
  }
  const auto shape = row_stats_shape(x);
  if (t.sizes() != at::IntArrayRef(shape)) {
    std::ostringstream msg;
    msg << "shape " << t.sizes() << " must be x.shape[:-1] = " << at::IntArrayRef(shape);
    fail(op, argument, msg.str());
  }
  if (t.device() != x.device()) {
    fail(op, argument, "is on " + t.device().str() + " but x is on " + x.device().str());
  }
  if (!t.is_contiguous()) fail(op, argument, "must be contiguous");
  return t.data_ptr<float>();
}

namespace {

// The bytes a tensor's elements lie in (core/problem.h's ByteRange; empty without
// elements): rows of contiguous elements a uniform pitch apart where the tensor is such a
// view (any leading dimensions that collapse into one row index), so that two column slices
// of one matrix are not taken to overlap; else just the extent.
ByteRange byte_span(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return {};
  std::int64_t low = 0, high = 0;  // element offsets of the first and last element
  for (std::int64_t i = 0; i < t.dim(); ++i) {
    const std::int64_t reach = (t.size(i) - 1) * t.stride(i);
    (reach < 0 ? low : high) += reach;
  }
  const auto base = reinterpret_cast<std::uintptr_t>(t.data_ptr());
  const auto item = static_cast<std::intptr_t>(t.element_size());
  const auto begin = static_cast<std::uintptr_t>(base + low * item);
  const auto end = static_cast<std::uintptr_t>(base + (high + 1) * item);
  ByteRange range{begin, end, end - begin, 0};
  const std::int64_t cols = t.dim() == 0 ? 1 : t.size(-1);
  if (t.dim() < 2 || (cols > 1 && t.stride(-1) != 1)) return range;
  // The leading dimensions of size > 1, innermost first, must step as one row index does.
  std::int64_t pitch = 0, expected = 0;
  for (std::int64_t i = t.dim() - 2; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (pitch == 0) {
      pitch = t.stride(i);
      if (pitch < cols) return range;  // rows overlap, or run backwards
    } else if (t.stride(i) != expected) {
      return range;
    }
    expected = t.stride(i) * t.size(i);
  }
  if (pitch == 0) return range;  // one row
  range.width = static_cast<std::uintptr_t>(cols * item);
  range.pitch = static_cast<std::uintptr_t>(pitch * item);
  return range;
}

bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.scalar_type() == b.scalar_type();
}

}  // namespace

void check_no_overlap(const char* op, const char* argument, const at::Tensor& out,
                      std::initializer_list<NamedInput> inputs) {
  const ByteRange out_span = byte_span(out);
  for (const NamedInput& in : inputs) {
    if (in.tensor == nullptr || !in.tensor->defined() || in.tensor->device() != out.device()) {
      continue;
    }
    if (in.may_be_out && same_view(*in.tensor, out)) continue;
    if (out_span.overlaps(byte_span(*in.tensor))) {
      fail(op, argument,
           std::string("overlaps the memory of '") + in.name + "'" +
               (in.may_be_out
                    ? std::string(" (in-place needs exactly the same view as '") + in.name + "')"
                    : std::string()));
    }
  }
}

std::vector<std::int64_t> row_stats_shape(const at::Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return sizes;
}

Vector vector_view(at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return {};
  return {t.data_ptr(), to_dtype("", "", t), t.numel()};
}

}  // namespace fusednorm::torch_ext
