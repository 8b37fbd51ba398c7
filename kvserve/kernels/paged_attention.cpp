// Decode attention straight from the paged KV cache: each sequence's one query attends to its first
// context_len positions, reading K/V in place through its block table, with no gathered copy and no
// padding to the longest sequence. One task per (sequence, KV head) covers that head's query group.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// A vector whose lanes sum to a . b.
inline __m256 dot_lanes(const float* a, const float* b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float tail = 0.0f;
    for (; i < n; ++i) tail += a[i] * b[i];
    return _mm256_add_ps(acc, _mm256_setr_ps(tail, 0, 0, 0, 0, 0, 0, 0));
}

// The lane sums of eight vectors, as one vector: one reduction per eight dot products, not eight.
inline __m256 hsum8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// scores[t] = scale * q . K[t] for the L keys at offsets rows[t].
void query_scores(const float* q, const float* k, const int64_t* rows, int64_t L, int64_t D, float scale, float* scores) {
    int64_t t = 0;
    for (; t + 8 <= L; t += 8) {
        __m256 partial[8];
        for (int j = 0; j < 8; ++j) partial[j] = dot_lanes(q, k + rows[t + j], D);
        _mm256_storeu_ps(scores + t, _mm256_mul_ps(hsum8(partial), _mm256_set1_ps(scale)));
    }
    for (; t < L; ++t) scores[t] = hsum(dot_lanes(q, k + rows[t], D)) * scale;
}

// out = sum_t p[t] * V[t], accumulated in registers 64 columns at a time.
void weighted_values(const float* p, const float* v, const int64_t* rows, int64_t L, int64_t D, float* out) {
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
        const int64_t vecs = std::min<int64_t>(64, D - c0) / 8, tail_end = std::min<int64_t>(64, D - c0);
        __m256 acc[8];
        float tail[8] = {};
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t t = 0; t < L; ++t) {
            const float* vt = v + rows[t] + c0;
            const __m256 pt = _mm256_set1_ps(p[t]);
            for (int r = 0; r < vecs; ++r) acc[r] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * r), acc[r]);
            for (int64_t c = vecs * 8; c < tail_end; ++c) tail[c - vecs * 8] += p[t] * vt[c];
        }
        for (int r = 0; r < vecs; ++r) _mm256_storeu_ps(out + c0 + 8 * r, acc[r]);
        for (int64_t c = vecs * 8; c < tail_end; ++c) out[c0 + c] = tail[c - vecs * 8];
    }
}

// exp for x <= 0 (scores minus their max), Cephes-style: 2^n * p(r), relative error ~1e-7.
inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

// softmax over n scores, in place.
void softmax(float* s, int64_t n) {
    const float m = *std::max_element(s, s + n);
    __m256 total = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(m)));
        _mm256_storeu_ps(s + i, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = hsum(total);
    for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - m));
    const float inv = 1.0f / sum;
    for (i = 0; i < n; ++i) s[i] *= inv;
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [blocks, block_size, KVH, D]; block_tables [B, W]; context_lens [B].
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
    TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "bad q or cache shapes");
    TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
                "q and the KV cache must be fp32");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables and lengths");
    const at::Tensor q = q_in.contiguous(), tables = block_tables.contiguous(), lens = context_lens.contiguous();
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), bs = k_cache.size(1), KVH = k_cache.size(2);
    const int64_t W = tables.size(1), num_blocks = k_cache.size(0);
    TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && tables.size(0) == B && lens.size(0) == B, "shapes do not agree");
    const int64_t* tp = tables.data_ptr<int64_t>();
    const int64_t* lp = lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
        TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * bs, "context length ", lp[b], " does not fit ", W, " blocks");
        for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j)
            TORCH_CHECK(tp[b * W + j] >= 0 && tp[b * W + j] < num_blocks, "block id out of range");
    }
    at::Tensor out = at::empty_like(q);
    const float *qp = q.data_ptr<float>(), *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t G = H / KVH;
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        std::vector<int64_t> rows;
        for (int64_t item = begin; item < end; ++item) {
            const int64_t b = item / KVH, g = item % KVH, L = lp[b];
            rows.resize(L);  // where each position's K/V row for this head starts in the cache
            for (int64_t t = 0; t < L; ++t) rows[t] = ((tp[b * W + t / bs] * bs + t % bs) * KVH + g) * D;
            scores.resize(L);
            for (int64_t h = b * H + g * G; h < b * H + (g + 1) * G; ++h) {
                query_scores(qp + h * D, kp, rows.data(), L, D, float(scale), scores.data());
                softmax(scores.data(), L);
                weighted_values(scores.data(), vp, rows.data(), L, D, op + h * D);
            }
        }
    });
    return out;
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
    m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, float scale) -> Tensor",
          &paged_decode_attention);
}
