// HeadRaggedLayer / HeadRaggedCache (include/kvpress/cache.h): packed per-head kept tokens plus a
// dense tail for appended tokens.
#include "kvpress/cache.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <string>

#include "checks.h"
#include "kvpress/ops.h"

namespace kvpress {
namespace {

constexpr const char* kFromRagged = "HeadRaggedLayer::from_ragged";

// Host copy of an int64 offsets tensor.
std::vector<int64_t> to_host_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU).contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

}  // namespace

// ---- construction -------------------------------------------------------------------------------

HeadRaggedLayer HeadRaggedLayer::from_ragged(const RaggedKV& kv, int64_t seq_len) {
  TORCH_CHECK(kv.batch > 0 && kv.kv_heads > 0, kFromRagged, ": batch and kv_heads must be > 0, got ", kv.batch, " and ",
              kv.kv_heads);
  TORCH_CHECK(static_cast<int64_t>(kv.heads.size()) == kv.batch * kv.kv_heads, kFromRagged,
              ": heads must hold batch * kv_heads = ", kv.batch * kv.kv_heads, " entries, got ", kv.heads.size());
  const HeadKV& first = kv.heads.front();
  checks::check_rank(kFromRagged, "heads[0].keys", first.keys, 2, "[n_kept, head_dim]");
  checks::check_float(kFromRagged, "heads[0].keys", first.keys);
  const int64_t dim = first.keys.size(1);
  TORCH_CHECK(dim > 0, kFromRagged, ": head_dim must be > 0, got ", dim);
  const at::ScalarType dtype = first.keys.scalar_type();
  const at::Device device = first.keys.device();

  std::vector<at::Tensor> keys, values, positions;
  std::vector<int64_t> offsets{0};
  keys.reserve(kv.heads.size());
  values.reserve(kv.heads.size());
  positions.reserve(kv.heads.size());
  for (size_t i = 0; i < kv.heads.size(); ++i) {
    const HeadKV& head = kv.heads[i];
    const std::string where = "heads[" + std::to_string(i) + "]";
    TORCH_CHECK(head.keys.defined() && head.values.defined() && head.kept_indices.defined(), kFromRagged, ": ", where,
                " must have keys, values and kept_indices");
    TORCH_CHECK(head.keys.dim() == 2 && head.keys.size(1) == dim, kFromRagged, ": ", where, ".keys must be [n_kept, ",
                dim, "], got ", checks::shape_str(head.keys));
    TORCH_CHECK(head.values.sizes() == head.keys.sizes(), kFromRagged, ": ", where,
                ".values must have the shape of its keys ", checks::shape_str(head.keys), ", got ",
                checks::shape_str(head.values));
    TORCH_CHECK(head.keys.scalar_type() == dtype && head.values.scalar_type() == dtype, kFromRagged, ": ", where,
                " keys and values must be ", dtype, " like heads[0], got ", head.keys.scalar_type(), " and ",
                head.values.scalar_type());
    TORCH_CHECK(head.keys.device() == device && head.values.device() == device && head.kept_indices.device() == device,
                kFromRagged, ": ", where, " must be on ", device, " like heads[0]");
    TORCH_CHECK(head.kept_indices.dim() == 1 && head.kept_indices.size(0) == head.keys.size(0) &&
                    head.kept_indices.scalar_type() == at::kLong,
                kFromRagged, ": ", where, ".kept_indices must be int64 [", head.keys.size(0), "], got ",
                head.kept_indices.scalar_type(), " ", checks::shape_str(head.kept_indices));
    keys.push_back(head.keys);
    values.push_back(head.values);
    positions.push_back(head.kept_indices);
    offsets.push_back(offsets.back() + head.keys.size(0));
  }

  HeadRaggedLayer layer(kv.batch, kv.kv_heads, dim);
  // One allocation of exactly T rows each: the memory the layer keeps.
  layer.packed_keys_ = at::cat(keys, 0);
  layer.packed_values_ = at::cat(values, 0);
  layer.packed_positions_ = at::cat(positions, 0);
  layer.offsets_host_ = offsets;
  layer.offsets_ = at::tensor(offsets, at::TensorOptions().dtype(at::kLong)).to(device);

  // Positions must be ascending within each head and >= 0; a head boundary may go down.
  const int64_t total = offsets.back();
  int64_t max_position = -1;
  if (total > 0) {
    const at::Tensor& pos = layer.packed_positions_;
    TORCH_CHECK(pos.min().item<int64_t>() >= 0, kFromRagged, ": kept_indices must be >= 0");
    max_position = pos.max().item<int64_t>();
    if (total > 1) {
      at::Tensor rising = pos.narrow(0, 1, total - 1) > pos.narrow(0, 0, total - 1);  // [T - 1]
      // Row r - 1 -> r crosses into a new head when r is an inner offset.
      std::vector<int64_t> boundaries;
      for (size_t i = 1; i + 1 < offsets.size(); ++i)
        if (offsets[i] > 0 && offsets[i] < total) boundaries.push_back(offsets[i] - 1);
      if (!boundaries.empty())
        rising.index_fill_(0, at::tensor(boundaries, at::TensorOptions().dtype(at::kLong)).to(device), true);
      TORCH_CHECK(rising.all().item<bool>(), kFromRagged, ": kept_indices must be strictly ascending within each head");
    }
  }
  if (seq_len < 0) seq_len = kv.keep_mask.defined() ? kv.keep_mask.size(-1) : max_position + 1;
  TORCH_CHECK(seq_len > max_position, kFromRagged, ": seq_len must be greater than every kept index (", max_position,
              "), got ", seq_len);
  layer.next_position_ = seq_len;
  layer.max_packed_position_ = max_position;
  return layer;
}

HeadRaggedLayer HeadRaggedLayer::from_dense(const at::Tensor& keys, const at::Tensor& values) {
  constexpr const char* op = "HeadRaggedLayer::from_dense";
  checks::check_kv(op, keys, values);
  const int64_t b = keys.size(0), h = keys.size(1), s = keys.size(2), d = keys.size(3);
  HeadRaggedLayer layer(b, h, d);
  // Row-major [B, Hkv, S, D] is already the packed layout.
  layer.packed_keys_ = keys.contiguous().view({b * h * s, d});
  layer.packed_values_ = values.contiguous().view({b * h * s, d});
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(keys.device());
  layer.packed_positions_ = at::arange(s, long_opts).repeat({b * h});
  layer.offsets_ = at::arange(b * h + 1, long_opts) * s;
  layer.offsets_host_.resize(static_cast<size_t>(b * h + 1));
  for (int64_t i = 0; i <= b * h; ++i) layer.offsets_host_[static_cast<size_t>(i)] = i * s;
  layer.next_position_ = s;
  layer.max_packed_position_ = s - 1;
  return layer;
}

HeadRaggedLayer HeadRaggedLayer::from_mask(const at::Tensor& keys, const at::Tensor& values,
                                           const at::Tensor& keep_mask) {
  constexpr const char* op = "HeadRaggedLayer::from_mask";
  checks::check_kv(op, keys, values);
  checks::check_keep_mask(op, keep_mask, keys);
  const int64_t b = keys.size(0), h = keys.size(1), s = keys.size(2), d = keys.size(3);
  HeadRaggedLayer layer(b, h, d);
  // Boolean indexing walks [B, Hkv, S] row-major: head after head, positions ascending, which is
  // exactly the packed order.
  const at::Tensor flat_mask = keep_mask.reshape({b * h * s});
  const at::Tensor rows = flat_mask.nonzero().view(-1);  // [T] flat (bh, s) indices
  layer.packed_keys_ = keys.reshape({b * h * s, d}).index_select(0, rows);
  layer.packed_values_ = values.reshape({b * h * s, d}).index_select(0, rows);
  layer.packed_positions_ = rows.remainder(s);
  const at::Tensor counts = keep_mask.reshape({b * h, s}).sum(1);  // int64 [B * Hkv]
  layer.offsets_ = at::cat({at::zeros({1}, counts.options()), counts.cumsum(0)});
  layer.offsets_host_ = to_host_vector(layer.offsets_);
  layer.next_position_ = s;
  layer.max_packed_position_ = layer.offsets_host_.back() > 0 ? layer.packed_positions_.max().item<int64_t>() : -1;
  return layer;
}

// ---- sizes ------------------------------------------------------------------------------------

at::ScalarType HeadRaggedLayer::dtype() const {
  TORCH_CHECK(defined(), "HeadRaggedLayer: the layer is empty");
  return packed_keys_.scalar_type();
}

at::Device HeadRaggedLayer::device() const {
  TORCH_CHECK(defined(), "HeadRaggedLayer: the layer is empty");
  return packed_keys_.device();
}

int64_t HeadRaggedLayer::length(int64_t b, int64_t h) const {
  TORCH_CHECK(b >= 0 && b < batch_ && h >= 0 && h < kv_heads_, "HeadRaggedLayer: head (", b, ", ", h,
              ") out of range for batch ", batch_, " and kv_heads ", kv_heads_);
  const size_t bh = static_cast<size_t>(b * kv_heads_ + h);
  return offsets_host_[bh + 1] - offsets_host_[bh] + tail_length_;
}

at::Tensor HeadRaggedLayer::lengths() const {
  at::Tensor out = at::empty({batch_, kv_heads_}, at::TensorOptions().dtype(at::kLong));
  int64_t* p = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch_ * kv_heads_; ++i)
    p[i] = offsets_host_[static_cast<size_t>(i + 1)] - offsets_host_[static_cast<size_t>(i)] + tail_length_;
  return out;
}

int64_t HeadRaggedLayer::max_length() const {
  int64_t m = 0;
  for (size_t i = 0; i + 1 < offsets_host_.size(); ++i) m = std::max(m, offsets_host_[i + 1] - offsets_host_[i]);
  return defined() ? m + tail_length_ : 0;
}

int64_t HeadRaggedLayer::min_length() const {
  if (!defined()) return 0;
  int64_t m = std::numeric_limits<int64_t>::max();
  for (size_t i = 0; i + 1 < offsets_host_.size(); ++i) m = std::min(m, offsets_host_[i + 1] - offsets_host_[i]);
  return m + tail_length_;
}

int64_t HeadRaggedLayer::total_tokens() const { return packed_tokens() + batch_ * kv_heads_ * tail_length_; }

// ---- contents -----------------------------------------------------------------------------------

at::Tensor HeadRaggedLayer::keys(int64_t b, int64_t h) const {
  length(b, h);  // range check
  const size_t bh = static_cast<size_t>(b * kv_heads_ + h);
  const at::Tensor packed = packed_keys_.narrow(0, offsets_host_[bh], offsets_host_[bh + 1] - offsets_host_[bh]);
  return tail_length_ == 0 ? packed.clone() : at::cat({packed, tail_keys()[b][h]}, 0);
}

at::Tensor HeadRaggedLayer::values(int64_t b, int64_t h) const {
  length(b, h);
  const size_t bh = static_cast<size_t>(b * kv_heads_ + h);
  const at::Tensor packed = packed_values_.narrow(0, offsets_host_[bh], offsets_host_[bh + 1] - offsets_host_[bh]);
  return tail_length_ == 0 ? packed.clone() : at::cat({packed, tail_values()[b][h]}, 0);
}

at::Tensor HeadRaggedLayer::kept_indices(int64_t b, int64_t h) const {
  length(b, h);
  const size_t bh = static_cast<size_t>(b * kv_heads_ + h);
  const at::Tensor packed = packed_positions_.narrow(0, offsets_host_[bh], offsets_host_[bh + 1] - offsets_host_[bh]);
  if (tail_length_ == 0) return packed.clone();
  const at::Tensor tail = at::tensor(tail_positions_, at::TensorOptions().dtype(at::kLong)).to(packed.device());
  return at::cat({packed, tail}, 0);
}

RaggedKV HeadRaggedLayer::to_ragged() const {
  RaggedKV out;
  out.batch = batch_;
  out.kv_heads = kv_heads_;
  for (int64_t b = 0; b < batch_; ++b)
    for (int64_t h = 0; h < kv_heads_; ++h) out.heads.push_back(HeadKV{keys(b, h), values(b, h), kept_indices(b, h)});
  out.keep_mask = keep_mask();
  return out;
}

at::Tensor HeadRaggedLayer::keep_mask() const {
  TORCH_CHECK(defined(), "HeadRaggedLayer::keep_mask: the layer is empty");
  const int64_t heads = batch_ * kv_heads_, s = next_position_;
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(device());
  at::Tensor mask = at::zeros({heads * s}, long_opts.dtype(at::kBool));
  if (packed_tokens() > 0) {
    // Head id of every packed row, then flat index head * S + position.
    const at::Tensor counts = offsets_.narrow(0, 1, heads) - offsets_.narrow(0, 0, heads);
    const at::Tensor head_of_row = at::repeat_interleave(at::arange(heads, long_opts), counts);
    mask.index_fill_(0, head_of_row * s + packed_positions_, true);
  }
  mask = mask.view({batch_, kv_heads_, s});
  if (tail_length_ > 0) {
    const at::Tensor tail = at::tensor(tail_positions_, at::TensorOptions().dtype(at::kLong)).to(device());
    mask.index_fill_(2, tail, true);
  }
  return mask;
}

// ---- decoding ---------------------------------------------------------------------------------

void HeadRaggedLayer::append(const at::Tensor& keys, const at::Tensor& values) {
  constexpr const char* op = "HeadRaggedLayer::append";
  TORCH_CHECK(defined(), op, ": the layer is empty (build it with from_ragged, from_dense or from_mask)");
  checks::check_kv(op, keys, values);
  TORCH_CHECK(keys.size(0) == batch_ && keys.size(1) == kv_heads_ && keys.size(3) == head_dim_, op, ": keys must be [",
              batch_, ", ", kv_heads_, ", n, ", head_dim_, "], got ", checks::shape_str(keys));
  TORCH_CHECK(keys.scalar_type() == dtype(), op, ": keys must be ", dtype(), " like the layer, got ",
              keys.scalar_type());
  TORCH_CHECK(keys.device() == device(), op, ": keys must be on ", device(), " like the layer, got ", keys.device());
  const int64_t n = keys.size(2);
  const int64_t capacity = tail_key_buffer_.defined() ? tail_key_buffer_.size(2) : 0;
  if (tail_length_ + n > capacity) {
    // Geometric growth: token-by-token decoding copies the tail O(log n) times.
    const int64_t new_capacity = std::max(tail_length_ + n, 2 * capacity);
    const std::vector<int64_t> shape{batch_, kv_heads_, new_capacity, head_dim_};
    at::Tensor kb = at::empty(shape, keys.options()), vb = at::empty(shape, values.options());
    if (tail_length_ > 0) {
      kb.narrow(2, 0, tail_length_).copy_(tail_keys());
      vb.narrow(2, 0, tail_length_).copy_(tail_values());
    }
    tail_key_buffer_ = kb;
    tail_value_buffer_ = vb;
  }
  tail_key_buffer_.narrow(2, tail_length_, n).copy_(keys);
  tail_value_buffer_.narrow(2, tail_length_, n).copy_(values);
  tail_length_ += n;
  for (int64_t i = 0; i < n; ++i) tail_positions_.push_back(next_position_ + i);
  next_position_ += n;
}

void HeadRaggedLayer::truncate_appended(int64_t n_keep, int64_t next_position) {
  constexpr const char* op = "HeadRaggedLayer::truncate_appended";
  TORCH_CHECK(n_keep >= 0 && n_keep <= tail_length_, op, ": n_keep must be in [0, ", tail_length_, "], got ", n_keep);
  const int64_t last = n_keep > 0 ? tail_positions_[static_cast<size_t>(n_keep - 1)] : max_packed_position_;
  TORCH_CHECK(next_position > last, op, ": next_position must be greater than the last position kept (", last,
              "), got ", next_position);
  tail_length_ = n_keep;
  tail_positions_.resize(static_cast<size_t>(n_keep));
  next_position_ = next_position;
}

void HeadRaggedLayer::shrink_to_fit() {
  if (!tail_key_buffer_.defined()) return;
  if (tail_length_ == 0) {
    tail_key_buffer_ = at::Tensor();
    tail_value_buffer_ = at::Tensor();
  } else if (tail_key_buffer_.size(2) > tail_length_) {
    tail_key_buffer_ = tail_keys().contiguous();
    tail_value_buffer_ = tail_values().contiguous();
  }
  tail_positions_.shrink_to_fit();
}

// ---- memory -------------------------------------------------------------------------------------

int64_t HeadRaggedLayer::storage_bytes() const {
  int64_t bytes = 0;
  for (const at::Tensor* t : {&packed_keys_, &packed_values_, &tail_key_buffer_, &tail_value_buffer_})
    if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  return bytes;
}

int64_t HeadRaggedLayer::index_bytes() const {
  if (!defined()) return 0;
  int64_t bytes = 0;
  for (const at::Tensor* t : {&packed_positions_, &offsets_})
    if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  // Host vectors by size, so that copies of a layer report the same bytes.
  bytes += static_cast<int64_t>(offsets_host_.size() * sizeof(int64_t));
  bytes += static_cast<int64_t>(tail_positions_.size() * sizeof(int64_t));
  return bytes;
}

// ---- raw storage ------------------------------------------------------------------------------

at::Tensor HeadRaggedLayer::tail_keys() const {
  if (!tail_key_buffer_.defined()) return at::empty({batch_, kv_heads_, 0, head_dim_}, packed_keys_.options());
  return tail_key_buffer_.narrow(2, 0, tail_length_);
}

at::Tensor HeadRaggedLayer::tail_values() const {
  if (!tail_value_buffer_.defined()) return at::empty({batch_, kv_heads_, 0, head_dim_}, packed_values_.options());
  return tail_value_buffer_.narrow(2, 0, tail_length_);
}

// ---- HeadRaggedCache --------------------------------------------------------------------------

HeadRaggedLayer& HeadRaggedCache::layer(int64_t i) {
  TORCH_CHECK(i >= 0 && i < num_layers(), "HeadRaggedCache: layer ", i, " out of range [0, ", num_layers(), ")");
  return layers_[static_cast<size_t>(i)];
}

const HeadRaggedLayer& HeadRaggedCache::layer(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < num_layers(), "HeadRaggedCache: layer ", i, " out of range [0, ", num_layers(), ")");
  return layers_[static_cast<size_t>(i)];
}

void HeadRaggedCache::set_layer(int64_t i, HeadRaggedLayer layer) { this->layer(i) = std::move(layer); }

int64_t HeadRaggedCache::bytes() const {
  int64_t total = 0;
  for (const auto& l : layers_) total += l.bytes();
  return total;
}

// ---- ragged attention over a layer ------------------------------------------------------------

namespace ops {

at::Tensor ragged_attention(const at::Tensor& queries, const HeadRaggedLayer& layer, std::optional<double> scale) {
  TORCH_CHECK(layer.defined(), "ragged_attention: layer is empty (no tokens were ever stored)");
  return ragged_attention(queries, layer.packed_keys(), layer.packed_values(), layer.offsets(), layer.tail_keys(),
                          layer.tail_values(), scale);
}

}  // namespace ops
}  // namespace kvpress
