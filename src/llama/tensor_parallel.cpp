// LlamaModel's tensor-parallel shards (LlamaModel::shard, kvpress/llama/tensor_parallel.h): the
// weights a rank holds, the sums over ranks, and the presses a shard refuses.
#include "kvpress/llama/tensor_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <sstream>
#include <utility>

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
  LlamaModel out = *this;
  out.config_.num_heads = c.num_heads / tp.world;
  out.config_.num_kv_heads = c.num_kv_heads / tp.world;
  out.config_.intermediate_size = c.intermediate_size / tp.world;
  out.tp_ = tp;
  // Rows (dim 0) or columns (dim 1) of the shard's block of a weight, copied.
  const auto cut = [&out](const at::Tensor& t, const char* module) {
    const ShardBlock b = out.shard_block(module);
    return t.defined() ? t.narrow(b.dim, b.first, b.count).contiguous() : t;
  };
  for (Layer& l : out.layers_) {
    for (auto [weight, module] : {std::pair{&l.q_proj, "q_proj"},
                                  {&l.q_bias, "q_proj"},
                                  {&l.k_proj, "k_proj"},
                                  {&l.k_bias, "k_proj"},
                                  {&l.v_proj, "v_proj"},
                                  {&l.v_bias, "v_proj"},
                                  {&l.o_proj, "o_proj"},
                                  {&l.gate_proj, "gate_proj"},
                                  {&l.up_proj, "up_proj"},
                                  {&l.down_proj, "down_proj"}})
      *weight = cut(*weight, module);  // o_bias stays whole: added once after the sum
  }
  return out;
}

LlamaModel::ShardBlock LlamaModel::shard_block(const std::string& module) const {
  TORCH_CHECK(tp_, "LlamaModel::shard_block: the model is not a shard");
  const int64_t d = config_.head_dim, rank = tp_->rank;
  const int64_t q = config_.num_heads * d, kv = config_.num_kv_heads * d, inter = config_.intermediate_size;
  if (module == "q_proj") return {0, rank * q, q};
  if (module == "k_proj" || module == "v_proj") return {0, rank * kv, kv};
  if (module == "o_proj") return {1, rank * q, q};
  if (module == "gate_proj" || module == "up_proj") return {0, rank * inter, inter};
  TORCH_CHECK(module == "down_proj", "LlamaModel::shard_block: no projection '", module, "'");
  return {1, rank * inter, inter};
}

std::optional<LoraLinear> LlamaModel::lora_update(const LoraAdapter* lora, int64_t layer, const char* module) const {
  const LoraLinear* update = lora ? lora->find(layer, module) : nullptr;
  if (update == nullptr) return std::nullopt;
  if (!tp_) return *update;
  const ShardBlock block = shard_block(module);
  LoraLinear part = *update;
  // B's rows make the block's outputs; A's columns read the block's inputs (a partial sum).
  if (block.dim == 0)
    part.b = update->b.narrow(0, block.first, block.count);
  else
    part.a = update->a.narrow(1, block.first, block.count);
  return part;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The ranks' sum of partial projection outputs as autograd sees it: each rank's partial gets the
// gradient of the sum, which every rank holds whole (the loss is the same on every rank).
struct SumOfPartials : torch::autograd::Function<SumOfPartials> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& partial, const HeadExchange* exchange) {
    return exchange->sum_over_ranks(partial);
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

// A whole input entering a rank's block of projections: the identity (a copy), whose gradient is
// the sum over the ranks of what each rank's projections give back. Every rank's backward reaches it
// in the same order (the same graph), so the all-reduces pair up.
struct IntoShard : torch::autograd::Function<IntoShard> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& whole, const HeadExchange* exchange) {
    ctx->saved_data["exchange"] = reinterpret_cast<int64_t>(exchange);  // the model outlives its graphs
    return whole.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* exchange = reinterpret_cast<const HeadExchange*>(ctx->saved_data["exchange"].toInt());
    return {exchange->sum_over_ranks(grads[0].contiguous()), at::Tensor()};
  }
};

bool recording(const at::Tensor& t) { return at::GradMode::is_enabled() && t.requires_grad(); }

}  // namespace

at::Tensor LlamaModel::sum_over_ranks(const at::Tensor& partial) const {
  if (!tp_) return partial;
  return recording(partial) ? SumOfPartials::apply(partial, tp_->exchange.get())
                            : tp_->exchange->sum_over_ranks(partial);
}

at::Tensor LlamaModel::into_shard(const at::Tensor& whole) const {
  return tp_ && recording(whole) ? IntoShard::apply(whole, tp_->exchange.get()) : whole;
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
    // (DMSPress's per-head evictions need nothing from other ranks' heads.)
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
