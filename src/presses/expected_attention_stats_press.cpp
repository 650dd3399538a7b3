#include "kvpress/presses/expected_attention_stats_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <utility>

#include "checks.h"
#include "head_exchange.h"
#include "kvpress/io/safetensors.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

constexpr const char* kName = "ExpectedAttentionStatsPress";

void check_statistics(const std::string& where, const ExpectedAttentionStatsPress::Statistics& s) {
  const at::Tensor& mean = s.query_mean;
  const at::Tensor& cov = s.query_cov;
  TORCH_CHECK(mean.defined() && cov.defined(), where, ": query_mean and query_cov must both be given");
  TORCH_CHECK(mean.dim() == 3 && at::isFloatingType(mean.scalar_type()), where,
              ": query_mean must be a float [num_layers, num_heads, head_dim] tensor, got ", checks::shape_str(mean));
  const int64_t d = mean.size(2);
  TORCH_CHECK(cov.dim() == 4 && at::isFloatingType(cov.scalar_type()) && cov.size(0) == mean.size(0) &&
                  cov.size(1) == mean.size(1) && cov.size(2) == d && cov.size(3) == d,
              where, ": query_cov must be a float [", mean.size(0), ", ", mean.size(1), ", ", d, ", ", d,
              "] tensor to match query_mean, got ", checks::shape_str(cov));
}

}  // namespace

ExpectedAttentionStatsPress::ExpectedAttentionStatsPress(double compression_ratio, const Params& params)
    : ExpectedAttentionStatsPress(compression_ratio,
                                  params.stats_folder.empty() ? Statistics{} : load_statistics(params.stats_folder),
                                  params.n_future_positions, params.n_sink, params.use_covariance, params.use_vnorm,
                                  params.epsilon, params.sample_seq_len, params.num_samples, params.dataset_name) {}

ExpectedAttentionStatsPress::ExpectedAttentionStatsPress(double compression_ratio, Statistics statistics,
                                                         int64_t n_future_positions, int64_t n_sink,
                                                         bool use_covariance, bool use_vnorm, double epsilon,
                                                         int64_t sample_seq_len, int64_t num_samples,
                                                         std::string dataset_name)
    : ExpectedAttentionPress(compression_ratio, n_future_positions, n_sink, use_covariance, use_vnorm, epsilon),
      sample_seq_len_(sample_seq_len),
      num_samples_(num_samples),
      dataset_name_(std::move(dataset_name)) {
  check_params(kName, Params{{n_future_positions, n_sink, use_covariance, use_vnorm, epsilon},
                             sample_seq_len,
                             num_samples,
                             dataset_name_,
                             {}});
  if (statistics.query_mean.defined() || statistics.query_cov.defined()) {
    check_statistics(kName, statistics);
    statistics_ = {statistics.query_mean.to(at::kFloat).contiguous(), statistics.query_cov.to(at::kFloat).contiguous()};
  }
}

ExpectedAttentionStatsPress::Statistics ExpectedAttentionStatsPress::load_statistics(const std::string& stats_folder) {
  const std::string path = stats_folder + "/model.safetensors";
  const io::SafetensorsFile file = io::load_safetensors(path);
  const std::string where = std::string(kName) + ": " + path;
  const Statistics s{io::required_tensor(file, "query_mean", where), io::required_tensor(file, "query_cov", where)};
  check_statistics(where, s);
  return {s.query_mean.to(at::kFloat).contiguous(), s.query_cov.to(at::kFloat).contiguous()};
}

at::Tensor ExpectedAttentionStatsPress::score(const LayerInputs& in) const {
  constexpr const char* op = "ExpectedAttentionStatsPress.score";
  checks::check_kv(op, in.keys, in.values);
  const at::Tensor& mean = statistics_.query_mean;
  TORCH_CHECK(mean.defined(), op,
              ": no query statistics: give stats_folder=DIR, a folder whose model.safetensors holds query_mean "
              "[num_layers, num_heads, head_dim] and query_cov [num_layers, num_heads, head_dim, head_dim] (kvpress's "
              "ExpectedAttentionStats.save_pretrained; scripts/make_artifact.py expected-attention-stats writes one). "
              "kvpress would download exp_att_stats_<model>_",
              dataset_name_, "_", num_samples_, "_", sample_seq_len_, "_", n_sink(), " from the Hugging Face hub");
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2), d = in.keys.size(3);
  TORCH_CHECK(seq > n_sink(), op, ": seq_len must be > n_sink (", n_sink(), "), got ", seq);
  TORCH_CHECK(d % 2 == 0, op, ": head_dim must be even for RoPE, got ", d);
  const int64_t layers = mean.size(0), heads = mean.size(1);
  TORCH_CHECK(in.layer_idx >= 0 && in.layer_idx < layers, op, ": layer_idx must be in [0, ", layers,
              ") (the statistics' layers), got ", in.layer_idx);
  TORCH_CHECK(mean.size(2) == d, op, ": the statistics' head_dim ", mean.size(2), " must match keys ",
              checks::shape_str(in.keys));
  const int64_t layer_kv_heads = head_exchange::layer_kv_heads(in);
  checks::check_gqa(op, heads, layer_kv_heads);
  // The statistics of the query heads `in` holds.
  const int64_t group = heads / layer_kv_heads, own = kv_heads * group;
  const at::Device device = in.keys.device();
  const at::Tensor mu =
      head_exchange::own_rows(op, "query_mean", mean[in.layer_idx], 0, in, group).to(device).expand({batch, own, d});
  const at::Tensor cov =
      use_covariance() ? head_exchange::own_rows(op, "query_cov", statistics_.query_cov[in.layer_idx], 0, in, group)
                             .to(device)
                             .expand({batch, own, d, d})
                       : at::Tensor();
  return score_from_statistics(in, mu, cov);
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"ExpectedAttentionStatsPress",
                    PressKind::kScorer,
                    "expected attention from query statistics computed once for the model (read from stats_folder)",
                    {{{{"inv_freq"}}, {{"cos", "sin"}}}, {}, {"layer_idx"}},
                    from_params<ExpectedAttentionStatsPress>};
});

}  // namespace

}  // namespace kvpress
