// Pieces of the messages that tell a user what to change.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mt {

// The n in [lo, hi] for which ok(n) holds, as "2, 3 or 6" ("" if none); with shown > 0, at
// most that many, followed by ", ..." where more hold.
inline std::string values_where(int64_t lo, int64_t hi, const std::function<bool(int64_t)>& ok, int shown = 0) {
  std::vector<int64_t> v;
  bool more = false;
  for (int64_t n = lo; n <= hi && !more; ++n)
    if (ok(n)) {
      more = shown > 0 && std::ssize(v) == shown;
      if (!more) v.push_back(n);
    }
  std::string out;
  for (size_t i = 0; i < v.size(); ++i)
    out += (i == 0 ? "" : i + 1 == v.size() && !more ? " or " : ", ") + std::to_string(v[i]);
  return more ? out + ", ..." : out;
}

}  // namespace mt
