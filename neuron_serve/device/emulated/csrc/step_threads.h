// Emulated backend: the threads our kernels split a step across (step_threads.cpp).
#pragma once

#include <c10/util/FunctionRef.h>

#include <cstdint>

namespace neuron_serve {

// How many threads a kernel may split work across now.
int64_t step_thread_count();

using StepTask = c10::function_ref<void(int64_t, int64_t)>;

// f(begin, end) over [0, n) in contiguous chunks, one per thread, as at::parallel_for
// with a grain of 1 does.
void step_parallel_for(int64_t n, StepTask f);

// A decode step's matmul is about to stream `bytes` of weights from `weights`: what the
// step streams after it is fetched ahead while a core would otherwise wait.
void note_weight_stream(const void* weights, int64_t bytes);

}  // namespace neuron_serve
