/* Torch operators in C++ against torch's stable ABI (torch/csrc/stable: C-shim headers, so this compiles in
 * about a second) for the engine's CPU steps, where Python around small C loops cost more than the loops.
 *
 * The few-row linear product of cpu_gemv.c, for the layer products of the engine's steps: through the
 * Python operator (hf_paged::few_row_linear, engine/cpu_linear.py) each of a decode step's 28 layer
 * products paid ~10 us of Python and dispatch around a ~3 us loop, and more inside a step, whose weight
 * stream leaves the interpreter's own data out of cache.
 *
 * few_row_linear(x, weight, bias, max_rows, fallback) is F.linear(x, weight, bias): in C (linear_rows)
 * where that takes the tensors (float32 on the CPU, a 2-D contiguous weight, a contiguous bias of its
 * rows, 1 to max_rows rows, at most the build's MAX_ROWS), else through the operator named fallback
 * (aten::linear by default; any operator taking (x, weight, bias), called through the dispatcher): the
 * choice and the bits of the Python callers' (cpu_gemv.try_linear_rows, then their own product).
 *
 * decode_step_attention(query, key, value, scale, sliding_window, softcap, sinks) is the engine's
 * attention of one layer of a compiled step (hf_paged::packed_step_attention, engine/compiled_body.py)
 * for steps of decode rows only on float32 CPU pools: where the stepping thread has set a decode plan
 * (set_decode_plan: per layer its pools, its read, its window; per layer group the step's slots,
 * block tables and lengths), it writes the new keys and values into their slots and reads through
 * the layout's C read (cpu_decode.c) with no Python; the layers attend in order, the plan counts them.
 * Without a plan it calls the Python operator. Through Python a layer of a one-sequence decode step
 * cost ~35 us around a ~10 us read.
 *
 * Registered at run time, not when the library loads: register_ops(ns) defines both operators in a
 * namespace the caller picks per loaded library (the tests load several builds into one process, and a
 * namespace can be defined once). Built into the few-row library by cpu_build.py where a C++ compiler
 * and torch's headers are at hand; cpu_ops.py binds it. */
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
std::atomic<uint64_t> layers_in_c{0};   /* layers decode_step_attention served from a plan (for the tests) */

/* cpu_decode.c's paged_decode, of one layout's library */
typedef int (*decode_read)(const float *q, const float *k_pool, const float *v_pool, const int32_t *tables,
                           const int32_t *lens, const float *sinks, float *out, int seqs, int width, int num_blocks,
                           int window, float scale, int threads);

struct LayerPlan {
    decode_read read;
    float *k_pool, *v_pool;
    int64_t num_blocks, block_size, kv_heads, heads, head_dim, window;
    const int64_t *slots;  /* the layer's group: slot of each new token */
    const int32_t *tables; /* [seqs, width] */
    const int32_t *lens;   /* [seqs] */
    int64_t width;
};

struct StepPlan {
    std::vector<LayerPlan> layers;
    int64_t seqs = 0;
    size_t next = 0; /* the layer that attends next */
    bool active = false;
};

thread_local StepPlan plan; /* the stepping thread's (an engine steps on one thread at a time) */

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

/* an uninitialized contiguous float32 CPU tensor (aoti_torch_empty_strided: allocation without a trip
 * through the dispatcher, which new_empty takes) */
Tensor empty_float(std::vector<int64_t> sizes) {
    int64_t ndim = static_cast<int64_t>(sizes.size());
    std::vector<int64_t> strides(ndim);
    for (int64_t d = ndim - 1, step = 1; d >= 0; step *= sizes[d], d--) strides[d] = step;
    AtenTensorHandle handle;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(ndim, sizes.data(), strides.data(),
                                                           aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(),
                                                           0, &handle));
    return Tensor(handle);
}

/* x's shape with out_features columns */
Tensor empty_like_rows(const Tensor &x, int64_t out_features) {
    std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
    sizes.back() = out_features;
    return empty_float(sizes);
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

Tensor packed_step_attention_in_python(const Tensor &query, const Tensor &key, const Tensor &value, double scale,
                                       std::optional<int64_t> window, std::optional<double> softcap,
                                       std::optional<Tensor> sinks) {
    std::array<StableIValue, 7> stack{torch::stable::detail::from(query), torch::stable::detail::from(key),
                                      torch::stable::detail::from(value), torch::stable::detail::from(scale),
                                      torch::stable::detail::from(window), torch::stable::detail::from(softcap),
                                      torch::stable::detail::from(sinks)};
    STABLE_TORCH_ERROR_CODE_CHECK(
        torch_call_dispatcher("hf_paged::packed_step_attention", "", stack.data(), TORCH_ABI_VERSION));
    return torch::stable::detail::to<Tensor>(stack[0]);
}

/* what the plan's layer expects of query [1, heads, seqs, head_dim] and key/value [1, kv_heads, seqs, head_dim] */
bool fits(const LayerPlan &layer, int64_t seqs, const Tensor &query, const Tensor &key, const Tensor &value) {
    for (const Tensor *t : {&query, &key, &value})
        if (!is_float_cpu(*t) || t->dim() != 4 || t->size(0) != 1 || t->size(2) != seqs ||
            t->size(3) != layer.head_dim)
            return false;
    return query.size(1) == layer.heads && key.size(1) == layer.kv_heads && value.size(1) == layer.kv_heads;
}

/* token t's [heads, head_dim] of a [1, heads, tokens, head_dim] tensor (any strides), contiguous at dst */
void copy_token(float *dst, const Tensor &from, int64_t t, int64_t heads, int64_t head_dim) {
    const float *src = static_cast<const float *>(from.data_ptr());
    int64_t sh = from.stride(1), st = from.stride(2), sd = from.stride(3);
    for (int64_t h = 0; h < heads; h++)
        for (int64_t d = 0; d < head_dim; d++) dst[h * head_dim + d] = src[h * sh + t * st + d * sd];
}

Tensor decode_step_attention(Tensor query, Tensor key, Tensor value, double scale, std::optional<int64_t> window,
                             std::optional<double> softcap, std::optional<Tensor> sinks) {
    if (!plan.active) return packed_step_attention_in_python(query, key, value, scale, window, softcap, sinks);
    STD_TORCH_CHECK(plan.next < plan.layers.size(), "decode_step_attention: more layers attended than the plan has (",
                    plan.layers.size(), ")");
    const LayerPlan &layer = plan.layers[plan.next];
    STD_TORCH_CHECK(!softcap.has_value(), "decode_step_attention: layer ", plan.next,
                    " has a softcap: no plan serves it");
    STD_TORCH_CHECK(fits(layer, plan.seqs, query, key, value), "decode_step_attention: layer ", plan.next,
                    "'s query, key or value does not fit its plan");
    const float *sink_logits = nullptr;
    if (sinks.has_value()) {
        STD_TORCH_CHECK(is_float_cpu(*sinks) && sinks->is_contiguous() && sinks->numel() == layer.heads,
                        "decode_step_attention: sinks of layer ", plan.next, " are not ", layer.heads,
                        " float32 values");
        sink_logits = static_cast<const float *>(sinks->data_ptr());
    }
    int64_t slots_in_pool = layer.num_blocks * layer.block_size;
    for (int64_t t = 0; t < plan.seqs; t++) {
        int64_t slot = layer.slots[t];
        STD_TORCH_CHECK(slot >= 0 && slot < slots_in_pool, "decode_step_attention: slot ", slot,
                        " outside the pool of ", slots_in_pool);
        int64_t row = slot * layer.kv_heads * layer.head_dim;
        copy_token(layer.k_pool + row, key, t, layer.kv_heads, layer.head_dim);
        copy_token(layer.v_pool + row, value, t, layer.kv_heads, layer.head_dim);
    }
    /* the read takes q as [seqs, heads, head_dim] and writes out in that layout: out's [1, seqs, heads, head_dim] */
    Tensor q = empty_float({plan.seqs, layer.heads, layer.head_dim});
    Tensor out = empty_float({1, plan.seqs, layer.heads, layer.head_dim});
    float *qd = static_cast<float *>(q.data_ptr());
    for (int64_t t = 0; t < plan.seqs; t++) copy_token(qd + t * layer.heads * layer.head_dim, query, t, layer.heads,
                                                       layer.head_dim);
    int64_t span = window.has_value() && *window > 0 ? *window : layer.window;
    int bad = layer.read(qd, layer.k_pool, layer.v_pool, layer.tables, layer.lens, sink_logits,
                         static_cast<float *>(out.data_ptr()), static_cast<int>(plan.seqs),
                         static_cast<int>(layer.width),
                         static_cast<int>(layer.num_blocks), static_cast<int>(span), static_cast<float>(scale),
                         static_cast<int>(torch::stable::get_num_threads()));
    STD_TORCH_CHECK(bad == 0, "decode_step_attention: the C read of layer ", plan.next, " refused its tables (", bad,
                    ")");
    plan.next++;
    layers_in_c.fetch_add(1, std::memory_order_relaxed);
    return out;
}

}  // namespace

/* The stepping thread's plan for its next compiled step of seqs decode rows (see decode_step_attention):
 * one row of PLAN_FIELDS int64 per layer, in order: its read (a layout's paged_decode), key pool, value
 * pool, blocks, block size, K/V heads, query heads, head dim, window (0: none), and its group's slots
 * (int64), block tables (int32, width columns), lengths (int32) and width. The caller keeps every
 * pointer alive until end_decode_plan. */
#define PLAN_FIELDS 13
extern "C" void set_decode_plan(int num_layers, const int64_t *rows, int64_t seqs) {
    plan.layers.resize(num_layers);
    for (int i = 0; i < num_layers; i++) {
        const int64_t *r = rows + (int64_t)PLAN_FIELDS * i;
        plan.layers[i] = LayerPlan{reinterpret_cast<decode_read>(r[0]), reinterpret_cast<float *>(r[1]),
                                   reinterpret_cast<float *>(r[2]), r[3], r[4], r[5], r[6], r[7], r[8],
                                   reinterpret_cast<const int64_t *>(r[9]), reinterpret_cast<const int32_t *>(r[10]),
                                   reinterpret_cast<const int32_t *>(r[11]), r[12]};
    }
    plan.seqs = seqs;
    plan.next = 0;
    plan.active = true;
}

extern "C" int decode_plan_fields(void) { return PLAN_FIELDS; }

/* Ends the plan; returns how many layers it served. */
extern "C" int end_decode_plan(void) {
    int served = plan.active ? static_cast<int>(plan.next) : 0;
    plan.active = false;
    return served;
}

/* Defines ns::few_row_linear and ns::decode_step_attention with their CPU kernels. Returns 0, or 1 where
 * torch refused (the libraries are kept for the life of the process: an operator's registration lasts as
 * long as its library). */
extern "C" int register_ops(const char *ns) {
    using torch::stable::detail::StableLibrary;
    try {
        auto *def = new StableLibrary(StableLibrary::Kind::DEF, ns, nullptr, __FILE__, __LINE__);
        def->def("few_row_linear(Tensor x, Tensor weight, Tensor? bias, int max_rows, "
                 "str fallback='aten::linear') -> Tensor");
        auto *impl = new StableLibrary(StableLibrary::Kind::IMPL, ns, "CPU", __FILE__, __LINE__);
        impl->impl("few_row_linear", TORCH_BOX(&few_row_linear));
        def->def("decode_step_attention(Tensor query, Tensor key, Tensor value, float scale, int? sliding_window, "
                 "float? softcap, Tensor? sinks) -> Tensor");
        impl->impl("decode_step_attention", TORCH_BOX(&decode_step_attention));
    } catch (const std::exception &) {
        return 1;
    }
    return 0;
}

extern "C" uint64_t few_row_products_in_c(void) { return products_in_c.load(std::memory_order_relaxed); }

extern "C" uint64_t decode_layers_in_c(void) { return layers_in_c.load(std::memory_order_relaxed); }
