// LlamaModel's tensor-parallel shards (LlamaModel::shard, kvpress/llama/tensor_parallel.h): the
// weights a rank holds, the sums over ranks, and the presses a shard refuses.
#include "kvpress/llama/tensor_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace kvpress::llama {

LlamaModel LlamaModel::shard(const TensorParallelRank& tp) const {
  constexpr const char* op = "LlamaModel::shard";
  TORCH_CHECK(!tp_, op, ": the model is already a shard (rank ", tp_->rank, " of ", tp_->world, ")");
  TORCH_CHECK(tp.world >= 1 && tp.rank >= 0 && tp.rank < tp.world, op, ": rank must be in [0, world), got rank ",
              tp.rank, " of world ", tp.world);
  TORCH_CHECK(tp.exchange != nullptr, op, ": tp.exchange must be set (it sums the partial projections over ranks)");
  const LlamaConfig& c = config_;
  TORCH_CHECK(c.num_kv_heads % tp.world == 0 && c.intermediate_size % tp.world == 0, op, ": the world size (", tp.world,
              ") must divide the KV heads (", c.num_kv_heads, ") and the intermediate size (", c.intermediate_size,
              ")");
  const int64_t d = c.head_dim, kv = c.num_kv_heads / tp.world, q = c.num_heads / tp.world;
  const int64_t inter = c.intermediate_size / tp.world;
  // Rows (dim 0) or columns (dim 1) [first, first + count) of a weight, copied.
  const auto cut = [](const at::Tensor& t, int64_t dim, int64_t first, int64_t count) {
    return t.defined() ? t.narrow(dim, first, count).contiguous() : t;
  };
  LlamaModel out = *this;
  out.config_.num_heads = q;
  out.config_.num_kv_heads = kv;
  out.config_.intermediate_size = inter;
  for (Layer& l : out.layers_) {
    l.q_proj = cut(l.q_proj, 0, tp.rank * q * d, q * d);
    l.k_proj = cut(l.k_proj, 0, tp.rank * kv * d, kv * d);
    l.v_proj = cut(l.v_proj, 0, tp.rank * kv * d, kv * d);
    l.q_bias = cut(l.q_bias, 0, tp.rank * q * d, q * d);
    l.k_bias = cut(l.k_bias, 0, tp.rank * kv * d, kv * d);
    l.v_bias = cut(l.v_bias, 0, tp.rank * kv * d, kv * d);
    l.o_proj = cut(l.o_proj, 1, tp.rank * q * d, q * d);  // o_bias stays whole: added once after the sum
    l.gate_proj = cut(l.gate_proj, 0, tp.rank * inter, inter);
    l.up_proj = cut(l.up_proj, 0, tp.rank * inter, inter);
    l.down_proj = cut(l.down_proj, 1, tp.rank * inter, inter);
  }
  out.tp_ = tp;
  return out;
}

at::Tensor LlamaModel::sum_over_ranks(const at::Tensor& partial) const {
  return tp_ ? tp_->exchange->sum_over_ranks(partial) : partial;
}

KVHeadRange LlamaModel::kv_head_range() const {
  if (!tp_) return {};
  return {tp_->rank * config_.num_kv_heads, tp_->world * config_.num_kv_heads};
}

std::shared_ptr<const HeadExchange> LlamaModel::head_exchange() const {
  return tp_ && tp_->global_budgets ? tp_->exchange : nullptr;
}

void LlamaModel::check_press_on_shard(const BasePress* press, const char* op) const {
  if (!tp_ || press == nullptr) return;
  if (press->needs_second_pass() && press->second_pass_shardable()) return;  // KVComposePress
  const DecodingRole role = press->decoding_role();
  if (role.compresses && !press->needs_second_pass() && press->head_span() != HeadSpan::kWholeLayer) {
    // A press compressing while decoding: every rank's hook sees its heads (and, with global
    // budgets, the exchange) at the same steps; its scorer and its prefill part must shard.
    TORCH_CHECK(!role.evicts_per_head, op, ": on a tensor-parallel shard, ", press->name(),
                " cannot run yet: it evicts per head while decoding");
    for (const BasePress* part : {role.scorer, press->prefill_press()}) {
      if (part == nullptr || part == press) continue;
      const std::string why = distributed::why_not_sharded(*part);
      TORCH_CHECK(why.empty(), op, ": on a tensor-parallel shard, ", press->name(), "'s ", why);
    }
    return;
  }
  const std::string why = distributed::why_not_sharded(*press);
  TORCH_CHECK(why.empty(), op, ": on a tensor-parallel shard, ", why);
}

LlamaModel tensor_parallel_shard(const LlamaModel& model, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                 distributed::BudgetMode budgets) {
  TORCH_CHECK(group, "tensor_parallel_shard: group must not be null");
  const LlamaConfig& c = model.config();
  std::ostringstream mine;
  mine << c.num_layers << " layers, " << c.num_heads << " heads, " << c.num_kv_heads << " KV heads, hidden "
       << c.hidden_size << ", " << model.dtype() << ", " << distributed::budget_mode_name(budgets) << " budgets";
  distributed::check_agreement(group,
                               {{"layers", static_cast<double>(c.num_layers)},
                                {"heads", static_cast<double>(c.num_heads)},
                                {"KV heads", static_cast<double>(c.num_kv_heads)},
                                {"head_dim", static_cast<double>(c.head_dim)},
                                {"hidden size", static_cast<double>(c.hidden_size)},
                                {"intermediate size", static_cast<double>(c.intermediate_size)},
                                {"vocabulary", static_cast<double>(c.vocab_size)},
                                {"dtype", static_cast<double>(model.dtype())},
                                {"budget mode", static_cast<double>(budgets)},
                                {"world size", static_cast<double>(group->getSize())}},
                               "tensor_parallel_shard", mine.str());
  TensorParallelRank tp;
  tp.rank = group->getRank();
  tp.world = group->getSize();
  tp.exchange = distributed::group_head_exchange(group, "tensor-parallel model");
  tp.global_budgets = budgets == distributed::BudgetMode::kGlobal;
  return model.shard(tp);
}

}  // namespace kvpress::llama
