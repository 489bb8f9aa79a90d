// The avx512vnni instance of lowbit_kernel.hpp (compiled with its own -m flags: CMakeLists.txt).
#include <immintrin.h>

namespace {
// AVX512-VNNI on 256-bit registers (EVEX vpdpbusd, needs AVX512VL).
inline __m256i dot2_avx512vnni(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
}
#define LOWBIT_DOT2 dot2_avx512vnni
}  // namespace

#include "lowbit_kernel.hpp"

LOWBIT_ENTRY(avx512vnni)
