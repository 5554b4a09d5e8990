// The fused H2O decode step on CPU (DESIGN.md §2.8): attention, score update, victim choice and
// slot write for one layer in one call, each (request, KV set) a loop of its own.
//
// It is the contract of h2o_lens.ops.decode_step for the policies the fused Triton step takes (an
// accumulating or unscored one), with what the torch step also gives when asked (the candidate
// set, the softmax weights, the overwritten key and value) and pinned positions: FP32
// logits, weights and scores for every storage dtype; empty slots (position -1) are never attended,
// slots past a row's capacity never chosen; the lowest eligible score leaves, a tie evicts the
// older position, then the lower slot; with no recent window the new token competes (slot B).
// Every sum runs in slot order within its row, so a row's result depends on nothing but its own
// slots: a request decoded in a batch equals itself alone, bit for bit (DESIGN.md §2.7).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using h2o_cpu::dot;  // cpu_common.cpp

template <typename T>
inline void axpy(float* out, float a, const T* v, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] += a * static_cast<float>(v[i]);
}

struct Shape : h2o_cpu::SlotStrides {
  int64_t b, hs, cap, d, group;
};

template <typename T, typename P>
void step_row(
    int64_t row, const Shape& s, const T* query, const T* key, const T* value, T* keys, T* values,
    float* scores, P* positions, const int64_t* step, const int64_t* fill, const int64_t* table,
    float scale, int64_t recent_all, int64_t sink_all, bool scored, bool agg_max, T* out,
    int64_t* slot_out, bool* evict_out, float* cand_s, P* cand_p, const int64_t* pins, int64_t n_pins,
    float* weights, T* old_k, T* old_v) {
  const int64_t bi = row / s.hs, h = row % s.hs, d = s.d, g_n = s.group, cap = s.cap;
  int64_t cap_r = cap, recent = recent_all, sink = sink_all;
  if (table != nullptr) {
    cap_r = table[row * 3];
    recent = table[row * 3 + 1];
    sink = table[row * 3 + 2];
  }
  // slots past a row's capacity are attended when they hold a position (an extension's, such as a
  // recall window) and never chosen; past the last slot that holds one, nothing weighs anything
  P* pos = positions + bi * s.ps0 + h * s.ps1;
  int64_t width = cap;
  while (width > 0 && pos[width - 1] < 0) --width;
  const int64_t choosable = std::min(cap, cap_r);
  const T* kbase = keys + bi * s.ks0 + h * s.ks1;
  const T* vbase = values + bi * s.vs0 + h * s.vs1;
  float* sc = scores + bi * s.ss0 + h * s.ss1;
  const T* kn = key + row * d;
  const T* vn = value + row * d;
  const int64_t now = step[bi];
  const float neg_inf = -std::numeric_limits<float>::infinity();

  std::vector<float> q(g_n * d), acc(g_n * d), p(g_n * width), m(g_n), l(g_n), p_new(g_n);
  for (int64_t g = 0; g < g_n; ++g) {
    const T* qg = query + (bi * s.hs * g_n + h * g_n + g) * d;
    for (int64_t i = 0; i < d; ++i) q[g * d + i] = static_cast<float>(qg[i]);
  }
  // logits: the new token's seeds the running maximum (it is never masked)
  for (int64_t g = 0; g < g_n; ++g) m[g] = p_new[g] = dot(&q[g * d], kn, d) * scale;
  for (int64_t j = 0; j < width; ++j) {
    const bool live = pos[j] >= 0;
    for (int64_t g = 0; g < g_n; ++g) {
      const float x = live ? dot(&q[g * d], kbase + j * s.ks2, d) * scale : neg_inf;
      p[g * width + j] = x;
      if (x > m[g]) m[g] = x;
    }
  }
  // softmax over the slots and the new token; the output from the unnormalised weights
  for (int64_t g = 0; g < g_n; ++g) {
    p_new[g] = std::exp(p_new[g] - m[g]);
    float total = p_new[g];
    float* pg = &p[g * width];
    for (int64_t j = 0; j < width; ++j) {
      pg[j] = std::exp(pg[j] - m[g]);
      total += pg[j];
    }
    l[g] = total;
    for (int64_t i = 0; i < d; ++i) acc[g * d + i] = p_new[g] * static_cast<float>(vn[i]);
  }
  for (int64_t j = 0; j < width; ++j) {
    if (pos[j] < 0) continue;  // weight 0: nothing to add
    const T* vj = vbase + j * s.vs2;
    for (int64_t g = 0; g < g_n; ++g) axpy(&acc[g * d], p[g * width + j], vj, d);
  }
  for (int64_t g = 0; g < g_n; ++g) {
    T* og = out + (bi * s.hs * g_n + h * g_n + g) * d;
    for (int64_t i = 0; i < d; ++i) og[i] = static_cast<T>(acc[g * d + i] / l[g]);
  }
  if (weights != nullptr) {  // (G, B + 1): the slots' weights, then the new token's
    for (int64_t g = 0; g < g_n; ++g) {
      float* wg = weights + (row * g_n + g) * (cap + 1);
      for (int64_t j = 0; j < cap; ++j) wg[j] = j < width ? p[g * width + j] / l[g] : 0.f;
      wg[cap] = p_new[g] / l[g];
    }
  }
  // the group's weights added to the scores (sum over the group in head order, or the largest)
  float new_score = 0.f;
  if (scored) {
    for (int64_t g = 0; g < g_n; ++g) {
      const float w = p_new[g] / l[g];
      new_score = g == 0 ? w : (agg_max ? std::max(new_score, w) : new_score + w);
    }
    for (int64_t j = 0; j < width; ++j) {
      float a = 0.f;
      for (int64_t g = 0; g < g_n; ++g) {
        const float w = p[g * width + j] / l[g];
        a = g == 0 ? w : (agg_max ? std::max(a, w) : a + w);
      }
      sc[j] += a;
    }
  }
  if (cand_s != nullptr) {  // the candidate set D after the score update, before the write
    float* cs = cand_s + row * (cap + 1);
    P* cp = cand_p + row * (cap + 1);
    for (int64_t j = 0; j < cap; ++j) cs[j] = sc[j], cp[j] = pos[j];
    cs[cap] = new_score;
    cp[cap] = static_cast<P>(now);
  }
  // the victim: the lowest eligible score, then the older position, then the lower slot
  const int64_t limit = now - recent;
  float best_s = std::numeric_limits<float>::infinity();
  int64_t best_p = std::numeric_limits<int64_t>::max(), best_j = -1;
  int64_t oldest_p = std::numeric_limits<int64_t>::max(), oldest_j = 0;  // nothing eligible
  for (int64_t j = 0; j < choosable; ++j) {
    const int64_t pj = pos[j];
    if (pj < oldest_p) oldest_p = pj, oldest_j = j;
    if (pj < 0 || pj > limit || pj < sink) continue;
    if (n_pins > 0 && std::binary_search(pins + bi * n_pins, pins + (bi + 1) * n_pins, pj)) continue;
    if (best_j < 0 || sc[j] < best_s || (sc[j] == best_s && pj < best_p)) best_s = sc[j], best_p = pj, best_j = j;
  }
  bool found = best_j >= 0;
  int64_t victim = found ? best_j : oldest_j;
  if (recent == 0 && now >= sink && now >= 0 && (!found || new_score < best_s)) {
    victim = cap;  // the new token is its own victim: nothing is written
    found = true;
  }
  int64_t slot = victim;
  bool evicts = found;
  if (fill != nullptr) {
    const bool full = fill[bi] >= cap_r;
    slot = full ? victim : fill[bi];
    evicts = full && found;
  }
  slot_out[row] = slot;
  evict_out[row] = evicts;
  if (old_k != nullptr) {  // what the write overwrites (slot B: the last slot's, meaningless)
    const int64_t at = std::min(slot, cap - 1);
    const T* kd = keys + bi * s.ks0 + h * s.ks1 + at * s.ks2;
    const T* vd = values + bi * s.vs0 + h * s.vs1 + at * s.vs2;
    for (int64_t i = 0; i < d; ++i) old_k[row * d + i] = kd[i], old_v[row * d + i] = vd[i];
  }
  if (slot < cap) {
    T* kd = keys + bi * s.ks0 + h * s.ks1 + slot * s.ks2;
    T* vd = values + bi * s.vs0 + h * s.vs1 + slot * s.vs2;
    for (int64_t i = 0; i < d; ++i) kd[i] = kn[i], vd[i] = vn[i];
    sc[slot] = new_score;
    pos[slot] = static_cast<P>(now);
  }
}

template <typename T, typename P>
void run(const Shape& s, at::Tensor& query, at::Tensor& key, at::Tensor& value, at::Tensor& keys,
         at::Tensor& values, at::Tensor& scores, at::Tensor& positions, at::Tensor& step,
         const at::Tensor& fill, const at::Tensor& table, double scale, int64_t recent, int64_t sink,
         bool scored, bool agg_max, at::Tensor& out, at::Tensor& slot, at::Tensor& evicts,
         const at::Tensor& cand_s, const at::Tensor& cand_p, const at::Tensor& pins, const at::Tensor& w,
         const at::Tensor& old_k, const at::Tensor& old_v) {
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  T* ks = keys.data_ptr<T>();
  T* vs = values.data_ptr<T>();
  float* sc = scores.data_ptr<float>();
  P* ps = positions.data_ptr<P>();
  const int64_t* st = step.data_ptr<int64_t>();
  const int64_t* fl = fill.defined() ? fill.data_ptr<int64_t>() : nullptr;
  const int64_t* tb = table.defined() ? table.data_ptr<int64_t>() : nullptr;
  T* op = out.data_ptr<T>();
  int64_t* so = slot.data_ptr<int64_t>();
  bool* eo = evicts.data_ptr<bool>();
  float* cs = cand_s.defined() ? cand_s.data_ptr<float>() : nullptr;
  P* cp = cand_p.defined() ? cand_p.data_ptr<P>() : nullptr;
  const int64_t* pn = pins.defined() ? pins.data_ptr<int64_t>() : nullptr;
  const int64_t n_pins = pins.defined() ? pins.size(1) : 0;
  float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  T* ok = old_k.defined() ? old_k.data_ptr<T>() : nullptr;
  T* ov = old_v.defined() ? old_v.data_ptr<T>() : nullptr;
  at::parallel_for(0, s.b * s.hs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      step_row<T, P>(row, s, qp, kp, vp, ks, vs, sc, ps, st, fl, tb, static_cast<float>(scale), recent, sink,
                     scored, agg_max, op, so, eo, cs, cp, pn, n_pins, wp, ok, ov);
    }
  });
}

}  // namespace

// query (b, Hq, d), key/value (b, Hs, d) contiguous; keys/values (b, Hs, B, d) with unit stride
// on d; scores (b, Hs, B) float32 and positions (b, Hs, B) int32/int64 with unit stride on B;
// step and fill (b,) int64 (fill undefined: every slot used); table (b, Hs, 3) int64 capacity,
// recent and sink per row and KV set, or undefined. Returns out (b, Hq, d), slot (b, Hs) int64
// (B: the new token evicted itself), evicts (b, Hs) bool, and what was asked (else None): with
// candidates, the candidate set D (b, Hs, B + 1), its scores after the update and its positions,
// the new token last; with weights, the softmax weights (b, Hs, G, B + 1); with journal, the key
// and value the write overwrote (b, Hs, d). pins (b, K) int64, each row sorted: positions never
// eligible. keys, values, scores and positions are updated in place.
std::vector<at::Tensor> decode_step(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor keys,
                                    at::Tensor values, at::Tensor scores, at::Tensor positions, at::Tensor step,
                                    c10::optional<at::Tensor> fill, c10::optional<at::Tensor> table, double scale,
                                    int64_t recent, int64_t sink, bool scored, bool agg_max, bool candidates,
                                    c10::optional<at::Tensor> pins, bool weights, bool journal) {
  Shape s{h2o_cpu::slot_strides(keys, values, scores, positions, "decode_step")};
  s.b = keys.size(0), s.hs = keys.size(1), s.cap = keys.size(2), s.d = keys.size(3);
  s.group = query.size(1) / s.hs;
  TORCH_CHECK(query.is_contiguous() && key.is_contiguous() && value.is_contiguous(), "query, key, value contiguous");
  at::Tensor out = at::empty_like(query);
  at::Tensor slot = at::empty({s.b, s.hs}, step.options().dtype(at::kLong));
  at::Tensor evicts = at::empty({s.b, s.hs}, step.options().dtype(at::kBool));
  at::Tensor fl = fill.has_value() ? fill->contiguous() : at::Tensor();
  at::Tensor tb = table.has_value() ? table->contiguous() : at::Tensor();
  at::Tensor cand_s, cand_p, w, old_k, old_v;
  if (candidates) {
    cand_s = at::empty({s.b, s.hs, s.cap + 1}, scores.options());
    cand_p = at::empty({s.b, s.hs, s.cap + 1}, positions.options());
  }
  if (weights) w = at::empty({s.b, s.hs, s.group, s.cap + 1}, scores.options());
  if (journal) {
    old_k = at::empty({s.b, s.hs, s.d}, keys.options());
    old_v = at::empty({s.b, s.hs, s.d}, values.options());
  }
  at::Tensor pn = pins.has_value() ? pins->contiguous() : at::Tensor();
  const bool wide = positions.scalar_type() == at::kLong;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, keys.scalar_type(), "h2o_decode_step_cpu", [&] {
    if (wide) {
      run<scalar_t, int64_t>(s, query, key, value, keys, values, scores, positions, step, fl, tb, scale, recent, sink,
                             scored, agg_max, out, slot, evicts, cand_s, cand_p, pn, w, old_k, old_v);
    } else {
      run<scalar_t, int32_t>(s, query, key, value, keys, values, scores, positions, step, fl, tb, scale, recent, sink,
                             scored, agg_max, out, slot, evicts, cand_s, cand_p, pn, w, old_k, old_v);
    }
  });
  return {out, slot, evicts, cand_s, cand_p, w, old_k, old_v};
}
