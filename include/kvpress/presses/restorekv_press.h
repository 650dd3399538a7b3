// RestoreKVPress (kvpress 0.5.5 restorekv_press.py; RestoreKV, arXiv 2608.01247): KVzip plus n
// learned "restore tokens" that summarise what eviction removes.
//
// After KVzip has scored the context (its replay), n restore tokens (learned input embeddings,
// n = 8 in the authors' adapters) run through the model ONCE with a LoRA adapter active: they sit at
// positions N .. N + n - 1 and attend to the full, uncompressed cache of the context (and causally
// to each other). Their keys/values join every layer's cache. Then KVzip evicts with the budget
// matched: the ratio becomes min(1, compression_ratio + n / N), so the n restore tokens per head take
// the place of n evicted context tokens per head, and are never evicted themselves. The adapter is
// used for that one pass only; later tokens (questions, answers) start at position N + n, as in
// kvpress's pipeline.
//
// The artifacts: kvpress downloads the authors' `higokri/RestoreKV-<model>[_plus]` (restore
// embeddings trained with the adapter by self-distillation from the full-cache model; the _plus
// variant for kvzip_plus_normalization). Here `restore` is a local copy of such a folder:
//   restore_embeddings.safetensors   restore_embeddings [n, hidden]
//   adapter_config.json, adapter_model.safetensors   a PEFT LoRA adapter (kvpress/lora.h)
// Without it the press still builds (kvpress's fields) but raises when it has to run.
// scripts/make_artifact.py restorekv trains such a folder for a model (self-distillation).
//
// kvpress::llama::restorekv_prefill (kvpress/llama/kvzip.h) runs it on the Llama runner with KVzip's
// memory bound (the compressed cache plus one layer's full keys/values; the restore tokens' n keys
// and values per layer on top). Batch 1 only, as kvpress.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "kvpress/lora.h"
#include "kvpress/presses/kvzip_press.h"

namespace kvpress {

class RestoreKVPress : public KVzipPress {
 public:
  // The authors' folder layout (their hub repositories).
  static constexpr const char* kEmbeddingsFile = "restore_embeddings.safetensors";
  static constexpr const char* kEmbeddingsKey = "restore_embeddings";

  struct Restore {
    at::Tensor embeddings;  // [n, hidden] float32: the restore tokens' input embeddings
    LoraAdapter adapter;    // active for the restore pass only
    bool defined() const { return embeddings.defined(); }
  };

  // KVzipPress's parameters and the folder of the restore artifacts.
  struct Params : KVzipPress::Params {
    std::string restore;  // read by load_restore; "" (none): compress() raises

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      KVzipPress::Params::for_each_field(self, visit);
      visit(ParamSpec{"restore",
                      "folder with restore_embeddings.safetensors and a PEFT LoRA adapter (the authors' "
                      "higokri/RestoreKV-<model>[_plus], or scripts/make_artifact.py restorekv)"}
                .file(),
            self.restore);
    }
  };

  // Reads params.restore when set (load_restore); raises as the constructor below.
  RestoreKVPress(double compression_ratio, const Params& params);
  // Raises as KVzipPress, and when the restore embeddings (if given) are not a non-empty [n, hidden].
  explicit RestoreKVPress(double compression_ratio = 0.0, bool layerwise = kDefaultLayerwise,
                          int64_t n_sink = kDefaultNSink,
                          bool kvzip_plus_normalization = kDefaultKVzipPlusNormalization,
                          int64_t chunk_size = kDefaultChunkSize, Restore restore = {});

  // <dir>/restore_embeddings.safetensors and the PEFT adapter in <dir>. Raises naming the file.
  static Restore load_restore(const std::string& dir);

  std::string name() const override { return "RestoreKVPress"; }
  // kvpress's adapter name for the variant (restorekv / restorekv_plus).
  std::string adapter_name() const { return kvzip_plus_normalization() ? "restorekv_plus" : "restorekv"; }
  // n: 0 without artifacts, as kvpress before it has loaded them.
  int64_t num_restore_tokens() const { return restore_.defined() ? restore_.embeddings.size(0) : 0; }
  // The artifacts; raises (how to give them) when there are none.
  const Restore& restore() const;

  // Budget matching: min(1, compression_ratio + n / context_length) (compression_ratio at ratio 0).
  double eviction_ratio(int64_t context_length) const override;
  // KVzip's pass with the restore tokens riding the scoring pass (kvpress/presses/kvzip_press.h).
  KVzipPassResult run_second_pass(SecondPassRun& run, const KVzipRunOptions& options) const override;

 private:
  Restore restore_;
};

}  // namespace kvpress
