// The avx2 instance of attention_kernel.hpp (compiled with -mavx2 -mfma: CMakeLists.txt).
#include "vec_avx2.hpp"

namespace {
struct V : Avx2 {
    static constexpr int64_t CHUNKS = 2;  // 6 heads x 2 vectors of sums + 2 of values + a weight in 16 registers
};
}  // namespace

#include "attention_kernel.hpp"

ATTENTION_ENTRY(avx2)
