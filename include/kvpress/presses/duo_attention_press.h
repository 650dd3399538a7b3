#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// DuoAttention (arXiv 2410.10819, kvpress 0.5.5's DuoAttentionPress): every KV head of the model is a
// retrieval head (keeps its whole cache) or a streaming head (keeps the first sink_size and the
// last recent_size tokens). The round(head_compression_ratio · L · Hkv) heads (Python's round, half
// to even) of lowest pattern score become streaming heads (ties: the lower flat index; kvpress:
// NumPy's unstable argsort). A streaming head drops positions [sink_size, S - recent_size). No
// compression ratio: what a layer keeps follows from the pattern (kvpress computes its ratio after
// a forward pass). kvpress masks the dropped keys (no memory saved); here the heads are stored
// head-ragged. kvpress downloads a pattern from the DuoAttention repository for six models, or
// estimates one at run time (on_the_fly_scoring: BookSum, sink 128, recent 256); here the pattern
// is a local folder in the repository's layout: config.json (sink_size, recent_size) and
// full_attention_heads.tsv (scores [L, Hkv], tab-separated, clipped to [0, 1] as kvpress does).
// scripts/make_artifact.py duo-attention computes one by kvpress's on-the-fly recipe.
// A DuoAttention pattern: what a streaming head keeps and every KV head's score.
struct DuoAttentionPattern {
  int64_t sink_size = 0;
  int64_t recent_size = 0;
  at::Tensor head_scores;  // [L, Hkv] float64 in [0, 1], or undefined (no pattern)
};

class DuoAttentionPress : public BasePress {
 public:
  using Pattern = DuoAttentionPattern;

  struct Params {
    double head_compression_ratio = 0.0;
    bool on_the_fly_scoring = false;  // kvpress's run-time estimate; refused here
    std::string attention_pattern;    // a folder for load_pattern; "" (none): every head keeps everything

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"head_compression_ratio", "fraction of the model's KV heads made streaming heads"}.fraction(),
            self.head_compression_ratio);
      visit(ParamSpec{"on_the_fly_scoring",
                      "kvpress: estimate the pattern at run time (here: make it offline, see attention_pattern)"},
            self.on_the_fly_scoring);
      visit(ParamSpec{"attention_pattern", "DuoAttention pattern folder: config.json and full_attention_heads.tsv"}
                .file(),
            self.attention_pattern);
    }
  };

  // Reads params.attention_pattern when set; raises for on_the_fly_scoring (it needs the model and
  // a dataset at run time) and as the constructor below.
  explicit DuoAttentionPress(const Params& params);
  // Raises unless 0 <= head_compression_ratio <= 1 and, with a pattern, sink_size, recent_size >= 0
  // and head_scores 2-d.
  explicit DuoAttentionPress(double head_compression_ratio = 0.0, Pattern pattern = {});

  // A pattern folder: config.json and full_attention_heads.tsv. Raises c10::Error naming the file
  // and what is wrong.
  static Pattern load_pattern(const std::string& folder);

  std::string name() const override { return "DuoAttentionPress"; }
  double compression_ratio() const override { return 0.0; }  // none: each head's kind decides
  bool head_ragged() const override { return true; }
  KV compress(const LayerInputs& inputs) const override;  // raises: use compress_ragged()

  double head_compression_ratio() const { return head_compression_ratio_; }
  const Pattern& pattern() const { return pattern_; }
  // [L, Hkv] bool: the streaming heads.
  const at::Tensor& streaming_heads() const { return streaming_; }

  // [B, Hkv, S] bool: everything, except [sink_size, S - recent_size) of the layer's streaming heads
  // (head_compression_ratio 0: everything, with or without a pattern).
  at::Tensor keep_mask(const LayerInputs& inputs) const override;

 private:
  double head_compression_ratio_;
  Pattern pattern_;
  at::Tensor streaming_;  // [L, Hkv] bool, or undefined without a pattern
};

}  // namespace kvpress
