// LowBitMatMul: y = x . dequant(W)^T for u4 (or u8) weights with a per-group f16 scale and zero point, as an OpenVINO
// custom op (evaluate() on the CPU plugin's reference path). Inputs: x f32 [..., K]; w u8 [N, Kp / 2] or u4 [N, ...]
// (Kp = K rounded up to 32, two values per byte, low nibble first: OpenVINO's own u4 order), or with bits = 8 bytes
// [N, Kp] in our paired layout (lowbit_kernel.hpp; rewrite.py repacks at load: u8 on the VNNI paths, s8 = u8 - 128
// on AVX2, rewrite.U8_ISAS); sz u8 [N, 4 G]: per row the f16 bits of its G group scales, then of its G zero points
// (rewrite.scale_table; raw bytes, so that no precision setting of the plugin converts them).
// Attributes: group_size (32 or a multiple of 64), isa ("auto", "avx2", "avxvnni", "avx512vnni"; bits = 8 needs a
// named one: its layout is the path's), bits (4 or 8), row_group (w's rows interleaved by groups of that many,
// lowbit_kernel.h; 1: row-major), slot_pairs (1; or 0: in lanes of 16 rows with their scale table likewise, only on
// avx512vnni: lowbit_kernel.hpp lanes_tile), residual (1: x's int8 rounding error runs too, below; at one row in
// lanes as a second int8 digit of x instead, lowbit_kernel.hpp lanes_tile; 2: that digit only, u4), gated (1 / 2:
// a SwiGLU's gate and up, y = silu(one half) * the other), down (1, beside gated: the MLP's down projection too, its
// w and sz as inputs 3 and 4 in the same layout and group size; y = that of the SwiGLU, rewrite.mlp). Output f32
// [..., N] (gated: N / 2; down: down's N). An optional last input, the next op's w (rewrite.link_ahead), is read
// ahead into this core's caches by an idle thread while the nodes between the two ops run (read_ahead, below).
// Why, with measurements: appliance/runtime/kernels/__init__.py.
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/op/op.hpp>
#include <string>
#include <vector>

#include "lowbit_kernel.h"

namespace {

bool supported(const std::string& isa) {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == "avx2") return avx2;
    if (isa == "avxvnni") return avx2 && __builtin_cpu_supports("avxvnni");
    if (isa == "avx512vnni")
        return avx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bw");
    return false;
}

// The widest path this CPU runs: AVX512-VNNI, then AVX-VNNI, then AVX2; "" when not even AVX2.
std::string best_isa() {
    for (const char* isa : {"avx512vnni", "avxvnni", "avx2"})
        if (supported(isa)) return isa;
    return "";
}

// The first 64-byte boundary at or after p (the scratch holds 64 bytes more than it needs).
template <typename T>
T* aligned(T* p) {
    const auto at = reinterpret_cast<uintptr_t>(p);
    return reinterpret_cast<T*>((at + 63) / 64 * 64);
}

// Rows [M, 2M) of xr: what x's rows lose to int8 as the kernels round them (lowbit_kernel.hpp quantize_block: per
// octet of 8 values, d = max|x| / 127, q = x / d rounded to nearest even; zero where d is not positive), so that
// quantized again as M more rows of x, the two rows' outputs add up to y with each value's rounding error ~127x
// smaller (the residual's step is its own octet's max / 127, at most half the first's). Scalar: it runs only on
// the attention projections, and only where asked (kernels.RESIDUAL_ENV); their K is the hidden size.
void residual_rows(const float* x, int64_t M, int64_t K, float* xr) {
    std::copy(x, x + M * K, xr);
    for (int64_t m = 0; m < M; ++m) {
        const float* row = x + m * K;
        float* r = xr + (M + m) * K;
        for (int64_t o = 0; o < K; o += 8) {
            const int64_t end = std::min(o + 8, K);
            float amax = 0.f;
            for (int64_t j = o; j < end; ++j) amax = std::max(amax, std::fabs(row[j]));
            const float d = amax / 127.f;
            for (int64_t j = o; j < end; ++j) r[j] = d > 0.f ? row[j] - std::nearbyint(row[j] / d) * d : row[j];
        }
    }
}

// Counts the op's calls in this process: a read-ahead stops when the next call starts (its bytes are then being read).
std::atomic<uint64_t> g_calls{0};

// How far ahead the next op's weights are read: 3/4 of this core's L2 (they wait there for the next op), at most
// 768 KB. On the 2-vCPU Zen 4 EPYC (1 MB L2) reading 384 / 768 / 1536 KB took the Qwen2.5-1.5B decode step to
// 0.998 / 0.984 / 0.994 of its time without (10 interleaved reps; a gap rarely lasts for more than ~700 KB).
int64_t ahead_bytes() {
    static const int64_t bytes = [] {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        return std::min<int64_t>(768 << 10, l2 > 0 ? l2 / 4 * 3 : 256 << 10);
    }();
    return bytes;
}

// Between two of our ops the graph runs nodes that read little memory (norms, RoPE, attention over a short context,
// converts, the CPU plugin's shape inference of our op): 58-76 us from one op's end to the next op's start at
// Qwen2.5-1.5B's decode step on the Zen 4 box, while the arena's other thread waits and the memory bus idles. That
// thread now reads the next op's weights from where TBB hands it its first rows (the middle: parallel_for's first
// split) until the next op starts or ahead_bytes() are read: ~700 KB a gap, which the op then reads from cache. The
// op took 15 us less, the gap 5 us more; the decode step 0.954-0.978 of its time without at 1.5B and 0.977 at
// Llama-3.2-3B (engines side by side, interleaved, medians of 12-16 pairs). One load per 64-byte line.
// The read holds a plain pointer into the plugin's memory: it ends when the next op of the same inference starts,
// and the last op of a graph (the LM head) reads nothing ahead, so none is left running when an inference returns.
// Our ops end it first, before their checks can throw. An inference that fails in a node between two of ours leaves
// it to finish its at most ahead_bytes() alone (tens of us at the box's bandwidth), far inside any unload of a model.
// A task TBB starts late (it was queued while no thread was free) reads nothing: the gap it was for is over, and
// the model whose weights it points at may have been unloaded since (a thread picking it up during a later
// compile_model would read freed memory).
constexpr std::chrono::microseconds READ_AHEAD_START{1000};

void read_ahead(const ov::Tensor& next, uint64_t call) {
    if (tbb::this_task_arena::max_concurrency() <= 1) return;
    const auto* bytes = static_cast<const char*>(next.data());
    const int64_t size = static_cast<int64_t>(next.get_byte_size());
    const int64_t from = size / 2 / 4096 * 4096, to = std::min(size, from + ahead_bytes());
    const auto queued = std::chrono::steady_clock::now();
    tbb::this_task_arena::enqueue([bytes, from, to, call, queued] {
        if (std::chrono::steady_clock::now() - queued > READ_AHEAD_START) return;
        uint64_t sum = 0;
        for (int64_t page = from; page < to && g_calls.load(std::memory_order_relaxed) == call; page += 4096)
            for (int64_t at = page; at < std::min(to, page + 4096); at += 64)
                sum += *reinterpret_cast<const volatile uint64_t*>(bytes + at);
        volatile uint64_t sink = sum;
        (void)sink;
    });
}

}  // namespace

// Ends a read-ahead still running (read_ahead): another op of ours that parallelises (DecodeAttention) calls it, so
// that the arena's other thread joins that op instead of reading weights beside it.
void appliance_end_read_ahead() { g_calls.fetch_add(1, std::memory_order_relaxed); }

namespace {

LowbitKernel kernel_for(const std::string& isa) {
    if (isa == "avx512vnni") return lowbit_kernel_avx512vnni();
    if (isa == "avxvnni") return lowbit_kernel_avxvnni();
    return lowbit_kernel_avx2();
}

}  // namespace

namespace appliance {

class LowBitMatMul : public ov::op::Op {
public:
    OPENVINO_OP("LowBitMatMul", "appliance");

    LowBitMatMul() = default;
    LowBitMatMul(const ov::OutputVector& args, int64_t group_size, std::string isa, int64_t bits = 4,
                 int64_t row_group = 1, int64_t residual = 0, int64_t slot_pairs = 1, int64_t gated = 0,
                 int64_t down = 0)
        : Op(args),
          m_group_size(group_size),
          m_isa(std::move(isa)),
          m_bits(bits),
          m_row_group(row_group),
          m_residual(residual),
          m_slot_pairs(slot_pairs),
          m_gated(gated),
          m_down(down) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        const size_t fixed = weights_inputs();
        OPENVINO_ASSERT(m_down == 0 || m_down == 1, "LowBitMatMul: down must be 0 or 1");
        OPENVINO_ASSERT(get_input_size() == fixed || get_input_size() == fixed + 1,
                        m_down ? "LowBitMatMul with down takes x, w, sz, the down w and sz, and the next w"
                               : "LowBitMatMul takes x, w, sz and the next w");
        OPENVINO_ASSERT(get_input_size() == fixed || get_input_element_type(fixed) == ov::element::u8,
                        "LowBitMatMul: the next op's w must be u8 bytes");
        OPENVINO_ASSERT(m_group_size == 32 || (m_group_size > 0 && m_group_size % 64 == 0),
                        "LowBitMatMul: group_size must be 32 or a multiple of 64");
        OPENVINO_ASSERT(m_isa == "auto" || supported(m_isa), "LowBitMatMul: this CPU cannot run isa=", m_isa);
        OPENVINO_ASSERT(!best_isa().empty(), "LowBitMatMul: needs AVX2 and FMA");
        OPENVINO_ASSERT(m_bits == 4 || m_bits == 8, "LowBitMatMul: bits must be 4 or 8");
        OPENVINO_ASSERT(m_bits == 4 || m_isa != "auto", "LowBitMatMul: bits 8 needs a named isa (its layout)");
        OPENVINO_ASSERT(m_row_group >= 1 && m_row_group <= 64, "LowBitMatMul: row_group must be 1..64");
        OPENVINO_ASSERT(m_residual >= 0 && m_residual <= 2, "LowBitMatMul: residual must be 0, 1 or 2");
        // Only the 512-bit lanes tile reads lanes; every other tile would misread them.
        OPENVINO_ASSERT(m_slot_pairs == 0 || m_slot_pairs == 1, "LowBitMatMul: slot_pairs must be 0 or 1");
        OPENVINO_ASSERT(m_slot_pairs == 1 || (m_isa == "avx512vnni" && m_row_group == 16),
                        "LowBitMatMul: slot_pairs 0 (lanes) needs isa avx512vnni and row_group 16");
        OPENVINO_ASSERT(m_gated >= 0 && m_gated <= 2 && (m_gated == 0 || m_residual != 1),
                        "LowBitMatMul: gated must be 0, 1 or 2, and not beside residual 1");
        OPENVINO_ASSERT(m_down == 0 || (m_gated != 0 && m_bits == 4), "LowBitMatMul: down needs gated u4");
        auto out = get_input_partial_shape(0);
        const auto& sz = get_input_partial_shape(2);
        if (m_gated && sz.rank().is_static() && sz[0].is_static())
            OPENVINO_ASSERT(sz[0].get_length() % (2 * m_row_group) == 0,
                            "LowBitMatMul: gated needs two halves of whole row groups");
        if (out.rank().is_static() && sz.rank().is_static()) {
            auto& last = out[out.size() - 1];
            last = m_gated && sz[0].is_static() ? ov::Dimension(sz[0].get_length() / 2) : sz[0];
            if (m_down) {  // the SwiGLU's width is the down projection's K; its rows are the output's
                const auto& sz2 = get_input_partial_shape(4);
                last = sz2.rank().is_static() ? sz2[0] : ov::Dimension::dynamic();
            }
        }
        set_output_type(0, ov::element::f32, out);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<LowBitMatMul>(args, m_group_size, m_isa, m_bits, m_row_group, m_residual, m_slot_pairs,
                                              m_gated, m_down);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("group_size", m_group_size);
        visitor.on_attribute("isa", m_isa);
        visitor.on_attribute("bits", m_bits);
        visitor.on_attribute("row_group", m_row_group);
        visitor.on_attribute("residual", m_residual);
        visitor.on_attribute("slot_pairs", m_slot_pairs);
        visitor.on_attribute("gated", m_gated);
        visitor.on_attribute("down", m_down);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const uint64_t call = g_calls.fetch_add(1, std::memory_order_relaxed) + 1;
        const ov::Tensor& x = inputs[0];
        const ov::Shape xs = x.get_shape();
        const int64_t K = static_cast<int64_t>(xs.back());
        const int64_t M = static_cast<int64_t>(ov::shape_size(xs)) / (K ? K : 1);
        LowbitArgs a = args(inputs[1], inputs[2], M, K);
        // down: its x is the gated rows' product (scratch), its y the op's output.
        LowbitArgs d = m_down ? args(inputs[3], inputs[4], M, a.N / 2) : LowbitArgs{};
        // residual 1 not as a second digit of x (args): x's rounding error as M more rows of x.
        const bool residual_rows_too = m_residual == 1 && a.digits == 1;
        OPENVINO_ASSERT(!m_gated || a.N % (2 * a.rg) == 0, "LowBitMatMul: gated needs two halves of whole row groups");
        ov::Shape ys = xs;
        ys.back() = static_cast<size_t>(m_down ? d.N : m_gated ? a.N / 2 : a.N);
        outputs[0].set_shape(ys);
        a.x = x.data<const float>();
        a.y = outputs[0].data<float>();
        if (a.M == 0 || a.N == 0) {  // with down, N = 0 is an empty SwiGLU: its projection is zero
            std::fill(a.y, a.y + ov::shape_size(ys), 0.f);
            return true;
        }
        // gated: the halves go to scratch first, the product to the op's output, or with down to d's x.
        thread_local std::vector<float> halves, product;
        float* gated = nullptr;
        if (m_gated) {
            halves.resize(static_cast<size_t>(a.M * a.N));
            if (m_down) {
                product.resize(static_cast<size_t>(a.M * a.N / 2));
                d.x = product.data();
                d.y = a.y;
            }
            gated = m_down ? product.data() : a.y;
            a.y = halves.data();
        }
        // residual 1 elsewhere: x's int8 rounding error as M more rows of x (residual_rows), the two outputs added
        // at the end.
        const int64_t rows = a.M;
        float* const y = a.y;
        thread_local std::vector<float> xr, yr;
        if (residual_rows_too) {
            xr.resize(static_cast<size_t>(2 * a.M * a.K));
            yr.resize(static_cast<size_t>(2 * a.M * a.N));
            residual_rows(a.x, a.M, a.K, xr.data());
            a.x = xr.data();
            a.y = yr.data();
            a.M *= 2;
        }
        run(a, gated, m_gated);
        if (residual_rows_too)
            for (int64_t i = 0; i < rows * a.N; ++i) y[i] = a.y[i] + a.y[rows * a.N + i];
        if (m_down && d.N) run(d, nullptr, 0);
        if (inputs.size() > weights_inputs()) read_ahead(inputs.back(), call);
        return true;
    }

private:
    // N rounded up to whole row groups: the rows w holds.
    static int64_t padded(const LowbitArgs& a) { return (a.N + a.rg - 1) / a.rg * a.rg; }

    // Inputs before the optional next op's w: x, w, sz (and with down, down's w and sz).
    size_t weights_inputs() const { return m_down ? 5 : 3; }

    // The kernel's arguments for weights w and their table sz against M rows of x [M, K] (x and y set by the caller).
    LowbitArgs args(const ov::Tensor& w, const ov::Tensor& sz, int64_t M, int64_t K) const {
        LowbitArgs a{};
        a.M = M;
        a.K = K;
        a.N = static_cast<int64_t>(sz.get_shape()[0]);
        a.G = static_cast<int64_t>(sz.get_byte_size()) / 4 / (a.N ? a.N : 1);
        a.gs = m_group_size;
        a.Kp = (a.K + 31) / 32 * 32;
        a.bits = m_bits;
        a.rg = m_row_group;
        a.slot = m_slot_pairs;
        // Lanes only, and before the residual's rows double M: the scales follow the rows of tokens; the residual is
        // x's error per octet, so with it (residual 1) x keeps a scale per octet.
        a.xspan = a.slot == 0 && m_residual != 1 && (a.bits == 8 || a.M >= LANES_BLOCK_ROWS) ? 4 : 1;
        // residual at one row in lanes with a scale per octet of x (u4; u8 with residual 1): a second int8 digit
        // of x (lanes_tile), not M more rows of x.
        a.digits = m_residual && a.slot == 0 && a.M == 1 && a.xspan == 1 ? 2 : 1;
        OPENVINO_ASSERT(a.slot == 1 || (a.K % a.gs == 0 && a.N % 16 == 0),
                        "LowBitMatMul: slot_pairs 0 (lanes) needs K a multiple of group_size and N of 16");
        OPENVINO_ASSERT(static_cast<int64_t>(w.get_byte_size()) == padded(a) * a.Kp * a.bits / 8,
                        "LowBitMatMul: w must hold N (rounded up to row_group) x Kp x bits / 8 bytes");
        OPENVINO_ASSERT(a.G == (a.K + a.gs - 1) / a.gs, "LowBitMatMul: sz must hold ceil(K / group_size) groups per row");
        a.w = static_cast<const uint8_t*>(w.data());
        a.sz = static_cast<const uint16_t*>(sz.data());
        return a;
    }

    // The kernel over a's rows, split across the arena's threads. `gated` (silu of one half times the other, `mode`
    // as the op's attribute; a.y its scratch): a task computes rows [n0, n1) of both halves and writes the product
    // of them, while they are in its core's cache.
    void run(const LowbitArgs& a, float* gated, int64_t mode) const {
        const LowbitKernel kernel = kernel_for(resolved());
        // Scratch per calling thread, kept between calls: allocating it each time was a measurable part of a
        // small layer's cost (the op's fixed cost per call was ~20 us against native's ~10 us at 256 x 256).
        thread_local std::vector<int8_t> xq;
        thread_local std::vector<float> dx, sums;
        xq.resize(static_cast<size_t>(a.digits * a.M * a.Kp + 64));
        dx.resize(static_cast<size_t>(lowbit_dx_floats(a.M, a.Kp) + 16));
        sums.resize(static_cast<size_t>(a.M * a.G + 8));  // + 8: the decode tile loads 8 groups' sums at a time
        const int64_t threads = tbb::this_task_arena::max_concurrency(), blocks = a.Kp / 32;
        // Quantizing x is serial work before the parallel rows: 41 us at K = 8960 (M = 1) against ~300 us of rows on
        // 2 threads. Long rows are split into chunks that start a pair of blocks and a group, one per thread.
        const int64_t align = std::max<int64_t>(2, a.gs / 32);
        const int64_t chunk = std::max(align, (blocks / threads + align - 1) / align * align);
        // Plain pointers into the calling thread's scratch: inside a TBB task, the thread_local names would be the
        // worker's own (empty) vectors.
        // On 64-byte lines: a 32-byte load that straddles two lines costs twice (the prefill tile ran 52 -> 58-60
        // MAC/ns standalone with its activations aligned, M = 64).
        int8_t* q = aligned(xq.data());
        float *d = aligned(dx.data()), *sm = sums.data();
        if (threads <= 1 || a.M * a.Kp < 4096 || chunk >= blocks) {
            kernel.quantize(a, q, d, sm, 0, blocks);
        } else {
            tbb::parallel_for(int64_t{0}, (blocks + chunk - 1) / chunk, [&](int64_t c) {
                kernel.quantize(a, q, d, sm, c * chunk, std::min(blocks, (c + 1) * chunk));
            });
        }
        // About four chunks per thread (at least 16 rows): balanced on a busy box, few tasks on a small layer; a
        // layer under ~64 K weights runs on the calling thread alone.
        const int64_t half = a.N / 2, gate = mode == 1 ? 0 : half, up = half - gate;
        auto rows = [&](int64_t n0, int64_t n1) {
            kernel.rows(a, q, d, sm, n0, n1);
            if (!gated) return;
            kernel.rows(a, q, d, sm, half + n0, half + n1);
            for (int64_t m = 0; m < a.M; ++m)
                kernel.gate(a.y + m * a.N + gate + n0, a.y + m * a.N + up + n0, n1 - n0, gated + m * half + n0);
        };
        const int64_t n = gated ? half : a.N;
        if (threads <= 1 || a.N * a.Kp < (int64_t{1} << 16)) {
            rows(0, n);
            return;
        }
        // Split by whole groups of rows (row_group): each task streams one contiguous run of w (gated: one of each
        // half).
        const int64_t grain = std::max<int64_t>(1, std::max<int64_t>(16, a.N / (4 * threads)) / a.rg);
        const int64_t groups = gated ? half / a.rg : padded(a) / a.rg;
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, groups, grain), [&](const tbb::blocked_range<int64_t>& r) {
            rows(r.begin() * a.rg, std::min(n, r.end() * a.rg));
        });
    }

    std::string resolved() const { return m_isa == "auto" ? best_isa() : m_isa; }

    int64_t m_group_size = 128;
    std::string m_isa = "auto";
    int64_t m_bits = 4;
    int64_t m_row_group = 1;
    int64_t m_residual = 0;
    int64_t m_slot_pairs = 1;
    int64_t m_gated = 0;  // 1: y = silu(first half) * second half (a SwiGLU's gate and up); 2: silu(second) * first
    int64_t m_down = 0;   // 1 (gated): then the down projection of that product, inputs 3 and 4
};

}  // namespace appliance

// For Python (ctypes): the ABI this library was built for (kernels.ABI, from build.py), checked before loading it.
extern "C" __attribute__((visibility("default"))) int appliance_kernels_abi() { return APPLIANCE_KERNELS_ABI; }

// For Python (ctypes): which paths this CPU runs, widest first, comma-separated ("" = none: the op refuses).
extern "C" __attribute__((visibility("default"))) const char* appliance_kernels_isas() {
    static const std::string isas = [] {
        std::string out;
        for (const char* isa : {"avx512vnni", "avxvnni", "avx2"})
            if (supported(isa)) out += (out.empty() ? "" : ",") + std::string(isa);
        return out;
    }();
    return isas.c_str();
}

ov::Extension::Ptr decode_attention_extension();  // decode_attention.cpp

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>(
    {std::make_shared<ov::OpExtension<appliance::LowBitMatMul>>(), decode_attention_extension()}));
