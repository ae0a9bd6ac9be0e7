// Token files in llm.c's format: a header of 256 little-endian int32 (magic 20240520,
// version 1 = uint16 tokens / 2 = uint32 tokens, token count), then the tokens.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mt {

constexpr int32_t kTokenFileMagic = 20240520;

// Reads every token. A missing file, wrong magic, unknown version, or a size that does not
// match the header's count throws mt::Error naming the file and what to do.
// key: the configuration key that named the file (data.path, data.val_path), for messages.
std::vector<int32_t> token_file_read(const std::string& path, const std::string& key = "data.path");
// Writes atomically (temporary file, then rename). version 0 picks 1 when every token
// fits in uint16, else 2.
void token_file_write(const std::string& path, const std::vector<int32_t>& tokens, int version = 0);

}  // namespace mt
