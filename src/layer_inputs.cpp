// LayerInputs' field list and the cross-field checks of include/kvpress/types.h.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "kvpress/types.h"

namespace kvpress {

std::vector<LayerInputField> layer_input_fields() {
  std::vector<LayerInputField> out;
  const LayerInputs defaults;
  for_each_field(defaults, [&](const LayerInputField& field, const auto&) { out.push_back(field); });
  return out;
}

namespace {

// Collects the number of query heads each source implies and raises when two disagree.
class QueryHeads {
 public:
  QueryHeads(const std::string& op) : op_(op) {}

  void add(int64_t heads, const std::string& source) {
    if (heads_ == 0) {
      heads_ = heads;
      source_ = source;
      return;
    }
    TORCH_CHECK(heads == heads_, op_, ": ", source, " implies ", heads, " query heads but ", source_, " implies ",
                heads_);
  }
  int64_t heads() const { return heads_; }
  const std::string& source() const { return source_; }

 private:
  const std::string& op_;
  int64_t heads_ = 0;
  std::string source_;
};

// Dtype and device of every tensor besides keys and values.
void check_field_types(const LayerInputs& in, const char* op) {
  for_each_field(in, [&](const LayerInputField& field, const auto& member) {
    if constexpr (std::is_same_v<std::decay_t<decltype(member)>, at::Tensor>) {
      if (!member.defined() || field.required) return;
      if (field.integer) {
        TORCH_CHECK(at::isIntegralType(member.scalar_type(), /*includeBool=*/false), op, ": ", field.name,
                    " must be an integer tensor, got ", member.scalar_type());
      } else {
        TORCH_CHECK(at::isFloatingType(member.scalar_type()), op, ": ", field.name,
                    " must be a floating-point tensor, got ", member.scalar_type());
      }
      checks::check_same_device(op, field.name, member, "keys", in.keys);
    }
  });
}

// queries and attentions: [B, Hq, Sq, D] and [B, Hq, Sq, S], 1 <= Sq <= S.
void check_query_rows(const LayerInputs& in, const char* op, QueryHeads& hq) {
  const int64_t B = in.keys.size(0), S = in.keys.size(2), D = in.keys.size(3);
  if (in.queries.defined()) {
    const at::Tensor& q = in.queries;
    TORCH_CHECK(q.dim() == 4 && q.size(0) == B && q.size(2) >= 1 && q.size(2) <= S && q.size(3) == D, op,
                ": queries must be [", B, ", num_heads, Sq, ", D, "] with 1 <= Sq <= ", S, ", got ",
                checks::shape_str(q));
    hq.add(q.size(1), "queries " + checks::shape_str(q));
  }
  if (in.attentions.defined()) {
    const at::Tensor& a = in.attentions;
    TORCH_CHECK(a.dim() == 4 && a.size(0) == B && a.size(2) >= 1 && a.size(2) <= S && a.size(3) == S, op,
                ": attentions must be [", B, ", num_heads, Sq, ", S, "] with 1 <= Sq <= ", S, ", got ",
                checks::shape_str(a));
    hq.add(a.size(1), "attentions " + checks::shape_str(a));
  }
}

// cos/sin [S, D] together, inv_freq [D / 2], input_ids [B, S].
void check_positions(const LayerInputs& in, const char* op) {
  const int64_t B = in.keys.size(0), S = in.keys.size(2), D = in.keys.size(3);
  TORCH_CHECK(in.cos.defined() == in.sin.defined(), op, ": cos and sin come together; only ",
              in.cos.defined() ? "cos" : "sin", " was given");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"cos", &in.cos}, {"sin", &in.sin}}) {
    TORCH_CHECK(!t->defined() || (t->dim() == 2 && t->size(0) == S && t->size(1) == D), op, ": ", name, " must be [", S,
                ", ", D, "] (seq_len, head_dim), got ", checks::shape_str(*t));
  }
  TORCH_CHECK(!in.inv_freq.defined() || (D % 2 == 0 && in.inv_freq.dim() == 1 && in.inv_freq.size(0) == D / 2), op,
              ": inv_freq must be [", D / 2, "] (head_dim / 2), got ", checks::shape_str(in.inv_freq));
  TORCH_CHECK(
      !in.input_ids.defined() || (in.input_ids.dim() == 2 && in.input_ids.size(0) == B && in.input_ids.size(1) == S),
      op, ": input_ids must be [", B, ", ", S, "] (batch, seq_len), got ", checks::shape_str(in.input_ids));
}

// hidden_states and the projections agree on the hidden size; q_proj and o_proj imply Hq.
void check_projections(const LayerInputs& in, const char* op, QueryHeads& hq) {
  const int64_t B = in.keys.size(0), Hkv = in.keys.size(1), S = in.keys.size(2), D = in.keys.size(3);
  int64_t hidden = -1;
  if (in.hidden_states.defined()) {
    const at::Tensor& h = in.hidden_states;
    TORCH_CHECK(h.dim() == 3 && h.size(0) == B && h.size(1) == S && h.size(2) > 0, op, ": hidden_states must be [", B,
                ", ", S, ", hidden_size], got ", checks::shape_str(h));
    hidden = h.size(2);
  }
  const std::string hidden_text = hidden < 0 ? std::string("hidden_size") : std::to_string(hidden);
  if (in.q_proj.defined()) {
    const at::Tensor& w = in.q_proj;
    TORCH_CHECK(w.dim() == 2 && w.size(0) > 0 && w.size(0) % D == 0 && (hidden < 0 || w.size(1) == hidden), op,
                ": q_proj must be [num_heads * ", D, ", ", hidden_text, "], got ", checks::shape_str(w));
    hq.add(w.size(0) / D, "q_proj " + checks::shape_str(w));
    if (hidden < 0) hidden = w.size(1);
  }
  if (in.k_proj.defined()) {
    const at::Tensor& w = in.k_proj;
    TORCH_CHECK(w.dim() == 2 && w.size(0) == Hkv * D && (hidden < 0 || w.size(1) == hidden), op, ": k_proj must be [",
                Hkv * D, ", ", hidden < 0 ? hidden_text : std::to_string(hidden), "], got ", checks::shape_str(w));
    if (hidden < 0) hidden = w.size(1);
  }
  if (in.o_proj.defined()) {
    const at::Tensor& w = in.o_proj;
    TORCH_CHECK(w.dim() == 2 && w.size(1) > 0 && w.size(1) % D == 0 && (hidden < 0 || w.size(0) == hidden), op,
                ": o_proj must be [", hidden < 0 ? hidden_text : std::to_string(hidden), ", num_heads * ", D, "], got ",
                checks::shape_str(w));
    hq.add(w.size(1) / D, "o_proj " + checks::shape_str(w));
  }
  // A bias belongs to its projection: [rows of the weight], and never without it.
  for (const auto& [name, bias, weight] :
       {std::tuple<const char*, const at::Tensor*, const at::Tensor*>{"q_bias", &in.q_bias, &in.q_proj},
        {"k_bias", &in.k_bias, &in.k_proj}}) {
    if (!bias->defined()) continue;
    const char* proj = name[0] == 'q' ? "q_proj" : "k_proj";
    TORCH_CHECK(weight->defined(), op, ": ", name, " needs ", proj, " (the bias of that projection)");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight->size(0), op, ": ", name, " must be [", weight->size(0),
                "] (", proj, "'s rows), got ", checks::shape_str(*bias));
  }
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor*>{"q_norm", &in.q_norm}, {"k_norm", &in.k_norm}}) {
    TORCH_CHECK(!t->defined() || (t->dim() == 1 && t->size(0) == D), op, ": ", name, " must be [", D,
                "] (head_dim), got ", checks::shape_str(*t));
  }
}

}  // namespace

void validate_layer_inputs(const LayerInputs& in, const std::string& op_name) {
  const char* op = op_name.c_str();
  TORCH_CHECK(in.keys.defined(), op, ": keys [batch, kv_heads, seq_len, head_dim] are required but were not given");
  TORCH_CHECK(in.values.defined(), op, ": values [batch, kv_heads, seq_len, head_dim] are required but were not given");
  TORCH_CHECK(in.keys.dim() == 4 && in.keys.size(2) > 0 && in.keys.size(3) > 0, op,
              ": keys must be [batch, kv_heads, seq_len, head_dim] with seq_len, head_dim > 0, got ",
              checks::shape_str(in.keys));
  checks::check_kv(op, in.keys, in.values);
  check_field_types(in, op);

  QueryHeads hq(op_name);
  TORCH_CHECK(in.num_heads >= 0, op, ": num_heads must be >= 0 (0: inferred), got ", in.num_heads);
  if (in.num_heads > 0) hq.add(in.num_heads, "num_heads");
  check_query_rows(in, op, hq);
  check_positions(in, op);
  check_projections(in, op, hq);
  const int64_t Hkv = in.keys.size(1), S = in.keys.size(2);
  TORCH_CHECK(hq.heads() == 0 || hq.heads() % Hkv == 0, op, ": ", hq.source(), " gives ", hq.heads(),
              " query heads, not a multiple of the ", Hkv, " KV heads of keys");
  TORCH_CHECK(in.num_layers >= 1, op, ": num_layers must be >= 1, got ", in.num_layers);
  TORCH_CHECK(in.layer_idx >= 0 && in.layer_idx < in.num_layers, op, ": layer_idx must be in [0, ", in.num_layers,
              "), got ", in.layer_idx);
  TORCH_CHECK(in.question_length >= 0 && in.question_length <= S, op, ": question_length must be in [0, ", S,
              "] (seq_len), got ", in.question_length);
  TORCH_CHECK(std::isfinite(in.norm_eps) && in.norm_eps >= 0, op, ": norm_eps must be a finite number >= 0, got ",
              in.norm_eps);
}

}  // namespace kvpress
