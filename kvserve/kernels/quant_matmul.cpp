// Weights kept in their GGUF file's quantized format (see quants.h): packing a file's rows into the kernels'
// layout, dequantizing rows (prefill's tiles, embedding lookups), and x @ W.T for a few rows of activations.
// Two ways to multiply: activations quantized to int8 per 32 values with one fp32 scale, as llama.cpp does,
// for integer dot products (AVX-512 VNNI where the CPU has it, else AVX2's maddubs); or fp32 activations
// against weights dequantized in registers (AVX2), which equals fp32 math on the dequantized weights up to
// summation order. The instruction set is picked at run time (KVSERVE_ISA=avx2 or set_kernel_isa forces AVX2).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "pointwise.h"
#include "quants.h"
#include "simd.h"
#include "timer.h"

namespace kvq {
bool avx512_supported();
bool amx_supported();
void matmul_panels_avx512(int type, const Activations& a, const uint8_t* w, const Layout& L, int64_t M, int64_t p0, int64_t p1,
                          float* out, int64_t ldo);
void to_bf16_avx512(const float* x, int64_t n, uint16_t* out);
void matmul_panels_bf16_amx(int type, const uint16_t* x, const uint8_t* w, const Layout& L, int64_t M, int64_t p0, int64_t p1,
                            float* out, int64_t ldo);
void dequantize_panel_avx512(int type, const uint8_t* w, const Layout& L, float* out);
void dequantize_panel_avx512(int type, const uint8_t* w, const Layout& L, uint16_t* out);
bool avx512_enabled();
}  // namespace kvq

namespace {
using namespace kvq;

// The best the CPU has, unless KVSERVE_ISA names a lesser one (avx2, avx512_vnni)
const std::string forced_isa = std::getenv("KVSERVE_ISA") ? std::getenv("KVSERVE_ISA") : "";
bool use_avx512 = avx512_supported() && forced_isa != "avx2";
bool use_amx = use_avx512 && forced_isa != "avx512_vnni" && amx_supported();
// From this many rows a step's int8 matmul runs in bf16 on AMX's tiles instead: on a 2-core Xeon, all of SmolLM2's
// linears (ms a row, VNNI kernels / AMX tiles) 0.59 / 0.57 at 24 rows, 0.56 / 0.46 at 32, 0.54 / 0.38 at 64, 0.50 /
// 0.28 at 192; dequantizing a panel at a time costs ~10 ms a step, so a few rows stay far faster in the kernels.
constexpr int64_t AMX_BF16_ROWS = 32;

bool supported(int type) { return info(type).bits != 0; }

// ---- packing a GGUF row ----

// The 32 unsigned codes of unit u of a raw GGUF row, in weight order.
void raw_codes(int type, const uint8_t* raw, int64_t u, uint8_t c[32]) {
    const Info t = info(type);
    if (!t.kquant) {
        const uint8_t* b = raw + u * t.block_bytes;
        if (type == Q8_0) {
            for (int j = 0; j < 32; ++j) c[j] = b[2 + j] ^ 0x80;  // int8 w -> w + 128
            return;
        }
        const int qs = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
        uint32_t qh = 0;
        if (t.bits == 5) std::memcpy(&qh, b + qs - 4, 4);
        for (int j = 0; j < 16; ++j) {
            c[j] = (b[qs + j] & 0x0F) | (((qh >> j) & 1) << 4);
            c[j + 16] = (b[qs + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        }
        return;
    }
    const uint8_t* b = raw + (u / 8) * t.block_bytes;
    const int s = static_cast<int>(u % 8);
    if (type == Q6_K) {  // ql[128] qh[64] scales[16] d
        for (int l = 0; l < 32; ++l) {
            const int n = 32 * s + l, h = n / 128, m = n % 128;
            const int low = m < 64 ? b[64 * h + m] & 0x0F : b[64 * h + m - 64] >> 4;
            c[l] = static_cast<uint8_t>(low | (((b[128 + 32 * h + l] >> (2 * (m / 32))) & 3) << 4));
        }
        return;
    }
    const uint8_t* qs = b + (type == Q4_K ? 16 : 48);  // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
    for (int l = 0; l < 32; ++l) {
        c[l] = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0F;
        if (type == Q5_K) c[l] |= ((b[16 + l] >> s) & 1) << 4;
    }
}

// Q4_K/Q5_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
void scale_min_k4(const uint8_t* q, int j, uint8_t* sc, uint8_t* m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

void pack_row(int type, const uint8_t* raw, uint8_t* dst, const Layout& L) {
    const Info t = info(type);
    uint8_t c[32];
    for (int64_t u = 0; u < L.units; ++u) {
        raw_codes(type, raw, u, c);
        if (t.bits == 8) {
            int64_t lo, hi;
            q8_halves(L, u, &lo, &hi);
            std::memcpy(dst + lo, c, 16), std::memcpy(dst + hi, c + 16, 16);
        } else {
            for (int j = 0; j < 16; ++j) dst[L.codes + 16 * u + j] = (c[j] & 0x0F) | ((c[j + 16] & 0x0F) << 4);
        }
        const int64_t g = u / 4, p = u % 4;
        for (int plane = 0; plane < (t.bits == 6 ? 2 : t.bits == 5 ? 1 : 0); ++plane) {
            uint64_t masks[2];
            uint8_t* at = dst + (plane ? L.hi2 : L.hi1) + 16 * g;
            std::memcpy(masks, at, 16);
            for (int j = 0; j < 16; ++j) {
                masks[0] |= uint64_t((c[j] >> (4 + plane)) & 1) << (16 * p + j);
                masks[1] |= uint64_t((c[j + 16] >> (4 + plane)) & 1) << (16 * p + j);
            }
            std::memcpy(at, masks, 16);
        }
        if (!t.kquant) {
            const uint8_t* b = raw + u * t.block_bytes;
            std::memcpy(dst + L.scales + 2 * u, b, 2);
            if (t.min) std::memcpy(dst + L.mins + 2 * u, b + 2, 2);
            continue;
        }
        const uint8_t* b = raw + (u / 8) * t.block_bytes;
        const int s = static_cast<int>(u % 8);
        if (t.per16) {
            std::memcpy(dst + L.scales + 2 * u, b + 192 + 2 * s, 2);
            std::memcpy(dst + L.super_scales + 2 * (u / 8), b + 208, 2);
        } else {
            scale_min_k4(b + 4, s, dst + L.scales + u, dst + L.mins + u);
            std::memcpy(dst + L.super_scales + 2 * (u / 8), b, 2);
            std::memcpy(dst + L.super_mins + 2 * (u / 8), b + 2, 2);
        }
    }
}

// ---- panels ----

// Moves row l of a panel into a row-format row (TO_PANEL false: `panel` is only read) or from one into the panel
// (which starts zeroed): every plane, lane by lane.
template <bool TO_PANEL>
void lane_io(int type, const Layout& L, uint8_t* panel, int64_t l, uint8_t* row) {
    const Info t = info(type);
    const auto move = [](uint8_t* in_panel, uint8_t* in_row, int n) {
        if constexpr (TO_PANEL) std::memcpy(in_panel, in_row, n);
        else std::memcpy(in_row, in_panel, n);
    };
    for (int64_t u = 0; u < L.units; ++u) {
        uint8_t* p = panel + L.unit_at(u);
        for (int j = 0; j < (t.bits == 8 ? 8 : 4); ++j) {
            int64_t at = L.codes + 16 * u + 4 * j, lo, hi;
            if (t.bits == 8) q8_halves(L, u, &lo, &hi), at = j < 4 ? lo + 4 * j : hi + 4 * (j - 4);
            move(p + 64 * j + 4 * l, row + at, 4);
        }
        for (int plane = 0; plane < (t.bits == 6 ? 2 : t.bits == 5 ? 1 : 0); ++plane) {
            uint8_t* masks = p + (plane ? L.p_hi2 : L.p_hi1);
            uint8_t* bits_at = row + (plane ? L.hi2 : L.hi1);
            // nibble j of the unit's 32 bits (weights 4j..4j+3) is lane l's in vector j % 4's low (j < 4) or high mask
            uint32_t bits = TO_PANEL ? unit_bits(bits_at, u) : 0;
            for (int j = 0; j < 8; ++j) {
                uint8_t* mask = masks + 16 * (j % 4) + 8 * (j / 4);
                if constexpr (TO_PANEL) {
                    const uint64_t m = load64(mask) | (uint64_t((bits >> (4 * j)) & 0xF) << (4 * l));
                    std::memcpy(mask, &m, 8);
                } else {
                    bits |= static_cast<uint32_t>((load64(mask) >> (4 * l)) & 0xF) << (4 * j);
                }
            }
            if constexpr (!TO_PANEL) set_unit_bits(bits_at, u, bits);
        }
        if (!t.kquant) {
            move(p + L.p_scales + 2 * l, row + L.scales + 2 * u, 2);
            if (t.min) move(p + L.p_mins + 2 * l, row + L.mins + 2 * u, 2);
        } else if (t.per16) {
            move(p + L.p_scales + l, row + L.scales + 2 * u, 1);
            move(p + L.p_scales + 16 + l, row + L.scales + 2 * u + 1, 1);
        } else {
            move(p + L.p_scales + l, row + L.scales + u, 1);
            move(p + L.p_mins + l, row + L.mins + u, 1);
        }
        if (t.kquant && u % 8 == 0) {
            move(p - L.header + 2 * l, row + L.super_scales + 2 * (u / 8), 2);
            if (t.min) move(p - L.header + 32 + 2 * l, row + L.super_mins + 2 * (u / 8), 2);
        }
    }
}

// Row n of a packed tensor of N rows in the row format: in place past the panels, else copied out of its panel into tmp.
const uint8_t* row_at(int type, const uint8_t* w, const Layout& L, int64_t N, int64_t n, uint8_t* tmp) {
    if (n >= N / PANEL * PANEL) return w + n * L.row_bytes;
    lane_io<false>(type, L, const_cast<uint8_t*>(w) + n / PANEL * L.panel_bytes(), n % PANEL, tmp);
    return tmp;
}

// Row-format rows (rows(i) for i < N) as a packed tensor of N rows at `out` (zeroed).
template <typename Rows>
void to_panels(int type, const Layout& L, int64_t N, Rows&& rows, uint8_t* out) {
    const int64_t panels = N / PANEL;
    at::parallel_for(0, panels + 1, 1, [&](int64_t begin, int64_t end) {
        std::vector<uint8_t> tmp(L.row_bytes);
        for (int64_t p = begin; p < end; ++p)
            for (int64_t n = p * PANEL; n < std::min(N, (p + 1) * PANEL); ++n) {
                if (p == panels) std::memcpy(out + n * L.row_bytes, rows(n, tmp.data()), L.row_bytes);
                else lane_io<true>(type, L, out + p * L.panel_bytes(), n % PANEL, const_cast<uint8_t*>(rows(n, tmp.data())));
            }
    });
}

// ---- dequantizing ----

inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }

inline void store8(at::BFloat16* out, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(out), bf16_round(v)); }

// A row-format row's values as fp32 or bf16: s * (c - o), plus m where the type has one (the gguf package's
// arithmetic: a multiply, then an add, never fused, so the values are bit for bit the package's).
template <int TYPE, typename T>
void dequantize_row(const uint8_t* row, const Layout& L, T* out) {
    constexpr bool min = info(TYPE).min;
    for (int64_t u = 0; u < L.units; ++u) {
        const __m256i v = unit_values(TYPE, row, L, u);
        const UnitScale s = unit_scale(TYPE, row, L, u);
        const __m128i halves[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
        for (int i = 0; i < 4; ++i) {
            const __m128i bytes = i % 2 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
            __m256 w = _mm256_mul_ps(_mm256_set1_ps(i < 2 ? s.lo : s.hi), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
            if constexpr (min) w = _mm256_add_ps(w, _mm256_set1_ps(s.min));
            store8(out + 32 * u + 8 * i, w);
        }
    }
}

// ---- activations ----

// Rows of x quantized per 32 values as the int8 kernels read them (kvq::Activations).
struct Prepared {
    std::vector<int8_t> q;
    std::vector<float> xs, xsum;
    std::vector<int32_t> corr_lo, corr_hi;

    Activations view(int64_t units) const { return {q.data(), xs.data(), xsum.data(), corr_lo.data(), corr_hi.data(), units}; }
};

void quantize_activations(int type, const float* x, int64_t M, int64_t K, Prepared& p) {
    const int offset = info(type).offset;
    const int64_t n = M * (K / 32);  // entry i: x + 32 * i
    p.q.resize(32 * n), p.xs.resize(n), p.xsum.resize(n), p.corr_lo.resize(n), p.corr_hi.resize(n);
    int8_t* q = p.q.data();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    kvp::for_rows(n, [&](int64_t i) {
        const float* xu = x + 32 * i;
        __m256 amax = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(xu + 8 * k), abs_mask));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float scale = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.0f;
        const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        __m256i v[4];
        for (int k = 0; k < 4; ++k)  // round half to even, as std::nearbyint and torch.round
            v[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xu + 8 * k), _mm256_set1_ps(inv)),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // |v| <= 127, so the saturating packs are exact; they interleave 4-value groups, which the permute undoes
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * i), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const int32_t lo = hsum_epi32(_mm256_add_epi32(v[0], v[1])), hi = hsum_epi32(_mm256_add_epi32(v[2], v[3]));
        p.xs[i] = scale, p.xsum[i] = scale * float(lo + hi), p.corr_lo[i] = offset * lo, p.corr_hi[i] = offset * hi;
    }, 1024);  // ~20 ns a unit: a decode step's few hundred stay on this thread
}

// ---- AVX2 kernels ----

// Integer dot products of unsigned codes with int8 activations, 4 bytes per int32 lane.
inline __m256i dot_lanes(__m256i codes, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
}

inline __m256i load32b(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline int32_t load32(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Lanes 8h..8h+7 of a panel unit's code vector j: the codes of weights 4j.. (lo) and 16 + 4j.. (hi; 8-bit: vector j + 4).
template <int TYPE>
inline void half_vector(const uint8_t* p, const Layout& L, int j, int h, __m256i* lo, __m256i* hi) {
    constexpr Info t = info(TYPE);
    if constexpr (t.bits == 8) {
        *lo = load32b(p + 64 * j + 32 * h), *hi = load32b(p + 64 * (j + 4) + 32 * h);
        return;
    }
    const __m256i c = load32b(p + 64 * j + 32 * h), mask = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(c, mask), *hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
    for (int plane = 0; plane < (t.bits == 6 ? 2 : t.bits == 5 ? 1 : 0); ++plane) {
        const uint8_t* m = p + (plane ? L.p_hi2 : L.p_hi1) + 16 * j;
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(16 << plane));
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(bytes_from_bits(static_cast<uint32_t>(load64(m) >> (32 * h))), bit));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(bytes_from_bits(static_cast<uint32_t>(load64(m + 8) >> (32 * h))), bit));
    }
}

inline __m256 bytes_to_ps(const uint8_t* p, bool is_signed) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

inline __m256 halves_to_ps(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Lanes 8h..8h+7 of a panel unit's scales (low and high 16 weights) and min: w = s * (c - o) + m.
struct Scales8 {
    __m256 lo, hi, min;
};

// A K-quant block's d and dmin, read at its first unit (p).
template <int TYPE>
inline void block_scales(const uint8_t* p, const Layout& L, int h, __m256* d, __m256* dmin) {
    *d = halves_to_ps(p - L.header + 16 * h);
    if constexpr (info(TYPE).min) *dmin = halves_to_ps(p - L.header + 32 + 16 * h);
}

template <int TYPE>
inline Scales8 unit_scales(const uint8_t* p, const Layout& L, int h, __m256 d, __m256 dmin) {
    constexpr Info t = info(TYPE);
    Scales8 s{_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    if constexpr (!t.kquant) {
        s.lo = s.hi = halves_to_ps(p + L.p_scales + 16 * h);
        if constexpr (t.min) s.min = halves_to_ps(p + L.p_mins + 16 * h);
    } else {
        s.lo = _mm256_mul_ps(d, bytes_to_ps(p + L.p_scales + 8 * h, t.per16));
        s.hi = t.per16 ? _mm256_mul_ps(d, bytes_to_ps(p + L.p_scales + 16 + 8 * h, true)) : s.lo;
        if constexpr (t.min) s.min = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), dmin), bytes_to_ps(p + L.p_mins + 8 * h, false));
    }
    return s;
}

// Lanes 8h..8h+7 of a panel unit's code vectors j (see half_vector), as the int8 kernels multiply them: 8-bit codes
// as signed weights (maddubs would saturate at 255 * 127 * 2: |w| is taken, and sign(x, w), in unit_sums).
template <int TYPE>
inline void int8_codes(const uint8_t* p, const Layout& L, int j, int h, __m256i* lo, __m256i* hi) {
    half_vector<TYPE>(p, L, j, h, lo, hi);
    if constexpr (info(TYPE).bits == 8) {
        *lo = _mm256_xor_si256(*lo, _mm256_set1_epi8(static_cast<char>(0x80)));
        *hi = _mm256_xor_si256(*hi, _mm256_set1_epi8(static_cast<char>(0x80)));
    }
}

// A unit's integer dot products with one activation row, code vectors j of 4 at a time (xl, xh: the row's values
// 4j.. and 16 + 4j.. broadcast): dl, dh the low and high 16 weights' int32 sums (for 4/5-bit codes, dl holds both),
// pairs the int16 sums not yet widened: at most 2 * 15 * 127 for 4-bit codes, 2 * 31 * 127 for 5-bit ones, so a
// unit's four code vectors (4-bit) or two (5-bit) sum without overflow before one widening to int32.
template <int TYPE>
inline void unit_sums(__m256i lo, __m256i hi, __m256i xl, __m256i xh, int j, __m256i& dl, __m256i& dh, __m256i& pairs) {
    constexpr Info t = info(TYPE);
    if constexpr (t.bits == 8) {
        dl = _mm256_add_epi32(dl, dot_lanes(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(xl, lo)));
        dh = _mm256_add_epi32(dh, dot_lanes(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(xh, hi)));
    } else if constexpr (t.per16) {
        dl = _mm256_add_epi32(dl, dot_lanes(lo, xl)), dh = _mm256_add_epi32(dh, dot_lanes(hi, xh));
    } else {
        pairs = _mm256_add_epi16(pairs, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
        if (t.bits == 4 ? j == 3 : j % 2 == 1) {
            dl = _mm256_add_epi32(dl, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
            pairs = _mm256_setzero_si256();
        }
    }
}

// acc plus a unit's scaled dot products (unit_sums) with activation entry i.
template <int TYPE>
inline __m256 unit_result(__m256i dl, __m256i dh, const Scales8& sc, const Activations& a, int64_t i, __m256 acc) {
    constexpr Info t = info(TYPE);
    const __m256 xs = _mm256_set1_ps(a.xs[i]);
    if constexpr (t.bits == 8) {
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(dl, dh)), _mm256_mul_ps(sc.lo, xs), acc);
    } else if constexpr (t.per16) {
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dl, _mm256_set1_epi32(a.corr_lo[i]))), _mm256_mul_ps(sc.lo, xs), acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dh, _mm256_set1_epi32(a.corr_hi[i]))), _mm256_mul_ps(sc.hi, xs), acc);
    } else {
        const __m256i dot = t.offset ? _mm256_sub_epi32(dl, _mm256_set1_epi32(a.corr_lo[i] + a.corr_hi[i])) : dl;
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sc.lo, xs), acc);
    }
    if constexpr (t.min) acc = _mm256_fmadd_ps(sc.min, _mm256_set1_ps(a.xsum[i]), acc);
    return acc;
}

inline __m256i broadcast4(const int8_t* x) { return _mm256_set1_epi32(load32(x)); }

// Lanes 8h..8h+7 of a panel (its rows 8h..8h+7) against R activation rows: out[r * ldo + 8h + lane]. A unit's
// codes are unpacked once, then each row's dot products are summed in turn (few vectors live at once: with every
// row's sums interleaved, the compiler spilled them to the stack; one process, both builds: 3.5-5% faster).
template <int TYPE, int R>
void panel_int8_avx2(const uint8_t* panel, const Layout& L, const Activations& a, int64_t r0, int h, bool fetch, float* out, int64_t ldo) {
    constexpr Info t = info(TYPE);
    __m256 acc[R], d = _mm256_setzero_ps(), dmin = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < L.units; ++u) {
        const uint8_t* p = panel + L.unit_at(u);
        if (fetch)
            for (int64_t b = 0; b < L.unit_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + AHEAD + b), _MM_HINT_T0);
        if (t.kquant && u % 8 == 0) block_scales<TYPE>(p, L, h, &d, &dmin);
        __m256i lo[4], hi[4];
        for (int j = 0; j < 4; ++j) int8_codes<TYPE>(p, L, j, h, &lo[j], &hi[j]);
        const Scales8 sc = unit_scales<TYPE>(p, L, h, d, dmin);
        for (int r = 0; r < R; ++r) {
            const int64_t i = a.at(r0 + r, u);
            const int8_t* x = a.q + 32 * i;
            __m256i dl = _mm256_setzero_si256(), dh = _mm256_setzero_si256(), pairs = _mm256_setzero_si256();
            for (int j = 0; j < 4; ++j) unit_sums<TYPE>(lo[j], hi[j], broadcast4(x + 4 * j), broadcast4(x + 16 + 4 * j), j, dl, dh, pairs);
            acc[r] = unit_result<TYPE>(dl, dh, sc, a, i, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo + 8 * h, acc[r]);
}

// A panel's 16 rows against one activation row r (a decode step's): out[0..16). Each broadcast of the row's values
// serves both halves' code vectors, and the panel is read in one pass, not one a half.
template <int TYPE>
void panel_int8_row_avx2(const uint8_t* panel, const Layout& L, const Activations& a, int64_t r, float* out) {
    constexpr Info t = info(TYPE);
    __m256 acc[2], d[2], dmin[2];
    for (int h = 0; h < 2; ++h) acc[h] = d[h] = dmin[h] = _mm256_setzero_ps();
    for (int64_t u = 0; u < L.units; ++u) {
        const uint8_t* p = panel + L.unit_at(u);
        for (int64_t b = 0; b < L.unit_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + AHEAD + b), _MM_HINT_T0);
        if (t.kquant && u % 8 == 0)
            for (int h = 0; h < 2; ++h) block_scales<TYPE>(p, L, h, &d[h], &dmin[h]);
        const int64_t i = a.at(r, u);
        const int8_t* x = a.q + 32 * i;
        __m256i dl[2], dh[2], pairs[2];
        for (int h = 0; h < 2; ++h) dl[h] = dh[h] = pairs[h] = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
            const __m256i xl = broadcast4(x + 4 * j), xh = broadcast4(x + 16 + 4 * j);
            for (int h = 0; h < 2; ++h) {
                __m256i lo, hi;
                int8_codes<TYPE>(p, L, j, h, &lo, &hi);
                unit_sums<TYPE>(lo, hi, xl, xh, j, dl[h], dh[h], pairs[h]);
            }
        }
        for (int h = 0; h < 2; ++h) acc[h] = unit_result<TYPE>(dl[h], dh[h], unit_scales<TYPE>(p, L, h, d[h], dmin[h]), a, i, acc[h]);
    }
    _mm256_storeu_ps(out, acc[0]), _mm256_storeu_ps(out + 8, acc[1]);
}

// Four vectors of eight 4-byte lanes -> per lane its four dwords in vector order: row k in the low half of
// result k, row k + 4 in its high half.
inline void transpose4x8(__m256i v[4]) {
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t2), v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3), v[3] = _mm256_unpackhi_epi64(t1, t3);
}

// 16 codes' values s * (c - o) (+ m) into out[0..16), in the row dequantizer's arithmetic.
template <int TYPE, typename T>
inline void dequantize16(__m128i codes, float s, float m, T* out) {
    constexpr Info t = info(TYPE);
    for (int i = 0; i < 2; ++i) {
        const __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(i ? _mm_srli_si128(codes, 8) : codes), _mm256_set1_epi32(t.offset));
        __m256 w = _mm256_mul_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(v));
        if constexpr (t.min) w = _mm256_add_ps(w, _mm256_set1_ps(m));
        store8(out + 8 * i, w);
    }
}

// A panel's 16 rows of values, row l at out + l * L.K: a unit's code vectors transposed into each row's codes.
template <int TYPE, typename T>
void dequantize_panel(const uint8_t* panel, const Layout& L, T* out) {
    constexpr Info t = info(TYPE);
    __m256 d = _mm256_setzero_ps(), dmin = _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h)
        for (int64_t u = 0; u < L.units; ++u) {
            const uint8_t* p = panel + L.unit_at(u);
            if (t.kquant && u % 8 == 0) block_scales<TYPE>(p, L, h, &d, &dmin);
            const Scales8 sc = unit_scales<TYPE>(p, L, h, d, dmin);
            float s_lo[8], s_hi[8], m[8];
            _mm256_storeu_ps(s_lo, sc.lo), _mm256_storeu_ps(s_hi, sc.hi), _mm256_storeu_ps(m, sc.min);
            __m256i lo[4], hi[4];
            for (int j = 0; j < 4; ++j) half_vector<TYPE>(p, L, j, h, &lo[j], &hi[j]);
            transpose4x8(lo), transpose4x8(hi);
            for (int k = 0; k < 8; ++k) {
                T* row = out + (8 * h + k) * L.K + 32 * u;
                const __m128i cl = k < 4 ? _mm256_castsi256_si128(lo[k]) : _mm256_extracti128_si256(lo[k - 4], 1);
                const __m128i ch = k < 4 ? _mm256_castsi256_si128(hi[k]) : _mm256_extracti128_si256(hi[k - 4], 1);
                dequantize16<TYPE>(cl, s_lo[k], m[k], row);
                dequantize16<TYPE>(ch, s_hi[k], m[k], row + 16);
            }
        }
}

// Rows [n0, n1) of a packed tensor of N rows, row n at out + (n - n0) * L.K: whole panels at once, other rows one by one.
template <typename T>
void dequantize_rows(int type, const uint8_t* w, const Layout& L, int64_t N, int64_t n0, int64_t n1, T* out) {
    std::vector<uint8_t> tmp(L.row_bytes);
    const int64_t panels_end = N / PANEL * PANEL;
    with_type(type, [&]<int TYPE>() {
        for (int64_t n = n0; n < n1;) {
            if (n % PANEL == 0 && n + PANEL <= std::min(n1, panels_end)) {
                const uint8_t* panel = w + n / PANEL * L.panel_bytes();
                T* o = out + (n - n0) * L.K;
                if (!use_avx512) dequantize_panel<TYPE>(panel, L, o);
                else if constexpr (std::is_same_v<T, float>) dequantize_panel_avx512(TYPE, panel, L, o);
                else dequantize_panel_avx512(TYPE, panel, L, reinterpret_cast<uint16_t*>(o));
                n += PANEL;
            } else {
                dequantize_row<TYPE>(row_at(TYPE, w, L, N, n, tmp.data()), L, out + (n - n0) * L.K);
                ++n;
            }
        }
    });
}

// Panels [p0, p1) against all M activation rows, eight at a time (a panel is read from memory once, however many
// rows multiply it). Eight rows share a unit's unpacked codes where four did; their sums then live on the stack, the
// codes in registers (ad hoc, one process, the two taking turns on SmolLM2's matrices, 2 threads of a Zen 3 EPYC:
// 32 rows 1.07-1.10x as fast, 256 rows 0.99-1.05x).
template <int TYPE>
void panels_int8_avx2(const Activations& a, const uint8_t* w, const Layout& L, int64_t M, int64_t p0, int64_t p1, float* out, int64_t ldo) {
    if (M <= 2) {  // a decode step, or one with a guess to verify: a pass over each panel a row (ad hoc, one process:
        // two rows 0.94-1.09x as fast as the many-row kernel, ~1.03x in the median; three rows 0.84-0.97x)
        for (int64_t p = p0; p < p1; ++p)
            for (int64_t r = 0; r < M; ++r) panel_int8_row_avx2<TYPE>(w + p * L.panel_bytes(), L, a, r, out + r * ldo + PANEL * p);
        return;
    }
    // Rows a block at a time, so that the block's activations, read again for every panel, stay in L1/L2 (all 512
    // rows of a prefill chunk did not: 0.45 ms a row where 64 rows took 0.31)
    const int64_t block = std::max<int64_t>(4, (32 << 10) / L.K / 4 * 4);
    for (int64_t r0 = 0; r0 < M; r0 += block)
        for (int64_t p = p0; p < p1; ++p)
            for (int h = 0; h < 2; ++h)
                for (int64_t r = r0; r < std::min(M, r0 + block); r += 8) {
                    const uint8_t* panel = w + p * L.panel_bytes();
                    float* o = out + r * ldo + PANEL * p;
                    const bool fetch = r == r0;  // the block's first rows ask for the bytes ahead; the panel is then in L1
                    switch (std::min<int64_t>(8, M - r)) {
                        case 8: panel_int8_avx2<TYPE, 8>(panel, L, a, r, h, fetch, o, ldo); break;
                        case 7: panel_int8_avx2<TYPE, 7>(panel, L, a, r, h, fetch, o, ldo); break;
                        case 6: panel_int8_avx2<TYPE, 6>(panel, L, a, r, h, fetch, o, ldo); break;
                        case 5: panel_int8_avx2<TYPE, 5>(panel, L, a, r, h, fetch, o, ldo); break;
                        case 4: panel_int8_avx2<TYPE, 4>(panel, L, a, r, h, fetch, o, ldo); break;
                        case 3: panel_int8_avx2<TYPE, 3>(panel, L, a, r, h, fetch, o, ldo); break;
                        case 2: panel_int8_avx2<TYPE, 2>(panel, L, a, r, h, fetch, o, ldo); break;
                        default: panel_int8_avx2<TYPE, 1>(panel, L, a, r, h, fetch, o, ldo); break;
                    }
                }
}

void panels_int8(int type, const Activations& a, const uint8_t* w, const Layout& L, int64_t M, int64_t p0, int64_t p1, float* out,
                 int64_t ldo) {
    if (use_avx512) matmul_panels_avx512(type, a, w, L, M, p0, p1, out, ldo);
    else with_type(type, [&]<int TYPE>() { panels_int8_avx2<TYPE>(a, w, L, M, p0, p1, out, ldo); });
}

// fp32 activations: a row-format row's units dequantized in registers; xsum holds each row's sum of x per unit.
template <int TYPE, int R>
void rows_fp32_avx2(const uint8_t* w, const Layout& L, const float* x, const float* xsum, int64_t r0, float* out, int64_t ldo) {
    constexpr Info t = info(TYPE);
    __m256 acc[R];
    float offset[R] = {};
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < L.units; ++u) {
        const __m256i v = unit_values(TYPE, w, L, u);
        const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
        const __m256 c[4] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))};
        const UnitScale s = unit_scale(TYPE, w, L, u);
        for (int r = 0; r < R; ++r) {
            const float* xu = x + (r0 + r) * L.K + 32 * u;
            const __m256 dl = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(xu + 8), _mm256_mul_ps(c[0], _mm256_loadu_ps(xu)));
            const __m256 dh = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(xu + 24), _mm256_mul_ps(c[2], _mm256_loadu_ps(xu + 16)));
            if constexpr (t.per16) {
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s.lo), dl, acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s.hi), dh, acc[r]);
            } else {
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s.lo), _mm256_add_ps(dl, dh), acc[r]);
            }
            if constexpr (t.min) offset[r] += s.min * xsum[(r0 + r) * L.units + u];
        }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = hsum(acc[r]) + offset[r];
}

// Rows [n0, n1) of a packed tensor of N rows against all M fp32 activation rows, eight at a time.
template <int TYPE>
void rows_fp32(const float* x, const float* xsum, const uint8_t* w, const Layout& L, int64_t N, int64_t M, int64_t n0, int64_t n1,
               float* out, int64_t ldo) {
    std::vector<uint8_t> tmp(L.row_bytes);
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = row_at(TYPE, w, L, N, n, tmp.data());
        for (int64_t r = 0; r < M; r += 8) {
            float* o = out + r * ldo + n;
            switch (std::min<int64_t>(8, M - r)) {
                case 8: rows_fp32_avx2<TYPE, 8>(row, L, x, xsum, r, o, ldo); break;
                case 7: rows_fp32_avx2<TYPE, 7>(row, L, x, xsum, r, o, ldo); break;
                case 6: rows_fp32_avx2<TYPE, 6>(row, L, x, xsum, r, o, ldo); break;
                case 5: rows_fp32_avx2<TYPE, 5>(row, L, x, xsum, r, o, ldo); break;
                case 4: rows_fp32_avx2<TYPE, 4>(row, L, x, xsum, r, o, ldo); break;
                case 3: rows_fp32_avx2<TYPE, 3>(row, L, x, xsum, r, o, ldo); break;
                case 2: rows_fp32_avx2<TYPE, 2>(row, L, x, xsum, r, o, ldo); break;
                default: rows_fp32_avx2<TYPE, 1>(row, L, x, xsum, r, o, ldo); break;
            }
        }
    }
}

// The first largest of each of M rows' outputs in columns [c0, c1), NaN largest (NumPy's argmax): column c of row r
// is at out[r * ldo + c].
struct RowArgmax {
    std::vector<float> value;
    std::vector<int64_t> at;

    void scan(const float* out, int64_t ldo, int64_t M, int64_t c0, int64_t c1) {
        value.resize(M), at.resize(M);
        for (int64_t r = 0; r < M; ++r) {
            const float* row = out + r * ldo + c0;
            const int64_t n = c1 - c0;
            const float best = largest(row, n);  // then its first place: two vector passes, not a compare a value
            int64_t c = 0;
            if (best != best)
                while (row[c] == row[c]) ++c;
            else
                while (row[c] != best) ++c;
            value[r] = best, at[r] = c0 + c;
        }
    }

    // The largest of n values, NaN if any is.
    static float largest(const float* x, int64_t n) {
        __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, nan = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
            m0 = _mm256_max_ps(m0, a), m1 = _mm256_max_ps(m1, b);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
        float best = *std::max_element(lanes, lanes + 8);
        bool any_nan = _mm256_movemask_ps(nan) != 0;
        for (; i < n; ++i) best = std::max(best, x[i]), any_nan |= x[i] != x[i];
        return any_nan ? NAN : best;
    }

    // Takes `later`'s where it beats this one's (scans of later columns merged in their order keep the first).
    void merge(const RowArgmax& later) {
        for (size_t r = 0; r < value.size(); ++r)
            if (value[r] == value[r] && (later.value[r] > value[r] || later.value[r] != later.value[r]))
                value[r] = later.value[r], at[r] = later.at[r];
    }
};

// Each thread's scan of the columns it computed (a slot each; the calling thread's outside a parallel region, and the
// last rows'), merged in column order: the rows' argmax.
struct ArgmaxScans {
    std::vector<std::pair<int64_t, RowArgmax>> parts;

    explicit ArgmaxScans(bool wanted) { parts.resize(wanted ? at::get_num_threads() + 2 : 0); }

    void scan(const float* out, int64_t ldo, int64_t M, int64_t c0, int64_t c1, bool last_rows = false) {
        if (parts.empty() || c0 >= c1) return;
        const size_t slot = last_rows ? parts.size() - 1 : at::in_parallel_region() ? at::get_thread_num() : parts.size() - 2;
        auto& [first, part] = parts[slot];
        first = c0, part.scan(out, ldo, M, c0, c1);
    }

    void write(int64_t M, int64_t* argmax) {
        if (parts.empty()) return;
        std::erase_if(parts, [](const auto& p) { return p.second.value.empty(); });
        std::sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
        for (size_t i = 1; i < parts.size(); ++i) parts[0].second.merge(parts[i].second);
        std::copy_n(parts[0].second.at.begin(), M, argmax);
    }
};

}  // namespace

bool kvq::avx512_enabled() { return use_avx512; }

Layout kvq::checked_layout(int64_t type, int64_t K) {
    TORCH_CHECK(supported(static_cast<int>(type)), "GGUF type ", type, " has no kvserve kernel");
    TORCH_CHECK(K > 0 && K % info(static_cast<int>(type)).block_weights == 0, "a row of ", K, " weights is not whole blocks of type ", type);
    return layout(static_cast<int>(type), K);
}

void kvq::dequantize_f32(int type, const uint8_t* w, const Layout& L, int64_t N, int64_t n0, int64_t n1, float* out) {
    dequantize_rows(type, w, L, N, n0, n1, out);
}

// out[r * ldo + n] = x[r] . W[n] for M rows of K fp32 values and N packed rows (see quants.h).
void kvq::matmul(int type, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t activations,
                 float* out, int64_t ldo, int64_t* argmax) {
    if (M == 0 || N == 0) return;
    const kvt::Scope timed;
    const Layout L = layout(type, K);
    ArgmaxScans scans(argmax != nullptr);
    if (activations == FP32_ROWS) {
        thread_local std::vector<float> sums;
        sums.assign(M * L.units, 0.0f);
        for (int64_t i = 0; i < M * L.units; ++i)
            for (int j = 0; j < 32; ++j) sums[i] += x[i * 32 + j];
        const float* xsum = sums.data();  // this thread's buffer: its address taken here, not in the workers
        at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
            with_type(type, [&]<int TYPE>() { rows_fp32<TYPE>(x, xsum, w, L, N, M, n0, n1, out, ldo); });
            scans.scan(out, ldo, M, n0, n1);
        });
        scans.write(M, argmax);
        return;
    }
    thread_local Prepared prepared;
    thread_local std::vector<uint16_t> x_bf16;
    const bool bf16 = use_amx && activations == INT8_ROWS && M >= AMX_BF16_ROWS;
    if (bf16) x_bf16.resize(M * K);
    uint16_t* xb = x_bf16.data();  // this thread's buffer: its address taken here, not in the workers
    if (bf16) at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) { to_bf16_avx512(x + r0 * K, (r1 - r0) * K, xb + r0 * K); });
    else quantize_activations(type, x, M, K, prepared);
    const Activations a = prepared.view(L.units);
    const auto multiply = [&](const uint8_t* panels_at, int64_t p0, int64_t p1, float* o, int64_t ld) {
        if (bf16) matmul_panels_bf16_amx(type, xb, panels_at, L, M, p0, p1, o, ld);
        else panels_int8(type, a, panels_at, L, M, p0, p1, o, ld);
    };
    const int64_t panels = N / PANEL, rest = N % PANEL;
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
        multiply(w, p0, p1, out, ldo);
        scans.scan(out, ldo, M, p0 * PANEL, p1 * PANEL);
    });
    if (rest) {  // the last rows, in the row format: through a panel of their own, zeros past them
        thread_local std::vector<uint8_t> panel;
        thread_local std::vector<float> tail;
        panel.assign(L.panel_bytes(), 0), tail.resize(M * PANEL);
        for (int64_t l = 0; l < rest; ++l)
            lane_io<true>(type, L, panel.data(), l, const_cast<uint8_t*>(w) + (panels * PANEL + l) * L.row_bytes);
        multiply(panel.data(), 0, 1, tail.data(), PANEL);
        for (int64_t r = 0; r < M; ++r) std::copy_n(tail.data() + r * PANEL, rest, out + r * ldo + panels * PANEL);
        scans.scan(out, ldo, M, panels * PANEL, N, true);
    }
    scans.write(M, argmax);
}

// x [M, K] fp32 @ W.T for packed W [N, row bytes]: [M, N], multiplied as `activations` says (FP32_ROWS, INT8_ROWS,
// INT8_ROWS_ONLY). `argmax` (int64 [M]): each output row's argmax too.
static at::Tensor checked_matmul(const at::Tensor& input, const at::Tensor& w, int64_t type, int64_t activations, at::Tensor* argmax) {
    TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kFloat && input.device().is_cpu(), "x must be a 2-D fp32 CPU tensor");
    TORCH_CHECK(activations >= FP32_ROWS && activations <= INT8_ROWS_ONLY, "activations must be 0, 1 or 2, got ", activations);
    const at::Tensor x = input.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    const Layout L = checked_layout(type, K);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == L.row_bytes,
                "weights do not match K=", K, ": expected packed rows of ", L.row_bytes, " bytes");
    at::Tensor out = at::empty({M, N}, x.options());
    if (argmax) *argmax = at::empty({M}, x.options().dtype(at::kLong));
    kvq::matmul(static_cast<int>(type), x.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), N, activations, out.data_ptr<float>(), N,
                argmax ? argmax->data_ptr<int64_t>() : nullptr);
    return out;
}

at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t activations) {
    return checked_matmul(x, w, type, activations, nullptr);
}

// gguf_matmul, and each output row's argmax [M], found as the outputs land: a greedy step's tokens without a pass
// over its logits.
std::tuple<at::Tensor, at::Tensor> gguf_matmul_argmax(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t activations) {
    at::Tensor argmax;
    at::Tensor out = checked_matmul(x, w, type, activations, &argmax);
    return {out, argmax};
}

// A GGUF tensor's rows [N, row bytes] -> the kernels' layout [N, packed row bytes] (panels, then the rest).
at::Tensor gguf_pack(const at::Tensor& raw, int64_t type) {
    TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.device().is_cpu(),
                "raw must be contiguous uint8 [rows, bytes]");
    TORCH_CHECK(supported(static_cast<int>(type)), "GGUF type ", type, " has no kvserve kernel");
    const Info t = info(static_cast<int>(type));
    TORCH_CHECK(raw.size(1) % t.block_bytes == 0, "rows of ", raw.size(1), " bytes are not whole blocks of type ", type);
    const Layout L = checked_layout(type, raw.size(1) / t.block_bytes * t.block_weights);
    at::Tensor out = at::zeros({raw.size(0), L.row_bytes}, raw.options());
    const uint8_t* src = raw.data_ptr<uint8_t>();
    to_panels(static_cast<int>(type), L, raw.size(0), [&](int64_t n, uint8_t* tmp) {
        std::fill_n(tmp, L.row_bytes, 0);
        pack_row(static_cast<int>(type), src + n * raw.size(1), tmp, L);
        return tmp;
    }, out.data_ptr<uint8_t>());
    return out;
}

// `ids` as contiguous int64, each checked to be a row of w (packed rows of layout L).
static at::Tensor checked_rows(const at::Tensor& w, const at::Tensor& ids, const Layout& L) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == L.row_bytes,
                "w must be packed rows of ", L.row_bytes, " bytes");
    at::Tensor index = ids.to(at::kLong).contiguous();
    const int64_t* id = index.data_ptr<int64_t>();
    for (int64_t i = 0; i < index.numel(); ++i) TORCH_CHECK(id[i] >= 0 && id[i] < w.size(0), "row ", id[i], " is past ", w.size(0), " rows");
    return index;
}

// Rows `ids` of packed rows: packed rows themselves (a vocabulary's subset of an LM head).
at::Tensor gguf_select(const at::Tensor& w, const at::Tensor& ids, int64_t type, int64_t K) {
    const Layout L = checked_layout(type, K);
    const at::Tensor index = checked_rows(w, ids, L);
    const int64_t* id = index.data_ptr<int64_t>();
    at::Tensor out = at::zeros({index.numel(), L.row_bytes}, w.options());
    const uint8_t* wp = w.data_ptr<uint8_t>();
    to_panels(static_cast<int>(type), L, index.numel(),
              [&](int64_t n, uint8_t* tmp) { return row_at(static_cast<int>(type), wp, L, w.size(0), id[n], tmp); }, out.data_ptr<uint8_t>());
    return out;
}

// Rows `ids` of packed rows, as fp32 [n, K]: an embedding lookup, one row at a time (no packed copy, no threads).
at::Tensor gguf_rows(const at::Tensor& w, const at::Tensor& ids, int64_t type, int64_t K) {
    const Layout L = checked_layout(type, K);
    const at::Tensor index = checked_rows(w, ids, L);
    const int64_t* id = index.data_ptr<int64_t>();
    at::Tensor out = at::empty({index.numel(), K}, w.options().dtype(at::kFloat));
    for (int64_t i = 0; i < index.numel(); ++i)
        dequantize_f32(static_cast<int>(type), w.data_ptr<uint8_t>(), L, w.size(0), id[i], id[i] + 1, out.data_ptr<float>() + i * K);
    return out;
}

// Packed rows -> their values [N, K] in fp32 or bf16 (into `out` where given: a buffer reused across calls spares
// the page faults of a fresh allocation).
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type, int64_t K, at::ScalarType dtype, const c10::optional<at::Tensor>& into) {
    const Layout L = checked_layout(type, K);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == L.row_bytes && w.stride(1) == 1 && w.stride(0) == L.row_bytes,
                "w must be packed rows of ", L.row_bytes, " bytes");
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize to float32 or bfloat16");
    TORCH_CHECK(!into.has_value() || (into->scalar_type() == dtype && into->is_contiguous() && into->numel() >= w.size(0) * K),
                "out must be a contiguous buffer of ", w.size(0) * K, " values of the dtype");
    at::Tensor out = into.has_value() ? into->view(-1).narrow(0, 0, w.size(0) * K).view({w.size(0), K})
                                      : at::empty({w.size(0), K}, w.options().dtype(dtype));
    const uint8_t* wp = w.data_ptr<uint8_t>();
    at::parallel_for(0, (w.size(0) + PANEL - 1) / PANEL, 1, [&](int64_t p0, int64_t p1) {  // whole panels to each thread
        const int64_t begin = p0 * PANEL, end = std::min(p1 * PANEL, w.size(0));
        if (dtype == at::kFloat) dequantize_rows(static_cast<int>(type), wp, L, w.size(0), begin, end, out.data_ptr<float>() + begin * K);
        else dequantize_rows(static_cast<int>(type), wp, L, w.size(0), begin, end, out.data_ptr<at::BFloat16>() + begin * K);
    });
    return out;
}

std::string kernel_isa() { return use_amx ? "amx" : use_avx512 ? "avx512_vnni" : "avx2"; }

double kernel_seconds() { return double(kvt::kernel_ns().load()) * 1e-9; }
double attention_seconds() { return double(kvt::attention_ns().load()) * 1e-9; }

void set_kernel_isa(const std::string& name) {
    TORCH_CHECK(name == "avx2" || name == "avx512_vnni" || name == "amx", "kernel ISA must be avx2, avx512_vnni or amx, got ", name);
    TORCH_CHECK(name == "avx2" || kvq::avx512_supported(), "this CPU has no AVX-512 VNNI");
    TORCH_CHECK(name != "amx" || kvq::amx_supported(), "this CPU has no AMX bf16 tiles");
    use_avx512 = name != "avx2", use_amx = name == "amx";
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
    m.def("gguf_pack(Tensor raw, int type) -> Tensor", &gguf_pack);
    m.def("gguf_dequantize(Tensor w, int type, int K, ScalarType dtype, Tensor? out=None) -> Tensor", &gguf_dequantize);
    m.def("gguf_select(Tensor w, Tensor ids, int type, int K) -> Tensor", &gguf_select);
    m.def("gguf_rows(Tensor w, Tensor ids, int type, int K) -> Tensor", &gguf_rows);
    m.def("gguf_matmul(Tensor x, Tensor w, int type, int activations=0) -> Tensor", &gguf_matmul);
    m.def("gguf_matmul_argmax(Tensor x, Tensor w, int type, int activations=0) -> (Tensor, Tensor)", &gguf_matmul_argmax);
    m.def("kernel_isa() -> str", &kernel_isa);
    m.def("set_kernel_isa(str name) -> ()", &set_kernel_isa);
    m.def("kernel_seconds() -> float", &kernel_seconds);
    m.def("attention_seconds() -> float", &attention_seconds);
}
