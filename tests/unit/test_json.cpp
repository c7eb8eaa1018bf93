// JSON writer and parser (lib/core/json.hpp).
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>

#include "core/json.hpp"

using expseg::core::json_escape;
using expseg::core::JsonValue;
using expseg::core::JsonWriter;
using expseg::core::parse_json;

namespace {

// The message of the runtime_error that parse_json throws for `text` ("" if it parsed).
std::string parse_error(std::string_view text) {
  try {
    (void)parse_json(text);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

std::string write_double(double d) {
  JsonWriter w;
  w.value(d);
  return w.take();
}

}  // namespace

TEST_SUITE("json") {

TEST_CASE("json: writer output is compact with commas inserted") {
  JsonWriter w;
  w.begin_object();
  w.field("a", 1);
  w.field("b", "x");
  w.key("c").begin_array().value(true).value(false).null().begin_object().end_object().begin_array().end_array().end_array();
  w.field("d", std::uint64_t{18446744073709551615ull});
  w.field("e", std::int64_t{-9223372036854775807ll - 1});
  w.key("f").raw("{\"g\":[1,2]}");
  w.end_object();
  CHECK(w.str() == R"({"a":1,"b":"x","c":[true,false,null,{},[]],"d":18446744073709551615,"e":-9223372036854775808,"f":{"g":[1,2]}})");
  const JsonValue v = parse_json(w.str());
  CHECK(v["f"]["g"][1].as_int() == 2);
}

TEST_CASE("json: writer escapes quotes, backslash and control characters; UTF-8 passes through") {
  CHECK(json_escape("a\"b\\c") == "a\\\"b\\\\c");
  CHECK(json_escape("\n\r\t\b\f") == "\\n\\r\\t\\b\\f");
  CHECK(json_escape(std::string_view("\x01\x1f\0", 3)) == "\\u0001\\u001f\\u0000");
  CHECK(json_escape("/") == "/");
  CHECK(json_escape("h\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80") == "h\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  JsonWriter w;
  w.begin_object().field("k\"ey", "v\nal").end_object();
  CHECK(w.str() == "{\"k\\\"ey\":\"v\\nal\"}");
}

// An independent UTF-8 check (RFC 3629), by code point.
static bool valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + static_cast<std::size_t>(n) > s.size()) return false;
    std::uint32_t cp = n == 1 ? c : c & (0x7Fu >> n);
    for (int k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + static_cast<std::size_t>(k)]);
      if ((d & 0xC0) != 0x80) return false;
      cp = cp << 6 | (d & 0x3Fu);
    }
    const std::uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += static_cast<std::size_t>(n);
  }
  return true;
}

TEST_CASE("json: UTF-8 text survives write then parse; other bytes become U+FFFD, so the output is always UTF-8") {
  std::mt19937_64 rng(42);
  std::size_t replaced = 0;
  for (int round = 0; round < 500; ++round) {
    std::string s;
    const int n = static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) s += static_cast<char>(rng() % 256);
    JsonWriter w;
    w.begin_array().value(s).end_array();
    CHECK(valid_utf8(w.str()));  // RFC 8259: a file name of Latin-1 bytes must not break a JSON reader
    const JsonValue v = parse_json(w.str());
    if (valid_utf8(s)) {
      REQUIRE(v[0].as_string() == s);
    } else {
      ++replaced;
      CHECK(v[0].as_string().find("\xEF\xBF\xBD") != std::string::npos);
    }
  }
  CHECK(replaced > 100);
  // Every code point, encoded, round-trips unchanged.
  for (int round = 0; round < 500; ++round) {
    std::string s;
    for (int i = 0; i < 20; ++i) {
      std::uint32_t cp = static_cast<std::uint32_t>(rng() % 0x110000);
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xFFFD;
      if (cp < 0x80) s += static_cast<char>(cp);
      else if (cp < 0x800) s += {static_cast<char>(0xC0 | cp >> 6), static_cast<char>(0x80 | (cp & 0x3F))};
      else if (cp < 0x10000) s += {static_cast<char>(0xE0 | cp >> 12), static_cast<char>(0x80 | (cp >> 6 & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
      else s += {static_cast<char>(0xF0 | cp >> 18), static_cast<char>(0x80 | (cp >> 12 & 0x3F)), static_cast<char>(0x80 | (cp >> 6 & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
    }
    REQUIRE(valid_utf8(s));
    JsonWriter w;
    w.begin_array().value(s).end_array();
    REQUIRE(parse_json(w.str())[0].as_string() == s);
  }
  CHECK(json_escape("lat\xE9.csv") == "lat\xEF\xBF\xBD.csv");               // Latin-1 e-acute
  CHECK(json_escape("\xED\xA0\x80") == "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // a surrogate, byte by byte
  CHECK(json_escape("\xC0\xAF") == "\xEF\xBF\xBD\xEF\xBF\xBD");                   // overlong '/'
}

TEST_CASE("json: doubles print plainly when integral, round-trip otherwise, null when not finite") {
  CHECK(write_double(3.0) == "3");
  CHECK(write_double(-2.0) == "-2");
  CHECK(write_double(0.0) == "0");
  CHECK(write_double(1e15) == "1000000000000000");
  CHECK(write_double(0.1) == "0.1");
  CHECK(write_double(0.5) == "0.5");
  CHECK(write_double(std::numeric_limits<double>::quiet_NaN()) == "null");
  CHECK(write_double(std::numeric_limits<double>::infinity()) == "null");
  CHECK(write_double(-std::numeric_limits<double>::infinity()) == "null");
  CHECK(parse_json(write_double(1e300)).as_number() == 1e300);
  std::mt19937_64 rng(7);
  for (int i = 0; i < 2000; ++i) {
    double d;
    const std::uint64_t bits = rng();
    std::memcpy(&d, &bits, sizeof d);
    if (!std::isfinite(d)) continue;
    const std::string text = write_double(d);
    REQUIRE(text.size() <= 24);
    REQUIRE(parse_json(text).as_number() == d);
  }
}

TEST_CASE("json: writer misuse throws logic_error") {
  { JsonWriter w; w.begin_object(); CHECK_THROWS_AS(w.value(1), std::logic_error); }
  { JsonWriter w; w.begin_object(); CHECK_THROWS_AS(w.end_array(), std::logic_error); }
  { JsonWriter w; w.begin_array(); CHECK_THROWS_AS(w.end_object(), std::logic_error); }
  { JsonWriter w; w.begin_array(); CHECK_THROWS_AS(w.key("k"), std::logic_error); }
  { JsonWriter w; CHECK_THROWS_AS(w.key("k"), std::logic_error); }
  { JsonWriter w; w.begin_object().key("a"); CHECK_THROWS_AS(w.key("b"), std::logic_error); }
  { JsonWriter w; w.begin_object().key("a"); CHECK_THROWS_AS(w.end_object(), std::logic_error); }
  { JsonWriter w; w.value(1); CHECK_THROWS_AS(w.value(2), std::logic_error); }
  { JsonWriter w; CHECK_THROWS_AS(w.end_object(), std::logic_error); }
}

TEST_CASE("json: parse values") {
  CHECK(parse_json("null").is_null());
  CHECK(parse_json(" true ").as_bool());
  CHECK_FALSE(parse_json("\n\tfalse\r").as_bool());
  CHECK(parse_json("0").as_int() == 0);
  CHECK(parse_json("-0").as_number() == 0.0);
  CHECK(parse_json("-12").as_int() == -12);
  CHECK(parse_json("1.25").as_number() == 1.25);
  CHECK(parse_json("1e3").as_int() == 1000);
  CHECK(parse_json("2.5E-1").as_number() == 0.25);
  CHECK(parse_json("1E+2").as_int() == 100);
  CHECK(parse_json("1e-400").as_number() == 0.0);  // underflow reads as zero
  CHECK(parse_json("9007199254740993").as_number() == 9007199254740992.0);
  CHECK(parse_json("\"a\\\"b\\\\c\\/d\\b\\f\\n\\r\\t\"").as_string() == "a\"b\\c/d\b\f\n\r\t");
  CHECK(parse_json("[]").as_array().empty());
  CHECK(parse_json("{}").as_object().empty());
  const JsonValue v = parse_json(R"( { "a" : [1, {"b": null}], "c": "x" } )");
  CHECK(v.has("a"));
  CHECK_FALSE(v.has("z"));
  CHECK(v["a"][1]["b"].is_null());
  CHECK(v["c"].as_string() == "x");
  CHECK(v["a"].as_array().size() == 2);
}

TEST_CASE("json: \\u escapes and surrogate pairs decode to UTF-8") {
  CHECK(parse_json(R"("\u0041")").as_string() == "A");
  CHECK(parse_json(R"("\u00e9")").as_string() == "\xc3\xa9");
  CHECK(parse_json(R"("\u20AC")").as_string() == "\xe2\x82\xac");
  CHECK(parse_json(R"("\ud83d\ude00")").as_string() == "\xf0\x9f\x98\x80");
  CHECK(parse_json(R"("\uDBFF\uDFFF")").as_string() == "\xf4\x8f\xbf\xbf");
  CHECK(parse_json(R"("\u0000")").as_string() == std::string(1, '\0'));
  CHECK(parse_json("\"h\xc3\xa9\"").as_string() == "h\xc3\xa9");  // raw UTF-8
  CHECK(parse_error(R"("\ud83d")").find("surrogate") != std::string::npos);
  CHECK(parse_error(R"("\ud83dx")").find("surrogate") != std::string::npos);
  CHECK(parse_error(R"("\ud83d\u0041")").find("surrogate") != std::string::npos);
  CHECK(parse_error(R"("\ude00")").find("surrogate") != std::string::npos);
  CHECK(parse_error(R"("\u12")").find("at byte") != std::string::npos);
  CHECK(parse_error(R"("\u12g4")").find("hex") != std::string::npos);
}

TEST_CASE("json: malformed input is an error that names the byte offset") {
  struct Case {
    const char* text;
    std::size_t offset;
  };
  const Case cases[] = {
      {"", 0},          {"   ", 3},        {"[1,]", 3},      {"{,}", 1},       {"{\"a\"}", 4},
      {"{\"a\":}", 5},  {"[1 2]", 3},      {"01", 1},        {"1.", 2},        {".5", 0},
      {"+1", 0},        {"-", 1},          {"1e", 2},        {"tru", 0},       {"nul", 0},
      {"'a'", 0},       {"[1] x", 4},      {"\"abc", 0},     {"\"a\x01\"", 2}, {"\"\\x\"", 1},
      {"{\"a\":1,\"a\":2}", 7},           {"[", 1},         {"{\"a\":1", 6},  {"1e400", 0},
      {"\xef\xbb\xbf{}", 0},
  };
  for (const Case& c : cases) {
    CAPTURE(c.text);
    const std::string msg = parse_error(c.text);
    REQUIRE_FALSE(msg.empty());
    CHECK(msg.find("at byte " + std::to_string(c.offset) + ":") != std::string::npos);
  }
}

TEST_CASE("json: nesting is limited to 256 levels, and deep hostile input stops where it turns bad") {
  const auto nested = [](int depth) { return std::string(static_cast<std::size_t>(depth), '[') + std::string(static_cast<std::size_t>(depth), ']'); };
  CHECK_NOTHROW(parse_json(nested(256)));
  CHECK(parse_error(nested(257)).find("nesting") != std::string::npos);
  std::string objs;
  for (int i = 0; i < 300; ++i) objs += "{\"a\":";
  CHECK(parse_error(objs).find("nesting") != std::string::npos);
  // The parse stops where the input turns bad, not at its end (the time these take is measured by
  // benchmarks/bench_parse.cpp, parse/json_hostile: no wall-clock bound here).
  CHECK(parse_error(std::string(1 << 20, '[')).find("at byte 256: nesting") != std::string::npos);
  CHECK(parse_error(std::string(1 << 20, 'a')).find("at byte 0") != std::string::npos);
  CHECK(parse_error("\"" + std::string(1 << 20, 'a')).find("at byte 0: unterminated") != std::string::npos);
}

TEST_CASE("json: accessors check types and bounds") {
  const JsonValue v = parse_json(R"({"n":1.5,"i":7,"s":"x","a":[1],"b":true,"big":1e19})");
  CHECK_THROWS_AS((void)v["n"].as_int(), std::runtime_error);
  CHECK_THROWS_AS((void)v["big"].as_int(), std::runtime_error);
  CHECK(v["i"].as_int() == 7);
  CHECK_THROWS_AS((void)v["s"].as_number(), std::runtime_error);
  CHECK_THROWS_AS((void)v["i"].as_string(), std::runtime_error);
  CHECK_THROWS_AS((void)v["s"].as_bool(), std::runtime_error);
  CHECK_THROWS_AS((void)v["a"].as_object(), std::runtime_error);
  CHECK_THROWS_AS((void)v["b"].as_array(), std::runtime_error);
  CHECK_THROWS_AS((void)v["a"][1], std::runtime_error);
  CHECK_THROWS_AS((void)v["missing"], std::runtime_error);
  CHECK_THROWS_AS((void)v["a"]["k"], std::runtime_error);
  CHECK_FALSE(v["a"].has("k"));
  try {
    (void)v["missing"];
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()).find("missing") != std::string::npos);
  }
  CHECK(parse_json("-9223372036854775808").as_int() == std::numeric_limits<std::int64_t>::min());
  CHECK_THROWS_AS((void)parse_json("9223372036854775808").as_int(), std::runtime_error);
}

TEST_CASE("json: integers read back exactly, uint64 ones above int64 and 2^53 included") {
  // The writer prints sizes and limits as uint64: a request of SIZE_MAX bytes, a limit of 2^64 - 1.
  // Read as doubles they were refused above 2^63 and rounded above 2^53.
  expseg::core::JsonWriter w;
  w.begin_array()
      .value(std::numeric_limits<std::uint64_t>::max())
      .value(std::uint64_t{9007199254740993})  // 2^53 + 1: no double holds it
      .value(std::numeric_limits<std::int64_t>::min())
      .value(std::int64_t{-9007199254740993})
      .end_array();
  const JsonValue v = parse_json(w.str());
  CHECK(v[0].as_uint() == std::numeric_limits<std::uint64_t>::max());
  CHECK_THROWS_AS((void)v[0].as_int(), std::runtime_error);
  CHECK(v[1].as_uint() == 9007199254740993u);
  CHECK(v[1].as_int() == 9007199254740993);
  CHECK(v[2].as_int() == std::numeric_limits<std::int64_t>::min());
  CHECK(v[3].as_int() == -9007199254740993);
  CHECK_THROWS_WITH_AS((void)v[3].as_uint(), "JSON number is negative", std::runtime_error);
  CHECK_THROWS_AS((void)parse_json("18446744073709551616").as_uint(), std::runtime_error);  // 2^64
  CHECK(parse_json("1e3").as_uint() == 1000);   // not a literal integer: through the double, still integral
  CHECK_THROWS_AS((void)parse_json("1.5").as_uint(), std::runtime_error);
  CHECK(parse_json("-0").as_int() == 0);
  CHECK(parse_json("-0").as_uint() == 0);
}

TEST_CASE("json regression: a number that is no integer literal is refused past 2^53, not rounded or clamped") {
  // Read through a double, -9223372036854775809 became INT64_MIN and 12345678901234567890.0 became
  // 12345678901234567168: an edited dump's figures changed without an error.
  CHECK_THROWS_WITH_AS((void)parse_json("-9223372036854775809").as_int(), "JSON number is not an integer in the int64 range",
                       std::runtime_error);
  CHECK_THROWS_WITH_AS((void)parse_json("12345678901234567890.0").as_uint(), "JSON number is not an integer in the uint64 range",
                       std::runtime_error);
  CHECK_THROWS_AS((void)parse_json("1e19").as_uint(), std::runtime_error);
  CHECK_THROWS_AS((void)parse_json("-1e300").as_int(), std::runtime_error);
  // Up to 2^53 every integer is exact as a double: still read, in both directions.
  CHECK(parse_json("9007199254740992.0").as_uint() == 9007199254740992u);
  CHECK(parse_json("-9.007199254740992e15").as_int() == -9007199254740992);
  // Integer literals keep their full range.
  CHECK(parse_json("12345678901234567890").as_uint() == 12345678901234567890u);
}

}  // TEST_SUITE

TEST_CASE("json regression: a document of more values than its reader allows is refused while parsing") {
  // An OOM dump of 64 MB of "0," took 4 GB to parse before its members were looked at.
  CHECK(expseg::core::parse_json("[0,0,0]", 4).as_array().size() == 3);
  CHECK_THROWS_WITH_AS((void)expseg::core::parse_json("[0,0,0]", 3), "JSON parse error at byte 5: more values than this document may hold",
                       std::runtime_error);
  CHECK_THROWS_WITH_AS((void)expseg::core::parse_json(R"({"a":{"b":[1,2]}})", 4), doctest::Contains("more values than this document may hold"),
                       std::runtime_error);
  CHECK(expseg::core::parse_json(R"({"a":{"b":[1,2]}})", 5)["a"]["b"][1].as_int() == 2);
}
