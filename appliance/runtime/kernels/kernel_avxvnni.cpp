// The avxvnni instance of lowbit_kernel.hpp (compiled with its own -m flags: CMakeLists.txt).
#include <immintrin.h>

namespace {
// AVX-VNNI (VEX vpdpbusd): u8 x s8 summed by four into i32, the odd half accumulated onto the even one.
inline __m256i dot2_avxvnni(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
}
#define LOWBIT_DOT2 dot2_avxvnni
}  // namespace

#include "lowbit_kernel.hpp"

LOWBIT_ENTRY(avxvnni)
