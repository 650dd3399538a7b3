#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// What TriAttentionPress keeps about one sequence while it decodes. Every layer holds the same tokens
// in the same slots (the press selects once for the whole model), so one record serves them all.
struct TriAttentionState : CopyableSequenceState<TriAttentionState> {
  at::Tensor positions;       // [Hkv, L] int64: the original position of each cache slot, per KV head
  int64_t prompt_length = 0;  // the prompt's tokens, pinned in the first slots of every head
  int64_t tokens_seen = 0;    // tokens_seen of the forward whose tokens `positions` last took in
  // The round being scored: the sum over the layers scored so far of their z-scored scores of the
  // decoding slots [prompt_length, L), max over each KV head's query heads, [Hkv, L - prompt_length].
  at::Tensor layer_score_sum;
  int64_t layers_scored = 0;
};

// TriAttention (Mao et al.; github.com/WeianMao/triattention, its Hugging Face path
// `triattention/methods/triattention.py` at c3744ee6; docs/PRESS_NOTES.md, "TriAttentionPress"):
// compression while generating a long reasoning trace, from the keys alone and statistics of the
// model's pre-RoPE queries measured once on plain text.
//
// A RoPE query and key attend by Σ_f Re(q_f conj(k_f) e^{i Δ ω_f}) over the D/2 frequency pairs
// (z_f = x[f] + i x[f + D/2]) at distance Δ. With the query replaced by its calibrated mean q̄_f
// (complex) and mean modulus E|q_f|, key j at position p_j scores, at round start R (the tokens
// processed) and over the offsets δ = 1, 2, 4, ..., offset_max_length:
//   s_j = agg_δ Σ_f |q̄_f| |K_f| cos((R − p_j + δ) ω_f + arg(q̄_f conj(K_f)))  +  Σ_f (E|q_f| − |q̄_f|) |K_f|
// (K: the key with its RoPE undone; agg: mean, or max, over the offsets). Selection, the paper's
// per-head mode: each (layer, query head) row of scores of the decoding tokens is z-scored
// (population std, floored at 1e-6), the max over the query heads of a KV head taken, then the mean
// over the layers; each KV head keeps its best (budget − prompt) decoding tokens, and the prompt
// whole. The same slots go in every layer (DecodingUpdate::kKeepEveryLayer).
//
// Schedule (the paper's runs: slack trigger, prompt tokens counted): after a decoding forward that
// leaves the cache with >= budget + divide_length tokens, back to budget. Nothing at prefill.
// Quirk kept from the authors' code: a prompt of >= budget tokens keeps only its first `budget`
// tokens at every compression, and no decoding token.
// Differences (docs/PRESS_NOTES.md): ties go to the lower position (the authors add 1e-6 uniform
// noise from a seeded CUDA generator); the kept slots are ascending (theirs: prompt, then by
// score); keys are un-rotated with the model's own RoPE frequencies (inv_freq) and RoPE with an
// attention scaling other than 1 is not supported; the authors' other modes (one selection for all
// heads, per layer and head, no z-score) are not offered.
// Needs batch 1 per sequence (the engine's per-sequence state), keys/values of the whole layer when
// it compresses (decoding_reads_cache), inv_freq, and every layer of every forward in order.
class TriAttentionPress : public BasePress {
 public:
  static constexpr int64_t kDefaultBudget = 2048;
  static constexpr int64_t kDefaultDivideLength = 128;
  static constexpr int64_t kDefaultOffsetMaxLength = 65536;
  static constexpr const char* kDefaultScoreAggregation = "mean";

  // Calibrated pre-RoPE query statistics, float32 [num_layers, num_heads, head_dim / 2] each:
  // the complex mean of the frequency pairs (real and imaginary parts) and the mean modulus.
  struct Statistics {
    at::Tensor q_mean_real;
    at::Tensor q_mean_imag;
    at::Tensor q_abs_mean;
  };

  struct Params {
    int64_t budget = kDefaultBudget;
    int64_t divide_length = kDefaultDivideLength;
    int64_t offset_max_length = kDefaultOffsetMaxLength;
    std::string score_aggregation = kDefaultScoreAggregation;
    std::string stats_file;  // safetensors with q_mean_real, q_mean_imag, q_abs_mean; "": none

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"budget", "tokens each head keeps after a compression, prompt included"}.positive(), self.budget);
      visit(ParamSpec{"divide_length", "compress when the cache holds budget + divide_length tokens"}.positive(),
            self.divide_length);
      visit(ParamSpec{"offset_max_length", "the largest future offset (1, 2, 4, ... up to it) keys are scored at"}
                .positive(),
            self.offset_max_length);
      visit(ParamSpec{"score_aggregation", "how a key's scores at the offsets combine"}.one_of({"mean", "max"}),
            self.score_aggregation);
      visit(
          ParamSpec{"stats_file", "safetensors of the model's query statistics (TriAttentionPress::calibrate)"}.file(),
          self.stats_file);
    }
  };

  // Reads params.stats_file when set (without statistics decoding_update() raises). Raises
  // c10::Error for a parameter outside its range or statistics of the wrong shapes.
  explicit TriAttentionPress(const Params& params);
  TriAttentionPress(const Params& params, Statistics statistics);

  std::string name() const override { return "TriAttentionPress"; }
  double compression_ratio() const override { return 0.0; }  // set by the budget and the length
  const Params& params() const { return params_; }
  const Statistics& statistics() const { return statistics_; }

  // The statistics of every layer's pre-RoPE queries over a calibration text: `layers` as a prefill
  // sees them (LlamaModel::capture_prefill's layers: queries + cos/sin, or hidden_states + q_proj),
  // the mean over every position and batch row. The authors' calibrate.py does the same on one
  // forward of plain text (<= 32768 tokens).
  static Statistics calibrate(const std::vector<LayerInputs>& layers);
  // The statistics as safetensors (q_mean_real, q_mean_imag, q_abs_mean), and back. load raises a
  // c10::Error naming the file and what is wrong.
  static void save_statistics(const std::string& path, const Statistics& statistics);
  static Statistics load_statistics(const std::string& path);

  // s_j above for one layer, float32 [Hq, n]: keys [Hkv, n, D] post-RoPE at `positions` [Hkv, n]
  // int64, the layer's statistics rows [Hq, D/2] (query head h reads KV head h / (Hq / Hkv)),
  // inv_freq [D/2], at round start `round_start`.
  static at::Tensor frequency_scores(const at::Tensor& keys, const at::Tensor& positions, int64_t round_start,
                                     const at::Tensor& q_mean_real, const at::Tensor& q_mean_imag,
                                     const at::Tensor& q_abs_mean, const at::Tensor& inv_freq,
                                     const at::Tensor& offsets, bool max_over_offsets);
  // 1, 2, 4, ... <= max_length, float32.
  static at::Tensor geometric_offsets(int64_t max_length);

  // Compression happens only while decoding.
  const BasePress* prefill_press() const override { return nullptr; }
  // The prefill, where the method does nothing: the layer as given (every engine skips it, as
  // prefill_press() is nullptr; a direct call gets the same answer).
  KV compress(const LayerInputs& inputs) const override;
  std::unique_ptr<PressSequenceState> new_sequence_state() const override;
  DecodingRole decoding_role() const override;
  bool decoding_reads_cache(int64_t layer, int64_t n, int64_t tokens_seen,
                            const PressSequenceState& state) const override;
  DecodingUpdate decoding_update(const LayerInputs& forward, int64_t tokens_seen,
                                 PressSequenceState& state) const override;

  // Whether a cache of `length` tokens (this forward's included) is compressed.
  bool due(int64_t length) const { return length >= params_.budget + params_.divide_length; }

 private:
  // The layer's z-scored scores of the decoding slots, max over each KV head's query heads, [Hkv, m].
  at::Tensor layer_scores(const LayerInputs& forward, const TriAttentionState& state, int64_t tokens_seen,
                          const char* op) const;
  // The slots every layer keeps, [1, Hkv, budget], from the round's summed scores.
  at::Tensor select(const TriAttentionState& state, int64_t num_layers) const;

  Params params_;
  Statistics statistics_;
  at::Tensor offsets_;  // [O] float32
};

}  // namespace kvpress
