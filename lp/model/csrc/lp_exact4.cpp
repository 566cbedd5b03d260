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
}

TORCH_LIBRARY_IMPL(lp_exact4, CPU, m) {
  m.impl("mm", &exact4_mm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exact4_mm", &exact4_mm, "x @ W.T with W as exact 4-bit blocks (float32 math)");
  m.def("avx512", &exact4_avx512, "whether this build runs the AVX-512 path");
  m.def("parallel_width", &exact4_parallel_width, "threads the kernel's parallel_for runs on");
}
