#pragma once

#include <cstdint>
#include <string>

#include "kvpress/presses/expected_attention_press.h"

namespace kvpress {

// ExpectedAttentionStatsPress (kvpress 0.5.5): ExpectedAttentionPress whose query mean and
// covariance are not measured on the prompt but read from statistics computed once for the model
// (pre-RoPE queries over a calibration text): query_mean [num_layers, num_heads, head_dim] and
// query_cov [num_layers, num_heads, head_dim, head_dim] of layer layer_idx, then the same averaged
// RoPE and scores. kvpress downloads them from the Hugging Face hub under a name made of the model,
// dataset_name, num_samples, sample_seq_len and n_sink, or reads kvpress's save_pretrained folder
// `stats_folder` (model.safetensors + config.json). Here only the folder can be read (nothing is
// downloaded); scripts/make_artifact.py expected-attention-stats writes one for a model by kvpress's
// recipe. Without statistics, score() raises and names what kvpress would have downloaded.
// Reads keys, values, layer_idx and the RoPE frequencies (inv_freq, else cos/sin); no queries.
class ExpectedAttentionStatsPress : public ExpectedAttentionPress {
 public:
  static constexpr int64_t kDefaultSampleSeqLen = 1000;
  static constexpr int64_t kDefaultNumSamples = 100;
  static constexpr const char* kDefaultDatasetName = "kmfoda/booksum";

  struct Statistics {
    at::Tensor query_mean;  // [num_layers, num_heads, head_dim] float32, or undefined (none)
    at::Tensor query_cov;   // [num_layers, num_heads, head_dim, head_dim] float32
  };

  // ExpectedAttentionPress's parameters, then the names of kvpress's hub statistics and the folder read here.
  struct Params : ExpectedAttentionPress::Params {
    int64_t sample_seq_len = kDefaultSampleSeqLen;
    int64_t num_samples = kDefaultNumSamples;
    std::string dataset_name = kDefaultDatasetName;
    std::string stats_folder;  // a folder for load_statistics; "" (none): score() raises

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      ExpectedAttentionPress::Params::for_each_field(self, visit);
      visit(ParamSpec{"sample_seq_len", "characters of each calibration sample (names kvpress's hub statistics)"}
                .positive(),
            self.sample_seq_len);
      visit(ParamSpec{"num_samples", "calibration samples (names kvpress's hub statistics)"}.positive(),
            self.num_samples);
      visit(ParamSpec{"dataset_name", "calibration dataset (names kvpress's hub statistics)"}, self.dataset_name);
      visit(ParamSpec{"stats_folder", "kvpress's statistics folder: model.safetensors with query_mean and query_cov"}
                .file(),
            self.stats_folder);
    }
  };

  // Reads params.stats_folder when set; raises as the constructor below.
  ExpectedAttentionStatsPress(double compression_ratio, const Params& params);
  // Raises as ExpectedAttentionPress, and unless the statistics (when given) have those shapes.
  ExpectedAttentionStatsPress(double compression_ratio, Statistics statistics,
                              int64_t n_future_positions = kDefaultNFuturePositions, int64_t n_sink = kDefaultNSink,
                              bool use_covariance = kDefaultUseCovariance, bool use_vnorm = kDefaultUseVnorm,
                              double epsilon = kDefaultEpsilon, int64_t sample_seq_len = kDefaultSampleSeqLen,
                              int64_t num_samples = kDefaultNumSamples, std::string dataset_name = kDefaultDatasetName);

  // kvpress's folder: <stats_folder>/model.safetensors with query_mean and query_cov, as float32.
  // Raises c10::Error naming the folder and what is wrong.
  static Statistics load_statistics(const std::string& stats_folder);

  std::string name() const override { return "ExpectedAttentionStatsPress"; }
  const Statistics& statistics() const { return statistics_; }
  int64_t sample_seq_len() const { return sample_seq_len_; }
  int64_t num_samples() const { return num_samples_; }
  const std::string& dataset_name() const { return dataset_name_; }

  at::Tensor score(const LayerInputs& inputs) const override;  // -> [B, Hkv, S] float32

 private:
  Statistics statistics_;
  int64_t sample_seq_len_;
  int64_t num_samples_;
  std::string dataset_name_;
};

}  // namespace kvpress
