// A press's parameters, declared once. A press with parameters holds a `Params` struct whose
// members carry the defaults and whose static `for_each_field(params, visit)` calls
// visit(ParamSpec, member) for every member, in order (as for_each_field does for LayerInputs,
// types.h). The registry's text parsing and listing (kvpress/registry.h), the constructor's range
// checks (check_params), `kvpress-cli list`, the Python classes and the docs all read that one
// declaration:
//
//   struct Params {
//     int64_t window_size = kDefaultWindowSize;
//     template <typename Self, typename Visit>
//     static void for_each_field(Self& self, Visit&& visit) {
//       visit(ParamSpec{"window_size", "trailing queries observed"}.positive(), self.window_size);
//     }
//   };
//
// A member is one of: int64_t, double, bool, std::optional<int64_t>, std::optional<double> (unset:
// None), std::string (free text; a file or folder with .path(); one of .choices()), or an enum
// listed by .choices() in its declaration order.
#pragma once

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace kvpress {

struct ParamSpec {
  // The values a number accepts; the constructor's check_params raises outside it.
  enum class Range {
    kAny,          // any finite value
    kPositive,     // > 0
    kNonNegative,  // >= 0
    kFraction,     // in [0, 1]
    kPositiveOdd,  // a positive odd integer (a pooling width)
  };

  const char* name;  // kvpress's parameter name, e.g. "window_size"
  const char* help;  // one line
  Range range = Range::kAny;
  std::vector<const char*> choices = {};  // text or enum members: the accepted values (an enum's in its order)
  bool path = false;                      // a text member naming a file or folder the press reads; "" when not given

  ParamSpec positive() const { return with_range(Range::kPositive); }
  ParamSpec non_negative() const { return with_range(Range::kNonNegative); }
  ParamSpec fraction() const { return with_range(Range::kFraction); }
  ParamSpec positive_odd() const { return with_range(Range::kPositiveOdd); }
  ParamSpec one_of(std::initializer_list<const char*> values) const {
    ParamSpec out = *this;
    out.choices = values;
    return out;
  }
  ParamSpec file() const {
    ParamSpec out = *this;
    out.path = true;
    return out;
  }

 private:
  ParamSpec with_range(Range r) const {
    ParamSpec out = *this;
    out.range = r;
    return out;
  }
};

// What a range accepts, as the checks' messages and the docs say it: "must be <range_text>".
inline const char* range_text(ParamSpec::Range range) {
  switch (range) {
    case ParamSpec::Range::kAny: return "finite";
    case ParamSpec::Range::kPositive: return "> 0";
    case ParamSpec::Range::kNonNegative: return ">= 0";
    case ParamSpec::Range::kFraction: return "in [0, 1]";
    case ParamSpec::Range::kPositiveOdd: return "a positive odd number";
  }
  return "";
}

namespace detail {

template <typename T>
bool in_range(ParamSpec::Range range, T value) {
  using Range = ParamSpec::Range;
  // Every range also excludes NaN and infinities.
  if (!std::isfinite(static_cast<double>(value))) return false;
  switch (range) {
    case Range::kAny: return true;
    case Range::kPositive: return value > 0;
    case Range::kNonNegative: return value >= 0;
    case Range::kFraction: return value >= 0 && value <= 1;
    case Range::kPositiveOdd:
      return value > 0 && static_cast<double>(value) == std::floor(static_cast<double>(value)) &&
             static_cast<int64_t>(value) % 2 == 1;
  }
  return false;
}

// "<press>: <name> must be <range_text>, got <value>", the library's message for a bad argument.
template <typename T>
void check_param_value(const char* press, const ParamSpec& spec, T value) {
  TORCH_CHECK(in_range(spec.range, value), press, ": ", spec.name, " must be ", range_text(spec.range), ", got ",
              value);
}

template <typename T>
struct is_optional : std::false_type {};
template <typename T>
struct is_optional<std::optional<T>> : std::true_type {};

}  // namespace detail

// Raises a c10::Error for the first member of `params` outside its declared range or choices (an
// unset optional is not checked). Each press's constructor calls it with its own name.
template <typename Params>
void check_params(const char* press, const Params& params) {
  Params::for_each_field(params, [press](const ParamSpec& spec, const auto& member) {
    using T = std::decay_t<decltype(member)>;
    if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>) {
      detail::check_param_value(press, spec, member);
    } else if constexpr (detail::is_optional<T>::value) {
      if (member) detail::check_param_value(press, spec, *member);
    } else if constexpr (std::is_enum_v<T>) {
      const auto index = static_cast<size_t>(member);
      TORCH_CHECK(index < spec.choices.size(), press, ": ", spec.name, " must be one of its ", spec.choices.size(),
                  " values, got value ", index);
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (spec.choices.empty()) return;
      std::string allowed;
      for (const char* c : spec.choices) {
        if (member == c) return;
        allowed += (allowed.empty() ? "" : ", ") + std::string(c);
      }
      TORCH_CHECK(false, press, ": ", spec.name, " must be one of ", allowed, ", got '", member, "'");
    } else {
      static_assert(std::is_same_v<T, bool>, "a press parameter is int64_t, double, bool, optional, string or enum");
    }
  });
}

}  // namespace kvpress
