// The avx2 instance of lowbit_kernel.hpp (compiled with its own -m flags: CMakeLists.txt).
#include <immintrin.h>

namespace {
// maddubs (u8 x s8 -> pairs of i16; at most 2 * 15 * 127, no saturation) then madd with ones -> i32.
inline __m256i dot_avx2(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
#define LOWBIT_DOT dot_avx2
}  // namespace

#include "lowbit_kernel.hpp"

LowbitKernel lowbit_kernel_avx2() {
    return {"avx2",
            [](const LowbitArgs& a, int8_t* xq, float* dx, float* xs) {
                quantize_rows(a.x, a.M, a.K, a.Kp, a.gs, a.G, xq, dx, xs);
            },
            rows};
}
