// The avx512vnni instance of lowbit_kernel.hpp (compiled with its own -m flags: CMakeLists.txt).
#include <immintrin.h>

namespace {
// AVX512-VNNI on 256-bit registers (EVEX vpdpbusd, needs AVX512VL), and one row of x (decode) on 512-bit ones
// (LOWBIT_ZMM: lowbit_kernel.hpp tile_zmm). On the AMX box (Sapphire Rapids) two pairs of blocks per 512-bit register
// were no faster standalone (1 thread, 1536 x 1536 g128, best of 200, 3 interleaved runs: 2.31 / 2.45 / 1.40 ns per
// 32 weights at M = 1 against 2.76 / 2.54 / 1.67); on a Zen 5 EPYC, whose 512-bit units are full width, the op at
// M = 1 took 0.33-0.54 of OpenVINO's time against the 256-bit tile's 0.59-0.81 (bench.kernels, 2 threads, 8
// layers, the Qwen2.5-1.5B and Llama-3.2-3B shapes; docs/performance.md).
inline __m256i dot2_avx512vnni(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
}
#define LOWBIT_DOT2 dot2_avx512vnni
#define LOWBIT_CHAINS 8  // 32 ymm registers (lowbit_kernel.hpp)
#define LOWBIT_ZMM      // one row of x on 512-bit registers (lowbit_kernel.hpp tile_zmm)
}  // namespace

#include "lowbit_kernel.hpp"

LOWBIT_ENTRY(avx512vnni)
