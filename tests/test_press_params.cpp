// A press's parameter declaration (kvpress/press_params.h): the constructor's checks from the
// declared ranges, and the registry's parsing and listing from the same Params struct.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "kvpress/press_params.h"
#include "kvpress/presses/cur_press.h"
#include "kvpress/presses/pyramidkv_press.h"
#include "kvpress/presses/snapkv_press.h"
#include "kvpress/registry.h"
#include "test_util.h"

namespace {

using kvpress::ParamSpec;
using kvpress::testing::expect_error;

enum class Shape { kRound, kSquare };

// One member of every kind and range.
struct ExampleParams {
  int64_t count = 1;
  int64_t sinks = 0;
  double share = 0.5;
  int64_t width = 3;
  double scale = 1.0;
  std::optional<int64_t> seed;
  std::string mode = "fast";
  Shape shape = Shape::kRound;

  template <typename Self, typename Visit>
  static void for_each_field(Self& self, Visit&& visit) {
    visit(ParamSpec{"count", "h"}.positive(), self.count);
    visit(ParamSpec{"sinks", "h"}.non_negative(), self.sinks);
    visit(ParamSpec{"share", "h"}.fraction(), self.share);
    visit(ParamSpec{"width", "h"}.positive_odd(), self.width);
    visit(ParamSpec{"scale", "h"}, self.scale);
    visit(ParamSpec{"seed", "h"}.non_negative(), self.seed);
    visit(ParamSpec{"mode", "h"}.one_of({"fast", "exact"}), self.mode);
    visit(ParamSpec{"shape", "h"}.one_of({"round", "square"}), self.shape);
  }
};

void check(const ExampleParams& p) { kvpress::check_params("Example", p); }

TEST(PressParams, DefaultsPass) { check(ExampleParams{}); }

TEST(PressParams, EachRangeRaisesWithTheLibrarysMessage) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  auto with = [](auto edit) {
    ExampleParams p;
    edit(p);
    return p;
  };
  expect_error([&] { check(with([](ExampleParams& p) { p.count = 0; })); }, {"Example: count must be > 0, got 0"});
  expect_error([&] { check(with([](ExampleParams& p) { p.sinks = -1; })); }, {"Example: sinks must be >= 0, got -1"});
  expect_error([&] { check(with([](ExampleParams& p) { p.share = 1.5; })); },
               {"Example: share must be in [0, 1], got 1.5"});
  // NaN and infinities fail every range with the range's own message.
  expect_error([&] { check(with([&](ExampleParams& p) { p.share = nan; })); },
               {"Example: share must be in [0, 1], got nan"});
  expect_error([&] { check(with([](ExampleParams& p) { p.width = 4; })); },
               {"Example: width must be a positive odd number, got 4"});
  expect_error([&] { check(with([](ExampleParams& p) { p.width = -3; })); },
               {"Example: width must be a positive odd number, got -3"});
  expect_error([&] { check(with([&](ExampleParams& p) { p.scale = inf; })); },
               {"Example: scale must be finite, got inf"});
  expect_error([&] { check(with([](ExampleParams& p) { p.seed = -2; })); }, {"Example: seed must be >= 0, got -2"});
  expect_error([&] { check(with([](ExampleParams& p) { p.mode = "slow"; })); },
               {"Example: mode must be one of fast, exact, got 'slow'"});
  expect_error([&] { check(with([](ExampleParams& p) { p.shape = static_cast<Shape>(7); })); },
               {"Example: shape must be one of its 2 values"});
}

TEST(PressParams, UnsetOptionalIsNotChecked) {
  ExampleParams p;
  p.seed = std::nullopt;
  check(p);
  p.seed = 0;
  check(p);
}

TEST(PressParams, ConstructorChecksTheDeclaration) {
  kvpress::SnapKVPress::Params params;
  params.kernel_size = 4;
  expect_error([&] { kvpress::SnapKVPress(0.5, params); },
               {"SnapKVPress: kernel_size must be a positive odd number, got 4"});
  params.kernel_size = 3;
  const kvpress::SnapKVPress press(0.5, params);
  EXPECT_EQ(press.kernel_size(), 3);
  EXPECT_EQ(press.window_size(), kvpress::SnapKVPress::kDefaultWindowSize);
}

TEST(PressParams, RegistryReadsEnumsOptionalsAndChoicesFromTheDeclaration) {
  auto built = kvpress::make_press("CURPress", 0.5, {{"leverage_type", "kv_avg"}, {"seed", "None"}});
  const auto* cur = dynamic_cast<const kvpress::CURPress*>(built.get());
  ASSERT_NE(cur, nullptr);
  EXPECT_EQ(cur->leverage_type(), kvpress::CURPress::LeverageType::kKvAvg);
  expect_error(
      [] {
        kvpress::make_press("CURPress", 0.5, {{"leverage_type", "both"}});
      },
      {"CURPress: parameter leverage_type must be kv_product, key, value or kv_avg, got 'both'"});
  expect_error(
      [] {
        kvpress::make_press("CURPress", 0.5, {{"local_window_size", "0"}});
      },
      {"CURPress: local_window_size must be > 0, got 0"});

  const kvpress::PressInfo* info = kvpress::find_press("CURPress");
  ASSERT_NE(info, nullptr);
  ASSERT_EQ(info->params.size(), 6u);
  EXPECT_EQ(info->params[1].name, "leverage_type");
  EXPECT_EQ(info->params[1].type, "str");
  EXPECT_EQ(info->params[1].default_value, "kv_product");  // the member's default, as its choice's text
  EXPECT_EQ(info->params[5].type, "int?");
  EXPECT_EQ(info->params[5].default_value, "None");
}

// PressParam::accepts, from the declared range or choices (the CLI listing, the generated
// docs/PRESS_PARAMETERS.md and the Python docstrings print it), in the words the checks use.
TEST(PressParams, RegistryListsWhatEachParameterAccepts) {
  const kvpress::PressInfo* snapkv = kvpress::find_press("SnapKVPress");
  ASSERT_NE(snapkv, nullptr);
  EXPECT_EQ(snapkv->params[0].accepts, "> 0");
  EXPECT_EQ(snapkv->params[1].accepts, "a positive odd number");
  const kvpress::PressInfo* cur = kvpress::find_press("CURPress");
  ASSERT_NE(cur, nullptr);
  EXPECT_EQ(cur->params[1].accepts, "kv_product, key, value or kv_avg");
  EXPECT_EQ(cur->params[5].accepts, "any or None");  // an unrestricted optional integer
  const kvpress::PressInfo* dropkv = kvpress::find_press("DropKVPress");
  ASSERT_NE(dropkv, nullptr);
  EXPECT_EQ(dropkv->params[2].name, "epsilon");
  EXPECT_EQ(dropkv->params[2].accepts, "> 0");
  expect_error(
      [] {
        kvpress::make_press("DropKVPress", 0.5, {{"epsilon", "0"}});
      },
      {"DropKVPress: epsilon must be > 0, got 0"});
}

TEST(PressParams, DerivedParamsListTheBaseFieldsFirst) {
  const kvpress::PressInfo* info = kvpress::find_press("PyramidKVPress");
  ASSERT_NE(info, nullptr);
  ASSERT_EQ(info->params.size(), 3u);
  EXPECT_EQ(info->params[0].name, "window_size");
  EXPECT_EQ(info->params[1].name, "kernel_size");
  EXPECT_EQ(info->params[2].name, "beta");
  EXPECT_EQ(info->params[2].default_value, std::to_string(kvpress::PyramidKVPress::kDefaultBeta));
}

}  // namespace
