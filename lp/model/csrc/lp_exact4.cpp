// Exact 4-bit weights, float32 math: y[m, n] = sum_k x[m, k] * w[n, k] with
// w[n, k] = d[n, b] * q[n, k] + c[n, b] (b = k / 32), q in 0..15, d and c float16 values
// (held as float32: a conversion per block costs more than their bytes).
// Every weight is formed in float32 as fma(q, d, c): q * d is exact (4 x 11 significant bits),
// so the one rounding gives the float32 weight the checkpoint holds (lp.model.exact4 checks
// it bit for bit). Each row's dot products run the same instructions in the same order
// whatever the number of rows: a row's output depends on that row only.
//
// Layout: q [N, K / 2] uint8, per block of 32 weights 16 bytes, byte j = q[j] | q[j + 16] << 4
// (GGUF Q4_1's own order); d, c [N, K / 32] float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cmath>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowTile = 8;

// rows [m0, m0 + MT) x outputs [n0, n1), NB outputs at a time: MT and NB are template arguments
// so the NB x MT accumulator chains stay in registers and enough of them run side by side to
// hide the multiply-add latency. Output (n, m) is always one chain over the blocks (the block's
// first 16 weights, then its last 16), summed across lanes at the end: the same operations in
// the same order whatever MT, NB and the tiling.
template <int MT, int NB>
void tile(const float* x, const uint8_t* q, const float* d, const float* c, float* y,
          int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t blocks = K / kBlock;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
#if defined(__AVX512F__)
    __m512 acc[NB][MT];
    for (int j = 0; j < NB; ++j)
      for (int i = 0; i < MT; ++i) acc[j][i] = _mm512_setzero_ps();
    const __m512i lo_mask = _mm512_set1_epi32(0x0f);
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 w0[NB], w1[NB];
      for (int j = 0; j < NB; ++j) {
        const int64_t nb = (n + j) * blocks + b;
        const __m512 dv = _mm512_set1_ps(d[nb]);
        const __m512 cv = _mm512_set1_ps(c[nb]);
        // one widening of the 16 bytes, both nibbles split in the 32-bit lanes
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (n + j) * (K / 2) + b * 16)));
        w0[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, lo_mask)), dv, cv);
        w1[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), dv, cv);
      }
      for (int i = 0; i < MT; ++i) {
        const float* xr = x + (m0 + i) * K + b * kBlock;
        const __m512 xa = _mm512_loadu_ps(xr), xb = _mm512_loadu_ps(xr + 16);
        for (int j = 0; j < NB; ++j) {
          acc[j][i] = _mm512_fmadd_ps(xb, w1[j], _mm512_fmadd_ps(xa, w0[j], acc[j][i]));
        }
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int i = 0; i < MT; ++i)
        y[(m0 + i) * N + n + j] = _mm512_reduce_add_ps(acc[j][i]);
#else
    for (int j = 0; j < NB; ++j) {
      float acc[MT][16];
      for (int i = 0; i < MT; ++i)
        for (int l = 0; l < 16; ++l) acc[i][l] = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t nb = (n + j) * blocks + b;
        float w0[16], w1[16];
        for (int l = 0; l < 16; ++l) {
          const uint8_t byte = q[(n + j) * (K / 2) + b * 16 + l];
          w0[l] = std::fma((float)(byte & 0x0f), d[nb], c[nb]);
          w1[l] = std::fma((float)(byte >> 4), d[nb], c[nb]);
        }
        for (int i = 0; i < MT; ++i) {
          const float* xr = x + (m0 + i) * K + b * kBlock;
          for (int l = 0; l < 16; ++l) acc[i][l] = std::fma(xr[16 + l], w1[l], std::fma(xr[l], w0[l], acc[i][l]));
        }
      }
      for (int i = 0; i < MT; ++i) {
        float v[16];  // lanes summed pairwise (8, 4, 2, 1)
        for (int l = 0; l < 16; ++l) v[l] = acc[i][l];
        for (int w = 8; w >= 1; w /= 2)
          for (int l = 0; l < w; ++l) v[l] += v[l + w];
        y[(m0 + i) * N + n + j] = v[0];
      }
    }
#endif
  }
  if (NB > 1 && n < n1) tile<MT, 1>(x, q, d, c, y, K, N, m0, n, n1);
}

}  // namespace

torch::Tensor exact4_mm(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor c) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "exact4_mm: x must be [M, K] float32");
  TORCH_CHECK(q.scalar_type() == torch::kUInt8 && d.scalar_type() == torch::kFloat32 &&
                  c.scalar_type() == torch::kFloat32,
              "exact4_mm: q uint8, d and c float32");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % kBlock == 0 && q.size(1) == K / 2 && d.size(0) == N && d.size(1) == K / kBlock &&
                  c.sizes() == d.sizes(),
              "exact4_mm: shapes do not match");
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
      switch (std::min(kRowTile, M - m0)) {
        case 1: tile<1, 8>(xp, qp, dp, cp, yp, K, N, m0, n0, n1); break;
        case 2: tile<2, 4>(xp, qp, dp, cp, yp, K, N, m0, n0, n1); break;
        case 3: tile<3, 4>(xp, qp, dp, cp, yp, K, N, m0, n0, n1); break;
        case 4: tile<4, 2>(xp, qp, dp, cp, yp, K, N, m0, n0, n1); break;
        case 5: tile<5, 2>(xp, qp, dp, cp, yp, K, N, m0, n0, n1); break;
        case 6: tile<6, 2>(xp, qp, dp, cp, yp, K, N, m0, n0, n1); break;
        case 7: tile<7, 2>(xp, qp, dp, cp, yp, K, N, m0, n0, n1); break;
        default: tile<8, 2>(xp, qp, dp, cp, yp, K, N, m0, n0, n1); break;
      }
    }
  });
  return y;
}

// The blocks of w [N, K] float32 in one pass (lp.model.exact4.encode's torch-side check, same
// arithmetic): per 32 weights c = min, d = float16((max - c) / 15), q = round-half-even((w - c) / d)
// clamped to 0..15 (d = 0: divided by 1), accepted when c and d are float16 values, every weight
// finite and q * d + c == w bit for bit (q * d is exact, so the add is the one rounding, as in
// the kernel's fma). Returns (ok, q [N, K / 2] uint8 in the kernel's layout, d, c [N, K / 32]).
std::tuple<bool, at::Tensor, at::Tensor, at::Tensor> exact4_encode(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == torch::kFloat32 && w_in.device().is_cpu(),
              "exact4_encode: w must be [N, K] float32 on the CPU");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % kBlock == 0, "exact4_encode: K must be a multiple of 32");
  const int64_t blocks = K / kBlock;
  at::Tensor q = torch::empty({N, K / 2}, torch::kUInt8);
  at::Tensor d = torch::empty({N, blocks}, torch::kFloat32);
  at::Tensor c = torch::empty({N, blocks}, torch::kFloat32);
  const float* wp = w.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* dp = d.data_ptr<float>();
  float* cp = c.data_ptr<float>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    uint8_t qs[kBlock];
    for (int64_t n = r0; n < r1 && ok.load(std::memory_order_relaxed); ++n) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* wb = wp + n * K + b * kBlock;
        float lo = wb[0], hi = wb[0];
        for (int64_t j = 0; j < kBlock; ++j) {
          if (!std::isfinite(wb[j])) { ok = false; return; }
          lo = std::min(lo, wb[j]);
          hi = std::max(hi, wb[j]);
        }
        const float cv = lo;
        const volatile float span = (hi - cv) / 15.0f;  // float32 sub and div, as torch computes them
        const float dv = static_cast<float>(c10::Half(span));
        if (static_cast<float>(c10::Half(cv)) != cv || !std::isfinite(dv)) { ok = false; return; }
        const float safe = dv > 0.0f ? dv : 1.0f;
        for (int64_t j = 0; j < kBlock; ++j) {
          const volatile float diff = wb[j] - cv;
          const volatile float ratio = diff / safe;
          float qf = std::nearbyint(static_cast<float>(ratio));
          qf = std::min(15.0f, std::max(0.0f, qf));
          const volatile float prod = qf * dv;  // exact
          const volatile float back = prod + cv;
          if (back != wb[j]) { ok = false; return; }
          qs[j] = static_cast<uint8_t>(qf);
        }
        uint8_t* qb = qp + n * (K / 2) + b * 16;
        for (int64_t j = 0; j < 16; ++j) qb[j] = static_cast<uint8_t>(qs[j] | (qs[j + 16] << 4));
        dp[n * blocks + b] = dv;
        cp[n * blocks + b] = cv;
      }
    }
  });
  return {ok.load(), q, d, c};
}

// ---- exact 8-bit weights (the LM head of a GGUF Q8_0 model) ----------------------------------
// y[m, n] = sum_k x[m, k] * w[n, k] with w[n, k] = d[n, b] * q[n, k] (b = k / 32), q int8, d a
// float16 value held as float32: q * d is exact (8 x 11 significant bits), so every weight is
// the checkpoint's float32 weight; the same chains as exact4's tile (the block's first 16
// weights, then its last 16; lanes summed at the end): a row's output depends on that row only.
// Layout: q [N, K] int8 (GGUF Q8_0's own order), d [N, K / 32] float32.
namespace {

template <int MT, int NB>
void tile8(const float* x, const int8_t* q, const float* d, float* y,
           int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t blocks = K / kBlock;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
#if defined(__AVX512F__)
    __m512 acc[NB][MT];
    for (int j = 0; j < NB; ++j)
      for (int i = 0; i < MT; ++i) acc[j][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 w0[NB], w1[NB];
      for (int j = 0; j < NB; ++j) {
        const __m512 dv = _mm512_set1_ps(d[(n + j) * blocks + b]);
        const int8_t* qb = q + (n + j) * K + b * kBlock;
        w0[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)))), dv);
        w1[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16)))), dv);
      }
      for (int i = 0; i < MT; ++i) {
        const float* xr = x + (m0 + i) * K + b * kBlock;
        const __m512 xa = _mm512_loadu_ps(xr), xb = _mm512_loadu_ps(xr + 16);
        for (int j = 0; j < NB; ++j) {
          acc[j][i] = _mm512_fmadd_ps(xb, w1[j], _mm512_fmadd_ps(xa, w0[j], acc[j][i]));
        }
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int i = 0; i < MT; ++i)
        y[(m0 + i) * N + n + j] = _mm512_reduce_add_ps(acc[j][i]);
#else
    for (int j = 0; j < NB; ++j) {
      float acc[MT][16];
      for (int i = 0; i < MT; ++i)
        for (int l = 0; l < 16; ++l) acc[i][l] = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const float dv = d[(n + j) * blocks + b];
        const int8_t* qb = q + (n + j) * K + b * kBlock;
        float w0[16], w1[16];
        for (int l = 0; l < 16; ++l) {
          w0[l] = (float)qb[l] * dv;
          w1[l] = (float)qb[16 + l] * dv;
        }
        for (int i = 0; i < MT; ++i) {
          const float* xr = x + (m0 + i) * K + b * kBlock;
          for (int l = 0; l < 16; ++l) acc[i][l] = std::fma(xr[16 + l], w1[l], std::fma(xr[l], w0[l], acc[i][l]));
        }
      }
      for (int i = 0; i < MT; ++i) {
        float v[16];
        for (int l = 0; l < 16; ++l) v[l] = acc[i][l];
        for (int w = 8; w >= 1; w /= 2)
          for (int l = 0; l < w; ++l) v[l] += v[l + w];
        y[(m0 + i) * N + n + j] = v[0];
      }
    }
#endif
  }
  if (NB > 1 && n < n1) tile8<MT, 1>(x, q, d, y, K, N, m0, n, n1);
}

}  // namespace

torch::Tensor exact8_mm(torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "exact8_mm: x must be [M, K] float32");
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && d.scalar_type() == torch::kFloat32, "exact8_mm: q int8, d float32");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % kBlock == 0 && q.size(1) == K && d.size(0) == N && d.size(1) == K / kBlock &&
                  q.is_contiguous() && d.is_contiguous(),
              "exact8_mm: shapes do not match");
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
      switch (std::min(kRowTile, M - m0)) {
        case 1: tile8<1, 8>(xp, qp, dp, yp, K, N, m0, n0, n1); break;
        case 2: tile8<2, 4>(xp, qp, dp, yp, K, N, m0, n0, n1); break;
        case 3: tile8<3, 4>(xp, qp, dp, yp, K, N, m0, n0, n1); break;
        case 4: tile8<4, 2>(xp, qp, dp, yp, K, N, m0, n0, n1); break;
        case 5: tile8<5, 2>(xp, qp, dp, yp, K, N, m0, n0, n1); break;
        case 6: tile8<6, 2>(xp, qp, dp, yp, K, N, m0, n0, n1); break;
        case 7: tile8<7, 2>(xp, qp, dp, yp, K, N, m0, n0, n1); break;
        default: tile8<8, 2>(xp, qp, dp, yp, K, N, m0, n0, n1); break;
      }
    }
  });
  return y;
}

// The 8-bit blocks of w [N, K] float32 (GGUF Q8_0's construction): per 32 weights d = max |w| / 127
// (exact when the block came from Q8_0: its largest weight is 127 d), q = round-half-even(w / d)
// in -127..127 (d = 0: divided by 1); accepted when every d is a float16 value, every weight finite
// and q * d == w bit for bit. Returns (ok, q [N, K] int8, d [N, K / 32]).
std::tuple<bool, at::Tensor, at::Tensor> exact8_encode(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == torch::kFloat32 && w_in.device().is_cpu(),
              "exact8_encode: w must be [N, K] float32 on the CPU");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % kBlock == 0, "exact8_encode: K must be a multiple of 32");
  const int64_t blocks = K / kBlock;
  at::Tensor q = torch::empty({N, K}, torch::kInt8);
  at::Tensor d = torch::empty({N, blocks}, torch::kFloat32);
  const float* wp = w.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, N, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1 && ok.load(std::memory_order_relaxed); ++n) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* wb = wp + n * K + b * kBlock;
        float amax = 0.0f;
        for (int64_t j = 0; j < kBlock; ++j) {
          if (!std::isfinite(wb[j])) { ok = false; return; }
          amax = std::max(amax, std::fabs(wb[j]));
        }
        const volatile float dq = amax / 127.0f;
        const float dv = dq;
        if (static_cast<float>(c10::Half(dv)) != dv) { ok = false; return; }
        const float safe = dv > 0.0f ? dv : 1.0f;
        for (int64_t j = 0; j < kBlock; ++j) {
          const volatile float ratio = wb[j] / safe;
          const float qf = std::nearbyint(static_cast<float>(ratio));
          if (qf < -127.0f || qf > 127.0f) { ok = false; return; }
          const volatile float back = qf * dv;  // exact
          if (back != wb[j]) { ok = false; return; }
          qp[n * K + b * kBlock + j] = static_cast<int8_t>(qf);
        }
        dp[n * blocks + b] = dv;
      }
    }
  });
  return {ok.load(), q, d};
}

bool exact4_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// how many threads at::parallel_for runs here: 1 when the build lacked -fopenmp (ATen's
// parallel_for is inline OpenMP; without the flag it silently runs on the calling thread)
int64_t exact4_parallel_width() {
  std::atomic<int64_t> width{1};
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    const int64_t mine = at::get_thread_num() + 1;
    int64_t seen = width.load();
    while (mine > seen && !width.compare_exchange_weak(seen, mine)) {}
  });
  return width.load();
}

// the op lp.model.exact4's linears call: torch.ops.lp_exact4.mm, opaque to torch.compile (its fake is
// registered in Python)
TORCH_LIBRARY(lp_exact4, m) {
  m.def("mm(Tensor x, Tensor q, Tensor d, Tensor c) -> Tensor");
  m.def("mm8(Tensor x, Tensor q, Tensor d) -> Tensor");
}

TORCH_LIBRARY_IMPL(lp_exact4, CPU, m) {
  m.impl("mm", &exact4_mm);
  m.impl("mm8", &exact8_mm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exact4_mm", &exact4_mm, "x @ W.T with W as exact 4-bit blocks (float32 math)");
  m.def("avx512", &exact4_avx512, "whether this build runs the AVX-512 path");
  m.def("encode", &exact4_encode, "(ok, q, d, c): w's exact 4-bit blocks in one pass");
  m.def("encode8", &exact8_encode, "(ok, q, d): w's exact 8-bit blocks in one pass");
  m.def("parallel_width", &exact4_parallel_width, "threads the kernel's parallel_for runs on");
}
