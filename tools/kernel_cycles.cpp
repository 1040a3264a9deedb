// fusednorm-kernel-cycles: the per-row CPU kernels of the quantized norm and the sums they
// start from, each timed alone on one row that stays in L1 (one thread), for fp32, fp16 and
// bf16 rows, in ns per element and in cycles per 8 elements at the clock a chain of
// dependent adds measures. What a pass
// costs in compute, apart from memory: fusednorm-bench times the operators end to end.
//   fusednorm-kernel-cycles [D]    (default D = 4096; FUSEDNORM_CPU_TARGET picks the target)
//   fusednorm-kernel-cycles [D] --placement
//     normalize_amax (prepared weight) with its weight and output placed at chosen byte
//     offsets (mod 4096) from the row: a store whose address matches a later load's in its
//     low 12 bits can delay that load ("4K aliasing"), so where the staged y sits matters.
//   fusednorm-kernel-cycles [D] --short-rows
//     the short-row RMSNorm kernel (rms_rows: RMSNorm of a block of rows, the forward's path
//     for D <= kMaxShortRow) on 64 rows that stay in L1 / L2, fp32 / fp16 / bf16, with the
//     weight in the row's dtype, in fp32 and without one: ns and cycles per row, and bytes
//     per cycle (x read + y written), the compute side of fusednorm-bench's short-row figures;
//     and the fused add (rms_rows with a residual).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu/quant_kernels.h"
#include "cpu/row_kernels.h"

namespace {

using Clock = std::chrono::steady_clock;

// Best of 30 rounds of 200 calls, in ns per element.
template <typename Fn>
double ns_per_element(Fn fn, std::int64_t n) {
  double best = 1e30;
  for (int round = 0; round < 30; ++round) {
    const auto start = Clock::now();
    for (int call = 0; call < 200; ++call) fn();
    const double ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count();
    best = std::min(best, ns / 200 / static_cast<double>(n));
  }
  return best;
}

// GHz from a chain of dependent integer adds (one per cycle on every x86 core); 0 elsewhere.
double measured_ghz() {
#if defined(__x86_64__)
  const std::uint64_t adds = 400000000;
  std::uint64_t v = 0;
  const auto start = Clock::now();
  for (std::uint64_t i = 0; i < adds / 8; ++i) {
    asm volatile(
        "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
        "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0"
        : "+r"(v));
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return static_cast<double>(adds) / seconds / 1e9;
#else
  return 0.0;
#endif
}

// `count` regions of at least `bytes` each, every one starting on a page boundary and followed
// by a page of slack, so that a buffer placed up to a page into its region stays inside it.
class PageRegions {
 public:
  static constexpr std::size_t kPage = 4096;
  PageRegions(std::size_t bytes, int count)
      : region_((bytes + kPage - 1) / kPage * kPage + kPage),
        storage_(static_cast<std::size_t>(count) * region_ + kPage),
        base_(storage_.data() +
              (kPage - reinterpret_cast<std::uintptr_t>(storage_.data()) % kPage) % kPage) {}
  // The byte `offset` (< kPage) into region `index`.
  unsigned char* at(int index, std::size_t offset) const {
    return base_ + static_cast<std::size_t>(index) * region_ + offset;
  }

 private:
  std::size_t region_;
  std::vector<unsigned char> storage_;
  unsigned char* base_;
};

// normalize_amax over x at a page boundary, w and y `w_offset` and `y_offset` bytes (mod
// 4096) after x, in one table: y's offset varied with w's fixed half a page away, then w's
// with y's fixed half a page away.
void report_placement(std::int64_t n, double ghz) {
  const fusednorm::cpu::QuantKernels& qk = fusednorm::cpu::quant_kernels();
  const PageRegions regions(static_cast<std::size_t>(n) * sizeof(float), 3);
  float* const x = reinterpret_cast<float*>(regions.at(0, 0));
  for (std::int64_t j = 0; j < n; ++j) x[j] = static_cast<float>(j % 97) * 0.01f - 0.4f;
  volatile float sink = 0.0f;
  auto time_at = [&](std::size_t w_offset, std::size_t y_offset) {
    float* const w = reinterpret_cast<float*>(regions.at(1, w_offset));
    float* const y = reinterpret_cast<float*>(regions.at(2, y_offset));
    for (std::int64_t j = 0; j < n; ++j) w[j] = 1.01f;
    return ns_per_element(
        [&] { sink = sink + qk.normalize_amax_prepared[0](x, w, y, n, 0.9f, 0.0f, nullptr).amax; },
        n);
  };
  const std::size_t offsets[] = {0,   16,  32,   48,   64,   96,   128,  192,  256,  384,
                                 512, 768, 1024, 2048, 3072, 3584, 3840, 3968, 4032, 4080};
  std::printf(
      "\nnormalize_amax (prepared weight), ns / element (cycles / 8 elements); offsets in\n"
      "bytes after x, mod 4096\n\n| offset | y at offset, w at 2048 | w at offset, y at "
      "2048 |\n|---:|---:|---:|\n");
  for (const std::size_t offset : offsets) {
    const double y_moved = time_at(2048, offset), w_moved = time_at(offset, 2048);
    std::printf("| %zu | %.3f (%.2f) | %.3f (%.2f) |\n", offset, y_moved, y_moved * ghz * 8,
                w_moved, w_moved * ghz * 8);
  }
}

struct Span {
  unsigned char* data;
  std::size_t size;
};

// rms_rows on 64 contiguous rows of n elements of each dtype (x, y and the weight in it).
void report_short_rows(std::int64_t n, double ghz) {
  namespace cpu = fusednorm::cpu;
  constexpr std::int64_t kRows = 64;
  const char* names[3] = {"fp32", "fp16", "bf16"};
  const std::size_t sizes[3] = {4, 2, 2};
  std::printf(
      "\nrms_rows (RMSNorm of a block of %lld rows), D = %lld\n\n"
      "| dtype | weight | ns / row | cycles / row | bytes / cycle (x + y) |\n"
      "|---|---|---:|---:|---:|\n",
      static_cast<long long>(kRows), static_cast<long long>(n));
  for (int t = 0; t < 3; ++t) {
    const cpu::DTypeKernels& k = cpu::row_kernels().by_dtype[t];
    const std::size_t bytes = static_cast<std::size_t>(kRows * n) * sizes[t];
    // x, y, w and the residual in a page-aligned region each, y 2048 bytes and w and the
    // residual 1024 and 3072 bytes further (mod 4096) than x: a store to y at the low 12
    // address bits of a later load from x ("4K aliasing") would delay that load, and where
    // separate allocations happen to land decides it (fp32 and fp16 y had landed 16 bytes
    // after x here). The backend writes short rows to a staging buffer on its stack.
    const std::size_t row_bytes = static_cast<std::size_t>(n) * sizes[t];
    const PageRegions regions(bytes, 4);
    const Span x{regions.at(0, 0), bytes}, y{regions.at(1, 2048), bytes},
        w{regions.at(2, 1024), row_bytes}, residual{regions.at(3, 3072), bytes};
    // Finite values near 1 in each dtype (a small ramp above fp16 0x3c00, bf16 0x3f80, fp32
    // 1.0f): the kernels' time does not depend on finite values.
    auto fill = [&](const Span& v) {
      for (std::size_t i = 0; i < v.size; i += sizes[t]) {
        if (t == 0) {
          const float one = 1.0f + static_cast<float>(i % 97) * 0.001f;
          std::memcpy(v.data + i, &one, 4);
        }
        if (t == 1) {
          const std::uint16_t h = 0x3c00 + (i % 97);
          std::memcpy(v.data + i, &h, 2);
        }
        if (t == 2) {
          const std::uint16_t b = 0x3f80 + (i % 97);
          std::memcpy(v.data + i, &b, 2);
        }
      }
    };
    fill(x);
    fill(w);
    cpu::RmsRows rows{};
    rows.x = x.data;
    rows.x_stride = n;
    rows.y = y.data;
    rows.y_stride = n;
    rows.eps = 1e-6f;
    rows.rows = kRows;
    rows.n = n;
    const std::vector<float> w32(static_cast<std::size_t>(n), 1.01f);
    const struct {
      const char* name;
      cpu::ParamType type;
      const void* data;
    } weights[3] = {{"row dtype", cpu::kElementParam, w.data},
                    {"fp32", cpu::kFloat32Param, w32.data()},
                    {"none", cpu::kNoParam, nullptr}};
    for (const auto& weight : weights) {
      rows.w = weight.data;
      // ns_per_element over kRows "elements": ns per row.
      const double ns = ns_per_element([&] { k.rms_rows[0][0][weight.type][0](rows); }, kRows);
      std::printf("| %s | %s | %.2f | %.1f | %.1f |\n", names[t], weight.name, ns, ns * ghz,
                  static_cast<double>(2 * n * sizes[t]) / (ns * ghz));
    }
    // The fused add (residual += x, then the norm of the stored residual), weight in the
    // row's dtype; its bytes are x and the residual read, the residual and y written. The
    // residual grows by x on every call, which stays finite over the calls timed here.
    fill(residual);
    rows.w = w.data;
    rows.residual = residual.data;
    rows.residual_stride = n;
    const double ns = ns_per_element([&] { k.rms_rows[0][1][cpu::kElementParam][0](rows); }, kRows);
    std::printf("| %s | row dtype, fused add | %.2f | %.1f | %.1f |\n", names[t], ns, ns * ghz,
                static_cast<double>(4 * n * sizes[t]) / (ns * ghz));
  }
}

// The fp16 / bf16 bits of a float, rounded to nearest even (finite, normal values only: the
// table's rows).
std::uint16_t half_bits(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  const std::uint32_t sign = (b >> 16) & 0x8000;
  const float a = std::fabs(f);
  if (a < 6.103515625e-05f) return static_cast<std::uint16_t>(sign);  // below fp16's normals
  std::uint32_t m;
  std::memcpy(&m, &a, 4);
  // Rebias the exponent (127 -> 15) and round the 23-bit mantissa to 10 bits, ties to even.
  const std::uint32_t rounded = m + 0xfff + ((m >> 13) & 1);
  return static_cast<std::uint16_t>(sign | ((rounded - (112u << 23)) >> 13));
}
std::uint16_t bfloat16_bits(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<std::uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}
}  // namespace

int main(int argc, char** argv) {
  using namespace fusednorm;
  const bool placement = argc > 1 && std::strcmp(argv[argc - 1], "--placement") == 0;
  const bool short_rows = argc > 1 && std::strcmp(argv[argc - 1], "--short-rows") == 0;
  const bool mode = placement || short_rows;
  const std::int64_t n = argc > (mode ? 2 : 1) ? std::atoll(argv[1]) : 4096;
  if (n <= 0) {
    std::fprintf(stderr, "fusednorm-kernel-cycles: D must be > 0\n");
    return 1;
  }
  const cpu::QuantKernels& qk = cpu::quant_kernels();
  // Values inside int8's and E4M3's ranges after the 3x scaling below, so that every
  // quantizer takes its ordinary path; the rows in each dtype hold the same values, rounded.
  std::vector<float> x(n), w(n, 1.01f), y(n);
  std::vector<std::uint16_t> x_f16(n), x_bf16(n);
  for (std::int64_t j = 0; j < n; ++j) {
    x[j] = static_cast<float>(j % 97) * 0.01f - 0.4f;
    x_f16[j] = half_bits(x[j]);
    x_bf16[j] = bfloat16_bits(x[j]);
  }
  const void* const rows_of[3] = {x.data(), x_f16.data(), x_bf16.data()};
  std::vector<std::uint8_t> q(n);
  const float rstd = 0.9f, inv_scale = 3.0f;
  volatile float sink = 0.0f;
  const double ghz = measured_ghz();
  std::printf("fusednorm-kernel-cycles: D = %lld, one thread, in L1; CPU SIMD target %s",
              static_cast<long long>(n), qk.target_name);
  if (ghz > 0) std::printf("; clock %.2f GHz (dependent adds)", ghz);
  std::printf(
      "\n\ncycles per 8 elements (ns per element) by the rows' dtype; the quantizers read "
      "the staged fp32 y, whatever the rows' dtype\n\n| kernel | fp32 | fp16 | bf16 |\n"
      "|---|---:|---:|---:|\n");
  // One row of the table: fn(t) times the kernel for rows of dtype t (0 fp32, 1 fp16, 2 bf16);
  // per_dtype false: one kernel for all (timed once, shown in every column).
  auto report = [&](const char* name, bool per_dtype, auto fn) {
    std::printf("| %s |", name);
    const double shared = per_dtype ? 0.0 : ns_per_element([&] { fn(0); }, n);
    for (int t = 0; t < 3; ++t) {
      const double ns = per_dtype ? ns_per_element([&] { fn(t); }, n) : shared;
      std::printf(" %.2f (%.3f) |", ns * ghz * 8, ns);
    }
    std::printf("\n");
  };
  report("sum_squares", true, [&](int t) {
    sink = sink + cpu::row_kernels().by_dtype[t].sum_squares[0](rows_of[t], n, 0.0f);
  });
  report("normalize_amax (prepared weight)", true, [&](int t) {
    sink =
        sink +
        qk.normalize_amax_prepared[t](rows_of[t], w.data(), y.data(), n, rstd, 0.0f, nullptr).amax;
  });
  const char* q_names[2] = {"int8", "e4m3"};
  for (int qi = 0; qi < 2; ++qi) {
    char name[96];
    std::snprintf(name, sizeof name, "quantize %s", q_names[qi]);
    report(name, false, [&](int) { qk.quantize[0][qi](y.data(), q.data(), n, inv_scale); });
    std::snprintf(name, sizeof name, "quantize_in_range %s", q_names[qi]);
    report(name, false,
           [&](int) { qk.quantize_in_range[0][qi](y.data(), q.data(), n, inv_scale); });
    std::snprintf(name, sizeof name, "normalize_quantize %s (prepared weight)", q_names[qi]);
    report(name, true, [&](int t) {
      qk.normalize_quantize[0][t][1][qi](rows_of[t], w.data(), q.data(), n, rstd, inv_scale,
                                         nullptr);
    });
  }
  if (placement) report_placement(n, ghz);
  if (short_rows) report_short_rows(n, ghz);
  return 0;
}
