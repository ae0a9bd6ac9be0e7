// Safetensors files: an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mt {

struct SafetensorsEntry {
  std::string dtype;  // "F32", "F16", "BF16", "F64", "I32", ...
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte range within the data section
};

// Reads the header at open; tensors are read on demand (the file is never loaded whole).
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);  // throws mt::Error naming the file
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  // Reads a tensor converted to float32 into dst (numel floats); checks the byte range.
  void read_f32(const std::string& name, float* dst, int64_t numel) const;
  // Elements [offset, offset + count) of a 1-D or flat F32 tensor (a shard's piece).
  void read_f32_range(const std::string& name, int64_t offset, int64_t count, float* dst) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  uint64_t data_start_ = 0;
  uint64_t file_size_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes float32 tensors, streaming them one by one; the header is fixed up front from the
// names and shapes. Written to a temporary file renamed into place by finish().
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, const std::vector<std::pair<std::string, Shape>>& tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  void write(const std::string& name, const float* data);  // in the order given
  void finish();

 private:
  std::string path_, tmp_;
  std::vector<std::pair<std::string, Shape>> tensors_;
  size_t next_ = 0;
  void* file_ = nullptr;
};

}  // namespace mt
