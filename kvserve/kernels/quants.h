// GGUF quantized weights in the layout kvserve's matmul kernels read, shared by the AVX2 and AVX-512 builds.
//
// Every supported type is a sequence of 32-weight units, each weight an unsigned code c with a per-unit scale s
// (two for Q6_K: one per 16 weights), an offset o per type and a per-unit min m:  w = s * (c - o) + m.
//   Q4_0 c 4 bits, o 8          Q4_1 4 bits, min        Q5_0 5 bits, o 16      Q5_1 5 bits, min
//   Q8_0 8 bits (w + 128), o 128                        Q4_K / Q5_K 4 / 5 bits, s = d * sc, m = -dmin * mc (per 256)
//   Q6_K 6 bits, o 32, s = d * sc per 16 weights
// A packed row is the GGUF row's own bits rearranged into planes ("weights in the layout the kernel wants"):
//   codes   4-bit: 16 bytes a unit, byte j holding weight j (low nibble) and weight 16 + j (high nibble); the
//           units of a group of four are 64 contiguous bytes, so one 512-bit load holds 128 weights.
//           8-bit: per group, the low halves of its units (16 bytes each), then their high halves.
//   hi1/hi2 5-bit and 6-bit types: bit 4 (and 5) of each code as two 64-bit masks a group, one bit per byte of
//           the group's low-half and high-half code vectors.
//   scales  fp16 per unit (legacy types); u8 (Q4_K/Q5_K) or i8 per 16 weights (Q6_K) with an fp16 d per 256.
//   mins    fp16 per unit (Q4_1/Q5_1); u8 with an fp16 dmin per 256 (Q4_K/Q5_K).
// Row bytes equal the file's for every type but Q4_K/Q5_K (6-bit scales unpacked to bytes: +4 bytes per 256).
//
// That is the row format. The kernels read rows a panel of 16 at a time: a tensor's rows [0, 16 * (N / 16)) lie
// as panels (16 * row bytes each, the same bits interleaved so that lane l of every vector belongs to row l), the
// last N % 16 rows in the row format. A panel is, per GGUF block, a header (K-quants: the 16 rows' d, then dmin,
// fp16) and then per unit:
//   codes   4-bit: four 64-byte vectors, vector j lane l = row l's code bytes 4j..4j+3 (weights 4j.. in the low
//           nibbles, 16 + 4j.. in the high ones); 8-bit: eight vectors, vector j lane l = row l's weights 4j..4j+3.
//   hi1/hi2 per 4-bit vector j, a 64-bit mask for its low nibbles and one for its high nibbles: bit 4l + b.
//   scales  16 fp16 (legacy types), 16 u8 (Q4_K/Q5_K), 16 i8 for weights 0-15 and 16 for 16-31 (Q6_K).
//   mins    16 fp16 (Q4_1/Q5_1), 16 u8 (Q4_K/Q5_K).
// One integer dot product instruction then covers 16 rows, and a unit's scales apply once per 16 rows and 32
// weights instead of once per 4 weights of a row.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kvq {

// ggml type ids (ggml.h)
enum Type { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Info {
    int bits;         // code bits: 4, 5, 6 or 8
    int offset;       // o
    bool min;         // a per-unit min
    bool kquant;      // scales (and mins) per unit as integers times an fp16 per 256 weights
    bool per16;       // a scale per 16 weights (Q6_K)
    int block_weights, block_bytes;  // the GGUF block
};

constexpr Info info(int type) {
    switch (type) {
        case Q4_0: return {4, 8, false, false, false, 32, 18};
        case Q4_1: return {4, 0, true, false, false, 32, 20};
        case Q5_0: return {5, 16, false, false, false, 32, 22};
        case Q5_1: return {5, 0, true, false, false, 32, 24};
        case Q8_0: return {8, 128, false, false, false, 32, 34};
        case Q4_K: return {4, 0, true, true, false, 256, 144};
        case Q5_K: return {5, 0, true, true, false, 256, 176};
        case Q6_K: return {6, 32, false, true, true, 256, 210};
        default: return {0, 0, false, false, false, 0, 0};
    }
}

// f.template operator()<TYPE>() for a run-time type id: the one place a type id becomes a template argument.
template <typename F>
inline void with_type(int type, F&& f) {
    switch (type) {
        case Q4_0: return f.template operator()<Q4_0>();
        case Q4_1: return f.template operator()<Q4_1>();
        case Q5_0: return f.template operator()<Q5_0>();
        case Q5_1: return f.template operator()<Q5_1>();
        case Q8_0: return f.template operator()<Q8_0>();
        case Q4_K: return f.template operator()<Q4_K>();
        case Q5_K: return f.template operator()<Q5_K>();
        default: return f.template operator()<Q6_K>();
    }
}

constexpr int64_t PANEL = 16;  // rows a panel interleaves
constexpr int64_t AHEAD = 4096;  // the kernels ask for a panel's bytes this far ahead of their use

// Byte offsets of a packed row's planes, and of a panel's unit parts (p_*, from the unit's start).
struct Layout {
    int64_t K, units, groups, supers;
    int64_t codes, hi1, hi2, scales, super_scales, mins, super_mins, row_bytes;
    int64_t block_units, block_shift, header, unit_bytes, p_hi1, p_hi2, p_scales, p_mins;

    int64_t panel_bytes() const { return PANEL * row_bytes; }
    // where unit u of a panel starts (its block's header lies `header` bytes before its first unit); a block's units
    // are 1 or 8, so a shift and a mask, not the division that sat on the panel kernels' path once a unit
    int64_t unit_at(int64_t u) const {
        return (u >> block_shift) * (header + block_units * unit_bytes) + header + (u & (block_units - 1)) * unit_bytes;
    }
};

inline Layout layout(int type, int64_t K) {
    const Info t = info(type);
    Layout L{};
    L.K = K, L.units = K / 32, L.groups = (L.units + 3) / 4, L.supers = K / 256;
    int64_t at = 0;
    L.codes = at, at += (t.bits == 8 ? 32 : 16) * L.units;
    if (t.bits == 5 || t.bits == 6) L.hi1 = at, at += 16 * L.groups;
    if (t.bits == 6) L.hi2 = at, at += 16 * L.groups;
    L.scales = at, at += t.kquant ? (t.per16 ? 2 : 1) * L.units : 2 * L.units;
    if (t.kquant) L.super_scales = at, at += 2 * L.supers;
    if (t.min) L.mins = at, at += t.kquant ? L.units : 2 * L.units;
    if (t.min && t.kquant) L.super_mins = at, at += 2 * L.supers;
    L.row_bytes = at;
    L.block_units = t.block_weights / 32, L.block_shift = __builtin_ctzll(uint64_t(L.block_units));
    L.header = t.kquant ? (t.min ? 64 : 32) : 0;
    at = t.bits == 8 ? 512 : 256;
    if (t.bits == 5 || t.bits == 6) L.p_hi1 = at, at += 64;
    if (t.bits == 6) L.p_hi2 = at, at += 64;
    L.p_scales = at, at += t.kquant && !t.per16 ? 16 : 32;
    if (t.min) L.p_mins = at, at += t.kquant ? 16 : 32;
    L.unit_bytes = at;
    return L;
}

inline float fp16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

inline uint64_t load64(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
}

// Where unit u's 16 low-half and 16 high-half code bytes lie in an 8-bit row (see the layout above).
inline void q8_halves(const Layout& L, int64_t u, int64_t* lo, int64_t* hi) {
    const int64_t g = u / 4, p = u % 4, n = L.units - 4 * g < 4 ? L.units - 4 * g : 4;
    *lo = L.codes + 128 * g + 16 * p;
    *hi = L.codes + 128 * g + 16 * n + 16 * p;
}

// A unit's scales (low and high 16 weights) and min: w = s * (c - o) + m.
struct UnitScale {
    float lo, hi, min;
};

inline UnitScale unit_scale(int type, const uint8_t* row, const Layout& L, int64_t u) {
    const Info t = info(type);
    if (!t.kquant) {
        const float s = fp16(row + L.scales + 2 * u);
        return {s, s, t.min ? fp16(row + L.mins + 2 * u) : 0.0f};
    }
    const float d = fp16(row + L.super_scales + 2 * (u / 8));
    if (t.per16) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(row + L.scales);
        return {d * float(sc[2 * u]), d * float(sc[2 * u + 1]), 0.0f};
    }
    const float s = d * float(row[L.scales + u]);
    return {s, s, -(fp16(row + L.super_mins + 2 * (u / 8)) * float(row[L.mins + u]))};
}

// Sets the bits unit_bits reads.
inline void set_unit_bits(uint8_t* plane, int64_t u, uint32_t bits) {
    const int64_t g = u / 4, p = u % 4;
    const uint64_t keep = ~(uint64_t(0xFFFF) << (16 * p));
    const uint64_t lo = (load64(plane + 16 * g) & keep) | (uint64_t(bits & 0xFFFF) << (16 * p));
    const uint64_t hi = (load64(plane + 16 * g + 8) & keep) | (uint64_t(bits >> 16) << (16 * p));
    std::memcpy(plane + 16 * g, &lo, 8), std::memcpy(plane + 16 * g + 8, &hi, 8);
}

// 0xFF in byte i where bit i of `bits` is set (llama.cpp's bytes_from_bits_32).
inline __m256i bytes_from_bits(uint32_t bits) {
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
    return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

// Bits [16p, 16p + 16) of a group's low-half and high-half masks as one unit's 32 bits, in weight order.
inline uint32_t unit_bits(const uint8_t* plane, int64_t u) {
    const int64_t g = u / 4, p = u % 4;
    const uint64_t lo = load64(plane + 16 * g), hi = load64(plane + 16 * g + 8);
    return static_cast<uint32_t>((lo >> (16 * p)) & 0xFFFF) | static_cast<uint32_t>(((hi >> (16 * p)) & 0xFFFF) << 16);
}

// A unit's 32 codes in weight order, minus the type's offset: signed bytes (every type's c - o fits).
inline __m256i unit_values(int type, const uint8_t* row, const Layout& L, int64_t u) {
    const Info t = info(type);
    __m256i c;
    if (t.bits == 8) {
        int64_t lo, hi;
        q8_halves(L, u, &lo, &hi);
        c = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + hi)),
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + lo)));
        return _mm256_xor_si256(c, _mm256_set1_epi8(static_cast<char>(0x80)));  // c - 128
    }
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + L.codes + 16 * u));
    const __m128i mask = _mm_set1_epi8(0x0F);
    c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
    if (t.bits >= 5) c = _mm256_or_si256(c, _mm256_and_si256(bytes_from_bits(unit_bits(row + L.hi1, u)), _mm256_set1_epi8(16)));
    if (t.bits == 6) c = _mm256_or_si256(c, _mm256_and_si256(bytes_from_bits(unit_bits(row + L.hi2, u)), _mm256_set1_epi8(32)));
    return t.offset ? _mm256_sub_epi8(c, _mm256_set1_epi8(static_cast<char>(t.offset))) : c;
}

// The layout of rows of K weights of `type`, after checking (TORCH_CHECK) that a kernel reads the type and that
// K is whole blocks of it (quant_matmul.cpp).
Layout checked_layout(int64_t type, int64_t K);

// What matmul multiplies the packed weights by (its `activations`; kernels/__init__.py: Activations): the fp32 rows;
// the rows quantized to int8 per 32 values, a step of many rows in bf16 on AMX's tiles where the CPU has them; or
// int8 rows at every step size, so that a row's numbers never depend on the rows beside it (batch_invariant).
enum : int64_t { FP32_ROWS = 0, INT8_ROWS = 1, INT8_ROWS_ONLY = 2 };

// out[r * ldo + n] = x[r] . W[n] for M rows of K fp32 values and N packed rows of `type` (panels, then the rest),
// multiplied as `activations` says (quant_matmul.cpp; for the fused layer ops too). `argmax`: also each row's first
// largest output's n (a NaN counts as largest, as in NumPy), found as each thread's outputs land.
void matmul(int type, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t activations,
            float* out, int64_t ldo, int64_t* argmax = nullptr);

// Rows [n0, n1) of a packed tensor `w` of N rows of `type` as fp32, row n at out + (n - n0) * L.K (quant_matmul.cpp).
void dequantize_f32(int type, const uint8_t* w, const Layout& L, int64_t N, int64_t n0, int64_t n1, float* out);

// The int8-activation kernels' view of M rows of x, prepared once a call: each row quantized per 32 values
// (scale = max|x| / 127, codes round(x / scale)). Unit u of row r is entry r * units + u: its 32 codes at q + 32 *
// entry, its scale xs, its sum of dequantized values xsum (the mins' term), and the type's offset times the sum
// of its first 16 codes and of its last 16 (corr_lo, corr_hi: the offset's term).
struct Activations {
    const int8_t* q;
    const float *xs, *xsum;
    const int32_t *corr_lo, *corr_hi;
    int64_t units;

    int64_t at(int64_t r, int64_t u) const { return r * units + u; }
};

}  // namespace kvq
