// The gradient statistics of one step in one kernel: over any number of tensors, the
// L2 norm, the NaN count and the Inf count, as float32 [norm, nan, inf].
//
// Why a kernel of our own (workers/grad_stats_kernel.py builds it, the cell calls it as a
// MindSpore "aot" Custom op on CPU): MindSpore's CPU graph needs a concatenation and a dot
// product per group of gradients for a norm (a copy and a read of every value, ~10
// kernels), and a data-dependent branch for the counts (~3 ms a step in its CPU runtime).
// Here each gradient is read once, where it lies, and the counts are taken (a second read
// of that tensor only) when its sum of squares is not finite: a finite sum proves there
// is nothing to count.
//
// The ABI is MindSpore's for aot Custom ops: params holds the inputs, then the output.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) {
        man <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct F32 {
  static float get(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
};
struct F16 {
  static float get(const void* p, int64_t i) { return f16_to_f32(static_cast<const uint16_t*>(p)[i]); }
};
struct BF16 {
  static float get(const void* p, int64_t i) { return bf16_to_f32(static_cast<const uint16_t*>(p)[i]); }
};
struct F64 {
  static double get(const void* p, int64_t i) { return static_cast<const double*>(p)[i]; }
};

// The fast pass: blocks of 512 values summed in 8 independent float lanes (the compiler
// vectorises them without reordering any sum), each block's total added in double. A
// square that overflows float32 (|x| > 1.8e19) makes it Inf; the exact pass then decides.
template <class T>
double square_sum_fast(const void* p, int64_t n) {
  double total = 0.0;
  int64_t i = 0;
  while (i < n) {
    const int64_t end = n - i > 512 ? i + 512 : n;
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; i + 8 <= end; i += 8) {
      for (int j = 0; j < 8; ++j) {
        const float v = T::get(p, i + j);
        a[j] += v * v;
      }
    }
    for (; i < end; ++i) {
      const float v = T::get(p, i);
      a[0] += v * v;
    }
    total += double(((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
  }
  return total;
}

// The exact pass, only for a tensor whose fast sum is not finite: counts NaN and Inf and
// sums the finite squares in double (finite float32 squares cannot overflow a double; a
// float64 gradient past 1e154 still may).
template <class T>
double square_sum_exact(const void* p, int64_t n, double* nan, double* inf) {
  double total = 0.0;
  int64_t nans = 0, infs = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = T::get(p, i);
    if (std::isnan(v)) {
      ++nans;
    } else if (std::isinf(v)) {
      ++infs;
    } else {
      total += v * v;
    }
  }
  *nan += double(nans);
  *inf += double(infs);
  if (nans) return std::nan("");
  if (infs) return HUGE_VAL;
  return total;
}

template <class T>
double tensor_square_sum(const void* p, int64_t n, double* nan, double* inf) {
  const double s = square_sum_fast<T>(p, n);
  return std::isfinite(s) ? s : square_sum_exact<T>(p, n, nan, inf);
}

double f64_square_sum(const void* p, int64_t n, double* nan, double* inf) {
  const double* x = static_cast<const double*>(p);
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += x[i] * x[i];
  return std::isfinite(total) ? total : square_sum_exact<F64>(p, n, nan, inf);
}

}  // namespace

extern "C" int MindpulseGradStats(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                  void* stream, void* extra) {
  (void)stream;
  (void)extra;
  if (nparam < 1) return 1;
  const int nin = nparam - 1;
  if (std::strcmp(dtypes[nin], "float32") != 0 && std::strcmp(dtypes[nin], "float") != 0) return 2;
  double sq = 0.0, nan = 0.0, inf = 0.0;
  for (int t = 0; t < nin; ++t) {
    int64_t n = 1;
    for (int d = 0; d < ndims[t]; ++d) n *= shapes[t][d];
    if (n <= 0) continue;
    const char* dt = dtypes[t];
    const void* p = params[t];
    if (!std::strcmp(dt, "float32") || !std::strcmp(dt, "float")) {
      sq += tensor_square_sum<F32>(p, n, &nan, &inf);
    } else if (!std::strcmp(dt, "float16")) {
      sq += tensor_square_sum<F16>(p, n, &nan, &inf);
    } else if (!std::strcmp(dt, "bfloat16")) {
      sq += tensor_square_sum<BF16>(p, n, &nan, &inf);
    } else if (!std::strcmp(dt, "float64") || !std::strcmp(dt, "double")) {
      sq += f64_square_sum(p, n, &nan, &inf);
    } else {
      return 3;  // not a floating-point gradient: the caller checks dtypes before using the op
    }
  }
  float* out = static_cast<float*>(params[nin]);
  out[0] = float(std::sqrt(sq));
  out[1] = float(nan);
  out[2] = float(inf);
  return 0;
}
