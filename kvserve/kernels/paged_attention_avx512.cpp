// The inner loops of paged decode attention over a float cache (fp32, fp16, bf16 rows) with AVX-512, for
// head_dim a multiple of 64: half the instructions of the AVX2 loops, which is what bounds them. Scores take a K
// row once for up to three query heads of its KV head, eight keys at a time, and reduce each head's eight
// partial-sum vectors together; values take a V row once for up to four query heads of its KV head. Like
// quant_matmul_avx512.cpp, only this file's code below the target pragma uses AVX-512, and paged_attention.cpp
// calls it where the CPU has it.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")

namespace {

template <int Format>
inline __m512 load16(const void* base, int64_t at) {
    if constexpr (Format == 0) return _mm512_loadu_ps(static_cast<const float*>(base) + at);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + at));
    if constexpr (Format == 1) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Lane j of the result is the sum of v[j]'s lanes, for each the same tree: (v[e] + v[8 + e]) + (v[4 + e] + v[12 + e])
// for e < 4, then (e0 + e2) + (e1 + e3), as _mm512_reduce_add_ps sums a single key's (the tail's, below).
inline __m256 reduce8(__m512 v[8]) {
    __m512 pairs[4], quads[2];
    for (int m = 0; m < 4; ++m)
        pairs[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0x44), _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0xEE));
    for (int m = 0; m < 2; ++m)
        quads[m] = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[2 * m], pairs[2 * m + 1], 0x88),
                                 _mm512_shuffle_f32x4(pairs[2 * m], pairs[2 * m + 1], 0xDD));
    const __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(quads[0], quads[1]), _mm512_unpackhi_ps(quads[0], quads[1]));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(u, u, 0x44), _mm512_shuffle_ps(u, u, 0xEE));  // lane 4l + m: key 4m + l
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums));
}

// out[h][t] = scale * q[h] . K[t] for the G query heads of one KV head (q: G rows of D), eight keys at a time: each K
// row is loaded and widened once for all G (3 heads x 8 keys: 24 accumulators of the 32 registers). The last keys
// take a reduction each, in the same order: a key's score does not depend on the run it falls in.
template <int Format, int G>
void heads_scores(const float* q, const void* k, const int64_t* rows, int64_t n, int64_t D, float scale, float* out, int64_t stride) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        __m512 acc[G][8];
        for (int h = 0; h < G; ++h)
            for (int j = 0; j < 8; ++j) acc[h][j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16)
            for (int j = 0; j < 8; ++j) {
                const __m512 kj = load16<Format>(k, rows[t + j] + i);
                for (int h = 0; h < G; ++h) acc[h][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + i), kj, acc[h][j]);
            }
        for (int h = 0; h < G; ++h) _mm256_storeu_ps(out + h * stride + t, _mm256_mul_ps(reduce8(acc[h]), _mm256_set1_ps(scale)));
    }
    for (int h = 0; h < G; ++h)
        for (int64_t u = t; u < n; ++u) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + i), load16<Format>(k, rows[u] + i), acc);
            out[h * stride + u] = _mm512_reduce_add_ps(acc) * scale;
        }
}

// out[h] += sum_t p[h][t] V[t] for Heads heads, 64 columns at a time.
template <int Format, int Heads>
void values(const float* p, int64_t p_stride, const void* v, const int64_t* rows, int64_t n, int64_t D, float* out, int64_t out_stride) {
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
        __m512 acc[Heads][4];
        for (int h = 0; h < Heads; ++h)
            for (int r = 0; r < 4; ++r) acc[h][r] = _mm512_loadu_ps(out + h * out_stride + c0 + 16 * r);
        for (int64_t t = 0; t < n; ++t) {
            __m512 vt[4];
            for (int r = 0; r < 4; ++r) vt[r] = load16<Format>(v, rows[t] + c0 + 16 * r);
            for (int h = 0; h < Heads; ++h) {
                const __m512 ph = _mm512_set1_ps(p[h * p_stride + t]);
                for (int r = 0; r < 4; ++r) acc[h][r] = _mm512_fmadd_ps(ph, vt[r], acc[h][r]);
            }
        }
        for (int h = 0; h < Heads; ++h)
            for (int r = 0; r < 4; ++r) _mm512_storeu_ps(out + h * out_stride + c0 + 16 * r, acc[h][r]);
    }
}

template <int G>
void heads_scores(int format, const float* q, const void* k, const int64_t* rows, int64_t n, int64_t D, float scale, float* out,
                  int64_t stride) {
    if (format == 0) heads_scores<0, G>(q, k, rows, n, D, scale, out, stride);
    else if (format == 1) heads_scores<1, G>(q, k, rows, n, D, scale, out, stride);
    else heads_scores<2, G>(q, k, rows, n, D, scale, out, stride);
}

template <int Format>
void values_heads(const float* p, int64_t p_stride, int64_t heads, const void* v, const int64_t* rows, int64_t n, int64_t D, float* out,
                  int64_t out_stride) {
    for (int64_t h = 0; h < heads; h += 4) {
        const float* ph = p + h * p_stride;
        float* oh = out + h * out_stride;
        switch (std::min<int64_t>(4, heads - h)) {
            case 1: values<Format, 1>(ph, p_stride, v, rows, n, D, oh, out_stride); break;
            case 2: values<Format, 2>(ph, p_stride, v, rows, n, D, oh, out_stride); break;
            case 3: values<Format, 3>(ph, p_stride, v, rows, n, D, oh, out_stride); break;
            default: values<Format, 4>(ph, p_stride, v, rows, n, D, oh, out_stride);
        }
    }
}

}  // namespace

namespace kva {

void scores_avx512(int format, const float* q, int64_t heads, const void* k, const int64_t* rows, int64_t n, int64_t D, float scale,
                   float* out, int64_t out_stride) {
    if (heads == 3) heads_scores<3>(format, q, k, rows, n, D, scale, out, out_stride);
    else if (heads == 2) heads_scores<2>(format, q, k, rows, n, D, scale, out, out_stride);
    else heads_scores<1>(format, q, k, rows, n, D, scale, out, out_stride);
}

void values_avx512(int format, const float* p, int64_t p_stride, int64_t heads, const void* v, const int64_t* rows, int64_t n, int64_t D,
                   float* out, int64_t out_stride) {
    if (format == 0) values_heads<0>(p, p_stride, heads, v, rows, n, D, out, out_stride);
    else if (format == 1) values_heads<1>(p, p_stride, heads, v, rows, n, D, out, out_stride);
    else values_heads<2>(p, p_stride, heads, v, rows, n, D, out, out_stride);
}

}  // namespace kva

#pragma GCC pop_options
