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
#include <vector>

#include "quants.h"
#include "simd.h"
#include "timer.h"

namespace kvq {
bool avx512_supported();
void matmul_rows_avx512(int type, const Activations& a, const uint8_t* w, const Layout& L, int64_t M, int64_t n0, int64_t n1,
                        float* out, int64_t ldo);
void dequantize_rows_avx512(int type, const uint8_t* w, const Layout& L, int64_t n0, int64_t n1, float* out);
void dequantize_rows_avx512(int type, const uint8_t* w, const Layout& L, int64_t n0, int64_t n1, uint16_t* out);
bool avx512_enabled();
}  // namespace kvq

namespace {
using namespace kvq;

bool use_avx512 = [] {
    const char* forced = std::getenv("KVSERVE_ISA");
    return avx512_supported() && !(forced && std::string(forced) == "avx2");
}();

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

// ---- dequantizing ----

inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }

inline void store8(at::BFloat16* out, __m256 v) {  // round to nearest even, as torch's .to(bfloat16)
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
}

// A row's values as fp32 or bf16: s * (c - o), plus m where the type has one (the gguf package's arithmetic: a
// multiply, then an add, never fused, so the values are bit for bit the package's).
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

template <typename T>
void dequantize_rows(int type, const uint8_t* w, const Layout& L, int64_t n0, int64_t n1, T* out) {
    with_type(type, [&]<int TYPE>() {
        for (int64_t n = n0; n < n1; ++n) dequantize_row<TYPE>(w + n * L.row_bytes, L, out + n * L.K);
    });
}

// ---- activations ----

// Rows of x quantized per 32 values and laid out as the int8 kernels read them (kvq::Activations).
struct Prepared {
    std::vector<int8_t> xa, xb;
    std::vector<float> xs, xm, xsum;
    std::vector<int32_t> corr, corr_b;

    Activations view(int64_t rows) const {
        return {xa.data(), xb.data(), xs.data(), corr.data(), corr_b.data(), xm.data(), xsum.data(), rows};
    }
};

void quantize_activations(int type, const float* x, int64_t M, int64_t K, Prepared& p) {
    const Info t = info(type);
    const int64_t units = K / 32, groups = (units + 3) / 4, n = M * groups;
    const bool lane_mins = t.min && t.kquant;  // xm: only the K-quants' min term reads it
    p.xa.assign(64 * n, 0), p.xb.assign(64 * n, 0), p.xs.assign(16 * n, 0.0f), p.xm.assign(lane_mins ? 16 * n : 0, 0.0f);
    p.xsum.assign(16 * M * ((units + 15) / 16), 0.0f);
    p.corr.assign(16 * n, 0), p.corr_b.assign(t.per16 ? 16 * n : 0, 0);
    const Activations view = p.view(M);
    for (int64_t r = 0; r < M; ++r) {
        for (int64_t u = 0; u < units; ++u) {
            const float* xu = x + r * K + 32 * u;
            __m256 amax = _mm256_setzero_ps();
            const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
            for (int i = 0; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(xu + 8 * i), abs_mask));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float scale = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.0f;
            const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
            int32_t q[32];
            for (int i = 0; i < 4; ++i) {  // round half to even, as std::nearbyint and torch.round
                const __m256 y = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xu + 8 * i), _mm256_set1_ps(inv)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * i), _mm256_cvtps_epi32(y));
            }
            const int64_t i = (u / 4) * M + r, p4 = u % 4;  // group-major (Activations::at)
            int32_t total = 0;
            for (int l = 0; l < 4; ++l) {
                int32_t sa = 0, sb = 0;
                for (int j = 4 * l; j < 4 * l + 4; ++j) {
                    p.xa[64 * i + 16 * p4 + j] = static_cast<int8_t>(q[j]), sa += q[j];
                    p.xb[64 * i + 16 * p4 + j] = static_cast<int8_t>(q[j + 16]), sb += q[j + 16];
                }
                p.xs[16 * i + 4 * p4 + l] = scale;
                if (lane_mins) p.xm[16 * i + 4 * p4 + l] = scale * float(sa + sb);
                p.corr[16 * i + 4 * p4 + l] = t.offset * (t.per16 ? sa : sa + sb);
                if (t.per16) p.corr_b[16 * i + 4 * p4 + l] = t.offset * sb;
                total += sa + sb;
            }
            p.xsum[view.unit_at(u, r)] = scale * float(total);
        }
    }
}

// ---- AVX2 kernels: one weight row against R activation rows ----

inline __m256i load_bytes(const uint8_t* p, int valid) {  // 32 bytes, or 16 and zeros
    return valid == 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                       : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Integer dot products of unsigned codes with int8 activations, 4 bytes per int32 lane.
inline __m256i dot_lanes(__m256i codes, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
}

// Half h of group g: two units' low-half and high-half codes, 32 bytes each (unit 2h in the first 16).
template <int TYPE>
inline void half_codes(const uint8_t* w, const Layout& L, int64_t g, int h, int units, __m256i* lo, __m256i* hi) {
    constexpr Info t = info(TYPE);
    const int valid = 16 * units;
    if constexpr (t.bits == 8) {
        const int64_t n = std::min<int64_t>(4, L.units - 4 * g);
        *lo = load_bytes(w + L.codes + 128 * g + 32 * h, valid);
        *hi = load_bytes(w + L.codes + 128 * g + 16 * n + 32 * h, valid);
        return;
    }
    const __m256i b = load_bytes(w + L.codes + 64 * g + 32 * h, valid), mask = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(b, mask), *hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
    for (int plane = 0; plane < (t.bits == 6 ? 2 : t.bits == 5 ? 1 : 0); ++plane) {
        const uint8_t* at = w + (plane ? L.hi2 : L.hi1) + 16 * g;
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(16 << plane));
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(bytes_from_bits(static_cast<uint32_t>(load64(at) >> (32 * h))), bit));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(bytes_from_bits(static_cast<uint32_t>(load64(at + 8) >> (32 * h))), bit));
    }
}

// The first `bytes` (even, at most 8) bytes at p, zeros after them, without reading past them (nor a memcpy call).
inline uint64_t load_upto8(const uint8_t* p, int bytes) {
    if (bytes == 8) return load64(p);
    uint64_t v = 0;
    if (bytes & 4) {
        uint32_t x;
        std::memcpy(&x, p, 4);
        v = x;
    }
    if (bytes & 2) {
        uint16_t x;
        std::memcpy(&x, p + (bytes & 4), 2);
        v |= uint64_t(x) << (8 * (bytes & 4));
    }
    return v;
}

// The same for up to 16 bytes.
inline __m128i load_upto16(const uint8_t* p, int bytes) {
    if (bytes == 16) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return bytes <= 8 ? _mm_cvtsi64_si128(static_cast<int64_t>(load_upto8(p, bytes)))
                      : _mm_set_epi64x(static_cast<int64_t>(load_upto8(p + 8, bytes - 8)), static_cast<int64_t>(load64(p)));
}

// The scales of a group's n units, one vector load and conversion for all: lane p holds unit p's scale (Q6_K:
// lanes 2p and 2p + 1 hold its low and high halves' scales).
template <int TYPE>
inline __m256 group_scales(const uint8_t* w, const Layout& L, int64_t g, int n) {
    constexpr Info t = info(TYPE);
    if constexpr (!t.kquant) {
        return _mm256_castps128_ps256(_mm_cvtph_ps(load_upto16(w + L.scales + 8 * g, 2 * n)));
    } else {  // K-quants' groups are whole: K is whole blocks of 256
        const __m256 d = _mm256_set1_ps(fp16(w + L.super_scales + 2 * (g / 2)));
        if constexpr (t.per16) return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_upto16(w + L.scales + 8 * g, 8))));
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load_upto16(w + L.scales + 4 * g, 4))));
    }
}

// Lanes 0-3 of the result from lane i of v, lanes 4-7 from lane j.
inline __m256 pair_lanes(__m256 v, int i, int j) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(i, i, i, i, j, j, j, j));
}

template <int TYPE, int R>
void rows_int8_avx2(const uint8_t* w, const Layout& L, const Activations& a, int64_t r0, float* out, int64_t ldo) {
    constexpr Info t = info(TYPE);
    __m256 acc[R];
    __m128 acc_min[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), acc_min[r] = _mm_setzero_ps();
    for (int64_t g = 0; g < L.groups; ++g) {
        const int n = static_cast<int>(std::min<int64_t>(4, L.units - 4 * g));
        const __m256 scales = group_scales<TYPE>(w, L, g, n);
        for (int h = 0; h < 2 && 2 * h < n; ++h) {
            const int units = std::min(2, n - 2 * h);
            __m256i lo, hi;
            half_codes<TYPE>(w, L, g, h, units, &lo, &hi);
            const __m256 s_lo = t.per16 ? pair_lanes(scales, 4 * h, 4 * h + 2) : pair_lanes(scales, 2 * h, 2 * h + 1);
            const __m256 s_hi = t.per16 ? pair_lanes(scales, 4 * h + 1, 4 * h + 3) : s_lo;
            for (int r = 0; r < R; ++r) {
                const int64_t i = a.at(g, r0 + r);
                const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xa + 64 * i + 32 * h));
                const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xb + 64 * i + 32 * h));
                const __m256 xs = _mm256_loadu_ps(a.xs + 16 * i + 8 * h);
                const __m256i corr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.corr + 16 * i + 8 * h));
                if constexpr (t.bits == 8) {  // maddubs would saturate at 255 * 127 * 2: signed weights, |w| * sign(x, w)
                    const __m256i wl = _mm256_xor_si256(lo, _mm256_set1_epi8(static_cast<char>(0x80)));
                    const __m256i wh = _mm256_xor_si256(hi, _mm256_set1_epi8(static_cast<char>(0x80)));
                    const __m256i d = _mm256_add_epi32(dot_lanes(_mm256_sign_epi8(wl, wl), _mm256_sign_epi8(xa, wl)),
                                                       dot_lanes(_mm256_sign_epi8(wh, wh), _mm256_sign_epi8(xb, wh)));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s_lo, xs), acc[r]);
                } else if constexpr (t.per16) {
                    const __m256i corr_b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.corr_b + 16 * i + 8 * h));
                    const __m256i dl = _mm256_sub_epi32(dot_lanes(lo, xa), corr);
                    const __m256i dh = _mm256_sub_epi32(dot_lanes(hi, xb), corr_b);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dl), _mm256_mul_ps(s_lo, xs), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dh), _mm256_mul_ps(s_hi, xs), acc[r]);
                } else {  // 4- and 5-bit codes: both halves' int16 pairs add without overflow
                    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb));
                    __m256i d = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
                    if constexpr (t.offset != 0) d = _mm256_sub_epi32(d, corr);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s_lo, xs), acc[r]);
                }
            }
        }
        if constexpr (t.min && t.kquant) {  // each unit's min times its sum of x: m = -dmin * mc
            const __m128 m = _mm_mul_ps(_mm_set1_ps(-fp16(w + L.super_mins + 2 * (g / 2))),
                                        _mm_cvtepi32_ps(_mm_cvtepu8_epi32(load_upto16(w + L.mins + 4 * g, 4))));
            for (int r = 0; r < R; ++r) acc_min[r] = _mm_fmadd_ps(m, _mm_loadu_ps(a.xsum + a.unit_at(4 * g, r0 + r)), acc_min[r]);
        }
    }
    if constexpr (t.min && !t.kquant)  // Q4_1/Q5_1: the fp16 mins, eight units an FMA, once a row
        for (int64_t u = 0; u < L.units; u += 8) {
            const __m256 m = _mm256_cvtph_ps(load_upto16(w + L.mins + 2 * u, 2 * static_cast<int>(std::min<int64_t>(8, L.units - u))));
            for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(a.xsum + a.unit_at(u, r0 + r)), acc[r]);
        }
    for (int r = 0; r < R; ++r) out[r * ldo] = hsum(acc[r]) + hsum(acc_min[r]);
}

// fp32 activations: each unit's values dequantized in registers; xsum holds each row's sum of x per unit.
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

// Every weight row in [n0, n1) against all M activation rows, eight at a time (each block decoded once per eight).
template <int TYPE, bool INT8>
void matmul_rows_avx2(const Activations& a, const float* x, const float* xsum, const uint8_t* w, const Layout& L, int64_t M,
                      int64_t n0, int64_t n1, float* out, int64_t ldo) {
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = w + n * L.row_bytes;
        for (int64_t r = 0; r < M; r += 8) {
            float* o = out + r * ldo + n;
#define KVQ_ROWS(R) INT8 ? rows_int8_avx2<TYPE, R>(row, L, a, r, o, ldo) : rows_fp32_avx2<TYPE, R>(row, L, x, xsum, r, o, ldo)
            switch (std::min<int64_t>(8, M - r)) {
                case 8: KVQ_ROWS(8); break;
                case 7: KVQ_ROWS(7); break;
                case 6: KVQ_ROWS(6); break;
                case 5: KVQ_ROWS(5); break;
                case 4: KVQ_ROWS(4); break;
                case 3: KVQ_ROWS(3); break;
                case 2: KVQ_ROWS(2); break;
                default: KVQ_ROWS(1); break;
            }
#undef KVQ_ROWS
        }
    }
}

template <bool INT8>
void matmul_rows_avx2(int type, const Activations& a, const float* x, const float* xsum, const uint8_t* w, const Layout& L,
                      int64_t M, int64_t n0, int64_t n1, float* out, int64_t ldo) {
    with_type(type, [&]<int TYPE>() { matmul_rows_avx2<TYPE, INT8>(a, x, xsum, w, L, M, n0, n1, out, ldo); });
}

}  // namespace

bool kvq::avx512_enabled() { return use_avx512; }

Layout kvq::checked_layout(int64_t type, int64_t K) {
    TORCH_CHECK(supported(static_cast<int>(type)), "GGUF type ", type, " has no kvserve kernel");
    TORCH_CHECK(K > 0 && K % info(static_cast<int>(type)).block_weights == 0, "a row of ", K, " weights is not whole blocks of type ", type);
    return layout(static_cast<int>(type), K);
}

// A GGUF tensor's rows [N, row bytes] -> the kernels' layout [N, packed row bytes].
at::Tensor gguf_pack(const at::Tensor& raw, int64_t type) {
    TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.device().is_cpu(),
                "raw must be contiguous uint8 [rows, bytes]");
    TORCH_CHECK(supported(static_cast<int>(type)), "GGUF type ", type, " has no kvserve kernel");
    const Info t = info(static_cast<int>(type));
    TORCH_CHECK(raw.size(1) % t.block_bytes == 0, "rows of ", raw.size(1), " bytes are not whole blocks of type ", type);
    const Layout L = checked_layout(type, raw.size(1) / t.block_bytes * t.block_weights);
    at::Tensor out = at::zeros({raw.size(0), L.row_bytes}, raw.options());
    const uint8_t* src = raw.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    at::parallel_for(0, raw.size(0), 64, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) pack_row(static_cast<int>(type), src + n * raw.size(1), dst + n * L.row_bytes, L);
    });
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
    at::parallel_for(0, w.size(0), 16, [&](int64_t begin, int64_t end) {
        if (dtype == at::kFloat) kvq::dequantize_f32(static_cast<int>(type), wp, L, begin, end, out.data_ptr<float>());
        else if (use_avx512) dequantize_rows_avx512(static_cast<int>(type), wp, L, begin, end, reinterpret_cast<uint16_t*>(out.data_ptr()));
        else dequantize_rows(static_cast<int>(type), wp, L, begin, end, out.data_ptr<at::BFloat16>());
    });
    return out;
}

void kvq::dequantize_f32(int type, const uint8_t* w, const Layout& L, int64_t n0, int64_t n1, float* out) {
    if (use_avx512) dequantize_rows_avx512(type, w, L, n0, n1, out);
    else dequantize_rows(type, w, L, n0, n1, out);
}

// out[r * ldo + n] = x[r] . W[n] for M rows of K fp32 values and N packed rows (see quants.h).
void kvq::matmul(int type, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, bool int8_activations,
                 float* out, int64_t ldo) {
    if (M == 0 || N == 0) return;
    const kvt::Scope timed;
    const Layout L = layout(type, K);
    thread_local Prepared prepared;
    thread_local std::vector<float> sums;
    if (int8_activations) {
        quantize_activations(type, x, M, K, prepared);
    } else {
        sums.assign(M * L.units, 0.0f);
        for (int64_t i = 0; i < M * L.units; ++i)
            for (int j = 0; j < 32; ++j) sums[i] += x[i * 32 + j];
    }
    // the buffers are this thread's: take their addresses here, not in the workers
    const Activations a = prepared.view(M);
    const float* xsum = sums.data();
    const bool avx512 = int8_activations && use_avx512;
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        if (avx512) matmul_rows_avx512(type, a, w, L, M, n0, n1, out, ldo);
        else if (int8_activations) matmul_rows_avx2<true>(type, a, x, xsum, w, L, M, n0, n1, out, ldo);
        else matmul_rows_avx2<false>(type, a, x, xsum, w, L, M, n0, n1, out, ldo);
    });
}

// x [M, K] fp32 @ W.T for packed W [N, row bytes]: [M, N]. int8_activations: x quantized per 32 values first.
at::Tensor gguf_matmul(const at::Tensor& input, const at::Tensor& w, int64_t type, bool int8_activations) {
    TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kFloat && input.device().is_cpu(), "x must be a 2-D fp32 CPU tensor");
    const at::Tensor x = input.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    const Layout L = checked_layout(type, K);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == L.row_bytes,
                "weights do not match K=", K, ": expected packed rows of ", L.row_bytes, " bytes");
    at::Tensor out = at::empty({M, N}, x.options());
    kvq::matmul(static_cast<int>(type), x.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), N, int8_activations, out.data_ptr<float>(), N);
    return out;
}

std::string kernel_isa() { return use_avx512 ? "avx512_vnni" : "avx2"; }

double kernel_seconds() { return double(kvt::kernel_ns().load()) * 1e-9; }

void set_kernel_isa(const std::string& name) {
    TORCH_CHECK(name == "avx2" || name == "avx512_vnni", "kernel ISA must be avx2 or avx512_vnni, got ", name);
    TORCH_CHECK(name == "avx2" || kvq::avx512_supported(), "this CPU has no AVX-512 VNNI");
    use_avx512 = name == "avx512_vnni";
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
    m.def("gguf_pack(Tensor raw, int type) -> Tensor", &gguf_pack);
    m.def("gguf_dequantize(Tensor w, int type, int K, ScalarType dtype, Tensor? out=None) -> Tensor", &gguf_dequantize);
    m.def("gguf_matmul(Tensor x, Tensor w, int type, bool int8_activations=False) -> Tensor", &gguf_matmul);
    m.def("kernel_isa() -> str", &kernel_isa);
    m.def("set_kernel_isa(str name) -> ()", &set_kernel_isa);
    m.def("kernel_seconds() -> float", &kernel_seconds);
}
