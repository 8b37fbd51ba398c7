// The int8-activation matmul with AVX-512 VNNI over panels of 16 weight rows (quants.h): per unit of 32 weights,
// eight 512-bit integer dot products (vpdpbusd: unsigned codes x int8 activations, 4 products per int32 lane,
// lane l for row l), then one conversion and FMA for all 16 rows; and where the CPU has AMX, many rows' matmul in
// bf16 on its tiles. Built in the same extension as the AVX2 code; only this file's functions below the target
// pragma use AVX-512 and AMX, and quant_matmul.cpp calls them where the CPU has them. No ATen code is instantiated
// here, so nothing AVX-512 can leak into shared inline functions.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quants.h"

namespace kvq {

bool avx512_supported() {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
}

bool amx_supported() {
    static const bool ok = [] {
        unsigned a, b, c, d;  // CPUID leaf 7: AMX-BF16 is EDX bit 22, AMX-TILE bit 24; AVX512-BF16 leaf 7.1 EAX bit 5
        if (!avx512_supported() || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 22 & 1) || !(d >> 24 & 1)) return false;
        if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a >> 5 & 1)) return false;
        return syscall(SYS_arch_prctl, 0x1023, 18) == 0;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: Linux lends tiles on request
    }();
    return ok;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-bf16")

namespace {

inline __m512i load(const uint8_t* p) { return _mm512_loadu_si512(p); }

inline __m512 halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

inline __m512 bytes(const uint8_t* p, bool is_signed) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

inline __m512i broadcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// A panel unit's code vector j: the codes of weights 4j.. (lo) and 16 + 4j.. (hi; 8-bit: vector j + 4) of each lane's row.
template <int TYPE>
inline void unit_vector(const uint8_t* p, const Layout& L, int j, __m512i* lo, __m512i* hi) {
    constexpr Info t = info(TYPE);
    if constexpr (t.bits == 8) {
        *lo = load(p + 64 * j), *hi = load(p + 64 * (j + 4));
        return;
    }
    const __m512i c = load(p + 64 * j), mask = _mm512_set1_epi8(0x0F);
    *lo = _mm512_and_si512(c, mask), *hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), mask);
    for (int plane = 0; plane < (t.bits == 6 ? 2 : t.bits == 5 ? 1 : 0); ++plane) {
        const uint8_t* m = p + (plane ? L.p_hi2 : L.p_hi1) + 16 * j;
        const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << plane));
        *lo = _mm512_mask_add_epi8(*lo, _cvtu64_mask64(load64(m)), *lo, bit);
        *hi = _mm512_mask_add_epi8(*hi, _cvtu64_mask64(load64(m + 8)), *hi, bit);
    }
}

// A panel unit's scales (low and high 16 weights) and min, a lane each: w = s * (c - o) + m.
struct Scales16 {
    __m512 lo, hi, min;
};

template <int TYPE>
inline Scales16 unit_scales(const uint8_t* p, const Layout& L, __m512 d, __m512 dmin) {
    constexpr Info t = info(TYPE);
    Scales16 s{_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    if constexpr (!t.kquant) {
        s.lo = s.hi = halves(p + L.p_scales);
        if constexpr (t.min) s.min = halves(p + L.p_mins);
    } else {
        s.lo = _mm512_mul_ps(d, bytes(p + L.p_scales, t.per16));
        s.hi = t.per16 ? _mm512_mul_ps(d, bytes(p + L.p_scales + 16, true)) : s.lo;
        if constexpr (t.min) s.min = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dmin), bytes(p + L.p_mins, false));
    }
    return s;
}

// A panel's 16 rows against R activation rows: out[r * ldo + l].
template <int TYPE, int R>
void panel(const uint8_t* w, const Layout& L, const Activations& a, int64_t r0, float* out, int64_t ldo) {
    constexpr Info t = info(TYPE);
    __m512 acc[R], d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < L.units; ++u) {
        const uint8_t* p = w + L.unit_at(u);
        for (int64_t b = 0; b < L.unit_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + AHEAD + b), _MM_HINT_T0);
        if (t.kquant && u % 8 == 0) d = halves(p - L.header), dmin = t.min ? halves(p - L.header + 32) : dmin;
        __m512i dl[R], dh[R];
        for (int r = 0; r < R; ++r) dl[r] = dh[r] = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
            __m512i lo, hi;
            unit_vector<TYPE>(p, L, j, &lo, &hi);
            for (int r = 0; r < R; ++r) {
                const int8_t* x = a.q + 32 * a.at(r0 + r, u);
                dl[r] = _mm512_dpbusd_epi32(dl[r], lo, broadcast(x + 4 * j));
                dh[r] = _mm512_dpbusd_epi32(dh[r], hi, broadcast(x + 16 + 4 * j));
            }
        }
        const Scales16 sc = unit_scales<TYPE>(p, L, d, dmin);
        const __m512 s_lo = sc.lo, s_hi = sc.hi, m = sc.min;
        for (int r = 0; r < R; ++r) {
            const int64_t i = a.at(r0 + r, u);
            const __m512 xs = _mm512_set1_ps(a.xs[i]);
            if constexpr (t.per16) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dl[r], _mm512_set1_epi32(a.corr_lo[i]))), _mm512_mul_ps(s_lo, xs), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dh[r], _mm512_set1_epi32(a.corr_hi[i]))), _mm512_mul_ps(s_hi, xs), acc[r]);
            } else {
                __m512i dot = _mm512_add_epi32(dl[r], dh[r]);
                if constexpr (t.offset != 0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(a.corr_lo[i] + a.corr_hi[i]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s_lo, xs), acc[r]);
            }
            if constexpr (t.min) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.xsum[i]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

// Panels [p0, p1) against all M activation rows, up to eight at a time: a panel is read from memory once, however
// many rows multiply it, and its codes are unpacked once per pass.
template <int TYPE>
void panels(const Activations& a, const uint8_t* w, const Layout& L, int64_t M, int64_t p0, int64_t p1, float* out, int64_t ldo) {
    for (int64_t p = p0; p < p1; ++p)
        for (int64_t r = 0; r < M; r += 8) {
            const uint8_t* pw = w + p * L.panel_bytes();
            float* o = out + r * ldo + PANEL * p;
            switch (M - r < 8 ? M - r : 8) {
                case 8: panel<TYPE, 8>(pw, L, a, r, o, ldo); break;
                case 7: panel<TYPE, 7>(pw, L, a, r, o, ldo); break;
                case 6: panel<TYPE, 6>(pw, L, a, r, o, ldo); break;
                case 5: panel<TYPE, 5>(pw, L, a, r, o, ldo); break;
                case 4: panel<TYPE, 4>(pw, L, a, r, o, ldo); break;
                case 3: panel<TYPE, 3>(pw, L, a, r, o, ldo); break;
                case 2: panel<TYPE, 2>(pw, L, a, r, o, ldo); break;
                default: panel<TYPE, 1>(pw, L, a, r, o, ldo); break;
            }
        }
}

// ---- AMX ----
// Steps of many rows multiply in bf16 on AMX's tiles, the weights dequantized a panel at a time into the B tile's
// layout (a unit: 16 rows of pairs of weights, lane l for the panel's row l), never whole: each activation row's
// product sums in fp32 tiles over all of K, with no per-unit work a row. Tiles 0-3: the sums (C) of two blocks of 16
// activation rows (0, 1 and 2, 3) by two panels (0, 2 and 1, 3); 4 and 5 the blocks' bf16 activations (A); 6 and 7
// a unit of each panel's weights (B).
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

inline void configure_tiles(int rows0, int rows1) {
    TileConfig c;
    c.rows[0] = c.rows[1] = c.rows[4] = rows0, c.rows[2] = c.rows[3] = c.rows[5] = rows1, c.rows[6] = c.rows[7] = 16;
    for (int tile = 0; tile < 8; ++tile) c.colsb[tile] = c.rows[tile] ? 64 : 0;
    asm volatile("" : : "r"(&c) : "memory");  // GCC 12 drops the stores ldtilecfg reads but the palette's
    _tile_loadconfig(&c);
}

// Lanes 4q..4q+3 of v, each four times: a quarter of a code vector's lanes, 4 weights each.
inline __m512 quarter_lanes(__m512 v, int q) {
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * q), _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2)), v);
}

// A code vector's 64 weights (4 of each lane's row: k, k + 1, k + 2, k + 3), s * c + b with s and b a quarter's
// lanes (quarter_lanes), as two B tile rows of bf16 pairs: (k, k + 1) of every lane at out, (k + 2, k + 3) at out + 64.
inline void bf16_rows(__m512i codes, const __m512* s, const __m512* b, uint8_t* out) {
    __m512 f[4];
    for (int q = 0; q < 4; ++q) f[q] = _mm512_fmadd_ps(s[q], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, q))), b[q]);
    const __m512i lo = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[1], f[0])), hi = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[3], f[2]));
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    _mm512_storeu_si512(out, _mm512_permutex2var_epi32(lo, even, hi));
    _mm512_storeu_si512(out + 64, _mm512_permutex2var_epi32(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi));
}

// A panel's weights as B tiles, 1,024 bytes a unit: w = s * (c - o) + m, computed as s * c + (m - s * o).
template <int TYPE>
void bf16_panel(const uint8_t* w, const Layout& L, uint8_t* out) {
    constexpr Info t = info(TYPE);
    __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
    for (int64_t u = 0; u < L.units; ++u) {
        const uint8_t* p = w + L.unit_at(u);
        for (int64_t b = 0; b < L.unit_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + AHEAD + b), _MM_HINT_T0);
        if (t.kquant && u % 8 == 0) d = halves(p - L.header), dmin = t.min ? halves(p - L.header + 32) : dmin;
        const Scales16 sc = unit_scales<TYPE>(p, L, d, dmin);
        __m512 s[2][4], b[2][4];  // low and high 16 weights' scales and biases, by quarter
        for (int half = 0; half < (t.per16 ? 2 : 1); ++half) {
            const __m512 scale = half ? sc.hi : sc.lo, bias = _mm512_fnmadd_ps(scale, _mm512_set1_ps(float(t.offset)), sc.min);
            for (int q = 0; q < 4; ++q) s[half][q] = quarter_lanes(scale, q), b[half][q] = quarter_lanes(bias, q);
        }
        for (int j = 0; j < 4; ++j) {
            __m512i lo, hi;
            unit_vector<TYPE>(p, L, j, &lo, &hi);
            bf16_rows(lo, s[0], b[0], out + 1024 * u + 128 * j);
            bf16_rows(hi, s[t.per16], b[t.per16], out + 1024 * u + 512 + 128 * j);
        }
    }
}

// Panels [p0, p1) against M rows of bf16 activations x (row r at x + r * K): out[r * ldo + n]. Two panels and two
// blocks of 16 rows at a time, so that each tile of activations or weights loaded serves two products.
template <int TYPE>
void panels_bf16(const uint16_t* x, const uint8_t* w, const Layout& L, int64_t M, int64_t p0, int64_t p1, float* out, int64_t ldo) {
    thread_local std::vector<uint8_t> tiles;
    const int64_t bytes = 1024 * L.units, stride = 2 * L.K;
    tiles.resize(2 * bytes);
    const uint8_t *b0 = tiles.data(), *b1 = b0 + bytes;
    int configured = -1;
    for (int64_t p = p0; p < p1; p += 2) {
        const bool two = p + 1 < p1;
        bf16_panel<TYPE>(w + p * L.panel_bytes(), L, tiles.data());
        if (two) bf16_panel<TYPE>(w + (p + 1) * L.panel_bytes(), L, tiles.data() + bytes);
        for (int64_t r0 = 0; r0 < M; r0 += 32) {
            const int rows0 = static_cast<int>(std::min<int64_t>(16, M - r0)), rows1 = static_cast<int>(std::clamp<int64_t>(M - r0 - 16, 0, 16));
            if (16 * rows0 + rows1 != configured) configure_tiles(rows0, rows1), configured = 16 * rows0 + rows1;
            const uint16_t* x0 = x + r0 * L.K;
            _tile_zero(0);
            _tile_zero(1);
            if (rows1) {
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int64_t u = 0; u < L.units; ++u) {
                _tile_loadd(4, x0 + 32 * u, stride);
                _tile_loadd(6, b0 + 1024 * u, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) {
                    _tile_loadd(7, b1 + 1024 * u, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (rows1) {
                    _tile_loadd(5, x0 + 16 * L.K + 32 * u, stride);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two) _tile_dpbf16ps(3, 5, 7);
                }
            }
            float* o = out + r0 * ldo + PANEL * p;
            _tile_stored(0, o, 4 * ldo);
            if (two) _tile_stored(1, o + PANEL, 4 * ldo);
            if (rows1) _tile_stored(2, o + 16 * ldo, 4 * ldo);
            if (rows1 && two) _tile_stored(3, o + 16 * ldo + PANEL, 4 * ldo);
        }
    }
    _tile_release();
}

}  // namespace

// x [M, K] fp32 as bf16, rounded to nearest even.
void to_bf16_avx512(const float* x, int64_t n, uint16_t* out) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i))));
    if (i < n) {
        const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
        _mm256_mask_storeu_epi16(out + i, k, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, x + i))));
    }
}

void matmul_panels_bf16_amx(int type, const uint16_t* x, const uint8_t* w, const Layout& L, int64_t M, int64_t p0, int64_t p1,
                            float* out, int64_t ldo) {
    with_type(type, [&]<int TYPE>() { panels_bf16<TYPE>(x, w, L, M, p0, p1, out, ldo); });
}

namespace {

inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }

inline void store16(uint16_t* out, __m512 v) {  // bf16, rounded to nearest even as torch's .to(bfloat16)
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}

// A panel's 16 rows of values, row l at out + l * L.K, as the AVX2 dequantizer computes them (s * (c - o), then
// + m), 16 at a time: a unit's four code vectors transposed into each row's 16 low-half and 16 high-half codes.
template <int TYPE, typename T>
void dequantize_panel(const uint8_t* w, const Layout& L, T* out) {
    constexpr Info t = info(TYPE);
    __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
    for (int64_t u = 0; u < L.units; ++u) {
        const uint8_t* p = w + L.unit_at(u);
        if (t.kquant && u % 8 == 0) d = halves(p - L.header), dmin = t.min ? halves(p - L.header + 32) : dmin;
        const Scales16 sc = unit_scales<TYPE>(p, L, d, dmin);
        const __m512 s_lo = sc.lo, s_hi = sc.hi, m = sc.min;
        alignas(64) float sl[16], sh[16], mn[16];
        _mm512_store_ps(sl, s_lo), _mm512_store_ps(sh, s_hi), _mm512_store_ps(mn, m);
        __m512i c[2][4];  // low and high halves' codes, vector j
        for (int j = 0; j < 4; ++j) unit_vector<TYPE>(p, L, j, &c[0][j], &c[1][j]);
        for (int half = 0; half < 2; ++half) {  // 4x4 dword transposes in each 128-bit lane: row 4q + k in lane q of v[k]
            __m512i* v = c[half];
            const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
            const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
            v[0] = _mm512_unpacklo_epi64(t0, t2), v[1] = _mm512_unpackhi_epi64(t0, t2);
            v[2] = _mm512_unpacklo_epi64(t1, t3), v[3] = _mm512_unpackhi_epi64(t1, t3);
        }
        for (int l = 0; l < 16; ++l)
            for (int half = 0; half < 2; ++half) {
                const __m512i v = c[half][l % 4];
                const __m128i codes = l / 4 == 0 ? _mm512_extracti32x4_epi32(v, 0) : l / 4 == 1 ? _mm512_extracti32x4_epi32(v, 1)
                                    : l / 4 == 2 ? _mm512_extracti32x4_epi32(v, 2) : _mm512_extracti32x4_epi32(v, 3);
                const __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(codes), _mm512_set1_epi32(t.offset));
                __m512 x = _mm512_mul_ps(_mm512_set1_ps(half ? sh[l] : sl[l]), _mm512_cvtepi32_ps(q));
                if constexpr (t.min) x = _mm512_add_ps(x, _mm512_set1_ps(mn[l]));
                store16(out + l * L.K + 32 * u + 16 * half, x);
            }
    }
}

}  // namespace

void dequantize_panel_avx512(int type, const uint8_t* w, const Layout& L, float* out) {
    with_type(type, [&]<int TYPE>() { dequantize_panel<TYPE>(w, L, out); });
}

void dequantize_panel_avx512(int type, const uint8_t* w, const Layout& L, uint16_t* out) {
    with_type(type, [&]<int TYPE>() { dequantize_panel<TYPE>(w, L, out); });
}

void matmul_panels_avx512(int type, const Activations& a, const uint8_t* w, const Layout& L, int64_t M, int64_t p0, int64_t p1,
                          float* out, int64_t ldo) {
    with_type(type, [&]<int TYPE>() { panels<TYPE>(a, w, L, M, p0, p1, out, ldo); });
}

#pragma GCC pop_options

}  // namespace kvq
