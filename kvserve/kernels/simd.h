// Vector math the kernels share (AVX2 + FMA).
#pragma once
#include <immintrin.h>

#include <cstdint>

// exp(x) for x in [-87, 88], Cephes-style: 2^n * p(r), relative error ~1e-7.
inline __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
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

// The next block's lines, asked for into L1 a few at a time between a block's arithmetic (`steps` times), so that
// its fetch runs under the arithmetic; what is left when this block is done, at once. (Asking for a whole block at
// once stalls as long as reading it: the prefetches wait for fill buffers as loads do.)
struct Ahead {
    const char *p, *end;
    int64_t per;
    Ahead(const char* from, const char* to, int64_t steps) : p(from), end(to), per(steps > 0 ? ((to - from) / 64 + steps - 1) / steps : 0) {}
    inline void step() {
        for (int64_t k = 0; k < per && p < end; ++k, p += 64) _mm_prefetch(p, _MM_HINT_T0);
    }
    ~Ahead() {
        for (; p < end; p += 64) _mm_prefetch(p, _MM_HINT_T0);
    }
};

// Eight floats as bfloat16, rounded to nearest even as torch's .to(bfloat16) rounds finite values.
inline __m128i bf16_round(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// The sum of a vector's lanes.
inline float hsum(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hsum(__m256 v) { return hsum(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); }

// The sum of a vector's int32 lanes.
inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
