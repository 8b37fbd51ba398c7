// The int8-activation matmul with AVX-512 VNNI: a group of four units (128 weights) per step, two 512-bit
// integer dot products (vpdpbusd: unsigned codes x int8 activations, 4 products per int32 lane), one
// conversion and one FMA per activation row. Built in the same extension as the AVX2 code; only this file's
// functions below the target pragma use AVX-512, and quant_matmul.cpp calls them where the CPU has it.
// No ATen code is instantiated here, so nothing AVX-512 can leak into shared inline functions.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quants.h"

namespace kvq {

bool avx512_supported() {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace {

// A group's codes (low halves of its units, high halves), the scales of each int32 lane for both, and (K-quants)
// each lane's unit's min.
struct Group {
    __m512i lo, hi;
    __m512 s_lo, s_hi, min;
};

// Lane l of a group's dot products covers unit l / 4: spread four per-unit values over 16 lanes.
inline __m512 spread(__m128 v) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm512_castps128_ps512(v));
}

// The 16 bytes of each of n units (plain loads where all four are there: masked ones stall on some CPUs).
inline __m512i load_bytes(const uint8_t* p, int64_t n) {
    return n == 4 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ULL << (16 * n)) - 1, p);
}

// n fp16 values (of at most four), zeros after them.
inline __m128i load_halves(const uint8_t* p, int64_t n) {
    return n == 4 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi16(static_cast<__mmask8>((1 << n) - 1), p);
}

template <int TYPE>
inline Group load_group(const uint8_t* w, const Layout& L, int64_t g) {
    constexpr Info t = info(TYPE);
    Group G;
    const int64_t n = L.units - 4 * g < 4 ? L.units - 4 * g : 4;
    if constexpr (t.bits == 8) {
        const uint8_t* c = w + L.codes + 128 * g;
        G.lo = load_bytes(c, n), G.hi = load_bytes(c + 16 * n, n);
    } else {
        const __m512i c = load_bytes(w + L.codes + 64 * g, n), mask = _mm512_set1_epi8(0x0F);
        G.lo = _mm512_and_si512(c, mask), G.hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), mask);
    }
    if constexpr (t.bits == 5 || t.bits == 6) {
        const uint8_t* p = w + L.hi1 + 16 * g;
        G.lo = _mm512_mask_add_epi8(G.lo, _cvtu64_mask64(load64(p)), G.lo, _mm512_set1_epi8(16));
        G.hi = _mm512_mask_add_epi8(G.hi, _cvtu64_mask64(load64(p + 8)), G.hi, _mm512_set1_epi8(16));
    }
    if constexpr (t.bits == 6) {
        const uint8_t* p = w + L.hi2 + 16 * g;
        G.lo = _mm512_mask_add_epi8(G.lo, _cvtu64_mask64(load64(p)), G.lo, _mm512_set1_epi8(32));
        G.hi = _mm512_mask_add_epi8(G.hi, _cvtu64_mask64(load64(p + 8)), G.hi, _mm512_set1_epi8(32));
    }
    if constexpr (!t.kquant) {
        G.s_lo = G.s_hi = spread(_mm_cvtph_ps(load_halves(w + L.scales + 8 * g, n)));
    } else if constexpr (t.per16) {  // eight scales, one per 16 weights: even ones for the low halves, odd for the high
        const float d = fp16(w + L.super_scales + 2 * (g / 2));  // a group never straddles 256 weights
        const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                           reinterpret_cast<const __m128i*>(w + L.scales + 8 * g)))), _mm256_set1_ps(d));
        const __m512 s8 = _mm512_castps256_ps512(s);
        G.s_lo = _mm512_permutexvar_ps(_mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0), s8);
        G.s_hi = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 7, 7, 5, 5, 5, 5, 3, 3, 3, 3, 1, 1, 1, 1), s8);
    } else {
        uint32_t sc, mc;
        std::memcpy(&sc, w + L.scales + 4 * g, 4), std::memcpy(&mc, w + L.mins + 4 * g, 4);
        const float d = fp16(w + L.super_scales + 2 * (g / 2)), dmin = fp16(w + L.super_mins + 2 * (g / 2));
        G.s_lo = G.s_hi = spread(_mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(sc))))));
        G.min = spread(_mm_mul_ps(_mm_set1_ps(-dmin), _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(mc))))));
    }
    return G;
}

// Sums of the lanes of four vectors, as the first four floats of one.
inline __m128 reduce4(const __m512 v[4]) {
    __m256 h[4];
    for (int i = 0; i < 4; ++i) h[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i]), _mm512_extractf32x8_ps(v[i], 1));
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
}

// One vector's sum in reduce4's order, so that a row's result never depends on the rows computed beside it.
inline float reduce(__m512 v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(h, h), _mm256_hadd_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
}

// C weight rows (from w, row_bytes apart) against R activation rows: out[r * ldo + c].
template <int TYPE, int R, int C>
void tile(const uint8_t* w, const Layout& L, const Activations& a, int64_t r0, float* out, int64_t ldo) {
    constexpr Info t = info(TYPE);
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < L.groups; ++g) {
        Group G[C];
        for (int c = 0; c < C; ++c) G[c] = load_group<TYPE>(w + c * L.row_bytes, L, g);
        const int64_t first = a.at(g, r0);  // the group's R activation rows, one after another
        for (int r = 0; r < R; ++r) {
            const int64_t i = first + r;
            const __m512i xa = _mm512_loadu_si512(a.xa + 64 * i), xb = _mm512_loadu_si512(a.xb + 64 * i);
            const __m512 xs = _mm512_loadu_ps(a.xs + 16 * i);
            const __m512i corr = _mm512_loadu_si512(a.corr + 16 * i);
            for (int c = 0; c < C; ++c) {
                if constexpr (t.per16) {
                    const __m512i dl = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), G[c].lo, xa), corr);
                    const __m512i dh = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), G[c].hi, xb),
                                                        _mm512_loadu_si512(a.corr_b + 16 * i));
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dl), _mm512_mul_ps(G[c].s_lo, xs), acc[r][c]);
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dh), _mm512_mul_ps(G[c].s_hi, xs), acc[r][c]);
                } else {
                    __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), G[c].lo, xa), G[c].hi, xb);
                    if constexpr (t.offset != 0) d = _mm512_sub_epi32(d, corr);
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(G[c].s_lo, xs), acc[r][c]);
                }
                if constexpr (t.min && t.kquant) acc[r][c] = _mm512_fmadd_ps(G[c].min, _mm512_loadu_ps(a.xm + 16 * i), acc[r][c]);
            }
        }
    }
    if constexpr (t.min && !t.kquant)  // Q4_1/Q5_1: each unit's fp16 min times its sum of x, 16 units an FMA, once a row
        for (int64_t u = 0; u < L.units; u += 16) {
            const int64_t n = L.units - u < 16 ? L.units - u : 16;
            for (int c = 0; c < C; ++c) {
                const uint8_t* m = w + c * L.row_bytes + L.mins + 2 * u;
                const __m512 mins = _mm512_cvtph_ps(n == 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m))
                                                            : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), m));
                for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(mins, _mm512_loadu_ps(a.xsum + a.unit_at(u, r0 + r)), acc[r][c]);
            }
        }
    for (int r = 0; r < R; ++r) {
        if constexpr (C == 4) {
            _mm_storeu_ps(out + r * ldo, reduce4(acc[r]));
        } else {
            for (int c = 0; c < C; ++c) out[r * ldo + c] = reduce(acc[r][c]);
        }
    }
}

// Ask for the cache lines of [begin, end) ahead of their use: the rows are read once, straight from memory.
#ifndef AHEAD
#define AHEAD 16
#endif
inline void prefetch(const uint8_t* begin, const uint8_t* end) {
    for (const uint8_t* p = begin; p < end; p += 64) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// Four weight rows (C = 4) or one (C = 1) against all M activation rows, four at a time: a weight row is read from
// memory once, however many rows multiply it.
template <int TYPE, int C>
void tiles(const uint8_t* w, const Layout& L, const Activations& a, int64_t M, float* out, int64_t ldo) {
    for (int64_t r = 0; r < M; r += 4) {
        switch (M - r < 4 ? M - r : 4) {
            case 4: tile<TYPE, 4, C>(w, L, a, r, out + r * ldo, ldo); break;
            case 3: tile<TYPE, 3, C>(w, L, a, r, out + r * ldo, ldo); break;
            case 2: tile<TYPE, 2, C>(w, L, a, r, out + r * ldo, ldo); break;
            default: tile<TYPE, 1, C>(w, L, a, r, out + r * ldo, ldo); break;
        }
    }
}

template <int TYPE>
void matmul_rows(const Activations& a, const uint8_t* w, const Layout& L, int64_t M, int64_t n0, int64_t n1, float* out, int64_t ldo) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        prefetch(w + (n + AHEAD) * L.row_bytes, w + (n + AHEAD + 4 < n1 ? n + AHEAD + 4 : n1) * L.row_bytes);
        tiles<TYPE, 4>(w + n * L.row_bytes, L, a, M, out + n, ldo);
    }
    for (; n < n1; ++n) tiles<TYPE, 1>(w + n * L.row_bytes, L, a, M, out + n, ldo);
}

inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }

inline void store16(uint16_t* out, __m512 v) {  // bf16, rounded to nearest even as torch's .to(bfloat16)
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}

// A row's values, a group of four units at a time: the same arithmetic as the AVX2 path (s * (c - o), then + m).
template <int TYPE, typename T>
void dequantize_row(const uint8_t* w, const Layout& L, T* out) {
    constexpr Info t = info(TYPE);
    for (int64_t g = 0; g < L.groups; ++g) {
        const Group G = load_group<TYPE>(w, L, g);
        const int64_t n = L.units - 4 * g < 4 ? L.units - 4 * g : 4;
        for (int64_t p = 0; p < n; ++p) {
            const UnitScale s = unit_scale(TYPE, w, L, 4 * g + p);
            const __m128i lo = p == 0 ? _mm512_extracti32x4_epi32(G.lo, 0) : p == 1 ? _mm512_extracti32x4_epi32(G.lo, 1)
                             : p == 2 ? _mm512_extracti32x4_epi32(G.lo, 2) : _mm512_extracti32x4_epi32(G.lo, 3);
            const __m128i hi = p == 0 ? _mm512_extracti32x4_epi32(G.hi, 0) : p == 1 ? _mm512_extracti32x4_epi32(G.hi, 1)
                             : p == 2 ? _mm512_extracti32x4_epi32(G.hi, 2) : _mm512_extracti32x4_epi32(G.hi, 3);
            const __m512i offset = _mm512_set1_epi32(t.offset);
            __m512 a = _mm512_mul_ps(_mm512_set1_ps(s.lo), _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(lo), offset)));
            __m512 b = _mm512_mul_ps(_mm512_set1_ps(s.hi), _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(hi), offset)));
            if constexpr (t.min) a = _mm512_add_ps(a, _mm512_set1_ps(s.min)), b = _mm512_add_ps(b, _mm512_set1_ps(s.min));
            store16(out + 32 * (4 * g + p), a);
            store16(out + 32 * (4 * g + p) + 16, b);
        }
    }
}

template <typename T>
void dequantize(int type, const uint8_t* w, const Layout& L, int64_t n0, int64_t n1, T* out) {
    with_type(type, [&]<int TYPE>() {
        for (int64_t n = n0; n < n1; ++n) dequantize_row<TYPE>(w + n * L.row_bytes, L, out + n * L.K);
    });
}

}  // namespace

void dequantize_rows_avx512(int type, const uint8_t* w, const Layout& L, int64_t n0, int64_t n1, float* out) {
    dequantize(type, w, L, n0, n1, out);
}

void dequantize_rows_avx512(int type, const uint8_t* w, const Layout& L, int64_t n0, int64_t n1, uint16_t* out) {
    dequantize(type, w, L, n0, n1, out);
}

void matmul_rows_avx512(int type, const Activations& a, const uint8_t* w, const Layout& L, int64_t M, int64_t n0, int64_t n1,
                        float* out, int64_t ldo) {
    with_type(type, [&]<int TYPE>() { matmul_rows<TYPE>(a, w, L, M, n0, n1, out, ldo); });
}

#pragma GCC pop_options

}  // namespace kvq
