// Decode attention straight from the paged KV cache: each sequence's one query attends to its first
// context_len positions, reading K/V in place through its block table, with no gathered copy and no
// padding to the longest sequence.
//
// K and V may be stored in any kvserve.kv format: float rows (fp32, fp16, bf16), and with AVX-512 every quantized
// format's codes, are read where they lie and widened in registers; on AVX2 quantized blocks are dequantized a block
// at a time into a small buffer that stays in L1, so the cache is read at its packed size. Block ids past the main pool name blocks of the residual pool (kivi2's newest tokens, in a float format).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "paged_attention.h"
#include "simd.h"
#include "timer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

namespace kvq {
bool avx512_enabled();  // quant_matmul.cpp: the CPU has AVX-512 VNNI and KVSERVE_ISA does not force AVX2
}
namespace kva {  // paged_attention_avx512.cpp: rows in any format (meta: their scales; channel: per-channel ones), head_dim a multiple of 64
void scores_avx512(int format, const float* q, int64_t heads, const void* k, const uint16_t* meta, const float* channel, const int64_t* rows,
                   int64_t n, int64_t D, float scale, float* out, int64_t out_stride, const char* ahead,
                   const char* ahead_end);  // heads: 1-3 of one KV head (a head_runs run); ahead: lines to fetch meanwhile
void values_avx512(int format, const float* p, int64_t p_stride, int64_t heads, const void* v, const uint16_t* meta, const float* channel,
                   const int64_t* rows, int64_t n, int64_t D, float* out, int64_t out_stride, const char* ahead, const char* ahead_end);
}  // namespace kva

namespace {

// kvserve.kv.formats codes
enum Format { F32 = 0, F16 = 1, BF16 = 2, E4M3 = 3, E5M2 = 4, INT8 = 5, INT4 = 6, INT2_TOKEN = 7, INT2_CHANNEL = 8 };
constexpr int64_t GROUP = 32;  // values per scale along head_dim

// Values as a float cache stores them: fp32, fp16 or bf16, read in place and widened in registers.
struct Half16 { uint16_t bits; };
struct Brain16 { uint16_t bits; };

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const Brain16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// Where a block's rows lie for the kernels: the values of a store (or a buffer) in a format, with its scales.
struct Source {
    int format;
    const void* data;
    const uint16_t* meta;
    const float* channel;  // 2-bit per channel: the block and head's scales, then their minimums
};

// f(the values as the typed pointer load8 reads) for a float Source.
template <typename F>
void with_floats(const Source& src, F&& f) {
    if (src.format == F32) f(static_cast<const float*>(src.data));
    else if (src.format == F16) f(static_cast<const Half16*>(src.data));
    else f(static_cast<const Brain16*>(src.data));
}

inline float load1(const float* p) { return *p; }
inline float load1(const Half16* p) { return _cvtsh_ss(p->bits); }
inline float load1(const Brain16* p) {
    const uint32_t bits = uint32_t(p->bits) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// A vector whose lanes sum to a . b.
template <typename T>
inline __m256 dot_lanes(const float* a, const T* b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
    float tail = 0.0f;
    for (; i < n; ++i) tail += a[i] * load1(b + i);
    return _mm256_add_ps(acc, _mm256_setr_ps(tail, 0, 0, 0, 0, 0, 0, 0));
}

// The lane sums of eight vectors, as one vector: one reduction per eight dot products, not eight.
inline __m256 hsum8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// A vector's lane sum in hsum8's order, so a key's score is the same whether it falls in a run of eight or not
// (a tree of guesses packs the keys a query sees into runs of its own: kva::attend).
inline float hsum_as8(__m256 v) {
    const __m256 pairs = _mm256_hadd_ps(v, v), quads = _mm256_hadd_ps(pairs, pairs);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

// scores[t] = scale * q . K[t] for the L keys at offsets rows[t].
template <typename T>
void query_scores(const float* q, const T* k, const int64_t* rows, int64_t L, int64_t D, float scale, float* scores) {
    int64_t t = 0;
    for (; D % 8 == 0 && t + 8 <= L; t += 8) {  // eight independent FMA chains, one per key: throughput-, not latency-bound
        __m256 partial[8];
        for (int j = 0; j < 8; ++j) partial[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) {
            const __m256 qi = _mm256_loadu_ps(q + i);
            for (int j = 0; j < 8; ++j) partial[j] = _mm256_fmadd_ps(qi, load8(k + rows[t + j] + i), partial[j]);
        }
        _mm256_storeu_ps(scores + t, _mm256_mul_ps(hsum8(partial), _mm256_set1_ps(scale)));
    }
    for (; t + 8 <= L; t += 8) {
        __m256 partial[8];
        for (int j = 0; j < 8; ++j) partial[j] = dot_lanes(q, k + rows[t + j], D);
        _mm256_storeu_ps(scores + t, _mm256_mul_ps(hsum8(partial), _mm256_set1_ps(scale)));
    }
    for (; t < L; ++t) scores[t] = hsum_as8(dot_lanes(q, k + rows[t], D)) * scale;
}

// The lane sums of four vectors, in hsum8's order (so a key's score is the same in any of the loops).
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// query_scores for the G query heads of one KV head (q: G rows of D, D a multiple of 8), four keys at a time: each
// K row is loaded and widened once for all G, where query_scores widened it once a head. Same sums, same order.
template <int G, typename T>
void heads_scores(const float* q, const T* k, const int64_t* rows, int64_t L, int64_t D, float scale, float* scores, int64_t stride,
                  Ahead& next) {
    int64_t t = 0;
    for (; t + 4 <= L; t += 4) {
        __m256 partial[G][4];
        for (int h = 0; h < G; ++h)
            for (int j = 0; j < 4; ++j) partial[h][j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8)
            for (int j = 0; j < 4; ++j) {
                const __m256 kj = load8(k + rows[t + j] + i);
                next.step();
                for (int h = 0; h < G; ++h) partial[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + i), kj, partial[h][j]);
            }
        for (int h = 0; h < G; ++h)
            _mm_storeu_ps(scores + h * stride + t, _mm_mul_ps(hsum4(partial[h][0], partial[h][1], partial[h][2], partial[h][3]), _mm_set1_ps(scale)));
    }
    for (int h = 0; h < G; ++h)
        for (int64_t u = t; u < L; ++u) scores[h * stride + u] = hsum_as8(dot_lanes(q + h * D, k + rows[u], D)) * scale;
}

// weighted_values for the G query heads of one KV head (p: G rows p_stride apart; out: G rows out_stride apart; D a
// multiple of 32), 32 columns at a time: each V row is loaded and widened once for all G. Same sums, same order.
template <int G, typename T>
void heads_values(const float* p, int64_t p_stride, const T* v, const int64_t* rows, int64_t L, int64_t D, float* out, int64_t out_stride,
                  Ahead& next) {
    for (int64_t c0 = 0; c0 < D; c0 += 32) {
        __m256 acc[G][4];
        for (int h = 0; h < G; ++h)
            for (int r = 0; r < 4; ++r) acc[h][r] = _mm256_loadu_ps(out + h * out_stride + c0 + 8 * r);
        for (int64_t t = 0; t < L; ++t) {
            __m256 pt[G];
            for (int h = 0; h < G; ++h) pt[h] = _mm256_set1_ps(p[h * p_stride + t]);
            next.step();
            for (int r = 0; r < 4; ++r) {
                const __m256 vt = load8(v + rows[t] + c0 + 8 * r);
                for (int h = 0; h < G; ++h) acc[h][r] = _mm256_fmadd_ps(pt[h], vt, acc[h][r]);
            }
        }
        for (int h = 0; h < G; ++h)
            for (int r = 0; r < 4; ++r) _mm256_storeu_ps(out + h * out_stride + c0 + 8 * r, acc[h][r]);
    }
}

// The G query heads of a KV head in runs of up to three (four as two and two), f(first head, run length).
template <typename F>
inline void head_runs(int64_t G, F&& f) {
    for (int64_t h = 0, n; h < G; h += n) {
        n = G - h == 4 ? 2 : std::min<int64_t>(3, G - h);
        f(h, n);
    }
}

// out += sum_t p[t] * V[t], accumulated in registers 64 columns at a time.
template <typename T>
void weighted_values(const float* p, const T* v, const int64_t* rows, int64_t L, int64_t D, float* out) {
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
        if (D - c0 >= 64) {  // a constant count keeps the eight accumulators in registers
            __m256 acc[8];
            for (int r = 0; r < 8; ++r) acc[r] = _mm256_loadu_ps(out + c0 + 8 * r);
            for (int64_t t = 0; t < L; ++t) {
                const T* vt = v + rows[t] + c0;
                const __m256 pt = _mm256_set1_ps(p[t]);
                for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(pt, load8(vt + 8 * r), acc[r]);
            }
            for (int r = 0; r < 8; ++r) _mm256_storeu_ps(out + c0 + 8 * r, acc[r]);
            continue;
        }
        const int64_t vecs = std::min<int64_t>(64, D - c0) / 8, tail_end = std::min<int64_t>(64, D - c0);
        __m256 acc[8];
        float tail[8] = {};
        for (int r = 0; r < vecs; ++r) acc[r] = _mm256_loadu_ps(out + c0 + 8 * r);
        for (int64_t c = vecs * 8; c < tail_end; ++c) tail[c - vecs * 8] = out[c0 + c];
        for (int64_t t = 0; t < L; ++t) {
            const T* vt = v + rows[t] + c0;
            const __m256 pt = _mm256_set1_ps(p[t]);
            for (int r = 0; r < vecs; ++r) acc[r] = _mm256_fmadd_ps(pt, load8(vt + 8 * r), acc[r]);
            for (int64_t c = vecs * 8; c < tail_end; ++c) tail[c - vecs * 8] += p[t] * load1(vt + c);
        }
        for (int r = 0; r < vecs; ++r) _mm256_storeu_ps(out + c0 + 8 * r, acc[r]);
        for (int64_t c = vecs * 8; c < tail_end; ++c) out[c0 + c] = tail[c - vecs * 8];
    }
}

// Scores of the G query heads of a KV head (q: G rows of D) against L keys: into scores + h * stride.
template <typename T>
void kv_head_scores(const float* q, int64_t G, const T* k, const int64_t* rows, int64_t L, int64_t D, float scale, float* scores,
                    int64_t stride, std::pair<const char*, const char*> ahead) {
    Ahead next(ahead.first, ahead.second, L / 4 * 4 * (D / 8));
    if (D % 8 != 0 || G == 1) {
        for (int64_t h = 0; h < G; ++h) query_scores(q + h * D, k, rows, L, D, scale, scores + h * stride);
        return;
    }
    head_runs(G, [&](int64_t h, int64_t n) {
        if (n == 3) heads_scores<3>(q + h * D, k, rows, L, D, scale, scores + h * stride, stride, next);
        else heads_scores<2>(q + h * D, k, rows, L, D, scale, scores + h * stride, stride, next);
    });
}

// out[h] += sum_t p[h][t] V[t] for the G query heads of a KV head (p rows p_stride apart, out rows out_stride apart).
template <typename T>
void kv_head_values(const float* p, int64_t p_stride, int64_t G, const T* v, const int64_t* rows, int64_t L, int64_t D, float* out,
                    int64_t out_stride, std::pair<const char*, const char*> ahead) {
    Ahead next(ahead.first, ahead.second, D / 32 * L);
    if (D % 32 != 0 || G == 1) {
        for (int64_t h = 0; h < G; ++h) weighted_values(p + h * p_stride, v, rows, L, D, out + h * out_stride);
        return;
    }
    head_runs(G, [&](int64_t h, int64_t n) {
        if (n == 3) heads_values<3>(p + h * p_stride, p_stride, v, rows, L, D, out + h * out_stride, out_stride, next);
        else heads_values<2>(p + h * p_stride, p_stride, v, rows, L, D, out + h * out_stride, out_stride, next);
    });
}

// s[i] = exp(s[i] - max) over n scores, in place; returns (max, sum of the exponentials).
std::pair<float, float> exp_scores(float* s, int64_t n) {
    __m256 lanes = _mm256_set1_ps(-INFINITY);  // max is exact in any order; std::max_element is one compare a cycle or less
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(s + i));
    float m = -INFINITY;
    for (int j = 0; j < 8; ++j) m = std::max(m, lanes[j]);
    for (; i < n; ++i) m = std::max(m, s[i]);
    __m256 total = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(m)));
        _mm256_storeu_ps(s + i, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = hsum(total);
    for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - m));
    return {m, sum};
}

inline __m256 load8_u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline __m256 load8_i8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline float half(const c10::Half* p) { return static_cast<float>(*p); }

int64_t row_bytes(int format, int64_t D);

// One layer's K or V store: parts[0] holds the values ([blocks, block_size, KVH, ...]), parts[1] the scales.
struct Store {
    int format;
    const uint8_t* data;
    const c10::Half* meta = nullptr;
    int64_t bs, kvh, dim;

    // Asks for block b's rows into L2, well ahead of their use: float stores, whose blocks are runs of bytes.
    void prefetch(int64_t b) const {
        if (format > BF16) return;
        const int64_t bytes = bs * kvh * dim * (format == F32 ? 4 : 2);
        for (const char* p = reinterpret_cast<const char*>(data) + b * bytes, *end = p + bytes; p < end; p += 64) _mm_prefetch(p, _MM_HINT_T1);
    }

    // Block b's values, as bytes.
    std::pair<const char*, const char*> span(int64_t b) const {
        const int64_t bytes = bs * kvh * row_bytes(format, dim);
        const char* p = reinterpret_cast<const char*>(data) + b * bytes;
        return {p, p + bytes};
    }

    // Reads a byte of each of block b's lines (its values; scales are few), in order, before its rows are read head by
    // head (kvh rows apart): the misses then come as an ascending run, which the hardware prefetcher follows, where
    // the strided rows alone got half a plain read's bandwidth and software prefetches did not help (ad-hoc, 46 MB of
    // fp16 blocks of 3 heads on one core: 12.8 GB/s strided, 20.9 touched first, 24.1 read in order).
    void touch(int64_t b) const {
        const int64_t bytes = bs * kvh * row_bytes(format, dim);
        for (const char* p = reinterpret_cast<const char*>(data) + b * bytes, *end = p + bytes; p < end; p += 64)
            (void)*reinterpret_cast<const volatile char*>(p);
    }

    // Row (block b, offset o, head g) as D floats in out.
    void dequant_row(int64_t b, int64_t o, int64_t g, const float* channel_scale, const float* channel_min, float* out) const {
        const int64_t row = (b * bs + o) * kvh + g, D = dim, G = D / GROUP;
        switch (format) {
            case F16: {
                const uint16_t* p = reinterpret_cast<const uint16_t*>(data) + row * D;
                for (int64_t i = 0; i < D; i += 8)
                    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
                break;
            }
            case BF16: {
                const uint16_t* p = reinterpret_cast<const uint16_t*>(data) + row * D;
                for (int64_t i = 0; i < D; i += 8) {
                    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
                    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
                }
                break;
            }
            case E4M3: {  // exponent and mantissa moved into an fp16's fields: the value / 2^8 (bias 7 against 15), subnormals too
                const uint8_t* p = data + row * D;
                const __m128i magnitude = _mm_set1_epi16(0x7F), sign = _mm_set1_epi16(0x80);
                for (int64_t i = 0; i < D; i += 8) {
                    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i)));
                    const __m128i m = _mm_and_si128(b, magnitude);
                    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, sign), 8), _mm_slli_epi16(m, 7));
                    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
                    const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(m, magnitude)));  // 0x7F, 0xFF
                    _mm256_storeu_ps(out + i, _mm256_blendv_ps(v, _mm256_set1_ps(NAN), nan));
                }
                break;
            }
            case E5M2: {  // e5m2 is the top byte of an fp16
                const uint8_t* p = data + row * D;
                for (int64_t i = 0; i < D; i += 8) {
                    const __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i))), 8);
                    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
                }
                break;
            }
            case INT8: {
                const int8_t* p = reinterpret_cast<const int8_t*>(data) + row * D;
                for (int64_t g32 = 0; g32 < G; ++g32) {
                    const __m256 s = _mm256_set1_ps(half(meta + row * G + g32));
                    for (int i = 0; i < 4; ++i)
                        _mm256_storeu_ps(out + g32 * 32 + 8 * i, _mm256_mul_ps(load8_i8(p + g32 * 32 + 8 * i), s));
                }
                break;
            }
            case INT4: {  // byte j of a group holds value j (low nibble) and j + 16 (high nibble)
                const uint8_t* p = data + row * D / 2;
                const __m128i mask = _mm_set1_epi8(0x0F);
                for (int64_t g32 = 0; g32 < G; ++g32) {
                    const __m256 s = _mm256_set1_ps(half(meta + (row * G + g32) * 2)), m = _mm256_set1_ps(half(meta + (row * G + g32) * 2 + 1));
                    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + g32 * 16));
                    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
                    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                    for (int i = 0; i < 4; ++i)
                        _mm256_storeu_ps(out + g32 * 32 + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), s, m));
                }
                break;
            }
            case INT2_TOKEN:
            case INT2_CHANNEL: {  // byte j of a group holds values j, j + 8, j + 16, j + 24 from its low bits up
                const uint8_t* p = data + row * D / 4;
                const __m128i mask = _mm_set1_epi8(0x03);
                for (int64_t g32 = 0; g32 < G; ++g32) {
                    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + g32 * 8));
                    for (int i = 0; i < 4; ++i) {
                        const __m256 u = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 2 * i), mask)));
                        float* o = out + g32 * 32 + 8 * i;
                        if (format == INT2_TOKEN) {
                            const c10::Half* sm = meta + (row * G + g32) * 2;
                            _mm256_storeu_ps(o, _mm256_fmadd_ps(u, _mm256_set1_ps(half(sm)), _mm256_set1_ps(half(sm + 1))));
                        } else {
                            _mm256_storeu_ps(o, _mm256_fmadd_ps(u, _mm256_loadu_ps(channel_scale + (o - out)), _mm256_loadu_ps(channel_min + (o - out))));
                        }
                    }
                }
                break;
            }
            default: TORCH_CHECK(false, "unknown KV format ", format);
        }
    }

    // Per-channel scale and minimum of block b, head g (INT2_CHANNEL), as floats.
    void channel_meta(int64_t b, int64_t g, float* scale, float* minimum) const {
        const c10::Half* m = meta + (b * kvh + g) * 2 * dim;
        for (int64_t c = 0; c < dim; ++c) scale[c] = half(m + c), minimum[c] = half(m + dim + c);
    }
};

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t row_bytes(int format, int64_t D) {
    switch (format) {
        case F32: return 4 * D;
        case F16: case BF16: return 2 * D;
        case INT4: return D / 2;
        case INT2_TOKEN: case INT2_CHANNEL: return D / 4;
        default: return D;
    }
}

Store make_store(const std::vector<at::Tensor>& parts, int64_t format, int64_t dim) {
    TORCH_CHECK(!parts.empty() && parts.size() <= 2, "a KV store has one or two parts");
    for (const auto& p : parts) TORCH_CHECK(p.is_contiguous() && p.device().is_cpu(), "KV parts must be contiguous CPU tensors");
    const at::Tensor& d = parts[0];
    TORCH_CHECK(d.dim() == 4, "KV data must be [blocks, block_size, kv_heads, ...]");
    TORCH_CHECK(format >= F32 && format <= INT2_CHANNEL, "unknown KV format ", format);
    TORCH_CHECK(d.size(3) * int64_t(d.element_size()) == row_bytes(int(format), dim), "KV data does not hold ", dim,
                " values per row in format ", format);
    TORCH_CHECK(format <= E5M2 || (parts.size() == 2 && parts[1].scalar_type() == at::kHalf && dim % GROUP == 0),
                "quantized KV needs fp16 scales and head_dim a multiple of 32");
    Store s{int(format), static_cast<const uint8_t*>(d.data_ptr()), nullptr, d.size(1), d.size(2), dim};
    if (parts.size() == 2) s.meta = parts[1].data_ptr<c10::Half>();
    return s;
}

// x's D values as int8 codes with an fp16 scale per group of GROUP, as kvserve/kv/formats/int8.py quantizes them:
// scale = fp16(max |x| / 127), codes = x * (1 / scale) rounded half to even.
void quantize_int8_row(const float* x, int64_t D, int8_t* codes, c10::Half* scales) {
    for (int64_t g = 0; g < D / GROUP; ++g) {
        const float* xg = x + g * GROUP;
        float amax = 0.0f;
        for (int64_t i = 0; i < GROUP; ++i) amax = std::max(amax, std::fabs(xg[i]));
        const float scale = float(c10::Half(amax / 127.0f)), inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int64_t i = 0; i < GROUP; ++i) codes[g * GROUP + i] = int8_t(std::clamp(std::nearbyint(xg[i] * inv), -127.0f, 127.0f));
        scales[g] = c10::Half(scale);
    }
}

// x's D values as 4-bit codes with an fp16 scale and minimum per group of GROUP, as kvserve/kv/formats/int4.py
// quantizes them (affine_quantize, then pack_bits: byte j of a group holds codes j and j + 16).
void quantize_int4_row(const float* x, int64_t D, uint8_t* codes, c10::Half* meta) {
    for (int64_t g = 0; g < D / GROUP; ++g) {
        const float* xg = x + g * GROUP;
        float lo = xg[0], hi = xg[0];
        for (int64_t i = 1; i < GROUP; ++i) lo = std::min(lo, xg[i]), hi = std::max(hi, xg[i]);
        const float scale = float(c10::Half((hi - lo) / 15.0f)), low = float(c10::Half(lo)), inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        uint8_t q[GROUP];
        for (int64_t i = 0; i < GROUP; ++i) q[i] = uint8_t(std::clamp(std::nearbyint((xg[i] - low) * inv), 0.0f, 15.0f));
        for (int64_t j = 0; j < GROUP / 2; ++j) codes[g * GROUP / 2 + j] = uint8_t(q[j] | q[j + GROUP / 2] << 4);
        meta[2 * g] = c10::Half(scale), meta[2 * g + 1] = c10::Half(low);
    }
}

// x's D values as fp8 codes, as kvserve/kv/formats/fp8.py writes them: saturated at the format's largest finite
// value (NaN stays NaN), then c10's conversion, the one torch's .to() rounds with.
template <typename F8>
void quantize_fp8_row(const float* x, int64_t D, uint8_t* codes) {
    const float max = float(std::numeric_limits<F8>::max());
    for (int64_t i = 0; i < D; ++i) codes[i] = F8(std::isnan(x[i]) ? x[i] : std::clamp(x[i], -max, max)).x;
}

// n floats as float16 (F16C), or bfloat16 (c10::BFloat16's rounding: to nearest even, NaN as 0x7FC0), 8 at a time;
// the values c10's conversions give, without their per-value branches.
void store_f16(const float* x, int64_t n, c10::Half* out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    std::copy(x + i, x + n, out + i);
}

void store_bf16(const float* x, int64_t n, c10::BFloat16* out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m128i is_nan = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_blendv_epi8(bf16_round(v), _mm_set1_epi16(0x7FC0), is_nan));
    }
    std::copy(x + i, x + n, out + i);
}

// New tokens' K or V rows (fp32, x + t * t_stride + h * h_stride) written at their rows of a float store (F32, F16
// or BF16, rounded as torch's .to()), an fp8, int8 or int4 one.
void write_rows(const Store& store, const float* x, int64_t t_stride, int64_t h_stride, int64_t T, const int64_t* slots, int64_t first) {
    const int64_t KVH = store.kvh, D = store.dim;
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < KVH; ++h) {
            const float* src = x + t * t_stride + h * h_stride;
            const int64_t row = (slots[t] - first) * KVH + h, at = row * D;
            void* data = const_cast<uint8_t*>(store.data);
            if (store.format == F32) std::copy(src, src + D, static_cast<float*>(data) + at);
            else if (store.format == F16) store_f16(src, D, static_cast<c10::Half*>(data) + at);
            else if (store.format == BF16) store_bf16(src, D, static_cast<c10::BFloat16*>(data) + at);
            else if (store.format == E4M3) quantize_fp8_row<c10::Float8_e4m3fn>(src, D, static_cast<uint8_t*>(data) + at);
            else if (store.format == E5M2) quantize_fp8_row<c10::Float8_e5m2>(src, D, static_cast<uint8_t*>(data) + at);
            else if (store.format == INT8) quantize_int8_row(src, D, static_cast<int8_t*>(data) + at, const_cast<c10::Half*>(store.meta) + row * (D / GROUP));
            else quantize_int4_row(src, D, static_cast<uint8_t*>(data) + row * D / 2, const_cast<c10::Half*>(store.meta) + row * (D / GROUP) * 2);
        }
}

// Values in a row of `bytes` bytes of a format (row_bytes' inverse).
int64_t row_values(int format, int64_t bytes) {
    switch (format) {
        case F32: return bytes / 4;
        case F16: case BF16: return bytes / 2;
        case INT4: return bytes * 2;
        case INT2_TOKEN: case INT2_CHANNEL: return bytes * 4;
        default: return bytes;
    }
}

}  // namespace

namespace kva {

// A layer's K and V stores and its residual pool's, checked once.
struct KVStores {
    std::vector<at::Tensor> held;  // the stores' tensors: the pointers below are theirs
    Store k, v, rk, rv;
    int64_t num_main = 0, num_residual = 0;
    bool writable = false;  // new tokens land in a float, fp8, int8 or int4 store (the residual pool's, where there is one): attend writes them

    // Asks for block `id` of main store m, or of r, the residual pool's, whose ids follow the main pool's.
    void prefetch(const Store& m, const Store& r, int64_t id) const {
        if (id >= num_main) r.prefetch(id - num_main);
        else m.prefetch(id);
    }

    std::pair<const char*, const char*> span(const Store& m, const Store& r, int64_t id) const {
        return id >= num_main ? r.span(id - num_main) : m.span(id);
    }

    void touch(const Store& m, const Store& r, int64_t id) const {
        if (id >= num_main) r.touch(id - num_main);
        else m.touch(id);
    }
};

std::shared_ptr<const KVStores> kv_stores(const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v, int64_t k_format,
                                          int64_t v_format, const std::vector<at::Tensor>& k_residual,
                                          const std::vector<at::Tensor>& v_residual, int64_t residual_format) {
    TORCH_CHECK(!k.empty() && k[0].dim() == 4, "KV data must be [blocks, block_size, kv_heads, ...]");
    TORCH_CHECK(k_format >= F32 && k_format <= INT2_CHANNEL, "unknown KV format ", k_format);
    const int64_t D = row_values(int(k_format), k[0].size(3) * k[0].element_size());
    auto s = std::make_shared<KVStores>();
    s->held = k;
    s->held.insert(s->held.end(), v.begin(), v.end());
    s->k = make_store(k, k_format, D), s->v = make_store(v, v_format, D);
    s->num_main = k[0].size(0);
    TORCH_CHECK(s->v.bs == s->k.bs && s->v.kvh == s->k.kvh && v[0].size(0) == s->num_main, "K and V stores do not agree");
    if (!k_residual.empty()) {
        TORCH_CHECK(residual_format <= BF16, "the residual pool holds floats");
        s->rk = make_store(k_residual, residual_format, D), s->rv = make_store(v_residual, residual_format, D);
        TORCH_CHECK(s->rk.bs == s->k.bs && s->rk.kvh == s->k.kvh && v_residual[0].size(0) == k_residual[0].size(0), "bad residual KV");
        s->num_residual = k_residual[0].size(0);
        s->held.insert(s->held.end(), k_residual.begin(), k_residual.end());
        s->held.insert(s->held.end(), v_residual.begin(), v_residual.end());
    }
    const auto written = [](int64_t f) { return f <= INT4; };  // floats, fp8, int8, int4: not the 2-bit formats
    s->writable = s->num_residual > 0 || (written(k_format) && written(v_format));
    return s;
}

int64_t head_dim(const KVStores& s) { return s.k.dim; }

bool same_pool(const KVStores& a, const KVStores& b) {
    auto alike = [](const Store& x, const Store& y) { return x.format == y.format && x.bs == y.bs && x.kvh == y.kvh && x.dim == y.dim; };
    return a.num_main == b.num_main && a.num_residual == b.num_residual && a.writable == b.writable && alike(a.k, b.k) &&
           alike(a.v, b.v) && (a.num_residual == 0 || (alike(a.rk, b.rk) && alike(a.rv, b.rv)));
}

void check_step(const KVStores& s, const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t window,
                const at::Tensor* slots) {
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                block_tables.is_contiguous() && context_lens.is_contiguous(), "block tables and lengths must be contiguous int64");
    const int64_t B = block_tables.size(0), W = block_tables.size(1), bs = s.k.bs;
    TORCH_CHECK(context_lens.numel() == B, "one context length per block table row");
    const int64_t* tp = block_tables.data_ptr<int64_t>();
    const int64_t* lp = context_lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
        TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * bs, "context length ", lp[b], " does not fit ", W, " blocks");
        const int64_t first = window > 0 ? std::max<int64_t>(0, lp[b] - window) : 0;
        for (int64_t j = first / bs; j < (lp[b] + bs - 1) / bs; ++j)
            TORCH_CHECK(tp[b * W + j] >= 0 && tp[b * W + j] < s.num_main + s.num_residual, "block id out of range");
    }
    if (slots != nullptr) check_slots(s, *slots);
}

void check_slots(const KVStores& s, const at::Tensor& slots) {
    TORCH_CHECK(s.writable, "only float, fp8, int8 and int4 stores are written here");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be contiguous int64");
    const int64_t bs = s.k.bs, first = s.num_residual ? s.num_main * bs : 0, rows = (s.num_residual ? s.num_residual : s.num_main) * bs;
    for (int64_t t = 0; t < slots.numel(); ++t) {
        const int64_t slot = slots.data_ptr<int64_t>()[t] - first;
        TORCH_CHECK(slot >= 0 && slot < rows, "slot ", slot + first, " is outside the pool");
    }
}

void write_new(const KVStores& s, const NewKV& fresh, int64_t T) {  // the residual pool's slots follow the main pool's
    const int64_t first = s.num_residual ? s.num_main * s.k.bs : 0;
    write_rows(s.num_residual ? s.rk : s.k, fresh.k, fresh.k_t, fresh.k_h, T, fresh.slots, first);
    write_rows(s.num_residual ? s.rv : s.v, fresh.v, fresh.v_t, fresh.v_h, T, fresh.slots, first);
}

const int64_t* check_hidden(const c10::optional<at::Tensor>& hidden, const at::Tensor& context_lens) {
    if (!hidden.has_value()) return nullptr;
    const int64_t B = context_lens.numel();
    TORCH_CHECK(hidden->scalar_type() == at::kLong && hidden->is_contiguous() && hidden->numel() == B, "hidden keys must be contiguous int64 [B]");
    for (int64_t b = 0; b < B; ++b) {
        const uint64_t m = uint64_t(hidden->data_ptr<int64_t>()[b]), len = uint64_t(context_lens.data_ptr<int64_t>()[b]);
        TORCH_CHECK(len > 64 || (m >> (len - 1)) == 0, "query ", b, " hides keys before its first");
    }
    return hidden->data_ptr<int64_t>();
}

void prefetch_context(const KVStores& s, int64_t B, const int64_t* tables, int64_t W, const int64_t* lens, int64_t window) {
    const Store &k = s.k, &v = s.v;
    const int64_t bs = k.bs, block_bytes = bs * k.kvh * (row_bytes(k.format, k.dim) + row_bytes(v.format, v.dim));
    for (int64_t b = 0, budget = (256 << 10) / block_bytes; b < B; ++b) {
        const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) / bs : 0;
        for (int64_t i = first; i * bs < lens[b] && budget > 0; ++i, --budget) {
            s.prefetch(k, s.rk, tables[b * W + i]), s.prefetch(v, s.rv, tables[b * W + i]);
        }
    }
}

void attend(const KVStores& s, const float* q, int64_t q_stride, const NewKV* fresh, int64_t B, int64_t H, const int64_t* tables,
            int64_t W, const int64_t* lens, double scale, int64_t window, const int64_t* hidden, float* out) {
    const kvt::Scope timed{&kvt::attention_ns()};
    const Store &ks = s.k, &vs = s.v, &rks = s.rk, &rvs = s.rv;
    const int64_t D = ks.dim, bs = ks.bs, KVH = ks.kvh, num_main = s.num_main;
    if (fresh != nullptr) write_new(s, *fresh, B);
    const int64_t* tp = tables;
    const int64_t* lp = lens;
    // A tree of guesses (hidden): query b skips the keys whose bit j is set, at lens[b] - 2 - j, its tree's other
    // branches. It sees its keys as the one-token step it stands for would, where they lie at consecutive positions:
    // the window and the chunks count the keys it sees, and each chunk's scores are packed, so the sums are that step's.
    auto mask = [&](int64_t b) { return hidden != nullptr ? uint64_t(hidden[b]) : uint64_t(0); };
    auto seen = [&](int64_t b) { return lp[b] - __builtin_popcountll(mask(b)); };
    auto first_key = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, seen(b) - window) : int64_t(0); };
    auto is_hidden = [&](int64_t b, int64_t t) {
        const int64_t j = lp[b] - 2 - t;
        return j >= 0 && j < 64 && (mask(b) >> j & 1);
    };
    auto slot_of = [&](int64_t b, int64_t key) {  // the slot of the key-th key query b sees: past each hidden slot below it
        int64_t slot = key;
        for (uint64_t m = mask(b); m != 0;) {  // the highest bit is the lowest hidden slot
            const int j = 63 - __builtin_clzll(m);
            m &= ~(uint64_t(1) << j);
            if (lp[b] - 2 - j <= slot) ++slot;
        }
        return slot;
    };
    // One task per (sequence, chunk of its context) covers every head, a block at a time, so each block's rows are
    // read whole and in order. Flash-decoding: a context of L keys splits into chunks of whole blocks, which threads
    // share (two from 128 keys on, so that both threads of a batch-1 step fetch the blocks the weight stream evicted;
    // at most eight; past the thread count, a multiple of it, so no thread of a batch-1 step takes one chunk more than
    // another); every chunk keeps its own softmax max and sum per head, merged at the end. The chunks depend on L
    // (and the thread count) alone, so a query's output never depends on the queries beside it: a speculative step's
    // verification rows give the numbers of the one-token steps they stand for.
    thread_local std::vector<int64_t> chunk_sizes, first_tasks;  // per sequence: its chunks' size; its first task, and the end
    chunk_sizes.resize(B), first_tasks.assign(B + 1, 0);
    int64_t* chunks = chunk_sizes.data();  // this thread's buffers: their addresses, for the workers
    int64_t* tasks = first_tasks.data();
    int64_t stride = 0;  // the longest chunk: the scores buffer's row
    const int64_t threads = at::get_num_threads();
    for (int64_t b = 0; b < B; ++b) {
        const int64_t L = seen(b) - first_key(b), most = std::clamp<int64_t>(L / (4 * bs), 1, 8);
        const int64_t splits = most > threads ? most - most % threads : most;
        chunks[b] = ceil_div(ceil_div(L, splits), bs) * bs, stride = std::max(stride, chunks[b]);
        tasks[b + 1] = tasks[b] + ceil_div(L, chunks[b]);
    }
    // Rows with the block table of the row before them (a chain of guesses: its rows stand for consecutive one-token
    // steps of one sequence) take their chunks in turn, chunk by chunk, so the thread that reads a chunk's blocks
    // reads them for every row while they are in its cache, where each row's chunks in a run split the rows between
    // the threads and each thread read the whole context from memory.
    thread_local std::vector<int64_t> task_order;
    task_order.resize(tasks[B]);
    int64_t* order = task_order.data();
    for (int64_t b0 = 0, b1, at = 0; b0 < B; b0 = b1) {
        int64_t most = tasks[b0 + 1] - tasks[b0];
        for (b1 = b0 + 1; b1 < B && std::equal(tp + b1 * W, tp + (b1 + 1) * W, tp + b0 * W); ++b1) most = std::max(most, tasks[b1 + 1] - tasks[b1]);
        for (int64_t c = 0; c < most; ++c)
            for (int64_t b = b0; b < b1; ++b)
                if (c < tasks[b + 1] - tasks[b]) order[at++] = tasks[b] + c;
    }
    const int64_t G = H / KVH;
    const bool wide = kvq::avx512_enabled() && D % 64 == 0;
    // The kernels fetch the next block (K's, then the chunk's first V block, then V's) a few lines at a time between
    // their arithmetic (Ahead), each of a block's KVH calls a share of its lines: the fetch overlaps the arithmetic, where
    // prefetching a whole block before it stalled as long as reading it (decode attention's clock after 2,000 tokens,
    // SmolLM2 on an AMX Xeon: 2.34-2.65 ms a step against 3.12-3.44 with AVX-512, 2.69-2.77 against 3.48-3.79 with AVX2)
    const std::pair<const char*, const char*> none{nullptr, nullptr};
    auto share = [&](std::pair<const char*, const char*> span, int64_t g) -> std::pair<const char*, const char*> {
        const int64_t per = ((span.second - span.first) / 64 + KVH - 1) / KVH * 64;
        return {std::min(span.second, span.first + g * per), std::min(span.second, span.first + (g + 1) * per)};
    };
    thread_local std::vector<float> partial;  // per task and query head: output, max, sum
    partial.resize(tasks[B] * H * (D + 2));
    float *pp = partial.data(), *op = out;
    at::parallel_for(0, tasks[B], 1, [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> scores, buffer, channel;  // each written before it is read
        thread_local std::vector<int64_t> rows;
        scores.resize(H * stride), buffer.resize(bs * D), channel.resize(2 * D), rows.resize(bs);
        // Rows o.. o + n - 1 of block `id` of K or V (main store m, residual store r) for head g, at slots t.., handed to
        // f as a Source with `rows` + o and their count: where they lie if the kernels widen their format in registers
        // (float caches; every format with AVX-512), else dequantized into `buffer`; the rows query b does not see are
        // left out.
        auto with_block_rows = [&](const Store& m, const Store& r, int64_t id, int64_t o, int64_t n, int64_t g, int64_t b, int64_t t,
                                   auto&& f) {
            const Store& s = id >= num_main ? r : m;
            if (id >= num_main) id -= num_main;
            auto pass = [&](const Source& src) {
                int64_t count = n;
                if (mask(b) != 0) {
                    count = 0;
                    for (int64_t i = 0; i < n; ++i)
                        if (!is_hidden(b, t + i)) rows[o + count++] = rows[o + i];
                }
                f(src, count);
            };
            if (s.format == INT2_CHANNEL) s.channel_meta(id, g, channel.data(), channel.data() + D);
            if (s.format <= BF16 || wide) {
                for (int64_t i = 0; i < o + n; ++i) rows[i] = ((id * bs + i) * KVH + g) * D;
                pass({s.format, s.data, reinterpret_cast<const uint16_t*>(s.meta), channel.data()});
                return;
            }
            for (int64_t i = 0; i < o + n; ++i) {
                s.dequant_row(id, i, g, channel.data(), channel.data() + D, buffer.data() + i * D);
                rows[i] = i * D;
            }
            pass({F32, buffer.data(), nullptr, nullptr});
        };
        for (int64_t i = begin; i < end; ++i) {
            const int64_t item = order[i], b = std::upper_bound(tasks, tasks + B + 1, item) - tasks - 1;
            const int64_t k0 = first_key(b) + (item - tasks[b]) * chunks[b], k1 = std::min(seen(b), k0 + chunks[b]), L = k1 - k0;
            const int64_t t0 = slot_of(b, k0), t1 = slot_of(b, k1 - 1) + 1;  // the chunk's slots (all of them, seen or not)
            float* part = pp + item * H * (D + 2);
            // block by block; a window starts anywhere in a block (o rows of it are skipped); `at`: the keys seen before
            for (int64_t t = t0, n, at = 0, count = 0; t < t1; t += n, at += count) {
                const int64_t o = t % bs;
                n = std::min(bs - o, t1 - t);
                // a chunk's first K block was not fetched ahead: touch its lines in order (the others are here already:
                // touching them too cost 4-10% of attention's time)
                if (t == t0) s.touch(ks, rks, tp[b * W + t / bs]);
                const auto next = t + n < t1 ? s.span(ks, rks, tp[b * W + (t + n) / bs]) : s.span(vs, rvs, tp[b * W + t0 / bs]);
                for (int64_t g = 0; g < KVH; ++g)
                    with_block_rows(ks, rks, tp[b * W + t / bs], o, n, g, b, t, [&](const Source& src, int64_t c) {
                        float* s = scores.data() + g * G * stride + at;
                        count = c;
                        const auto [a, e] = share(next, g);
                        if (wide)
                            head_runs(G, [&](int64_t h, int64_t m) {
                                kva::scores_avx512(src.format, q + b * q_stride + (g * G + h) * D, m, src.data, src.meta, src.channel,
                                                   rows.data() + o, c, D, float(scale), s + h * stride, stride, h == 0 ? a : nullptr,
                                                   h == 0 ? e : nullptr);
                            });
                        else with_floats(src, [&](const auto* base) {
                            kv_head_scores(q + b * q_stride + g * G * D, G, base, rows.data() + o, c, D, float(scale), s, stride, {a, e});
                        });
                    });
            }
            for (int64_t h = 0; h < H; ++h) {
                const auto [m, sum] = exp_scores(scores.data() + h * stride, L);
                std::fill(part + h * (D + 2), part + h * (D + 2) + D, 0.0f);
                part[h * (D + 2) + D] = m, part[h * (D + 2) + D + 1] = sum;
            }
            for (int64_t t = t0, n, at = 0, count = 0; t < t1; t += n, at += count) {
                const int64_t o = t % bs;
                n = std::min(bs - o, t1 - t);
                const auto next = t + n < t1 ? s.span(vs, rvs, tp[b * W + (t + n) / bs]) : none;
                for (int64_t g = 0; g < KVH; ++g)
                    with_block_rows(vs, rvs, tp[b * W + t / bs], o, n, g, b, t, [&](const Source& src, int64_t c) {
                        const float* p = scores.data() + g * G * stride + at;
                        count = c;
                        float* out = part + g * G * (D + 2);
                        const auto [a, e] = share(next, g);
                        if (wide) kva::values_avx512(src.format, p, stride, G, src.data, src.meta, src.channel, rows.data() + o, c, D, out, D + 2, a, e);
                        else with_floats(src, [&](const auto* base) {
                            kv_head_values(p, stride, G, base, rows.data() + o, c, D, out, D + 2, {a, e});
                        });
                    });
            }
            if (tasks[b + 1] - tasks[b] == 1) {  // the whole context in one chunk: normalize here, no merge
                for (int64_t h = 0; h < H; ++h) {
                    const float inv = 1.0f / part[h * (D + 2) + D + 1];
                    float* o = op + (b * H + h) * D;
                    for (int64_t i = 0; i < D; ++i) o[i] = part[h * (D + 2) + i] * inv;
                }
            }
        }
    });
    if (tasks[B] == B) return;
    at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
        for (int64_t bh = begin; bh < end; ++bh) {
            const int64_t b = bh / H, C = tasks[b + 1] - tasks[b];
            if (C == 1) continue;
            const float* first = pp + (tasks[b] * H + bh % H) * (D + 2);  // chunk c at first + c * H * (D + 2)
            float m = -INFINITY, sum = 0.0f;
            for (int64_t c = 0; c < C; ++c) m = std::max(m, first[c * H * (D + 2) + D]);
            float* o = op + bh * D;
            std::fill(o, o + D, 0.0f);
            for (int64_t c = 0; c < C; ++c) {
                const float* part = first + c * H * (D + 2);
                const float w = std::exp(part[D] - m);
                sum += w * part[D + 1];
                for (int64_t i = 0; i < D; ++i) o[i] += w * part[i];
            }
            const float inv = 1.0f / sum;
            for (int64_t i = 0; i < D; ++i) o[i] *= inv;
        }
    });
}

}  // namespace kva

// Prompt attention: a chunk's queries against their sequence's cache, causal (and windowed), in tiles. A task is
// TILE query positions of one sequence and one KV head (its G query heads, TILE * G rows); it reads the keys
// those positions see 16 at a time, widened (or dequantized) once into fp32 buffers, K transposed, so each key
// serves every row while in cache: the scores and the weighted values are small matrix products in registers, with an
// online softmax between them (flash attention). Keys past a row's position (or before its window) are left out.
namespace {

// 32 query positions a task: 1.02-1.13x as fast as 16 and 1.14-1.29x as fast as 8 on 512- and 2,048-token prompts,
// 64 within noise of 32 (ad hoc, the sizes taking turns in one process, 1 and 2 threads of a Zen 3 EPYC)
constexpr int64_t TILE = 32, KEYS = 16;

// s[r][0..16) = q[r] . K[0..16) for R rows (q rows D apart; kt: the keys transposed, [D][16]).
template <int R>
inline void tile_scores(const float* q, const float* kt, int64_t D, float* s) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * KEYS), k1 = _mm256_loadu_ps(kt + d * KEYS + 8);
        for (int r = 0; r < R; ++r) {
            const __m256 x = _mm256_broadcast_ss(q + r * D + d);
            acc[r][0] = _mm256_fmadd_ps(x, k0, acc[r][0]), acc[r][1] = _mm256_fmadd_ps(x, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(s + r * KEYS, acc[r][0]), _mm256_storeu_ps(s + r * KEYS + 8, acc[r][1]);
}

// o[r][c..c + 8V) += sum_j p[r][j] v[j][c..] over n keys, for R rows (p rows 16 apart, o rows D apart).
template <int R, int V>
inline void tile_values(const float* p, const float* v, int64_t n, int64_t D, int64_t c, float* o) {
    __m256 acc[R][V];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < V; ++i) acc[r][i] = _mm256_loadu_ps(o + r * D + c + 8 * i);
    for (int64_t j = 0; j < n; ++j) {  // R * V accumulators, R weights and a value vector: 16 registers at most
        __m256 pj[R];
        for (int r = 0; r < R; ++r) pj[r] = _mm256_broadcast_ss(p + r * KEYS + j);
        for (int i = 0; i < V; ++i) {
            const __m256 vj = _mm256_loadu_ps(v + j * D + c + 8 * i);
            for (int r = 0; r < R; ++r) acc[r][i] = _mm256_fmadd_ps(pj[r], vj, acc[r][i]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < V; ++i) _mm256_storeu_ps(o + r * D + c + 8 * i, acc[r][i]);
}

// f.template operator()<R>(first row) over `rows` rows, STEP at a time, then the rest.
template <int STEP, typename F>
inline void row_groups(int64_t rows, F&& f) {
    int64_t r = 0;
    for (; r + STEP <= rows; r += STEP) f.template operator()<STEP>(r);
    switch (rows - r) {
        case 5: if constexpr (STEP > 5) f.template operator()<5>(r); break;
        case 4: if constexpr (STEP > 4) f.template operator()<4>(r); break;
        case 3: if constexpr (STEP > 3) f.template operator()<3>(r); break;
        case 2: f.template operator()<2>(r); break;
        case 1: f.template operator()<1>(r); break;
        default: break;
    }
}

// An 8x8 block of floats (rows `as` apart) transposed into out (rows `os` apart).
inline void transpose8(const float* a, int64_t as, float* out, int64_t os) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(a + i * as);
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(out + i * os, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(out + (i + 4) * os, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

// s[j] = -inf for the keys a row does not see: j outside [from, to).
inline void hide_keys(float* s, int64_t from, int64_t to) {
    const __m256 f = _mm256_set1_ps(float(from)), e = _mm256_set1_ps(float(to)), hidden = _mm256_set1_ps(-INFINITY);
    for (int i = 0; i < 2; ++i) {
        const __m256 j = _mm256_setr_ps(8 * i, 8 * i + 1, 8 * i + 2, 8 * i + 3, 8 * i + 4, 8 * i + 5, 8 * i + 6, 8 * i + 7);
        const __m256 seen = _mm256_and_ps(_mm256_cmp_ps(j, f, _CMP_GE_OQ), _mm256_cmp_ps(j, e, _CMP_LT_OQ));
        _mm256_storeu_ps(s + 8 * i, _mm256_blendv_ps(hidden, _mm256_loadu_ps(s + 8 * i), seen));
    }
}

// A row's scores s[0..16) (left-out keys -inf) folded into its running max m, sum l and output o (D values, rescaled
// where the max grows); s becomes the keys' weights exp(s - m).
inline void fold_row(float* s, float& m, float& l, float* o, int64_t D) {
    const __m256 a = _mm256_loadu_ps(s), b = _mm256_loadu_ps(s + 8);
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(_mm256_max_ps(a, b)), _mm256_extractf128_ps(_mm256_max_ps(a, b), 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    const float top = std::max(_mm_cvtss_f32(x), _mm_cvtss_f32(_mm_movehdup_ps(x)));
    if (top == -INFINITY) {  // no key of these 16 is seen
        std::fill(s, s + KEYS, 0.0f);
        return;
    }
    if (top > m) {
        const __m256 alpha = _mm256_set1_ps(m == -INFINITY ? 0.0f : std::exp(m - top));
        l *= alpha[0];
        for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), alpha));
        m = top;
    }
    const __m256 mv = _mm256_set1_ps(m), minus = _mm256_set1_ps(-INFINITY);
    const __m256 ea = _mm256_and_ps(exp_ps(_mm256_sub_ps(a, mv)), _mm256_cmp_ps(a, minus, _CMP_NEQ_OQ));
    const __m256 eb = _mm256_and_ps(exp_ps(_mm256_sub_ps(b, mv)), _mm256_cmp_ps(b, minus, _CMP_NEQ_OQ));
    _mm256_storeu_ps(s, ea), _mm256_storeu_ps(s + 8, eb);
    l += hsum(_mm256_add_ps(ea, eb));
}

// Key `key` of a sequence (its table row `table`) for head g as D floats: from the main store m or, past num_main,
// the residual pool's r. `channel` holds a 2-bit-per-channel block's scales and minimums (read when the block changes).
struct KeyRows {
    const Store &m, &r;
    int64_t num_main;
    float* channel;
    int64_t loaded = -1;  // the block whose scales `channel` holds

    void read(const int64_t* table, int64_t key, int64_t g, float* out) {
        const int64_t block = table[key / m.bs], id = block >= num_main ? block - num_main : block, o = key % m.bs;
        const Store& s = block >= num_main ? r : m;
        if (s.format == F32) {
            const float* p = reinterpret_cast<const float*>(s.data) + ((id * s.bs + o) * s.kvh + g) * s.dim;
            std::copy(p, p + s.dim, out);
            return;
        }
        if (s.format == INT2_CHANNEL && loaded != block) s.channel_meta(id, g, channel, channel + s.dim), loaded = block;
        s.dequant_row(id, o, g, channel, channel + s.dim, out);
    }
};

struct PromptTask {
    int64_t b, g, q0, q1, cost;
};

}  // namespace

namespace kva {

// counts[b]: sequence b's queries, the first of its Q entries of query_index (the rest repeat its last).
void attend_prompt(const KVStores& s, const float* q, int64_t q_t, int64_t q_h, const int64_t* query_index, const int64_t* counts, int64_t B,
                   int64_t Q, int64_t H, const int64_t* tables, int64_t W, const int64_t* lens, double scale, int64_t window, float* out) {
    const kvt::Scope timed{&kvt::attention_ns()};
    const int64_t D = s.k.dim, KVH = s.k.kvh, G = H / KVH;
    std::vector<int64_t> first_row(B + 1, 0);  // each sequence's first output row
    std::vector<PromptTask> tasks;
    for (int64_t b = 0; b < B; ++b) {
        first_row[b + 1] = first_row[b] + counts[b];
        for (int64_t q0 = 0; q0 < counts[b]; q0 += TILE) {
            const int64_t q1 = std::min(counts[b], q0 + TILE), last = lens[b] - counts[b] + q1 - 1;
            const int64_t keys = window > 0 ? std::min(last + 1, window + q1 - q0 - 1) : last + 1;
            for (int64_t g = 0; g < KVH; ++g) tasks.push_back({b, g, q0, q1, keys * (q1 - q0)});
        }
    }
    std::sort(tasks.begin(), tasks.end(), [](const PromptTask& x, const PromptTask& y) { return x.cost > y.cost; });
    std::atomic<int64_t> next{0};  // the costliest first, to whichever thread is free: the threads end together
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
        const int64_t R = TILE * G;
        std::vector<float> qs(R * D), o(R * D), sc(R * KEYS), kt(D * KEYS), kv(KEYS * D), vv(KEYS * D), channel(4 * D), m(R), l(R);
        KeyRows keys{s.k, s.rk, s.num_main, channel.data()}, values{s.v, s.rv, s.num_main, channel.data() + 2 * D};
        for (int64_t i; (i = next.fetch_add(1)) < int64_t(tasks.size());) {
            const PromptTask& t = tasks[i];
            const int64_t rows = (t.q1 - t.q0) * G, before = lens[t.b] - counts[t.b], *table = tables + t.b * W;
            for (int64_t qi = t.q0; qi < t.q1; ++qi)  // row (qi - q0) * G + h: query head g * G + h, scaled
                for (int64_t h = 0; h < G; ++h) {
                    const float* src = q + query_index[t.b * Q + qi] * q_t + (t.g * G + h) * q_h;
                    float* dst = qs.data() + ((qi - t.q0) * G + h) * D;
                    for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * float(scale);
                }
            std::fill(o.begin(), o.begin() + rows * D, 0.0f), std::fill(m.begin(), m.end(), -INFINITY), std::fill(l.begin(), l.end(), 0.0f);
            const int64_t last = before + t.q1 - 1, lo = window > 0 ? std::max<int64_t>(0, before + t.q0 - window + 1) : 0;
            keys.loaded = values.loaded = -1;
            for (int64_t k0 = lo / KEYS * KEYS; k0 <= last; k0 += KEYS) {
                const int64_t n = std::min(KEYS, last + 1 - k0);
                for (int64_t j = 0; j < KEYS; ++j) {  // keys no row sees (before lo, past n) as zeros: a block a window
                    if (k0 + j < lo || j >= n) {  // left behind may have been given back, and 0 * NaN is NaN
                        std::fill(kv.begin() + j * D, kv.begin() + (j + 1) * D, 0.0f);
                        std::fill(vv.begin() + j * D, vv.begin() + (j + 1) * D, 0.0f);
                        continue;
                    }
                    keys.read(table, k0 + j, t.g, kv.data() + j * D);
                    values.read(table, k0 + j, t.g, vv.data() + j * D);
                }
                for (int64_t j = 0; j < KEYS; j += 8)
                    for (int64_t d = 0; d < D; d += 8) transpose8(kv.data() + j * D + d, D, kt.data() + d * KEYS + j, KEYS);
                row_groups<6>(rows, [&]<int N>(int64_t r) { tile_scores<N>(qs.data() + r * D, kt.data(), D, sc.data() + r * KEYS); });
                for (int64_t r = 0; r < rows; ++r) {  // the keys row r sees: [from, to) of these 16
                    const int64_t pos = before + t.q0 + r / G - k0;
                    const int64_t from = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0, to = std::min<int64_t>(KEYS, pos + 1);
                    float* sr = sc.data() + r * KEYS;
                    if (from > 0 || to < KEYS) hide_keys(sr, from, to);
                    fold_row(sr, m[r], l[r], o.data() + r * D, D);
                }
                for (int64_t c = 0; c < D; c += D - c >= 32 ? 32 : 8)
                    row_groups<3>(rows, [&]<int N>(int64_t r) {
                        float* orow = o.data() + r * D;
                        if (D - c >= 32) tile_values<N, 4>(sc.data() + r * KEYS, vv.data(), n, D, c, orow);
                        else tile_values<N, 1>(sc.data() + r * KEYS, vv.data(), n, D, c, orow);
                    });
            }
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t qi = t.q0 + r / G, h = t.g * G + r % G;
                float* dst = out + ((first_row[t.b] + qi) * H + h) * D;
                const float inv = 1.0f / l[r];
                for (int64_t d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv;
            }
        }
    });
}

}  // namespace kva

// q [T, H, D] fp32: a step's queries; query_index [B, Q]: each sequence's queries' rows of q (padding repeats the
// last real one); its keys are its first context_lens[b] in its blocks (block_tables [B, W]), the newest being its
// queries' own, each query seeing the keys up to its position (the last `window`, where window > 0). Returns
// [V, H, D]: the sequences' queries in order, without padding.
at::Tensor paged_prompt_attention(const at::Tensor& q_in, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& query_index,
                                  double scale, int64_t k_format, int64_t v_format, const std::vector<at::Tensor>& k_residual,
                                  const std::vector<at::Tensor>& v_residual, int64_t residual_format, int64_t window) {
    TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "q must be fp32 [T, H, D]");
    const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();  // the qkv projection's view, read where it lies
    const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous(), index = query_index.contiguous();
    const int64_t T = q.size(0), H = q.size(1), D = q.size(2), B = tables.size(0);
    const auto stores = kva::kv_stores(k, v, k_format, v_format, k_residual, v_residual, residual_format);
    TORCH_CHECK(kva::head_dim(*stores) == D && D % 8 == 0, "KV data does not hold ", D, " values per row (a multiple of 8)");
    TORCH_CHECK(H % stores->k.kvh == 0, "query heads are not a multiple of KV heads");
    TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 2 && index.size(0) == B, "query_index must be int64 [B, Q]");
    kva::check_step(*stores, tables, lens, 0, nullptr);  // every block up to each length: a prompt's first queries see before lens - window
    const int64_t Q = index.size(1), *ip = index.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
    std::vector<int64_t> counts(B, 1);  // padding repeats a sequence's last query
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = 0; i < Q; ++i) {
            TORCH_CHECK(ip[b * Q + i] >= 0 && ip[b * Q + i] < T, "query index ", ip[b * Q + i], " is outside q");
            if (i > 0 && ip[b * Q + i] != ip[b * Q + i - 1]) ++counts[b];
        }
        TORCH_CHECK(counts[b] <= lp[b], "sequence ", b, " has more queries than keys");
    }
    at::Tensor out = at::empty({std::accumulate(counts.begin(), counts.end(), int64_t(0)), H, D}, q.options());
    kva::attend_prompt(*stores, q.data_ptr<float>(), q.stride(0), q.stride(1), ip, counts.data(), B, Q, H, tables.data_ptr<int64_t>(),
                       tables.size(1), lp, scale, window, out.data_ptr<float>());
    return out;
}

namespace {

// The new tokens' K/V (fp32 [T, KVH, D], rows of unit stride) and their slots, checked against the stores.
kva::NewKV new_kv(const kva::KVStores& s, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& slots) {
    const int64_t T = slots.numel();
    for (const at::Tensor* x : {&k_new, &v_new})
        TORCH_CHECK(x->dim() == 3 && x->scalar_type() == at::kFloat && x->stride(2) == 1 && x->size(0) == T && x->size(1) == s.k.kvh &&
                    x->size(2) == s.k.dim, "new K/V must be fp32 [T, KVH, D] matching the cache and the slots");
    kva::check_slots(s, slots);
    return {k_new.data_ptr<float>(), v_new.data_ptr<float>(), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            slots.data_ptr<int64_t>()};
}

}  // namespace

// New tokens' K/V [T, KVH, D] (fp32) written at their slots of a float, fp8, int8 or int4 store (of the residual
// pool where there is one), as the formats' quantize_tokens write them.
void paged_write_kv(const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v, int64_t k_format, int64_t v_format,
                    const std::vector<at::Tensor>& k_residual, const std::vector<at::Tensor>& v_residual, int64_t residual_format,
                    const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& slots) {
    const auto stores = kva::kv_stores(k, v, k_format, v_format, k_residual, v_residual, residual_format);
    kva::write_new(*stores, new_kv(*stores, k_new, v_new, slots), slots.numel());
}

// q [B, H, D]; k, v: each a list of parts of a kvserve.kv format, values first ([blocks, block_size, KVH, ...]);
// block_tables [B, W]; context_lens [B]. Ids >= blocks index k_residual / v_residual ([blocks', block_size, KVH, D],
// in residual_format; empty lists: no residual pool). window > 0: each query sees only its last `window` keys
// (a sliding-window layer; the blocks before them are never read). k_new/v_new [B, KVH, D] and slots [B]: the new
// tokens' K/V, first written at their slots (of the residual pool where there is one, whose slots follow the main
// pool's), for float stores. hidden [B]: keys each query skips (kva::attend).
at::Tensor paged_decode_attention(const at::Tensor& q_in, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t k_format, int64_t v_format, const std::vector<at::Tensor>& k_residual,
                                  const std::vector<at::Tensor>& v_residual, int64_t residual_format, int64_t window,
                                  const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new,
                                  const c10::optional<at::Tensor>& slots, const c10::optional<at::Tensor>& hidden) {
    TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "q must be fp32 [B, H, D]");
    const at::Tensor q = q_in.contiguous(), tables = block_tables.contiguous(), lens = context_lens.contiguous();
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
    const auto stores = kva::kv_stores(k, v, k_format, v_format, k_residual, v_residual, residual_format);
    TORCH_CHECK(kva::head_dim(*stores) == D, "KV data does not hold ", D, " values per row in format ", k_format);
    TORCH_CHECK(H % stores->k.kvh == 0 && tables.size(0) == B, "shapes do not agree");
    kva::check_step(*stores, tables, lens, window, slots.has_value() ? &*slots : nullptr);
    TORCH_CHECK(!slots.has_value() || (k_new.has_value() && v_new.has_value()), "k_new, v_new and slots [T] go together");
    const kva::NewKV fresh = slots.has_value() ? new_kv(*stores, *k_new, *v_new, *slots) : kva::NewKV{};
    TORCH_CHECK(!slots.has_value() || slots->numel() == B, "one new token per query");
    at::Tensor out = at::empty_like(q);
    kva::attend(*stores, q.data_ptr<float>(), H * D, slots.has_value() ? &fresh : nullptr, B, H, tables.data_ptr<int64_t>(),
                tables.size(1), lens.data_ptr<int64_t>(), scale, window, kva::check_hidden(hidden, lens), out.data_ptr<float>());
    return out;
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
    m.def("paged_decode_attention(Tensor q, Tensor[] k, Tensor[] v, Tensor block_tables, Tensor context_lens, float scale, "
          "int k_format, int v_format, Tensor[] k_residual, Tensor[] v_residual, int residual_format, int window=0, "
          "Tensor? k_new=None, Tensor? v_new=None, Tensor? slots=None, Tensor? hidden=None) -> Tensor",
          &paged_decode_attention);
    m.def("paged_prompt_attention(Tensor q, Tensor[] k, Tensor[] v, Tensor block_tables, Tensor context_lens, Tensor query_index, "
          "float scale, int k_format, int v_format, Tensor[] k_residual, Tensor[] v_residual, int residual_format, int window=0) -> Tensor",
          &paged_prompt_attention);
    m.def("paged_write_kv(Tensor[] k, Tensor[] v, int k_format, int v_format, Tensor[] k_residual, Tensor[] v_residual, "
          "int residual_format, Tensor k_new, Tensor v_new, Tensor slots) -> ()", &paged_write_kv);
}
