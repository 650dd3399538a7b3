#include "kvpress/presses/composed_press.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "layer_slices.h"
#include "presses/registration.h"

namespace kvpress {

ComposedPress::ComposedPress(std::vector<std::shared_ptr<const BasePress>> presses) : presses_(std::move(presses)) {
  TORCH_CHECK(!presses_.empty(), "ComposedPress: presses must hold at least one press, got none");
  for (size_t i = 0; i < presses_.size(); ++i)
    TORCH_CHECK(presses_[i] != nullptr, "ComposedPress: presses[", i, "] must be a press, got nullptr");
}

double ComposedPress::compression_ratio() const {
  double kept = 1.0;
  for (const auto& p : presses_) kept *= 1.0 - p->compression_ratio();
  return 1.0 - kept;
}

HeadSpan ComposedPress::head_span() const {
  HeadSpan span = HeadSpan::kPerHead;
  for (const auto& press : presses_) span = wider_span(span, press->head_span());
  return span;
}

KV ComposedPress::compress(const LayerInputs& in) const {
  constexpr const char* op = "ComposedPress.compress";
  checks::check_kv(op, in.keys, in.values);
  KV kv = presses_.front()->compress(in);
  for (size_t i = 1; i < presses_.size(); ++i) {
    const KV next = presses_[i]->compress(kv_only(in, kv.keys, kv.values));
    kv = KV{next.keys, next.values, kv.kept_indices.gather(-1, next.kept_indices).contiguous()};
  }
  return kv;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

// ComposedPress's presses: `presses` = "A,B,..."; press i is configured as `presses.<i>`.
std::vector<std::shared_ptr<const BasePress>> composed_presses(ParamReader& p, double ratio) {
  const std::string list = p.get_text(
      "presses", "KnormPress", "comma-separated press names; presses.<i>.<param> (and presses.<i>.compression_ratio)");
  std::vector<std::shared_ptr<const BasePress>> out;
  size_t begin = 0;
  for (int i = 0;; ++i) {
    const size_t comma = list.find(',', begin);
    const std::string name = list.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    TORCH_CHECK(!name.empty() && !is_none(name), "ComposedPress: presses must be comma-separated press names, got '",
                list, "'");
    out.push_back(named_press(p, "presses." + std::to_string(i), name, ratio));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return out;
}

const Registration kRegistration([] {
  return PressEntry{"ComposedPress",
                    PressKind::kWrapper,
                    "presses applied in order",
                    {{}, {}, {}, "later presses see keys and values only"},
                    [](double r, ParamReader& p) { return std::make_unique<ComposedPress>(composed_presses(p, r)); }};
});

}  // namespace

}  // namespace kvpress
