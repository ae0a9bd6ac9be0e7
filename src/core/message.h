// Pieces of the messages that tell a user what to change.
#pragma once
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace mt {

// What a path that exists is when it is not a regular file, its links followed ("a
// directory", "a FIFO", "a character device", ...); "" for a regular file or nothing there.
// Opening a FIFO blocks until something writes to it, and a file renamed into place over a
// device or FIFO replaces it: readers and writers of files ask first.
inline std::string not_regular_kind(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  switch (fs::status(path, ec).type()) {
    case fs::file_type::directory: return "a directory";
    case fs::file_type::fifo: return "a FIFO";
    case fs::file_type::character: return "a character device";
    case fs::file_type::block: return "a block device";
    case fs::file_type::socket: return "a socket";
    case fs::file_type::regular:
    case fs::file_type::not_found:
    case fs::file_type::none: return "";
    default: return "not a regular file";
  }
}

// A float as the double of its shortest decimal (1e-05, not 9.999999747378752e-06): the number
// a person wrote, for JSON and messages; read back into a float, the same float.
inline double float_as_written(float f) {
  char buf[32];
  char* end = std::to_chars(buf, buf + sizeof buf, f).ptr;
  return std::strtod(std::string(buf, end).c_str(), nullptr);
}

// The values as "2, 3 or 6" ("" if none); with shown > 0, the first `shown` of them,
// followed by ", ..." where there are more.
inline std::string values_text(const std::vector<int64_t>& v, int shown = 0) {
  const bool more = shown > 0 && std::ssize(v) > shown;
  const size_t n = more ? static_cast<size_t>(shown) : v.size();
  std::string out;
  for (size_t i = 0; i < n; ++i) out += (i == 0 ? "" : i + 1 == n && !more ? " or " : ", ") + std::to_string(v[i]);
  return more ? out + ", ..." : out;
}

// The n in [lo, hi] for which ok(n) holds, as values_text writes them. It tries every n, so
// it is for small ranges; the divisors of a count that may reach 2^31 come from divisors().
inline std::string values_where(int64_t lo, int64_t hi, const std::function<bool(int64_t)>& ok, int shown = 0) {
  std::vector<int64_t> v;
  for (int64_t n = lo; n <= hi && (shown == 0 || std::ssize(v) <= shown); ++n)
    if (ok(n)) v.push_back(n);
  return values_text(v, shown);
}

// The divisors of n >= 1, ascending; trial division up to sqrt(n), so n = 2^31 - 1 takes
// no time.
inline std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> low, high;
  for (int64_t i = 1; i <= n / i; ++i)
    if (n % i == 0) {
      low.push_back(i);
      if (i != n / i) high.push_back(n / i);
    }
  low.insert(low.end(), high.rbegin(), high.rend());
  return low;
}

}  // namespace mt
