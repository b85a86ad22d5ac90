// A whole decode step's layers in one call: the Llama family's norm, fused QKV, rotation and K/V write, paged
// attention, output projection, residual adds, gate/up, SiLU-mul and down projection, layer after layer, with the
// kernels the Python layers call one by one (shard/models/llama.py) and in the same order, so the same bits.
//
// At one row a decode step of SmolLM2-135M runs about 450 small ops; through Python's modules each pays a dispatch,
// argument checks and an allocation, and the step's time beyond its weight reads was several milliseconds (AMD EPYC
// Zen 3, 2 vCPUs: 35 ms a float32 step, 25 ms of it GEMV). Here a layer's weights are bound once, when the model
// loads (`DecodeStack`, built by shard/layers/decode_stack.py), and a step is one call per rank, or one per half
// layer where a tensor-parallel all-reduce must run between them (Python keeps the collectives). The Python layers
// stay the reference and serve everything this does not: prompt chunks, LoRA, Gemma's family, many rows of a bf16
// layer that widens (see decode_stack.py).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::decode_stack_kernel {

// How a linear layer's weight is held (shard/layers/gemm.py's Gemm, whose call this mirrors branch for branch).
enum Kind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2 };

// x @ W.T (+ bias) through oneDNN's kernel for a weight it packed (what Gemm calls `_linear_pointwise`).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                          std::string("")};
  op.callBoxed(stack);
  return stack[0].toTensor();
}

struct Linear {
  int64_t kind = kDense;
  at::Tensor plain;       // [out, in] for the small-rows kernel, or undefined
  int64_t small_rows = 0;  // rows up to which `plain` serves
  at::Tensor weight;      // dense: packed for oneDNN or plain for at::linear; int8 values; int4 packed nibbles
  bool packed = false;
  at::Tensor scales;  // int8 and int4
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case kInt8:
        return int8_gemm_kernel::int8_gemm(x, weight, scales, bias);
      case kInt4:
        return int4_gemm_kernel::int4_gemm(x, weight, scales, bias);
      default:
        if (plain.defined() && x.size(0) <= small_rows) return small_gemm_kernel::small_gemm(x, plain, bias);
        return packed ? onednn_linear(x, weight, bias) : at::linear(x, weight, bias);
    }
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;  // Qwen3: each query and key head normalised before the rotation
  std::vector<Linear> linears;              // qkv, o_proj, gate_up, down
};

// What a step passes: the rows' angles, where their K/V go and where their contexts lie.
struct Rows {
  const at::Tensor& cos;
  const at::Tensor& sin;
  const at::Tensor& slots;
  const at::Tensor& block_tables;
  const at::Tensor& context_lens;
  int64_t window;
};

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "query and key norms come together");
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm), {}});
  }

  // The last layer's next linear, in the order qkv, o_proj, gate_up, down.
  void add_linear(int64_t kind, c10::optional<at::Tensor> plain, int64_t small_rows, at::Tensor weight, bool packed,
                  c10::optional<at::Tensor> scales, c10::optional<at::Tensor> bias) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "add_layer first, then its four linears");
    TORCH_CHECK(kind >= kDense && kind <= kInt4, "an unknown weight kind ", kind);
    TORCH_CHECK(kind == kDense || scales.has_value(), "a quantized weight comes with its scales");
    layers_.back().linears.push_back(Linear{kind, plain.value_or(at::Tensor()), small_rows, std::move(weight), packed,
                                            scales.value_or(at::Tensor()), std::move(bias)});
  }

  int64_t halves() const { return 2 * static_cast<int64_t>(layers_.size()); }

  // Runs half layers [first, last) (half 2i: layer i's attention, 2i+1: its MLP) over `hidden` [R, hidden], which
  // still owes `delta` (the previous half's output; none before layer 0) and takes each residual add in place.
  // Returns the last half's output, the next one's delta.
  at::Tensor run(at::Tensor hidden, c10::optional<at::Tensor> delta, at::Tensor cos, at::Tensor sin,
                 std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches, at::Tensor slots,
                 at::Tensor block_tables, at::Tensor context_lens, int64_t window, int64_t first, int64_t last) {
    TORCH_CHECK(0 <= first && first < last && last <= halves(), "half layers [", first, ", ", last, ") of ", halves());
    TORCH_CHECK(key_caches.size() == layers_.size() && value_caches.size() == layers_.size(), "a cache per layer");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden [rows, size], contiguous");
    for (const auto& layer : layers_) TORCH_CHECK(layer.linears.size() == 4, "a layer without its four linears");
    const Rows rows{cos, sin, slots, block_tables, context_lens, window};
    at::Tensor owed = delta.value_or(at::Tensor());
    for (int64_t half = first; half < last; ++half) {
      const Layer& layer = layers_[half / 2];
      const at::Tensor& norm = half % 2 ? layer.post_norm : layer.input_norm;
      const at::Tensor normed = owed.defined() ? rms_norm_kernel::add_rms_norm_(hidden, owed, norm, eps_, false)
                                               : rms_norm_kernel::rms_norm(hidden, norm, eps_, false);
      owed = half % 2 ? mlp(layer, normed)
                      : attention(layer, normed, key_caches[half / 2], value_caches[half / 2], rows);
    }
    return owed;
  }

 private:
  at::Tensor attention(const Layer& layer, const at::Tensor& x, at::Tensor& key_cache, at::Tensor& value_cache,
                       const Rows& rows) const {
    at::Tensor qkv = layer.linears[0](x);
    const int64_t count = qkv.size(0);
    at::Tensor q;
    if (!layer.q_norm && key_cache.scalar_type() == qkv.scalar_type() && rows.cos.scalar_type() == qkv.scalar_type()) {
      rotary_kernel::rotary_kv_(qkv, heads_, kv_heads_, rows.cos, rows.sin, key_cache, value_cache, rows.slots);
      q = qkv.view({count, -1, head_dim_}).narrow(1, 0, heads_).contiguous();
    } else {
      q = rotated_apart(layer, qkv, key_cache, value_cache, rows);
    }
    const at::Tensor attended = paged_attention_kernel::attend<conveyor::Widest>(
        q, key_cache, value_cache, rows.block_tables, rows.context_lens, scale_, rows.window, 0.0);
    return layer.linears[1](attended.view({count, heads_ * head_dim_}));
  }

  // The rotation apart from the cache write, as the Python layer takes it when the heads are normalised first or
  // the cache is 8-bit: q and k copied out side by side, normalised, turned, then k and v written to their slots.
  at::Tensor rotated_apart(const Layer& layer, const at::Tensor& qkv, at::Tensor& key_cache, at::Tensor& value_cache,
                           const Rows& rows) const {
    const int64_t count = qkv.size(0), turned = heads_ + kv_heads_;
    at::Tensor qk = qkv.narrow(1, 0, turned * head_dim_).reshape({count, turned, head_dim_}).contiguous();
    if (layer.q_norm) {
      at::Tensor q_part = qk.narrow(1, 0, heads_), k_part = qk.narrow(1, heads_, kv_heads_);
      qk = at::cat({rms_norm_kernel::rms_norm(q_part.contiguous(), *layer.q_norm, eps_, false),
                    rms_norm_kernel::rms_norm(k_part.contiguous(), *layer.k_norm, eps_, false)},
                   1);
    }
    rotary_kernel::rotary_(qk, rows.cos, rows.sin);
    const at::Tensor k = qk.narrow(1, heads_, kv_heads_).contiguous();
    const at::Tensor v = qkv.narrow(1, turned * head_dim_, kv_heads_ * head_dim_).reshape({count, kv_heads_, head_dim_});
    write(key_cache, k, rows.slots);
    write(value_cache, v.contiguous(), rows.slots);
    return qk.narrow(1, 0, heads_).contiguous();
  }

  static void write(at::Tensor& cache, const at::Tensor& rows, const at::Tensor& slots) {
    if (cache.scalar_type() == at::kChar) return kv_quant_kernel::write(cache, slots, rows);
    cache.view({-1, cache.size(2), cache.size(3)}).index_copy_(0, slots, rows);
  }

  at::Tensor mlp(const Layer& layer, const at::Tensor& x) const {
    return layer.linears[3](silu_mul_kernel::silu_mul(layer.linears[2](x)));
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_linear", &DecodeStack::add_linear)
      .def("halves", &DecodeStack::halves)
      .def("run", &DecodeStack::run);
}

}  // namespace conveyor::decode_stack_kernel
