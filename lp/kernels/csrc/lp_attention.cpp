// Paged attention of a batched step, every sequence in one call (lp.kernels.attention's
// ``paged_attention``): float32 on the CPU. Sequences of at most ``max_rows`` rows (decoding rows,
// small draft trees) run the loop below, all of them in one parallel region; a longer one (a
// prefill chunk, a large tree) runs ATen's scaled_dot_product_attention over its keys (a view of
// the pool, or its slots gathered), as the Python op does.
//
// Inputs as lp.kernels.attention.paged_attention takes them: query [1, H, Q, D] (any strides),
// key / value: the whole pool [1, H_kv, P, D] (contiguous), spans [S, 7] int64 (QO, ROWS, FIRST,
// KEYS, MASK, SLIDING, SLOTS), masks: the flat float32 additive masks, slots: the flat int64 pool
// slots of fragmented sequences. Output [1, Q, H, D] contiguous.
//
// Per (sequence, query head), on one thread: for each of its rows,
// scores s_j = scale * (q . k_j) + mask_j over the sequence's keys in order, m = max_j s_j,
// p_j = exp(s_j - m), out = (sum_j p_j v_j) / (sum_j p_j); every sum runs over j in order and
// over d in 16-lane chunks, the same operations whatever the batch holds: a sequence's output
// depends on its own rows and keys only (not on the other sequences, not on the thread count).
// exp is a degree-6 polynomial after range reduction (relative error ~1e-7, within a few float32
// ulps). Three builds: AVX-512 (16-lane vectors), AVX2 + FMA (the same 16 lanes as two 8-lane halves,
// e^x 0 below the smallest normal float instead of AVX-512's denormals) and a scalar loop; each is
// its own fixed order of operations. A row whose every score is -inf (fully masked), or with a NaN or +inf score (a NaN in q or
// in a key it sees), gives NaN, as sdpa does.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define LP_ATT256 1
#endif

namespace {

enum { QO = 0, ROWS, FIRST, KEYS, MASK, SLIDING, SLOTS };

#if defined(__AVX512F__)
// e^x for float32 lanes: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), e^r by its Taylor
// polynomial to degree 6 (Horner), then times 2^n (scalef: exact, and 0 for x < -104)
inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-104.0f), hi = _mm512_set1_ps(88.7f);
  x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(LP_ATT256)
// e^x for 8 float32 lanes, x <= 88 (scores minus their maximum: <= 0): exp512's reduction and
// polynomial, 2^n from its exponent bits (n >= -126: a normal float); x < -87.3 gives 0
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, two_n));
}

// the 8 lanes' sum (halves, then pairs, then the last two)
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

inline float exp1(float x) {
#if defined(__AVX512F__)
  return _mm512_cvtss_f32(exp512(_mm512_set1_ps(x)));
#else
  return std::exp(x);
#endif
}

// dot of two float32 vectors of length D (D % 16 == 0 on the AVX-512 path), 16 lanes, summed at the end
inline float dot(const float* a, const float* b, int64_t D) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
#elif defined(LP_ATT256)
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), hi);
  }
  return hsum256(_mm256_add_ps(lo, hi));
#else
  float acc[16] = {0};
  for (int64_t d = 0; d < D; ++d) acc[d % 16] = std::fma(a[d], b[d], acc[d % 16]);
  float s = 0;
  for (int l = 0; l < 16; ++l) s += acc[l];
  return s;
#endif
}

#if defined(__AVX512F__)
// dot(q, k[i], D) for the 4 keys k[0..3]: the same chain per key (16 lanes over d in order, summed at
// the end), the four run side by side
inline void dot4(const float* q, const float* const* k, int64_t D, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[0] + d), a0);
    a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[1] + d), a1);
    a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[2] + d), a2);
    a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[3] + d), a3);
  }
  out[0] = _mm512_reduce_add_ps(a0);
  out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2);
  out[3] = _mm512_reduce_add_ps(a3);
}
#elif defined(LP_ATT256)
// dot(q, k[i], D) for the 4 keys k[0..3], dot()'s chains side by side
inline void dot4(const float* q, const float* const* k, int64_t D, float* out) {
  __m256 a[4], b[4];
  for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m256 qa = _mm256_loadu_ps(q + d), qb = _mm256_loadu_ps(q + d + 8);
    for (int i = 0; i < 4; ++i) {
      a[i] = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k[i] + d), a[i]);
      b[i] = _mm256_fmadd_ps(qb, _mm256_loadu_ps(k[i] + d + 8), b[i]);
    }
  }
  for (int i = 0; i < 4; ++i) out[i] = hsum256(_mm256_add_ps(a[i], b[i]));
}
#endif

}  // namespace

torch::Tensor lp_paged_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor spans,
                                 torch::Tensor masks, torch::Tensor slots, double scale, bool sliding,
                                 int64_t max_rows) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1,
              "lp paged attention: query [1, H, Q, D], key / value [1, H_kv, P, D]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key.scalar_type() == torch::kFloat32 &&
                  value.scalar_type() == torch::kFloat32 && masks.scalar_type() == torch::kFloat32,
              "lp paged attention: float32 only");
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous() && masks.is_contiguous(),
              "lp paged attention: the pool and the masks must be contiguous");
  TORCH_CHECK(spans.scalar_type() == torch::kLong && spans.dim() == 2 && spans.size(1) == 7 &&
                  slots.scalar_type() == torch::kLong,
              "lp paged attention: spans [S, 7] int64, slots int64");
  const int64_t H = query.size(1), Q = query.size(2), D = query.size(3), Hkv = key.size(1), P = key.size(2);
  TORCH_CHECK(H % Hkv == 0 && key.size(3) == D && value.sizes() == key.sizes(), "lp paged attention: shapes");
#if defined(__AVX512F__) || defined(LP_ATT256)
  TORCH_CHECK(D % 16 == 0, "lp paged attention: head size must be a multiple of 16");
#endif
  const int64_t groups = H / Hkv;
  auto out = torch::empty({1, Q, H, D}, query.options());
  auto sp = spans.contiguous();
  const int64_t S = sp.size(0);
  const int64_t* table = sp.data_ptr<int64_t>();
  const auto slots_c = slots.contiguous();  // named: a temporary's pointer would dangle
  const int64_t* slot = slots_c.data_ptr<int64_t>();
  if (query.stride(3) != 1) query = query.contiguous();
  const float* qp = query.data_ptr<float>();
  const int64_t qs_h = query.stride(1), qs_q = query.stride(2);
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  const float* mp = masks.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // tasks: (sequence, query head) of every sequence this call runs
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t* row = table + s * 7;
    if (row[ROWS] > 0 && row[ROWS] <= max_rows)
      for (int64_t h = 0; h < H; ++h) tasks.emplace_back(s, h);
  }
  for (int64_t s = 0; s < S; ++s) {  // long sequences: sdpa, one call each
    const int64_t* row = table + s * 7;
    const int64_t qo = row[QO], q = row[ROWS], first = row[FIRST], k = row[KEYS];
    if (q <= max_rows) continue;
    torch::Tensor k_s, v_s;
    if (first >= 0) {
      k_s = key.narrow(2, first, k);
      v_s = value.narrow(2, first, k);
    } else {
      auto idx = slots.narrow(0, row[SLOTS], k);
      k_s = key.index_select(2, idx);
      v_s = value.index_select(2, idx);
    }
    const int64_t at = sliding && row[SLIDING] >= 0 ? row[SLIDING] : row[MASK];
    std::optional<torch::Tensor> mask;
    if (at >= 0) mask = masks.narrow(0, at, q * k).view({1, 1, q, k});
    auto o = at::scaled_dot_product_attention(query.narrow(2, qo, q), k_s, v_s, mask, 0.0, false, scale,
                                              groups > 1);
    out.narrow(1, qo, q).copy_(o.transpose(1, 2));
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> score;
    std::vector<const float*> kr, vr;
    for (int64_t t = t0; t < t1; ++t) {
      const auto [s, h] = tasks[t];
      const int64_t g = h / groups;
      const int64_t* row = table + s * 7;
      const int64_t qo = row[QO], q = row[ROWS], first = row[FIRST], k = row[KEYS];
      const int64_t at = sliding && row[SLIDING] >= 0 ? row[SLIDING] : row[MASK];
      kr.resize(k);
      vr.resize(k);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t pos = first >= 0 ? first + j : slot[row[SLOTS] + j];
        TORCH_CHECK(pos >= 0 && pos < P, "lp paged attention: a slot outside the pool");
        kr[j] = kp + (g * P + pos) * D;
        vr[j] = vp + (g * P + pos) * D;
      }
      score.resize(k);
      for (int64_t r = 0; r < q; ++r) {
        const float* mask = at >= 0 ? mp + at + r * k : nullptr;
        const float* qv = qp + h * qs_h + (qo + r) * qs_q;
        float m = -std::numeric_limits<float>::infinity();
        bool nan = false;
        int64_t j0 = 0;
#if defined(__AVX512F__) || defined(LP_ATT256)
        for (; j0 + 4 <= k; j0 += 4) dot4(qv, kr.data() + j0, D, score.data() + j0);  // dot()'s chains, 4 at once
#endif
        for (int64_t j = j0; j < k; ++j) score[j] = dot(qv, kr[j], D);
        for (int64_t j = 0; j < k; ++j) {
          float x = score[j] * sc;
          if (mask) x += mask[j];
          score[j] = x;
          nan |= x != x;  // std::max skips a NaN (and exp512 would clamp it): caught here
          m = std::max(m, x);
        }
        float* o = op + ((qo + r) * H + h) * D;
        // NaN as sdpa gives it: a NaN score (from q or a key), a +inf one (exp(inf - inf)), or no
        // visible key at all (every score -inf)
        if (nan || m == std::numeric_limits<float>::infinity() || m == -std::numeric_limits<float>::infinity()) {
          for (int64_t d = 0; d < D; ++d) o[d] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        float l = 0;
#if defined(__AVX512F__)
        const __m512 mv = _mm512_set1_ps(m);
        int64_t j = 0;
        __m512 lv = _mm512_setzero_ps();
        for (; j + 16 <= k; j += 16) {
          const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(score.data() + j), mv));
          _mm512_storeu_ps(score.data() + j, e);
          lv = _mm512_add_ps(lv, e);
        }
        if (j < k) {
          const __mmask16 tail = static_cast<__mmask16>((1u << (k - j)) - 1);
          const __m512 e = _mm512_maskz_mov_ps(
              tail, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, score.data() + j), mv)));
          _mm512_mask_storeu_ps(score.data() + j, tail, e);
          lv = _mm512_add_ps(lv, e);
        }
        l = _mm512_reduce_add_ps(lv);
        const float inv = 1.0f / l;
        for (int64_t d = 0; d < D; d += 64) {  // four 16-lane accumulators over the keys, in order
          const int64_t w = std::min<int64_t>(4, (D - d) / 16);
          __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
          for (int64_t jj = 0; jj < k; ++jj) {
            const __m512 pj = _mm512_set1_ps(score[jj]);
            for (int64_t c = 0; c < w; ++c)
              acc[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr[jj] + d + 16 * c), acc[c]);
          }
          for (int64_t c = 0; c < w; ++c) _mm512_storeu_ps(o + d + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
        }
#elif defined(LP_ATT256)
        const __m256 mv = _mm256_set1_ps(m);
        int64_t j = 0;
        __m256 lv = _mm256_setzero_ps();
        for (; j + 8 <= k; j += 8) {
          const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(score.data() + j), mv));
          _mm256_storeu_ps(score.data() + j, e);
          lv = _mm256_add_ps(lv, e);
        }
        if (j < k) {  // the tail padded with -inf: e^-inf is 0
          alignas(32) float t[8];
          for (int i = 0; i < 8; ++i) t[i] = j + i < k ? score[j + i] : -std::numeric_limits<float>::infinity();
          const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(t), mv));
          _mm256_store_ps(t, e);
          for (int i = 0; j + i < k; ++i) score[j + i] = t[i];
          lv = _mm256_add_ps(lv, e);
        }
        l = hsum256(lv);
        const float inv = 1.0f / l;
        for (int64_t d = 0; d < D; d += 32) {  // four 8-lane accumulators over the keys, in order
          const int64_t w = std::min<int64_t>(4, (D - d) / 8);
          __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
          for (int64_t jj = 0; jj < k; ++jj) {
            const __m256 pj = _mm256_set1_ps(score[jj]);
            for (int64_t c = 0; c < w; ++c)
              acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr[jj] + d + 8 * c), acc[c]);
          }
          for (int64_t c = 0; c < w; ++c) _mm256_storeu_ps(o + d + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
        }
#else
        for (int64_t j = 0; j < k; ++j) {
          score[j] = exp1(score[j] - m);
          l += score[j];
        }
        const float inv = 1.0f / l;
        for (int64_t d = 0; d < D; ++d) {
          float acc = 0;
          for (int64_t j = 0; j < k; ++j) acc = std::fma(score[j], vr[j][d], acc);
          o[d] = acc * inv;
        }
#endif
      }
    }
  });
  return out;
}

TORCH_LIBRARY(lp_attention, m) {
  m.def("paged(Tensor query, Tensor key, Tensor value, Tensor spans, Tensor masks, Tensor slots, float scale, "
        "bool sliding, int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(lp_attention, CPU, m) {
  m.impl("paged", &lp_paged_attention);
}

bool lp_attention_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

bool lp_attention_simd() {
#if defined(__AVX512F__) || defined(LP_ATT256)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged", &lp_paged_attention, "every short sequence of a batched step against its own paged keys");
  m.def("avx512", &lp_attention_avx512, "whether this build runs the AVX-512 path");
  m.def("simd", &lp_attention_simd, "whether this build runs a vector path (AVX-512, or AVX2 with FMA; else a scalar loop)");
}
