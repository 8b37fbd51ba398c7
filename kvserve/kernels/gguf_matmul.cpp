// x @ W.T with W kept in its GGUF blocks (Q4_0, Q4_1, Q8_0): a few rows of activations against 4- or 8-bit
// weights. Decoding is memory-bound, so reading 4.5-8.5 bits per weight instead of 32 is the whole point.
// Two ways: fp32 activations against weights dequantized in registers (the result equals fp32 math on the
// dequantized weights up to summation order), or activations quantized to int8 per block of 32 with one fp32
// scale, as llama.cpp does, for integer dot products: a third of the instructions per block (the result
// equals fp32 math on the dequantized weights and dequantized activations, up to summation order).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// ggml type ids and block sizes (ggml-common.h); every block holds 32 weights of one row.
constexpr int Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;
constexpr int64_t QK = 32;

constexpr int64_t block_bytes(int type) { return type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34; }

inline float fp16(const uint8_t* p) { return _cvtsh_ss(*reinterpret_cast<const uint16_t*>(p)); }

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The 32 integer codes of a block as four vectors of 8 floats, in weight order.
template <int TYPE>
inline void codes(const uint8_t* qs, __m256 c[4]) {
    if constexpr (TYPE == Q8_0) {
        for (int i = 0; i < 4; ++i)
            c[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i))));
    } else {  // byte j holds weight j in its low nibble and weight j + 16 in its high one
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        c[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        c[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        c[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        c[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    }
}

// M rows of K activations: fp32 with each block's sum, or int8 codes with each block's scale (the sum of a
// block's dequantized values is in `sum` then).
struct Activations {
    const float* x;
    const float* sum;
    const int8_t* q;
    const float* scale;
    int64_t K, blocks;
};

// The 32 weights of a block as bytes in weight order: codes 0..15 (Q4_0, Q4_1) or signed values (Q8_0).
template <int TYPE>
inline __m256i code_bytes(const uint8_t* qs) {
    if constexpr (TYPE == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}

// One weight row against R activation rows. A block's weights are d * code + m, so its dot product with x is
// d * (codes . x) + m * sum(x) (Q4_0: m = -8d; int8 activations: x = scale * q, sums of q).
template <int TYPE, int R, bool INT8>
void row_dot(const uint8_t* row, const Activations& a, int64_t r0, float* out, int64_t out_stride) {
    __m256 acc[R];
    float offset[R] = {};
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const int64_t K = a.K, blocks = a.blocks;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = row + b * block_bytes(TYPE);
        const uint8_t* qs = blk + (TYPE == Q4_1 ? 4 : 2);
        const float d = fp16(blk);
        const float m = TYPE == Q4_1 ? fp16(blk + 2) : TYPE == Q4_0 ? -8.0f * d : 0.0f;
        if constexpr (INT8) {
            const __m256i w = code_bytes<TYPE>(qs);
            const __m256i wu = TYPE == Q8_0 ? _mm256_sign_epi8(w, w) : w;  // unsigned bytes for maddubs
            for (int r = 0; r < R; ++r) {
                const int64_t i = (r0 + r) * blocks + b;
                __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + i * QK));
                if constexpr (TYPE == Q8_0) xq = _mm256_sign_epi8(xq, w);  // |w| * (x * sign(w)) = w * x
                const __m256i pairs = _mm256_maddubs_epi16(wu, xq);
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.scale[i]), dot, acc[r]);
                if constexpr (TYPE != Q8_0) offset[r] += m * a.sum[i];
            }
        } else {
            __m256 c[4];
            codes<TYPE>(qs, c);
            const __m256 dv = _mm256_set1_ps(d);
            for (int r = 0; r < R; ++r) {
                const float* xb = a.x + (r0 + r) * K + b * QK;
                __m256 dot = _mm256_mul_ps(c[0], _mm256_loadu_ps(xb));
                dot = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(xb + 8), dot);
                dot = _mm256_fmadd_ps(c[2], _mm256_loadu_ps(xb + 16), dot);
                dot = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(xb + 24), dot);
                acc[r] = _mm256_fmadd_ps(dv, dot, acc[r]);
                if constexpr (TYPE != Q8_0) offset[r] += m * a.sum[(r0 + r) * blocks + b];
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]) + offset[r];
}

template <int TYPE, bool INT8>
void matmul(const Activations& a, const uint8_t* w, int64_t M, int64_t N, float* out) {
    const int64_t row_bytes = a.blocks * block_bytes(TYPE);
    at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* row = w + n * row_bytes;
            int64_t r = 0;
            for (; r + 8 <= M; r += 8) row_dot<TYPE, 8, INT8>(row, a, r, out + r * N + n, N);
            // the rest in one pass too: each block is unpacked once for all rows
            float* o = out + r * N + n;
            switch (M - r) {
                case 7: row_dot<TYPE, 7, INT8>(row, a, r, o, N); break;
                case 6: row_dot<TYPE, 6, INT8>(row, a, r, o, N); break;
                case 5: row_dot<TYPE, 5, INT8>(row, a, r, o, N); break;
                case 4: row_dot<TYPE, 4, INT8>(row, a, r, o, N); break;
                case 3: row_dot<TYPE, 3, INT8>(row, a, r, o, N); break;
                case 2: row_dot<TYPE, 2, INT8>(row, a, r, o, N); break;
                case 1: row_dot<TYPE, 1, INT8>(row, a, r, o, N); break;
            }
        }
    });
}

template <bool INT8>
void matmul_type(int type, const Activations& a, const uint8_t* w, int64_t M, int64_t N, float* out) {
    if (type == Q4_0) matmul<Q4_0, INT8>(a, w, M, N, out);
    else if (type == Q4_1) matmul<Q4_1, INT8>(a, w, M, N, out);
    else matmul<Q8_0, INT8>(a, w, M, N, out);
}

}  // namespace

// The block type follows from the row length: 18, 20 or 34 bytes per 32 weights. int8_activations: each block of
// 32 activations becomes round(x / scale) with scale = max|x| / 127 (0 where the block is all zeros).
at::Tensor gguf_matmul(const at::Tensor& input, const at::Tensor& w, bool int8_activations) {
    TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kFloat && input.device().is_cpu(), "x must be a 2-D fp32 CPU tensor");
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be contiguous uint8 blocks");
    const at::Tensor x = input.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0), blocks = K / QK;
    TORCH_CHECK(K % QK == 0 && w.size(1) % blocks == 0, "weight blocks do not match K=", K);
    const int64_t bytes = w.size(1) / blocks;
    const int type = bytes == block_bytes(Q4_0) ? Q4_0 : bytes == block_bytes(Q4_1) ? Q4_1 : bytes == block_bytes(Q8_0) ? Q8_0 : -1;
    TORCH_CHECK(type != -1, "unsupported GGUF block of ", bytes, " bytes");
    at::Tensor out = at::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    std::vector<float> sums(M * blocks), scales;
    std::vector<int8_t> codes;
    if (int8_activations) {
        scales.resize(M * blocks), codes.resize(M * K);
        for (int64_t i = 0; i < M * blocks; ++i) {
            const float* xb = xp + i * QK;
            float amax = 0.0f;
            for (int64_t j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
            const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
            int32_t total = 0;
            for (int64_t j = 0; j < QK; ++j) total += codes[i * QK + j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
            scales[i] = scale, sums[i] = scale * float(total);
        }
    } else {
        for (int64_t i = 0; i < M * blocks; ++i)
            for (int64_t j = 0; j < QK; ++j) sums[i] += xp[i * QK + j];
    }
    const Activations a{xp, sums.data(), codes.data(), scales.data(), K, blocks};
    float* op = out.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    if (int8_activations) matmul_type<true>(type, a, wp, M, N, op);
    else matmul_type<false>(type, a, wp, M, N, op);
    return out;
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
    m.def("gguf_matmul(Tensor x, Tensor w, bool int8_activations=False) -> Tensor", &gguf_matmul);
}
