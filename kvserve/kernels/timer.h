// Wall time spent in the memory-bound kernels (quantized matmuls, paged decode attention), summed since start:
// bench/decode.py reports a step's overhead as its wall time minus this, and the attention's share of it.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>

namespace kvt {

inline std::atomic<int64_t>& kernel_ns() {
    static std::atomic<int64_t> ns{0};
    return ns;
}

inline std::atomic<int64_t>& attention_ns() {  // the part of kernel_ns spent in decode attention
    static std::atomic<int64_t> ns{0};
    return ns;
}

// Adds its lifetime to kernel_ns, and to `also` where given.
struct Scope {
    std::atomic<int64_t>* also = nullptr;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    ~Scope() {
        const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
        kernel_ns().fetch_add(ns, std::memory_order_relaxed);
        if (also != nullptr) also->fetch_add(ns, std::memory_order_relaxed);
    }
};

}  // namespace kvt
