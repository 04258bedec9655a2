/* The few-row linear product of cpu_gemv.c as a torch operator written in C++ against torch's stable ABI
 * (torch/csrc/stable: C-shim headers, so it compiles in about a second), for the layer products of the
 * engine's steps: through the Python operator (hf_paged::few_row_linear, engine/cpu_linear.py) each
 * of a decode step's 28 layer products paid ~10 us of Python and dispatch around a ~3 us loop, and
 * more inside a step, whose weight stream leaves the interpreter's own data out of cache.
 *
 * few_row_linear(x, weight, bias, max_rows, fallback) is F.linear(x, weight, bias): in C (linear_rows)
 * where that takes the tensors (float32 on the CPU, a 2-D contiguous weight, a contiguous bias of its
 * rows, 1 to max_rows rows, at most the build's MAX_ROWS), else through the operator named fallback
 * (aten::linear by default; any operator taking (x, weight, bias), called through the dispatcher): the
 * choice and the bits of the Python callers' (cpu_gemv.try_linear_rows, then their own product).
 *
 * Registered at run time, not when the library loads: register_ops(ns) defines ns::few_row_linear,
 * a namespace the caller picks per loaded library (the tests load several builds into one process,
 * and a namespace can be defined once). Built into the few-row library by cpu_build.py where a C++
 * compiler and torch's headers are at hand; cpu_gemv.py binds it. */
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <array>
#include <atomic>
#include <exception>
#include <string>
#include <vector>

extern "C" int linear_rows(const float *x, const float *w, const float *bias, float *y, int rows, int in, int out,
                           int threads);
extern "C" int max_rows(void);

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

std::atomic<uint64_t> products_in_c{0}; /* products this library's operator ran in C (for the tests) */

bool is_float_cpu(const Tensor &t) { return t.scalar_type() == ScalarType::Float && t.is_cpu(); }

/* what linear_rows takes (cpu_gemv.supports) */
bool takes(const Tensor &x, const Tensor &weight, const std::optional<Tensor> &bias, int64_t most) {
    if (!is_float_cpu(x) || !is_float_cpu(weight) || weight.dim() != 2 || x.dim() < 1) return false;
    int64_t in = x.size(x.dim() - 1);
    if (in != weight.size(1) || x.numel() < 1 || x.numel() > most * in || !weight.is_contiguous()) return false;
    if (bias.has_value()) {
        const Tensor &b = *bias;
        if (!is_float_cpu(b) || b.dim() != 1 || b.size(0) != weight.size(0) || !b.is_contiguous()) return false;
    }
    return true;
}

/* the operator op (a name without an overload: its default one) of (x, weight, bias) */
Tensor call_op(const std::string &op, const Tensor &x, const Tensor &weight, const std::optional<Tensor> &bias) {
    std::array<StableIValue, 3> stack{torch::stable::detail::from(x), torch::stable::detail::from(weight),
                                      torch::stable::detail::from(bias)};
    STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(op.c_str(), "", stack.data(), TORCH_ABI_VERSION));
    return torch::stable::detail::to<Tensor>(stack[0]);
}

/* an uninitialized float32 CPU tensor of x's shape with out_features columns (aoti_torch_empty_strided:
 * allocation without a trip through the dispatcher, which new_empty takes) */
Tensor empty_like_rows(const Tensor &x, int64_t out_features) {
    int64_t ndim = x.dim();
    std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end()), strides(ndim);
    sizes.back() = out_features;
    for (int64_t d = ndim - 1, step = 1; d >= 0; step *= sizes[d], d--) strides[d] = step;
    AtenTensorHandle handle;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(ndim, sizes.data(), strides.data(),
                                                           aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(),
                                                           0, &handle));
    return Tensor(handle);
}

Tensor few_row_linear(Tensor x, Tensor weight, std::optional<Tensor> bias, int64_t limit, std::string fallback) {
    int64_t most = limit < max_rows() ? limit : max_rows();
    if (!takes(x, weight, bias, most)) return call_op(fallback, x, weight, bias);
    int64_t in = weight.size(1), out_features = weight.size(0), rows = x.numel() / in;
    Tensor flat = x.is_contiguous() ? x : torch::stable::contiguous(x);
    Tensor out = empty_like_rows(x, out_features);
    const float *b = bias.has_value() ? static_cast<const float *>(bias->data_ptr()) : nullptr;
    if (linear_rows(static_cast<const float *>(flat.data_ptr()), static_cast<const float *>(weight.data_ptr()), b,
                    static_cast<float *>(out.data_ptr()), static_cast<int>(rows), static_cast<int>(in),
                    static_cast<int>(out_features), static_cast<int>(torch::stable::get_num_threads())))
        STD_TORCH_CHECK(false, "few_row_linear: the C loop refused ", rows, " rows");
    products_in_c.fetch_add(1, std::memory_order_relaxed);
    return out;
}

}  // namespace

/* Defines ns::few_row_linear and its CPU kernel. Returns 0, or 1 where torch refused (the libraries
 * are kept for the life of the process: an operator's registration lasts as long as its library). */
extern "C" int register_ops(const char *ns) {
    using torch::stable::detail::StableLibrary;
    try {
        auto *def = new StableLibrary(StableLibrary::Kind::DEF, ns, nullptr, __FILE__, __LINE__);
        def->def("few_row_linear(Tensor x, Tensor weight, Tensor? bias, int max_rows, "
                 "str fallback='aten::linear') -> Tensor");
        auto *impl = new StableLibrary(StableLibrary::Kind::IMPL, ns, "CPU", __FILE__, __LINE__);
        impl->impl("few_row_linear", TORCH_BOX(&few_row_linear));
    } catch (const std::exception &) {
        return 1;
    }
    return 0;
}

extern "C" uint64_t few_row_products_in_c(void) { return products_in_c.load(std::memory_order_relaxed); }
