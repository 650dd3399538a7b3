// kvpress::distributed (kvpress/distributed.h): the Gloo group, head shards, the setup check, and
// the two budget modes (global: the head exchange presses that span heads call). Compiled with USE_C10D_GLOO, which
// ProcessGroupGloo.hpp needs; gloo's headers come from Debian's libgloo-dev (scripts/setup.sh) and only declare what
// libtorch_cpu defines.
#include "kvpress/distributed.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <ATen/ATen.h>

#include "distributed/wait_for.h"
#include "layer_slices.h"

#include <functional>
#include <mutex>
#include <sstream>
#include <vector>

namespace kvpress::distributed {
namespace {

// The ranks whose fields differ from this rank's, e.g. "rank 1: compression ratio 0.25 (here 0.5)".
std::string differing_ranks(const std::vector<at::Tensor>& all, const at::Tensor& mine,
                            const std::vector<std::pair<std::string, double>>& fields) {
  std::ostringstream out;
  for (size_t r = 0; r < all.size(); ++r) {
    if (at::equal(all[r], mine)) continue;
    out << (out.tellp() > 0 ? "; " : "") << "rank " << r << ":";
    for (int64_t f = 0; f < mine.numel(); ++f)
      if (all[r][f].item<double>() != mine[f].item<double>())
        out << " " << fields[static_cast<size_t>(f)].first << " " << all[r][f].item<double>() << " (here "
            << mine[f].item<double>() << ")";
  }
  return out.str();
}

// "<owner>: rank r of w", what an error of a rank's collective starts with.
std::string rank_of(const std::string& owner, const c10d::ProcessGroup& group) {
  return owner + ": rank " + std::to_string(group.getRank()) + " of " + std::to_string(group.getSize());
}

// The head exchange of one rank in global mode: all-gathers and all-reduces over the group, counted.
class GroupHeadExchange final : public HeadExchange {
 public:
  GroupHeadExchange(c10::intrusive_ptr<c10d::ProcessGroup> group, const std::string& owner)
      : group_(std::move(group)), who_(rank_of(owner, *group_)) {}

  at::Tensor gather_heads(const at::Tensor& local) const override {
    std::vector<std::vector<at::Tensor>> gathered(1);
    for (int64_t r = 0; r < group_->getSize(); ++r)
      gathered[0].push_back(at::empty_like(local, at::MemoryFormat::Contiguous));
    std::vector<at::Tensor> input{local.contiguous()};
    counted(
        input[0], [&] { return group_->allgather(gathered, input); }, "an all-gather of per-head scores");
    return at::cat(gathered[0], 1);
  }

  at::Tensor sum_over_ranks(const at::Tensor& partial) const override {
    return all_reduce(partial, c10d::ReduceOp::SUM, "an all-reduce (sum)");
  }
  at::Tensor max_over_ranks(const at::Tensor& partial) const override {
    return all_reduce(partial, c10d::ReduceOp::MAX, "an all-reduce (maximum)");
  }

  ExchangeStats stats() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

 private:
  at::Tensor all_reduce(const at::Tensor& partial, c10d::ReduceOp::RedOpType reduce, const char* step) const {
    std::vector<at::Tensor> tensors{partial.clone(at::MemoryFormat::Contiguous)};  // reduced in place
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp(reduce);
    counted(
        tensors[0], [&] { return group_->allreduce(tensors, options); }, step);
    return tensors[0];
  }

  // Runs one collective whose payload on this rank is `payload`, and counts it.
  void counted(const at::Tensor& payload, const std::function<c10::intrusive_ptr<c10d::Work>()>& start,
               const char* step) const {
    const auto t0 = std::chrono::steady_clock::now();
    detail::run_operation(start, who_, step);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto bytes = static_cast<int64_t>(payload.nbytes());
    const std::lock_guard<std::mutex> lock(mutex_);
    stats_.collectives += 1;
    stats_.bytes_sent += bytes;
    stats_.bytes_received += (group_->getSize() - 1) * bytes;
    stats_.seconds += seconds;
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string who_;  // "ShardedPress: rank 1 of 4", what its errors start with
  mutable std::mutex mutex_;
  mutable ExchangeStats stats_;
};

void check_rank_in_world(const char* op, int64_t rank, int64_t world) {
  TORCH_CHECK(world > 0 && rank >= 0 && rank < world, op, ": rank must be in [0, world), got rank ", rank, " of world ",
              world);
}

}  // namespace

const char* budget_mode_name(BudgetMode mode) { return mode == BudgetMode::kPerRank ? "per_rank" : "global"; }

void check_agreement(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                     const std::vector<std::pair<std::string, double>>& fields, const std::string& owner,
                     const std::string& mine_text) {
  std::vector<double> values;
  for (const auto& field : fields) values.push_back(field.second);
  const at::Tensor mine = at::tensor(values, at::kDouble);
  std::vector<std::vector<at::Tensor>> gathered(1);
  for (int64_t r = 0; r < group->getSize(); ++r) gathered[0].push_back(at::empty_like(mine));
  std::vector<at::Tensor> input{mine.clone()};
  detail::run_operation([&] { return group->allgather(gathered, input); }, rank_of(owner, *group),
                        "the setup's all-gather");
  const std::string differ = differing_ranks(gathered[0], mine, fields);
  TORCH_CHECK(differ.empty(), owner, ": rank ", group->getRank(), " (", mine_text, ") differs from: ", differ);
}

std::shared_ptr<const HeadExchange> group_head_exchange(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                        const std::string& owner) {
  TORCH_CHECK(group, "group_head_exchange: group must not be null");
  return std::make_shared<GroupHeadExchange>(group, owner);
}

std::string why_not_sharded(const BasePress& press) {
  if (press.head_span() == HeadSpan::kWholeLayer)
    return press.name() +
           " cannot be sharded across ranks: its scores need every head of the layer in a way it does not exchange "
           "(head_span whole_layer)";
  if (press.needs_second_pass() || press.decoding_role().compresses || press.prefill_press() != &press)
    return press.name() +
           " cannot be sharded across ranks yet: it needs a second pass over the model or compresses while decoding; "
           "a shard compresses one layer at prefill";
  return "";
}

HeadShard head_shard(int64_t kv_heads, int64_t rank, int64_t world) {
  check_rank_in_world("head_shard", rank, world);
  TORCH_CHECK(kv_heads > 0 && kv_heads % world == 0, "head_shard: the world size (", world,
              ") must divide kv_heads, got kv_heads ", kv_heads);
  return HeadShard{rank, world, kv_heads};
}

LayerInputs rank_share(const LayerInputs& layer, const HeadShard& shard) {
  constexpr const char* op = "rank_share";
  TORCH_CHECK(layer.keys.defined() && layer.keys.dim() == 4 && layer.keys.size(1) == shard.kv_heads, op,
              ": keys must hold the layer's ", shard.kv_heads, " KV heads ([B, ", shard.kv_heads, ", S, D]), got ",
              layer.keys.defined() ? layer.keys.sizes() : at::IntArrayRef{});
  const int64_t heads = known_num_heads(layer), d = layer.keys.size(3);
  TORCH_CHECK(heads > 0 && heads % shard.kv_heads == 0, op,
              ": the number of query heads must be known (num_heads, queries, attentions or q_proj) and a multiple "
              "of kv_heads ",
              shard.kv_heads, ", got ", heads);
  const int64_t groups = heads / shard.kv_heads, kv_first = shard.first(), kv_count = shard.count();
  const int64_t q_first = kv_first * groups, q_count = kv_count * groups;
  const auto cut = [](const at::Tensor& t, int64_t dim, int64_t first, int64_t count) {
    return t.defined() ? t.narrow(dim, first, count).contiguous() : t;
  };
  LayerInputs local = layer;
  local.keys = cut(layer.keys, 1, kv_first, kv_count);
  local.values = cut(layer.values, 1, kv_first, kv_count);
  local.queries = cut(layer.queries, 1, q_first, q_count);
  local.attentions = cut(layer.attentions, 1, q_first, q_count);
  local.q_proj = cut(layer.q_proj, 0, q_first * d, q_count * d);
  local.q_bias = cut(layer.q_bias, 0, q_first * d, q_count * d);
  local.k_proj = cut(layer.k_proj, 0, kv_first * d, kv_count * d);
  local.k_bias = cut(layer.k_bias, 0, kv_first * d, kv_count * d);
  local.o_proj = cut(layer.o_proj, 1, q_first * d, q_count * d);
  local.num_heads = q_count;
  return local;
}

c10::intrusive_ptr<c10d::ProcessGroup> gloo_group(const std::string& store_path, int rank, int world,
                                                  std::chrono::milliseconds timeout) {
  check_rank_in_world("gloo_group", rank, world);
  TORCH_CHECK(timeout.count() > 0, "gloo_group: timeout must be > 0 ms, got ", timeout.count());
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, world);
  store->setTimeout(timeout);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  // torch's flight recorder (FlightRecorder::recordWithResetEnabled, torch 2.11) enters a group in
  // its process-wide table at the group's first collective without taking its own lock, so ranks
  // that are threads of one process would race there (a lost table node, LeakSanitizer saw it; or a
  // corrupted table). The group's first collective is therefore this barrier, enqueued (Gloo enqueues
  // on the caller's thread without waiting for peers) under one process-wide lock; its wait, which
  // needs the other ranks, is not. When gloo_group returns, every rank of the world has entered.
  static std::mutex first_collective;
  c10::intrusive_ptr<c10d::Work> barrier;
  {
    const std::lock_guard<std::mutex> lock(first_collective);
    barrier = detail::start_operation([&] { return backend->barrier(); }, rank_of("gloo_group", *group),
                                      "the group's first barrier");
  }
  detail::wait_for(barrier, rank_of("gloo_group", *group), "the group's first barrier");
  return group;
}

#ifndef KVPRESS_WITH_CUDA
c10::intrusive_ptr<c10d::ProcessGroup> nccl_group(const std::string&, int, int, std::chrono::milliseconds) {
  TORCH_CHECK(false, "nccl_group: this kvpress-cpp was built without CUDA (KVPRESS_WITH_CUDA=OFF); use gloo_group");
}
#endif

ShardedPress::ShardedPress(std::shared_ptr<const BasePress> press, c10::intrusive_ptr<c10d::ProcessGroup> group,
                           int64_t kv_heads, BudgetMode mode)
    : press_(std::move(press)), group_(std::move(group)), mode_(mode) {
  TORCH_CHECK(press_ != nullptr, "ShardedPress: press must not be null");
  TORCH_CHECK(group_, "ShardedPress: group must not be null");
  shard_ = head_shard(kv_heads, group_->getRank(), group_->getSize());
  // The press's name (as a hash), its compression ratio, the mode, the layer's KV heads, the world.
  const auto name_hash = static_cast<double>(std::hash<std::string>{}(press_->name()) % (uint64_t{1} << 52));
  std::ostringstream mine;
  mine << press_->name() << ", ratio " << press_->compression_ratio() << ", " << budget_mode_name(mode_)
       << ", kv_heads " << kv_heads;
  check_agreement(group_,
                  {{"press name", name_hash},
                   {"compression ratio", press_->compression_ratio()},
                   {"budget mode", static_cast<double>(mode_)},
                   {"kv_heads", static_cast<double>(kv_heads)},
                   {"world size", static_cast<double>(shard_.world)}},
                  "ShardedPress", mine.str());
  // Every rank made the same press, so every rank raises the same here.
  const std::string why = why_not_sharded(*press_);
  TORCH_CHECK(why.empty(), "ShardedPress: ", why);
  if (mode_ == BudgetMode::kGlobal) exchange_ = group_head_exchange(group_, "ShardedPress");
}

ExchangeStats ShardedPress::exchange_stats() const {
  return exchange_ ? static_cast<const GroupHeadExchange&>(*exchange_).stats() : ExchangeStats{};
}

LayerInputs ShardedPress::share(const LayerInputs& local, const char* op) const {
  TORCH_CHECK(local.keys.defined() && local.keys.dim() == 4 && local.keys.size(1) == shard_.count(), op,
              ": keys must hold this rank's ", shard_.count(), " KV heads ([B, ", shard_.count(), ", S, D]), got ",
              local.keys.defined() ? local.keys.sizes() : at::IntArrayRef{});
  TORCH_CHECK(!local.head_exchange && local.kv_head_range.first == 0 && local.kv_head_range.layer_kv_heads == 0, op,
              ": local.head_exchange and local.kv_head_range must be unset (the ShardedPress sets them)");
  LayerInputs share = local;
  share.kv_head_range = {shard_.first(), shard_.kv_heads};
  share.head_exchange = exchange_;
  return share;
}

KV ShardedPress::compress(const LayerInputs& local) const {
  return press_->compress(share(local, "ShardedPress.compress"));
}

RaggedKV ShardedPress::compress_ragged(const LayerInputs& local) const {
  return press_->compress_ragged(share(local, "ShardedPress.compress_ragged"));
}

}  // namespace kvpress::distributed
