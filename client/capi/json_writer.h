// A minimal JSON writer for the C ABI's dictionaries (objects, arrays,
// strings, unsigned integers, booleans, null). Not thread-safe; one per reply.
#ifndef ACTSTASH_CLIENT_CAPI_JSON_WRITER_H_
#define ACTSTASH_CLIENT_CAPI_JSON_WRITER_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace actstash::capi {

class JsonWriter {
 public:
  void Begin() { Open('{'); }
  void End() { Close('}'); }
  void BeginArray() { Open('['); }
  void EndArray() { Close(']'); }
  void Key(std::string_view key) {
    Separate();
    String(key);
    out_ += ':';
    after_key_ = true;
  }
  void Field(std::string_view key, uint64_t value) {
    Key(key);
    Value(absl::StrCat(value));
  }
  void Field(std::string_view key, uint32_t value) { Field(key, uint64_t{value}); }
  void Field(std::string_view key, bool value) {
    Key(key);
    Value(value ? "true" : "false");
  }
  void Field(std::string_view key, const std::string& value) {
    Key(key);
    Separate();
    String(value);
  }
  void NullField(std::string_view key) {
    Key(key);
    Value("null");
  }
  // A value after Key or inside an array: JSON text as is (a number, true,
  // false, null), or a string to quote.
  void RawValue(std::string_view json) { Value(json); }
  void StringValue(std::string_view s) {
    Separate();
    String(s);
  }
  const std::string& str() const { return out_; }

 private:
  void Separate() {
    if (after_key_) {
      after_key_ = false;
    } else if (!out_.empty() && out_.back() != '{' && out_.back() != '[') {
      out_ += ',';
    }
  }
  void Open(char c) {
    Separate();
    out_ += c;
  }
  void Close(char c) { out_ += c; }
  void Value(std::string_view v) {
    Separate();
    out_ += v;
  }
  void String(std::string_view s) {
    out_ += '"';
    for (unsigned char c : s) {
      if (c == '"' || c == '\\') {
        out_ += '\\';
        out_ += static_cast<char>(c);
      } else if (c < 0x20) {
        out_ += absl::StrFormat("\\u%04x", c);
      } else {
        out_ += static_cast<char>(c);
      }
    }
    out_ += '"';
  }

  std::string out_;
  bool after_key_ = false;
};

}  // namespace actstash::capi

#endif  // ACTSTASH_CLIENT_CAPI_JSON_WRITER_H_
