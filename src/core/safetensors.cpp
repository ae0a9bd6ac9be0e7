#include "core/safetensors.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/message.h"  // not_regular_kind
#include "core/half.h"

namespace mt {

namespace {

size_t st_dtype_size(const std::string& d) {
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "I8" || d == "U8" || d == "BOOL") return 1;
  return 0;
}

}  // namespace

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  const std::string kind = not_regular_kind(path);  // a FIFO would block the open below
  MT_CHECK(kind.empty(), path << " is " << kind << ", not a safetensors file");
  FILE* f = std::fopen(path.c_str(), "rb");
  MT_CHECK(f, "cannot open safetensors file " << path << ": " << std::strerror(errno));
  std::fseek(f, 0, SEEK_END);
  file_size_ = static_cast<uint64_t>(std::ftell(f));
  std::fseek(f, 0, SEEK_SET);
  uint64_t hlen = 0;
  bool ok = file_size_ >= 8 && std::fread(&hlen, 8, 1, f) == 1 && hlen <= file_size_ - 8;
  std::string header;
  if (ok) {
    header.resize(hlen);
    ok = std::fread(header.data(), 1, hlen, f) == hlen;
  }
  std::fclose(f);
  MT_CHECK(ok, path << " is not a safetensors file (its header length does not fit the file of " << file_size_
                    << " bytes); re-export it or point to the right file");
  data_start_ = 8 + hlen;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const std::exception& e) {
    MT_FAIL(path << " is not a safetensors file (its JSON header does not parse: " << e.what() << ")");
  }
  MT_CHECK(j.is_object(), path << " is not a safetensors file (header is not a JSON object)");
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      for (auto m = it->begin(); m != it->end(); ++m)
        if (m->is_string()) metadata_[m.key()] = m->get<std::string>();
      continue;
    }
    try {
      SafetensorsEntry e;
      e.dtype = it->at("dtype").get<std::string>();
      e.shape = it->at("shape").get<Shape>();
      e.begin = it->at("data_offsets").at(0).get<uint64_t>();
      e.end = it->at("data_offsets").at(1).get<uint64_t>();
      entries_[it.key()] = e;
    } catch (const std::exception& ex) {
      MT_FAIL(path << ": tensor " << it.key() << " has a malformed header entry (" << ex.what() << ")");
    }
  }
}

void SafetensorsReader::read_f32(const std::string& name, float* dst, int64_t numel) const {
  auto it = entries_.find(name);
  MT_CHECK(it != entries_.end(), path_ << " has no tensor " << name);
  const SafetensorsEntry& e = it->second;
  size_t es = st_dtype_size(e.dtype);
  MT_CHECK(e.dtype == "F32" || e.dtype == "F16" || e.dtype == "BF16" || e.dtype == "F64",
           path_ << ": tensor " << name << " has dtype " << e.dtype << "; only F32, F16, BF16 and F64 load");
  MT_CHECK(shape_numel(e.shape) == numel,
           path_ << ": tensor " << name << " has " << shape_numel(e.shape) << " elements, expected " << numel);
  MT_CHECK(e.end >= e.begin && e.end - e.begin == numel * es && data_start_ + e.end <= file_size_,
           path_ << ": tensor " << name << " has a byte range that does not fit the file (truncated or corrupt)");
  FILE* f = std::fopen(path_.c_str(), "rb");
  MT_CHECK(f, "cannot open " << path_ << ": " << std::strerror(errno));
  std::fseek(f, static_cast<long>(data_start_ + e.begin), SEEK_SET);
  bool ok;
  if (e.dtype == "F32") {
    ok = std::fread(dst, 4, numel, f) == static_cast<size_t>(numel);
  } else {
    std::vector<char> buf(numel * es);
    ok = std::fread(buf.data(), 1, buf.size(), f) == buf.size();
    for (int64_t i = 0; ok && i < numel; ++i) {
      if (e.dtype == "F64") {
        double d;
        std::memcpy(&d, buf.data() + 8 * i, 8);
        dst[i] = static_cast<float>(d);
      } else {
        uint16_t h;
        std::memcpy(&h, buf.data() + 2 * i, 2);
        dst[i] = e.dtype == "F16" ? f16_to_f32(h) : bf16_to_f32(h);
      }
    }
  }
  std::fclose(f);
  MT_CHECK(ok, path_ << ": short read of tensor " << name << " (file truncated?)");
}

void SafetensorsReader::read_f32_range(const std::string& name, int64_t offset, int64_t count, float* dst) const {
  auto it = entries_.find(name);
  MT_CHECK(it != entries_.end(), path_ << " has no tensor " << name);
  const SafetensorsEntry& e = it->second;
  MT_CHECK(e.dtype == "F32", path_ << ": tensor " << name << " is " << e.dtype << ", expected F32");
  MT_CHECK(offset >= 0 && count >= 0 && offset + count <= shape_numel(e.shape),
           path_ << ": range [" << offset << ", " << offset + count << ") is outside tensor " << name << " of "
                 << shape_numel(e.shape) << " elements");
  MT_CHECK(e.end - e.begin == static_cast<uint64_t>(shape_numel(e.shape)) * 4 && data_start_ + e.end <= file_size_,
           path_ << ": tensor " << name << " has a byte range that does not fit the file (truncated or corrupt)");
  FILE* f = std::fopen(path_.c_str(), "rb");
  MT_CHECK(f, "cannot open " << path_ << ": " << std::strerror(errno));
  std::fseek(f, static_cast<long>(data_start_ + e.begin + offset * 4), SEEK_SET);
  const bool ok = std::fread(dst, 4, count, f) == static_cast<size_t>(count);
  std::fclose(f);
  MT_CHECK(ok, path_ << ": short read of tensor " << name << " (file truncated?)");
}

SafetensorsWriter::SafetensorsWriter(const std::string& path, const std::vector<std::pair<std::string, Shape>>& tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), tmp_(path + ".tmp." + std::to_string(getpid())), tensors_(tensors) {
  nlohmann::ordered_json j;
  if (!metadata.empty()) j["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& [name, shape] : tensors) {
    uint64_t bytes = shape_numel(shape) * 4;
    j[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
  }
  std::string header = j.dump();
  while ((header.size() + 8) % 8) header += ' ';  // keep the data 8-byte aligned
  FILE* f = std::fopen(tmp_.c_str(), "wb");
  MT_CHECK(f, "cannot write " << tmp_ << ": " << std::strerror(errno) << "; check the directory exists and is writable");
  file_ = f;
  uint64_t hlen = header.size();
  if (!(std::fwrite(&hlen, 8, 1, f) == 1 && std::fwrite(header.data(), 1, hlen, f) == hlen)) {
    // A constructor that throws runs no destructor: remove the temporary here.
    std::fclose(f);
    file_ = nullptr;
    std::remove(tmp_.c_str());
    MT_FAIL("write to " << tmp_ << " failed (disk full?)");
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (file_) {  // not finished: an error interrupted the write; leave nothing behind
    std::fclose(static_cast<FILE*>(file_));
    std::remove(tmp_.c_str());
  }
}

void SafetensorsWriter::write(const std::string& name, const float* data) {
  MT_CHECK(next_ < tensors_.size() && tensors_[next_].first == name,
           "internal: safetensors tensors written out of order at " << name);
  size_t n = shape_numel(tensors_[next_].second);
  MT_CHECK(std::fwrite(data, 4, n, static_cast<FILE*>(file_)) == n, "write to " << tmp_ << " failed (disk full?)");
  ++next_;
}

void SafetensorsWriter::finish() {
  MT_CHECK(next_ == tensors_.size(), "internal: safetensors file finished with tensors missing");
  FILE* f = static_cast<FILE*>(file_);
  file_ = nullptr;
  bool ok = std::fflush(f) == 0 && fsync(fileno(f)) == 0;
  ok = std::fclose(f) == 0 && ok;
  // file_ is already cleared, so the destructor will not remove the temporary: every failure
  // from here on removes it itself.
  if (!ok) {
    std::remove(tmp_.c_str());
    MT_FAIL("write to " << tmp_ << " failed (disk full?)");
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp_.c_str());
    MT_FAIL("cannot rename " << tmp_ << " to " << path_ << ": " << std::strerror(err));
  }
}

}  // namespace mt
