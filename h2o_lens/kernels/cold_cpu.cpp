// The cold tier's refill and append on CPU (DESIGN.md §2.13): one call per layer each, a loop per
// (request, KV set), for caches on the fused CPU step (DESIGN.md §2.8).
//
// The refill is h2o_lens.cold's: the window's occupants give their scores back to their cold
// records; the records the step's queries would attend to most are chosen (`exact`: a softmax per
// query head over every cold key of the row; `pages`: Quest's bound over each page of 16 records
// first, the `scan` best pages, a tie taking the later page, then the softmax over their records),
// aggregated over the group as the policy's (sum or max), the `recall` best, a tie taking the newer
// position; an occupant chosen again keeps its slot, the others leave, and the incoming records, in
// ascending position order, take the freed slots in ascending slot order. The append writes a
// decode step's victim (or the new token that was its own victim) to the end of its row's records
// and widens its page's summary. FP32 throughout, whatever the storage dtype; a row's result
// depends on nothing but its own records and slots (DESIGN.md §2.7).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace h2o_cold {
namespace {  // internal linkage: another build in the same process keeps its own

constexpr int64_t kPage = 16;  // records per page summary (h2o_lens.cold_config.PAGE)
constexpr int kLanes = h2o_cpu::kLanes;  // partial sums of a dot product or a softmax's total
constexpr int64_t kChunk = 128;  // keys scored by every query of a group before the next ones

using h2o_cpu::dot;  // cpu_common.cpp; the AVX2 path below gives its bits for eight keys at once

// e^x for x <= 0 (a softmax's shifted logits): 2^n · p(r), n = round(x / ln 2), r = x − n ln 2
// (ln 2 in two parts), p a degree-7 polynomial (Cephes' expf coefficients); 0 below −87.3, where
// e^x leaves the normal floats. At most 1.3 ulp from e^x and the same bits in the scalar and AVX2
// forms, checked over every float in [−87.3, 0].
constexpr float kExpLow = -87.3f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

inline float exp_neg(float x) {
  if (!(x >= kExpLow)) return 0.f;
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = std::fma(kP0, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  p = std::fma(p, r * r, r + 1.f);
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

#if defined(__AVX2__) && defined(__FMA__)
#define H2O_COLD_AVX2 1

// The eight lane sums of a[0 … 7] in dot()'s tree: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline __m256 sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline __m256 exp_neg8(__m256 x) {
  const __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_GE_OQ);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kP0), r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  p = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  return _mm256_and_ps(p, low);
}
#endif

// Asks for `bytes` from `p` on into the cache ahead of their use: the pages a selection chose are
// short runs far apart, which the hardware's prefetcher would find one after another.
inline void prefetch(const void* p, int64_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
#endif
}

// dst[0 … n) = src[0 … n), with stores that bypass the caches where both ends allow it: the
// window's slots are written once here and read once by the step's attention, and an ordinary
// store would first read each line in. The caller fences (_mm_sfence) before another thread reads.
template <typename T>
inline void copy_through(const T* src, T* dst, int64_t n) {
#ifdef H2O_COLD_AVX2
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  if (bytes % 32 == 0 && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    const char* from = reinterpret_cast<const char*>(src);
    char* to = reinterpret_cast<char*>(dst);
    for (int64_t o = 0; o < bytes; o += 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(to + o),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + o)));
    }
    return;
  }
#endif
  std::copy(src, src + n, dst);
}

// out[c] = the dot product of `q` with key c of k (m keys, `d` apart), c < m.
template <typename T>
inline void query_dots(const float* q, const T* k, int64_t m, int64_t d, float* out) {
  int64_t c = 0;
#ifdef H2O_COLD_AVX2
  if constexpr (std::is_same<T, float>::value) {
    if (d % kLanes == 0) {
      for (; c + 8 <= m; c += 8) {
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
        const float* kc = k + c * d;
        for (int64_t i = 0; i < d; i += kLanes) {
          const __m256 qv = _mm256_loadu_ps(q + i);
          for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + j * d + i), a[j]);
        }
        _mm256_storeu_ps(out + c, sum8(a));
      }
    }
  }
#endif
  for (; c < m; ++c) out[c] = dot(q, k + c * d, d);
}

// The largest of x[0 … m − 1] (−inf for none).
inline float largest(const float* x, int64_t m) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t c = 0;
#ifdef H2O_COLD_AVX2
  __m256 most = _mm256_set1_ps(top);
  for (; c + kLanes <= m; c += kLanes) most = _mm256_max_ps(most, _mm256_loadu_ps(x + c));
  float lanes[kLanes];
  _mm256_storeu_ps(lanes, most);
  for (int l = 0; l < kLanes; ++l) top = std::max(top, lanes[l]);
#endif
  for (; c < m; ++c) top = std::max(top, x[c]);
  return top;
}

// logits[g · stride + c] for the g_n queries `q` (g_n, d) and keys c < m: chunk by chunk, so that
// a chunk's keys are read from memory once for the whole group. `top` (g_n, or null): each
// query's largest logit so far, raised to this call's where larger.
template <typename T>
inline void group_dots(const float* q, int64_t g_n, const T* k, int64_t m, int64_t d, float* logits, int64_t stride,
                       float* top) {
  for (int64_t c0 = 0; c0 < m; c0 += kChunk) {
    const int64_t len = std::min(kChunk, m - c0);
    if (c0 + kChunk < m) prefetch(k + (c0 + kChunk) * d, std::min(kChunk, m - c0 - kChunk) * d * sizeof(T));
    for (int64_t g = 0; g < g_n; ++g) {
      float* out = logits + g * stride + c0;
      query_dots(q + g * d, k + c0 * d, len, d, out);
      if (top != nullptr) top[g] = std::max(top[g], largest(out, len));
    }
  }
}

// Each query head's softmax over the m entries of `logits` (G, m), its largest entry `top[g]`,
// aggregated over the group into `value` (m): the sum in head order, or the largest. `logits` is
// overwritten. A softmax's total is kLanes partial sums (entry c into sum c mod kLanes, in order)
// added in dot()'s tree.
inline void aggregate_softmax(float* logits, const float* top, int64_t g_n, int64_t m, bool agg_max, float* value) {
  for (int64_t g = 0; g < g_n; ++g) {
    float* lg = logits + g * m;
    float part[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t c = 0;
#ifdef H2O_COLD_AVX2
    {
      const __m256 shift = _mm256_set1_ps(top[g]);
      __m256 acc = _mm256_setzero_ps();
      for (; c + kLanes <= m; c += kLanes) {
        const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(lg + c), shift));
        _mm256_storeu_ps(lg + c, e);
        acc = _mm256_add_ps(acc, e);
      }
      _mm256_storeu_ps(part, acc);
    }
#else
    for (; c + kLanes <= m; c += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        lg[c + l] = exp_neg(lg[c + l] - top[g]);
        part[l] += lg[c + l];
      }
    }
#endif
    for (int l = 0; c < m; ++c, ++l) {
      lg[c] = exp_neg(lg[c] - top[g]);
      part[l] += lg[c];
    }
    const float total = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    if (g == 0) {
      for (int64_t j = 0; j < m; ++j) value[j] = lg[j] / total;
    } else if (agg_max) {
      for (int64_t j = 0; j < m; ++j) value[j] = std::max(value[j], lg[j] / total);
    } else {
      for (int64_t j = 0; j < m; ++j) value[j] += lg[j] / total;
    }
  }
}

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

// The k best of m entries by `value` (each >= 0), a tie taking the larger order(c) (a newer
// position, a later page); `out` (room for k) gets their indices, in no set order. Returns how
// many (min(k, m)). A non-negative float's bits order as it does: a histogram of the bits over
// their range finds the bucket that holds the k-th best; the entries above it are taken, the
// bucket's are narrowed down by histograms of their own until few are left, and those few are
// ranked by value and then by order. `tied` is scratch.
template <typename Order>
inline int64_t best_of(const float* value, Order order, int64_t m, int64_t k, int64_t* out,
                       std::vector<int64_t>& tied) {
  if (k >= m) {
    for (int64_t c = 0; c < m; ++c) out[c] = c;
    return m;
  }
  uint32_t lo = bits_of(value[0]), hi = lo;
  for (int64_t c = 1; c < m; ++c) {
    const uint32_t u = bits_of(value[c]);
    lo = std::min(lo, u), hi = std::max(hi, u);
  }
  uint32_t hist[1024];
  // the bucket of [lo, hi] (split into at most 1024) that holds the need-th best of `n` entries
  // whose bits lie in [lo, hi], narrowed to [lo, hi]; returns how many lie above it
  auto narrow = [&](auto&& each, int64_t need, uint32_t& b_lo, uint32_t& b_hi) {
    int shift = 0;
    while (((b_hi - b_lo) >> shift) >= 1024) ++shift;
    const uint32_t buckets = ((b_hi - b_lo) >> shift) + 1, base = b_lo;
    std::fill(hist, hist + buckets, 0u);
    each([&](uint32_t u) { ++hist[(u - base) >> shift]; });
    uint32_t at = buckets;
    int64_t above = 0;
    while (above + hist[at - 1] < need) above += hist[--at];
    --at;
    b_lo = base + (at << shift);
    b_hi = at + 1 == buckets ? b_hi : base + ((at + 1) << shift) - 1;
    return above;
  };
  int64_t need = k, n_out = 0;
  need -= narrow([&](auto&& f) { for (int64_t c = 0; c < m; ++c) f(bits_of(value[c])); }, need, lo, hi);
  tied.clear();
  for (int64_t c = 0; c < m; ++c) {
    const uint32_t u = bits_of(value[c]);
    if (u > hi) out[n_out++] = c;
    else if (u >= lo) tied.push_back(c);
  }
  while (static_cast<int64_t>(tied.size()) > 64 && lo < hi) {
    need -= narrow([&](auto&& f) { for (int64_t c : tied) f(bits_of(value[c])); }, need, lo, hi);
    size_t kept = 0;
    for (int64_t c : tied) {
      const uint32_t u = bits_of(value[c]);
      if (u > hi) out[n_out++] = c;
      else if (u >= lo) tied[kept++] = c;
    }
    tied.resize(kept);
  }
  auto better = [&](int64_t a, int64_t b) {
    const uint32_t ua = bits_of(value[a]), ub = bits_of(value[b]);
    return ua > ub || (ua == ub && order(a) > order(b));
  };
  std::nth_element(tied.begin(), tied.begin() + (need - 1), tied.end(), better);
  for (int64_t t = 0; t < need; ++t) out[n_out++] = tied[t];
  return n_out;
}

struct Refill : h2o_cpu::SlotStrides {
  int64_t hs, group, d, records, pages_cap;  // store: records and pages per row
  int64_t r, start, scan;                    // the window's slots, its first slot; pages read
  bool pages, agg_max;
  float scale;
};

// A thread's working memory across rows and calls (sized up as needed, never cleared).
struct Scratch {
  std::vector<float> q, top, up, down, bound, low_part, logits, value;
  std::vector<int64_t> cand, pick, tied;
  std::vector<std::pair<int64_t, int64_t>> incoming;  // (position, record)
  std::vector<uint8_t> mark;
};

inline Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

template <typename V>
inline typename V::value_type* room(V& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

template <typename T, typename P>
void refill_row(int64_t row, const Refill& s, const T* query, const T* store_k, const T* store_v,
                const int64_t* store_pos, float* store_sc, const int64_t* count, const float* low,
                const float* high, const int64_t* window, T* keys, T* values, float* scores, P* positions,
                int64_t* new_w, bool* filled, float* score_out, int64_t* held, int64_t* tally) {
  const int64_t bi = row / s.hs, h = row % s.hs, d = s.d, g_n = s.group, r = s.r;
  const int64_t n = count[row];
  const int64_t* win = window + row * r;
  float* lsc = scores + bi * s.ss0 + h * s.ss1 + s.start;
  P* lpos = positions + bi * s.ps0 + h * s.ps1 + s.start;
  float* ssc = store_sc + row * s.records;
  const int64_t* spos = store_pos + row * s.records;
  const T* sk = store_k + row * s.records * d;
  const T* sv = store_v + row * s.records * d;
  Scratch& w = scratch();
  // the occupants' scores go back to their records
  for (int64_t j = 0; j < r; ++j) {
    if (win[j] >= 0) ssc[win[j]] = lsc[j];
  }
  const int64_t pages = (n + kPage - 1) / kPage;
  const bool by_page = s.pages && pages > s.scan;
  // the step's queries of the KV set's group, scaled in the storage dtype as the model's are
  float* q = room(w.q, g_n * d);
  for (int64_t g = 0; g < g_n; ++g) {
    const T* qg = query + ((bi * s.hs + h) * g_n + g) * d;
    for (int64_t i = 0; i < d; ++i) q[g * d + i] = static_cast<float>(static_cast<T>(static_cast<float>(qg[i]) * s.scale));
  }
  float* top = room(w.top, g_n);
  std::fill(top, top + g_n, -std::numeric_limits<float>::infinity());
  // the candidates: every record, or the records of the best pages (their runs of records)
  int64_t m = n;
  int64_t* cand = nullptr;  // candidate c's record (null: record c)
  if (by_page) {
    float* up = room(w.up, g_n * d);
    float* down = room(w.down, g_n * d);
    float* bound = room(w.bound, g_n * pages);
    float* over_low = room(w.low_part, g_n * pages);
    float* value = room(w.value, pages);
    for (int64_t i = 0; i < g_n * d; ++i) up[i] = std::max(q[i], 0.f), down[i] = q[i] - up[i];
    group_dots(up, g_n, high + row * s.pages_cap * d, pages, d, bound, pages, nullptr);
    group_dots(down, g_n, low + row * s.pages_cap * d, pages, d, over_low, pages, nullptr);
    for (int64_t i = 0; i < g_n * pages; ++i) bound[i] += over_low[i];
    for (int64_t g = 0; g < g_n; ++g) top[g] = std::max(top[g], largest(bound + g * pages, pages));
    aggregate_softmax(bound, top, g_n, pages, s.agg_max, value);
    int64_t* pick = room(w.pick, s.scan);
    const int64_t got = best_of(value, [](int64_t p) { return p; }, pages, s.scan, pick, w.tied);
    std::sort(pick, pick + got);  // the pages' records in record order
    for (int64_t i = 0; i < got; ++i) {
      prefetch(sk + pick[i] * kPage * d, kPage * d * sizeof(T));
      prefetch(spos + pick[i] * kPage, kPage * sizeof(int64_t));
    }
    cand = room(w.cand, got * kPage);
    m = 0;
    for (int64_t i = 0; i < got; ++i) {
      for (int64_t c = pick[i] * kPage; c < std::min(n, (pick[i] + 1) * kPage); ++c) cand[m++] = c;
    }
    std::fill(top, top + g_n, -std::numeric_limits<float>::infinity());
  }
  tally[2 * row] = m;
  // each candidate's value, the recall best of them
  float* logits = room(w.logits, g_n * m);
  float* value = room(w.value, m);
  if (cand == nullptr) {
    group_dots(q, g_n, sk, m, d, logits, m, top);
  } else {
    for (int64_t c = 0; c < m;) {  // a run of consecutive records (one page, or adjacent pages) at a time
      int64_t len = 1;
      while (c + len < m && cand[c + len] == cand[c] + len) ++len;
      group_dots(q, g_n, sk + cand[c] * d, len, d, logits + c, m, top);
      c += len;
    }
  }
  aggregate_softmax(logits, top, g_n, m, s.agg_max, value);
  auto record = [&](int64_t c) { return cand == nullptr ? c : cand[c]; };
  int64_t* pick = room(w.pick, std::min(r, m));
  const int64_t chosen = best_of(value, [&](int64_t c) { return spos[record(c)]; }, m, r, pick, w.tied);
  // the swap: an occupant chosen again stays; the incoming, by position, fill the freed slots
  uint8_t* mark = room(w.mark, n);
  for (int64_t i = 0; i < chosen; ++i) mark[record(pick[i])] = 1;
  int64_t* nw = new_w + row * r;
  bool* fl = filled + row * r;
  for (int64_t j = 0; j < r; ++j) {
    const bool stays = win[j] >= 0 && win[j] < n && mark[win[j]] == 1;
    if (stays) mark[win[j]] = 2;
    nw[j] = stays ? win[j] : -1;
    fl[j] = false;
  }
  w.incoming.clear();
  for (int64_t i = 0; i < chosen; ++i) {
    const int64_t rec = record(pick[i]);
    if (mark[rec] == 1) w.incoming.emplace_back(spos[rec], rec);
    mark[rec] = 0;  // the marks are all clear again for the next row
  }
  std::sort(w.incoming.begin(), w.incoming.end());
  size_t next = 0;
  for (int64_t j = 0; j < r && next < w.incoming.size(); ++j) {
    if (nw[j] >= 0) continue;
    nw[j] = w.incoming[next++].second;
    fl[j] = true;
  }
  tally[2 * row + 1] = static_cast<int64_t>(next);
  // the window's slots: every slot's score and position, a filled slot's key and value
  float* so = score_out + row * r;
  int64_t* ho = held + row * r;
  for (int64_t j = 0; j < r; ++j) {
    const int64_t rec = nw[j];
    so[j] = rec < 0 ? 0.f : ssc[rec];
    ho[j] = rec < 0 ? -1 : spos[rec];
    lsc[j] = so[j];
    lpos[j] = static_cast<P>(ho[j]);
    if (fl[j]) {
      T* kd = keys + bi * s.ks0 + h * s.ks1 + (s.start + j) * s.ks2;
      T* vd = values + bi * s.vs0 + h * s.vs1 + (s.start + j) * s.vs2;
      copy_through(sk + rec * d, kd, d);
      copy_through(sv + rec * d, vd, d);
    }
  }
}
template <typename T, typename P>
void refill(const Refill& s, int64_t rows, const at::Tensor& query, at::Tensor& kv, at::Tensor& store_pos,
            at::Tensor& store_sc, const at::Tensor& count, const at::Tensor& low, const at::Tensor& high,
            const at::Tensor& window, at::Tensor& keys, at::Tensor& values, at::Tensor& scores,
            at::Tensor& positions, at::Tensor& new_w, at::Tensor& filled, at::Tensor& score_out, at::Tensor& held,
            std::vector<int64_t>& tally) {
  const T* qp = query.data_ptr<T>();
  const T* sk = kv.data_ptr<T>();
  const T* sv = sk + rows * s.records * s.d;
  const float* lo = low.defined() ? low.data_ptr<float>() : nullptr;
  const float* hi = high.defined() ? high.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      refill_row<T, P>(row, s, qp, sk, sv, store_pos.data_ptr<int64_t>(), store_sc.data_ptr<float>(),
                       count.data_ptr<int64_t>(), lo, hi, window.data_ptr<int64_t>(), keys.data_ptr<T>(),
                       values.data_ptr<T>(), scores.data_ptr<float>(), positions.data_ptr<P>(),
                       new_w.data_ptr<int64_t>(), filled.data_ptr<bool>(), score_out.data_ptr<float>(),
                       held.data_ptr<int64_t>(), tally.data());
    }
#ifdef H2O_COLD_AVX2
    _mm_sfence();  // the window's slots written through (copy_through) before the step reads them
#endif
  });
}

template <typename T, typename P>
int64_t append(int64_t rows, int64_t records, int64_t pages_cap, int64_t d, int64_t width, at::Tensor& kv,
               at::Tensor& store_pos, at::Tensor& store_sc, at::Tensor& count, const at::Tensor& low,
               const at::Tensor& high, const at::Tensor& slot, const at::Tensor& evicts, const at::Tensor& cand_s,
               const at::Tensor& cand_p, const at::Tensor& old_k, const at::Tensor& old_v, const at::Tensor& new_k,
               const at::Tensor& new_v) {
  T* sk = kv.data_ptr<T>();
  T* sv = sk + rows * records * d;
  int64_t* spos = store_pos.data_ptr<int64_t>();
  float* ssc = store_sc.data_ptr<float>();
  int64_t* cnt = count.data_ptr<int64_t>();
  float* lo = low.defined() ? low.data_ptr<float>() : nullptr;
  float* hi = high.defined() ? high.data_ptr<float>() : nullptr;
  const int64_t* sl = slot.data_ptr<int64_t>();
  const bool* ev = evicts.data_ptr<bool>();
  const int64_t c = cand_s.size(-1);
  const float* cs = cand_s.data_ptr<float>();
  const P* cp = cand_p.data_ptr<P>();
  int64_t added = 0;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t at = sl[row];
    const int64_t pos = ev[row] ? static_cast<int64_t>(cp[row * c + at]) : -1;
    if (pos < 0) continue;
    const int64_t rec = cnt[row];
    TORCH_CHECK(rec < records, "cold_append: the store has no room for record ", rec, " (", records, " per row)");
    const bool self = at >= width;  // the new token was its own victim
    const T* k = (self ? new_k : old_k).data_ptr<T>() + row * d;
    const T* v = (self ? new_v : old_v).data_ptr<T>() + row * d;
    std::copy(k, k + d, sk + (row * records + rec) * d);
    std::copy(v, v + d, sv + (row * records + rec) * d);
    spos[row * records + rec] = pos;
    ssc[row * records + rec] = cs[row * c + at];
    cnt[row] = rec + 1;
    ++added;
    if (lo != nullptr) {  // an empty page holds (+inf, -inf): the first key's min and max is the key
      float* pl = lo + (row * pages_cap + rec / kPage) * d;
      float* ph = hi + (row * pages_cap + rec / kPage) * d;
      for (int64_t i = 0; i < d; ++i) {
        const float x = static_cast<float>(k[i]);
        pl[i] = std::min(pl[i], x);
        ph[i] = std::max(ph[i], x);
      }
    }
  }
  return added;
}

}  // namespace
}  // namespace h2o_cold

// One layer's refill. query (b, Hq, d) contiguous, the storage dtype; the store: kv (2, b, Hs, N,
// d), positions (b, Hs, N) int64, scores (b, Hs, N) float32, count (b, Hs) int64, low and high
// (b, Hs, P, d) float32 (`pages` only, else undefined), all contiguous; window (b, Hs, r) int64
// records (-1: empty); the layer: keys and values (b, Hs, W, d) with unit stride on d, scores (b,
// Hs, W) float32 and positions (b, Hs, W) int32/int64 with unit stride on W, the window at slots
// start … start + r - 1. Writes the store's scores of the occupants and the window's slots in
// place. Returns the new window (b, Hs, r) int64, the slots filled (bool), each slot's score
// (float32, 0 where empty) and position (int64, -1 where empty), and (2,) int64: the keys scored
// and the records brought into the window, over every row.
std::vector<at::Tensor> cold_refill(at::Tensor query, at::Tensor kv, at::Tensor store_pos, at::Tensor store_sc,
                                    at::Tensor count, c10::optional<at::Tensor> low, c10::optional<at::Tensor> high,
                                    at::Tensor window, at::Tensor keys, at::Tensor values, at::Tensor scores,
                                    at::Tensor positions, int64_t start, double scale, bool agg_max, int64_t scan) {
  h2o_cold::Refill s{h2o_cpu::slot_strides(keys, values, scores, positions, "cold_refill")};
  const int64_t b = kv.size(1);
  s.hs = kv.size(2), s.records = kv.size(3), s.d = kv.size(4);
  s.group = query.size(1) / s.hs;
  s.r = window.size(2), s.start = start, s.scan = scan;
  s.pages = low.has_value();
  s.pages_cap = s.pages ? low->size(2) : 0;
  s.agg_max = agg_max, s.scale = static_cast<float>(scale);
  TORCH_CHECK(start >= 0 && start + s.r <= keys.size(2), "cold_refill: the window lies outside the layer's slots");
  for (const at::Tensor* t : {&query, &kv, &store_pos, &store_sc, &count, &window}) {
    TORCH_CHECK(t->is_contiguous(), "cold_refill: the query, the store and the window must be contiguous");
  }
  at::Tensor lo = s.pages ? low->contiguous() : at::Tensor();
  at::Tensor hi = s.pages ? high->contiguous() : at::Tensor();
  at::Tensor new_w = at::empty_like(window);
  at::Tensor filled = at::empty(window.sizes(), window.options().dtype(at::kBool));
  at::Tensor score_out = at::empty(window.sizes(), store_sc.options());
  at::Tensor held = at::empty_like(window);
  std::vector<int64_t> tally(2 * b * s.hs, 0);  // per row: keys read, slots filled
  const bool wide = positions.scalar_type() == at::kLong;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv.scalar_type(), "h2o_cold_refill", [&] {
    if (wide) {
      h2o_cold::refill<scalar_t, int64_t>(s, b * s.hs, query, kv, store_pos, store_sc, count, lo, hi, window, keys,
                                          values, scores, positions, new_w, filled, score_out, held, tally);
    } else {
      h2o_cold::refill<scalar_t, int32_t>(s, b * s.hs, query, kv, store_pos, store_sc, count, lo, hi, window, keys,
                                          values, scores, positions, new_w, filled, score_out, held, tally);
    }
  });
  int64_t keys_read = 0, entries = 0;
  for (int64_t row = 0; row < b * s.hs; ++row) keys_read += tally[2 * row], entries += tally[2 * row + 1];
  at::Tensor totals = at::empty({2}, count.options());
  totals.data_ptr<int64_t>()[0] = keys_read;
  totals.data_ptr<int64_t>()[1] = entries;
  return {new_w, filled, score_out, held, totals};
}

// One decode step's victims appended to a layer's store (its tensors as cold_refill's, with room
// for one more record per row): slot, evicts (b, Hs) from the step, its candidate set's scores
// (b, Hs, C) float32 and positions (int32/int64), the overwritten key and value and the step's
// new ones (b, Hs, d), contiguous; `width` the layer's slots (a slot at or past it: the new token
// left). Returns the number of records written.
int64_t cold_append(at::Tensor kv, at::Tensor store_pos, at::Tensor store_sc, at::Tensor count,
                    c10::optional<at::Tensor> low, c10::optional<at::Tensor> high, at::Tensor slot, at::Tensor evicts,
                    at::Tensor cand_s, at::Tensor cand_p, at::Tensor old_k, at::Tensor old_v, at::Tensor new_k,
                    at::Tensor new_v, int64_t width) {
  const int64_t rows = kv.size(1) * kv.size(2), records = kv.size(3), d = kv.size(4);
  for (const at::Tensor* t : {&kv, &store_pos, &store_sc, &count, &slot, &evicts, &cand_s, &cand_p, &old_k, &old_v,
                              &new_k, &new_v}) {
    TORCH_CHECK(t->is_contiguous(), "cold_append: every tensor must be contiguous");
  }
  at::Tensor lo = low.has_value() ? low->contiguous() : at::Tensor();
  at::Tensor hi = high.has_value() ? high->contiguous() : at::Tensor();
  TORCH_CHECK(!lo.defined() || (lo.data_ptr() == low->data_ptr() && hi.data_ptr() == high->data_ptr()),
              "cold_append: the page summaries must be contiguous (they are updated in place)");
  const int64_t pages_cap = lo.defined() ? lo.size(2) : 0;
  int64_t added = 0;
  const bool wide = cand_p.scalar_type() == at::kLong;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv.scalar_type(), "h2o_cold_append", [&] {
    if (wide) {
      added = h2o_cold::append<scalar_t, int64_t>(rows, records, pages_cap, d, width, kv, store_pos, store_sc, count,
                                                  lo, hi, slot, evicts, cand_s, cand_p, old_k, old_v, new_k, new_v);
    } else {
      added = h2o_cold::append<scalar_t, int32_t>(rows, records, pages_cap, d, width, kv, store_pos, store_sc, count,
                                                  lo, hi, slot, evicts, cand_s, cand_p, old_k, old_v, new_k, new_v);
    }
  });
  return added;
}
