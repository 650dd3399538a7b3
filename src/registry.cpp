// Name -> press lookup and the parsing of press parameters given as text. Each press registers
// itself from its own .cpp (src/presses/registration.h) and declares its parameters once, in its
// Params struct (kvpress/press_params.h) or as its factory reads them; the listing is made by running
// each factory once with no parameters.
#include "kvpress/registry.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <system_error>

#include "presses/registration.h"

namespace kvpress {

std::optional<int64_t> parse_int(std::string_view text) {
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::optional<double> parse_double(std::string_view text) {
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  double value = 0.0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() || !std::isfinite(value))
    return std::nullopt;
  return value;
}

std::optional<std::vector<double>> parse_double_list(std::string_view text) {
  std::vector<double> out;
  while (true) {
    const size_t comma = text.find(',');
    const auto value = parse_double(text.substr(0, comma));
    if (!value) return std::nullopt;
    out.push_back(*value);
    if (comma == std::string_view::npos) return out;
    text.remove_prefix(comma + 1);
  }
}

std::string format_double(double value) {
  char buffer[32];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

namespace {

using registration::PressEntry;

// The order list_presses() gives (and with it `kvpress-cli list`, the docs and the known-press lists
// of error messages): kvpress's simple scorers first, then the rebuilding scorers, channel and layer
// presses, second passes, wrappers, decoding presses, budget presses and CTR-Press. A registered
// press missing here comes after these, by name, so adding a press needs no line here.
constexpr const char* kCatalogue[] = {
    "RandomPress",
    "KnormPress",
    "StreamingLLMPress",
    "KeyDiffPress",
    "SnapKVPress",
    "FinchPress",
    "LagKVPress",
    "TOVAPress",
    "ObservedAttentionPress",
    "QFilterPress",
    "KVzapPress",
    "CURPress",
    "LeverageScorePress",
    "NonCausalAttnPress",
    "CompactorPress",
    "ExpectedAttentionPress",
    "ExpectedAttentionStatsPress",
    "CapPress",
    "ThinKPress",
    "SimLayerKVPress",
    "DuoAttentionPress",
    "KVComposePress",
    "KVzipPress",
    "RestoreKVPress",
    "KVgradPress",
    "FastKVzipPress",
    "KeyRerotationPress",
    "ChunkKVPress",
    "EntropyGatedChunkKVPress",
    "ChunkPress",
    "BlockPress",
    "ComposedPress",
    "DecodingPress",
    "CAMPress",
    "CompressionRatioDecodingPress",
    "PrefillDecodingPress",
    "AdaKVPress",
    "DMSPress",
    "MergingPress",
    "LUKVPress",
    "CriticalKVPress",
    "CriticalAdaKVPress",
    "PyramidKVPress",
    "PerLayerCompressionPress",
    "QSMPress",
    "CTRPress",
};

// Every registered press, in kCatalogue's order.
const std::vector<PressEntry>& entries() {
  static const std::vector<PressEntry> table = [] {
    std::vector<PressEntry> all;
    for (const auto describe : registration::registrations()) all.push_back(describe());
    const auto rank = [](const PressEntry& e) {
      const auto* end = std::end(kCatalogue);
      return std::make_pair(std::find(std::begin(kCatalogue), end, e.name) - std::begin(kCatalogue), e.name);
    };
    std::sort(all.begin(), all.end(), [&](const PressEntry& a, const PressEntry& b) { return rank(a) < rank(b); });
    for (size_t i = 1; i < all.size(); ++i)
      TORCH_INTERNAL_ASSERT(all[i].name != all[i - 1].name, "press ", all[i].name, " is registered twice");
    return all;
  }();
  return table;
}

const PressEntry* find_entry(const std::string& name) {
  for (const auto& e : entries())
    if (e.name == name) return &e;
  return nullptr;
}

std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : separator) + item;
  return out;
}

}  // namespace

bool registration::takes_ratio(const std::string& name) {
  const PressEntry* entry = find_entry(name);
  return entry == nullptr || entry->no_ratio.empty();
}

const std::vector<PressInfo>& list_presses() {
  static const std::vector<PressInfo> infos = [] {
    std::vector<PressInfo> out;
    for (const auto& e : entries()) {
      registration::ParamReader declared(e.name, {});
      // Every factory declares its parameters as it reads them.
      const std::unique_ptr<BasePress> built = e.make(0.0, declared);
      TORCH_INTERNAL_ASSERT(built->name() == e.name, "press registered as ", e.name, " is named ", built->name());
      out.push_back(PressInfo{e.name, e.kind, e.summary, e.inputs, declared.declared(), e.no_ratio});
    }
    return out;
  }();
  return infos;
}

const PressInfo* find_press(const std::string& name) {
  for (const auto& info : list_presses())
    if (info.name == name) return &info;
  return nullptr;
}

bool needs_file(const PressInfo& info) {
  return std::any_of(info.params.begin(), info.params.end(), [](const PressParam& p) { return p.type == "path"; });
}

double ratio_for(const PressInfo& info, double compression_ratio) {
  return info.no_ratio.empty() ? compression_ratio : 0.0;
}

std::string describe_inputs(const PressInfo& info) {
  const PressInputs& in = info.inputs;
  if (info.kind == PressKind::kSecondPass) return "second pass: " + in.note;
  std::vector<std::string> alternatives;
  for (const InputSet& set : in.alternatives)
    alternatives.push_back(join(set.fields, "+") + (set.all_positions ? " (all positions)" : ""));
  std::string text = join(alternatives, " | ");
  if (!in.required.empty()) text += (text.empty() ? "" : ", with ") + join(in.required, "+");
  if (info.kind == PressKind::kWrapper || info.kind == PressKind::kDecoding) {
    if (alternatives.size() > 1) text = "(" + text + ")";
    text = text.empty() ? "the inner press's" : "the inner press's + " + text;
  }
  if (text.empty()) text = "keys, values";
  if (!in.optional.empty()) text += "; uses " + join(in.optional, ", ") + " when given";
  if (!in.note.empty()) text += "; " + in.note;
  return info.kind == PressKind::kDecoding ? "during decoding: " + text : text;
}

bool needs_attentions(const std::string& name) {
  const PressInfo* info = find_press(name);
  if (info == nullptr || info->inputs.alternatives.empty()) return false;
  for (const InputSet& set : info->inputs.alternatives)
    if (std::find(set.fields.begin(), set.fields.end(), "attentions") == set.fields.end()) return false;
  return true;
}

std::unique_ptr<BasePress> make_press(const std::string& name, double compression_ratio,
                                      const std::map<std::string, std::string>& params) {
  const PressEntry* entry = find_entry(name);
  if (entry == nullptr) {
    std::vector<std::string> names;
    for (const auto& e : entries()) names.push_back(e.name);
    TORCH_CHECK(false, "make_press: unknown press '", name, "' (known: ", join(names, ", "), ")");
  }
  TORCH_CHECK(entry->no_ratio.empty() || compression_ratio == 0.0, name, ": compression_ratio must be 0 (",
              entry->no_ratio, "), got ", compression_ratio);
  registration::ParamReader p(name, params);
  std::unique_ptr<BasePress> press = entry->make(compression_ratio, p);
  p.check_all_used();
  return press;
}

}  // namespace kvpress
