// Exact low-bit weights, float32 math: y[m, n] = sum_k x[m, k] * w[n, k], every float32 weight
// formed exactly from its block (b = k / 32):
//   exact4 (GGUF Q4_1 / Q4_0): w = fma(q, d, c), q in 0..15, d and c float16 values held as
//     float32 (a conversion per block costs more than their bytes); q * d is exact (4 x 11
//     significant bits), so the one rounding gives the float32 weight the checkpoint holds;
//   exact8 (GGUF Q8_0, SmolLM2's LM head): w = q * d, q int8, d a float16 value: exact.
// (lp.kernels.exact4 checks both bit for bit.) Each row's dot products run the same instructions in
// the same order whatever the number of rows: a row's output depends on that row only.
//
// Encoded layout (lp_exact4.encode / encode8, GGUF's own order): exact4 q [N, K / 2] uint8, per
// block 16 bytes, byte j = q[j] | q[j + 16] << 4; d, c [N, K / 32] float32. exact8 q [N, K] int8,
// d [N, K / 32] float32.
// Kernel layout (pack4 / pack8): outputs in groups of 8, one chunk per (group, block) holding the
// group's 8 outputs' block in a row: exact4 8 x 16 q bytes, then d[8], c[8] (192 bytes); exact8
// 8 x 32 q bytes, then d[8] (288 bytes); groups padded with zero weights to a multiple of 8. A
// thread's share of a matrix is then one forward stream that the kernel prefetches ahead of
// itself: the one-row product then runs at the memory's bandwidth (bench/results/step_cost).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// lp.kernels.idot's two builds: AVX-512 VNNI (vpdpbusd on x's three int8 digits, 16 outputs a register) or
// AVX2 with FMA and F16C (the same packed codes widened to the file's float32 weights, float32 multiply-adds:
// fdot_group; the greedy head's screen on x's top digit alone, screen_group)
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LP_IDOT512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LP_IDOT256 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowTile = 8;
constexpr int kGroup = 8;            // outputs per chunk
constexpr int64_t kPrefetch = 4096;  // bytes ahead of the chunk being read (measured: 3-8 KiB alike)
std::atomic<bool> g_prefetch{true};  // off only to measure what it buys (bench/exact4_bandwidth.py)

// decoder_paged's phase clock (bench/step_profile.py): off unless switched on, seconds per phase
constexpr int kPhases = 10;
const char* const kPhaseNames[kPhases] = {"norm", "qkv", "rope", "kv_write", "attention", "o", "residual",
                                          "gate_up", "silu_mul", "down"};
std::atomic<bool> g_clock{false};
double g_phase[kPhases] = {0};
struct Clock {
  bool on = g_clock.load(std::memory_order_relaxed);
  std::chrono::steady_clock::time_point t = on ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  void lap(int phase) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    g_phase[phase] += std::chrono::duration<double>(now - t).count();
    t = now;
  }
};

struct NoPrep {};

// How a chunk's output j forms its block's 32 weights: lanes 0-15 (w0) and 16-31 (w1).
struct Weights4 {
  static constexpr int64_t kBytes = kGroup * 16 + 2 * kGroup * 4;
  static constexpr int kKind = 0;  // its row of g_tile
  static constexpr int64_t kSuper = 1;  // blocks of 32 per entry of the packed tensor
  using Prep = NoPrep;  // what a block's loads share (the K-quant kinds: its 8 outputs' scales)
  static inline NoPrep prep(const uint8_t*, int) { return {}; }
#if defined(__AVX512F__)
  static inline void load(const uint8_t* chunk, int, int j, const NoPrep&, __m512& w0, __m512& w1) {
    const float* d = reinterpret_cast<const float*>(chunk + kGroup * 16);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // the block's 16 possible weights fma(q, d, c), picked by each nibble (permutexvar reads an
    // index's low 4 bits: the low nibble needs no mask)
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[j]), _mm512_set1_ps(d[kGroup + j]));
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + j * 16)));
    w0 = _mm512_permutexvar_ps(v, table);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  }
#endif
  static inline void load(const uint8_t* chunk, int, int j, const NoPrep&, float* w0, float* w1) {
    const float* d = reinterpret_cast<const float*>(chunk + kGroup * 16);
    for (int l = 0; l < 16; ++l) {
      const uint8_t byte = chunk[j * 16 + l];
      w0[l] = std::fma((float)(byte & 0x0f), d[j], d[kGroup + j]);
      w1[l] = std::fma((float)(byte >> 4), d[j], d[kGroup + j]);
    }
  }
  static void pack(const uint8_t* q, const float* d, const float* c, uint8_t* chunk, int64_t n, int j,
                   int64_t b, int64_t blocks) {
    std::memcpy(chunk + j * 16, q + n * blocks * 16 + b * 16, 16);
    reinterpret_cast<float*>(chunk + kGroup * 16)[j] = d[n * blocks + b];
    reinterpret_cast<float*>(chunk + kGroup * 16)[kGroup + j] = c[n * blocks + b];
  }
};

struct Weights8 {
  static constexpr int64_t kBytes = kGroup * 32 + kGroup * 4;
  static constexpr int kKind = 1;
  static constexpr int64_t kSuper = 1;
  using Prep = NoPrep;
  static inline NoPrep prep(const uint8_t*, int) { return {}; }
#if defined(__AVX512F__)
  static inline void load(const uint8_t* chunk, int, int j, const NoPrep&, __m512& w0, __m512& w1) {
    const __m512 dv = _mm512_set1_ps(reinterpret_cast<const float*>(chunk + kGroup * 32)[j]);
    const __m128i* qb = reinterpret_cast<const __m128i*>(chunk + j * 32);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb))), dv);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb + 1))), dv);
  }
#endif
  static inline void load(const uint8_t* chunk, int, int j, const NoPrep&, float* w0, float* w1) {
    const float dv = reinterpret_cast<const float*>(chunk + kGroup * 32)[j];
    const int8_t* qb = reinterpret_cast<const int8_t*>(chunk + j * 32);
    for (int l = 0; l < 16; ++l) {
      w0[l] = (float)qb[l] * dv;
      w1[l] = (float)qb[16 + l] * dv;
    }
  }
  static void pack(const uint8_t* q, const float* d, const float*, uint8_t* chunk, int64_t n, int j,
                   int64_t b, int64_t blocks) {
    std::memcpy(chunk + j * 32, q + n * blocks * 32 + b * 32, 32);
    reinterpret_cast<float*>(chunk + kGroup * 32)[j] = d[n * blocks + b];
  }
};

// exact8 with a scale and an offset per 16 weights (GGUF Q6_K: w = (d * scale) * q, q in -32..31, a
// scale per 16; Q5_K: (d * scale) * q - dmin * min per 32; Q5_1: d * q + m per 32): w = fma(q, D, C)
// with D, C float32 per half-block, q int8; D * q is exact in each of these formats (at most 11 + 7
// + 5 significant bits), so the one rounding of the fma is gguf.dequantize's one rounding.
// Chunk: 8 x 32 q bytes, then D (lanes 0-15)[8], D (lanes 16-31)[8], C[8], C[8] (384 bytes).
struct Weights8x {
  static constexpr int64_t kBytes = kGroup * 32 + 4 * kGroup * 4;
  static constexpr int kKind = 2;
  static constexpr int64_t kSuper = 1;
  using Prep = NoPrep;
  static inline NoPrep prep(const uint8_t*, int) { return {}; }
#if defined(__AVX512F__)
  static inline void load(const uint8_t* chunk, int, int j, const NoPrep&, __m512& w0, __m512& w1) {
    const float* s = reinterpret_cast<const float*>(chunk + kGroup * 32);
    const __m128i* qb = reinterpret_cast<const __m128i*>(chunk + j * 32);
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb))), _mm512_set1_ps(s[j]),
                         _mm512_set1_ps(s[2 * kGroup + j]));
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb + 1))),
                         _mm512_set1_ps(s[kGroup + j]), _mm512_set1_ps(s[3 * kGroup + j]));
  }
#endif
  static inline void load(const uint8_t* chunk, int, int j, const NoPrep&, float* w0, float* w1) {
    const float* s = reinterpret_cast<const float*>(chunk + kGroup * 32);
    const int8_t* qb = reinterpret_cast<const int8_t*>(chunk + j * 32);
    for (int l = 0; l < 16; ++l) {
      w0[l] = std::fma((float)qb[l], s[j], s[2 * kGroup + j]);
      w1[l] = std::fma((float)qb[16 + l], s[kGroup + j], s[3 * kGroup + j]);
    }
  }
};

// rows [m0, m0 + MT) x the group's outputs [s, s + NB): MT and NB are template arguments so the
// NB x MT accumulator chains stay in registers and enough of them run side by side to hide the
// multiply-add latency. Output (n, m) is always one chain over the blocks (the block's first 16
// weights, then its last 16), summed across lanes at the end (8, 4, 2, 1 apart): the same
// operations in the same order whatever MT, NB and the tiling.
template <class W, int MT, int NB>
void tile(const float* x, const uint8_t* group, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0, int s,
          bool prefetch) {
  const int64_t blocks = K / kBlock;
#if defined(__AVX512F__)
  __m512 acc[NB][MT];
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MT; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* chunk = group + (b / W::kSuper) * W::kBytes;  // the entry holding block b
    const int r = static_cast<int>(b % W::kSuper);
    if (prefetch)
      for (int64_t line = 0; line < W::kBytes / W::kSuper; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(chunk) + r * (W::kBytes / W::kSuper) + kPrefetch + line,
                     _MM_HINT_T0);
    __m512 w0[NB], w1[NB];
    const typename W::Prep pr = W::prep(chunk, r);
    for (int j = 0; j < NB; ++j) W::load(chunk, r, s + j, pr, w0[j], w1[j]);
    for (int i = 0; i < MT; ++i) {
      const float* xr = x + (m0 + i) * K + b * kBlock;
      const __m512 xa = _mm512_loadu_ps(xr), xb = _mm512_loadu_ps(xr + 16);
      for (int j = 0; j < NB; ++j) acc[j][i] = _mm512_fmadd_ps(xb, w1[j], _mm512_fmadd_ps(xa, w0[j], acc[j][i]));
    }
  }
  for (int j = 0; j < NB; ++j)
    if (n0 + s + j < N)
      for (int i = 0; i < MT; ++i) y[(m0 + i) * N + n0 + s + j] = _mm512_reduce_add_ps(acc[j][i]);
#else
  (void)prefetch;
  for (int j = 0; j < NB; ++j) {
    float acc[MT][16];
    for (int i = 0; i < MT; ++i)
      for (int l = 0; l < 16; ++l) acc[i][l] = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      float w0[16], w1[16];
      const uint8_t* e = group + (b / W::kSuper) * W::kBytes;
      const int r = static_cast<int>(b % W::kSuper);
      W::load(e, r, s + j, W::prep(e, r), w0, w1);
      for (int i = 0; i < MT; ++i) {
        const float* xr = x + (m0 + i) * K + b * kBlock;
        for (int l = 0; l < 16; ++l) acc[i][l] = std::fma(xr[16 + l], w1[l], std::fma(xr[l], w0[l], acc[i][l]));
      }
    }
    if (n0 + s + j >= N) continue;
    for (int i = 0; i < MT; ++i) {
      float v[16];  // lanes summed pairwise (8, 4, 2, 1), as _mm512_reduce_add_ps does
      for (int l = 0; l < 16; ++l) v[l] = acc[i][l];
      for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) v[l] += v[l + w];
      y[(m0 + i) * N + n0 + s + j] = v[0];
    }
  }
#endif
}

// outputs per tile (NB) for a tile of MT rows, per weight kind (exact4, exact8): the fastest of
// 1, 2, 4, 8 measured per MT on this project's 2-vCPU EPYC over SmolLM2's shapes (python -m
// bench.exact4_tiles; bench/results/step_cost/exact4_tiles). Below 8 rows more outputs share
// each row's loads, even where their accumulators spill (2 rows: ~20% less time at 8 outputs
// than at 4). Whatever NB, each output's sum runs in the same order: only speed depends on it.
// set_tile overrides an entry (the benchmark).
int g_tile[9][kRowTile + 1] = {{0, 8, 8, 8, 4, 4, 4, 4, 2}, {0, 8, 8, 8, 8, 4, 4, 4, 2}, {0, 8, 8, 8, 8, 4, 4, 4, 2},
                               {0, 8, 8, 8, 8, 4, 4, 4, 2}, {0, 8, 8, 8, 4, 4, 4, 4, 2}, {0, 8, 8, 8, 4, 4, 4, 4, 2},
                               {0, 8, 8, 8, 4, 4, 4, 4, 2}, {0, 8, 8, 8, 4, 4, 4, 4, 2}, {0, 8, 8, 8, 8, 4, 4, 4, 2}};

// every row tile over one group, the group's chunks read from memory once (prefetched on the
// first pass, in L1 for the others)
template <class W, int MT, int NB>
void group_rows(const float* x, const uint8_t* group, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
                bool prefetch) {
  for (int s = 0; s < kGroup; s += NB) tile<W, MT, NB>(x, group, y, K, N, m0, n0, s, prefetch && s == 0);
}

template <class W, int MT>
void group_tile(const float* x, const uint8_t* group, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
                bool prefetch) {
  switch (g_tile[W::kKind][MT]) {
    case 1: group_rows<W, MT, 1>(x, group, y, K, N, m0, n0, prefetch); break;
    case 2: group_rows<W, MT, 2>(x, group, y, K, N, m0, n0, prefetch); break;
    case 4: group_rows<W, MT, 4>(x, group, y, K, N, m0, n0, prefetch); break;
    default: group_rows<W, MT, 8>(x, group, y, K, N, m0, n0, prefetch); break;
  }
}

// every row of x [M, K] over one group (outputs n0..n0 + 7 of y [M, N]), in row tiles of up to kRowTile
// (the group's chunks prefetched on the first tile only)
template <class W>
void group_all_rows(const float* x, const uint8_t* group, float* y, int64_t K, int64_t N, int64_t M, int64_t n0,
                    bool prefetch) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
    const bool first = prefetch && m0 == 0;
    switch (std::min(kRowTile, M - m0)) {
      case 1: group_tile<W, 1>(x, group, y, K, N, m0, n0, first); break;
      case 2: group_tile<W, 2>(x, group, y, K, N, m0, n0, first); break;
      case 3: group_tile<W, 3>(x, group, y, K, N, m0, n0, first); break;
      case 4: group_tile<W, 4>(x, group, y, K, N, m0, n0, first); break;
      case 5: group_tile<W, 5>(x, group, y, K, N, m0, n0, first); break;
      case 6: group_tile<W, 6>(x, group, y, K, N, m0, n0, first); break;
      case 7: group_tile<W, 7>(x, group, y, K, N, m0, n0, first); break;
      default: group_tile<W, 8>(x, group, y, K, N, m0, n0, first); break;
    }
  }
}

template <class W>
torch::Tensor packed_mm(const char* name, torch::Tensor x, const torch::Tensor& p, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, name, ": x must be [M, K] float32");
  TORCH_CHECK(p.dim() == 3 && p.scalar_type() == torch::kUInt8 && p.is_contiguous() && p.size(2) == W::kBytes,
              name, ": p must be a packed [groups, blocks, ", W::kBytes, "] uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), groups = p.size(0);
  TORCH_CHECK(K % (kBlock * W::kSuper) == 0 && p.size(1) == K / (kBlock * W::kSuper) && N > 0 &&
                  (N + kGroup - 1) / kGroup == groups,
              name, ": shapes do not match");
  x = x.contiguous();
  at::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = p.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t group_bytes = p.size(1) * W::kBytes;
  const bool prefetch = g_prefetch.load(std::memory_order_relaxed);
  at::parallel_for(0, groups, 2, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      group_all_rows<W>(xp, pp + g * group_bytes, yp, K, N, M, g * kGroup, prefetch);
    }
  });
  return y;
}

// A [groups, blocks, bytes] tensor in the kernel layout (zero-padded groups), each chunk written by
// fill(chunk, n, j, b): output n (the group's j-th) of K-block b. Every kind's pack walks this way.
template <class Fill>
at::Tensor pack_chunks(int64_t N, int64_t blocks, int64_t bytes, const Fill& fill) {
  const int64_t groups = (N + kGroup - 1) / kGroup;
  at::Tensor p = torch::zeros({groups, blocks, bytes}, torch::kUInt8);
  uint8_t* pp = p.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < blocks; ++b)
        for (int j = 0; j < kGroup && g * kGroup + j < N; ++j) fill(pp + (g * blocks + b) * bytes, g * kGroup + j, j, b);
  });
  return p;
}

// the encoded blocks (q [N, K / per_byte]; d, c [N, K / 32]) in the kernel layout
template <class W>
at::Tensor pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor* c) {
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous() && d.scalar_type() == torch::kFloat32 && d.dim() == 2,
              "pack: q and d must be contiguous, d [N, K / 32] float32");
  const int64_t N = d.size(0), blocks = d.size(1);
  TORCH_CHECK(q.size(0) == N && q.numel() * (c ? 2 : 1) == N * blocks * kBlock, "pack: q does not match d");
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* cp = c ? c->data_ptr<float>() : nullptr;
  return pack_chunks(N, blocks, W::kBytes, [&](uint8_t* chunk, int64_t n, int j, int64_t b) {
    W::pack(qp, dp, cp, chunk, n, j, b, blocks);
  });
}

}  // namespace

torch::Tensor exact4_mm(torch::Tensor x, torch::Tensor p, int64_t n) { return packed_mm<Weights4>("exact4_mm", x, p, n); }

torch::Tensor exact8_mm(torch::Tensor x, torch::Tensor p, int64_t n) { return packed_mm<Weights8>("exact8_mm", x, p, n); }

at::Tensor exact4_pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor& c) {
  TORCH_CHECK(q.scalar_type() == torch::kUInt8 && c.sizes() == d.sizes() && c.scalar_type() == torch::kFloat32 &&
                  c.is_contiguous(),
              "exact4_pack: q uint8 [N, K / 2], d and c float32 [N, K / 32]");
  return pack<Weights4>(q, d, &c);
}

// 16-bit float weights (GGUF F16 / BF16 tensors, bf16 / fp16 checkpoints): w = the value widened to
// float32, exact (a float16 or bfloat16 value is a float32 value). Chunk: 8 x 32 weights of 2 bytes
// (512 bytes), no scales; the same tiles, chains and summation order as the block kinds.
template <bool kBf16>
struct Weights16 {
  static constexpr int64_t kBytes = kGroup * 64;
  static constexpr int kKind = 3;
  static constexpr int64_t kSuper = 1;
  using Prep = NoPrep;
  static inline NoPrep prep(const uint8_t*, int) { return {}; }
#if defined(__AVX512F__)
  static inline __m512 widen(const __m256i h) {
    if constexpr (kBf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
  static inline void load(const uint8_t* chunk, int, int j, const NoPrep&, __m512& w0, __m512& w1) {
    const __m256i* qb = reinterpret_cast<const __m256i*>(chunk + j * 64);
    w0 = widen(_mm256_loadu_si256(qb));
    w1 = widen(_mm256_loadu_si256(qb + 1));
  }
#endif
  static inline float one(uint16_t h) {
    if constexpr (kBf16) {
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  }
  static inline void load(const uint8_t* chunk, int, int j, const NoPrep&, float* w0, float* w1) {
    const uint16_t* qb = reinterpret_cast<const uint16_t*>(chunk + j * 64);
    for (int l = 0; l < 16; ++l) {
      w0[l] = one(qb[l]);
      w1[l] = one(qb[16 + l]);
    }
  }
};

// GGUF's 5- and 6-bit and K-quant blocks at about the file's size (issue 50): q unsigned in
// 0..2^(4 + HI) - 1 as its low nibble (byte l of a block: weight l | weight l + 16 << 4) and HI bit
// planes (bit l of plane p's word: weight l's bit 4 + p), and the scales as the file codes them:
//   MODE 0 (Q5_0, Q5_1): w = fma(q, D, C), D and C float32 per 32 (Q5_0: C = -16 D; Q5_1: d, m);
//   MODE 1 (Q4_K, Q5_K): w = fma(q, d * sc, nm * mn), d and nm = -dmin float32 per 256, the 6-bit
//     sc and mn per 32 (d * sc and nm * mn exact: 11 x 6 bits);
//   MODE 2 (Q6_K): w = (q - 32) * (d * sc), d float32 per 256, sc int8 per 16 (d * sc exact);
//   MODE 3 (Q6_K as bytes, HI 0): MODE 2's weights with q - 32 held as an int8 a weight (byte l of a
//     block: weight l) instead of a nibble and two planes: 8.6 bits a weight, decoded as exact8's.
// In each, the float32 product or fma rounds once, as gguf.dequantize's one rounding does (q * D is
// exact in every case), so the weights are bit for bit transformers' float32 ones.
// Entry of the packed tensor (group of 8 outputs, kSuper blocks): a header (MODE 1: d[8], nm[8];
// MODE 2, 3: d[8]; MODE 0: none), then per block 8 x 16 nibble bytes (MODE 3: 8 x 32 int8 codes), HI x
// 8 plane words, the scales (MODE 0: D[8], C[8] float32; MODE 1: sc[8], mn[8] uint8; MODE 2, 3: sc[8]
// (lanes 0-15), sc[8] (16-31)).
template <int HI, int MODE>
struct WeightsQ {
  static constexpr int64_t kSuper = MODE == 0 ? 1 : 8;
  static constexpr int64_t kHead = MODE == 0 ? 0 : (MODE == 1 ? 2 * kGroup * 4 : kGroup * 4);
  static constexpr int64_t kScales = MODE == 0 ? 2 * kGroup * 4 : 2 * kGroup;
  static constexpr int64_t kCodes = MODE == 3 ? kGroup * 32 : kGroup * 16 + HI * kGroup * 4;  // before the scales
  static constexpr int64_t kBlockBytes = kCodes + kScales;
  static constexpr int64_t kBytes = kHead + kSuper * kBlockBytes;
  static constexpr int kKind = MODE == 0 ? 4 : (MODE == 1 ? 5 + HI : 4 + MODE);  // 4 Q5_0/1, 5 Q4_K, 6 Q5_K, 7 Q6_K, 8 Q6_K bytes
  static_assert(HI != 0 || MODE == 1 || MODE == 3, "4-bit q: MODE 1 only (one D and C a block)");

  // the block's 8 outputs' D and C for lanes 0-15 and 16-31 (MODE 2: C unused), formed at once
  // (lanes 0-7 of each; output j's picked by a permute in load)
  struct Prep {
#if defined(__AVX512F__)
    __m512 D0, D1, C0, C1;
#endif
    float d0[kGroup], d1[kGroup], c0[kGroup], c1[kGroup];  // the scalar path's
  };
  static inline Prep prep(const uint8_t* e, int r) {
    Prep p;
    const uint8_t* sc = e + kHead + r * kBlockBytes + kCodes;
    const float* head = reinterpret_cast<const float*>(e);
#if defined(__AVX512F__)
    auto bytes8 = [](const uint8_t* at, bool sign) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at));
      return _mm512_cvtepi32_ps(sign ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
    };
    auto floats8 = [](const void* at) { return _mm512_castps256_ps512(_mm256_loadu_ps(reinterpret_cast<const float*>(at))); };
    if constexpr (MODE == 0) {
      p.D0 = p.D1 = floats8(sc);
      p.C0 = p.C1 = floats8(sc + kGroup * 4);
    } else if constexpr (MODE == 1) {
      p.D0 = p.D1 = _mm512_mul_ps(floats8(head), bytes8(sc, false));
      p.C0 = p.C1 = _mm512_mul_ps(floats8(head + kGroup), bytes8(sc + kGroup, false));
    } else {  // MODE 2, 3
      p.D0 = _mm512_mul_ps(floats8(head), bytes8(sc, true));
      p.D1 = _mm512_mul_ps(floats8(head), bytes8(sc + kGroup, true));
      p.C0 = p.C1 = _mm512_setzero_ps();
    }
#else
    for (int j = 0; j < kGroup; ++j) {
      if constexpr (MODE == 0) {
        p.d0[j] = p.d1[j] = reinterpret_cast<const float*>(sc)[j];
        p.c0[j] = p.c1[j] = reinterpret_cast<const float*>(sc)[kGroup + j];
      } else if constexpr (MODE == 1) {
        p.d0[j] = p.d1[j] = head[j] * static_cast<float>(sc[j]);
        p.c0[j] = p.c1[j] = head[kGroup + j] * static_cast<float>(sc[kGroup + j]);
      } else {
        const int8_t* s8 = reinterpret_cast<const int8_t*>(sc);
        p.d0[j] = head[j] * static_cast<float>(s8[j]);
        p.d1[j] = head[j] * static_cast<float>(s8[kGroup + j]);
        p.c0[j] = p.c1[j] = 0.0f;
      }
    }
#endif
    return p;
  }
  static inline uint32_t plane(const uint8_t* blk, int p, int j) {
    uint32_t v;
    std::memcpy(&v, blk + kGroup * 16 + (p * kGroup + j) * 4, 4);
    return v;
  }
#if defined(__AVX512F__)
  static inline void load(const uint8_t* e, int r, int j, const Prep& pr, __m512& w0, __m512& w1) {
    const uint8_t* blk = e + kHead + r * kBlockBytes;
    const __m512i lane = _mm512_set1_epi32(j);
    const __m512 D0 = _mm512_permutexvar_ps(lane, pr.D0), C0 = _mm512_permutexvar_ps(lane, pr.C0);
    const __m512 D1 = MODE >= 2 ? _mm512_permutexvar_ps(lane, pr.D1) : D0, C1 = C0;
    if constexpr (MODE == 3) {  // the codes as bytes: exact8's decode
      (void)C1;
      const __m128i* qb = reinterpret_cast<const __m128i*>(blk + j * 32);
      w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb))), D0);
      w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb + 1))), D1);
      return;
    }
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + j * 16)));
    if constexpr (HI == 0) {  // Weights4's table: the block's 16 weights fma(q, D, C), picked by each nibble
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512 table = _mm512_fmadd_ps(iota, D0, C0);
      w0 = _mm512_permutexvar_ps(v, table);
      w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    } else {
      __m512i q0 = _mm512_and_si512(v, _mm512_set1_epi32(0x0f)), q1 = _mm512_srli_epi32(v, 4);
      for (int p = 0; p < HI; ++p) {
        const uint32_t h = plane(blk, p, j);
        const __m512i bit = _mm512_set1_epi32(16 << p);
        q0 = _mm512_mask_or_epi32(q0, static_cast<__mmask16>(h & 0xffff), q0, bit);
        q1 = _mm512_mask_or_epi32(q1, static_cast<__mmask16>(h >> 16), q1, bit);
      }
      if constexpr (MODE == 2) {
        const __m512i off = _mm512_set1_epi32(32);
        w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q0, off)), D0);
        w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q1, off)), D1);
      } else {
        w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), D0, C0);
        w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), D1, C1);
      }
    }
  }
#endif
  static inline void load(const uint8_t* e, int r, int j, const Prep& pr, float* w0, float* w1) {
    const uint8_t* blk = e + kHead + r * kBlockBytes;
    const float D[2] = {pr.d0[j], pr.d1[j]}, C[2] = {pr.c0[j], pr.c1[j]};
    if constexpr (MODE == 3) {
      const int8_t* qb = reinterpret_cast<const int8_t*>(blk + j * 32);
      for (int l = 0; l < 16; ++l) {
        w0[l] = static_cast<float>(qb[l]) * D[0];
        w1[l] = static_cast<float>(qb[16 + l]) * D[1];
      }
      return;
    }
    uint32_t h[2] = {HI > 0 ? plane(blk, 0, j) : 0u, HI > 1 ? plane(blk, 1, j) : 0u};
    for (int l = 0; l < 16; ++l) {
      const uint8_t byte = blk[j * 16 + l];
      int q0 = byte & 0x0f, q1 = byte >> 4;
      for (int p = 0; p < HI; ++p) {
        q0 |= static_cast<int>((h[p] >> l) & 1u) << (4 + p);
        q1 |= static_cast<int>((h[p] >> (16 + l)) & 1u) << (4 + p);
      }
      if constexpr (MODE == 2) {
        w0[l] = static_cast<float>(q0 - 32) * D[0];
        w1[l] = static_cast<float>(q1 - 32) * D[1];
      } else {
        w0[l] = std::fma(static_cast<float>(q0), D[0], C[0]);
        w1[l] = std::fma(static_cast<float>(q1), D[1], C[1]);
      }
    }
  }
};

// -- idot: GGUF blocks on integer dot products (lp.kernels.idot) ---------------------------------------
// Every block format is w = D u + C per 32 inputs (u the unsigned code: Q4_0 D = d, C = -8 d; Q4_1 C = m;
// Q5_0 / Q5_1 alike with 5 bits; Q8_0 u = q + 128, C = -128 d; Q4_K / Q5_K D = d sc, C = nm mn; Q6_K a D per
// 16 inputs, C = -32 D). x is held per 32 inputs as X = x 2^e rounded to an integer, |X| < 2^23 (e from the
// block's largest |x|: 23 significant bits, the largest element's rounding at most 2^-23 of it; 21-22 bits for
// the kinds of IDotInt), split into three signed int8 digits X = 2^16 x1 + 2^8 x2 + x3. AVX-512 VNNI's vpdpbusd
// forms sum(u x_i) exactly in int32, 16 outputs a lane each; per block t = 2^16 S1 + (2^8 S2 + S3) is exact in
// double (IDotInt's kinds: t, or t - k sum(X) where C = -k D, fits int32 and is formed there modulo 2^32; then no
// C term), and each output accumulates
// acc = fma(t, D 2^-e, acc); acc = fma(C, sum(X) 2^-e, acc) in double (each product exact, one rounding a step),
// rounded to float32 once at the end. A row's result depends on that row only (rows share the weights' decode,
// never a sum). Packed: per group of 16 outputs, entries of kSuper blocks: a header (K-quants: d[16], nm[16]
// float32; Q6_K: d[16]), then per block the codes (kCodes bytes: 4 x 64 nibble bytes, byte 4 i + t of vector c
// holding output i's u[8c + t] (low) and u[8c + 4 + t] (high); then 1-2 planes of 8 x 64 bits, bit 4 i + t of
// word 2c + h the code's bit 4 (5) of u[8c + 4h + t]; or 8 x 64 code bytes, vector c holding u[4c + t]) and the
// scales (F16: D[16], C[16] float16; F32: float32; K: sc[16], mn[16] uint8; 6K: sc[16] of inputs 0-15, sc[16] of
// 16-31, int8; D0: D[16] float16, C = -8 / -16 / -128 D; D0F: D[16] float32, C = -128 D). lp.kernels.idot.packi
// writes it; lp.kernels.idot.reference is this arithmetic in torch.
// CODE 4 (IQ4_NL / IQ4_XS, AVX-512 build only): a nibble indexing IQ4's sixteen int8 values, u = value + 128 (one
// vpshufb a code vector), C = -128 D: Q8_0's arithmetic at 4 bits a code. CODE 5 (Q3_K, AVX-512 build only): 2-bit
// codes, 2 x 64 bytes (bits 2h, 2h + 1 of byte 4 i + t of vector s: output i's u[4 (4 s + h) + t]), then one plane
// (bit 2, as the nibble kinds' planes), with Q6_K's scales (6K) and C = -4 D: 3.6 bits a weight (the file's 3.44).
// CODE 6 (Q2_K, AVX-512 build only): the crumbs alone, with K16 scales: Q4_K's (a header d[16], nm[16] float32 per
// super-block; D = d sc, C = nm mn) per 16 inputs (sc[16] of inputs 0-15, sc[16] of 16-31, then mn alike, uint8):
// 3.25 bits a weight (the file's 2.625). SCALE 7 (XS, IQ4_XS): a header d[16] float32 per super-block, per block
// sc[16] int8 (the file's scale - 32), D = d sc, C = -128 D: 4.375 bits a weight with CODE 4 (the file's 4.25).
template <int CODE, int SCALE>  // CODE 0 nibble, 1 nibble + 1 plane, 2 nibble + 2 planes, 3 bytes, 4 IQ4 nibble,
struct IDot {                   // 5 crumb + 1 plane, 6 crumb; SCALE 0 F16, 1 F32, 2 K, 3 6K, 4 D0, 5 D0F, 6 K16, 7 XS
  static constexpr int64_t kSuper = SCALE == 2 || SCALE == 3 || SCALE == 6 || SCALE == 7 ? 8 : 1;
  static constexpr int64_t kHead = SCALE == 2 || SCALE == 6 ? 128 : (SCALE == 3 || SCALE == 7 ? 64 : 0);
  static constexpr int kPlanes = CODE <= 2 ? CODE : (CODE == 5 ? 1 : 0);  // bit planes above the nibble (crumb)
  static constexpr int64_t kLow = CODE == 5 || CODE == 6 ? 128 : 256;  // bytes of the low codes (nibbles, or crumbs)
  static constexpr int64_t kCodes = CODE == 3 ? 512 : kLow + kPlanes * 64;
  static constexpr int64_t kScales = SCALE == 1 ? 128 : (SCALE == 0 || SCALE == 5 || SCALE == 6 ? 64 : (SCALE == 7 ? 16 : 32));
  static constexpr int64_t kBlockBytes = kCodes + kScales;
  static constexpr int64_t kBytes = kHead + kSuper * kBlockBytes;
  static constexpr int kHalves = SCALE == 3 || SCALE == 6 ? 2 : 1;
};

// C = k D of the kinds that hold D alone (SCALE 4, 5): k by the code's width
constexpr float code_offset(int code) {
  return code == 0 ? -8.0f : (code == 1 ? -16.0f : (code == 2 ? -32.0f : (code == 5 ? -4.0f : -128.0f)));
}
// IQ4_NL / IQ4_XS's code values (gguf.quants.IQ4_NL.kvalues) plus 128: CODE 4's unsigned codes
constexpr uint8_t kIq4Codes[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

constexpr int kIdotRows = 32;  // rows a pass over a group's blocks holds accumulators for

// x's digits and scales: per row 3 x K int8 (x1, x2, x3), per row and block s = 2^-e and sum(X) s (double;
// the AVX2 build: also over the block's first 16 inputs, and the top digits' sums); sums: see below
struct IDotX {
  std::vector<int8_t> digits;
  std::vector<double> scales;
  std::vector<double> resid;  // AVX2 build: per row ||x - x'||_2, x' = 2^16 x1 2^-e (the screen's bound)
  std::vector<int32_t> sums;  // AVX-512 build: per row sum(X) over each block, then over each block's first 16 inputs
};

#if defined(LP_IDOT512)
// X's width a kind takes (kTop: |X| < 2^(kTop + 1)): the widest whose block sums t of integer codes times X fit
// int32 (kOn: kinds 20, 21, 23, 24, 25, 29, 30), so t converts to double in one step; top 22 otherwise (the
// three int8 digits' 8355711, t in two parts)
template <int CODE, int SCALE>
struct IDotInt {
  // |t| < 2^31: 4-bit codes 23 bits centred (C = -8 D: |u - 8| <= 8, 32 inputs), 22 not; 5-bit codes 22 centred,
  // 21 not; Q6_K 22 (centred, 16 inputs a half)
  // Q3_K (CODE 5): 3-bit codes centred, |u - 4| <= 4 over 16 inputs a half: 22; Q2_K (6): u <= 3 over 16: 22
  static constexpr bool kOn = (CODE <= 2 || CODE == 5 || CODE == 6) && SCALE != 1;
  static constexpr bool kFold = kOn && (SCALE == 3 || SCALE == 4);  // C = -k D: t = sum (u - k) X, no C term
  static constexpr int kCenter = static_cast<int>(-code_offset(CODE));
  static constexpr int kTop = !kOn ? 22 : (CODE == 0 ? (kFold ? 22 : 21) : (CODE == 1 ? (kFold ? 21 : 20) : (CODE >= 5 ? 22 : 21)));
};

IDotX idot_prep(const float* x, int64_t M, int64_t K, int top = 22) {
  const int64_t B = K / kBlock;
  // the largest X: three int8 digits hold 8355711 (top 22); below, 2^(top + 1) - 1
  const double cap = top == 22 ? 8355711.0 : std::ldexp(1.0, top + 1) - 1.0;
  IDotX out{std::vector<int8_t>(3 * M * K), std::vector<double>(2 * M * B), {}, std::vector<int32_t>(2 * M * B)};
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* x1 = out.digits.data() + 3 * m * K;
      double* s = out.scales.data() + 2 * m * B;
      for (int64_t b = 0; b < B; ++b) {
        const float* xb = x + m * K + b * kBlock;
        const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const bool finite = std::isfinite(mx) && !(_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q));
        int e = 0;
        if (mx > 0.f && finite) {
          e = top - std::ilogb(mx);  // mx 2^e in [2^top, 2^(top + 1))
          if (std::ldexp(static_cast<double>(mx), e) > cap) e -= 1;  // round(mx 2^e) <= cap
        }
        const __m512 ev = _mm512_set1_ps(static_cast<float>(finite ? e : 0));
        int64_t sum[2];
        for (int h = 0; h < 2; ++h) {
          // x 2^e is exact (a power of two), rounded to the nearest integer (ties to even)
          const __m512i X = finite ? _mm512_cvtps_epi32(_mm512_scalef_ps(h ? hi : lo, ev)) : _mm512_setzero_si512();
          sum[h] = _mm512_reduce_add_epi32(X);
          const __m512i d3 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X, c128), c255), c128);
          const __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(X, d3), 8);
          const __m512i d2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, c128), c255), c128);
          const __m512i d1 = _mm512_srai_epi32(_mm512_sub_epi32(r, d2), 8);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(x1 + b * kBlock + 16 * h), _mm512_cvtepi32_epi8(d1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(x1 + K + b * kBlock + 16 * h), _mm512_cvtepi32_epi8(d2));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(x1 + 2 * K + b * kBlock + 16 * h), _mm512_cvtepi32_epi8(d3));
        }
        const double sc = finite ? std::ldexp(1.0, -e) : NAN;  // a non-finite x: the row's outputs NaN
        s[b] = sc;
        s[B + b] = static_cast<double>(sum[0] + sum[1]) * sc;
        out.sums[2 * m * B + b] = static_cast<int32_t>(sum[0] + sum[1]);  // |sum| < 2^28
        out.sums[2 * m * B + B + b] = static_cast<int32_t>(sum[0]);
      }
    }
  });
  return out;
}

// One block of an idot group (the layout above): its 16 outputs' codes u (vector c: lanes 4 i + t hold output i's
// u[4c + t]) and their D and C in double (outputs 0-7 and 8-15; Q6_K: of inputs 0-15, then 16-31); mmi's product
// and the greedy screen's both decode a block here
template <class F, int CODE, int SCALE>
__attribute__((always_inline)) inline void idot_block(const uint8_t* e, const uint8_t* blk, __m512i (&u)[8],
                                                      __m512d (&D)[2][2], __m512d (&C)[2][2]) {
  const __m512i m4 = _mm512_set1_epi8(0x0f), one4 = _mm512_set1_epi8(16), one5 = _mm512_set1_epi8(32);
  auto lo_pd = [](const __m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); };
  auto hi_pd = [](const __m512 v) {
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  if constexpr (CODE == 3) {
    for (int c = 0; c < 8; ++c) u[c] = _mm512_loadu_si512(blk + 64 * c);
  } else {
    if constexpr (CODE == 5 || CODE == 6) {  // crumbs: vector j from bits 2 (j % 4) of low vector j / 4
      const __m512i m2 = _mm512_set1_epi8(0x03);
      for (int s = 0; s < 2; ++s) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * s);
        u[4 * s] = _mm512_and_si512(v, m2);
        u[4 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 2), m2);
        u[4 * s + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m2);
        u[4 * s + 3] = _mm512_and_si512(_mm512_srli_epi16(v, 6), m2);
      }
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * c);
        u[2 * c] = _mm512_and_si512(v, m4);
        u[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      }
    }
    for (int p = 0; p < F::kPlanes; ++p) {
      const uint64_t* plane = reinterpret_cast<const uint64_t*>(blk + F::kLow + 64 * p);
      const __m512i bit = CODE == 5 ? _mm512_set1_epi8(4) : (p == 0 ? one4 : one5);
      // the bit is 0 in the nibble code: a masked byte add sets it, one op (a masked move and an or: two)
      for (int j = 0; j < 8; ++j) u[j] = _mm512_mask_add_epi8(u[j], plane[j], u[j], bit);
    }
    if constexpr (CODE == 4) {  // the nibble's IQ4 value + 128, looked up in each 128-bit lane
      const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Codes)));
      for (int j = 0; j < 8; ++j) u[j] = _mm512_shuffle_epi8(lut, u[j]);
    }
  }
  // the 16 outputs' D and C (double, outputs 0-7 and 8-15; Q6_K: of inputs 0-15, then 16-31)
  const uint8_t* sc = blk + F::kCodes;
  if constexpr (SCALE == 0 || SCALE == 1 || SCALE == 4 || SCALE == 5) {
    __m512 d, c;
    if constexpr (SCALE == 4 || SCALE == 5) {  // Q4_0 / Q5_0 / Q8_0 / IQ4: C = -8 / -16 / -128 D, exact
      d = SCALE == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc))) : _mm512_loadu_ps(sc);
      c = _mm512_mul_ps(d, _mm512_set1_ps(code_offset(CODE)));
    } else if constexpr (SCALE == 0) {
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
      c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32)));
    } else {
      d = _mm512_loadu_ps(sc);
      c = _mm512_loadu_ps(sc + 64);
    }
    D[0][0] = lo_pd(d), D[0][1] = hi_pd(d), C[0][0] = lo_pd(c), C[0][1] = hi_pd(c);
  } else if constexpr (SCALE == 2) {
    const float* hd = reinterpret_cast<const float*>(e);
    const __m512 d = _mm512_mul_ps(_mm512_loadu_ps(hd), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))));
    const __m512 c = _mm512_mul_ps(_mm512_loadu_ps(hd + 16), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16)))));
    D[0][0] = lo_pd(d), D[0][1] = hi_pd(d), C[0][0] = lo_pd(c), C[0][1] = hi_pd(c);  // d sc, nm mn: exact
  } else if constexpr (SCALE == 7) {  // IQ4_XS: D = d sc (an 11-bit d times a 6-bit sc: exact), C = -128 D
    const __m512 d = _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(e)),
                                   _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))));
    const __m512 c = _mm512_mul_ps(d, _mm512_set1_ps(code_offset(CODE)));
    D[0][0] = lo_pd(d), D[0][1] = hi_pd(d), C[0][0] = lo_pd(c), C[0][1] = hi_pd(c);
  } else if constexpr (SCALE == 6) {  // per 16 inputs: D = d sc, C = nm mn, exact
    const float* hd = reinterpret_cast<const float*>(e);
    for (int h = 0; h < 2; ++h) {
      const __m512 d = _mm512_mul_ps(_mm512_loadu_ps(hd), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * h)))));
      const __m512 c = _mm512_mul_ps(_mm512_loadu_ps(hd + 16), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 32 + 16 * h)))));
      D[h][0] = lo_pd(d), D[h][1] = hi_pd(d), C[h][0] = lo_pd(c), C[h][1] = hi_pd(c);
    }
  } else {
    const __m512 hd = _mm512_loadu_ps(reinterpret_cast<const float*>(e));
    const __m512 m32 = _mm512_set1_ps(code_offset(CODE));  // Q6_K -32, Q3_K -4
    for (int h = 0; h < 2; ++h) {
      const __m512 d = _mm512_mul_ps(hd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * h)))));
      const __m512 c = _mm512_mul_ps(d, m32);
      D[h][0] = lo_pd(d), D[h][1] = hi_pd(d), C[h][0] = lo_pd(c), C[h][1] = hi_pd(c);
    }
  }
}

template <class F, int CODE, int SCALE>
void idot_group(const uint8_t* grp, int64_t entries, const IDotX& xd, int64_t M, int64_t K, float* y, int64_t N,
                int64_t n0, bool prefetch) {
  using I = IDotInt<CODE, SCALE>;
  const int64_t B = K / kBlock;
  alignas(64) double acc[kIdotRows][16];
  const __m512d k16 = _mm512_set1_pd(65536.0);
  for (int64_t m0 = 0; m0 < M; m0 += kIdotRows) {
    const int64_t mt = std::min<int64_t>(kIdotRows, M - m0);
    for (int64_t m = 0; m < mt; ++m) {
      _mm512_store_pd(acc[m], _mm512_setzero_pd());
      _mm512_store_pd(acc[m] + 8, _mm512_setzero_pd());
    }
    for (int64_t en = 0; en < entries; ++en) {
      const uint8_t* e = grp + en * F::kBytes;
      for (int r = 0; r < F::kSuper; ++r) {
        const int64_t b = en * F::kSuper + r;
        const uint8_t* blk = e + F::kHead + r * F::kBlockBytes;
        if (prefetch && m0 == 0)
          for (int64_t l = 0; l < F::kBlockBytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetch + l, _MM_HINT_T0);
        __m512i u[8];
        __m512d D[2][2], C[2][2];
        idot_block<F, CODE, SCALE>(e, blk, u, D, C);
        for (int64_t m = 0; m < mt; ++m) {
          const int8_t* xr = xd.digits.data() + 3 * (m0 + m) * K + b * kBlock;
          const int32_t* w1 = reinterpret_cast<const int32_t*>(xr);
          const int32_t* w2 = reinterpret_cast<const int32_t*>(xr + K);
          const int32_t* w3 = reinterpret_cast<const int32_t*>(xr + 2 * K);
          const double* sr = xd.scales.data() + 2 * (m0 + m) * B;
          const __m512d s = _mm512_set1_pd(sr[b]);
          __m512d a0 = _mm512_load_pd(acc[m]), a1 = _mm512_load_pd(acc[m] + 8);
          for (int h = 0; h < F::kHalves; ++h) {
            constexpr int per = 8 / F::kHalves;
            // two chains a digit (even and odd j), summed after: integer sums, exact in any order (4-8 rows
            // 2-3% faster on one thread of an AVX-512 EPYC, one row the same: the count of ops sets the time)
            __m512i S1 = _mm512_setzero_si512(), S2 = S1, S3 = S1, T1 = S1, T2 = S1, T3 = S1;
            for (int j = h * per; j < (h + 1) * per; j += 2) {
              S1 = _mm512_dpbusd_epi32(S1, u[j], _mm512_set1_epi32(w1[j]));
              S2 = _mm512_dpbusd_epi32(S2, u[j], _mm512_set1_epi32(w2[j]));
              S3 = _mm512_dpbusd_epi32(S3, u[j], _mm512_set1_epi32(w3[j]));
              T1 = _mm512_dpbusd_epi32(T1, u[j + 1], _mm512_set1_epi32(w1[j + 1]));
              T2 = _mm512_dpbusd_epi32(T2, u[j + 1], _mm512_set1_epi32(w2[j + 1]));
              T3 = _mm512_dpbusd_epi32(T3, u[j + 1], _mm512_set1_epi32(w3[j + 1]));
            }
            S1 = _mm512_add_epi32(S1, T1), S2 = _mm512_add_epi32(S2, T2), S3 = _mm512_add_epi32(S3, T3);
            __m512d t0, t1;  // t of outputs 0-7 and 8-15, exact in double
            if constexpr (I::kOn) {
              // t = 2^16 S1 + 2^8 S2 + S3 (- k sum X) fits int32 (IDotInt): summed modulo 2^32, exact
              __m512i R = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(S1, 16), _mm512_slli_epi32(S2, 8)), S3);
              if constexpr (I::kFold) {
                const int32_t* xs = xd.sums.data() + 2 * (m0 + m) * B;
                const int32_t sum = F::kHalves == 1 ? xs[b] : (h == 0 ? xs[B + b] : xs[b] - xs[B + b]);
                R = _mm512_sub_epi32(R, _mm512_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(sum) * I::kCenter)));
              }
              t0 = _mm512_cvtepi32_pd(_mm512_castsi512_si256(R));
              t1 = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(R, 1));
            } else {
              // t = 2^16 S1 + (2^8 S2 + S3): the parenthesis fits int32 (|S2|, |S3| < 2^21)
              static_assert(F::kHalves == 1, "Q6_K's halves take IDotInt's path");
              const __m512i R = _mm512_add_epi32(_mm512_slli_epi32(S2, 8), S3);
              t0 = _mm512_fmadd_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(S1)), k16,
                                   _mm512_cvtepi32_pd(_mm512_castsi512_si256(R)));
              t1 = _mm512_fmadd_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(S1, 1)), k16,
                                   _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(R, 1)));
            }
            a0 = _mm512_fmadd_pd(t0, _mm512_mul_pd(D[h][0], s), a0);
            a1 = _mm512_fmadd_pd(t1, _mm512_mul_pd(D[h][1], s), a1);
            if constexpr (!I::kFold) {  // C (sum X 2^-e; of the half: Q2_K's C per 16, the sum exact in double)
              const int32_t* xs = xd.sums.data() + 2 * (m0 + m) * B;
              const __m512d sxv = _mm512_set1_pd(F::kHalves == 1 ? sr[B + b]
                                                 : static_cast<double>(h == 0 ? xs[B + b] : xs[b] - xs[B + b]) * sr[b]);
              a0 = _mm512_fmadd_pd(C[h][0], sxv, a0);
              a1 = _mm512_fmadd_pd(C[h][1], sxv, a1);
            }
          }
          _mm512_store_pd(acc[m], a0);
          _mm512_store_pd(acc[m] + 8, a1);
        }
      }
    }
    for (int64_t m = 0; m < mt; ++m) {
      alignas(64) float out[16];
      _mm256_store_ps(out, _mm512_cvtpd_ps(_mm512_load_pd(acc[m])));
      _mm256_store_ps(out + 8, _mm512_cvtpd_ps(_mm512_load_pd(acc[m] + 8)));
      for (int i = 0; i < 16 && n0 + i < N; ++i) y[(m0 + m) * N + n0 + i] = out[i];
    }
  }
}

// The greedy head's screen product (lp.kernels.idot.IScreen) in the AVX-512 build: x's top two digits alone,
// X'' = 2^16 x1 + 2^8 x2 per block (mmi's X less its last digit x3), on the int8 dots: per block t = 2^16 S1 +
// 2^8 S2, exact in double, and acc += t (D 2^-e) + C (sum X'' 2^-e) in double, rounded to float32 once.
// sx: per row, sum X'' 2^-e over each block, then over each block's first 16 inputs (screen_prep)
// The group's outputs y_v are not kept: per row, lo = max_v (y_v - E_v) and hi = max_v (y_v + E_v) over its 16
// tokens go to gl / gu [M, groups] (E_v = 1.001 ||w_v|| R + 9.6e-7 |y_v|, R the row's resid; NaN where a y_v is
// not finite), the selection idot_screen_run makes from them
template <class F, int CODE, int SCALE, int DIG>
void screen_group(const uint8_t* grp, int64_t entries, const IDotX& xd, const double* sx, const double* resid,
                  const float* wn, int64_t M, int64_t K, float* gl, float* gu, int64_t N, int64_t g, int64_t G,
                  bool prefetch) {
  const int64_t n0 = 16 * g;
  const int64_t B = K / kBlock;
  alignas(64) double acc[kIdotRows][16];
  const __m512d k16 = _mm512_set1_pd(65536.0), k8 = _mm512_set1_pd(256.0);
  for (int64_t m0 = 0; m0 < M; m0 += kIdotRows) {
    const int64_t mt = std::min<int64_t>(kIdotRows, M - m0);
    for (int64_t m = 0; m < mt; ++m) {
      _mm512_store_pd(acc[m], _mm512_setzero_pd());
      _mm512_store_pd(acc[m] + 8, _mm512_setzero_pd());
    }
    for (int64_t en = 0; en < entries; ++en) {
      const uint8_t* e = grp + en * F::kBytes;
      for (int r = 0; r < F::kSuper; ++r) {
        const int64_t b = en * F::kSuper + r;
        const uint8_t* blk = e + F::kHead + r * F::kBlockBytes;
        if (prefetch && m0 == 0)
          for (int64_t l = 0; l < F::kBlockBytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetch + l, _MM_HINT_T0);
        __m512i u[8];
        __m512d D[2][2], C[2][2];
        idot_block<F, CODE, SCALE>(e, blk, u, D, C);
        for (int64_t m = 0; m < mt; ++m) {
          const int8_t* xr = xd.digits.data() + 3 * (m0 + m) * K + b * kBlock;
          const int32_t* w1 = reinterpret_cast<const int32_t*>(xr);
          const int32_t* w2 = reinterpret_cast<const int32_t*>(xr + K);
          const double* sxr = sx + 2 * (m0 + m) * B;
          const __m512d s = _mm512_set1_pd(xd.scales[2 * (m0 + m) * B + b]);
          __m512d a0 = _mm512_load_pd(acc[m]), a1 = _mm512_load_pd(acc[m] + 8);
          for (int h = 0; h < F::kHalves; ++h) {
            constexpr int per = 8 / F::kHalves;
            __m512i S1 = _mm512_setzero_si512(), S2 = S1, T1 = S1, T2 = S1;
            for (int j = h * per; j < (h + 1) * per; j += 2) {
              S1 = _mm512_dpbusd_epi32(S1, u[j], _mm512_set1_epi32(w1[j]));
              T1 = _mm512_dpbusd_epi32(T1, u[j + 1], _mm512_set1_epi32(w1[j + 1]));
              if constexpr (DIG == 2) {
                S2 = _mm512_dpbusd_epi32(S2, u[j], _mm512_set1_epi32(w2[j]));
                T2 = _mm512_dpbusd_epi32(T2, u[j + 1], _mm512_set1_epi32(w2[j + 1]));
              }
            }
            S1 = _mm512_add_epi32(S1, T1);
            __m512d t0, t1;
            if constexpr (DIG == 2) {
              // 2^16 S1 + 2^8 S2: both products exact, |t| < 2^43, so the one rounding of the fma is none
              S2 = _mm512_add_epi32(S2, T2);
              t0 = _mm512_fmadd_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(S1)), k16,
                                   _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(S2)), k8));
              t1 = _mm512_fmadd_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(S1, 1)), k16,
                                   _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(S2, 1)), k8));
            } else {
              t0 = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(S1)), k16);
              t1 = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(S1, 1)), k16);
            }
            const __m512d sxv = _mm512_set1_pd(F::kHalves == 1 ? sxr[b] : (h == 0 ? sxr[B + b] : sxr[b] - sxr[B + b]));
            a0 = _mm512_fmadd_pd(t0, _mm512_mul_pd(D[h][0], s), a0);
            a1 = _mm512_fmadd_pd(t1, _mm512_mul_pd(D[h][1], s), a1);
            a0 = _mm512_fmadd_pd(C[h][0], sxv, a0);
            a1 = _mm512_fmadd_pd(C[h][1], sxv, a1);
          }
          _mm512_store_pd(acc[m], a0);
          _mm512_store_pd(acc[m] + 8, a1);
        }
      }
    }
    // the group's tokens (a tail group: its first N - n0), each E as the token-by-token loop computed it
    const __mmask16 live = static_cast<__mmask16>(N - n0 >= 16 ? 0xffff : (1u << (N - n0)) - 1);
    const __m512 wv = _mm512_maskz_loadu_ps(live, wn + n0), c1001 = _mm512_set1_ps(1.001f), c96 = _mm512_set1_ps(9.6e-7f);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t m = 0; m < mt; ++m) {
      const __m512 y = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(_mm512_load_pd(acc[m]))),
                                          _mm512_cvtpd_ps(_mm512_load_pd(acc[m] + 8)), 1);
      const __m512 R = _mm512_set1_ps(static_cast<float>(resid[m0 + m]));
      // e = 1.001 (w R) + 9.6e-7 |y|: the products and the sum rounded one by one (no fma), as in the loop before
      const __m512 e = _mm512_add_ps(_mm512_mul_ps(c1001, _mm512_mul_ps(wv, R)), _mm512_mul_ps(c96, _mm512_abs_ps(y)));
      const bool finite = (_mm512_mask_cmp_ps_mask(live, y, y, _CMP_UNORD_Q) |
                           _mm512_mask_cmp_ps_mask(live, _mm512_abs_ps(y), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ)) == 0;
      gl[(m0 + m) * G + g] = finite ? _mm512_mask_reduce_max_ps(live, _mm512_mask_sub_ps(ninf, live, y, e)) : NAN;
      gu[(m0 + m) * G + g] = finite ? _mm512_mask_reduce_max_ps(live, _mm512_mask_add_ps(ninf, live, y, e)) : NAN;
    }
  }
}

// The screen's sums and bound from mmi's digits (idot_prep with the kind's top): sx [M, 2B] (sum X'' 2^-e over
// each block, then over its first 16 inputs: integers times a power of two, exact in double) and per row
// R = 1.001 ||(X - X'') 2^-e|| + 2^-30 ||X 2^-e||: X - X'' is the last digit x3, and the two products' double
// sums (the screen's and mmi's: one rounding of 2^-53 a block and term, their sum of |terms| at most ||w|| ||X
// 2^-e||) fit 2^-30 many times over; NaN for a row that is not finite
void screen_prep(const IDotX& xd, int64_t M, int64_t K, int digits, std::vector<double>& sx, std::vector<double>& resid) {
  const int64_t B = K / kBlock;
  sx.assign(2 * M * B, 0.0);
  resid.assign(M, 0.0);
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* x1 = xd.digits.data() + 3 * m * K;
    const int8_t* x2 = x1 + K;
    const int8_t* x3 = x1 + 2 * K;
    double r2 = 0.0, n2 = 0.0;
    bool finite = true;
    for (int64_t b = 0; b < B; ++b) {
      const double sc = xd.scales[2 * m * B + b];
      finite &= std::isfinite(sc);
      int64_t all = 0, first = 0, last = 0, whole = 0;
      for (int i = 0; i < kBlock; ++i) {
        const int64_t k = b * kBlock + i;
        const int64_t X = 65536 * static_cast<int64_t>(x1[k]) + 256 * static_cast<int64_t>(x2[k]) + x3[k];
        const int64_t top = digits == 2 ? X - x3[k] : 65536 * static_cast<int64_t>(x1[k]);
        all += top;
        if (i < 16) first += top;
        last += (X - top) * (X - top);
        whole += X * X;
      }
      sx[2 * m * B + b] = static_cast<double>(all) * sc;
      sx[2 * m * B + B + b] = static_cast<double>(first) * sc;
      r2 += static_cast<double>(last) * sc * sc;
      n2 += static_cast<double>(whole) * sc * sc;
    }
    resid[m] = finite ? 1.001 * std::sqrt(r2) + std::ldexp(1.0, -30) * std::sqrt(n2) : NAN;
  }
}

#elif defined(LP_IDOT256)
// AVX2: the digits and scales idot_prep's AVX-512 form makes (x 2^e exact in float where 2^e is a normal float,
// else in double; either way rounded once to the nearest integer, ties to even)
IDotX idot_prep(const float* x, int64_t M, int64_t K) {
  const int64_t B = K / kBlock;
  IDotX out{std::vector<int8_t>(3 * M * K), std::vector<double>(5 * M * B), std::vector<double>(M, 0.0)};
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    const __m256i c128 = _mm256_set1_epi32(128), c255 = _mm256_set1_epi32(255);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* x1 = out.digits.data() + 3 * m * K;
      double* s = out.scales.data() + 5 * m * B;
      double resid = 0.0, norm = 0.0;
      for (int64_t b = 0; b < B; ++b) {
        const float* xb = x + m * K + b * kBlock;
        __m256 v[4], mxv = _mm256_setzero_ps();
        int unord = 0;
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm256_loadu_ps(xb + 8 * i);
          mxv = _mm256_max_ps(mxv, _mm256_andnot_ps(sign, v[i]));
          unord |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mxv);
        float mx = 0.f;
        for (float l : lanes) mx = std::max(mx, l);
        const bool finite = std::isfinite(mx) && !unord;
        int e = 0;
        if (mx > 0.f && finite) {
          e = 22 - std::ilogb(mx);
          if (std::ldexp(static_cast<double>(mx), e) > 8355711.0) e -= 1;
        }
        __m256i X[4];
        for (int i = 0; i < 4; ++i) {
          if (!finite) {
            X[i] = _mm256_setzero_si256();
          } else if (e >= -126 && e <= 127) {
            X[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(std::ldexp(1.0f, e))));
          } else {
            alignas(32) int32_t xi[8];
            for (int l = 0; l < 8; ++l)
              xi[l] = static_cast<int32_t>(std::nearbyint(std::ldexp(static_cast<double>(xb[8 * i + l]), e)));
            X[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(xi));
          }
        }
        int64_t sum[2];
        for (int h = 0; h < 2; ++h) {
          alignas(32) int32_t t[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_add_epi32(X[2 * h], X[2 * h + 1]));
          sum[h] = 0;
          for (int32_t l : t) sum[h] += l;
        }
        __m256i d[3][4];
        for (int i = 0; i < 4; ++i) {
          d[2][i] = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(X[i], c128), c255), c128);
          const __m256i r = _mm256_srai_epi32(_mm256_sub_epi32(X[i], d[2][i]), 8);
          d[1][i] = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(r, c128), c255), c128);
          d[0][i] = _mm256_srai_epi32(_mm256_sub_epi32(r, d[1][i]), 8);
        }
        int64_t sum1[2];  // the top digits' sums, and the screen's residual X - 2^16 x1 (squared)
        for (int h = 0; h < 2; ++h) {
          alignas(32) int32_t t[8], r[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_add_epi32(d[0][2 * h], d[0][2 * h + 1]));
          sum1[h] = 0;
          for (int32_t l : t) sum1[h] += l;
          for (int i = 2 * h; i < 2 * h + 2; ++i) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(r), _mm256_sub_epi32(X[i], _mm256_slli_epi32(d[0][i], 16)));
            for (int32_t l : r) resid += static_cast<double>(l) * static_cast<double>(l) * std::ldexp(1.0, -2 * e);
            _mm256_store_si256(reinterpret_cast<__m256i*>(r), X[i]);
            for (int32_t l : r) norm += static_cast<double>(l) * static_cast<double>(l) * std::ldexp(1.0, -2 * e);
          }
        }
        for (int k = 0; k < 3; ++k) {  // 32 int32 in [-128, 127] to 32 int8, in order
          const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(d[k][0], d[k][1]), _mm256_packs_epi32(d[k][2], d[k][3]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(x1 + k * K + b * kBlock), _mm256_permutevar8x32_epi32(p, order));
        }
        const double sc = finite ? std::ldexp(1.0, -e) : NAN;
        s[b] = sc;
        s[B + b] = static_cast<double>(sum[0] + sum[1]) * sc;
        s[2 * B + b] = static_cast<double>(sum[0]) * sc;
        s[3 * B + b] = static_cast<double>(sum1[0] + sum1[1]) * 65536.0 * sc;
        s[4 * B + b] = static_cast<double>(sum1[0]) * 65536.0 * sc;
        if (!finite) resid = NAN;
      }
      // ||X 2^-e - x'|| with 0.1% slack, plus, times ||x||: ||x - X 2^-e|| (< sqrt(32) 2^-22 ||x|| block by
      // block) and the float32 sums of mmi's AVX2 product (fdot_group: chains of K / 4 + 2 roundings, each
      // within 2^-24 of the sum of |w x|, that sum at most ||w|| ||x||)
      const double slack = 6.0 * std::ldexp(1.0, -22) + 1.01 * static_cast<double>(K / 4 + 3) * std::ldexp(1.0, -24) + std::ldexp(1.0, -30);
      out.resid[m] = 1.001 * std::sqrt(resid) + 1.001 * slack * std::sqrt(norm);
    }
  });
  return out;
}

// sum over j of u[j] . x[j] (4 bytes a lane) into S: vpdpbusd where AVX-VNNI is; else vpmaddubsw pairs summed in
// int16 over at most `span` j's (their bound: span 2 |u| 128 < 2^15) and widened by vpmaddwd
template <int CODE>
inline __m256i dot4(const __m256i* u, const int32_t* xw, int j0, int j1) {
#if defined(__AVXVNNI__)
  __m256i S = _mm256_setzero_si256();
  for (int j = j0; j < j1; ++j) S = _mm256_dpbusd_avx_epi32(S, u[j], _mm256_set1_epi32(xw[j]));
  return S;
#else
  static_assert(CODE != 3, "8-bit codes go as two nibbles");
  constexpr int span = CODE == 0 ? 8 : (CODE == 1 ? 4 : 2);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i S = _mm256_setzero_si256();
  for (int j = j0; j < j1; j += span) {
    __m256i p = _mm256_maddubs_epi16(u[j], _mm256_set1_epi32(xw[j]));
    for (int i = j + 1; i < std::min(j + span, j1); ++i) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[i], _mm256_set1_epi32(xw[i])));
    S = _mm256_add_epi32(S, _mm256_madd_epi16(p, ones));
  }
  return S;
#endif
}

// a 32-bit plane word's bits as bytes: byte i of the result = bit where bit i of mask is set (the fifth and sixth
// code bits of Q5_x / Q6_K)
inline __m256i plane256(uint32_t mask, int bit) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                                          3, 3, 3, 3);
  const __m256i bits = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(mask)), spread), bits);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bits), _mm256_set1_epi8(static_cast<char>(bit)));
}

// Half o (outputs 8 o .. 8 o + 7: the 32-byte half o of every 64-byte vector) of a block's codes: u[j] holds
// inputs 4 j .. 4 j + 3 of each output's 32-bit lane (byte t: input 4 j + t). SPLIT8: 8-bit codes as low
// nibbles u[0..7] and high nibbles u[8..15] (vpmaddubsw's int16 bound)
template <int CODE, bool SPLIT8>
inline void codes256(const uint8_t* blk, int o, __m256i* u) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  if constexpr (CODE == 3) {
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * c + 32 * o));
      if constexpr (SPLIT8) {
        u[c] = _mm256_and_si256(v, m4);
        u[8 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      } else {
        u[c] = v;
      }
    }
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * c + 32 * o));
      u[2 * c] = _mm256_and_si256(v, m4);
      u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    for (int p = 0; p < CODE; ++p) {
      const uint32_t* plane = reinterpret_cast<const uint32_t*>(blk + 256 + 64 * p);
      for (int j = 0; j < 8; ++j) u[j] = _mm256_or_si256(u[j], plane256(plane[2 * j + o], p == 0 ? 16 : 32));
    }
  }
}

// D and C (float32, each exact) of half o's 8 outputs for the block at blk (entry e, scales sc); [h]: of inputs
// 16 h .. 16 h + 15 (they differ for Q6_K only)
template <int CODE, int SCALE>
inline void scales256(const uint8_t* e, const uint8_t* sc, int o, __m256* D, __m256* C) {
  if constexpr (SCALE == 4) {  // Q4_0 / Q5_0 / Q8_0: C = -8 / -16 / -128 D
    D[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * o)));
    C[0] = _mm256_mul_ps(D[0], _mm256_set1_ps(CODE == 0 ? -8.0f : (CODE == 1 ? -16.0f : -128.0f)));
  } else if constexpr (SCALE == 0) {
    D[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * o)));
    C[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 32 + 16 * o)));
  } else if constexpr (SCALE == 1) {
    D[0] = _mm256_loadu_ps(reinterpret_cast<const float*>(sc) + 8 * o);
    C[0] = _mm256_loadu_ps(reinterpret_cast<const float*>(sc + 64) + 8 * o);
  } else if constexpr (SCALE == 2) {  // d sc, nm mn
    const float* hd = reinterpret_cast<const float*>(e);
    D[0] = _mm256_mul_ps(_mm256_loadu_ps(hd + 8 * o), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * o)))));
    C[0] = _mm256_mul_ps(_mm256_loadu_ps(hd + 16 + 8 * o), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16 + 8 * o)))));
  } else {  // Q6_K: d sc per 16 inputs, C = -32 D
    const __m256 hd = _mm256_loadu_ps(reinterpret_cast<const float*>(e) + 8 * o);
    for (int h = 0; h < 2; ++h) {
      D[h] = _mm256_mul_ps(hd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16 * h + 8 * o)))));
      C[h] = _mm256_mul_ps(D[h], _mm256_set1_ps(-32.0f));
    }
  }
  if constexpr (SCALE != 3) D[1] = D[0], C[1] = C[0];
}

// The greedy head's screen product (lp.kernels.idot.IScreen): x's top digit alone, X' = 2^16 x1 per block, on
// the int8 dots (per block t = 2^16 sum(u x1) exact; acc += t (D 2^-e) + C (sum X' 2^-e) in double)
template <class F, int CODE, int SCALE>
void screen_group(const uint8_t* grp, int64_t entries, const IDotX& xd, int64_t M, int64_t K, float* y, int64_t N,
                  int64_t n0, bool prefetch) {
  const int64_t B = K / kBlock;
  alignas(64) double acc[kIdotRows][16];
  const __m256d k16 = _mm256_set1_pd(65536.0);
  auto lo_pd = [](const __m256 v) { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); };
  auto hi_pd = [](const __m256 v) { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); };
  for (int64_t m0 = 0; m0 < M; m0 += kIdotRows) {
    const int64_t mt = std::min<int64_t>(kIdotRows, M - m0);
    for (int64_t m = 0; m < mt; ++m)
      for (int i = 0; i < 16; i += 4) _mm256_store_pd(acc[m] + i, _mm256_setzero_pd());
    for (int64_t en = 0; en < entries; ++en) {
      const uint8_t* e = grp + en * F::kBytes;
      for (int r = 0; r < F::kSuper; ++r) {
        const int64_t b = en * F::kSuper + r;
        const uint8_t* blk = e + F::kHead + r * F::kBlockBytes;
        if (prefetch && m0 == 0)
          for (int64_t l = 0; l < F::kBlockBytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetch + l, _MM_HINT_T0);
        for (int o = 0; o < 2; ++o) {
          __m256i u[16];
#if defined(__AVXVNNI__)
          codes256<CODE, false>(blk, o, u);
#else
          codes256<CODE, true>(blk, o, u);
#endif
          __m256 Df[2], Cf[2];
          scales256<CODE, SCALE>(e, blk + F::kCodes, o, Df, Cf);
          const __m256d D[2][2] = {{lo_pd(Df[0]), hi_pd(Df[0])}, {lo_pd(Df[1]), hi_pd(Df[1])}};
          const __m256d C[2][2] = {{lo_pd(Cf[0]), hi_pd(Cf[0])}, {lo_pd(Cf[1]), hi_pd(Cf[1])}};
          for (int64_t m = 0; m < mt; ++m) {
            const int32_t* w1 = reinterpret_cast<const int32_t*>(xd.digits.data() + 3 * (m0 + m) * K + b * kBlock);
            const double* sr = xd.scales.data() + 5 * (m0 + m) * B;
            const __m256d s = _mm256_set1_pd(sr[b]);
            double* ar = acc[m] + 8 * o;
            __m256d a0 = _mm256_load_pd(ar), a1 = _mm256_load_pd(ar + 4);
            for (int h = 0; h < F::kHalves; ++h) {
              constexpr int per = 8 / F::kHalves;
              __m256i S;
#if defined(__AVXVNNI__)
              S = dot4<CODE>(u, w1, h * per, (h + 1) * per);
#else
              if constexpr (CODE == 3)
                S = _mm256_add_epi32(_mm256_slli_epi32(dot4<0>(u + 8, w1, h * per, (h + 1) * per), 4), dot4<0>(u, w1, h * per, (h + 1) * per));
              else
                S = dot4<CODE>(u, w1, h * per, (h + 1) * per);
#endif
              const __m256d t0 = _mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(S)), k16);
              const __m256d t1 = _mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(S, 1)), k16);
              const double sx = F::kHalves == 1 ? sr[3 * B + b] : (h == 0 ? sr[4 * B + b] : sr[3 * B + b] - sr[4 * B + b]);
              const __m256d sxv = _mm256_set1_pd(sx);
              a0 = _mm256_fmadd_pd(t0, _mm256_mul_pd(D[h][0], s), a0);
              a1 = _mm256_fmadd_pd(t1, _mm256_mul_pd(D[h][1], s), a1);
              a0 = _mm256_fmadd_pd(C[h][0], sxv, a0);
              a1 = _mm256_fmadd_pd(C[h][1], sxv, a1);
            }
            _mm256_store_pd(ar, a0);
            _mm256_store_pd(ar + 4, a1);
          }
        }
      }
    }
    for (int64_t m = 0; m < mt; ++m) {
      alignas(32) float out[16];
      for (int i = 0; i < 16; i += 4) _mm_store_ps(out + i, _mm256_cvtpd_ps(_mm256_load_pd(acc[m] + i)));
      for (int i = 0; i < 16 && n0 + i < N; ++i) y[(m0 + m) * N + n0 + i] = out[i];
    }
  }
}

// fdot_group's one- and two-row step over a half block: the widened weights of input 4 j + t go straight into
// partial t of each row (acc rows 64 floats apart)
template <int R>
inline void fdot_fused(const __m256i* u, const __m256* D, const __m256* C, const __m256i* pick, const float* xr, int64_t K,
                       float* ar) {
  const float* xs = xr + (R == 2 ? K : 0);
  float* br = ar + (R == 2 ? 64 : 0);
  __m256 a0 = _mm256_load_ps(ar), a1 = _mm256_load_ps(ar + 8), a2 = _mm256_load_ps(ar + 16), a3 = _mm256_load_ps(ar + 24);
  __m256 b0, b1, b2, b3;
  if constexpr (R == 2) b0 = _mm256_load_ps(br), b1 = _mm256_load_ps(br + 8), b2 = _mm256_load_ps(br + 16), b3 = _mm256_load_ps(br + 24);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m256 d = D[j / 4], c = C[j / 4];
    const __m256 w0 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(u[j], pick[0])), c);
    const __m256 w1 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(u[j], pick[1])), c);
    const __m256 w2 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(u[j], pick[2])), c);
    const __m256 w3 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(u[j], pick[3])), c);
    a0 = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xr + 4 * j), a0);
    a1 = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xr + 4 * j + 1), a1);
    a2 = _mm256_fmadd_ps(w2, _mm256_broadcast_ss(xr + 4 * j + 2), a2);
    a3 = _mm256_fmadd_ps(w3, _mm256_broadcast_ss(xr + 4 * j + 3), a3);
    if constexpr (R == 2) {
      b0 = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xs + 4 * j), b0);
      b1 = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xs + 4 * j + 1), b1);
      b2 = _mm256_fmadd_ps(w2, _mm256_broadcast_ss(xs + 4 * j + 2), b2);
      b3 = _mm256_fmadd_ps(w3, _mm256_broadcast_ss(xs + 4 * j + 3), b3);
    }
  }
  _mm256_store_ps(ar, a0), _mm256_store_ps(ar + 8, a1), _mm256_store_ps(ar + 16, a2), _mm256_store_ps(ar + 24, a3);
  if constexpr (R == 2) _mm256_store_ps(br, b0), _mm256_store_ps(br + 8, b1), _mm256_store_ps(br + 16, b2), _mm256_store_ps(br + 24, b3);
}

// AVX2's product (mmi without AVX-512 VNNI): the same packed codes, each block's 512 weights widened once to the
// file's float32 values w = fma(D, u, C) (one rounding of the exact D u + C: gguf.dequantize's weights), then a
// float32 fma chain per row: output n's four partial sums p_t (t = input mod 4) run over the inputs in order,
// y = (p_0 + p_1) + (p_2 + p_3). On AVX2 an int8 product takes vpmaddubsw + vpmaddwd per digit (three digits a
// row); a float multiply-add a weight and row costs half that, and the rows of a call share the decode.
// A row's result depends on that row only; lp.kernels.idot.reference_float is this arithmetic in torch.
template <class F, int CODE, int SCALE>
void fdot_group(const uint8_t* grp, int64_t entries, const float* x, int64_t M, int64_t K, float* y, int64_t N,
                int64_t n0, bool prefetch) {
  alignas(32) float acc[kIdotRows][64];  // per row: [half o][partial t][8 outputs]
  alignas(32) float w[2][32][8];         // the block's weights: [half o][input][8 outputs]
  __m256i pick[4];  // byte t of every 32-bit lane, zero-extended
  for (int t = 0; t < 4; ++t) {
    alignas(32) int8_t c[32];
    for (int l = 0; l < 32; ++l) c[l] = (l % 4 == 0) ? static_cast<int8_t>((l / 4 % 4) * 4 + t) : static_cast<int8_t>(-128);
    pick[t] = _mm256_load_si256(reinterpret_cast<const __m256i*>(c));
  }
  for (int64_t m0 = 0; m0 < M; m0 += kIdotRows) {
    const int64_t mt = std::min<int64_t>(kIdotRows, M - m0);
    for (int64_t m = 0; m < mt; ++m)
      for (int i = 0; i < 64; i += 8) _mm256_store_ps(acc[m] + i, _mm256_setzero_ps());
    for (int64_t en = 0; en < entries; ++en) {
      const uint8_t* e = grp + en * F::kBytes;
      for (int r = 0; r < F::kSuper; ++r) {
        const int64_t b = en * F::kSuper + r;
        const uint8_t* blk = e + F::kHead + r * F::kBlockBytes;
        if (prefetch && m0 == 0)
          for (int64_t l = 0; l < F::kBlockBytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetch + l, _MM_HINT_T0);
        const uint8_t* sc = blk + F::kCodes;
        for (int o = 0; o < 2; ++o) {  // outputs 8 o .. 8 o + 7: the 32-byte half o of every 64-byte vector
          __m256i u[8];
          codes256<CODE, false>(blk, o, u);
          __m256 D[2], C[2];
          scales256<CODE, SCALE>(e, sc, o, D, C);
          if (mt <= 2) {  // one or two rows: each weight into the rows' multiply-adds as it is widened (the same sums, same order)
            if (mt == 1)
              fdot_fused<1>(u, D, C, pick, x + m0 * K + b * kBlock, K, acc[0] + 32 * o);
            else
              fdot_fused<2>(u, D, C, pick, x + m0 * K + b * kBlock, K, acc[0] + 32 * o);
            continue;
          }
          for (int j = 0; j < 8; ++j)
            for (int t = 0; t < 4; ++t)
              _mm256_store_ps(w[o][4 * j + t], _mm256_fmadd_ps(D[j / 4], _mm256_cvtepi32_ps(_mm256_shuffle_epi8(u[j], pick[t])), C[j / 4]));
        }
        for (int64_t m = 0; mt > 2 && m < mt; ++m) {  // three rows or more: over the widened block
          const float* xr = x + (m0 + m) * K + b * kBlock;
          float* ar = acc[m];
          __m256 a0 = _mm256_load_ps(ar), a1 = _mm256_load_ps(ar + 8), a2 = _mm256_load_ps(ar + 16),
                 a3 = _mm256_load_ps(ar + 24), b0 = _mm256_load_ps(ar + 32), b1 = _mm256_load_ps(ar + 40),
                 b2 = _mm256_load_ps(ar + 48), b3 = _mm256_load_ps(ar + 56);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) {  // partial t of input 4 j + t (x's four from one load: fewer loads than FMAs)
            const __m256 x4 = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(xr + 4 * j));
            const __m256 x0 = _mm256_permute_ps(x4, 0x00), x1 = _mm256_permute_ps(x4, 0x55),
                         x2 = _mm256_permute_ps(x4, 0xaa), x3 = _mm256_permute_ps(x4, 0xff);
            a0 = _mm256_fmadd_ps(_mm256_load_ps(w[0][4 * j]), x0, a0);
            a1 = _mm256_fmadd_ps(_mm256_load_ps(w[0][4 * j + 1]), x1, a1);
            a2 = _mm256_fmadd_ps(_mm256_load_ps(w[0][4 * j + 2]), x2, a2);
            a3 = _mm256_fmadd_ps(_mm256_load_ps(w[0][4 * j + 3]), x3, a3);
            b0 = _mm256_fmadd_ps(_mm256_load_ps(w[1][4 * j]), x0, b0);
            b1 = _mm256_fmadd_ps(_mm256_load_ps(w[1][4 * j + 1]), x1, b1);
            b2 = _mm256_fmadd_ps(_mm256_load_ps(w[1][4 * j + 2]), x2, b2);
            b3 = _mm256_fmadd_ps(_mm256_load_ps(w[1][4 * j + 3]), x3, b3);
          }
          _mm256_store_ps(ar, a0), _mm256_store_ps(ar + 8, a1), _mm256_store_ps(ar + 16, a2), _mm256_store_ps(ar + 24, a3);
          _mm256_store_ps(ar + 32, b0), _mm256_store_ps(ar + 40, b1), _mm256_store_ps(ar + 48, b2), _mm256_store_ps(ar + 56, b3);
        }
      }
    }
    for (int64_t m = 0; m < mt; ++m) {
      alignas(32) float out[16];
      for (int o = 0; o < 2; ++o) {
        const float* ar = acc[m] + 32 * o;
        const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(ar), _mm256_load_ps(ar + 8)),
                                       _mm256_add_ps(_mm256_load_ps(ar + 16), _mm256_load_ps(ar + 24)));
        _mm256_store_ps(out + 8 * o, s);
      }
      for (int i = 0; i < 16 && n0 + i < N; ++i) y[(m0 + m) * N + n0 + i] = out[i];
    }
  }
}
#endif

#if defined(LP_IDOT256)
// idot kinds 32 / 33 (the AVX2 build): 16-bit float weights (GGUF F16 / BF16 tensors, a bf16 / fp16
// checkpoint's weights) widened exactly in the kernel (a float16 or bfloat16 value is a float32 value),
// then fdot_group's sums: four float32 partial sums an output, input i into partial i mod 4 in input order,
// y = (p0 + p1) + (p2 + p3) (lp.kernels.idot.reference_float). Layout (lp.kernels.idot.packi): per group
// of 16 outputs and block of 32 inputs, [half o][input][8 outputs] of 2 bytes, 1024 bytes. A row at a time,
// its eight partial sums in registers over the whole group (the group's 32 K bytes stay in cache for the
// next row).
template <bool BF16>
inline __m256 widen16(const uint8_t* at) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

template <bool BF16>
void f16dot_group(const uint8_t* grp, int64_t blocks, const float* x, int64_t M, int64_t K, float* y, int64_t N,
                  int64_t n0, bool prefetch) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    __m256 a[2][4];
    for (int o = 0; o < 2; ++o)
      for (int t = 0; t < 4; ++t) a[o][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = grp + b * 1024;
      if (prefetch && m == 0)
        for (int64_t l = 0; l < 1024; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetch + l, _MM_HINT_T0);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        for (int t = 0; t < 4; ++t) {
          const int i = 4 * j + t;
          const __m256 xv = _mm256_broadcast_ss(xr + b * kBlock + i);
          a[0][t] = _mm256_fmadd_ps(widen16<BF16>(blk + 16 * i), xv, a[0][t]);
          a[1][t] = _mm256_fmadd_ps(widen16<BF16>(blk + 512 + 16 * i), xv, a[1][t]);
        }
      }
    }
    alignas(32) float out[16];
    for (int o = 0; o < 2; ++o)
      _mm256_store_ps(out + 8 * o, _mm256_add_ps(_mm256_add_ps(a[o][0], a[o][1]), _mm256_add_ps(a[o][2], a[o][3])));
    for (int i = 0; i < 16 && n0 + i < N; ++i) y[m * N + n0 + i] = out[i];
  }
}

torch::Tensor idot16_run(torch::Tensor x, const torch::Tensor& p, int64_t N, bool bf16) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "mmi: x must be [M, K] float32");
  TORCH_CHECK(p.dim() == 3 && p.scalar_type() == torch::kUInt8 && p.is_contiguous() && p.size(2) == 1024,
              "mmi: p must be a packed [groups, blocks, 1024] uint8 tensor (kinds 32 / 33)");
  const int64_t M = x.size(0), K = x.size(1), groups = p.size(0);
  TORCH_CHECK(K % kBlock == 0 && p.size(1) == K / kBlock && N > 0 && (N + 15) / 16 == groups, "mmi: shapes do not match");
  x = x.contiguous();
  at::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint8_t* pp = p.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t group_bytes = p.size(1) * 1024;
  const bool prefetch = g_prefetch.load(std::memory_order_relaxed);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (bf16)
        f16dot_group<true>(pp + g * group_bytes, p.size(1), xp, M, K, yp, N, g * 16, prefetch);
      else
        f16dot_group<false>(pp + g * group_bytes, p.size(1), xp, M, K, yp, N, g * 16, prefetch);
    }
  });
  return y;
}
#endif

#if defined(LP_IDOT512) || defined(LP_IDOT256)

template <int CODE, int SCALE>
torch::Tensor idot_run(torch::Tensor x, const torch::Tensor& p, int64_t N) {
  using F = IDot<CODE, SCALE>;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "mmi: x must be [M, K] float32");
  TORCH_CHECK(p.dim() == 3 && p.scalar_type() == torch::kUInt8 && p.is_contiguous() && p.size(2) == F::kBytes,
              "mmi: p must be a packed [groups, entries, ", F::kBytes, "] uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), groups = p.size(0);
  TORCH_CHECK(K % (kBlock * F::kSuper) == 0 && p.size(1) == K / (kBlock * F::kSuper) && N > 0 && (N + 15) / 16 == groups,
              "mmi: shapes do not match");
  x = x.contiguous();
  at::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint8_t* pp = p.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t group_bytes = p.size(1) * F::kBytes;
  const bool prefetch = g_prefetch.load(std::memory_order_relaxed);
#if defined(LP_IDOT256)
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      fdot_group<F, CODE, SCALE>(pp + g * group_bytes, p.size(1), xp, M, K, yp, N, g * 16, prefetch);
  });
#else
  const IDotX xd = idot_prep(x.data_ptr<float>(), M, K, IDotInt<CODE, SCALE>::kTop);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      idot_group<F, CODE, SCALE>(pp + g * group_bytes, p.size(1), xd, M, K, yp, N, g * 16, prefetch);
  });
#endif
  return y;
}
#endif

// kinds 20..35 (lp.kernels.idot's doc): (CODE, SCALE); 32 / 33 are the AVX2 build's 16-bit floats (no blocks), 34 / 35
// the AVX-512 build's IQ4 nibbles (D float16 / float32), 36 / 37 its Q3_K / Q2_K crumbs, 38 IQ4_XS's nibbles with
// its d per 256 and int8 scales per 32
constexpr int kIdotKinds[19][2] = {{0, 0}, {1, 0}, {3, 0}, {0, 2}, {1, 2}, {2, 3}, {0, 1}, {1, 1}, {3, 1}, {0, 4}, {1, 4}, {3, 4},
                                   {-1, -1}, {-1, -1}, {4, 4}, {4, 5}, {5, 3}, {6, 6}, {4, 7}};

// kinds whose blocks this build's mmi / screeni / rowsi take
bool idot_block_kind(int64_t kind) {
#if defined(LP_IDOT512)
  return (kind >= 20 && kind <= 31) || (kind >= 34 && kind <= 38);
#else
  return kind >= 20 && kind <= 31;
#endif
}

bool idot_available() {
#if defined(LP_IDOT512) || defined(LP_IDOT256)
  return true;
#else
  return false;
#endif
}

torch::Tensor idot_mm(torch::Tensor x, torch::Tensor p, int64_t n, int64_t kind) {
  TORCH_CHECK(kind >= 20 && kind <= 38, "mmi: kind must be 20..38 (lp.kernels.idot), got ", kind);
  TORCH_CHECK(kind <= 33 || idot_block_kind(kind), "mmi: kinds 34..38 (IQ4 nibbles, Q3_K / Q2_K crumbs) run in idot's AVX-512 build");
  if (kind == 32 || kind == 33) {  // 16-bit floats: 32 float16, 33 bfloat16
#if defined(LP_IDOT256)
    return idot16_run(x, p, n, kind == 33);
#else
    TORCH_CHECK(false, "mmi: kinds 32 / 33 (16-bit floats) run in idot's AVX2 build; with AVX-512 they run as exact16 (mm16)");
#endif
  }
#if defined(LP_IDOT512) || defined(LP_IDOT256)
  switch (kind) {
    case 20: return idot_run<0, 0>(x, p, n);
    case 21: return idot_run<1, 0>(x, p, n);
    case 22: return idot_run<3, 0>(x, p, n);
    case 23: return idot_run<0, 2>(x, p, n);
    case 24: return idot_run<1, 2>(x, p, n);
    case 25: return idot_run<2, 3>(x, p, n);
    case 26: return idot_run<0, 1>(x, p, n);
    case 27: return idot_run<1, 1>(x, p, n);
    case 28: return idot_run<3, 1>(x, p, n);
    case 29: return idot_run<0, 4>(x, p, n);
    case 30: return idot_run<1, 4>(x, p, n);
#if defined(LP_IDOT512)
    case 34: return idot_run<4, 4>(x, p, n);
    case 35: return idot_run<4, 5>(x, p, n);
    case 36: return idot_run<5, 3>(x, p, n);
    case 37: return idot_run<6, 6>(x, p, n);
    case 38: return idot_run<4, 7>(x, p, n);
#endif
    default: return idot_run<3, 4>(x, p, n);
  }
#else
  TORCH_CHECK(false, "mmi: this build has neither AVX-512 VNNI nor AVX2 with FMA and F16C (lp.kernels.idot runs only where one is)");
#endif
}

// (blocks an entry, header bytes, code bytes a block, block bytes, entry bytes) of idot kind 20..31 (34, 35)
std::vector<int64_t> idot_layout(int64_t kind) {
  TORCH_CHECK(idot_block_kind(kind), "layouti: kind must be 20..31 (34..38 with AVX-512: lp.kernels.idot), got ", kind);
  const int code = kIdotKinds[kind - 20][0], scale = kIdotKinds[kind - 20][1];
  const int64_t super = scale == 2 || scale == 3 || scale == 6 || scale == 7 ? 8 : 1,
                head = scale == 2 || scale == 6 ? 128 : (scale == 3 || scale == 7 ? 64 : 0);
  const int64_t codes = code == 3 ? 512 : (code == 5 ? 128 + 64 : (code == 6 ? 128 : 256 + (code <= 2 ? code : 0) * 64)),
                scales = scale == 1 ? 128 : (scale == 0 || scale == 5 || scale == 6 ? 64 : (scale == 7 ? 16 : 32));
  return {super, head, codes, codes + scales, head + super * (codes + scales)};
}

#if defined(LP_IDOT256) || defined(LP_IDOT512)
// The greedy head's screen over idot codes (lp.kernels.idot.IBlockHead.argmax_logits): y1 = the product with x's
// top digits alone (x' = 2^16 x1 2^-e per block), within E_v = ||w_v|| R + 2^-20 |y1_v| of the exact product's
// float32 logit (R: ||x - x'|| with slack; Cauchy-Schwarz, then float32 roundings); a token can be a row's
// argmax only if y1_v + E_v >= max_u (y1_u - E_u). Returns (ok, the groups of 16 tokens holding every such
// token of every row), ok false for a non-finite row or more than max_groups groups.
template <int CODE, int SCALE>
std::tuple<bool, at::Tensor> idot_screen_run(torch::Tensor x, const torch::Tensor& p, int64_t N, const torch::Tensor& wnorm,
                                             int64_t max_groups, int64_t digits) {
  using F = IDot<CODE, SCALE>;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "screeni: x must be [M, K] float32");
  TORCH_CHECK(p.dim() == 3 && p.scalar_type() == torch::kUInt8 && p.is_contiguous() && p.size(2) == F::kBytes &&
                  (N + 15) / 16 == p.size(0), "screeni: p must be a packed [groups, entries, ", F::kBytes, "] uint8 tensor");
  TORCH_CHECK(wnorm.dim() == 1 && wnorm.size(0) == N && wnorm.scalar_type() == torch::kFloat32 && wnorm.is_contiguous(),
              "screeni: wnorm must be [N] float32");
  const int64_t M = x.size(0), K = x.size(1), groups = p.size(0);
  TORCH_CHECK(K % (kBlock * F::kSuper) == 0 && p.size(1) == K / (kBlock * F::kSuper), "screeni: shapes do not match");
  x = x.contiguous();
#if defined(LP_IDOT512)
  const IDotX xd = idot_prep(x.data_ptr<float>(), M, K, IDotInt<CODE, SCALE>::kTop);  // mmi's own digits
  std::vector<double> sx, resid;
  TORCH_CHECK(digits == 1 || digits == 2, "screeni: digits must be 1 or 2, got ", digits);
  screen_prep(xd, M, K, static_cast<int>(digits), sx, resid);
#else
  const IDotX xd = idot_prep(x.data_ptr<float>(), M, K);
  const std::vector<double>& resid = xd.resid;
#endif
  for (double r : resid)
    if (!std::isfinite(r)) return {false, at::Tensor()};
  const uint8_t* pp = p.data_ptr<uint8_t>();
  const int64_t group_bytes = p.size(1) * F::kBytes;
  const bool prefetch = g_prefetch.load(std::memory_order_relaxed);
  const float* wn = wnorm.data_ptr<float>();
#if defined(LP_IDOT512)
  // per row and group of 16 tokens: max (y - E) and max (y + E); a row's low is the largest of the first, a
  // group is kept where some row's second reaches that row's low (as the loops below do token by token)
  std::vector<float> gl(M * groups), gu(M * groups);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      if (digits == 2)
        screen_group<F, CODE, SCALE, 2>(pp + g * group_bytes, p.size(1), xd, sx.data(), resid.data(), wn, M, K,
                                        gl.data(), gu.data(), N, g, groups, prefetch);
      else
        screen_group<F, CODE, SCALE, 1>(pp + g * group_bytes, p.size(1), xd, sx.data(), resid.data(), wn, M, K,
                                        gl.data(), gu.data(), N, g, groups, prefetch);
  });
  std::vector<float> low(M, -INFINITY);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      if (std::isnan(gl[m * groups + g])) return {false, at::Tensor()};  // a logit that is not finite
      low[m] = std::max(low[m], gl[m * groups + g]);
    }
  std::vector<int64_t> kept;
  for (int64_t g = 0; g < groups; ++g) {
    bool any = false;
    for (int64_t m = 0; m < M && !any; ++m) any = gu[m * groups + g] >= low[m];
    if (any) {
      kept.push_back(g);
      if (static_cast<int64_t>(kept.size()) > max_groups) return {false, at::Tensor()};
    }
  }
  return {true, torch::tensor(kept, torch::kLong)};
#else
  std::vector<float> y(M * N);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      screen_group<F, CODE, SCALE>(pp + g * group_bytes, p.size(1), xd, M, K, y.data(), N, g * 16, prefetch);
  });
  std::vector<float> low(M, -INFINITY);
  bool finite = true;
  for (int64_t m = 0; m < M; ++m) {
    const float R = static_cast<float>(resid[m]);
    const float* ym = y.data() + m * N;
    float lo = -INFINITY;
    for (int64_t v = 0; v < N; ++v) {
      const float e = 1.001f * (wn[v] * R) + 9.6e-7f * std::fabs(ym[v]);
      lo = std::max(lo, ym[v] - e);
      finite &= std::isfinite(ym[v]);
    }
    low[m] = lo;
  }
  if (!finite) return {false, at::Tensor()};
  std::vector<int64_t> kept;
  for (int64_t g = 0; g < groups; ++g) {
    bool any = false;
    for (int64_t m = 0; m < M && !any; ++m) {
      const float R = static_cast<float>(resid[m]);
      for (int64_t v = g * 16; v < std::min(N, g * 16 + 16); ++v) {
        const float yv = y[m * N + v];
        if (yv + (1.001f * (wn[v] * R) + 9.6e-7f * std::fabs(yv)) >= low[m]) {
          any = true;
          break;
        }
      }
    }
    if (any) {
      kept.push_back(g);
      if (static_cast<int64_t>(kept.size()) > max_groups) return {false, at::Tensor()};
    }
  }
  return {true, torch::tensor(kept, torch::kLong)};
#endif
}
#endif

std::tuple<bool, at::Tensor> idot_screen(torch::Tensor x, torch::Tensor p, int64_t n, int64_t kind, torch::Tensor wnorm,
                                         int64_t max_groups, int64_t digits) {
  TORCH_CHECK(idot_block_kind(kind), "screeni: kind must be 20..31 (34..38 with AVX-512: lp.kernels.idot), got ", kind);
#if defined(LP_IDOT256) || defined(LP_IDOT512)
  switch (kind) {
    case 20: return idot_screen_run<0, 0>(x, p, n, wnorm, max_groups, digits);
    case 21: return idot_screen_run<1, 0>(x, p, n, wnorm, max_groups, digits);
    case 22: return idot_screen_run<3, 0>(x, p, n, wnorm, max_groups, digits);
    case 23: return idot_screen_run<0, 2>(x, p, n, wnorm, max_groups, digits);
    case 24: return idot_screen_run<1, 2>(x, p, n, wnorm, max_groups, digits);
    case 25: return idot_screen_run<2, 3>(x, p, n, wnorm, max_groups, digits);
    case 26: return idot_screen_run<0, 1>(x, p, n, wnorm, max_groups, digits);
    case 27: return idot_screen_run<1, 1>(x, p, n, wnorm, max_groups, digits);
    case 28: return idot_screen_run<3, 1>(x, p, n, wnorm, max_groups, digits);
    case 29: return idot_screen_run<0, 4>(x, p, n, wnorm, max_groups, digits);
    case 30: return idot_screen_run<1, 4>(x, p, n, wnorm, max_groups, digits);
#if defined(LP_IDOT512)
    case 34: return idot_screen_run<4, 4>(x, p, n, wnorm, max_groups, digits);
    case 35: return idot_screen_run<4, 5>(x, p, n, wnorm, max_groups, digits);
    case 36: return idot_screen_run<5, 3>(x, p, n, wnorm, max_groups, digits);
    case 37: return idot_screen_run<6, 6>(x, p, n, wnorm, max_groups, digits);
    case 38: return idot_screen_run<4, 7>(x, p, n, wnorm, max_groups, digits);
#endif
    default: return idot_screen_run<3, 4>(x, p, n, wnorm, max_groups, digits);
  }
#else
  TORCH_CHECK(false, "screeni: this build runs neither of idot's forms (AVX-512 VNNI, or AVX2 with FMA and F16C)");
#endif
}

// whether mmi runs AVX2's float32 product (fdot_group, and the 16-bit kinds 32 / 33): the LP_IDOT256 build
bool idot_float() {
#if defined(LP_IDOT256)
  return true;
#else
  return false;
#endif
}

bool idot_screen_available() {
#if defined(LP_IDOT256) || defined(LP_IDOT512)
  return true;
#else
  return false;
#endif
}

// Rows `ids` of a weight packed by lp.kernels.idot.packi, as float32 [len(ids), K]: each weight the double
// D u + C rounded to float32, the value a unit row's product gives (a tied embedding reads its head's codes)
template <int CODE, int SCALE>
void idot_rows_run(const uint8_t* p, int64_t entries, const int64_t* ids, int64_t n, int64_t K, int64_t N, float* out) {
  using F = IDot<CODE, SCALE>;
  const int64_t group_bytes = entries * F::kBytes;
  auto half = [](const uint8_t* at, int i) {
    return static_cast<float>(c10::Half(reinterpret_cast<const uint16_t*>(at)[i], c10::Half::from_bits()));
  };
  for (int64_t r = 0; r < n; ++r) {
    const int64_t id = ids[r];
    TORCH_CHECK(id >= 0 && id < N, "rowsi: row ", id, " outside 0..", N - 1);
    const int i = static_cast<int>(id % 16);
    for (int64_t en = 0; en < entries; ++en) {
      const uint8_t* e = p + (id / 16) * group_bytes + en * F::kBytes;
      for (int rr = 0; rr < F::kSuper; ++rr) {
        const int64_t b = en * F::kSuper + rr;
        const uint8_t* blk = e + F::kHead + rr * F::kBlockBytes;
        const uint8_t* sc = blk + F::kCodes;
        for (int k = 0; k < 32; ++k) {
          const int j = k / 4, t = k % 4;
          int code;
          if constexpr (CODE == 3) {
            code = blk[64 * j + 4 * i + t];
          } else {
            if constexpr (CODE == 5 || CODE == 6) {
              code = (blk[64 * (j / 4) + 4 * i + t] >> (2 * (j % 4))) & 0x03;
            } else {
              const uint8_t byte = blk[64 * (j / 2) + 4 * i + t];
              code = j % 2 ? byte >> 4 : byte & 0x0f;
            }
            for (int pl = 0; pl < F::kPlanes; ++pl) {
              const uint64_t word = reinterpret_cast<const uint64_t*>(blk + F::kLow + 64 * pl)[j];
              if ((word >> (4 * i + t)) & 1u) code |= CODE == 5 ? 4 : (pl == 0 ? 16 : 32);
            }
          }
          if constexpr (CODE == 4) code = kIq4Codes[code];
          float d, c;
          if constexpr (SCALE == 4 || SCALE == 5) {
            d = SCALE == 4 ? half(sc, i) : reinterpret_cast<const float*>(sc)[i];
            c = d * code_offset(CODE);
          } else if constexpr (SCALE == 0) {
            d = half(sc, i), c = half(sc + 32, i);
          } else if constexpr (SCALE == 1) {
            d = reinterpret_cast<const float*>(sc)[i], c = reinterpret_cast<const float*>(sc + 64)[i];
          } else if constexpr (SCALE == 2) {
            const float* hd = reinterpret_cast<const float*>(e);
            d = hd[i] * static_cast<float>(sc[i]), c = hd[16 + i] * static_cast<float>(sc[16 + i]);
          } else if constexpr (SCALE == 7) {
            d = reinterpret_cast<const float*>(e)[i] * static_cast<float>(static_cast<int8_t>(sc[i]));
            c = d * code_offset(CODE);
          } else if constexpr (SCALE == 6) {
            const float* hd = reinterpret_cast<const float*>(e);
            const int h = k / 16;
            d = hd[i] * static_cast<float>(sc[16 * h + i]), c = hd[16 + i] * static_cast<float>(sc[32 + 16 * h + i]);
          } else {
            d = reinterpret_cast<const float*>(e)[i] * static_cast<float>(static_cast<int8_t>(sc[16 * (k / 16) + i]));
            c = d * code_offset(CODE);
          }
          out[r * K + b * kBlock + k] = static_cast<float>(static_cast<double>(d) * code + static_cast<double>(c));
        }
      }
    }
  }
}

torch::Tensor idot_rows(const torch::Tensor& p, const torch::Tensor& ids_in, int64_t N, int64_t kind) {
  TORCH_CHECK(idot_block_kind(kind), "rowsi: kind must be 20..31 (34..38 with AVX-512: lp.kernels.idot), got ", kind);
  const std::vector<int64_t> lay = idot_layout(kind);
  TORCH_CHECK(p.dim() == 3 && p.scalar_type() == torch::kUInt8 && p.is_contiguous() && p.size(2) == lay[4] &&
                  p.size(0) == (N + 15) / 16, "rowsi: p must be a packed [groups, entries, ", lay[4], "] uint8 tensor of ", N, " rows");
  const at::Tensor ids = ids_in.reshape(-1).to(torch::kLong).contiguous();
  const int64_t n = ids.size(0), entries = p.size(1), K = entries * lay[0] * kBlock;
  at::Tensor out = torch::empty({n, K}, torch::kFloat32);
  const uint8_t* pp = p.data_ptr<uint8_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  switch (kind) {
    case 20: idot_rows_run<0, 0>(pp, entries, ip, n, K, N, op); break;
    case 21: idot_rows_run<1, 0>(pp, entries, ip, n, K, N, op); break;
    case 22: idot_rows_run<3, 0>(pp, entries, ip, n, K, N, op); break;
    case 23: idot_rows_run<0, 2>(pp, entries, ip, n, K, N, op); break;
    case 24: idot_rows_run<1, 2>(pp, entries, ip, n, K, N, op); break;
    case 25: idot_rows_run<2, 3>(pp, entries, ip, n, K, N, op); break;
    case 26: idot_rows_run<0, 1>(pp, entries, ip, n, K, N, op); break;
    case 27: idot_rows_run<1, 1>(pp, entries, ip, n, K, N, op); break;
    case 28: idot_rows_run<3, 1>(pp, entries, ip, n, K, N, op); break;
    case 29: idot_rows_run<0, 4>(pp, entries, ip, n, K, N, op); break;
    case 30: idot_rows_run<1, 4>(pp, entries, ip, n, K, N, op); break;
    case 34: idot_rows_run<4, 4>(pp, entries, ip, n, K, N, op); break;
    case 35: idot_rows_run<4, 5>(pp, entries, ip, n, K, N, op); break;
    case 36: idot_rows_run<5, 3>(pp, entries, ip, n, K, N, op); break;
    case 37: idot_rows_run<6, 6>(pp, entries, ip, n, K, N, op); break;
    case 38: idot_rows_run<4, 7>(pp, entries, ip, n, K, N, op); break;
    default: idot_rows_run<3, 4>(pp, entries, ip, n, K, N, op); break;
  }
  return out;
}

// y = x @ W.T for W packed in WeightsQ's layout (lp.kernels.exactq.packq); kind 4..8 as kKind
torch::Tensor exactq_mm(torch::Tensor x, torch::Tensor p, int64_t n, int64_t kind) {
  switch (kind) {
    case 4: return packed_mm<WeightsQ<1, 0>>("exactq_mm", x, p, n);
    case 5: return packed_mm<WeightsQ<0, 1>>("exactq_mm", x, p, n);
    case 6: return packed_mm<WeightsQ<1, 1>>("exactq_mm", x, p, n);
    case 7: return packed_mm<WeightsQ<2, 2>>("exactq_mm", x, p, n);
    case 8: return packed_mm<WeightsQ<0, 3>>("exactq_mm", x, p, n);
    default: TORCH_CHECK(false, "exactq_mm: kind must be 4 (Q5_0 / Q5_1), 5 (Q4_K), 6 (Q5_K), 7 (Q6_K) or 8 (Q6_K as bytes), got ", kind);
  }
}

std::vector<int64_t> exactq_layout(int64_t kind) {
  auto of = [](auto w) {
    using W = decltype(w);
    return std::vector<int64_t>{W::kSuper, W::kHead, W::kBlockBytes, W::kBytes};
  };
  switch (kind) {
    case 4: return of(WeightsQ<1, 0>{});
    case 5: return of(WeightsQ<0, 1>{});
    case 6: return of(WeightsQ<1, 1>{});
    case 7: return of(WeightsQ<2, 2>{});
    case 8: return of(WeightsQ<0, 3>{});
    default: TORCH_CHECK(false, "exactq_layout: kind must be 4..8, got ", kind);
  }
}

at::Tensor exact8_pack(const at::Tensor& q, const at::Tensor& d) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8, "exact8_pack: q int8 [N, K], d float32 [N, K / 32]");
  return pack<Weights8>(q, d, nullptr);
}

torch::Tensor exact8x_mm(torch::Tensor x, torch::Tensor p, int64_t n) {
  return packed_mm<Weights8x>("exact8x_mm", x, p, n);
}

torch::Tensor exact16_mm(torch::Tensor x, torch::Tensor p, int64_t n, bool bf16) {
  return bf16 ? packed_mm<Weights16<true>>("exact16_mm", x, p, n) : packed_mm<Weights16<false>>("exact16_mm", x, p, n);
}

// w [N, K] bfloat16 or float16 (K a multiple of 32) in Weights16's layout
at::Tensor exact16_pack(const at::Tensor& w) {
  TORCH_CHECK((w.scalar_type() == torch::kBFloat16 || w.scalar_type() == torch::kHalf) && w.dim() == 2 &&
                  w.is_contiguous() && w.size(1) % kBlock == 0,
              "exact16_pack: w bfloat16 or float16 [N, K], contiguous, K a multiple of 32");
  const int64_t K = w.size(1);
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  return pack_chunks(w.size(0), K / kBlock, Weights16<true>::kBytes, [&](uint8_t* chunk, int64_t n, int j, int64_t b) {
    std::memcpy(chunk + j * 64, wp + (n * K + b * kBlock) * 2, 64);
  });
}

// (q [N, K] int8, D, C [N, K / 16] float32) in Weights8x's layout
at::Tensor exact8x_pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor& c) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous() && d.scalar_type() == torch::kFloat32 &&
                  d.dim() == 2 && d.is_contiguous() && c.sizes() == d.sizes() && c.scalar_type() == torch::kFloat32 &&
                  c.is_contiguous() && q.size(0) == d.size(0) && q.size(1) == d.size(1) * 16 && q.size(1) % kBlock == 0,
              "exact8x_pack: q int8 [N, K], D and C float32 [N, K / 16], K a multiple of 32");
  const int64_t K = q.size(1), blocks = K / kBlock;
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  return pack_chunks(q.size(0), blocks, Weights8x::kBytes, [&](uint8_t* chunk, int64_t n, int j, int64_t b) {
    std::memcpy(chunk + j * 32, qp + n * K + b * kBlock, 32);
    float* s = reinterpret_cast<float*>(chunk + kGroup * 32);
    const int64_t h = n * 2 * blocks + 2 * b;  // output n's two half-blocks of block b
    s[j] = dp[h];
    s[kGroup + j] = dp[h + 1];
    s[2 * kGroup + j] = cp[h];
    s[3 * kGroup + j] = cp[h + 1];
  });
}

// The blocks of w [N, K] float32 in one pass (lp.kernels.exact4.encode's torch-side check, same
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

// LlamaRMSNorm's formula over the last dim of x [..., H] float32: y = w * (x * rsqrt(mean(x * x) +
// eps)), each square rounded then summed in 16 lanes, the lanes summed 8, 4, 2, 1 apart, divided
// by H (torch's pow, sum and div; only the sum's order differs), one row at a time: a row's output
// depends on that row only. One op call for the seven of the eager module.
torch::Tensor rms_norm(torch::Tensor x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 && w.dim() == 1 &&
                  x.dim() >= 1 && x.size(-1) == w.size(0) && w.is_contiguous(),
              "rms_norm: x [..., H] and w [H], float32");
  x = x.contiguous();
  at::Tensor y = torch::empty_like(x);
  const int64_t H = w.size(0), R = H ? x.numel() / H : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * H;
      float* yr = yp + r * H;
      float lanes[16] = {0.f};
      int64_t k = 0;
#if defined(__AVX512F__)
      __m512 acc = _mm512_setzero_ps();
      for (; k + 16 <= H; k += 16) {
        const __m512 v = _mm512_loadu_ps(xr + k);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
      }
      _mm512_storeu_ps(lanes, acc);
#else
      for (; k + 16 <= H; k += 16)
        for (int l = 0; l < 16; ++l) {
          const float sq = xr[k + l] * xr[k + l];
          lanes[l] += sq;
        }
#endif
      for (int l = 0; k < H; ++k, ++l) {
        const float sq = xr[k] * xr[k];
        lanes[l] += sq;
      }
      for (int half = 8; half >= 1; half /= 2)
        for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
      const float var = lanes[0] / static_cast<float>(H);
      const float inv = 1.0f / std::sqrt(var + epsf);
      for (int64_t j = 0; j < H; ++j) yr[j] = wp[j] * (xr[j] * inv);  // two roundings, as torch's two muls
    }
  });
  return y;
}

// Decoder layers of the Llama / Qwen2 / Qwen3 shape in two calls per layer (lp.kernels.fused), each the very
// operations of the transformers module it stands for, on the same kernels, so the same bits:
//   attn_in:  rms_norm, the q/k/v products (one fused product, or one per group of siblings of one
//             kernel kind, each with its bias where it has one, side by side), Qwen3's q and k norms
//             (rms_norm over each head), rotary embedding of
//             q and k as torch's eager `q * cos + rotate_half(q) * sin` (two products and a sum,
//             each rounded: the embedded-rounding intrinsics below are never contracted into a
//             fused multiply-add); q, k, v returned as [1, H, Q, D] views of [1, Q, H, D] buffers
//             (the strides of the module's own q and k after the rotation)
//   out_mlp:  the attention output's product (o), the residual sum, rms_norm, the gate/up products,
//             at::silu(gate) * up, the down product, the residual sum (ATen's own kernels for
//             silu, mul and add).
// A layer's products come as lists: p (packed weights), meta (n, kind, bias index or -1 each), b.
// Built on every CPU (lp.kernels.fused runs it where its products are fast: AVX-512, or idot's AVX2 form); the
// build's -ffp-contract=off keeps every scalar a * b + c two roundings, as torch's separate ops.
namespace {
// out[d] = x[d] * c[d] + rot[d] * s[d], rot = cat(-x[D/2:], x[:D/2]); D a multiple of 32
void rope_row(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t half = D / 2;
#if defined(__AVX512F__)
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 xv = _mm512_loadu_ps(x + d);
    __m512 rot = d < half ? _mm512_loadu_ps(x + d + half) : _mm512_loadu_ps(x + d - half);
    if (d < half) rot = _mm512_xor_ps(rot, sign);  // -x: exact
    const __m512 a = _mm512_mul_round_ps(xv, _mm512_loadu_ps(c + d), R);
    const __m512 b = _mm512_mul_round_ps(rot, _mm512_loadu_ps(s + d), R);
    _mm512_storeu_ps(out + d, _mm512_add_round_ps(a, b, R));
  }
#else
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -x[d + half] : x[d - half];
    const float a = x[d] * c[d], b = rot * s[d];  // two products and a sum, each rounded (no contraction)
    out[d] = a + b;
  }
#endif
}
// y = x + y elementwise, x and y contiguous float32 of one shape: the float sum at::add(x, y) gives
// (alpha 1: fma(y, 1, x) rounds once, as x + y), without its allocation and dispatch
void add_into(const torch::Tensor& x_in, const torch::Tensor& y) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.sizes() == y.sizes() && y.is_contiguous() && x.scalar_type() == torch::kFloat32 &&
                  y.scalar_type() == torch::kFloat32, "add_into: x and y of one shape, float32, y contiguous");
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t n = y.numel();
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(yp + i, _mm512_add_ps(_mm512_loadu_ps(xp + i), _mm512_loadu_ps(yp + i)));
#endif
  for (; i < n; ++i) yp[i] = xp[i] + yp[i];
}

// pool[h, write[t], :] = kv[t, h, :] for kv a [1, heads, Q, D] view of a contiguous [1, Q, heads, D]
// buffer (attn_in's k, v) and pool [heads, P, D] contiguous: PagedCache.update's index_copy_ along
// the slots, as plain copies; any other layout goes through index_copy_ itself
void write_slots(at::Tensor& pool, const torch::Tensor& write, const torch::Tensor& kv) {
  const at::Tensor rows = kv[0];  // [heads, Q, D]
  const int64_t heads = rows.size(0), Q = rows.size(1), D = rows.size(2);
  const bool plain = pool.is_contiguous() && pool.dim() == 3 && pool.size(0) == heads && pool.size(2) == D &&
                     pool.scalar_type() == torch::kFloat32 && rows.scalar_type() == torch::kFloat32 &&
                     rows.stride(2) == 1 && rows.stride(1) == heads * D && rows.stride(0) == D &&
                     write.scalar_type() == torch::kLong && write.dim() == 1 && write.size(0) == Q &&
                     write.is_contiguous();
  if (!plain) {
    pool.index_copy_(1, write, rows);
    return;
  }
  const int64_t P = pool.size(1);
  const int64_t* wp = write.data_ptr<int64_t>();
  const float* src = rows.data_ptr<float>();
  float* dst = pool.data_ptr<float>();
  for (int64_t t = 0; t < Q; ++t) {
    const int64_t slot = wp[t];
    TORCH_CHECK(slot >= 0 && slot < P, "decoder_paged: a write slot outside the pool");
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + (h * P + slot) * D, src + (t * heads + h) * D, sizeof(float) * D);
  }
}

// One product of a layer: y = x @ W.T on the kernel of its kind (lp.kernels.fused.KERNEL_KINDS:
// 0 exact4, 1 exact8, 2 exact8x, 3 exact16 float16, 16 exact16 bfloat16, 4..8 exactq), then
// `y += b` where it has a bias (the linear module's own in-place add: one rounding)
struct Lin {
  const at::Tensor* p;
  int64_t n, kind;
  const at::Tensor* b;  // nullptr: no bias
};

torch::Tensor kernel_mm(const torch::Tensor& x, const torch::Tensor& p, int64_t n, int64_t kind) {
  switch (kind) {
    case 0: return exact4_mm(x, p, n);
    case 1: return exact8_mm(x, p, n);
    case 2: return exact8x_mm(x, p, n);
    case 3: return exact16_mm(x, p, n, false);
    case 16: return exact16_mm(x, p, n, true);
    default: return kind >= 20 ? idot_mm(x, p, n, kind) : exactq_mm(x, p, n, kind);  // 4..8, 20..31, else an error
  }
}

// the products of one input (q | k | v, gate | up, or a single one), side by side along the outputs
at::Tensor products(const at::Tensor& x, const Lin* lin, size_t count) {
  std::vector<at::Tensor> ys;
  for (size_t i = 0; i < count; ++i) {
    at::Tensor y = kernel_mm(x, *lin[i].p, lin[i].n, lin[i].kind);
    if (lin[i].b != nullptr) y.add_(*lin[i].b);
    ys.push_back(std::move(y));
  }
  return ys.size() == 1 ? ys[0] : at::cat(ys, 1);
}

// lists p, meta (n, kind, bias index or -1 per product), b into Lin views
std::vector<Lin> lins_of(at::TensorList p, at::IntArrayRef meta, at::TensorList b) {
  TORCH_CHECK(meta.size() == 3 * p.size(), "fused stack: meta must hold (n, kind, bias index) per product");
  std::vector<Lin> out;
  for (size_t i = 0; i < p.size(); ++i) {
    const int64_t bi = meta[3 * i + 2];
    TORCH_CHECK(bi < static_cast<int64_t>(b.size()), "fused stack: a bias index outside the biases");
    out.push_back({&p[i], meta[3 * i], meta[3 * i + 1], bi < 0 ? nullptr : &b[bi]});
  }
  return out;
}
}  // namespace

namespace {
// qn, kn: Qwen3's q and k norms (RMSNorm over each head's D values, before the rotation), or nullptr
std::vector<torch::Tensor> attn_in_lins(torch::Tensor h, const torch::Tensor& ln_w, double eps, const Lin* lin,
                                        size_t count, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                        torch::Tensor cos, torch::Tensor sin, const at::Tensor* qn,
                                        const at::Tensor* kn, double q_eps, double k_eps) {
  TORCH_CHECK(h.dim() == 3 && h.size(0) == 1, "attn_in: h must be [1, Q, H]");
  TORCH_CHECK(head_dim % 32 == 0, "attn_in: head_dim must be a multiple of 32");
  const int64_t Q = h.size(1), D = head_dim, N = (heads + 2 * kv_heads) * D;
  cos = cos.contiguous();
  sin = sin.contiguous();
  TORCH_CHECK(cos.numel() == Q * D && sin.numel() == Q * D && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32, "attn_in: cos, sin must be [1, Q, head_dim] float32");
  Clock clock;
  const at::Tensor x = rms_norm(h, ln_w, eps);
  clock.lap(0);
  const at::Tensor y = products(x.view({Q, h.size(2)}), lin, count);
  TORCH_CHECK(y.size(1) == N && y.is_contiguous(), "attn_in: the q/k/v products must give heads + 2 kv_heads heads");
  clock.lap(1);
  // rows the rotation reads: head i of token t at src + t * stride + i * D
  const float* q_src = y.data_ptr<float>();
  const float* k_src = q_src + heads * D;
  int64_t q_stride = N, k_stride = N;
  at::Tensor qy, ky;
  if (qn != nullptr) {
    qy = rms_norm(y.slice(1, 0, heads * D).reshape({Q, heads, D}), *qn, q_eps);
    ky = rms_norm(y.slice(1, heads * D, (heads + kv_heads) * D).reshape({Q, kv_heads, D}), *kn, k_eps);
    q_src = qy.data_ptr<float>(), q_stride = heads * D;
    k_src = ky.data_ptr<float>(), k_stride = kv_heads * D;
  }
  at::Tensor q = torch::empty({1, Q, heads, D}, h.options());
  at::Tensor k = torch::empty({1, Q, kv_heads, D}, h.options());
  at::Tensor v = torch::empty({1, Q, kv_heads, D}, h.options());
  const float* yp = y.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < Q; ++t) {
    const float* row = yp + t * N;
    for (int64_t i = 0; i < heads; ++i)
      rope_row(q_src + t * q_stride + i * D, cp + t * D, sp + t * D, qp + (t * heads + i) * D, D);
    for (int64_t i = 0; i < kv_heads; ++i)
      rope_row(k_src + t * k_stride + i * D, cp + t * D, sp + t * D, kp + (t * kv_heads + i) * D, D);
    std::memcpy(vp + t * kv_heads * D, row + (heads + kv_heads) * D, sizeof(float) * kv_heads * D);
  }
  clock.lap(2);
  return {q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)};
}

// lin: o, the gate/up products (gu of them), down
// post: Gemma's sandwich norms (post-attention: on o's output before its residual sum;
// post-feedforward: on down's output before its), or nullptr; gelu: gelu(gate, "tanh") for silu(gate)
torch::Tensor out_mlp_lins(const torch::Tensor& h, const torch::Tensor& attn, const Lin* lin, size_t gu,
                           const torch::Tensor& ln_w, double eps, int64_t inter, const at::Tensor* post_attn,
                           double post_attn_eps, const at::Tensor* post_ff, double post_ff_eps, bool gelu) {
  TORCH_CHECK(h.dim() == 3 && h.size(0) == 1, "out_mlp: h must be [1, Q, H]");
  const int64_t Q = h.size(1), H = h.size(2);
  Clock clock;
  const at::Tensor a = attn.reshape({Q, -1}).contiguous();
  at::Tensor h1 = products(a, lin, 1).view({1, Q, H});
  if (post_attn != nullptr) h1 = rms_norm(h1, *post_attn, post_attn_eps);
  clock.lap(5);
  add_into(h, h1);  // h1 = h + o(a): at::add's sum (alpha 1), in o's fresh buffer
  clock.lap(6);
  const at::Tensor x = rms_norm(h1, ln_w, eps);
  clock.lap(0);
  const at::Tensor g = products(x.view({Q, H}), lin + 1, gu);
  TORCH_CHECK(g.size(1) == 2 * inter, "out_mlp: the gate/up products must give 2 x inter outputs");
  clock.lap(7);
  const at::Tensor gate = g.slice(1, 0, inter);
  const at::Tensor m = at::mul(gelu ? at::gelu(gate, "tanh") : at::silu(gate), g.slice(1, inter, 2 * inter));
  clock.lap(8);
  at::Tensor out = products(m, lin + 1 + gu, 1).view({1, Q, H});
  if (post_ff != nullptr) out = rms_norm(out, *post_ff, post_ff_eps);
  clock.lap(9);
  add_into(h1, out);
  clock.lap(6);
  return out;
}
}  // namespace

std::vector<torch::Tensor> attn_in(torch::Tensor h, const torch::Tensor& ln_w, double eps, at::TensorList p,
                                   at::IntArrayRef meta, at::TensorList b, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, torch::Tensor cos, torch::Tensor sin, at::TensorList qk_norm,
                                   at::ArrayRef<double> qk_eps) {
  const std::vector<Lin> lin = lins_of(p, meta, b);
  TORCH_CHECK(!lin.empty(), "attn_in: no q/k/v product");
  TORCH_CHECK((qk_norm.empty() && qk_eps.empty()) || (qk_norm.size() == 2 && qk_eps.size() == 2),
              "attn_in: qk_norm and qk_eps hold the q and k norms' (or nothing)");
  const bool norms = !qk_norm.empty();
  return attn_in_lins(h, ln_w, eps, lin.data(), lin.size(), heads, kv_heads, head_dim, cos, sin,
                      norms ? &qk_norm[0] : nullptr, norms ? &qk_norm[1] : nullptr, norms ? qk_eps[0] : 0.0,
                      norms ? qk_eps[1] : 0.0);
}

torch::Tensor out_mlp(const torch::Tensor& h, const torch::Tensor& attn, at::TensorList p, at::IntArrayRef meta,
                      at::TensorList b, const torch::Tensor& ln_w, double eps, int64_t inter, at::TensorList post,
                      at::ArrayRef<double> post_eps, bool gelu) {
  const std::vector<Lin> lin = lins_of(p, meta, b);
  TORCH_CHECK(lin.size() >= 3, "out_mlp: products o, gate/up (one or more), down");
  TORCH_CHECK((post.empty() && post_eps.empty()) || (post.size() == 2 && post_eps.size() == 2),
              "out_mlp: post and post_eps hold the post-attention and post-feedforward norms' (or nothing)");
  const bool sandwich = !post.empty();
  return out_mlp_lins(h, attn, lin.data(), lin.size() - 2, ln_w, eps, inter, sandwich ? &post[0] : nullptr,
                      sandwich ? post_eps[0] : 0.0, sandwich ? &post[1] : nullptr, sandwich ? post_eps[1] : 0.0, gelu);
}

// Every decoder layer of a batched step on the paged pool (lp.model.paged, gather=False) in one
// call: per layer attn_in, the pool's write (index_copy_ of k and v at the step's slots, as
// PagedCache.update), lp_attention::paged through the dispatcher (lp.kernels.attention's
// batch_sdpa_forward: the same op, arguments and order), out_mlp. The same operations as the
// per-layer Python loop of lp.kernels.fused, without ~4 Python calls a layer. p / meta / b: every
// layer's products in order (its q/k/v ones, o, its gate/up ones, down); counts: per layer the
// number of q/k/v products and of gate/up products.
torch::Tensor decoder_paged(torch::Tensor h, at::TensorList ln1, at::ArrayRef<double> eps1, at::TensorList ln2,
                            at::ArrayRef<double> eps2, at::TensorList p, at::IntArrayRef meta, at::TensorList b,
                            at::IntArrayRef counts, at::TensorList qk_norm, at::ArrayRef<double> qk_eps,
                            at::TensorList post, at::ArrayRef<double> post_eps, at::IntArrayRef flags,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                            const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& cos_local,
                            const torch::Tensor& sin_local, at::TensorList keys,
                            at::TensorList values, const torch::Tensor& write, const torch::Tensor& spans,
                            const torch::Tensor& masks, const torch::Tensor& slots, double scale, int64_t max_rows) {
  const size_t L = ln1.size();
  TORCH_CHECK(eps1.size() == L && ln2.size() == L && eps2.size() == L && counts.size() == 2 * L &&
                  keys.size() == L && values.size() == L,
              "decoder_paged: one entry per layer in every list (two counts a layer)");
  TORCH_CHECK((qk_norm.empty() && qk_eps.empty()) || (qk_norm.size() == 2 * L && qk_eps.size() == 2 * L),
              "decoder_paged: qk_norm and qk_eps hold two a layer (or nothing)");
  const bool norms = !qk_norm.empty();
  TORCH_CHECK((post.empty() && post_eps.empty()) || (post.size() == 2 * L && post_eps.size() == 2 * L),
              "decoder_paged: post and post_eps hold two a layer (or nothing)");
  TORCH_CHECK(flags.size() == L, "decoder_paged: one flags entry a layer (1: sliding window, 2: gelu tanh)");
  const bool sandwich = !post.empty();
  const std::vector<Lin> lin = lins_of(p, meta, b);
  size_t used = 0;
  for (size_t l = 0; l < L; ++l) used += counts[2 * l] + counts[2 * l + 1] + 2;
  TORCH_CHECK(used == lin.size(), "decoder_paged: the counts do not match the products");
  static auto paged = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("lp_attention::paged", "")
                          .typed<at::Tensor(at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                            at::Tensor, at::Tensor, double, bool, int64_t)>();
  const Lin* cur = lin.data();
  for (size_t l = 0; l < L; ++l) {
    const size_t nqkv = counts[2 * l], ngu = counts[2 * l + 1];
    const bool sliding = flags[l] & 1, gelu = flags[l] & 2;
    auto qkv_l = attn_in_lins(h, ln1[l], eps1[l], cur, nqkv, heads, kv_heads, head_dim, sliding ? cos_local : cos,
                              sliding ? sin_local : sin,
                              norms ? &qk_norm[2 * l] : nullptr, norms ? &qk_norm[2 * l + 1] : nullptr,
                              norms ? qk_eps[2 * l] : 0.0, norms ? qk_eps[2 * l + 1] : 0.0);
    cur += nqkv;
    at::Tensor pool_k = keys[l], pool_v = values[l];
    Clock clock;
    write_slots(pool_k, write, qkv_l[1]);
    write_slots(pool_v, write, qkv_l[2]);
    clock.lap(3);
    const at::Tensor out = paged.call(qkv_l[0], pool_k.unsqueeze(0), pool_v.unsqueeze(0), spans, masks, slots, scale,
                                      sliding, max_rows);
    clock.lap(4);
    h = out_mlp_lins(h, out, cur, ngu, ln2[l], eps2[l], inter, sandwich ? &post[2 * l] : nullptr,
                     sandwich ? post_eps[2 * l] : 0.0, sandwich ? &post[2 * l + 1] : nullptr,
                     sandwich ? post_eps[2 * l + 1] : 0.0, gelu);
    cur += ngu + 2;
  }
  return h;
}

// ---------------------------------------------------------------------------
// The greedy head's screen (lp.kernels.exact4.Head8.argmax_logits): an integer pass over the LM head that
// bounds every token's float32 logit, so that only the tokens that can be a row's argmax need the
// exact8 kernel. Weights: each token's exact row w_v re-quantized to int8 with one scale D_v = max|w_v|
// / 127 (r_v = round(w_v / D_v); werr_v >= max_i |w_vi - D_v r_vi|, wabs_v >= sum_i |w_vi|, both rounded
// up), stored as r + 128 (unsigned) in groups of 16 tokens x 4 inputs, the layout of AVX-512 VNNI's
// vpdpbusd (16 tokens' dot products in the 16 lanes of one register). Activations: each row's x as
// sx k with k = round(x / sx) integer, |k| <= 32639 (sx = max|x| / 32639), written k = 256 h + l, h and
// l signed bytes. The integer sums are exact (|sum| < 2^24: exact in float32 too); the screen value
// s_v = fl(fl(fl(256 H + L) D_v) sx) carries three roundings. With x~ = sx k, w~ = D_v r_v:
//   |x . w_v - x~ . w~_v| <= |x - x~| . |w_v| + |x~| . |w_v - w~_v| <= 1.01 sx / 2 wabs_v + (|x|_1 + 1.01 K sx / 2) werr_v
//   |s_v - x~ . w~_v| <= 3.01 u (max|x| + sx) (wabs_v + K werr_v)   (u = 2^-24)
//   |f_v - x . w_v| <= 1.01 K u max|x| wabs_v   (f_v: the exact8 kernel's float32 logit, any summation order)
// so f_v lies within e_v = 1.02 (a wabs_v + b werr_v) of s_v, a and b the row's coefficients below
// (the 2% covers their own float32 rounding). upper = s + e; lower = s - e, and each row's largest
// lower: a token whose upper is below that cannot be (or tie) the row's argmax.
namespace {

constexpr int kScreenTokens = 16;
constexpr double kScreenMax = 32639.0;  // |k|: h = (k + 128) >> 8 stays in -127..127

float round_up(double v) {
  float f = static_cast<float>(v);
  if (static_cast<double>(f) < v) f = std::nextafter(f, INFINITY);
  return f;
}

struct ScreenRow {
  float sx, a, b;
  int32_t h_sum, l_sum;
};

#if defined(__AVX512VNNI__)
// acc += the 16 dot products of w's unsigned bytes (4 a lane) with the 4 signed bytes at p, broadcast.
// In assembly: GCC's intrinsic copies the accumulator around every instruction (2 moves each).
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}
#endif

template <int MT>
void screen_tile(const uint8_t* wg, const int8_t* h, const int8_t* l, const ScreenRow* rows, const float* D,
                 const float* wabs, const float* werr, float* upper, float* lower_max, int64_t K, int64_t V,
                 int64_t v0, int64_t m0) {
#if defined(__AVX512VNNI__)
  // named accumulators, not arrays: GCC keeps an array of them in memory, storing it every step
  __m512i a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7;
  a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = _mm512_setzero_si512();
  const int8_t* hr = h + m0 * K;
  const int8_t* lr = l + m0 * K;
  for (int64_t k4 = 0; k4 < K / 4; ++k4) {
    _mm_prefetch(reinterpret_cast<const char*>(wg) + k4 * 64 + kPrefetch, _MM_HINT_T0);
    const __m512i wv = _mm512_loadu_si512(wg + k4 * 64);
    const int64_t at = k4 * 4;
#define LP_ROW(i)                                           \
  if constexpr (MT > i) {                                   \
    a##i = dpbusd_bcast(a##i, wv, hr + i * K + at);         \
    b##i = dpbusd_bcast(b##i, wv, lr + i * K + at);         \
  }
    LP_ROW(0) LP_ROW(1) LP_ROW(2) LP_ROW(3) LP_ROW(4) LP_ROW(5) LP_ROW(6) LP_ROW(7)
#undef LP_ROW
  }
  const __m512i ah[8] = {a0, a1, a2, a3, a4, a5, a6, a7}, al[8] = {b0, b1, b2, b3, b4, b5, b6, b7};
  const int64_t n = std::min<int64_t>(kScreenTokens, V - v0);
  const __mmask16 live = n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
  const __m512 Dv = _mm512_maskz_loadu_ps(live, D + v0), av = _mm512_maskz_loadu_ps(live, wabs + v0),
               ev = _mm512_maskz_loadu_ps(live, werr + v0);
  for (int i = 0; i < MT; ++i) {
    const ScreenRow& r = rows[m0 + i];
    const __m512i H = _mm512_sub_epi32(ah[i], _mm512_set1_epi32(128 * r.h_sum));
    const __m512i L = _mm512_sub_epi32(al[i], _mm512_set1_epi32(128 * r.l_sum));
    const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(H), _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(L));
    const __m512 s = _mm512_mul_ps(_mm512_mul_ps(t, Dv), _mm512_set1_ps(r.sx));
    const __m512 e = _mm512_mul_ps(_mm512_set1_ps(1.02f),
                                   _mm512_fmadd_ps(_mm512_set1_ps(r.a), av, _mm512_mul_ps(_mm512_set1_ps(r.b), ev)));
    _mm512_mask_storeu_ps(upper + (m0 + i) * V + v0, live, _mm512_add_ps(s, e));
    const float lo = _mm512_mask_reduce_max_ps(live, _mm512_sub_ps(s, e));
    lower_max[m0 + i] = std::max(lower_max[m0 + i], lo);
  }
#else
  for (int i = 0; i < MT; ++i) {
    const ScreenRow& r = rows[m0 + i];
    for (int j = 0; j < kScreenTokens && v0 + j < V; ++j) {
      int32_t H = 0, L = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t w = static_cast<int32_t>(wg[(k / 4) * 64 + j * 4 + k % 4]);
        H += w * h[(m0 + i) * K + k];
        L += w * l[(m0 + i) * K + k];
      }
      H -= 128 * r.h_sum;
      L -= 128 * r.l_sum;
      const float t = std::fma(static_cast<float>(H), 256.0f, static_cast<float>(L));
      const float s = (t * D[v0 + j]) * r.sx;
      const float e = 1.02f * std::fma(r.a, wabs[v0 + j], r.b * werr[v0 + j]);
      upper[(m0 + i) * V + v0 + j] = s + e;
      lower_max[m0 + i] = std::max(lower_max[m0 + i], s - e);
    }
  }
#endif
}

}  // namespace

bool exact8_vnni() {
#if defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

// The screen's weights from the head's exact 8-bit blocks (q [V, K] int8, d [V, K / 32] float32):
// (w [ceil(V / 16), K / 4, 16, 4] uint8 = r + 128, D, wabs, werr [V] float32), as described above.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> exact8_screen_pack(const at::Tensor& q, const at::Tensor& d) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous() && d.dim() == 2 &&
                  d.scalar_type() == torch::kFloat32 && d.is_contiguous() && q.size(1) % kBlock == 0 &&
                  d.size(0) == q.size(0) && (d.size(1) == q.size(1) / kBlock || d.size(1) == q.size(1) / 16),
              "exact8_screen_pack: q [V, K] int8 and d [V, K / 32] (or [V, K / 16]) float32, contiguous");
  const int64_t per = q.size(1) / d.size(1);  // weights a scale: 32 (Q8_0), 16 (Q6_K as bytes)
  const int64_t V = q.size(0), K = q.size(1), G = (V + kScreenTokens - 1) / kScreenTokens;
  at::Tensor w = torch::full({G, K / 4, kScreenTokens, 4}, 128, torch::kUInt8);
  at::Tensor D = torch::empty({V}, torch::kFloat32), wabs = torch::empty({V}, torch::kFloat32),
             werr = torch::empty({V}, torch::kFloat32);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  uint8_t* wp = w.data_ptr<uint8_t>();
  float *Dp = D.data_ptr<float>(), *ap = wabs.data_ptr<float>(), *ep = werr.data_ptr<float>();
  at::parallel_for(0, V, 256, [&](int64_t v0, int64_t v1) {
    std::vector<float> wf(K);
    for (int64_t v = v0; v < v1; ++v) {
      float amax = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        wf[k] = static_cast<float>(qp[v * K + k]) * dp[v * (K / per) + k / per];  // exact
        amax = std::max(amax, std::fabs(wf[k]));
      }
      const float Dv = amax / 127.0f, safe = Dv > 0.0f ? Dv : 1.0f;
      double sum = 0.0, err = 0.0;
      uint8_t* wg = wp + (v / kScreenTokens) * (K / 4) * 64 + (v % kScreenTokens) * 4;
      for (int64_t k = 0; k < K; ++k) {
        const float r = std::min(127.0f, std::max(-127.0f, std::nearbyint(wf[k] / safe)));
        wg[(k / 4) * 64 + k % 4] = static_cast<uint8_t>(static_cast<int>(r) + 128);
        err = std::max(err, std::fabs(static_cast<double>(wf[k]) - static_cast<double>(r) * Dv));  // exact in double
        sum += std::fabs(static_cast<double>(wf[k]));
      }
      Dp[v] = Dv;
      ap[v] = round_up(sum * (1.0 + 1e-12));
      ep[v] = round_up(err);
    }
  });
  return {w, D, wabs, werr};
}

// (ok, upper [M, V], lower_max [M]) of the screen over x [M, K] float32; ok false (and nothing
// computed) where a row of x is not finite.
std::tuple<bool, at::Tensor, at::Tensor> exact8_screen(torch::Tensor x, const at::Tensor& w, const at::Tensor& D,
                                                      const at::Tensor& wabs, const at::Tensor& werr) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "exact8_screen: x must be [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), V = D.size(0);
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(1) * 4 == K &&
                  w.size(0) == (V + kScreenTokens - 1) / kScreenTokens && wabs.numel() == V && werr.numel() == V,
              "exact8_screen: the screen (exact8_screen_pack) does not match x");
  x = x.contiguous();
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> h(M * K), l(M * K);
  std::vector<ScreenRow> rows(M);
  const double u = std::ldexp(1.0, -24);
  for (int64_t m = 0; m < M; ++m) {
    double xmax = 0.0, l1 = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = xp[m * K + k];
      if (!std::isfinite(v)) return {false, at::Tensor(), at::Tensor()};
      xmax = std::max(xmax, std::fabs(v));
      l1 += std::fabs(v);
    }
    float sx = static_cast<float>(xmax / kScreenMax);
    if (!(sx > 0.0f) || !std::isnormal(sx)) sx = 1.0f;  // x ~ 0: every k is 0, |x - x~| <= sx / 2
    int32_t hs = 0, ls = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double kk = std::min(kScreenMax, std::max(-kScreenMax, std::nearbyint(xp[m * K + k] / static_cast<double>(sx))));
      const int32_t ki = static_cast<int32_t>(kk), hi = static_cast<int32_t>(std::floor((ki + 128) / 256.0));
      h[m * K + k] = static_cast<int8_t>(hi);
      l[m * K + k] = static_cast<int8_t>(ki - 256 * hi);
      hs += hi;
      ls += ki - 256 * hi;
    }
    const double sxd = sx, grow = 3.01 * u * (xmax + sxd);
    rows[m] = {sx, round_up(1.01 * sxd / 2 + 1.01 * K * u * xmax + grow),
               round_up((l1 * (1.0 + 1e-12) + 1.01 * K * sxd / 2 + K * grow)), hs, ls};
  }
  at::Tensor upper = torch::empty({M, V}, torch::kFloat32);
  at::Tensor lower = torch::full({M}, -INFINITY, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float *Dp = D.data_ptr<float>(), *ap = wabs.data_ptr<float>(), *ep = werr.data_ptr<float>();
  float* up = upper.data_ptr<float>();
  float* lowp = lower.data_ptr<float>();
  std::mutex merge;
  at::parallel_for(0, w.size(0), 16, [&](int64_t g0, int64_t g1) {
    std::vector<float> mine(M, -INFINITY);
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = wp + g * (K / 4) * 64;
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t v0 = g * kScreenTokens;
        switch (std::min<int64_t>(8, M - m0)) {
#define LP_SCREEN(n) \
  case n: screen_tile<n>(wg, h.data(), l.data(), rows.data(), Dp, ap, ep, up, mine.data(), K, V, v0, m0); break;
          LP_SCREEN(1) LP_SCREEN(2) LP_SCREEN(3) LP_SCREEN(4) LP_SCREEN(5) LP_SCREEN(6) LP_SCREEN(7)
          default: screen_tile<8>(wg, h.data(), l.data(), rows.data(), Dp, ap, ep, up, mine.data(), K, V, v0, m0);
#undef LP_SCREEN
        }
      }
    }
    std::lock_guard<std::mutex> lock(merge);
    for (int64_t m = 0; m < M; ++m) lowp[m] = std::max(lowp[m], mine[m]);
  });
  return {true, upper, lower};
}

// The greedy head through the screen, in one call: the screen's bounds over x [M, K], then the exact8
// kernel (the packed head p, as exact8_mm runs it: the same bits) over every group of 8 tokens that
// holds a token some row keeps (upper >= the row's largest lower), -inf everywhere else.
// (ok, logits [M, vocab]); ok false (nothing computed) where a row of x is not finite.
// kind: the packed head's kernel, 1 (exact8: pack8) or 8 (exactq's Q6_K as bytes: packq)
template <class W>
std::tuple<bool, at::Tensor> screen_logits(torch::Tensor x, const at::Tensor& w, const at::Tensor& D,
                                           const at::Tensor& wabs, const at::Tensor& werr, const at::Tensor& p,
                                           int64_t vocab) {
  auto [ok, upper, lower] = exact8_screen(x, w, D, wabs, werr);
  if (!ok) return {false, at::Tensor()};
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), V = D.size(0);
  TORCH_CHECK(V == vocab && p.dim() == 3 && p.scalar_type() == torch::kUInt8 && p.is_contiguous() &&
                  p.size(0) == (vocab + kGroup - 1) / kGroup && p.size(1) == K / (kBlock * W::kSuper) &&
                  p.size(2) == W::kBytes,
              "exact8_screen_logits: p is not the packed head (pack8 / packq) of this screen");
  const float* up = upper.data_ptr<float>();
  const float* lowp = lower.data_ptr<float>();
  std::vector<uint8_t> keep(p.size(0), 0);  // a group some row keeps a token of (M x V compares: both threads)
  at::parallel_for(0, p.size(0), 256, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m = 0; m < M && !keep[g]; ++m)
        for (int64_t v = g * kGroup; v < std::min<int64_t>(V, (g + 1) * kGroup); ++v)
          if (up[m * V + v] >= lowp[m]) { keep[g] = 1; break; }
  });
  std::vector<int64_t> groups;
  for (int64_t g = 0; g < p.size(0); ++g)
    if (keep[g]) groups.push_back(g);
  at::Tensor y = torch::full({M, vocab}, -INFINITY, torch::kFloat32);
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = p.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t group_bytes = p.size(1) * W::kBytes;
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = groups[i];
      group_all_rows<W>(xp, pp + g * group_bytes, yp, K, vocab, M, g * kGroup, false);
    }
  });
  return {true, y};
}

std::tuple<bool, at::Tensor> exact8_screen_logits(torch::Tensor x, const at::Tensor& w, const at::Tensor& D,
                                                 const at::Tensor& wabs, const at::Tensor& werr, const at::Tensor& p,
                                                 int64_t vocab, int64_t kind) {
  TORCH_CHECK(kind == 1 || kind == 8, "exact8_screen_logits: kind must be 1 (exact8) or 8 (Q6_K as bytes)");
  return kind == 1 ? screen_logits<Weights8>(x, w, D, wabs, werr, p, vocab)
                   : screen_logits<WeightsQ<0, 3>>(x, w, D, wabs, werr, p, vocab);
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

// the op lp.kernels.exact4's linears call: torch.ops.lp_exact4.mm, opaque to torch.compile (its fake is
// registered in Python)
TORCH_LIBRARY(lp_exact4, m) {
  m.def("mm(Tensor x, Tensor p, int n) -> Tensor");
  m.def("mm8(Tensor x, Tensor p, int n) -> Tensor");
  m.def("mm8x(Tensor x, Tensor p, int n) -> Tensor");
  m.def("mm16(Tensor x, Tensor p, int n, bool bf16) -> Tensor");
  m.def("mmq(Tensor x, Tensor p, int n, int kind) -> Tensor");
  m.def("mmi(Tensor x, Tensor p, int n, int kind) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("attn_in(Tensor h, Tensor ln_w, float eps, Tensor[] p, int[] meta, Tensor[] b, int heads, int kv_heads, "
        "int head_dim, Tensor cos, Tensor sin, Tensor[] qk_norm, float[] qk_eps) -> Tensor[]");
  m.def("out_mlp(Tensor h, Tensor attn, Tensor[] p, int[] meta, Tensor[] b, Tensor ln_w, float eps, int inter, "
        "Tensor[] post, float[] post_eps, bool gelu) -> Tensor");
  m.def("decoder_paged(Tensor h, Tensor[] ln1, float[] eps1, Tensor[] ln2, float[] eps2, Tensor[] p, int[] meta, "
        "Tensor[] b, int[] counts, Tensor[] qk_norm, float[] qk_eps, Tensor[] post, float[] post_eps, int[] flags, "
        "int heads, int kv_heads, int head_dim, int inter, Tensor cos, Tensor sin, Tensor cos_local, Tensor sin_local, "
        "Tensor(a!)[] keys, Tensor(b!)[] values, Tensor write, Tensor spans, Tensor masks, Tensor slots, float scale, "
        "int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(lp_exact4, CPU, m) {
  m.impl("mm", &exact4_mm);
  m.impl("mm8", &exact8_mm);
  m.impl("mm8x", &exact8x_mm);
  m.impl("mm16", &exact16_mm);
  m.impl("mmq", &exactq_mm);
  m.impl("mmi", &idot_mm);
  m.impl("rms_norm", &rms_norm);
  m.impl("attn_in", &attn_in);
  m.impl("out_mlp", &out_mlp);
  m.impl("decoder_paged", &decoder_paged);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &exact4_pack, "exact 4-bit blocks (q, d, c) in the kernel layout");
  m.def("pack8", &exact8_pack, "exact 8-bit blocks (q, d) in the kernel layout");
  m.def("pack8x", &exact8x_pack, "exact 8-bit blocks (q, D, C per 16 weights) in the kernel layout");
  m.def("pack16", &exact16_pack, "bfloat16 / float16 weights in the kernel layout");
  m.def("layoutq", &exactq_layout, "(blocks an entry, header bytes, block bytes, entry bytes) of exactq kind 4..8");
  m.def("screeni", &idot_screen, py::call_guard<py::gil_scoped_release>(),
        "(ok, kept groups of 16): the idot head's greedy screen (x, p, n, kind, wnorm, max_groups, digits: x's top "
        "digits it takes, 1 or 2; the AVX2 build takes 1 whatever this says)",
        py::arg("x"), py::arg("p"), py::arg("n"), py::arg("kind"), py::arg("wnorm"), py::arg("max_groups"), py::arg("digits") = 2);
  m.def("screeni_available", &idot_screen_available, "whether this build runs screeni (either of idot's forms)");
  m.def("idot_float", &idot_float, "whether mmi's product is AVX2's float32 one (fdot_group) rather than the int8 digits' (and runs kinds 32 / 33)");
  m.def("rowsi", &idot_rows, "rows ids of an idot-packed weight (p, ids, n rows, kind) as float32 [len(ids), K]");
  m.def("layouti", &idot_layout, "(blocks an entry, header bytes, code bytes, block bytes, entry bytes) of idot kind 20..31, 34..38");
  m.def("idot_iq4", []() { return idot_block_kind(34); }, "whether mmi runs IQ4 nibbles and Q3_K / Q2_K crumbs (kinds 34..38: the AVX-512 build)");
  m.def("idot", &idot_available, "whether this build runs lp.kernels.idot (AVX-512 VNNI and BW, or AVX2 with FMA and F16C)");
  m.def("avx512", &exact4_avx512, "whether this build runs the AVX-512 path");
  m.def("encode", &exact4_encode, "(ok, q, d, c): w's exact 4-bit blocks in one pass");
  m.def("encode8", &exact8_encode, "(ok, q, d): w's exact 8-bit blocks in one pass");
  m.def("screen8_pack", &exact8_screen_pack, "the greedy head screen's int8 weights from exact 8-bit blocks");
  // the screen's two calls run without the GIL, as torch.ops calls do: the server's HTTP thread works meanwhile
  m.def("screen8", &exact8_screen, py::call_guard<py::gil_scoped_release>(),
        "(ok, upper [M, V], lower_max [M]): the greedy head screen's bounds");
  m.def("screen8_logits", &exact8_screen_logits, py::call_guard<py::gil_scoped_release>(),
        "(ok, logits [M, vocab]): the greedy head through the screen, -inf where proved below the maximum; kind: "
        "the packed head's kernel, 1 (pack8) or 8 (exactq's Q6_K as bytes)",
        py::arg("x"), py::arg("w"), py::arg("D"), py::arg("wabs"), py::arg("werr"), py::arg("p"), py::arg("vocab"),
        py::arg("kind") = 1);
  m.def("vnni", &exact8_vnni, "whether this build runs the screen on AVX-512 VNNI");
  m.def("set_tile", [](int kind, int rows, int outputs) {
    TORCH_CHECK(kind >= 0 && kind < 9 && rows >= 1 && rows <= kRowTile &&
                    (outputs == 1 || outputs == 2 || outputs == 4 || outputs == 8),
                "set_tile: kind 0 (exact4), 1 (exact8), 2 (exact8x), 3 (exact16), 4..8 (exactq), rows 1..8, outputs 1, 2, 4 or 8");
    g_tile[kind][rows] = outputs;
  }, "outputs per tile for a tile of `rows` rows (benchmarks)");
  m.def("tiles", []() {
    std::vector<std::vector<int>> t;
    for (const auto& row : g_tile) t.emplace_back(row + 1, row + kRowTile + 1);
    return t;
  }, "outputs per tile for 1..8 rows, exact4, exact8, exact8x, exact16, exactq 4..8");
  m.def("set_prefetch", [](bool on) { g_prefetch = on; }, "the kernels' software prefetch on or off (benchmarks)");
  m.def("parallel_width", &exact4_parallel_width, "threads the kernel's parallel_for runs on");
  m.def("set_clock", [](bool on) {
    g_clock = on;
    for (double& t : g_phase) t = 0;
  }, "decoder_paged's phase clock on (zeroed) or off (benchmarks)");
  m.def("clock", []() {
    std::vector<std::pair<std::string, double>> out;
    for (int i = 0; i < kPhases; ++i) out.emplace_back(kPhaseNames[i], g_phase[i]);
    return out;
  }, "seconds per phase of decoder_paged since set_clock(True)");
}
