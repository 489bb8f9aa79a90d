// The avx2 instance of lowbit_kernel.hpp (compiled with its own -m flags: CMakeLists.txt).
#include <immintrin.h>

namespace {
// maddubs (u8 x s8 -> pairs of i16, at most 2 * 15 * 127), the even and odd halves added as i16 (at most 7620, no
// saturation), then one madd with ones -> i32.
inline __m256i dot2_avx2(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)),
                             _mm256_set1_epi16(1));
}
#define LOWBIT_DOT2 dot2_avx2
}  // namespace

#include "lowbit_kernel.hpp"

LOWBIT_ENTRY(avx2)
