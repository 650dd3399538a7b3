#include "kvpress/presses/base_press.h"

#include <ATen/ATen.h>

#include "budget.h"
#include "checks.h"
#include "kvpress/ops.h"

namespace kvpress {

const char* head_span_name(HeadSpan span) {
  switch (span) {
    case HeadSpan::kPerHead: return "per_head";
    case HeadSpan::kExchanged: return "exchanged";
    case HeadSpan::kWholeLayer: return "whole_layer";
  }
  return "unknown";
}

HeadSpan wider_span(HeadSpan a, HeadSpan b) { return static_cast<int>(a) > static_cast<int>(b) ? a : b; }

// ---- BasePress ------------------------------------------------------------------------------

at::Tensor BasePress::keep_mask(const LayerInputs& inputs) const {
  const KV kv = compress(inputs);
  at::Tensor mask =
      at::zeros({kv.keys.size(0), kv.keys.size(1), inputs.keys.size(2)}, inputs.keys.options().dtype(at::kBool));
  return mask.scatter_(2, kv.kept_indices, true);
}

RaggedKV BasePress::compress_ragged(const LayerInputs& inputs) const {
  if (head_ragged()) return ops::gather_ragged(inputs.keys, inputs.values, keep_mask(inputs));
  const KV kv = compress(inputs);
  RaggedKV out;
  out.batch = kv.keys.size(0);
  out.kv_heads = kv.keys.size(1);
  out.keep_mask = at::zeros({out.batch, out.kv_heads, inputs.keys.size(2)}, inputs.keys.options().dtype(at::kBool))
                      .scatter_(2, kv.kept_indices, true);
  out.heads.reserve(static_cast<size_t>(out.batch * out.kv_heads));
  for (int64_t b = 0; b < out.batch; ++b) {
    for (int64_t h = 0; h < out.kv_heads; ++h) {
      out.heads.push_back(HeadKV{kv.keys[b][h], kv.values[b][h], kv.kept_indices[b][h]});
    }
  }
  return out;
}

at::Tensor BasePress::kept_positions(const LayerInputs&) const { return at::Tensor(); }

KV BasePress::gather_kept(const LayerInputs& inputs) const {
  const at::Tensor kept = kept_positions(inputs);
  // kvpress returns the cache untouched at ratio 0: no copy.
  if (compression_ratio() == 0.0) return KV{inputs.keys, inputs.values, kept};
  return ops::gather_kv(inputs.keys, inputs.values, kept);
}

KV BasePress::compress_in_place(const LayerInputs& inputs) const {
  const std::string op = name() + ".compress_in_place";
  checks::check_kv(op.c_str(), inputs.keys, inputs.values);
  if (head_ragged()) refuse_uniform_compress();
  const at::Tensor kept = kept_positions(inputs);
  if (kept.defined()) return ops::compact_kv_in_place(inputs.keys, inputs.values, kept);
  // A press that changes what it keeps: its result, copied into the front of the buffers.
  const KV kv = compress(inputs);
  const int64_t n = kv.keys.size(2);
  TORCH_CHECK(kv.keys.dim() == 4 && kv.keys.sizes() == kv.values.sizes() && n <= inputs.keys.size(2), op, ": ", name(),
              " returned keys ", checks::shape_str(kv.keys), " for a cache of ", checks::shape_str(inputs.keys));
  KV out{inputs.keys.narrow(2, 0, n), inputs.values.narrow(2, 0, n), kv.kept_indices};
  if (kv.keys.data_ptr() != inputs.keys.data_ptr()) out.keys.copy_(kv.keys);  // ratio 0 returns the inputs
  if (kv.values.data_ptr() != inputs.values.data_ptr()) out.values.copy_(kv.values);
  return out;
}

at::Tensor BasePress::record_prefill(const LayerInputs&, PressSequenceState&) const { return at::Tensor(); }

bool BasePress::decoding_reads_cache(int64_t, int64_t, int64_t, const PressSequenceState&) const { return false; }

DecodingUpdate BasePress::decoding_update(const LayerInputs&, int64_t, PressSequenceState&) const {
  TORCH_CHECK(false, name(), ".decoding_update: ", name(),
              " does not compress while decoding (decoding_role().compresses is false)");
}

void BasePress::refuse_uniform_compress() const {
  TORCH_CHECK(false, name(), ".compress: ", name(),
              " keeps a different number of tokens per KV head, which a [B, Hkv, n_kept, D] cache cannot hold; "
              "use compress_ragged() (head_ragged() is true)");
}

void BasePress::second_pass(SecondPassRun&) const {
  TORCH_CHECK(false, name(), ".second_pass: ", name(),
              " compresses layer by layer in the ordinary prefill and has no second pass (needs_second_pass() is "
              "false)");
}

// ---- ScorerPress ----------------------------------------------------------------------------

ScorerPress::ScorerPress(double compression_ratio) : compression_ratio_(compression_ratio) {
  checks::check_ratio("ScorerPress", compression_ratio);
}

void ScorerPress::set_compression_ratio(double compression_ratio) {
  checks::check_ratio("ScorerPress", compression_ratio);
  compression_ratio_ = compression_ratio;
}

KV ScorerPress::compress(const LayerInputs& inputs) const { return gather_kept(inputs); }

at::Tensor ScorerPress::kept_positions(const LayerInputs& inputs) const {
  const std::string op = name() + ".compress";
  checks::check_kv(op.c_str(), inputs.keys, inputs.values);
  const int64_t batch = inputs.keys.size(0), kv_heads = inputs.keys.size(1), seq = inputs.keys.size(2);
  if (compression_ratio_ == 0.0) return budget::keep_all(inputs).kept_indices;
  const at::Tensor scores = score(inputs);
  TORCH_CHECK(scores.dim() == 3 && scores.size(0) == batch && scores.size(1) == kv_heads && scores.size(2) == seq, op,
              ": scores must be [", batch, ", ", kv_heads, ", ", seq, "], got ", checks::shape_str(scores));
  TORCH_CHECK(at::isFloatingType(scores.scalar_type()), op, ": scores must be a floating tensor, got ",
              scores.scalar_type());
  try {
    return ops::topk_indices(scores, ops::n_kept(seq, compression_ratio_));
  } catch (const c10::Error&) {
    // The top-k kernels check finiteness on the way; only a failure pays for naming this press.
    checks::check_finite_scores(op.c_str(), scores);
    throw;
  }
}

// ---- ScorerWrapperPress ---------------------------------------------------------------------

ScorerWrapperPress::ScorerWrapperPress(std::shared_ptr<const ScorerPress> press, const char* wrapper_name)
    : press_(std::move(press)) {
  TORCH_CHECK(press_ != nullptr, wrapper_name, ": press must be a ScorerPress, got nullptr");
}

at::Tensor ScorerWrapperPress::inner_scores(const LayerInputs& inputs, const char* op) const {
  return budget::inner_scores(*press_, inputs, op);
}

ChunkedWrapperPress::ChunkedWrapperPress(std::shared_ptr<const ScorerPress> press, int64_t chunk_length,
                                         const char* wrapper_name)
    : ScorerWrapperPress(std::move(press), wrapper_name), chunk_length_(chunk_length) {
  checks::check_positive(wrapper_name, "chunk_length", chunk_length);
}

LayerInputs ScorerWrapperPress::without_attentions(const LayerInputs& inputs) {
  LayerInputs out = inputs;
  out.attentions = at::Tensor();
  return out;
}

KV HeadRaggedWrapperPress::compress(const LayerInputs&) const { refuse_uniform_compress(); }

}  // namespace kvpress
