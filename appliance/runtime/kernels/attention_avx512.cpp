// The avx512 instance of attention_kernel.hpp (compiled with -mavx512f -mavx512bw -mavx512vl: CMakeLists.txt), for
// groups of a multiple of 16 values on a CPU with AVX-512 (decode_attention.cpp picks it).
#include <immintrin.h>

#include <cstdint>

namespace {
struct V {
    using vec = __m512;
    static constexpr int64_t W = 16;
    static constexpr int64_t CHUNKS = 4;  // 6 heads x 4 vectors of sums + 4 of values + a weight in 32 registers
    static vec zero() { return _mm512_setzero_ps(); }
    static vec load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
    static vec load_u8(const uint8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    static vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
    static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
    static vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
    static vec set1(float x) { return _mm512_set1_ps(x); }
    static float hsum(vec v) { return _mm512_reduce_add_ps(v); }
    // The sums of four vectors with one shuffle tree (4 reductions one after the other cost ~3x as much).
    static void hsum4(vec a, vec b, vec c, vec d, float* out) {
        const vec ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        const vec cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
        const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
        vec x = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
        x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
        x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
        _mm_storeu_ps(out, _mm512_castps512_ps128(x));
    }
    static vec fnmadd(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }
    static vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
    static vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
    static vec min(vec a, vec b) { return _mm512_min_ps(a, b); }
    static vec round(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static vec scale2(vec p, vec n) { return _mm512_scalef_ps(p, n); }
};
}  // namespace

#include "attention_kernel.hpp"

ATTENTION_ENTRY(avx512)
