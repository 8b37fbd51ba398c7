// The inner loops of paged decode attention over a float cache (fp32, fp16, bf16 rows) with AVX-512, for
// head_dim a multiple of 64: half the instructions of the AVX2 loops, which is what bounds them. Scores take 16
// keys of one query head at a time and reduce their 16 partial-sum vectors together; values take a V row once
// for up to four query heads of its KV head. Like quant_matmul_avx512.cpp, only this file's code below the target
// pragma uses AVX-512, and paged_attention.cpp calls it where the CPU has it.
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

// Lane j of the result is the sum of v[j]'s lanes.
inline __m512 reduce16(__m512 v[16]) {
    __m512 pairs[8], quads[4];
    for (int m = 0; m < 8; ++m)  // 128-bit lanes 0-1 hold key 2m's partial sums, 2-3 key 2m + 1's
        pairs[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0x44), _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0xEE));
    for (int m = 0; m < 4; ++m)  // 128-bit lane l holds key 4m + l's
        quads[m] = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[2 * m], pairs[2 * m + 1], 0x88),
                                 _mm512_shuffle_f32x4(pairs[2 * m], pairs[2 * m + 1], 0xDD));
    const __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(quads[0], quads[1]), _mm512_unpackhi_ps(quads[0], quads[1]));
    const __m512 w = _mm512_add_ps(_mm512_unpacklo_ps(quads[2], quads[3]), _mm512_unpackhi_ps(quads[2], quads[3]));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(u, w, 0x44), _mm512_shuffle_ps(u, w, 0xEE));  // lane 4l + m: key 4m + l
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

template <int Format>
void scores(const float* q, const void* k, const int64_t* rows, int64_t n, int64_t D, float scale, float* out) {
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
            const __m512 qi = _mm512_loadu_ps(q + i);
            for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qi, load16<Format>(k, rows[t + j] + i), acc[j]);
        }
        _mm512_storeu_ps(out + t, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
    }
    for (; t < n; ++t) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16<Format>(k, rows[t] + i), acc);
        out[t] = _mm512_reduce_add_ps(acc) * scale;
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
    for (int64_t h = 0; h < heads; ++h) {
        if (format == 0) scores<0>(q + h * D, k, rows, n, D, scale, out + h * out_stride);
        else if (format == 1) scores<1>(q + h * D, k, rows, n, D, scale, out + h * out_stride);
        else scores<2>(q + h * D, k, rows, n, D, scale, out + h * out_stride);
    }
}

void values_avx512(int format, const float* p, int64_t p_stride, int64_t heads, const void* v, const int64_t* rows, int64_t n, int64_t D,
                   float* out, int64_t out_stride) {
    if (format == 0) values_heads<0>(p, p_stride, heads, v, rows, n, D, out, out_stride);
    else if (format == 1) values_heads<1>(p, p_stride, heads, v, rows, n, D, out, out_stride);
    else values_heads<2>(p, p_stride, heads, v, rows, n, D, out, out_stride);
}

}  // namespace kva

#pragma GCC pop_options
