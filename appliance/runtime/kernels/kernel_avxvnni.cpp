// The avxvnni instance of lowbit_kernel.hpp (compiled with its own -m flags: CMakeLists.txt).
#include <immintrin.h>

namespace {
// AVX-VNNI (VEX-encoded vpdpbusd): u8 x s8 summed by four into i32 in one instruction.
inline __m256i dot_avxvnni(__m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x); }
#define LOWBIT_DOT dot_avxvnni
}  // namespace

#include "lowbit_kernel.hpp"

LowbitKernel lowbit_kernel_avxvnni() {
    return {"avxvnni",
            [](const LowbitArgs& a, int8_t* xq, float* dx, float* xs) {
                quantize_rows(a.x, a.M, a.K, a.Kp, a.gs, a.G, xq, dx, xs);
            },
            rows};
}
