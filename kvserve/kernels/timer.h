// Wall time spent in the memory-bound kernels (quantized matmuls, paged decode attention), summed since start:
// bench/decode.py reports a step's overhead as its wall time minus this.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>

namespace kvt {

inline std::atomic<int64_t>& kernel_ns() {
    static std::atomic<int64_t> ns{0};
    return ns;
}

// Adds its lifetime to kernel_ns.
struct Scope {
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    ~Scope() {
        const auto elapsed = std::chrono::steady_clock::now() - start;
        kernel_ns().fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count(), std::memory_order_relaxed);
    }
};

}  // namespace kvt
