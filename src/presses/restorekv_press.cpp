// RestoreKVPress: KVzip with restore tokens (include/kvpress/presses/restorekv_press.h).
#include "kvpress/presses/restorekv_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "checks.h"
#include "kvpress/io/safetensors.h"
#include "presses/registration.h"

namespace kvpress {

namespace {
constexpr const char* kPress = "RestoreKVPress";
}  // namespace

RestoreKVPress::RestoreKVPress(double compression_ratio, const Params& params)
    : RestoreKVPress(compression_ratio, params.layerwise, params.n_sink, params.kvzip_plus_normalization,
                     params.chunk_size, params.restore.empty() ? Restore{} : load_restore(params.restore)) {}

RestoreKVPress::RestoreKVPress(double compression_ratio, bool layerwise, int64_t n_sink, bool kvzip_plus_normalization,
                               int64_t chunk_size, Restore restore)
    : KVzipPress(compression_ratio, layerwise, n_sink, kvzip_plus_normalization, chunk_size),
      restore_(std::move(restore)) {
  if (!restore_.defined()) return;
  const at::Tensor& e = restore_.embeddings;
  TORCH_CHECK(e.dim() == 2 && e.size(0) > 0 && e.size(1) > 0 && at::isFloatingType(e.scalar_type()), kPress,
              ": restore embeddings must be a non-empty floating [n, hidden] tensor, got ", checks::shape_str(e), " ",
              e.scalar_type());
  TORCH_CHECK(at::isfinite(e).all().item<bool>(), kPress, ": restore embeddings must be finite");
  restore_.embeddings = e.to(at::kFloat).contiguous();
}

RestoreKVPress::Restore RestoreKVPress::load_restore(const std::string& dir) {
  const std::string path = dir + "/" + kEmbeddingsFile;
  const io::SafetensorsFile file = io::load_safetensors(path);
  Restore r;
  r.embeddings = io::required_tensor(file, kEmbeddingsKey, std::string(kPress) + ": " + path);
  r.adapter = LoraAdapter::load_peft(dir);
  return r;
}

const RestoreKVPress::Restore& RestoreKVPress::restore() const {
  TORCH_CHECK(restore_.defined(), kPress,
              ": no restore artifacts: give restore=DIR, a local copy of the authors' adapter repository "
              "(higokri/RestoreKV-<model>",
              kvzip_plus_normalization() ? "_plus" : "",
              ", which kvpress would download): restore_embeddings.safetensors, adapter_config.json and "
              "adapter_model.safetensors");
  return restore_;
}

double RestoreKVPress::eviction_ratio(int64_t context_length) const {
  const double ratio = compression_ratio();
  if (ratio == 0.0 || context_length <= 0) return ratio;
  // kvpress: compression_ratio = min(1.0, requested + n / context_length), in Python floats.
  return std::min(1.0, ratio + static_cast<double>(num_restore_tokens()) / static_cast<double>(context_length));
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "RestoreKVPress",
      PressKind::kSecondPass,
      "KVzip plus learned restore tokens: run once over the full cache with a LoRA adapter, they take the place of "
      "as many evicted tokens per head",
      {{},
       {},
       {},
       "the context replayed after a repeat prompt, and the restore tokens' pass with the adapter "
       "(kvpress::llama::kvzip_prefill)"},
      from_params<RestoreKVPress>};
});

}  // namespace

}  // namespace kvpress
