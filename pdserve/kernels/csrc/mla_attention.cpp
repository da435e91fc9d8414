// Latent attention (MLA) decode in the absorbed form, reading the latent pages in place.
//
// Each query row b is one token of H heads with a query of Dk dims (the key up-projection already
// folded into its first Dk - r dims); the cache holds one latent row of Dk values per token (no
// head axis): [num_pages, page_size, Dk]. A token's key is its whole row, its value the row's
// first Dv values (DeepSeek-V3: Dk 576, Dv 512). Row b attends to positions [0, lens[b]) of its
// page table (or, with `positions`, to the lens[b] positions listed for it: sparse attention);
// out[b, h] = softmax(scale * q[b, h] . K) V, Dv values per head.
//
// A task is (row, 16 heads): the 16 heads' queries are held transposed, so a score is 16 lanes
// of partial sums over the key's dims, each in dim order; values are added in key order. Blocks of
// 16 keys at fixed positions feed an online softmax. The loops are plain C++ written to vectorise
// across heads (scores) and dims (values), compiled three times (scalar, AVX2, AVX-512 on x86-64;
// NEON is the baseline on aarch64) with contraction off, so every tier computes the same IEEE
// operations in the same order: the bits do not depend on the tier, on the other rows of a call,
// or on whether a row is a decode step or a token of a prefill (deterministic mode runs every
// row here).
#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace pds {
namespace {

constexpr int kHeads = 16;  // query heads per task
constexpr int kBlock = 16;  // keys per softmax block
constexpr int64_t kMaxDim = 1024;

struct MlaArgs {
  const void* q;
  void* out;
  const void* cache;
  const int32_t* table;
  const int32_t* lens;
  const int32_t* positions;  // optional [rows, positions_stride]: the keys a row attends to (ascending), lens[b] of them
  int64_t q_stride_b, q_stride_h, out_stride_b, out_stride_h, table_stride, positions_stride;
  int64_t heads, page_size, dk, dv;
  float scale;
  bool q_bf16, cache_bf16;
};

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

template <typename T>
inline __attribute__((always_inline)) float at_f32(const T* p, int64_t i) {
  if constexpr (sizeof(T) == 2)
    return bf16_to_f32(p[i]);
  else
    return p[i];
}

template <typename QT, typename KT>
inline __attribute__((always_inline)) void mla_tasks(const MlaArgs& a, int64_t begin, int64_t end) {
  const int64_t Dk = a.dk, Dv = a.dv, groups = (a.heads + kHeads - 1) / kHeads;
  std::vector<float> qt(Dk * kHeads), acc(kHeads * Dv), keys(kBlock * Dk), s(kBlock * kHeads);  // kBlock % 4 == 0
  float m[kHeads], l[kHeads];
  const QT* q = static_cast<const QT*>(a.q);
  const KT* cache = static_cast<const KT*>(a.cache);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / groups, h0 = (task % groups) * kHeads;
    const int64_t H = std::min<int64_t>(kHeads, a.heads - h0), len = a.lens[b];
    const int32_t* pages = a.table + b * a.table_stride;
    for (int64_t g = 0; g < kHeads; ++g) {
      const QT* qr = q + b * a.q_stride_b + (h0 + g) * a.q_stride_h;
      for (int64_t d = 0; d < Dk; ++d) qt[d * kHeads + g] = g < H ? at_f32(qr, d) * a.scale : 0.f;
      m[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.f;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t pos = 0; pos < len; pos += kBlock) {
      const int n = int(std::min<int64_t>(kBlock, len - pos));
      for (int j = 0; j < n; ++j) {
        const int64_t p = a.positions ? a.positions[b * a.positions_stride + pos + j] : pos + j;
        const KT* row = cache + (int64_t(pages[p / a.page_size]) * a.page_size + p % a.page_size) * Dk;
        float* kr = keys.data() + j * Dk;
        for (int64_t d = 0; d < Dk; ++d) kr[d] = at_f32(row, d);
      }
      const int n4 = (n + 3) & ~3;  // scores four keys at a time (rows past n are zeros, unused)
      std::fill(keys.begin() + n * Dk, keys.begin() + n4 * Dk, 0.f);
      for (int j = 0; j < n4; j += 4) {
        float s0[kHeads] = {}, s1[kHeads] = {}, s2[kHeads] = {}, s3[kHeads] = {};
        const float *k0 = keys.data() + j * Dk, *k1 = k0 + Dk, *k2 = k1 + Dk, *k3 = k2 + Dk;
        for (int64_t d = 0; d < Dk; ++d) {  // 16 heads' partial sums, each in dim order
          const float* qd = qt.data() + d * kHeads;
          for (int g = 0; g < kHeads; ++g) {
            s0[g] += qd[g] * k0[d];
            s1[g] += qd[g] * k1[d];
            s2[g] += qd[g] * k2[d];
            s3[g] += qd[g] * k3[d];
          }
        }
        for (int g = 0; g < kHeads; ++g) {
          s[(j + 0) * kHeads + g] = s0[g];
          s[(j + 1) * kHeads + g] = s1[g];
          s[(j + 2) * kHeads + g] = s2[g];
          s[(j + 3) * kHeads + g] = s3[g];
        }
      }
      for (int64_t g = 0; g < H; ++g) {
        float mb = m[g];
        for (int j = 0; j < n; ++j) mb = std::max(mb, s[j * kHeads + g]);
        const float alpha = std::exp(m[g] - mb);
        float sum = 0.f;
        for (int j = 0; j < n; ++j) {
          const float e = std::exp(s[j * kHeads + g] - mb);
          s[j * kHeads + g] = e;
          sum += e;
        }
        l[g] = l[g] * alpha + sum;
        m[g] = mb;
        float* o = acc.data() + g * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] *= alpha;
      }
      for (int64_t g = 0; g < H; ++g) {  // values: the first Dv dims of each key, in key order
        float* o = acc.data() + g * Dv;
        int64_t d0 = 0;
        for (; d0 + 16 <= Dv; d0 += 16) {  // 16 dims at a time held across the block's keys
          float t[16];
          for (int i = 0; i < 16; ++i) t[i] = o[d0 + i];
          for (int j = 0; j < n; ++j) {
            const float pj = s[j * kHeads + g];
            const float* vr = keys.data() + j * Dk + d0;
            for (int i = 0; i < 16; ++i) t[i] += pj * vr[i];
          }
          for (int i = 0; i < 16; ++i) o[d0 + i] = t[i];
        }
        for (; d0 < Dv; ++d0)
          for (int j = 0; j < n; ++j) o[d0] += s[j * kHeads + g] * keys[j * Dk + d0];
      }
    }
    for (int64_t g = 0; g < H; ++g) {
      const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
      const float* o = acc.data() + g * Dv;
      const int64_t off = b * a.out_stride_b + (h0 + g) * a.out_stride_h;
      for (int64_t d = 0; d < Dv; ++d) {
        if constexpr (sizeof(QT) == 2)
          static_cast<uint16_t*>(a.out)[off + d] = f32_to_bf16(o[d] * inv);
        else
          static_cast<float*>(a.out)[off + d] = o[d] * inv;
      }
    }
  }
}

template <typename QT, typename KT>
void mla_scalar(const MlaArgs& a, int64_t begin, int64_t end) {
  mla_tasks<QT, KT>(a, begin, end);
}

#if PDS_X86
template <typename QT, typename KT>
PDS_AVX2 void mla_avx2(const MlaArgs& a, int64_t begin, int64_t end) {
  mla_tasks<QT, KT>(a, begin, end);
}

template <typename QT, typename KT>
PDS_AVX512 void mla_avx512(const MlaArgs& a, int64_t begin, int64_t end) {
  mla_tasks<QT, KT>(a, begin, end);
}
#endif

template <typename QT, typename KT>
void mla_run(const MlaArgs& a, int64_t begin, int64_t end) {
#if PDS_X86
  if (use_avx512()) return mla_avx512<QT, KT>(a, begin, end);
  if (use_avx2()) return mla_avx2<QT, KT>(a, begin, end);
#endif
  mla_scalar<QT, KT>(a, begin, end);
}

// ---- the lightning indexer (DeepSeek-V3.2): which keys each query attends to --------------------
struct IndexArgs {
  const float* q;        // [rows, heads, dim], scaled by the caller as it likes
  const float* weights;  // [rows, heads]
  const void* cache;     // [pages, page_size, dim] index keys
  const int32_t* table;
  const int32_t* lens;
  int32_t* out;     // [rows, topk]: selected positions, ascending
  int32_t* count;   // [rows]: how many (min(topk, len))
  int64_t table_stride, heads, dim, page_size, topk;
  float scale;
};

// score(t) = sum over heads h, in order, of weights[h] * relu(scale * (q[h] . k[t])), each dot in
// dim order (16 heads' partial sums at a time, across the heads); the topk highest scores, the
// lowest position first among equal ones (exact zeros from the ReLU tie often); then ascending.
template <typename KT>
inline __attribute__((always_inline)) void index_rows(const IndexArgs& a, int64_t begin, int64_t end) {
  const int64_t Hp = (a.heads + kHeads - 1) / kHeads * kHeads, D = a.dim;
  std::vector<float> qt(D * Hp), dots(Hp), kr(D), score;
  std::vector<int32_t> order;
  const KT* cache = static_cast<const KT*>(a.cache);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t len = a.lens[b];
    const float* q = a.q + b * a.heads * D;
    for (int64_t d = 0; d < D; ++d)
      for (int64_t h = 0; h < Hp; ++h) qt[d * Hp + h] = h < a.heads ? q[h * D + d] : 0.f;
    score.resize(len);
    const int32_t* pages = a.table + b * a.table_stride;
    for (int64_t t = 0; t < len; ++t) {
      const KT* row = cache + (int64_t(pages[t / a.page_size]) * a.page_size + t % a.page_size) * D;
      for (int64_t d = 0; d < D; ++d) kr[d] = at_f32(row, d);
      for (int64_t h = 0; h < Hp; ++h) dots[h] = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float kd = kr[d];
        const float* qd = qt.data() + d * Hp;
        for (int64_t h = 0; h < Hp; ++h) dots[h] += qd[h] * kd;
      }
      float s = 0.f;
      for (int64_t h = 0; h < a.heads; ++h) s += a.weights[b * a.heads + h] * std::max(dots[h] * a.scale, 0.f);
      score[t] = s;
    }
    const int64_t k = std::min<int64_t>(a.topk, len);
    order.resize(len);
    for (int64_t t = 0; t < len; ++t) order[t] = int32_t(t);
    auto better = [&](int32_t x, int32_t y) { return score[x] > score[y] || (score[x] == score[y] && x < y); };
    if (k < len) std::nth_element(order.begin(), order.begin() + k, order.end(), better);
    std::sort(order.begin(), order.begin() + k);
    std::copy(order.begin(), order.begin() + k, a.out + b * a.topk);
    a.count[b] = int32_t(k);
  }
}

template <typename KT>
void index_scalar(const IndexArgs& a, int64_t begin, int64_t end) { index_rows<KT>(a, begin, end); }
#if PDS_X86
template <typename KT>
PDS_AVX2 void index_avx2(const IndexArgs& a, int64_t begin, int64_t end) { index_rows<KT>(a, begin, end); }
template <typename KT>
PDS_AVX512 void index_avx512(const IndexArgs& a, int64_t begin, int64_t end) { index_rows<KT>(a, begin, end); }
#endif

template <typename KT>
void index_run(const IndexArgs& a, int64_t begin, int64_t end) {
#if PDS_X86
  if (use_avx512()) return index_avx512<KT>(a, begin, end);
  if (use_avx2()) return index_avx2<KT>(a, begin, end);
#endif
  index_scalar<KT>(a, begin, end);
}

}  // namespace

void indexer_topk(at::Tensor out, at::Tensor count, const at::Tensor& q, const at::Tensor& weights,
                  const at::Tensor& cache, const at::Tensor& page_table, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "indexer_topk: q must be a contiguous float32 [rows, heads, dim]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2 &&
                  weights.size(0) == B && weights.size(1) == H,
              "indexer_topk: weights must be a contiguous float32 [rows, heads]");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && float_or_bf16(cache) && cache.size(2) == D,
              "indexer_topk: the cache must be a contiguous float32 or bfloat16 [pages, page_size, dim]");
  TORCH_CHECK(out.scalar_type() == at::kInt && out.dim() == 2 && out.size(0) == B && out.is_contiguous() &&
                  count.scalar_type() == at::kInt && count.dim() == 1 && count.size(0) == B,
              "indexer_topk: out must be int32 [rows, topk] and count int32 [rows]");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  page_table.dim() == 2 && page_table.size(0) == B && page_table.stride(1) == 1 &&
                  seq_lens.size(0) == B && seq_lens.is_contiguous(),
              "indexer_topk: page_table and seq_lens must be int32, [rows, pages] and [rows]");
  TORCH_CHECK(D <= kMaxDim, "indexer_topk: dim ", D, " > ", kMaxDim);
  if (B == 0) return;
  IndexArgs a{q.data_ptr<float>(), weights.data_ptr<float>(), cache.data_ptr(), page_table.data_ptr<int32_t>(),
              seq_lens.data_ptr<int32_t>(), out.data_ptr<int32_t>(), count.data_ptr<int32_t>(),
              page_table.stride(0), H, D, cache.size(1), out.size(1), float(scale)};
  const bool bf16 = cache.scalar_type() == at::kBFloat16;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    bf16 ? index_run<uint16_t>(a, begin, end) : index_run<float>(a, begin, end);
  });
}

void mla_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& cache, const at::Tensor& page_table,
                          const at::Tensor& seq_lens, double scale, int64_t v_dim,
                          const c10::optional<at::Tensor>& positions) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3, "mla_decode_attention: q and out must be [rows, heads, dims]");
  TORCH_CHECK(float_or_bf16(q) && out.scalar_type() == q.scalar_type(),
              "mla_decode_attention: q and out must both be float32 or both bfloat16");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "mla_decode_attention: the last dim must be contiguous");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && float_or_bf16(cache),
              "mla_decode_attention: the cache must be a contiguous float32 or bfloat16 [pages, page_size, dims]");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  page_table.dim() == 2 && page_table.stride(1) == 1 && seq_lens.is_contiguous(),
              "mla_decode_attention: page_table and seq_lens must be int32, [rows, pages] and [rows]");
  const int64_t B = q.size(0), H = q.size(1), Dk = q.size(2);
  TORCH_CHECK(cache.size(2) == Dk, "mla_decode_attention: q has ", Dk, " dims, the cache's rows ", cache.size(2));
  TORCH_CHECK(Dk <= kMaxDim && v_dim >= 1 && v_dim <= Dk, "mla_decode_attention: need 1 <= v_dim (", v_dim,
              ") <= dims (", Dk, ") <= ", kMaxDim);
  TORCH_CHECK(out.size(0) == B && out.size(1) == H && out.size(2) == v_dim, "mla_decode_attention: out must be [",
              B, ", ", H, ", ", v_dim, "]");
  TORCH_CHECK(page_table.size(0) == B && seq_lens.size(0) == B, "mla_decode_attention: batch sizes differ");
  const int32_t* pos = nullptr;
  if (positions.has_value()) {  // sparse attention: each row's selected keys
    const at::Tensor& p = *positions;
    TORCH_CHECK(p.scalar_type() == at::kInt && p.dim() == 2 && p.size(0) == B && p.stride(1) == 1,
                "mla_decode_attention: positions must be int32 [rows, k]");
    TORCH_CHECK(B == 0 || seq_lens.max().item<int32_t>() <= p.size(1),
                "mla_decode_attention: with positions, seq_lens counts each row's positions (at most ", p.size(1), ")");
    pos = p.data_ptr<int32_t>();
  }
  if (B == 0) return;
  MlaArgs a{q.data_ptr(), out.data_ptr(), cache.data_ptr(), page_table.data_ptr<int32_t>(),
            seq_lens.data_ptr<int32_t>(), pos, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            page_table.stride(0), pos ? positions->stride(0) : 0, H, cache.size(1), Dk, v_dim, float(scale),
            q.scalar_type() == at::kBFloat16, cache.scalar_type() == at::kBFloat16};
  const int64_t tasks = B * ((H + kHeads - 1) / kHeads);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    if (a.q_bf16)
      a.cache_bf16 ? mla_run<uint16_t, uint16_t>(a, begin, end) : mla_run<uint16_t, float>(a, begin, end);
    else
      a.cache_bf16 ? mla_run<float, uint16_t>(a, begin, end) : mla_run<float, float>(a, begin, end);
  });
}

}  // namespace pds
