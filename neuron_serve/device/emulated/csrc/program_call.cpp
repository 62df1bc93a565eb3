// Emulated backend: a C++-wrapper graph's entry called with the arguments a replay recorded
// (replay.py), without building a Python list of ~400 new handles on every step.
//
// inductor's C++ wrapper compiles each graph into `inductor_entry_impl(inputs, outputs)`,
// which takes ownership of one handle per input and drops each once it is done with it.
// Its Python entry gets those handles from a list made per call (a handle per tensor,
// through Python); here each is a copy of a handle the replay holds, made in C++.

#include <ATen/core/Tensor.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <cstdio>
#include <exception>
#include <vector>

using GraphEntry = void (*)(AtenTensorHandle* inputs, AtenTensorHandle* outputs);

// Calls `entry` on new handles to the tensors of `held` (n of them), its outputs' handles
// into `outputs`. Must be called holding the GIL: the entry releases it while it runs.
// Returns 0, or 1 with the error's message in `error`.
extern "C" int neuron_serve_call_graph(void* entry, const AtenTensorHandle* held, int64_t n,
                                       AtenTensorHandle* outputs, char* error,
                                       int64_t error_size) {
  using namespace torch::aot_inductor;
  try {
    std::vector<AtenTensorHandle> inputs(n);
    for (int64_t i = 0; i < n; ++i)
      inputs[i] = new_tensor_handle(at::Tensor(*tensor_handle_to_tensor_pointer(held[i])));
    reinterpret_cast<GraphEntry>(entry)(inputs.data(), outputs);  // owns the inputs now
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_size, "%s", e.what());
  } catch (...) {
    std::snprintf(error, error_size, "unknown C++ exception");
  }
  return 1;
}
