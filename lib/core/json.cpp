// Minimal JSON writer and parser (see json.hpp).
#include "core/json.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <system_error>

#include "core/text.hpp"

namespace expseg::core {

// ------------------------------------------------------------------------------------------------
// Writer

namespace {

void append_escaped(std::string& out, std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  // Well-formed UTF-8 passes through, other bytes >= 0x80 become U+FFFD: JSON is UTF-8 (RFC 8259),
  // and file names are arbitrary bytes.
  append_utf8(out, text, [](char ch, std::string& o) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\b': o += "\\b"; break;
      case '\f': o += "\\f"; break;
      case '\n': o += "\\n"; break;
      case '\r': o += "\\r"; break;
      case '\t': o += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          o += "\\u00";
          o += kHex[c >> 4];
          o += kHex[c & 0xf];
        } else {
          o += ch;
        }
    }
  });
}

}  // namespace

std::string json_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  append_escaped(out, text);
  return out;
}

void JsonWriter::before_value() {
  if (stack_.empty()) {
    if (!out_.empty()) throw std::logic_error("JsonWriter: more than one top-level value");
    return;
  }
  if (stack_.back() == '{') {
    if (!after_key_) throw std::logic_error("JsonWriter: value inside an object without a key");
    after_key_ = false;
    return;
  }
  if (need_comma_) out_ += ',';
}

JsonWriter& JsonWriter::begin_object() {
  before_value();
  out_ += '{';
  stack_.push_back('{');
  need_comma_ = false;
  return *this;
}

JsonWriter& JsonWriter::end_object() {
  if (stack_.empty() || stack_.back() != '{' || after_key_)
    throw std::logic_error("JsonWriter: end_object without a matching begin_object (or after a key)");
  stack_.pop_back();
  out_ += '}';
  need_comma_ = true;
  return *this;
}

JsonWriter& JsonWriter::begin_array() {
  before_value();
  out_ += '[';
  stack_.push_back('[');
  need_comma_ = false;
  return *this;
}

JsonWriter& JsonWriter::end_array() {
  if (stack_.empty() || stack_.back() != '[')
    throw std::logic_error("JsonWriter: end_array without a matching begin_array");
  stack_.pop_back();
  out_ += ']';
  need_comma_ = true;
  return *this;
}

JsonWriter& JsonWriter::key(std::string_view name) {
  if (stack_.empty() || stack_.back() != '{') throw std::logic_error("JsonWriter: key outside an object");
  if (after_key_) throw std::logic_error("JsonWriter: two keys in a row");
  if (need_comma_) out_ += ',';
  out_ += '"';
  append_escaped(out_, name);
  out_ += "\":";
  after_key_ = true;
  need_comma_ = true;
  return *this;
}

JsonWriter& JsonWriter::value(std::string_view text) {
  before_value();
  out_ += '"';
  append_escaped(out_, text);
  out_ += '"';
  need_comma_ = true;
  return *this;
}

JsonWriter& JsonWriter::value(bool b) {
  before_value();
  out_ += b ? "true" : "false";
  need_comma_ = true;
  return *this;
}

JsonWriter& JsonWriter::value(std::int64_t n) {
  before_value();
  char buf[24];
  auto r = std::to_chars(buf, buf + sizeof buf, n);
  out_.append(buf, r.ptr);
  need_comma_ = true;
  return *this;
}

JsonWriter& JsonWriter::value(std::uint64_t n) {
  before_value();
  char buf[24];
  auto r = std::to_chars(buf, buf + sizeof buf, n);
  out_.append(buf, r.ptr);
  need_comma_ = true;
  return *this;
}

JsonWriter& JsonWriter::value(double d) {
  if (!std::isfinite(d)) return null();
  before_value();
  char buf[64];
  std::to_chars_result r;
  // Integral values print plainly ("3", not "3e+00"); 2^53 bounds where every integer is exact.
  if (d == std::trunc(d) && std::fabs(d) <= 9007199254740992.0) {
    r = std::to_chars(buf, buf + sizeof buf, static_cast<std::int64_t>(d));
  } else {
    // Shortest text that reads back as the same double (never longer than %.17g), and independent
    // of the C locale, unlike printf.
    r = std::to_chars(buf, buf + sizeof buf, d);
  }
  out_.append(buf, r.ptr);
  need_comma_ = true;
  return *this;
}

JsonWriter& JsonWriter::null() {
  before_value();
  out_ += "null";
  need_comma_ = true;
  return *this;
}

JsonWriter& JsonWriter::raw(std::string_view json) {
  before_value();
  out_ += json;
  need_comma_ = true;
  return *this;
}

// ------------------------------------------------------------------------------------------------
// Value accessors

namespace {

const char* kind_name(const JsonValue& v) {
  switch (v.v.index()) {
    case 0: return "null";
    case 1: return "a bool";
    case 2: return "a number";
    case 3: return "a string";
    case 4: return "an array";
    default: return "an object";
  }
}

// 2^53: every integer up to it is exact as a double.
constexpr double kExactDoubleLimit = 9007199254740992.0;

[[noreturn]] void type_mismatch(const JsonValue& v, const char* expected) {
  throw std::runtime_error(std::string("JSON value is ") + kind_name(v) + ", expected " + expected);
}

}  // namespace

bool JsonValue::as_bool() const {
  if (!is_bool()) type_mismatch(*this, "a bool");
  return std::get<bool>(v);
}

double JsonValue::as_number() const {
  if (!is_number()) type_mismatch(*this, "a number");
  return std::get<double>(v);
}

std::int64_t JsonValue::as_int() const {
  if (is_number() && integer_kind == -1) return static_cast<std::int64_t>(integer);
  if (is_number() && integer_kind == 1 && integer <= static_cast<std::uint64_t>(INT64_MAX)) return static_cast<std::int64_t>(integer);
  const double d = as_number();
  // Not an integer literal (1e3, 5.0, or past int64): only a double that is an exact integer. Past
  // 2^53 a double holds only some integers, so the literal's value may have been rounded: refused,
  // not clamped (-9223372036854775809 would read as INT64_MIN).
  if (d != std::trunc(d) || std::fabs(d) > kExactDoubleLimit) throw std::runtime_error("JSON number is not an integer in the int64 range");
  return static_cast<std::int64_t>(d);
}

std::uint64_t JsonValue::as_uint() const {
  if (is_number() && integer_kind == 1) return integer;
  const double d = as_number();
  if (d < 0.0) throw std::runtime_error("JSON number is negative");
  // As as_int: a double past 2^53 may be a rounded literal (12345678901234567890.0 reads as ...168).
  if (d != std::trunc(d) || d > kExactDoubleLimit) throw std::runtime_error("JSON number is not an integer in the uint64 range");
  return static_cast<std::uint64_t>(d);
}

const std::string& JsonValue::as_string() const {
  if (!is_string()) type_mismatch(*this, "a string");
  return std::get<std::string>(v);
}

const JsonValue::Array& JsonValue::as_array() const {
  if (!is_array()) type_mismatch(*this, "an array");
  return *std::get<std::shared_ptr<Array>>(v);
}

const JsonValue::Object& JsonValue::as_object() const {
  if (!is_object()) type_mismatch(*this, "an object");
  return *std::get<std::shared_ptr<Object>>(v);
}

bool JsonValue::has(std::string_view key) const {
  if (!is_object()) return false;
  const Object& o = *std::get<std::shared_ptr<Object>>(v);
  return o.find(key) != o.end();
}

const JsonValue& JsonValue::operator[](std::string_view key) const {
  const Object& o = as_object();
  auto it = o.find(key);
  if (it == o.end()) throw std::runtime_error("JSON object has no member \"" + json_escape(key) + "\"");
  return it->second;
}

const JsonValue& JsonValue::operator[](std::size_t index) const {
  const Array& a = as_array();
  if (index >= a.size())
    throw std::runtime_error("JSON array index " + std::to_string(index) + " out of range (size " +
                             std::to_string(a.size()) + ")");
  return a[index];
}

// ------------------------------------------------------------------------------------------------
// Parser (RFC 8259). Recursive descent; nesting is bounded so hostile input cannot exhaust the stack.

namespace {

constexpr int kMaxDepth = 256;

class Parser {
 public:
  Parser(std::string_view text, std::size_t max_values) : s_(text), values_left_(max_values) {}

  JsonValue document() {
    skip_ws();
    JsonValue v = value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { fail_at(pos_, what); }
  [[noreturn]] void fail_at(std::size_t at, const std::string& what) const {
    throw std::runtime_error("JSON parse error at byte " + std::to_string(at) + ": " + what);
  }

  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return s_[pos_]; }

  void skip_ws() {
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
      ++pos_;
    }
  }

  void expect_literal(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) != lit) fail("invalid literal");
    pos_ += lit.size();
  }

  JsonValue value(int depth) {
    if (at_end()) fail("unexpected end of input, expected a value");
    if (values_left_-- == 0) fail("more values than this document may hold");
    JsonValue out;
    switch (peek()) {
      case '{': out.v = object(depth + 1); break;
      case '[': out.v = array(depth + 1); break;
      case '"': out.v = string(); break;
      case 't': expect_literal("true"); out.v = true; break;
      case 'f': expect_literal("false"); out.v = false; break;
      case 'n': expect_literal("null"); out.v = nullptr; break;
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) {
          out.v = number(out);
        } else {
          fail(std::string("unexpected character '") + json_escape(std::string_view(&s_[pos_], 1)) + "'");
        }
    }
    return out;
  }

  std::shared_ptr<JsonValue::Object> object(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth));
    ++pos_;  // '{'
    auto obj = std::make_shared<JsonValue::Object>();
    skip_ws();
    if (!at_end() && peek() == '}') {
      ++pos_;
      return obj;
    }
    for (;;) {
      skip_ws();
      if (at_end() || peek() != '"') fail("expected a string key");
      const std::size_t key_at = pos_;
      std::string k = string();
      skip_ws();
      if (at_end() || peek() != ':') fail("expected ':' after an object key");
      ++pos_;
      skip_ws();
      JsonValue v = value(depth);
      if (!obj->emplace(std::move(k), std::move(v)).second) fail_at(key_at, "duplicate object key");
      skip_ws();
      if (at_end()) fail("unexpected end of input inside an object");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return obj;
      }
      fail("expected ',' or '}' in an object");
    }
  }

  std::shared_ptr<JsonValue::Array> array(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth));
    ++pos_;  // '['
    auto arr = std::make_shared<JsonValue::Array>();
    skip_ws();
    if (!at_end() && peek() == ']') {
      ++pos_;
      return arr;
    }
    for (;;) {
      skip_ws();
      arr->push_back(value(depth));
      skip_ws();
      if (at_end()) fail("unexpected end of input inside an array");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return arr;
      }
      fail("expected ',' or ']' in an array");
    }
  }

  unsigned hex4() {
    if (s_.size() - pos_ < 4) fail("truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<unsigned>(c - 'A' + 10);
      else fail("invalid hex digit in a \\u escape");
      ++pos_;
    }
    return v;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  // Raw bytes >= 0x80 are taken as they are (not validated as UTF-8), so text the writer passed
  // through always reads back.
  std::string string() {
    const std::size_t start = pos_;
    ++pos_;  // '"'
    std::string out;
    for (;;) {
      if (at_end()) fail_at(start, "unterminated string");
      const char c = s_[pos_];
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string (must be escaped)");
      if (c != '\\') {
        out += c;
        ++pos_;
        continue;
      }
      ++pos_;
      if (at_end()) fail_at(start, "unterminated string");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          const std::size_t esc_at = pos_ - 2;
          unsigned cp = hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail_at(esc_at, "lone low surrogate in a \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (s_.size() - pos_ < 2 || s_[pos_] != '\\' || s_[pos_ + 1] != 'u')
              fail_at(esc_at, "high surrogate not followed by a \\u low surrogate");
            pos_ += 2;
            const unsigned lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail_at(esc_at, "high surrogate not followed by a low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: fail_at(pos_ - 2, "invalid escape in a string");
      }
    }
  }

  double number(JsonValue& out) {
    const std::size_t start = pos_;
    auto digit = [&] { return !at_end() && peek() >= '0' && peek() <= '9'; };
    if (peek() == '-') ++pos_;
    if (!digit()) fail("expected a digit");
    // Decimal exponent of the leading significant digit, to tell overflow from underflow below.
    long magnitude = 0;
    bool nonzero = false;
    if (peek() == '0') {
      ++pos_;
    } else {
      nonzero = true;
      while (digit()) {
        ++pos_;
        ++magnitude;
      }
      --magnitude;
    }
    if (!at_end() && peek() == '.') {
      ++pos_;
      if (!digit()) fail("expected a digit after '.'");
      long place = -1;
      while (digit()) {
        if (!nonzero && peek() != '0') {
          nonzero = true;
          magnitude = place;
        }
        --place;
        ++pos_;
      }
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      ++pos_;
      bool neg = false;
      if (!at_end() && (peek() == '+' || peek() == '-')) neg = (s_[pos_++] == '-');
      if (!digit()) fail("expected a digit in the exponent");
      long exp = 0;
      while (digit()) {
        if (exp < 1000000) exp = exp * 10 + (peek() - '0');  // saturate: only the sign of overflow matters
        ++pos_;
      }
      magnitude += neg ? -exp : exp;
    }
    double d = 0.0;
    const char* first = s_.data() + start;
    const char* last = s_.data() + pos_;
    auto r = std::from_chars(first, last, d);
    if (r.ec == std::errc::result_out_of_range) {
      if (!nonzero || magnitude < 0) return (*first == '-') ? -0.0 : 0.0;  // underflow
      fail_at(start, "number out of the range of a double");
    }
    if (r.ec != std::errc() || r.ptr != last) fail_at(start, "invalid number");
    // An integer literal (no fraction, no exponent): its exact value too, where it fits.
    if (std::find_if(first, last, [](char c) { return c == '.' || c == 'e' || c == 'E'; }) == last) {
      if (*first == '-') {
        std::int64_t n = 0;
        if (auto ri = std::from_chars(first, last, n); ri.ec == std::errc() && ri.ptr == last) {
          out.integer = static_cast<std::uint64_t>(n);
          out.integer_kind = n < 0 ? -1 : 1;  // "-0" is 0
        }
      } else {
        std::uint64_t n = 0;
        if (auto ru = std::from_chars(first, last, n); ru.ec == std::errc() && ru.ptr == last) {
          out.integer = n;
          out.integer_kind = 1;
        }
      }
    }
    return d;
  }

  std::string_view s_;
  std::size_t pos_ = 0;
  std::size_t values_left_;
};

}  // namespace

JsonValue parse_json(std::string_view text, std::size_t max_values) { return Parser(text, max_values).document(); }

}  // namespace expseg::core
