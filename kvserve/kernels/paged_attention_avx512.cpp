// The inner loops of paged decode attention with AVX-512, for head_dim a multiple of 64: half the instructions of
// the AVX2 loops, which is what bounds them. Scores take a K row once for up to three query heads of its KV head,
// eight keys at a time, and reduce each head's eight partial-sum vectors together; values take a V row once for up
// to four query heads of its KV head. Rows are read where they lie in any format: float rows widened in registers,
// quantized codes dequantized there as Store::dequant_row does into its buffer (the same values, so the same sums,
// without the buffer's round trip). Like quant_matmul_avx512.cpp, only this file's code below the target pragma
// uses AVX-512, and paged_attention.cpp calls it where the CPU has it.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "simd.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")

namespace {

// kvserve.kv.formats codes (paged_attention.cpp's Format)
enum { F32 = 0, F16 = 1, BF16 = 2, E4M3 = 3, E5M2 = 4, INT8 = 5, INT4 = 6, INT2_TOKEN = 7, INT2_CHANNEL = 8 };
constexpr int64_t GROUP = 32;  // values per scale along head_dim

// Values at .. at + 31 of a store, at = row + i (`row`: a row's first element, a multiple of D; i: a multiple of 32,
// one group of a quantized format), as two vectors of floats: base is the store's values, meta its fp16 scales
// (int8: one per group of GROUP values; int4, 2-bit per token: a scale and a minimum), channel the block and head's
// per-channel scales and minimums (2-bit per channel: D of each).
template <int Format>
inline void load32(const void* base, const uint16_t* meta, const float* channel, int64_t row, int64_t i, int64_t D, __m512& lo, __m512& hi) {
    const uint8_t* bytes = static_cast<const uint8_t*>(base);
    const int64_t at = row + i;
    if constexpr (Format == F32) {
        lo = _mm512_loadu_ps(static_cast<const float*>(base) + at), hi = _mm512_loadu_ps(static_cast<const float*>(base) + at + 16);
    } else if constexpr (Format == F16 || Format == BF16) {
        const uint16_t* p = static_cast<const uint16_t*>(base) + at;
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
        if constexpr (Format == F16) lo = _mm512_cvtph_ps(a), hi = _mm512_cvtph_ps(b);
        else {
            lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(a), 16));
            hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
        }
    } else if constexpr (Format == E4M3 || Format == E5M2) {
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + at));
        const auto widen = [](__m128i c) {
            const __m256i b = _mm256_cvtepu8_epi16(c);
            if constexpr (Format == E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));  // the top byte of an fp16
            // exponent and mantissa moved into an fp16's fields: the value / 2^8 (bias 7 against 15); 0x7F, 0xFF: NaN
            const __m256i magnitude = _mm256_set1_epi16(0x7F), m = _mm256_and_si256(b, magnitude);
            const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8), _mm256_slli_epi16(m, 7));
            const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
            return _mm512_mask_blend_ps(_mm256_cmpeq_epi16_mask(m, magnitude), v, _mm512_set1_ps(NAN));
        };
        lo = widen(_mm256_castsi256_si128(codes)), hi = widen(_mm256_extracti128_si256(codes, 1));
    } else if constexpr (Format == INT8) {
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + at));
        const __m512 scale = _mm512_set1_ps(_cvtsh_ss(meta[at / GROUP]));
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes))), scale);
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1))), scale);
    } else if constexpr (Format == INT2_TOKEN || Format == INT2_CHANNEL) {
        // a group's 32 codes in 8 bytes, byte j holding values j, j + 8, j + 16, j + 24 from its low bits up
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + at / 4));
        const __m512i twice = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(b, b)), three = _mm512_set1_epi32(3);
        const __m512i low = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
        const __m512 u0 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(twice, low), three));
        const __m512 u1 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(twice, _mm512_add_epi32(low, _mm512_set1_epi32(4))), three));
        if constexpr (Format == INT2_TOKEN) {
            const __m512 scale = _mm512_set1_ps(_cvtsh_ss(meta[at / GROUP * 2])), minimum = _mm512_set1_ps(_cvtsh_ss(meta[at / GROUP * 2 + 1]));
            lo = _mm512_fmadd_ps(u0, scale, minimum), hi = _mm512_fmadd_ps(u1, scale, minimum);
        } else {
            lo = _mm512_fmadd_ps(u0, _mm512_loadu_ps(channel + i), _mm512_loadu_ps(channel + D + i));
            hi = _mm512_fmadd_ps(u1, _mm512_loadu_ps(channel + i + 16), _mm512_loadu_ps(channel + D + i + 16));
        }
    } else {  // INT4: a group's 32 codes in 16 bytes, byte j holding value j (low nibble) and j + 16 (high nibble)
        const int64_t group = at / GROUP;
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + group * (GROUP / 2))), mask = _mm_set1_epi8(0x0F);
        const __m512 scale = _mm512_set1_ps(_cvtsh_ss(meta[2 * group])), minimum = _mm512_set1_ps(_cvtsh_ss(meta[2 * group + 1]));
        lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask))), scale, minimum);
        hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask))), scale, minimum);
    }
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
void heads_scores(const float* q, const void* k, const uint16_t* meta, const float* channel, const int64_t* rows, int64_t n, int64_t D,
                  float scale, float* out, int64_t stride, const char* ahead, const char* ahead_end) {
    Ahead next(ahead, ahead_end, n / 8 * 8 * (D / 32));
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        __m512 acc[G][8];
        for (int h = 0; h < G; ++h)
            for (int j = 0; j < 8; ++j) acc[h][j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 32)
            for (int j = 0; j < 8; ++j) {
                __m512 lo, hi;
                load32<Format>(k, meta, channel, rows[t + j], i, D, lo, hi);
                next.step();
                for (int h = 0; h < G; ++h) acc[h][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + i), lo, acc[h][j]);
                for (int h = 0; h < G; ++h) acc[h][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + i + 16), hi, acc[h][j]);
            }
        for (int h = 0; h < G; ++h) _mm256_storeu_ps(out + h * stride + t, _mm256_mul_ps(reduce8(acc[h]), _mm256_set1_ps(scale)));
    }
    for (int h = 0; h < G; ++h)
        for (int64_t u = t; u < n; ++u) {
            __m512 acc = _mm512_setzero_ps(), lo, hi;
            for (int64_t i = 0; i < D; i += 32) {
                load32<Format>(k, meta, channel, rows[u], i, D, lo, hi);
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + i + 16), hi, _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + i), lo, acc));
            }
            out[h * stride + u] = _mm512_reduce_add_ps(acc) * scale;
        }
}

// out[h] += sum_t p[h][t] V[t] for Heads heads, 64 columns at a time.
template <int Format, int Heads>
void values(const float* p, int64_t p_stride, const void* v, const uint16_t* meta, const float* channel, const int64_t* rows, int64_t n,
            int64_t D, float* out, int64_t out_stride, const char* ahead, const char* ahead_end) {
    Ahead next(ahead, ahead_end, n * (D / 64));
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
        __m512 acc[Heads][4];
        for (int h = 0; h < Heads; ++h)
            for (int r = 0; r < 4; ++r) acc[h][r] = _mm512_loadu_ps(out + h * out_stride + c0 + 16 * r);
        for (int64_t t = 0; t < n; ++t) {
            __m512 vt[4];
            load32<Format>(v, meta, channel, rows[t], c0, D, vt[0], vt[1]), load32<Format>(v, meta, channel, rows[t], c0 + 32, D, vt[2], vt[3]);
            next.step();
            for (int h = 0; h < Heads; ++h) {
                const __m512 ph = _mm512_set1_ps(p[h * p_stride + t]);
                for (int r = 0; r < 4; ++r) acc[h][r] = _mm512_fmadd_ps(ph, vt[r], acc[h][r]);
            }
        }
        for (int h = 0; h < Heads; ++h)
            for (int r = 0; r < 4; ++r) _mm512_storeu_ps(out + h * out_stride + c0 + 16 * r, acc[h][r]);
    }
}

// f(std::integral_constant<int, format>{}) for a format load32 reads.
template <typename F>
void with_format(int format, F&& f) {
    switch (format) {
        case F32: return f(std::integral_constant<int, F32>{});
        case F16: return f(std::integral_constant<int, F16>{});
        case BF16: return f(std::integral_constant<int, BF16>{});
        case E4M3: return f(std::integral_constant<int, E4M3>{});
        case E5M2: return f(std::integral_constant<int, E5M2>{});
        case INT8: return f(std::integral_constant<int, INT8>{});
        case INT4: return f(std::integral_constant<int, INT4>{});
        case INT2_TOKEN: return f(std::integral_constant<int, INT2_TOKEN>{});
        default: return f(std::integral_constant<int, INT2_CHANNEL>{});
    }
}

}  // namespace

namespace kva {

void scores_avx512(int format, const float* q, int64_t heads, const void* k, const uint16_t* meta, const float* channel, const int64_t* rows,
                   int64_t n, int64_t D, float scale, float* out, int64_t out_stride, const char* ahead, const char* ahead_end) {
    with_format(format, [&](auto f) {
        constexpr int F = decltype(f)::value;
        if (heads == 3) heads_scores<F, 3>(q, k, meta, channel, rows, n, D, scale, out, out_stride, ahead, ahead_end);
        else if (heads == 2) heads_scores<F, 2>(q, k, meta, channel, rows, n, D, scale, out, out_stride, ahead, ahead_end);
        else heads_scores<F, 1>(q, k, meta, channel, rows, n, D, scale, out, out_stride, ahead, ahead_end);
    });
}

void values_avx512(int format, const float* p, int64_t p_stride, int64_t heads, const void* v, const uint16_t* meta, const float* channel,
                   const int64_t* rows, int64_t n, int64_t D, float* out, int64_t out_stride, const char* ahead, const char* ahead_end) {
    with_format(format, [&](auto f) {
        constexpr int F = decltype(f)::value;
        for (int64_t h = 0; h < heads; h += 4) {
            const float* ph = p + h * p_stride;
            float* oh = out + h * out_stride;
            const char *a = h == 0 ? ahead : nullptr, *e = h == 0 ? ahead_end : nullptr;
            switch (std::min<int64_t>(4, heads - h)) {
                case 1: values<F, 1>(ph, p_stride, v, meta, channel, rows, n, D, oh, out_stride, a, e); break;
                case 2: values<F, 2>(ph, p_stride, v, meta, channel, rows, n, D, oh, out_stride, a, e); break;
                case 3: values<F, 3>(ph, p_stride, v, meta, channel, rows, n, D, oh, out_stride, a, e); break;
                default: values<F, 4>(ph, p_stride, v, meta, channel, rows, n, D, oh, out_stride, a, e);
            }
        }
    });
}

}  // namespace kva

#pragma GCC pop_options
