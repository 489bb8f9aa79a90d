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

// u8 weights (the LM head) come as s8 = u8 - 128 (rewrite.u8_layout): maddubs(u8 w, s8 x) would saturate its i16
// pair sums (2 x 255 x 127). The sign moves onto x instead: |w| is a u8 up to 128 (abs(-128) = 0x80 read unsigned)
// and sign(x, w) stays in [-127, 127] (|x| <= 127), so a pair sums to at most 2 x 128 x 127 = 32512 in i16, and each
// half goes to i32 (madd) before the halves are added. The other way round, maddubs(|x|, sign(w, x)), would be
// cheaper (|x| shared by the rows of a pass) but wrong at w = -128 with x < 0: -(-128) does not fit an s8.
inline __m256i dot2_s8_avx2(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i a = _mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(xlo, lo));
    const __m256i b = _mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(xhi, hi));
    return _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones));
}
#define LOWBIT_DOT2_W8 dot2_s8_avx2
}  // namespace

#include "lowbit_kernel.hpp"

LOWBIT_ENTRY(avx2)
