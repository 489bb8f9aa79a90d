// The low-bit matmul kernel, written once and compiled once per ISA (kernel_avx2.cpp, kernel_avxvnni.cpp,
// kernel_avx512vnni.cpp include it with their own -m flags and LOWBIT_DOT). Everything here sits in an anonymous
// namespace: each translation unit keeps its own copy, so the linker never merges an AVX-512 instance into the
// AVX2 path (the one-definition-rule trap of per-ISA builds).
//
// y[m, n] = sum_g s[n,g] * sum_{k in g} (q[n,k] - z[n,g]) * x[m,k]
//         ~ sum_g s[n,g] * (sum_{b in g} dx[m,b] * <q[n,b], xq[m,b]>  -  z[n,g] * sum_{k in g} x[m,k])
// x is quantized per block of 32 values to int8 (dx = max|x| / 127). The zero-point term sums the quantized x
// (dx * sum xq), not the exact x: then the two terms are exactly the dot of (q - z) with the quantized x, and the
// rounding error scales with |q - z| (<= 15 - z) instead of q (<= 15). With the exact sum, Q4_1 grids (z ~ 7.5)
// measured a 1.2-2.2% error of the largest output on the default model's layers, against 0.4-0.9% this way. q is u4 as OpenVINO stores it (byte j of a 32-block holds
// elements 2j (low nibble) and 2j+1 (high nibble)); instead of repacking the weights, the activations are stored
// permuted (even elements first, then odd), so one AND and one shift unpack a block into the same order.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "lowbit_kernel.h"

namespace {

constexpr int BLOCK = 32;
constexpr int MTILE = 4;  // rows of x per pass over a weight row: the row stays in L1, read from memory once

// Quantizes rows of x [M, K] to xq [M, Kp] (permuted blocks), dx [M, Kp/32] and per-group sums xs [M, G].
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int64_t gs, int64_t G, int8_t* xq,
                          float* dx, float* xs) {
    const int64_t blocks = Kp / BLOCK;
    for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * K;
        int8_t* qr = xq + m * Kp;
        float* dr = dx + m * blocks;
        float* sr = xs + m * G;
        for (int64_t g = 0; g < G; ++g) sr[g] = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
            float v[BLOCK];
            for (int i = 0; i < BLOCK; ++i) {
                const int64_t k = b * BLOCK + i;
                v[i] = k < K ? xr[k] : 0.f;
            }
            float amax = 0.f;
            for (int i = 0; i < BLOCK; ++i) amax = std::fmax(amax, std::fabs(v[i]));
            const float d = amax / 127.f;
            dr[b] = d;
            int8_t* out = qr + b * BLOCK;
            int sum = 0;
            for (int i = 0; i < BLOCK; ++i) {
                // Division, not a multiplication by 1/d: 1/d overflows when d is denormal.
                int q = d > 0.f ? static_cast<int>(std::nearbyint(v[i] / d)) : 0;
                q = q < -127 ? -127 : (q > 127 ? 127 : q);
                out[(i & 1) * 16 + (i >> 1)] = static_cast<int8_t>(q);
                sum += q;
            }
            sr[(b * BLOCK) / gs] += d * static_cast<float>(sum);
        }
    }
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256i unpack_u4(const uint8_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    return _mm256_set_m128i(hi, lo);
}

// Rows [n0, n1) of the output for rows [m0, m0 + mt) of x; mt <= MTILE.
template <int MT>
inline void rows_tile(const LowbitArgs& a, const int8_t* xq, const float* dx, const float* xs, int64_t m0,
                      int64_t n0, int64_t n1) {
    const int64_t blocks = a.Kp / BLOCK, per_group = a.gs / BLOCK, row_bytes = a.Kp / 2;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* w = a.w + n * row_bytes;
        const uint16_t* sz = a.sz + n * 2 * a.G;
        __m256 acc[MT];
        float bias[MT];
        for (int m = 0; m < MT; ++m) {
            acc[m] = _mm256_setzero_ps();
            bias[m] = 0.f;
        }
        for (int64_t g = 0; g < a.G; ++g) {
            const float s = _cvtsh_ss(sz[2 * g]);
            const float bz = s * _cvtsh_ss(sz[2 * g + 1]);
            __m256 gacc[MT];
            for (int m = 0; m < MT; ++m) gacc[m] = _mm256_setzero_ps();
            const int64_t b1 = (g + 1) * per_group < blocks ? (g + 1) * per_group : blocks;
            for (int64_t b = g * per_group; b < b1; ++b) {
                const __m256i wq = unpack_u4(w + b * (BLOCK / 2));
                for (int m = 0; m < MT; ++m) {
                    const __m256i xv =
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (m0 + m) * a.Kp + b * BLOCK));
                    const __m256i dot = LOWBIT_DOT(wq, xv);
                    gacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dx[(m0 + m) * blocks + b]),
                                              gacc[m]);
                }
            }
            const __m256 vs = _mm256_set1_ps(s);
            for (int m = 0; m < MT; ++m) {
                acc[m] = _mm256_fmadd_ps(gacc[m], vs, acc[m]);
                bias[m] += bz * xs[(m0 + m) * a.G + g];
            }
        }
        for (int m = 0; m < MT; ++m) a.y[(m0 + m) * a.N + n] = hsum(acc[m]) - bias[m];
    }
}

inline void rows(const LowbitArgs& a, const int8_t* xq, const float* dx, const float* xs, int64_t n0, int64_t n1) {
    int64_t m0 = 0;
    for (; m0 + MTILE <= a.M; m0 += MTILE) rows_tile<MTILE>(a, xq, dx, xs, m0, n0, n1);
    switch (a.M - m0) {
        case 3: rows_tile<3>(a, xq, dx, xs, m0, n0, n1); break;
        case 2: rows_tile<2>(a, xq, dx, xs, m0, n0, n1); break;
        case 1: rows_tile<1>(a, xq, dx, xs, m0, n0, n1); break;
        default: break;
    }
}

}  // namespace
