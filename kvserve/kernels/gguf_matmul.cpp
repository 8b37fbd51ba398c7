// x @ W.T with W kept in its GGUF blocks (Q4_0, Q4_1, Q8_0): a few rows of fp32 activations against
// 4- or 8-bit weights, dequantized in registers. Decoding is memory-bound, so reading 4.5-8.5 bits per
// weight instead of 32 is the whole point; the result equals fp32 math on the dequantized weights up
// to summation order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

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

// One weight row against R activation rows. A block's weights are d * code + m, so its dot product
// with x is d * (codes . x) + m * sum(x): the sums of x per block are computed once per call.
template <int TYPE, int R>
void row_dot(const uint8_t* row, const float* x, const float* xsum, int64_t K, float* out, int64_t out_stride) {
    __m256 acc[R];
    float offset[R] = {};
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const int64_t blocks = K / QK;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = row + b * block_bytes(TYPE);
        const float d = fp16(blk);
        const float m = TYPE == Q4_1 ? fp16(blk + 2) : TYPE == Q4_0 ? -8.0f * d : 0.0f;
        __m256 c[4];
        codes<TYPE>(blk + (TYPE == Q4_1 ? 4 : 2), c);
        const __m256 dv = _mm256_set1_ps(d);
        for (int r = 0; r < R; ++r) {
            const float* xb = x + r * K + b * QK;
            __m256 dot = _mm256_mul_ps(c[0], _mm256_loadu_ps(xb));
            dot = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(xb + 8), dot);
            dot = _mm256_fmadd_ps(c[2], _mm256_loadu_ps(xb + 16), dot);
            dot = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(xb + 24), dot);
            acc[r] = _mm256_fmadd_ps(dv, dot, acc[r]);
            if constexpr (TYPE != Q8_0) offset[r] += m * xsum[r * blocks + b];
        }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]) + offset[r];
}

template <int TYPE>
void matmul(const float* x, const uint8_t* w, const float* xsum, int64_t M, int64_t K, int64_t N, float* out) {
    const int64_t row_bytes = K / QK * block_bytes(TYPE);
    at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* row = w + n * row_bytes;
            int64_t r = 0;
            const int64_t blocks = K / QK;
            for (; r + 8 <= M; r += 8) row_dot<TYPE, 8>(row, x + r * K, xsum + r * blocks, K, out + r * N + n, N);
            // the rest in one pass too: each block is unpacked once for all rows (a row's sums do not change)
            const float* xr = x + r * K;
            const float* sr = xsum + r * blocks;
            float* o = out + r * N + n;
            switch (M - r) {
                case 7: row_dot<TYPE, 7>(row, xr, sr, K, o, N); break;
                case 6: row_dot<TYPE, 6>(row, xr, sr, K, o, N); break;
                case 5: row_dot<TYPE, 5>(row, xr, sr, K, o, N); break;
                case 4: row_dot<TYPE, 4>(row, xr, sr, K, o, N); break;
                case 3: row_dot<TYPE, 3>(row, xr, sr, K, o, N); break;
                case 2: row_dot<TYPE, 2>(row, xr, sr, K, o, N); break;
                case 1: row_dot<TYPE, 1>(row, xr, sr, K, o, N); break;
            }
        }
    });
}

}  // namespace

// The block type follows from the row length: 18, 20 or 34 bytes per 32 weights.
at::Tensor gguf_matmul(const at::Tensor& input, const at::Tensor& w) {
    TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kFloat && input.device().is_cpu(), "x must be a 2-D fp32 CPU tensor");
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be contiguous uint8 blocks");
    const at::Tensor x = input.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    TORCH_CHECK(K % QK == 0 && w.size(1) % (K / QK) == 0, "weight blocks do not match K=", K);
    const int64_t bytes = w.size(1) / (K / QK);
    const int type = bytes == block_bytes(Q4_0) ? Q4_0 : bytes == block_bytes(Q4_1) ? Q4_1 : bytes == block_bytes(Q8_0) ? Q8_0 : -1;
    TORCH_CHECK(type != -1, "unsupported GGUF block of ", bytes, " bytes");
    at::Tensor out = at::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    std::vector<float> xsum(M * (K / QK));
    for (int64_t i = 0; i < M * (K / QK); ++i)
        for (int64_t j = 0; j < QK; ++j) xsum[i] += xp[i * QK + j];
    const float* sp = xsum.data();
    float* op = out.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    if (type == Q4_0) matmul<Q4_0>(xp, wp, sp, M, K, N, op);
    else if (type == Q4_1) matmul<Q4_1>(xp, wp, sp, M, K, N, op);
    else matmul<Q8_0>(xp, wp, sp, M, K, N, op);
    return out;
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) { m.def("gguf_matmul(Tensor x, Tensor w) -> Tensor", &gguf_matmul); }
