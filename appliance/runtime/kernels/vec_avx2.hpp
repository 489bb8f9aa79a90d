// Eight floats in a 256-bit register as the traits the vector code of this library is written against: the float
// vector type and its width W, zero, load, store, load_u8 (W u8 values as floats), fmadd, fnmadd, add, sub, mul,
// max, min, round (to nearest), scale2 (x 2^n), set1, hsum, hsum4 (four sums at once). The decode attention
// (attention_avx2.cpp) and the gated op's SwiGLU (lowbit_kernel.hpp) use it; attention_avx512.cpp has the 512-bit
// twin. Include it only from a file compiled with -mavx2 -mfma (CMakeLists.txt).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace {
struct Avx2 {
    using vec = __m256;
    static constexpr int64_t W = 8;
    static vec zero() { return _mm256_setzero_ps(); }
    static vec load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
    static vec load_u8(const uint8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    static vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
    static vec fnmadd(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
    static vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
    static vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
    static vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
    static vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
    static vec min(vec a, vec b) { return _mm256_min_ps(a, b); }
    static vec set1(float x) { return _mm256_set1_ps(x); }
    static vec round(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    // p 2^n for integral n in [-126, 127]: n + 127 as a float's exponent bits.
    static vec scale2(vec p, vec n) {
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    }
    static float hsum(vec v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
    // The sums of four vectors: two rounds of hadd, then the two 128-bit halves.
    static void hsum4(vec a, vec b, vec c, vec d, float* out) {
        const vec x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
    }
};
}  // namespace
