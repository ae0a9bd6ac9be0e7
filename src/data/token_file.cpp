// Token files in llm.c's format. Bytes are decoded and encoded explicitly as little endian,
// so a file written here reads the same on any host. Writes go to a temporary name and are
// renamed into place, so a reader never sees a half-written file.
#include "data/token_file.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>

#include "core/error.h"
#include "core/message.h"

namespace mt {
namespace {

constexpr int64_t kHeaderInts = 256;
constexpr int64_t kHeaderBytes = kHeaderInts * 4;
constexpr const char* kHowToFix = "write one with `meshtrain prepare`";

struct FileCloser {
  void operator()(FILE* f) const {
    if (f) std::fclose(f);
  }
};
using FilePtr = std::unique_ptr<FILE, FileCloser>;

int32_t load_le32(const unsigned char* p) {
  return static_cast<int32_t>(uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 |
                              uint32_t{p[3]} << 24);
}

void store_le32(unsigned char* p, uint32_t v) {
  p[0] = static_cast<unsigned char>(v), p[1] = static_cast<unsigned char>(v >> 8);
  p[2] = static_cast<unsigned char>(v >> 16), p[3] = static_cast<unsigned char>(v >> 24);
}

}  // namespace

std::vector<int32_t> token_file_read(const std::string& path, const std::string& key) {
  // fopen opens a directory, whose read fails with no key named, and waits on a FIFO for a writer
  const std::string kind = not_regular_kind(path);
  MT_CHECK(kind.empty(), key << " = " << path << " is " << kind << "; set " << key << " to a token file ("
                             << kHowToFix << ")");
  FilePtr f(std::fopen(path.c_str(), "rb"));
  MT_CHECK(f, "cannot open token file " << path << ": " << std::strerror(errno)
                                        << "; set " << key << " to an existing file or create one with "
                                           "`meshtrain prepare`");
  MT_CHECK(std::fseek(f.get(), 0, SEEK_END) == 0, "cannot seek in token file " << path << ": "
                                                                               << std::strerror(errno));
  const int64_t size = std::ftell(f.get());
  MT_CHECK(size >= 0, "cannot size token file " << path << ": " << std::strerror(errno));
  std::rewind(f.get());

  MT_CHECK(size >= kHeaderBytes, key << ": " << path << " is not a token file (" << size
                                               << " bytes, shorter than the " << kHeaderBytes
                                               << "-byte header); " << kHowToFix);
  unsigned char header_bytes[kHeaderBytes];
  MT_CHECK(std::fread(header_bytes, 1, kHeaderBytes, f.get()) == size_t(kHeaderBytes),
           "cannot read the header of token file " << path << ": " << std::strerror(errno));
  const int32_t magic = load_le32(header_bytes);
  const int32_t version = load_le32(header_bytes + 4);
  const int32_t count = load_le32(header_bytes + 8);
  MT_CHECK(magic == kTokenFileMagic, key << ": " << path << " is not a token file (magic " << magic
                                                   << ", expected " << kTokenFileMagic << "); "
                                                   << kHowToFix);
  MT_CHECK(version == 1 || version == 2,
           key << ": token file " << path << " has version " << version
                                    << ", expected 1 (uint16 tokens) or 2 (uint32 tokens); "
                                    << "rewrite it with `meshtrain prepare`");
  MT_CHECK(count >= 0, key << ": token file " << path << " has a negative token count (" << count
                                                << ") in its header; rewrite it with `meshtrain prepare`");
  const int64_t width = version == 1 ? 2 : 4;
  const int64_t expected = kHeaderBytes + int64_t{count} * width;
  MT_CHECK(size == expected,
           key << ": token file " << path << " is " << size << " bytes, but its header says "
                                    << count << " tokens of " << width << " bytes (1024 + " << count
                                    << "*" << width << " = " << expected << " bytes); the file is "
                                    << (size < expected ? "truncated" : "longer than its header says")
                                    << ", rewrite it with `meshtrain prepare`");

  // Read in chunks to keep the temporary byte buffer small for multi-GB files.
  std::vector<int32_t> tokens(static_cast<size_t>(count));
  constexpr int64_t kChunkTokens = 1 << 20;
  std::vector<unsigned char> buf(static_cast<size_t>(kChunkTokens * width));
  for (int64_t done = 0; done < count;) {
    const int64_t n = std::min<int64_t>(kChunkTokens, count - done);
    MT_CHECK(std::fread(buf.data(), static_cast<size_t>(width), static_cast<size_t>(n), f.get()) ==
                 static_cast<size_t>(n),
             "cannot read the tokens of " << path << ": " << std::strerror(errno));
    const unsigned char* p = buf.data();
    if (width == 2) {
      for (int64_t i = 0; i < n; ++i) tokens[done + i] = int32_t{p[2 * i]} | int32_t{p[2 * i + 1]} << 8;
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const int32_t t = load_le32(p + 4 * i);
        MT_CHECK(t >= 0, key << ": token file " << path << " holds token " << uint32_t(t)
                                                  << " at index " << done + i
                                                  << ", larger than the largest supported id "
                                                  << std::numeric_limits<int32_t>::max()
                                                  << "; rewrite it with a smaller vocabulary");
        tokens[done + i] = t;
      }
    }
    done += n;
  }
  return tokens;
}

void token_file_write(const std::string& path, const std::vector<int32_t>& tokens, int version) {
  MT_CHECK(version == 0 || version == 1 || version == 2,
           "token file version " << version << " is not supported; use 0 (auto), 1 (uint16) or 2 (uint32)");
  MT_CHECK(tokens.size() <= size_t(std::numeric_limits<int32_t>::max()),
           "cannot write " << tokens.size() << " tokens to " << path << ": the header's count is an int32; "
                           << "split the data into several files");
  int32_t max_token = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    MT_CHECK(tokens[i] >= 0, "cannot write token file " << path << ": token " << tokens[i] << " at index "
                                                        << i << " is negative; token ids must be >= 0");
    max_token = std::max(max_token, tokens[i]);
  }
  if (version == 0) version = max_token < 65536 ? 1 : 2;
  MT_CHECK(version == 2 || max_token < 65536,
           "cannot write token file " << path << " as version 1 (uint16): token " << max_token
                                      << " does not fit; use version 2 or 0 (auto)");

  const int width = version == 1 ? 2 : 4;
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FilePtr f(std::fopen(tmp.c_str(), "wb"));
  MT_CHECK(f, "cannot create " << tmp << ": " << std::strerror(errno)
                               << "; check that the directory exists and is writable");
  unsigned char header[kHeaderBytes] = {};
  store_le32(header, kTokenFileMagic);
  store_le32(header + 4, static_cast<uint32_t>(version));
  store_le32(header + 8, static_cast<uint32_t>(tokens.size()));
  bool ok = std::fwrite(header, 1, kHeaderBytes, f.get()) == size_t(kHeaderBytes);

  constexpr size_t kChunkTokens = 1 << 20;
  std::vector<unsigned char> buf(kChunkTokens * width);
  for (size_t done = 0; ok && done < tokens.size();) {
    const size_t n = std::min(kChunkTokens, tokens.size() - done);
    unsigned char* p = buf.data();
    for (size_t i = 0; i < n; ++i) {
      const uint32_t t = static_cast<uint32_t>(tokens[done + i]);
      if (width == 2) {
        p[2 * i] = static_cast<unsigned char>(t), p[2 * i + 1] = static_cast<unsigned char>(t >> 8);
      } else {
        store_le32(p + 4 * i, t);
      }
    }
    ok = std::fwrite(p, width, n, f.get()) == n;
    done += n;
  }
  int write_errno = errno;
  if (std::fclose(f.release()) != 0 && ok) ok = false, write_errno = errno;
  if (!ok) {
    std::remove(tmp.c_str());
    MT_FAIL("cannot write token file " << tmp << ": " << std::strerror(write_errno)
                                       << "; check free disk space and permissions");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    MT_FAIL("cannot rename " << tmp << " to " << path << ": " << std::strerror(e));
  }
}

}  // namespace mt
