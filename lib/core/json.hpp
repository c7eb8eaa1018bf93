// Minimal JSON for expseg: a streaming writer (stats, snapshots, reports, replay results) and a
// small parser (tests, tools reading their own output). No dependencies beyond the standard library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace expseg::core {

// Appends JSON text to a string. Commas between members/elements are inserted automatically.
// Misuse (a value where a key is expected, unbalanced end_*) throws std::logic_error.
class JsonWriter {
 public:
  JsonWriter& begin_object();
  JsonWriter& end_object();
  JsonWriter& begin_array();
  JsonWriter& end_array();
  JsonWriter& key(std::string_view name);
  JsonWriter& value(std::string_view text);
  JsonWriter& value(const char* text) { return value(std::string_view(text)); }
  JsonWriter& value(const std::string& text) { return value(std::string_view(text)); }
  JsonWriter& value(bool b);
  JsonWriter& value(std::int64_t n);
  JsonWriter& value(std::uint64_t n);
  JsonWriter& value(int n) { return value(static_cast<std::int64_t>(n)); }
  JsonWriter& value(unsigned n) { return value(static_cast<std::uint64_t>(n)); }
  JsonWriter& value(long long n) { return value(static_cast<std::int64_t>(n)); }
  JsonWriter& value(unsigned long long n) { return value(static_cast<std::uint64_t>(n)); }
  JsonWriter& value(double d);  // non-finite numbers are written as null
  JsonWriter& null();
  JsonWriter& raw(std::string_view json);  // an already-serialised JSON value
  template <class T>
  JsonWriter& field(std::string_view name, const T& v) {
    key(name);
    return value(v);
  }
  const std::string& str() const { return out_; }
  std::string take() { return std::move(out_); }

 private:
  void before_value();
  std::string out_;
  std::vector<char> stack_;   // '{' or '['
  bool need_comma_ = false;
  bool after_key_ = false;
};

// Escapes a string for inclusion between JSON quotes (control characters as \u00XX).
std::string json_escape(std::string_view text);

// Parsed JSON value.
struct JsonValue {
  using Object = std::map<std::string, JsonValue, std::less<>>;
  using Array = std::vector<JsonValue>;
  std::variant<std::nullptr_t, bool, double, std::string, std::shared_ptr<Array>, std::shared_ptr<Object>> v;
  // An integer literal's exact value (a double holds integers exactly only up to 2^53, and none
  // above 2^63, where the writer's uint64 sizes and limits go): 1 for one in [0, 2^64) (`integer`),
  // -1 for a negative one in the int64 range (`integer` as its two's complement), 0 otherwise.
  std::uint64_t integer = 0;
  signed char integer_kind = 0;

  bool is_null() const { return v.index() == 0; }
  bool is_bool() const { return v.index() == 1; }
  bool is_number() const { return v.index() == 2; }
  bool is_string() const { return v.index() == 3; }
  bool is_array() const { return v.index() == 4; }
  bool is_object() const { return v.index() == 5; }
  bool as_bool() const;                  // throws std::runtime_error on a type mismatch
  double as_number() const;
  std::int64_t as_int() const;           // number that must be integral
  std::uint64_t as_uint() const;         // number that must be integral and in [0, 2^64)
  const std::string& as_string() const;
  const Array& as_array() const;
  const Object& as_object() const;
  bool has(std::string_view key) const;  // object member exists
  const JsonValue& operator[](std::string_view key) const;  // throws if missing
  const JsonValue& operator[](std::size_t index) const;     // throws if out of range
};

// Parses one JSON document (surrounding whitespace allowed). Throws std::runtime_error with the
// byte offset on malformed input, and on a document of more than `max_values` values (a bound on
// the memory the tree takes: about a hundred bytes a value, where "0," is two bytes of text).
JsonValue parse_json(std::string_view text, std::size_t max_values = SIZE_MAX);

}  // namespace expseg::core
