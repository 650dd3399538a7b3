// The Llama forward pass, its KV cache, and where a press plugs in (docs/LLAMA_RUNNER.md).
//
// Every step mirrors transformers' modeling_llama.py (eager attention; modeling_qwen2/qwen3.py for
// their biases and q/k norms) with the same ATen operations in the same order, so float32 logits
// agree to ~1e-6:
//   RMSNorm      x.float() * rsqrt(mean(x^2) + eps), cast back, times the weight (Qwen3's q_norm /
//                k_norm: the same over each head's D values, before RoPE)
//   RoPE         inv_freq = 1 / theta^(arange(0, D, 2) / D) in float32; angles = position * inv_freq;
//                cos/sin of cat(angles, angles); x * cos + rotate_half(x) * sin
//   attention    softmax(q k^T * D^-0.5 + causal mask) in float32, cast to the model dtype, times v,
//                where the weights are read (a press, return_attentions, eager_attention); else
//                fused, at::scaled_dot_product_attention, as transformers' "sdpa" (agrees to ~1e-6)
//   MLP          down(silu(gate(x)) * up(x))
#include "kvpress/llama/model.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <vector>

#include "kvpress/cache.h"
#include "kvpress/io/safetensors.h"
#include "kvpress/llama/tokenizer.h"
#include "kvpress/ops.h"
#include "kvpress/registry.h"
#include "second_pass_run.h"

namespace kvpress::llama {
namespace {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

at::Tensor take_weight(const std::map<std::string, at::Tensor>& weights, const std::string& name,
                       std::vector<int64_t> shape, at::ScalarType dtype) {
  const auto it = weights.find(name);
  TORCH_CHECK(it != weights.end(), "LlamaModel: checkpoint has no tensor '", name, "'");
  TORCH_CHECK(it->second.sizes() == at::IntArrayRef(shape), "LlamaModel: ", name, " must be ", at::IntArrayRef(shape),
              " for this config, got ", shape_str(it->second));
  return it->second.to(dtype).contiguous();
}

}  // namespace

// ---- KVCache -----------------------------------------------------------------------------------

KVCache::KVCache(int64_t num_layers) {
  TORCH_CHECK(num_layers >= 0, "KVCache: num_layers must be >= 0, got ", num_layers);
  layers_.resize(static_cast<size_t>(num_layers));
}

const KVCache::Layer& KVCache::layer_at(int64_t layer, const char* op) const {
  TORCH_CHECK(layer >= 0 && layer < num_layers(), op, ": layer ", layer, " out of range [0, ", num_layers(), ")");
  return layers_[static_cast<size_t>(layer)];
}

KVCache::Layer& KVCache::layer_at(int64_t layer, const char* op) {
  return const_cast<Layer&>(static_cast<const KVCache&>(*this).layer_at(layer, op));
}

int64_t KVCache::length(int64_t layer) const { return layer_at(layer, "KVCache::length").length; }

std::vector<int64_t> KVCache::lengths() const {
  std::vector<int64_t> out;
  for (const auto& l : layers_) out.push_back(l.length);
  return out;
}

at::Tensor KVCache::keys(int64_t layer) const {
  const Layer& l = layer_at(layer, "KVCache::keys");
  TORCH_CHECK(!l.ragged.defined(), "KVCache::keys: layer ", layer, " is stored head-ragged (use ragged(layer))");
  return l.key_buffer.defined() ? l.key_buffer.narrow(2, 0, l.length) : at::Tensor();
}

at::Tensor KVCache::values(int64_t layer) const {
  const Layer& l = layer_at(layer, "KVCache::values");
  TORCH_CHECK(!l.ragged.defined(), "KVCache::values: layer ", layer, " is stored head-ragged (use ragged(layer))");
  return l.value_buffer.defined() ? l.value_buffer.narrow(2, 0, l.length) : at::Tensor();
}

void KVCache::append(int64_t layer, const at::Tensor& keys, const at::Tensor& values) {
  constexpr const char* op = "KVCache::append";
  Layer& l = layer_at(layer, op);
  TORCH_CHECK(keys.defined() && values.defined() && keys.dim() == 4 && values.sizes() == keys.sizes(), op,
              ": keys and values must be [batch, kv_heads, n, head_dim] of one shape, got ", shape_str(keys), " and ",
              shape_str(values));
  TORCH_CHECK(values.scalar_type() == keys.scalar_type(), op, ": values must have the dtype of keys (",
              keys.scalar_type(), "), got ", values.scalar_type());
  TORCH_CHECK(values.device() == keys.device(), op, ": values must be on the device of keys (", keys.device(),
              "), got ", values.device());
  if (l.ragged.defined()) {  // every head gets the new tokens in its tail (HeadRaggedLayer checks them)
    l.ragged.append(keys, values);
    l.length = l.ragged.max_length();
    return;
  }
  // Everything is checked before the cache changes, so a refused append leaves it as it was.
  if (l.key_buffer.defined()) {
    TORCH_CHECK(keys.size(0) == l.key_buffer.size(0) && keys.size(1) == l.key_buffer.size(1) &&
                    keys.size(3) == l.key_buffer.size(3),
                op, ": new keys ", shape_str(keys), " do not match the cache ", shape_str(this->keys(layer)));
    TORCH_CHECK(keys.scalar_type() == l.key_buffer.scalar_type(), op, ": keys must be ", l.key_buffer.scalar_type(),
                " like the cache, got ", keys.scalar_type());
    TORCH_CHECK(keys.device() == l.key_buffer.device(), op, ": keys must be on ", l.key_buffer.device(),
                " like the cache, got ", keys.device());
  }
  const int64_t n = keys.size(2);
  const int64_t capacity = l.key_buffer.defined() ? l.key_buffer.size(2) : 0;
  if (l.length + n > capacity) {
    // Grow geometrically so that token-by-token decoding copies the cache O(log n) times.
    const int64_t new_capacity = std::max(l.length + n, 2 * capacity);
    std::vector<int64_t> shape{keys.size(0), keys.size(1), new_capacity, keys.size(3)};
    at::Tensor kb = at::empty(shape, keys.options()), vb = at::empty(shape, values.options());
    if (l.length > 0) {
      kb.narrow(2, 0, l.length).copy_(l.key_buffer.narrow(2, 0, l.length));
      vb.narrow(2, 0, l.length).copy_(l.value_buffer.narrow(2, 0, l.length));
    }
    at::Tensor mb;
    if (l.mask_buffer.defined()) {
      mb = at::empty({keys.size(0), keys.size(1), new_capacity}, l.mask_buffer.options());
      if (l.length > 0) mb.narrow(2, 0, l.length).copy_(l.mask_buffer.narrow(2, 0, l.length));
    }
    l.key_buffer = kb;
    l.value_buffer = vb;
    l.mask_buffer = mb;
  }
  l.key_buffer.narrow(2, l.length, n).copy_(keys);
  l.value_buffer.narrow(2, l.length, n).copy_(values);
  if (l.mask_buffer.defined()) l.mask_buffer.narrow(2, l.length, n).fill_(true);  // new tokens are visible
  l.length += n;
}

void KVCache::replace(int64_t layer, const at::Tensor& keys, const at::Tensor& values) {
  constexpr const char* op = "KVCache::replace";
  Layer& l = layer_at(layer, op);
  TORCH_CHECK(keys.defined() && values.defined() && keys.dim() == 4 && values.sizes() == keys.sizes(), op,
              ": keys and values must be [batch, kv_heads, n, head_dim] of one shape, got ", shape_str(keys), " and ",
              shape_str(values));
  l.key_buffer = keys.contiguous();
  l.value_buffer = values.contiguous();
  l.mask_buffer = at::Tensor();
  l.ragged = HeadRaggedLayer();
  l.length = keys.size(2);
}

KV KVCache::compress_in_place(int64_t layer, const BasePress& press, LayerInputs inputs) {
  constexpr const char* op = "KVCache::compress_in_place";
  Layer& l = layer_at(layer, op);
  TORCH_CHECK(l.key_buffer.defined() && !l.ragged.defined() && !l.mask_buffer.defined(), op, ": layer ", layer,
              " must hold dense tokens without a keep mask");
  inputs.keys = keys(layer);
  inputs.values = values(layer);
  KV kv = press.compress_in_place(inputs);
  l.length = kv.keys.size(2);
  return kv;
}

void KVCache::replace_ragged(int64_t layer, HeadRaggedLayer ragged) {
  constexpr const char* op = "KVCache::replace_ragged";
  Layer& l = layer_at(layer, op);
  TORCH_CHECK(ragged.defined(), op, ": the head-ragged layer is empty");
  l = Layer();  // frees the dense buffers
  l.ragged = std::move(ragged);
  l.length = l.ragged.max_length();
}

void KVCache::set_keep_mask(int64_t layer, const at::Tensor& keep_mask) {
  constexpr const char* op = "KVCache::set_keep_mask";
  Layer& l = layer_at(layer, op);
  TORCH_CHECK(l.key_buffer.defined() && !l.ragged.defined(), op, ": layer ", layer, " must hold dense tokens");
  const at::Tensor keys = this->keys(layer);
  TORCH_CHECK(keep_mask.defined() && keep_mask.scalar_type() == at::kBool && keep_mask.dim() == 3 &&
                  keep_mask.size(0) == keys.size(0) && keep_mask.size(1) == keys.size(1) &&
                  keep_mask.size(2) == l.length,
              op, ": keep_mask must be bool [", keys.size(0), ", ", keys.size(1), ", ", l.length, "], got ",
              keep_mask.defined() ? shape_str(keep_mask) : std::string("undefined"));
  at::Tensor mask =
      at::ones({keys.size(0), keys.size(1), l.key_buffer.size(2)}, keep_mask.options().device(keys.device()));
  mask.narrow(2, 0, l.length).copy_(keep_mask);
  l.mask_buffer = mask;
}

void KVCache::evict(int64_t layer, int64_t first, const at::Tensor& evict) {
  constexpr const char* op = "KVCache::evict";
  Layer& l = layer_at(layer, op);
  TORCH_CHECK(evict.defined() && evict.scalar_type() == at::kBool && evict.dim() == 3, op,
              ": evict must be bool [B, Hkv, m], got ", evict.defined() ? shape_str(evict) : std::string("undefined"));
  const int64_t m = evict.size(2);
  // During a forward the layer already holds the forward's tokens while position() does not count them.
  const int64_t extent = l.ragged.defined() ? l.ragged.next_position() : l.length;
  TORCH_CHECK(first >= 0 && first + m <= extent, op, ": positions ", first, " .. ", first + m - 1,
              " must be cached in layer ", layer, " (", extent, " positions)");
  if (l.ragged.defined()) {
    RaggedKV kv = l.ragged.to_ragged();
    at::Tensor drop = at::zeros_like(kv.keep_mask);
    drop.narrow(2, first, m).copy_(evict);
    for (int64_t b = 0; b < kv.batch; ++b)
      for (int64_t h = 0; h < kv.kv_heads; ++h) {
        HeadKV& head = kv.heads[static_cast<size_t>(b * kv.kv_heads + h)];
        const at::Tensor keep = drop[b][h].index_select(0, head.kept_indices.to(drop.device())).logical_not();
        head.keys = head.keys.index({keep});
        head.values = head.values.index({keep});
        head.kept_indices = head.kept_indices.index({keep.to(head.kept_indices.device())});
      }
    kv.keep_mask = kv.keep_mask.logical_and(drop.logical_not());
    l.ragged = HeadRaggedLayer::from_ragged(kv, l.ragged.next_position());
    return;
  }
  at::Tensor mask = keep_mask(layer);
  mask = mask.defined() ? mask.clone() : at::ones({evict.size(0), evict.size(1), l.length}, evict.options());
  mask.narrow(2, first, m).logical_and_(evict.logical_not().to(mask.device()));
  set_keep_mask(layer, mask);
}

bool KVCache::is_ragged(int64_t layer) const { return layer_at(layer, "KVCache::is_ragged").ragged.defined(); }

const HeadRaggedLayer& KVCache::ragged(int64_t layer) const {
  const Layer& l = layer_at(layer, "KVCache::ragged");
  TORCH_CHECK(l.ragged.defined(), "KVCache::ragged: layer ", layer, " is not stored head-ragged");
  return l.ragged;
}

at::Tensor KVCache::keep_mask(int64_t layer) const {
  const Layer& l = layer_at(layer, "KVCache::keep_mask");
  return l.mask_buffer.defined() ? l.mask_buffer.narrow(2, 0, l.length) : at::Tensor();
}

int64_t KVCache::bytes() const {
  int64_t total = 0;
  for (const Layer& l : layers_) {
    for (const at::Tensor* t : {&l.key_buffer, &l.value_buffer, &l.mask_buffer})
      if (t->defined()) total += static_cast<int64_t>(t->nbytes());
    if (l.ragged.defined()) total += l.ragged.bytes();
  }
  return total;
}

void KVCache::set_position(int64_t position) {
  TORCH_CHECK(position >= 0, "KVCache::set_position: position must be >= 0, got ", position);
  position_ = position;
}

void KVCache::truncate(const std::vector<int64_t>& lengths, int64_t position) {
  TORCH_CHECK(static_cast<int64_t>(lengths.size()) == num_layers(), "KVCache::truncate: expected ", num_layers(),
              " lengths, got ", lengths.size());
  // Check every layer before changing any.
  for (size_t i = 0; i < layers_.size(); ++i) {
    TORCH_CHECK(lengths[i] >= 0 && lengths[i] <= layers_[i].length, "KVCache::truncate: layer ", i, " holds ",
                layers_[i].length, " tokens, cannot keep ", lengths[i]);
    const HeadRaggedLayer& ragged = layers_[i].ragged;
    // A head-ragged layer can drop only the tokens appended after its compression (every head holds them).
    TORCH_CHECK(!ragged.defined() || layers_[i].length - lengths[i] <= ragged.appended(),
                "KVCache::truncate: head-ragged layer ", i, " can drop at most the ", ragged.appended(),
                " tokens appended after compression (keep >= ", layers_[i].length - ragged.appended(), "), got ",
                lengths[i]);
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    HeadRaggedLayer& ragged = layers_[i].ragged;
    if (ragged.defined()) ragged.truncate_appended(ragged.appended() - (layers_[i].length - lengths[i]), position);
    layers_[i].length = lengths[i];
  }
  position_ = position;
}

// ---- model ---------------------------------------------------------------------------------------

LlamaModel LlamaModel::load(const std::string& dir, at::ScalarType dtype) {
  LlamaConfig config = LlamaConfig::load(dir + "/config.json");
  const io::SafetensorsFile file = io::load_safetensors(dir + "/model.safetensors");
  return LlamaModel(std::move(config), file.tensors, dtype);
}

LlamaModel::LlamaModel(LlamaConfig config, const std::map<std::string, at::Tensor>& weights, at::ScalarType dtype)
    : config_(std::move(config)), dtype_(dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "LlamaModel: dtype must be float32, float16 or bfloat16, got ", dtype);
  const LlamaConfig& c = config_;
  const int64_t h = c.hidden_size, d = c.head_dim;
  // Tied checkpoints may store the matrix under either name (TinyStories-656K keeps only lm_head).
  std::string embed_name = "model.embed_tokens.weight";
  if (!weights.count(embed_name) && c.tie_word_embeddings && weights.count("lm_head.weight"))
    embed_name = "lm_head.weight";
  embed_tokens_ = take_weight(weights, embed_name, {c.vocab_size, h}, dtype);
  lm_head_ = c.tie_word_embeddings ? embed_tokens_ : take_weight(weights, "lm_head.weight", {c.vocab_size, h}, dtype);
  norm_ = take_weight(weights, "model.norm.weight", {h}, dtype);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer l;
    l.input_norm = take_weight(weights, p + "input_layernorm.weight", {h}, dtype);
    l.q_proj = take_weight(weights, p + "self_attn.q_proj.weight", {c.num_heads * d, h}, dtype);
    l.k_proj = take_weight(weights, p + "self_attn.k_proj.weight", {c.num_kv_heads * d, h}, dtype);
    l.v_proj = take_weight(weights, p + "self_attn.v_proj.weight", {c.num_kv_heads * d, h}, dtype);
    l.o_proj = take_weight(weights, p + "self_attn.o_proj.weight", {h, c.num_heads * d}, dtype);
    if (c.qkv_bias) {
      l.q_bias = take_weight(weights, p + "self_attn.q_proj.bias", {c.num_heads * d}, dtype);
      l.k_bias = take_weight(weights, p + "self_attn.k_proj.bias", {c.num_kv_heads * d}, dtype);
      l.v_bias = take_weight(weights, p + "self_attn.v_proj.bias", {c.num_kv_heads * d}, dtype);
    }
    if (c.o_proj_bias) l.o_bias = take_weight(weights, p + "self_attn.o_proj.bias", {h}, dtype);
    if (c.qk_norm) {
      l.q_norm = take_weight(weights, p + "self_attn.q_norm.weight", {d}, dtype);
      l.k_norm = take_weight(weights, p + "self_attn.k_norm.weight", {d}, dtype);
    }
    l.post_norm = take_weight(weights, p + "post_attention_layernorm.weight", {h}, dtype);
    l.gate_proj = take_weight(weights, p + "mlp.gate_proj.weight", {c.intermediate_size, h}, dtype);
    l.up_proj = take_weight(weights, p + "mlp.up_proj.weight", {c.intermediate_size, h}, dtype);
    l.down_proj = take_weight(weights, p + "mlp.down_proj.weight", {h, c.intermediate_size}, dtype);
    layers_.push_back(std::move(l));
  }
  // transformers: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)); Python's
  // 1.0 / t is t.reciprocal() * 1.0.
  const at::Tensor exponent = at::arange(0, d, 2, at::kLong).to(at::kFloat) / static_cast<double>(d);
  inv_freq_ = scaled_inv_freq(c, at::reciprocal(at::pow(c.rope_theta, exponent)));
}

// The frequency scaling of config.rope_type, with transformers' float32 tensor operations in its
// order (_compute_linear_scaling_rope_parameters, _compute_llama3_parameters), so that the angles
// are its angles bit for bit. inv_freq: [D/2] float32.
at::Tensor LlamaModel::scaled_inv_freq(const LlamaConfig& c, const at::Tensor& inv_freq) {
  if (c.rope_type == "linear") return inv_freq / c.rope_factor;
  if (c.rope_type != "llama3") return inv_freq;
  const double old_context = static_cast<double>(c.rope_original_max_position_embeddings);
  const double low_freq_wavelen = old_context / c.rope_low_freq_factor;
  const double high_freq_wavelen = old_context / c.rope_high_freq_factor;
  // Python's scalar / tensor is tensor.reciprocal() * scalar (ATen's C++ operator fills, then divides).
  const at::Tensor wavelen = at::reciprocal(inv_freq) * (2 * M_PI);
  // Wavelengths beyond the low-frequency bound: divided by the factor; shorter ones kept.
  const at::Tensor low = at::where(wavelen > low_freq_wavelen, inv_freq / c.rope_factor, inv_freq);
  // The band between: interpolated between the two.
  const at::Tensor smooth = (at::reciprocal(wavelen) * old_context - c.rope_low_freq_factor) /
                            (c.rope_high_freq_factor - c.rope_low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * low / c.rope_factor + smooth * low;
  const at::Tensor medium = (wavelen < high_freq_wavelen).logical_not() & (wavelen > low_freq_wavelen).logical_not();
  return at::where(medium, smoothed, low);
}

RopeTables LlamaModel::rope(int64_t start, int64_t n) const {
  std::vector<int64_t> positions(static_cast<size_t>(n));
  std::iota(positions.begin(), positions.end(), start);
  return rope_at(positions);
}

RopeTables LlamaModel::rope_at(const std::vector<int64_t>& position_ids) const {
  // angles[p, i] = position_p * inv_freq_i in float32 (transformers' [D/2, 1] @ [1, n] matmul has a
  // single product per entry, so it is this product exactly).
  const at::Tensor positions = at::tensor(at::ArrayRef<int64_t>(position_ids), at::kLong).to(at::kFloat);
  const at::Tensor angles = positions.unsqueeze(1) * inv_freq_.unsqueeze(0);  // [n, D/2]
  const at::Tensor emb = at::cat({angles, angles}, -1);                       // [n, D]
  return {emb.cos().to(dtype_), emb.sin().to(dtype_)};
}

at::Tensor LlamaModel::embed(const at::Tensor& input_ids) const { return at::embedding(embed_tokens_, input_ids); }

ModelShape LlamaModel::shape() const {
  ModelShape s;
  s.num_layers = config_.num_layers;
  s.num_heads = config_.num_heads;
  s.num_kv_heads = config_.num_kv_heads;
  s.head_dim = config_.head_dim;
  s.hidden_size = config_.hidden_size;
  s.intermediate_size = config_.intermediate_size;
  s.dtype = dtype_;
  return s;
}

LlamaModel::LayerQKV LlamaModel::layer_qkv(int64_t layer, const at::Tensor& x, const RopeTables& rope_tables,
                                           const LoraAdapter* lora) const {
  TORCH_CHECK(layer >= 0 && layer < config_.num_layers, "LlamaModel::layer_qkv: layer must be in [0, ",
              config_.num_layers, "), got ", layer);
  const at::Tensor h = rms_norm(x, layers_[static_cast<size_t>(layer)].input_norm);
  LayerQKV qkv = project_qkv(layer, h, rope_tables, lora);
  qkv.h = h;
  return qkv;
}

at::Tensor LlamaModel::layer_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values) const {
  constexpr const char* op = "LlamaModel::layer_attention";
  const LlamaConfig& c = config_;
  TORCH_CHECK(q.dim() == 4 && q.size(1) == c.num_heads && q.size(3) == c.head_dim, op, ": q must be [B, ", c.num_heads,
              ", n, ", c.head_dim, "], got ", shape_str(q));
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == q.size(0) && keys.size(1) == c.num_kv_heads &&
                  keys.size(2) >= q.size(2) && keys.size(3) == c.head_dim && values.sizes() == keys.sizes(),
              op, ": keys and values must be [", q.size(0), ", ", c.num_kv_heads, ", L >= ", q.size(2), ", ",
              c.head_dim, "], got ", shape_str(keys), " and ", shape_str(values));
  return dense_attention(q, keys, values, at::Tensor(), nullptr);
}

const at::Tensor& LlamaModel::o_proj(int64_t layer) const {
  TORCH_CHECK(layer >= 0 && layer < config_.num_layers, "LlamaModel::o_proj: layer must be in [0, ", config_.num_layers,
              "), got ", layer);
  return layers_[static_cast<size_t>(layer)].o_proj;
}

at::Tensor LlamaModel::layer_output(int64_t layer, const at::Tensor& x, const at::Tensor& attn,
                                    const LoraAdapter* lora) const {
  TORCH_CHECK(layer >= 0 && layer < config_.num_layers, "LlamaModel::layer_output: layer must be in [0, ",
              config_.num_layers, "), got ", layer);
  return mlp_residual(layer, x + project_output(layer, attn, lora), lora);
}

at::Tensor LlamaModel::project_output(int64_t layer, const at::Tensor& attn, const LoraAdapter* lora) const {
  TORCH_CHECK(layer >= 0 && layer < config_.num_layers, "LlamaModel::project_output: layer must be in [0, ",
              config_.num_layers, "), got ", layer);
  const Layer& w = layers_[static_cast<size_t>(layer)];
  const std::optional<LoraLinear> update = lora_update(lora, layer, "o_proj");
  if (!tp_) return lora_linear(attn, w.o_proj, update ? &*update : nullptr, w.o_bias);
  // A shard: its heads' part of the projection, summed over the ranks, then the bias once.
  const at::Tensor y = sum_over_ranks(lora_linear(attn, w.o_proj, update ? &*update : nullptr));
  return w.o_bias.defined() ? y + w.o_bias : y;
}

at::Tensor LlamaModel::layer_mlp(int64_t layer, const at::Tensor& y, const LoraAdapter* lora) const {
  TORCH_CHECK(layer >= 0 && layer < config_.num_layers, "LlamaModel::layer_mlp: layer must be in [0, ",
              config_.num_layers, "), got ", layer);
  return mlp_residual(layer, y, lora);
}

at::Tensor LlamaModel::mlp_residual(int64_t layer, const at::Tensor& y, const LoraAdapter* lora) const {
  const Layer& w = layers_[static_cast<size_t>(layer)];
  const std::optional<LoraLinear> gate = lora_update(lora, layer, "gate_proj"),
                                  up = lora_update(lora, layer, "up_proj"),
                                  down = lora_update(lora, layer, "down_proj");
  const auto part = [](const std::optional<LoraLinear>& u) { return u ? &*u : nullptr; };
  const at::Tensor m = into_shard(rms_norm(y, w.post_norm));
  // On a shard, its block of the intermediate rows: down_proj's partial output summed over the ranks.
  return y + sum_over_ranks(
                 lora_linear(at::silu(lora_linear(m, w.gate_proj, part(gate))) * lora_linear(m, w.up_proj, part(up)),
                             w.down_proj, part(down)));
}

const at::Tensor& LlamaModel::projection(int64_t layer, const std::string& module) const {
  const Layer& w = layers_[static_cast<size_t>(layer)];
  const std::pair<const char*, const at::Tensor*> table[] = {
      {"q_proj", &w.q_proj},       {"k_proj", &w.k_proj},   {"v_proj", &w.v_proj},      {"o_proj", &w.o_proj},
      {"gate_proj", &w.gate_proj}, {"up_proj", &w.up_proj}, {"down_proj", &w.down_proj}};
  for (const auto& [name, weight] : table)
    if (module == name) return *weight;
  TORCH_CHECK(false, "LlamaModel: no projection '", module, "'");
}

void LlamaModel::check_adapter(const LoraAdapter& adapter, const char* op) const {
  for (const auto& [key, update] : adapter.modules()) {
    const auto& [layer, module] = key;
    TORCH_CHECK(layer < config_.num_layers, op, ": the LoRA adapter targets layer ", layer, " (", module,
                "), the model has ", config_.num_layers, " layers");
    // The whole model's weight shape (a shard holds a block of it: lora_update cuts the adapter alike).
    const at::Tensor& w = projection(layer, module);
    int64_t out = w.size(0), in = w.size(1);
    if (tp_) (shard_block(module).dim == 0 ? out : in) *= tp_->world;
    TORCH_CHECK(update.a.size(1) == in && update.b.size(0) == out, op, ": the LoRA adapter's layer ", layer, " ",
                module, " needs A [r, ", in, "] and B [", out, ", r] (the weight is [", out, ", ", in, "]), got A [",
                update.a.size(0), ", ", update.a.size(1), "] and B [", update.b.size(0), ", ", update.b.size(1), "]");
  }
}

at::Tensor LlamaModel::rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor variance = xf.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (xf * at::rsqrt(variance + config_.rms_norm_eps)).to(x.scalar_type());
}

ForwardOutput LlamaModel::prefill(const at::Tensor& input_ids, KVCache& cache, const PrefillOptions& options) const {
  TORCH_CHECK(cache.position() == 0, "LlamaModel::prefill: the cache already holds ", cache.position(),
              " tokens; prefill starts from an empty cache (use forward() to continue)");
  TORCH_CHECK(options.question_length >= 0 && (input_ids.dim() != 2 || options.question_length <= input_ids.size(1)),
              "LlamaModel::prefill: question_length must be in [0, ", input_ids.dim() == 2 ? input_ids.size(1) : 0,
              "] (the prefill's tokens), got ", options.question_length);
  // A press that cannot compress layer by layer runs the model again over the context first: it
  // takes the prefill over (kvpress/model_view.h).
  const BasePress* press = prefill_press_of(options.press);
  check_press_on_shard(press, "LlamaModel::prefill");
  if (press != nullptr && press->needs_second_pass()) {
    detail::LlamaSecondPassRun run("LlamaModel::prefill", *this, input_ids, cache, options, *press);
    return run.take_output([&] { press->second_pass(run); });
  }
  return run(input_ids, cache, options, &options);
}

bool CapturedPrefill::is_prefill_of(const at::Tensor& input_ids) const {
  return !layers.empty() && layers.front().input_ids.sizes() == input_ids.sizes() &&
         at::equal(layers.front().input_ids, input_ids);
}

CapturedPrefill LlamaModel::capture_prefill(const at::Tensor& input_ids, const ForwardOptions& options) const {
  ForwardOptions plain = options;  // no press: the capture is the uncompressed prefill
  plain.press = nullptr;
  plain.press_state = nullptr;
  PrefillOptions no_press;
  static_cast<ForwardOptions&>(no_press) = plain;
  CapturedPrefill captured;
  captured.cache = new_cache();
  captured.layers.reserve(static_cast<size_t>(config_.num_layers));
  captured.logits = run(input_ids, captured.cache, plain, &no_press, &captured.layers).logits;
  return captured;
}

std::string LlamaModel::why_not_captured(const BasePress* press, PressAttentions press_attentions) {
  const BasePress* p = prefill_press_of(press);
  if (p == nullptr) return "";
  if (p->needs_second_pass()) return p->name() + " runs a second pass over the context";
  if (p->new_sequence_state() != nullptr) return p->name() + " starts its per-sequence state at prefill";
  if (wants_attentions(press_attentions, ForwardOptions{}, p->name()))
    return p->name() + " reads attention weights, which a captured prefill does not keep";
  return "";
}

KVCache LlamaModel::compress_captured(const CapturedPrefill& captured, const PrefillOptions& options,
                                      ForwardOutput* out) const {
  const std::string why = why_not_captured(options.press, options.press_attentions);
  TORCH_CHECK(why.empty(), "LlamaModel::compress_captured: ", why, "; run prefill() with it instead");
  TORCH_CHECK(static_cast<int64_t>(captured.layers.size()) == config_.num_layers &&
                  captured.cache.num_layers() == config_.num_layers,
              "LlamaModel::compress_captured: the capture has ", captured.layers.size(), " layers, the model ",
              config_.num_layers, " (use this model's capture_prefill())");
  const int64_t seq = captured.layers.front().keys.size(2);
  TORCH_CHECK(options.question_length >= 0 && options.question_length <= seq,
              "LlamaModel::compress_captured: question_length must be in [0, ", seq, "] (the capture's tokens), got ",
              options.question_length);
  KVCache cache = captured.cache;  // shares the capture's tensors; compressing replaces them
  const BasePress* press = prefill_press_of(options.press);
  if (press == nullptr) return cache;
  ForwardOutput local;
  for (int64_t li = 0; li < config_.num_layers; ++li) {
    LayerInputs in = captured.layers[static_cast<size_t>(li)];
    in.question_length = options.question_length;  // as prefill() gives it
    compress_at_prefill(*press, options, li, std::move(in), /*in_place=*/false, cache, out ? *out : local);
  }
  cache.set_position(press->position_after(cache.position(), cache.length(0)));
  return cache;
}

ForwardOutput LlamaModel::forward(const at::Tensor& input_ids, KVCache& cache, const ForwardOptions& options) const {
  return run(input_ids, cache, options, nullptr);
}

void LlamaModel::check_forward_inputs(const at::Tensor& input_ids, const KVCache& cache) const {
  const LlamaConfig& c = config_;
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.size(1) > 0 && input_ids.scalar_type() == at::kLong,
              "LlamaModel: input_ids must be a non-empty int64 [batch, n] tensor, got ", shape_str(input_ids), " ",
              input_ids.scalar_type());
  TORCH_CHECK(cache.num_layers() == c.num_layers, "LlamaModel: the cache has ", cache.num_layers(),
              " layers, the model ", c.num_layers, " (use new_cache())");
  const int64_t lowest = input_ids.min().item<int64_t>(), highest = input_ids.max().item<int64_t>();
  TORCH_CHECK(lowest >= 0 && highest < c.vocab_size, "LlamaModel: input_ids must be in [0, vocab_size (", c.vocab_size,
              ")), got values in [", lowest, ", ", highest, "]");
}

ForwardOutput LlamaModel::run(const at::Tensor& input_ids, KVCache& cache, const ForwardOptions& options,
                              const PrefillOptions* prefill, std::vector<LayerInputs>* capture) const {
  const LlamaConfig& c = config_;
  check_forward_inputs(input_ids, cache);
  const int64_t n = input_ids.size(1);
  const int64_t start = cache.position();

  // A DecodingPress does nothing at prefill (kvpress's hook skips it); a PrefillDecodingPress
  // applies its prefilling press.
  const BasePress* press = prefill ? prefill_press_of(options.press) : nullptr;
  const bool press_attentions = press && wants_attentions(prefill->press_attentions, options, press->name());
  // kvpress's is_prefilling: a forward starting at position 0 is a prefill, so decoding presses skip it.
  const BasePress* decoding =
      start > 0 && options.press && options.press->decoding_role().compresses ? options.press : nullptr;
  PressSequenceState* state = options.press_state;
  check_press_on_shard(decoding, "LlamaModel::forward");
  TORCH_CHECK(decoding == nullptr || state != nullptr, "LlamaModel: ", decoding->name(),
              " needs a press_state (press->new_sequence_state(), one per sequence), got nullptr");
  const DecodingRole role = decoding ? decoding->decoding_role() : DecodingRole{};
  const bool decoding_attentions =
      role.scorer && (options.decoding_attentions || needs_attentions(role.scorer->name()));
  // A press whose state starts at prefill (DMSPress's window) records it there.
  const bool records_prefill = press && state && !decoding;

  ForwardOutput out;
  const RopeTables rope_tables = rope(start, n);
  at::Tensor x = at::embedding(embed_tokens_, input_ids);  // [B, n, hidden]
  // A failure part-way (a press raising in some layer) leaves the cache as it was before this call.
  // A copy is a snapshot: the layers' tensors are shared, and a forward only writes past their
  // current lengths or replaces tensors (it never truncates), so the copy's contents stay intact.
  KVCache before = cache;
  // The press state the forward advances goes back with it (PressSequenceState::snapshot).
  const std::unique_ptr<PressSequenceState> state_before =
      state && (records_prefill || decoding) ? state->snapshot() : nullptr;
  try {
    for (int64_t li = 0; li < c.num_layers; ++li) {
      const Layer& w = layers_[static_cast<size_t>(li)];
      const at::Tensor h = rms_norm(x, w.input_norm);  // the attention input kvpress calls hidden_states
      const LayerQKV qkv = project_qkv(li, h, rope_tables);
      cache.append(li, qkv.k, qkv.v);
      at::Tensor attn_out, attn_weights;  // [B, n, Hq * D]; [B, Hq, n, L] of a dense layer
      if (cache.is_ragged(li)) {
        TORCH_CHECK(!options.return_attentions, "LlamaModel: return_attentions is not available for layer ", li,
                    ", stored head-ragged (prefill with ragged_layout = kMasked to get dense weights)");
        TORCH_CHECK(decoding == nullptr || role.evicts_per_head,
                    "LlamaModel: ", decoding ? decoding->name() : std::string(), " cannot compress layer ", li,
                    ", stored head-ragged");
        attn_out = ragged_attention(qkv.q, cache.ragged(li));
      } else {
        // Weights only where someone reads them; fused attention otherwise (no n x L matrix).
        const bool weights_needed =
            options.eager_attention || options.return_attentions || press_attentions || decoding_attentions;
        attn_out = dense_attention(qkv.q, cache.keys(li), cache.values(li), cache.keep_mask(li),
                                   weights_needed ? &attn_weights : nullptr);
      }
      if (options.return_attentions) out.attentions.push_back(attn_weights);

      // The presses' hooks run here, after the attention used the full cache, as kvpress's forward hook.
      if (capture) {
        LayerInputs in =
            hook_inputs(li, input_ids, h, rope_tables, cache.keys(li).contiguous(), cache.values(li).contiguous());
        in.queries = qkv.q;
        capture->push_back(std::move(in));
      } else if (press) {
        LayerInputs in =
            hook_inputs(li, input_ids, h, rope_tables, cache.keys(li).contiguous(), cache.values(li).contiguous());
        // The queries this prefill computed anyway (all positions, from 0): a press reads them
        // instead of projecting the hidden states again.
        in.queries = qkv.q;
        if (press_attentions) in.attentions = attn_weights;
        in.question_length = prefill->question_length;
        // In place only in a layer this prefill filled: `before` shares no stored token of it.
        const bool in_place = prefill->compress_in_place && before.length(li) == 0;
        const at::Tensor mask = records_prefill ? options.press->record_prefill(in, *state) : at::Tensor();
        compress_at_prefill(*press, *prefill, li, std::move(in), in_place, cache, out, mask);
      } else if (decoding) {
        // The whole layer only when the press reads it; else this forward's new keys/values.
        const bool whole = decoding->decoding_reads_cache(li, n, start + n, *state);
        LayerInputs in = hook_inputs(li, input_ids, h, rope_tables, whole ? cache.keys(li).contiguous() : qkv.k,
                                     whole ? cache.values(li).contiguous() : qkv.v);
        if (decoding_attentions) in.attentions = attn_weights;
        update_while_decoding(*decoding, options, li, std::move(in), start + n, cache);
      }

      x = mlp_residual(li, x + project_output(li, attn_out), nullptr);
    }
    // After a press that re-rotates the kept keys to positions 0..n_kept-1 (KeyRerotationPress), the
    // next token continues at n_kept, as in kvpress's pipeline; otherwise after the last input token.
    cache.set_position(press ? press->position_after(start + n, cache.length(0)) : start + n);
  } catch (...) {
    cache = std::move(before);
    if (state_before) state->restore(*state_before);
    throw;
  }

  x = rms_norm(x, norm_);
  if (options.last_logits_only) x = x.narrow(1, n - 1, 1);
  out.logits = at::linear(x, lm_head_);
  return out;
}

bool LlamaModel::wants_attentions(PressAttentions mode, const ForwardOptions& options, const std::string& press_name) {
  switch (mode) {
    case PressAttentions::kAlways: return true;
    case PressAttentions::kNever: return false;
    // Computed anyway when the caller asked for them (kvpress on an eager model passes them too).
    case PressAttentions::kAuto: return options.return_attentions || needs_attentions(press_name);
  }
  return false;
}

LlamaModel::LayerQKV LlamaModel::project_qkv(int64_t layer, const at::Tensor& h, const RopeTables& rope_tables,
                                             const LoraAdapter* lora) const {
  const Layer& w = layers_[static_cast<size_t>(layer)];
  const std::optional<LoraLinear> q_update = lora_update(lora, layer, "q_proj"),
                                  k_update = lora_update(lora, layer, "k_proj"),
                                  v_update = lora_update(lora, layer, "v_proj");
  const auto update = [](const std::optional<LoraLinear>& u) { return u ? &*u : nullptr; };
  const int64_t batch = h.size(0), n = h.size(1), d = config_.head_dim;
  // [B, n, heads * D] -> [B, heads, n, D], RMS-normed per head first where the model has the norm.
  const auto heads = [&](const at::Tensor& projected, int64_t count, const at::Tensor& norm) {
    const at::Tensor x = projected.view({batch, n, count, d});
    return (norm.defined() ? rms_norm(x, norm) : x).transpose(1, 2);
  };
  const at::Tensor input = into_shard(h);  // a shard's heads read the whole h
  LayerQKV out;
  out.q = ops::apply_rope(heads(lora_linear(input, w.q_proj, update(q_update), w.q_bias), config_.num_heads, w.q_norm),
                          rope_tables.cos, rope_tables.sin);
  out.k =
      ops::apply_rope(heads(lora_linear(input, w.k_proj, update(k_update), w.k_bias), config_.num_kv_heads, w.k_norm),
                      rope_tables.cos, rope_tables.sin);
  out.v = heads(lora_linear(input, w.v_proj, update(v_update), w.v_bias), config_.num_kv_heads, at::Tensor());
  return out;
}

at::Tensor LlamaModel::dense_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                       const at::Tensor& keep_mask, at::Tensor* weights_out) const {
  const int64_t batch = q.size(0), n = q.size(2), len = keys.size(2);
  const int64_t hq = config_.num_heads, hkv = config_.num_kv_heads, d = config_.head_dim, groups = hq / hkv;
  const double scaling = 1.0 / std::sqrt(static_cast<double>(d));  // head_dim ** -0.5
  // New token i sits in cache slot len - n + i and sees slots <= that one; everything before the
  // new tokens (the possibly compressed past) is visible.
  const auto causal_visible = [&] {  // [n, L] bool
    const at::Tensor row = at::arange(n, at::kLong).unsqueeze(1) + (len - n);
    const at::Tensor col = at::arange(len, at::kLong).unsqueeze(0);
    return col <= row;
  };
  if (weights_out == nullptr) {
    // SDPA's is_causal aligns the mask top-left, which is ours only when the new tokens are the
    // whole layer; otherwise the visibility goes in as a boolean mask (true = attend).
    at::Tensor visible;
    const bool is_causal = n == len && n > 1 && !keep_mask.defined();
    if (!is_causal && n > 1) visible = causal_visible();
    // A head-ragged selection kept densely (RaggedLayout::kMasked) hides its evicted tokens.
    if (keep_mask.defined()) {
      const at::Tensor kept = keep_mask.repeat_interleave(groups, 1).unsqueeze(2);  // [B, Hq, 1, L]
      visible = visible.defined() ? at::logical_and(kept, visible) : kept;
    }
    const std::optional<at::Tensor> mask = visible.defined() ? std::optional<at::Tensor>(visible) : std::nullopt;
    return at::scaled_dot_product_attention(q, keys, values, mask, 0.0, is_causal, scaling, /*enable_gqa=*/true)
        .transpose(1, 2)
        .reshape({batch, n, hq * d});
  }
  // GQA without repeating K/V: the G query heads of a KV head become extra rows of one matmul.
  // Query head j*G + g uses KV head j, as repeat_kv does.
  const at::Tensor qg = q.reshape({batch, hkv, groups * n, d});
  at::Tensor scores = at::matmul(qg, keys.transpose(2, 3)) * scaling;  // [B, Hkv, G*n, L]
  scores = scores.view({batch, hkv, groups, n, len});
  if (n > 1) scores = scores.masked_fill(causal_visible().logical_not(), -std::numeric_limits<double>::infinity());
  if (keep_mask.defined())
    scores = scores.masked_fill(keep_mask.logical_not().view({batch, hkv, 1, 1, len}),
                                -std::numeric_limits<double>::infinity());
  const at::Tensor weights = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());       // [B, Hkv, G, n, L]
  const at::Tensor attn = at::matmul(weights.view({batch, hkv, groups * n, len}), values);  // [B, Hkv, G*n, D]
  *weights_out = weights.view({batch, hq, n, len});
  return attn.view({batch, hq, n, d}).transpose(1, 2).reshape({batch, n, hq * d});
}

at::Tensor LlamaModel::ragged_attention(const at::Tensor& q, const HeadRaggedLayer& layer) const {
  // Fused attention over each head's kept tokens and the new ones: no dense K/V, no weight matrix.
  const int64_t batch = q.size(0), n = q.size(2);
  const double scaling = 1.0 / std::sqrt(static_cast<double>(config_.head_dim));
  return ops::ragged_attention(q, layer, scaling)
      .transpose(1, 2)
      .reshape({batch, n, config_.num_heads * config_.head_dim});
}

LayerInputs LlamaModel::hook_inputs(int64_t layer, const at::Tensor& input_ids, const at::Tensor& h,
                                    const RopeTables& rope_tables, const at::Tensor& keys,
                                    const at::Tensor& values) const {
  const Layer& w = layers_[static_cast<size_t>(layer)];
  LayerInputs in;
  in.keys = keys;
  in.values = values;
  in.hidden_states = h;  // this forward's attention input
  in.q_proj = w.q_proj;
  in.k_proj = w.k_proj;
  in.q_bias = w.q_bias;  // undefined unless the model has them (Qwen2)
  in.k_bias = w.k_bias;
  in.q_norm = w.q_norm;  // Qwen3
  in.k_norm = w.k_norm;
  in.o_proj = w.o_proj;      // CriticalKVPress / CriticalAdaKVPress weigh values by it
  in.cos = rope_tables.cos;  // this forward's positions (0..S-1 at prefill)
  in.sin = rope_tables.sin;
  in.inv_freq = inv_freq_;   // ExpectedAttentionPress's future positions, KeyRerotationPress
  in.input_ids = input_ids;  // token text (QSMPress/CTRPress semantic weights)
  in.num_heads = config_.num_heads;
  in.layer_idx = layer;
  in.num_layers = config_.num_layers;
  in.norm_eps = config_.rms_norm_eps;
  in.kv_head_range = kv_head_range();  // a shard's heads, and with global budgets the other ranks'
  in.head_exchange = head_exchange();
  return in;
}

void LlamaModel::compress_at_prefill(const BasePress& press, const PrefillOptions& options, int64_t layer,
                                     LayerInputs in, bool in_place, KVCache& cache, ForwardOutput& out,
                                     const at::Tensor& keep_mask_given) const {
  const int64_t batch = in.keys.size(0), hkv = in.keys.size(1), seq = in.keys.size(2), d = in.keys.size(3);
  if (options.tokenizer != nullptr && !in.token_text) {  // QSMPress/CTRPress read the tokens' text
    const Tokenizer* tokenizer = options.tokenizer;
    in.token_text = [tokenizer](int64_t id) { return tokenizer->decode({id}, /*skip_special_tokens=*/false); };
  }
  if (press.head_ragged()) {
    // Heads keep different numbers of tokens: store each head's kept tokens only (kPacked) or
    // mask the evicted ones in the dense layer (kMasked).
    const RaggedKV kv =
        keep_mask_given.defined() ? ops::gather_ragged(in.keys, in.values, keep_mask_given) : press.compress_ragged(in);
    TORCH_CHECK(kv.batch == batch && kv.kv_heads == hkv, "LlamaModel: ", press.name(), " returned ", kv.batch, " x ",
                kv.kv_heads, " heads for a cache of ", shape_str(in.keys));
    HeadRaggedLayer ragged = HeadRaggedLayer::from_ragged(kv, seq);
    const at::Tensor keep_mask = kv.keep_mask.defined() ? kv.keep_mask : ragged.keep_mask();
    if (options.ragged_layout == PrefillOptions::RaggedLayout::kPacked)
      cache.replace_ragged(layer, std::move(ragged));
    else
      cache.set_keep_mask(layer, keep_mask);
    out.keep_masks.push_back(keep_mask);
    if (options.on_compress_ragged) options.on_compress_ragged(in, kv);
    return;
  }
  if (in_place) {
    // The layer's buffer is this prefill's own: the kept tokens move to its front, nothing is
    // allocated for them (peak S tokens, not S + kept), and decoding appends fill the freed tail.
    // An observer sees the inputs as the press did, so it gets them before the move.
    LayerInputs seen;
    if (options.on_compress) {
      seen = in;
      seen.keys = in.keys.clone();
      seen.values = in.values.clone();
    }
    const KV kv = cache.compress_in_place(layer, press, std::move(in));
    out.kept_indices.push_back(kv.kept_indices);
    if (options.on_compress) options.on_compress(seen, kv);
    return;
  }
  const KV kv = press.compress(in);
  TORCH_CHECK(kv.keys.dim() == 4 && kv.keys.size(0) == batch && kv.keys.size(1) == hkv && kv.keys.size(3) == d &&
                  kv.values.sizes() == kv.keys.sizes(),
              "LlamaModel: ", press.name(), " returned keys ", shape_str(kv.keys), " and values ", shape_str(kv.values),
              " for a cache of ", shape_str(in.keys));
  cache.replace(layer, kv.keys, kv.values);
  out.kept_indices.push_back(kv.kept_indices);
  if (options.on_compress) options.on_compress(in, kv);
}

namespace {

// A kKeepEveryLayer update: every layer keeps the slots `keep` [B, Hkv, k] of its dense cache (each
// layer has run its attention of this forward; the forward's undo covers a failure part-way).
void keep_in_every_layer(const BasePress& press, const ForwardOptions& options, const LayerInputs& last,
                         const at::Tensor& keep, KVCache& cache) {
  const int64_t length = last.keys.size(2);
  TORCH_CHECK(keep.dim() == 3 && keep.size(0) == last.keys.size(0) && keep.size(1) == last.keys.size(1),
              "LlamaModel: ", press.name(), " returned slots ", shape_str(keep), " to keep for a cache of ",
              shape_str(last.keys));
  for (int64_t layer = 0; layer < cache.num_layers(); ++layer) {
    TORCH_CHECK(!cache.is_ragged(layer) && !cache.keep_mask(layer).defined() && cache.length(layer) == length,
                "LlamaModel: ", press.name(), " keeps the same slots in every layer, but layer ", layer,
                " is not a dense layer of ", length, " tokens");
    LayerInputs in = last;
    in.layer_idx = layer;
    in.keys = cache.keys(layer);
    in.values = cache.values(layer);
    const KV kv = ops::gather_kv(in.keys, in.values, keep);
    cache.replace(layer, kv.keys, kv.values);
    if (options.on_decoding_compress) options.on_decoding_compress(in, kv);
  }
}

}  // namespace

void LlamaModel::update_while_decoding(const BasePress& press, const ForwardOptions& options, int64_t layer,
                                       LayerInputs in, int64_t tokens_seen, KVCache& cache) const {
  const DecodingUpdate update = press.decoding_update(in, tokens_seen, *options.press_state);
  if (update.kind == DecodingUpdate::Kind::kKeepEveryLayer) {
    keep_in_every_layer(press, options, in, update.keep, cache);
    return;
  }
  if (update.kind == DecodingUpdate::Kind::kEvict) {
    cache.evict(layer, update.evict_first, update.evict);
    return;
  }
  if (update.kind != DecodingUpdate::Kind::kReplace) return;
  const KV& kv = update.replacement;
  TORCH_CHECK(kv.keys.dim() == 4 && kv.keys.size(0) == in.keys.size(0) && kv.keys.size(1) == in.keys.size(1) &&
                  kv.keys.size(3) == in.keys.size(3) && kv.values.sizes() == kv.keys.sizes(),
              "LlamaModel: ", press.name(), " returned keys ", shape_str(kv.keys), " and values ", shape_str(kv.values),
              " for a cache of ", shape_str(in.keys));
  cache.replace(layer, kv.keys, kv.values);
  if (options.on_decoding_compress) options.on_decoding_compress(in, kv);
}

}  // namespace kvpress::llama
