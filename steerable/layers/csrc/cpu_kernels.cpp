// CPU kernels of a float32 engine step (steerable/layers/cpu_kernels.py builds this file once per
// machine and falls back to PyTorch ops where it cannot). Eager PyTorch spends a decode step on op
// dispatch and on copies: attention gathered every cached K/V row into a padded batch before
// reading it again, and each norm, rotary or SwiGLU was several passes over memory. Here each is
// one pass, the attention reading the paged cache in place. Products keep PyTorch's float32
// rounding where one operation rounds once (no FMA contraction: the build passes -ffp-contract=off);
// reductions (norms, softmax) sum in another order, so results agree to the last bit or two.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

// exp(x) in float32 to within 2 ulp, written so that loops over it vectorize (the C library's
// expf and floorf do not without -ffast-math, which would also drop the infinities a softmax
// relies on): x = n ln2 + r, |r| <= ln2 / 2 (n rounded to nearest by adding and subtracting
// 1.5 * 2^23), exp(r) by Cephes' polynomial, 2^n through the exponent bits.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3365f), 88.3762626647949f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  return y * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, ": a float32 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

// Blocks ahead, into L2: at 2 into L1 some were evicted before use; at 6 and more, L2 held too
// many (SmolLM2, 64 decode rows, context ~104, one core of an AMX Xeon: 4 -> 1.44-1.49 ms a layer, 2 -> 1.58-1.78).
constexpr size_t PREFETCH_AHEAD = 4;

// Prefetches [p, p + bytes) into the caches: a row's next cache block lies anywhere in memory,
// so the hardware prefetcher cannot see it coming.
inline void prefetch(const float* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  // Every line: a prefetch a pair of lines apart left half of them to demand misses on hosts whose
  // adjacent-line prefetcher did not fetch the other (2.1 against 1.45 ms a layer, same shape).
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

struct Rows {  // what the attention of a step's rows reads, and the shapes
  const float *q, *k, *v;
  float* out;
  const int32_t *table, *seq, *first, *len;
  int64_t rows, hq, hkv, group, d, bs, qs0, qs1, os0, os1, kb, kh, vb, vpos, vh, ts;
  float scale, cap;
};

// s[j] = q . k_j for the BS positions of a position-minor K block kt ([D][BS]).
template <int64_t D, int64_t BS>
inline void block_scores(const float* qv, const float* kt, float* s, int64_t d, int64_t bs) {
#ifdef __AVX512F__
  if constexpr (BS == 16 && D % 4 == 0 && D > 0) {  // four chains of multiply-adds, one vector of positions
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (int64_t i = 0; i < D; i += 4) {
      c0 = _mm512_fmadd_ps(_mm512_set1_ps(qv[i]), _mm512_loadu_ps(kt + i * 16), c0);
      c1 = _mm512_fmadd_ps(_mm512_set1_ps(qv[i + 1]), _mm512_loadu_ps(kt + (i + 1) * 16), c1);
      c2 = _mm512_fmadd_ps(_mm512_set1_ps(qv[i + 2]), _mm512_loadu_ps(kt + (i + 2) * 16), c2);
      c3 = _mm512_fmadd_ps(_mm512_set1_ps(qv[i + 3]), _mm512_loadu_ps(kt + (i + 3) * 16), c3);
    }
    _mm512_storeu_ps(s, _mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)));
    return;
  }
#endif
  for (int64_t j = 0; j < bs; ++j) s[j] = 0.f;
  for (int64_t i = 0; i < d; ++i) {
    const float qi = qv[i];
#pragma omp simd
    for (int64_t j = 0; j < bs; ++j) s[j] += qi * kt[i * bs + j];
  }
}

// a = a * rescale + sum over j in [lo, hi) of p[j] * v_j (v_j = vbase + j * vpos, D wide).
template <int64_t D>
inline void block_values(const float* p, const float* vbase, int64_t vpos, int64_t lo, int64_t hi, float rescale,
                         float* a, int64_t d) {
#ifdef __AVX512F__
  if constexpr (D % 64 == 0 && D > 0) {  // 64 columns at a time, held in four registers
    const __m512 r = _mm512_set1_ps(rescale);
    for (int64_t c = 0; c < D; c += 64) {
      __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(a + c), r), a1 = _mm512_mul_ps(_mm512_loadu_ps(a + c + 16), r);
      __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(a + c + 32), r), a3 = _mm512_mul_ps(_mm512_loadu_ps(a + c + 48), r);
      for (int64_t j = lo; j < hi; ++j) {
        const __m512 pj = _mm512_set1_ps(p[j]);
        const float* vv = vbase + j * vpos + c;
        a0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vv), a0);
        a1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vv + 16), a1);
        a2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vv + 32), a2);
        a3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vv + 48), a3);
      }
      _mm512_storeu_ps(a + c, a0), _mm512_storeu_ps(a + c + 16, a1);
      _mm512_storeu_ps(a + c + 32, a2), _mm512_storeu_ps(a + c + 48, a3);
    }
    return;
  }
#endif
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) a[i] *= rescale;
  for (int64_t j = lo; j < hi; ++j) {
    const float pj = p[j];
    const float* vv = vbase + j * vpos;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) a[i] += pj * vv[i];
  }
}

// The G query heads of one KV head at once (G > 0, AVX-512, BS 16, D a multiple of 64): each K
// vector and V row is loaded once for all G heads instead of once a head. s holds G rows of BS
// scores, q the G heads' rows (qs apart).
template <int64_t D, int64_t G>
inline void group_scores(const float* q, int64_t qs, const float* kt, float* s) {
#ifdef __AVX512F__
  __m512 even[G], odd[G];
  for (int64_t g = 0; g < G; ++g) even[g] = _mm512_setzero_ps(), odd[g] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 2) {
    const __m512 k0 = _mm512_loadu_ps(kt + i * 16), k1 = _mm512_loadu_ps(kt + (i + 1) * 16);
    for (int64_t g = 0; g < G; ++g) {
      even[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * qs + i]), k0, even[g]);
      odd[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * qs + i + 1]), k1, odd[g]);
    }
  }
  for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(s + g * 16, _mm512_add_ps(even[g], odd[g]));
#endif
}

// a_g = a_g * rescale[g] + sum over j in [lo, hi) of p_g[j] * v_j for the G heads (p_g = p + g * 16,
// a_g = a + g * D), 64 columns at a time.
template <int64_t D, int64_t G>
inline void group_values(const float* p, const float* vbase, int64_t vpos, int64_t lo, int64_t hi,
                         const float* rescale, float* a) {
#ifdef __AVX512F__
  for (int64_t c = 0; c < D; c += 64) {
    __m512 acc[G][4];
    for (int64_t g = 0; g < G; ++g) {
      const __m512 r = _mm512_set1_ps(rescale[g]);
      for (int64_t u = 0; u < 4; ++u) acc[g][u] = _mm512_mul_ps(_mm512_loadu_ps(a + g * D + c + u * 16), r);
    }
    for (int64_t j = lo; j < hi; ++j) {
      const float* vv = vbase + j * vpos + c;
      const __m512 v0 = _mm512_loadu_ps(vv), v1 = _mm512_loadu_ps(vv + 16);
      const __m512 v2 = _mm512_loadu_ps(vv + 32), v3 = _mm512_loadu_ps(vv + 48);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * 16 + j]);
        acc[g][0] = _mm512_fmadd_ps(pj, v0, acc[g][0]);
        acc[g][1] = _mm512_fmadd_ps(pj, v1, acc[g][1]);
        acc[g][2] = _mm512_fmadd_ps(pj, v2, acc[g][2]);
        acc[g][3] = _mm512_fmadd_ps(pj, v3, acc[g][3]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t u = 0; u < 4; ++u) _mm512_storeu_ps(a + g * D + c + u * 16, acc[g][u]);
  }
#endif
}

// The kernel for head size D and block size BS (compile-time constants for the common shapes, so
// the vector loops have no remainder; 0: the runtime sizes) and G query heads a KV head (0: any,
// one head at a time; G > 0 takes them together, each K and V block read once for all G). K is
// position-minor ([block, Hkv, D, BS]): a query's scores over a block are D vector multiply-adds of
// BS lanes, no horizontal sums.
template <int64_t D, int64_t BS, int64_t G>
__attribute__((optimize("fp-contract=fast")))  // multiply-adds: no op of PyTorch's to round alike here
void attend_rows(const Rows& w) {
  const int64_t d = D ? D : w.d, bs = BS ? BS : w.bs, hq = w.hq, group = G ? G : w.group, hkv = w.hkv;
  at::parallel_for(0, w.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(hq * d), score(hq * bs), m(hq), l(hq), rescale(hq);
    std::vector<int64_t> visits;  // every block this range reads, in order: what to prefetch ahead
    for (int64_t r = begin; r < end; ++r)
      for (int64_t start = w.first[r] - w.first[r] % bs; start < w.len[r]; start += bs)
        visits.push_back(w.table[w.seq[r] * w.ts + start / bs]);
    const int64_t k_bytes = hkv * w.kh * 4, v_bytes = ((bs - 1) * w.vpos + hkv * w.vh) * 4;
    const int64_t k_part = (k_bytes / hkv + 127) / 128 * 128, v_part = (v_bytes / hkv + 127) / 128 * 128;
    size_t visit = 0;
    for (int64_t r = begin; r < end; ++r) {
      const int32_t len = w.len[r], first = w.first[r];
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int32_t* blocks = w.table + w.seq[r] * w.ts;
      const float* qrow = w.q + r * w.qs0;
      for (int64_t start = first - first % bs; start < len; start += bs) {
        const int64_t lo = std::max<int64_t>(start, first) - start, hi = std::min<int64_t>(start + bs, len) - start;
        const int64_t block = blocks[start / bs];
        // Memory, not arithmetic, bounds this loop: the block read PREFETCH_AHEAD blocks later
        // (this row's or the next rows') streams in meanwhile, a slice of it per KV head.
        const int64_t ahead = visit + PREFETCH_AHEAD < visits.size() ? visits[visit + PREFETCH_AHEAD] : -1;
        ++visit;
        for (int64_t h = 0; h < hkv; ++h) {  // the KV head's query heads' scores, softmax updates, values
          if (ahead >= 0) {
            prefetch(w.k + ahead * w.kb + h * k_part / 4, std::min(k_part, k_bytes - h * k_part));
            prefetch(w.v + ahead * w.vb + h * v_part / 4, std::min(v_part, v_bytes - h * v_part));
          }
          const float* kt = w.k + block * w.kb + h * w.kh;
          const float* vb = w.v + block * w.vb + h * w.vh;
          const int64_t h0 = h * group;
          if constexpr (G > 0)
            group_scores<D, G>(qrow + h0 * w.qs1, w.qs1, kt, score.data() + h0 * bs);
          else
            for (int64_t hd = h0; hd < h0 + group; ++hd)
              block_scores<D, BS>(qrow + hd * w.qs1, kt, score.data() + hd * bs, d, bs);
          for (int64_t hd = h0; hd < h0 + group; ++hd) {
            float* s = score.data() + hd * bs;
            if (w.cap > 0.f)
              for (int64_t j = lo; j < hi; ++j) s[j] = w.cap * std::tanh(s[j] * w.scale / w.cap) / w.scale;
            float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
            for (int64_t j = 0; j < bs; ++j) top = std::max(top, j >= lo && j < hi ? s[j] : top);
            top = std::max(m[hd], top * w.scale);
            rescale[hd] = exp_approx(m[hd] - top);
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < bs; ++j) {  // positions outside [lo, hi) weigh 0
              const float e = exp_approx(s[j] * w.scale - top);
              s[j] = j >= lo && j < hi ? e : 0.f;
              sum += s[j];
            }
            l[hd] = l[hd] * rescale[hd] + sum;
            m[hd] = top;
          }
          if constexpr (G > 0)
            group_values<D, G>(score.data() + h0 * bs, vb, w.vpos, lo, hi, rescale.data() + h0, acc.data() + h0 * d);
          else
            for (int64_t hd = h0; hd < h0 + group; ++hd)
              block_values<D>(score.data() + hd * bs, vb, w.vpos, lo, hi, rescale[hd], acc.data() + hd * d, d);
        }
      }
      for (int64_t hd = 0; hd < hq; ++hd) {
        float* o = w.out + r * w.os0 + hd * w.os1;
        const float inv = l[hd] > 0.f ? 1.f / l[hd] : 0.f;
        for (int64_t i = 0; i < d; ++i) o[i] = acc[hd * d + i] * inv;
      }
    }
  });
}

// The instantiation for the shapes: query heads a KV head taken together where the vector code
// covers them (AVX-512, blocks of 16, heads of 64 or 128, groups of 1 to 4).
template <int64_t D>
void attend_rows_grouped(const Rows& w) {
#ifdef __AVX512F__
  switch (w.group) {
    case 1: return attend_rows<D, 16, 1>(w);
    case 2: return attend_rows<D, 16, 2>(w);
    case 3: return attend_rows<D, 16, 3>(w);
    case 4: return attend_rows<D, 16, 4>(w);
  }
#endif
  attend_rows<D, 16, 0>(w);
}

// Attention of query rows over a paged cache. Row r of q ([T, Hq, D]) belongs to sequence
// row_seq[r] (its block-table row) and attends to positions [row_first[r], row_len[r]) of it
// (row_len 0: no sequence, its output is zeros): decode rows and prefill chunks alike. k_cache and
// v_cache are [blocks, block_size, Hkv, D] views, K's memory position-minor (``key_cache_view``),
// V's head-dim-minor; the query heads of KV head h are h * group .. (h + 1) * group - 1. softcap
// > 0: scores become softcap * tanh(score / softcap). An online softmax, one cache block at a time.
void paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     torch::Tensor& out, const torch::Tensor& block_table, const torch::Tensor& row_seq,
                     const torch::Tensor& row_first, const torch::Tensor& row_len, double scale, double softcap) {
  check_f32(q, "q");
  check_f32(v_cache, "v_cache");
  check_f32(out, "out");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && k_cache.stride(1) == 1 &&
                  k_cache.stride(3) == k_cache.size(1) && k_cache.stride(2) == k_cache.size(1) * k_cache.size(3),
              "k_cache: a position-minor float32 view (key_cache_view)");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.stride(1) == 1, "block_table: int32 rows");
  for (const auto* t : {&row_seq, &row_first, &row_len})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous() && t->numel() == q.size(0),
                "row arrays: contiguous int32, one entry a query row");
  Rows w;
  w.rows = q.size(0), w.hq = q.size(1), w.d = q.size(2), w.bs = k_cache.size(1), w.hkv = k_cache.size(2);
  w.group = w.hq / w.hkv;
  TORCH_CHECK(k_cache.size(3) == w.d && v_cache.size(3) == w.d && w.hq == w.hkv * w.group, "head shapes");
  w.q = q.data_ptr<float>(), w.k = k_cache.data_ptr<float>(), w.v = v_cache.data_ptr<float>();
  w.out = out.data_ptr<float>();
  w.table = block_table.data_ptr<int32_t>(), w.seq = row_seq.data_ptr<int32_t>();
  w.first = row_first.data_ptr<int32_t>(), w.len = row_len.data_ptr<int32_t>();
  w.qs0 = q.stride(0), w.qs1 = q.stride(1), w.os0 = out.stride(0), w.os1 = out.stride(1);
  w.kb = k_cache.stride(0), w.kh = k_cache.stride(2);
  w.vb = v_cache.stride(0), w.vpos = v_cache.stride(1), w.vh = v_cache.stride(2);
  w.ts = block_table.stride(0);
  w.scale = static_cast<float>(scale), w.cap = static_cast<float>(softcap);
  if (w.d == 64 && w.bs == 16) attend_rows_grouped<64>(w);
  else if (w.d == 128 && w.bs == 16) attend_rows_grouped<128>(w);
  else attend_rows<0, 0, 0>(w);
}

// key/value rows [T, Hkv, D] into the caches (views of any strides) at slot_mapping (block * block_size + offset; a
// negative slot is a padding row and is skipped).
void store_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache, torch::Tensor& v_cache,
              const torch::Tensor& slot_mapping) {
  check_f32(key, "key");
  check_f32(value, "value");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32, "caches");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(), "slot_mapping: int64");
  const int64_t rows = key.size(0), heads = key.size(1), d = key.size(2), block_size = k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot = slots[r];
    if (slot < 0) continue;
    const int64_t block = slot / block_size, off = slot % block_size;
    for (int64_t h = 0; h < heads; ++h) {
      float* kd = kc + block * k_cache.stride(0) + off * k_cache.stride(1) + h * k_cache.stride(2);
      float* vd = vc + block * v_cache.stride(0) + off * v_cache.stride(1) + h * v_cache.stride(2);
      const float* ks = kp + r * key.stride(0) + h * key.stride(1);
      const float* vs = vp + r * value.stride(0) + h * value.stride(1);
      for (int64_t i = 0; i < d; ++i) kd[i * k_cache.stride(3)] = ks[i];
      for (int64_t i = 0; i < d; ++i) vd[i * v_cache.stride(3)] = vs[i];
    }
  }
}

// Rotate-half rotary embedding of x [T, H, D] (any row stride) into out [T, H, D]: the first half
// x1 * cos - x2 * sin, the second x2 * cos + x1 * sin, cos/sin rows [positions, D / 2].
void rope(const torch::Tensor& x, torch::Tensor& out, const torch::Tensor& positions, const torch::Tensor& cos,
          const torch::Tensor& sin) {
  check_f32(x, "x");
  check_f32(out, "out");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(), "positions: int64");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32, "tables");
  const int64_t rows = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos.data_ptr<float>() + pos[r] * cos.stride(0);
      const float* s = sin.data_ptr<float>() + pos[r] * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        const float* x1 = xp + r * x.stride(0) + h * x.stride(1);
        const float* x2 = x1 + half;
        float* o = op + r * out.stride(0) + h * out.stride(1);
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          o[i] = x1[i] * c[i] - x2[i] * s[i];
          o[i + half] = x2[i] * c[i] + x1[i] * s[i];
        }
      }
    }
  });
}

// One row's RMSNorm as HF computes it in float32: h * rsqrt(mean(h^2) + eps), then * weight.
inline void norm_row(const float* h, const float* w, float* out, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += h[i] * h[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (h[i] * inv);
}

// RMSNorm of x [T, N] into out (a new tensor).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.is_contiguous(), "x [T, N], weight contiguous");
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t rows = x.size(0), n = x.size(1);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(x.data_ptr<float>() + r * x.stride(0), weight.data_ptr<float>(), out.data_ptr<float>() + r * n, n,
               static_cast<float>(eps));
  });
  return out;
}

// (residual + delta, its RMSNorm): the residual add deferred into the next norm, in one pass.
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& residual, const torch::Tensor& delta,
                                        const torch::Tensor& weight, double eps) {
  check_f32(residual, "residual");
  check_f32(delta, "delta");
  TORCH_CHECK(residual.dim() == 2 && residual.sizes() == delta.sizes() && weight.is_contiguous(), "shapes");
  auto hidden = torch::empty_like(residual, at::MemoryFormat::Contiguous);
  auto normed = torch::empty_like(residual, at::MemoryFormat::Contiguous);
  const int64_t rows = residual.size(0), n = residual.size(1);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* a = residual.data_ptr<float>() + r * residual.stride(0);
      const float* b = delta.data_ptr<float>() + r * delta.stride(0);
      float* h = hidden.data_ptr<float>() + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) h[i] = a[i] + b[i];
      norm_row(h, weight.data_ptr<float>(), normed.data_ptr<float>() + r * n, n, static_cast<float>(eps));
    }
  });
  return {hidden, normed};
}

// SwiGLU of gate_up [T, 2N] (gate | up): silu(gate) * up, silu(x) = x / (1 + exp(-x)).
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2, "gate_up [T, 2N]");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up.data_ptr<float>() + r * gate_up.stride(0);
      const float* u = g + n;
      float* o = out.data_ptr<float>() + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
    }
  });
  return out;
}

// Greedy tokens: each row's first maximum of logits [T, V] as int64 (torch.argmax's answer, a NaN
// being the maximum). Sixteen lanes keep their own first maximum in one vectorised pass; the
// smallest index among the lanes that hold the row's maximum is the first. ATen's max over the
// last dimension took 2.7 ms for 64 rows of SmolLM2's 49,152 logits on one Zen 4 core.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1, "logits [T, V], rows contiguous");
  constexpr int64_t L = 16;
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  int64_t* tokens = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = logits.data_ptr<float>() + r * logits.stride(0);
      float best[L];
      int32_t at[L];
      int32_t nan = 0;
      for (int64_t j = 0; j < L; ++j) best[j] = -std::numeric_limits<float>::infinity(), at[j] = -1;
      const int64_t whole = n / L * L;
      for (int64_t i = 0; i < whole; i += L) {
#pragma omp simd reduction(| : nan)
        for (int64_t j = 0; j < L; ++j) {
          const float v = x[i + j];
          const bool more = v > best[j];
          best[j] = more ? v : best[j];
          at[j] = more ? static_cast<int32_t>(i + j) : at[j];
          nan |= v != v;
        }
      }
      float top = -std::numeric_limits<float>::infinity();
      int64_t first = -1;
      for (int64_t j = 0; j < L; ++j)
        if (at[j] >= 0 && (best[j] > top || (best[j] == top && at[j] < first))) top = best[j], first = at[j];
      for (int64_t i = whole; i < n; ++i) {
        nan |= x[i] != x[i];
        if (x[i] > top) top = x[i], first = i;
      }
      if (first < 0) first = 0;  // every logit -inf (or NaN): the first, as torch
      if (nan)
        for (int64_t i = 0; i < n; ++i)
          if (x[i] != x[i]) { first = i; break; }
      tokens[r] = first;
    }
  });
  return out;
}

// y = x W^T (+ bias) for one row x [1, K] and W [N, K] (a batch-1 decode step's projection or LM
// head). Memory-bound: every weight is read once and used once. oneDNN's GEMM read SmolLM2's
// weights at 12-14 GB/s on one Zen 4 core; one weight row at a time, as one sequential stream with
// four independent accumulators and a software prefetch ahead, reads them at 19-25 GB/s there (a
// plain sum over the same bytes: 21-24). The prefetch goes to L2 (T1): a non-temporal one, as first
// written, read at 5.8 GB/s on one core of an AMX Xeon where T1 at 2 KB ahead reads at 13 (F.linear
// 11.6, a sum 10.4; 4 KB ahead 12.4). Summed in another order than oneDNN's, so within float32
// rounding of it.
#ifdef __AVX512F__
constexpr bool LINEAR_ROW = true;
constexpr int64_t ROW_PREFETCH = 512;  // floats ahead

inline float dot_row(const float* w, const float* x, int64_t k) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    for (int64_t j = 0; j < 64; j += 16) _mm_prefetch(reinterpret_cast<const char*>(w + i + ROW_PREFETCH + j), _MM_HINT_T1);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 32), _mm512_loadu_ps(x + i + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 48), _mm512_loadu_ps(x + i + 48), a3);
  }
  for (; i < k; i += 16) {
    const __mmask16 mask = k - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (k - i)) - 1);
    a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, w + i), _mm512_maskz_loadu_ps(mask, x + i), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

torch::Tensor linear_row(const torch::Tensor& x, const torch::Tensor& weight, const std::optional<torch::Tensor>& bias) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weight.dim() == 2 && weight.size(1) == x.size(1), "x [1, K], weight [N, K]");
  const int64_t n = weight.size(0), k = x.size(1), ws = weight.stride(0);
  const float* b = nullptr;
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias [N]");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({1, n}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) yp[r] = dot_row(wp + r * ws, xp, k) + (b ? b[r] : 0.f);
  });
  return y;
}
#else
constexpr bool LINEAR_ROW = false;  // without AVX-512 oneDNN's GEMM serves one row too

torch::Tensor linear_row(const torch::Tensor&, const torch::Tensor&, const std::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "linear_row needs AVX-512");
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention);
  m.def("store_kv", &store_kv);
  m.def("rope", &rope);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("argmax_rows", &argmax_rows);
  m.def("linear_row", &linear_row);
  m.attr("LINEAR_ROW") = LINEAR_ROW;
}
