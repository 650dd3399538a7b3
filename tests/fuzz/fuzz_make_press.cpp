// libFuzzer target: kvpress::make_press with arbitrary names, ratios and parameters. Input lines:
//   1. the press name
//   2. the compression ratio, read with strtod (so also "nan", "inf", "-1e308", "0x1p-3")
//   3+ parameters "key=value" (split at the first '='; a line without one is a key with an empty
//      value), nested ones included: press.<p>, presses.<i>.<p>, prefilling_press.<p>, ...
// Every input either builds a press of that name with a ratio in [0, 1] or raises a c10::Error.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "fuzz_util.h"
#include "kvpress/presses/prefill_decoding_press.h"
#include "kvpress/registry.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::istringstream lines(std::string(reinterpret_cast<const char*>(data), size));
  std::string name, ratio_text, line;
  std::getline(lines, name);
  std::getline(lines, ratio_text);
  const double ratio = std::strtod(ratio_text.c_str(), nullptr);
  std::map<std::string, std::string> params;
  while (std::getline(lines, line)) {
    const size_t eq = line.find('=');
    params[line.substr(0, eq)] = eq == std::string::npos ? std::string() : line.substr(eq + 1);
  }
  kvpress::fuzz::expect_success_or_error([&] {
    const std::unique_ptr<kvpress::BasePress> press = kvpress::make_press(name, ratio, params);
    FUZZ_EXPECT(press != nullptr, name);
    FUZZ_EXPECT(press->name() == name, press->name() + " built for " + name);
    FUZZ_EXPECT(kvpress::find_press(name) != nullptr, name);
    const double r = press->compression_ratio();
    FUZZ_EXPECT(std::isfinite(r) && r >= 0.0 && r <= 1.0, "compression_ratio " + std::to_string(r));
    press->head_ragged();
    press->rerotates_keys();
    kvpress::prefill_press_of(press.get());
    press->decoding_role();
    press->new_sequence_state();
  });
  return 0;
}
