// The Llama forward pass, its KV cache, and where a press plugs in (docs/LLAMA_RUNNER.md).
//
// Every step mirrors transformers' modeling_llama.py (eager attention) with the same ATen
// operations in the same order, so float32 logits agree to ~1e-6:
//   RMSNorm      x.float() * rsqrt(mean(x^2) + eps), cast back, times the weight
//   RoPE         inv_freq = 1 / theta^(arange(0, D, 2) / D) in float32; angles = position * inv_freq;
//                cos/sin of cat(angles, angles); x * cos + rotate_half(x) * sin
//   attention    softmax(q k^T * D^-0.5 + causal mask) in float32, cast to the model dtype, times v
//   MLP          down(silu(gate(x)) * up(x))
#include "kvpress/llama/model.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "kvpress/io/safetensors.h"
#include "kvpress/ops.h"
#include "kvpress/registry.h"

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

KVCache::KVCache(int64_t num_layers) : layers_(static_cast<size_t>(num_layers)) {}

int64_t KVCache::length(int64_t layer) const { return layers_.at(static_cast<size_t>(layer)).length; }

std::vector<int64_t> KVCache::lengths() const {
  std::vector<int64_t> out;
  for (const auto& l : layers_) out.push_back(l.length);
  return out;
}

at::Tensor KVCache::keys(int64_t layer) const {
  const Layer& l = layers_.at(static_cast<size_t>(layer));
  return l.key_buffer.defined() ? l.key_buffer.narrow(2, 0, l.length) : at::Tensor();
}

at::Tensor KVCache::values(int64_t layer) const {
  const Layer& l = layers_.at(static_cast<size_t>(layer));
  return l.value_buffer.defined() ? l.value_buffer.narrow(2, 0, l.length) : at::Tensor();
}

void KVCache::append(int64_t layer, const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(layer >= 0 && layer < num_layers(), "KVCache::append: layer ", layer, " out of range");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes(),
              "KVCache::append: keys and values must be [batch, kv_heads, n, head_dim] of one shape, got ",
              shape_str(keys), " and ", shape_str(values));
  Layer& l = layers_[static_cast<size_t>(layer)];
  const int64_t n = keys.size(2);
  if (l.key_buffer.defined()) {
    TORCH_CHECK(keys.size(0) == l.key_buffer.size(0) && keys.size(1) == l.key_buffer.size(1) &&
                    keys.size(3) == l.key_buffer.size(3),
                "KVCache::append: new keys ", shape_str(keys), " do not match the cache ",
                shape_str(this->keys(layer)));
  }
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
    l.key_buffer = kb;
    l.value_buffer = vb;
  }
  l.key_buffer.narrow(2, l.length, n).copy_(keys);
  l.value_buffer.narrow(2, l.length, n).copy_(values);
  l.length += n;
}

void KVCache::replace(int64_t layer, const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(layer >= 0 && layer < num_layers(), "KVCache::replace: layer ", layer, " out of range");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes(),
              "KVCache::replace: keys and values must be [batch, kv_heads, n, head_dim] of one shape, got ",
              shape_str(keys), " and ", shape_str(values));
  Layer& l = layers_[static_cast<size_t>(layer)];
  l.key_buffer = keys.contiguous();
  l.value_buffer = values.contiguous();
  l.length = keys.size(2);
}

void KVCache::truncate(const std::vector<int64_t>& lengths, int64_t position) {
  TORCH_CHECK(static_cast<int64_t>(lengths.size()) == num_layers(), "KVCache::truncate: expected ", num_layers(),
              " lengths, got ", lengths.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    TORCH_CHECK(lengths[i] >= 0 && lengths[i] <= layers_[i].length, "KVCache::truncate: layer ", i, " holds ",
                layers_[i].length, " tokens, cannot keep ", lengths[i]);
    layers_[i].length = lengths[i];
  }
  position_ = position;
}

// ---- model ---------------------------------------------------------------------------------------

bool press_needs_attentions(const BasePress& press) {
  // The registry's `needs` lists alternatives separated by '|'; attentions are required when every
  // alternative starts with them ("attentions (all rows)").
  for (const PressInfo& info : list_presses()) {
    if (info.name != press.name()) continue;
    std::stringstream ss(info.needs);
    std::string alternative;
    bool all = true, any = false;
    while (std::getline(ss, alternative, '|')) {
      const size_t first = alternative.find_first_not_of(' ');
      any = true;
      all = all && first != std::string::npos && alternative.compare(first, 10, "attentions") == 0;
    }
    return any && all;
  }
  return false;
}

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
    l.post_norm = take_weight(weights, p + "post_attention_layernorm.weight", {h}, dtype);
    l.gate_proj = take_weight(weights, p + "mlp.gate_proj.weight", {c.intermediate_size, h}, dtype);
    l.up_proj = take_weight(weights, p + "mlp.up_proj.weight", {c.intermediate_size, h}, dtype);
    l.down_proj = take_weight(weights, p + "mlp.down_proj.weight", {h, c.intermediate_size}, dtype);
    layers_.push_back(std::move(l));
  }
  // transformers: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)); Python's
  // 1.0 / t is t.reciprocal() * 1.0.
  const at::Tensor exponent = at::arange(0, d, 2, at::kLong).to(at::kFloat) / static_cast<double>(d);
  inv_freq_ = at::reciprocal(at::pow(c.rope_theta, exponent));
}

RopeTables LlamaModel::rope(int64_t start, int64_t n) const {
  // angles[p, i] = position_p * inv_freq_i in float32 (transformers' [D/2, 1] @ [1, n] matmul has a
  // single product per entry, so it is this product exactly).
  const at::Tensor positions = at::arange(start, start + n, at::kLong).to(at::kFloat);
  const at::Tensor angles = positions.unsqueeze(1) * inv_freq_.unsqueeze(0);  // [n, D/2]
  const at::Tensor emb = at::cat({angles, angles}, -1);                         // [n, D]
  return {emb.cos().to(dtype_), emb.sin().to(dtype_)};
}

at::Tensor LlamaModel::rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor variance = xf.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (xf * at::rsqrt(variance + config_.rms_norm_eps)).to(x.scalar_type());
}

ForwardOutput LlamaModel::prefill(const at::Tensor& input_ids, KVCache& cache, const PrefillOptions& options) const {
  TORCH_CHECK(cache.position() == 0, "LlamaModel::prefill: the cache already holds ", cache.position(),
              " tokens; prefill starts from an empty cache (use forward() to continue)");
  return run(input_ids, cache, options, &options);
}

ForwardOutput LlamaModel::forward(const at::Tensor& input_ids, KVCache& cache, const ForwardOptions& options) const {
  return run(input_ids, cache, options, nullptr);
}

ForwardOutput LlamaModel::run(const at::Tensor& input_ids, KVCache& cache, const ForwardOptions& options,
                              const PrefillOptions* prefill) const {
  const LlamaConfig& c = config_;
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.size(1) > 0 && input_ids.scalar_type() == at::kLong,
              "LlamaModel: input_ids must be a non-empty int64 [batch, n] tensor, got ", shape_str(input_ids), " ",
              input_ids.scalar_type());
  TORCH_CHECK(cache.num_layers() == c.num_layers, "LlamaModel: the cache has ", cache.num_layers(),
              " layers, the model ", c.num_layers, " (use new_cache())");
  const int64_t batch = input_ids.size(0), n = input_ids.size(1);
  const int64_t hq = c.num_heads, hkv = c.num_kv_heads, d = c.head_dim, groups = hq / hkv;
  const double scaling = 1.0 / std::sqrt(static_cast<double>(d));  // head_dim ** -0.5
  const int64_t start = cache.position();

  const BasePress* press = prefill ? prefill->press : nullptr;
  bool press_attentions = false;
  if (press) {
    switch (prefill->press_attentions) {
      case PressAttentions::kAlways: press_attentions = true; break;
      case PressAttentions::kNever: press_attentions = false; break;
      // Computed anyway when the caller asked for them (kvpress on an eager model passes them too).
      case PressAttentions::kAuto:
        press_attentions = options.return_attentions || press_needs_attentions(*press);
        break;
    }
  }

  ForwardOutput out;
  const RopeTables rope_tables = rope(start, n);
  at::Tensor x = at::embedding(embed_tokens_, input_ids);  // [B, n, hidden]

  for (int64_t li = 0; li < c.num_layers; ++li) {
    const Layer& w = layers_[static_cast<size_t>(li)];

    // --- self-attention -------------------------------------------------------------------------
    const at::Tensor residual = x;
    const at::Tensor h = rms_norm(x, w.input_norm);  // the attention input kvpress calls hidden_states
    at::Tensor q = at::linear(h, w.q_proj).view({batch, n, hq, d}).transpose(1, 2);   // [B, Hq, n, D]
    at::Tensor k = at::linear(h, w.k_proj).view({batch, n, hkv, d}).transpose(1, 2);  // [B, Hkv, n, D]
    const at::Tensor v = at::linear(h, w.v_proj).view({batch, n, hkv, d}).transpose(1, 2);
    q = ops::apply_rope(q, rope_tables.cos, rope_tables.sin);
    k = ops::apply_rope(k, rope_tables.cos, rope_tables.sin);
    cache.append(li, k, v);
    const at::Tensor keys = cache.keys(li), values = cache.values(li);  // [B, Hkv, L, D]
    const int64_t len = keys.size(2);

    // GQA without repeating K/V: the G query heads of a KV head become extra rows of one matmul.
    // Query head j*G + g uses KV head j, as repeat_kv does.
    const at::Tensor qg = q.reshape({batch, hkv, groups * n, d});
    at::Tensor scores = at::matmul(qg, keys.transpose(2, 3)) * scaling;  // [B, Hkv, G*n, L]
    scores = scores.view({batch, hkv, groups, n, len});
    if (n > 1) {
      // New token i sits in cache slot len - n + i and sees slots <= that one; everything before
      // the new tokens (the possibly compressed past) is visible.
      const at::Tensor row = at::arange(n, at::kLong).unsqueeze(1) + (len - n);
      const at::Tensor col = at::arange(len, at::kLong).unsqueeze(0);
      scores = scores.masked_fill(col > row, -std::numeric_limits<double>::infinity());
    }
    const at::Tensor weights = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());  // [B, Hkv, G, n, L]
    const at::Tensor attn = at::matmul(weights.view({batch, hkv, groups * n, len}), values);  // [B, Hkv, G*n, D]
    const at::Tensor attn_out = attn.view({batch, hq, n, d}).transpose(1, 2).reshape({batch, n, hq * d});
    const at::Tensor attn_weights = weights.view({batch, hq, n, len});
    if (options.return_attentions) out.attentions.push_back(attn_weights);

    // --- the press: kvpress's forward hook runs here, after the attention used the full cache ---
    if (press) {
      LayerInputs in;
      in.keys = keys.contiguous();
      in.values = values.contiguous();
      in.hidden_states = h;
      in.q_proj = w.q_proj;
      in.k_proj = w.k_proj;
      in.cos = rope_tables.cos;  // positions 0..S-1 (prefill starts at 0)
      in.sin = rope_tables.sin;
      if (press_attentions) in.attentions = attn_weights;
      in.num_heads = hq;
      in.layer_idx = li;
      in.num_layers = c.num_layers;
      in.norm_eps = c.rms_norm_eps;
      const KV kv = press->compress(in);
      TORCH_CHECK(kv.keys.dim() == 4 && kv.keys.size(0) == batch && kv.keys.size(1) == hkv && kv.keys.size(3) == d &&
                      kv.values.sizes() == kv.keys.sizes(),
                  "LlamaModel: ", press->name(), " returned keys ", shape_str(kv.keys), " and values ",
                  shape_str(kv.values), " for a cache of ", shape_str(keys));
      cache.replace(li, kv.keys, kv.values);
      out.kept_indices.push_back(kv.kept_indices);
      if (prefill->on_compress) prefill->on_compress(in, kv);
    }

    x = residual + at::linear(attn_out, w.o_proj);

    // --- MLP ----------------------------------------------------------------------------------------
    const at::Tensor m = rms_norm(x, w.post_norm);
    x = x + at::linear(at::silu(at::linear(m, w.gate_proj)) * at::linear(m, w.up_proj), w.down_proj);
  }
  cache.advance(n);

  x = rms_norm(x, norm_);
  if (options.last_logits_only) x = x.narrow(1, n - 1, 1);
  out.logits = at::linear(x, lm_head_);
  return out;
}

}  // namespace kvpress::llama
