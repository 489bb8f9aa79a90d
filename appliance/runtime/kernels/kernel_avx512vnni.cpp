// The avx512vnni instance of lowbit_kernel.hpp (compiled with its own -m flags: CMakeLists.txt).
#include <immintrin.h>

namespace {
// AVX512-VNNI on 256-bit registers (EVEX vpdpbusd, needs AVX512VL). Tried: two pairs of blocks per 512-bit register
// (one 64-byte weight load, activations joined with vinserti64x4): no faster standalone (1 thread, 1536 x 1536 g128,
// best of 200, 3 interleaved runs: 2.31 / 2.45 / 1.40 ns per 32 weights at M = 1 against 2.76 / 2.54 / 1.67).
inline __m256i dot2_avx512vnni(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
}
#define LOWBIT_DOT2 dot2_avx512vnni
#define LOWBIT_CHAINS 8  // 32 ymm registers (lowbit_kernel.hpp)
}  // namespace

#include "lowbit_kernel.hpp"

LOWBIT_ENTRY(avx512vnni)
