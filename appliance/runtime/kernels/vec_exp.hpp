// exp on a vector of floats, for the kernels' softmax weights (attention_kernel.hpp) and SiLU (lowbit_kernel.hpp
// swiglu), one definition for every vector width: V is a traits struct as vec_avx2.hpp's.
#pragma once

namespace {

// exp(x) with x clamped to [-87, 88], where 2^n below stays a normal float: x = n ln 2 + r, exp(r) by Cephes' expf
// polynomial (relative error ~2e-7), times 2^n. exp(-87) ~ 1.6e-38 stands in for anything smaller, exp(88) ~ 1.7e38
// for anything larger.
template <class V>
inline typename V::vec vexp(typename V::vec x) {
    x = V::min(V::set1(88.f), V::max(V::set1(-87.f), x));
    const auto n = V::round(V::mul(x, V::set1(1.44269504f)));
    const auto r = V::fnmadd(n, V::set1(-2.12194440e-4f), V::fnmadd(n, V::set1(0.693359375f), x));
    auto p = V::set1(1.9875691500e-4f);
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
        p = V::fmadd(p, r, V::set1(c));
    p = V::fmadd(V::mul(p, r), r, V::add(r, V::set1(1.f)));
    return V::scale2(p, n);
}

}  // namespace
