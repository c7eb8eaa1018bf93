// The HTML A/B report (include/expseg/report.hpp, lib/html_report.cpp): the page is well-formed
// XHTML-compatible markup, has one chart per group with one reserved and one allocated series per
// backend, one OOM marker per failed allocation, a segment map per backend, fetches nothing from the
// network, and escapes odd text.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "expseg/report.hpp"
#include "expseg/scenarios.hpp"
#include "expseg/trace.hpp"

namespace {

using namespace std::string_literals;

// --- a tiny XML well-formedness checker ---------------------------------------------------------
// Every element closed (explicitly, or self-closed), properly nested; every attribute quoted;
// '&' only in the entities XML knows (amp, lt, gt, quot, apos, &#N;, &#xN;); no '<' in text.
// Also an HTML rule: outside <svg>, only void elements may self-close ("<div/>" is an open tag to an
// HTML parser).
struct XmlCheck {
  bool ok = true;
  std::string error;
  std::size_t elements = 0;
};

bool is_name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == ':' || c == '.'; }

bool check_entities(std::string_view text, std::string& error) {
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '&') continue;
    const std::size_t semi = text.find(';', i);
    if (semi == std::string_view::npos || semi - i > 10) {
      error = "bare '&' near: " + std::string(text.substr(i, 20));
      return false;
    }
    const std::string_view ent = text.substr(i + 1, semi - i - 1);
    const bool named = ent == "amp" || ent == "lt" || ent == "gt" || ent == "quot" || ent == "apos";
    bool numeric = ent.size() >= 2 && ent[0] == '#';
    if (numeric)
      for (std::size_t k = 1; k < ent.size(); ++k)
        numeric = numeric && (std::isxdigit(static_cast<unsigned char>(ent[k])) || (k == 1 && ent[k] == 'x'));
    if (!named && !numeric) {
      error = "unknown entity &" + std::string(ent) + ";";
      return false;
    }
  }
  return true;
}

XmlCheck check_xml(std::string_view doc) {
  static const char* const kVoid[] = {"meta", "br", "hr", "img", "input", "link", "col", "area", "base", "wbr", "source"};
  XmlCheck r;
  std::vector<std::string> stack;
  auto fail = [&](const std::string& what, std::size_t at) {
    r.ok = false;
    r.error = what + " at offset " + std::to_string(at) + ": " + std::string(doc.substr(at, 60));
    return r;
  };
  std::size_t i = 0;
  while (i < doc.size()) {
    const std::size_t lt = doc.find('<', i);
    const std::string_view text = doc.substr(i, lt == std::string_view::npos ? std::string_view::npos : lt - i);
    if (!check_entities(text, r.error)) return fail(r.error, i);
    if (text.find('>') != std::string_view::npos && !stack.empty() && stack.back() != "script" && stack.back() != "style") {
      // '>' is legal XML text, but we escape it everywhere except in the script and the style sheet.
      return fail("unescaped '>' in text", i);
    }
    if (lt == std::string_view::npos) break;
    i = lt;
    if (doc.compare(i, 4, "<!--") == 0) {
      const std::size_t end = doc.find("-->", i);
      if (end == std::string_view::npos) return fail("unterminated comment", i);
      i = end + 3;
      continue;
    }
    if (doc.compare(i, 2, "<!") == 0) {  // <!DOCTYPE html>
      const std::size_t end = doc.find('>', i);
      if (end == std::string_view::npos) return fail("unterminated declaration", i);
      i = end + 1;
      continue;
    }
    if (doc.compare(i, 2, "</") == 0) {
      std::size_t j = i + 2;
      while (j < doc.size() && is_name_char(doc[j])) ++j;
      const std::string name(doc.substr(i + 2, j - i - 2));
      if (j >= doc.size() || doc[j] != '>') return fail("malformed end tag", i);
      if (stack.empty() || stack.back() != name) return fail("end tag </" + name + "> does not match <" + (stack.empty() ? "" : stack.back()) + ">", i);
      stack.pop_back();
      i = j + 1;
      continue;
    }
    // Start tag.
    std::size_t j = i + 1;
    while (j < doc.size() && is_name_char(doc[j])) ++j;
    const std::string name(doc.substr(i + 1, j - i - 1));
    if (name.empty()) return fail("'<' that starts no tag", i);
    // Attributes.
    for (;;) {
      while (j < doc.size() && std::isspace(static_cast<unsigned char>(doc[j]))) ++j;
      if (j >= doc.size()) return fail("unterminated tag", i);
      if (doc[j] == '>' || doc.compare(j, 2, "/>") == 0) break;
      const std::size_t a = j;
      while (j < doc.size() && is_name_char(doc[j])) ++j;
      if (j == a) return fail("bad attribute name", j);
      if (j >= doc.size() || doc[j] != '=') return fail("attribute without a value", a);
      ++j;
      if (j >= doc.size() || (doc[j] != '"' && doc[j] != '\'')) return fail("unquoted attribute value", a);
      const char q = doc[j];
      const std::size_t end = doc.find(q, j + 1);
      if (end == std::string_view::npos) return fail("unterminated attribute value", a);
      const std::string_view value = doc.substr(j + 1, end - j - 1);
      if (value.find('<') != std::string_view::npos) return fail("'<' in an attribute value", a);
      if (!check_entities(value, r.error)) return fail(r.error, a);
      j = end + 1;
    }
    ++r.elements;
    if (doc[j] == '/') {
      const bool in_svg = std::find(stack.begin(), stack.end(), "svg") != stack.end() || name == "svg";
      const bool is_void = std::find(std::begin(kVoid), std::end(kVoid), name) != std::end(kVoid);
      if (!in_svg && !is_void) return fail("<" + name + "/> self-closes outside SVG", i);
      i = j + 2;
      continue;
    }
    if (std::find(std::begin(kVoid), std::end(kVoid), name) != std::end(kVoid)) return fail("void element <" + name + "> not self-closed", i);
    stack.push_back(name);
    i = j + 1;
  }
  if (!stack.empty()) {
    r.ok = false;
    r.error = "unclosed <" + stack.back() + ">";
  }
  return r;
}

std::size_t count(std::string_view hay, std::string_view needle) {
  std::size_t n = 0;
  for (std::size_t at = hay.find(needle); at != std::string_view::npos; at = hay.find(needle, at + needle.size())) ++n;
  return n;
}

// The text of each group's <section>.
std::vector<std::string> sections(const std::string& page) {
  std::vector<std::string> out;
  const std::string open = "<section class=\"card group\"";
  for (std::size_t at = page.find(open); at != std::string::npos;) {
    const std::size_t end = page.find("</section>", at);
    REQUIRE(end != std::string::npos);
    out.push_back(page.substr(at, end - at));
    at = page.find(open, end);
  }
  return out;
}

expseg::Config sim_config(expseg::BackendKind backend, const char* extra = "") {
  expseg::Config c = expseg::Config::parse(std::string("device:sim,sim_capacity:80GiB,") + extra);
  c.backend = backend;
  return c;
}

std::vector<expseg::ScenarioResult> run_ab(const char* name) {
  std::vector<expseg::ScenarioResult> v;
  expseg::ScenarioOptions o;
  o.series_points = 300;
  o.snapshot_at_peak = true;
  for (auto b : {expseg::BackendKind::split_merge, expseg::BackendKind::expandable}) v.push_back(expseg::run_scenario(name, sim_config(b, "oom_snapshot:true"), o));
  return v;
}

// A small trace with an odd name: three 1 GiB blocks, the middle one freed, then 2 GiB asked for
// under a 3 GiB limit: live 2 GiB + 2 GiB exceed the limit, so every backend fails that request.
expseg::Trace odd_trace() {
  std::string csv = "Thread,Time,Action,Pointer,Size,Stream\n";
  csv += "1,0,allocate,0x1000,1073741824,0x0\n";
  csv += "1,1,allocate,0x2000,1073741824,0x0\n";
  csv += "1,2,allocate,0x3000,1073741824,0x0\n";
  csv += "1,3,free,0x2000,1073741824,0x0\n";
  csv += "1,4,allocate,0x4000,2147483648,0x0\n";
  csv += "1,5,free,0x1000,1073741824,0x0\n";
  csv += "1,6,free,0x3000,1073741824,0x0\n";
  return expseg::parse_trace(csv, "odd <trace> & \"name\".csv");
}

std::vector<expseg::ReplayResult> replay_ab(const expseg::Trace& t, const char* extra) {
  std::vector<expseg::ReplayResult> v;
  expseg::ReplayOptions o;
  o.series_points = 100;
  o.snapshot_at_peak = true;
  for (auto b : {expseg::BackendKind::split_merge, expseg::BackendKind::expandable}) v.push_back(expseg::replay(t, sim_config(b, extra), o));
  return v;
}

}  // namespace

TEST_CASE("report: the checker itself rejects malformed markup") {
  CHECK(check_xml("<a><b x=\"1\"/></a>").ok == false);  // <b/> outside svg
  CHECK(check_xml("<svg><b x=\"1\"/></svg>").ok);
  CHECK_FALSE(check_xml("<a><b></a></b>").ok);
  CHECK_FALSE(check_xml("<a x=1></a>").ok);
  CHECK_FALSE(check_xml("<a>x & y</a>").ok);
  CHECK_FALSE(check_xml("<a>&nbsp;</a>").ok);
  CHECK_FALSE(check_xml("<div>").ok);
  CHECK_FALSE(check_xml("<meta charset=\"utf-8\">").ok);
  CHECK(check_xml("<!DOCTYPE html><html><head><meta charset=\"utf-8\"/></head><body>a &amp; b &#39; &#xA0;</body></html>").ok);
}

TEST_CASE("report: scenario groups — structure, series, OOM markers, segment maps") {
  std::vector<expseg::ReportGroup> groups;
  std::size_t expected_ooms = 0;
  std::vector<std::size_t> ooms_per_group;
  for (const char* name : {"split-800-500-300", "kv-cache-decode", "cupy-limit"}) {
    const auto runs = run_ab(name);
    for (const auto& r : runs) CHECK(r.device == "sim:80GiB");  // named as replays name it (was "sim:0")
    std::size_t n = 0;
    for (const auto& r : runs) n += r.ooms;
    expected_ooms += n;
    ooms_per_group.push_back(n);
    groups.push_back(expseg::report_group(std::span<const expseg::ScenarioResult>(runs)));
  }
  REQUIRE(expected_ooms >= 3);  // split_merge fails split-800-500-300 and kv-cache-decode; both fail cupy-limit

  expseg::ReportOptions opt;
  opt.title = "test report";
  const std::string page = expseg::render_html_report(groups, opt);

  const XmlCheck x = check_xml(page);
  INFO(x.error);
  REQUIRE(x.ok);
  CHECK(x.elements > 100);
  CHECK(page.rfind("<!DOCTYPE html>", 0) == 0);

  // Nothing fetched from the network: the only URLs are the SVG (and XHTML) namespaces.
  for (const char* scheme : {"http://", "https://"}) {
    for (std::size_t at = page.find(scheme); at != std::string::npos; at = page.find(scheme, at + 1)) {
      const std::string ctx = page.substr(at >= 7 ? at - 7 : 0, 60);
      INFO(ctx);
      const bool ns = page.compare(at, 26, "http://www.w3.org/2000/svg") == 0 || page.compare(at, 28, "http://www.w3.org/1999/xhtml") == 0;
      CHECK(ns);
      CHECK(page.compare(at - 7, 7, "xmlns=\"") == 0);
    }
  }
  CHECK(count(page, "<link") == 0);
  CHECK(count(page, " src=") == 0);
  CHECK(count(page, "url(") == 0);
  CHECK(count(page, "@import") == 0);

  const auto secs = sections(page);
  REQUIRE(secs.size() == groups.size());
  CHECK(count(page, "<svg class=\"chart\"") == groups.size());
  CHECK(count(page, "class=\"oom\"") == expected_ooms);
  for (std::size_t gi = 0; gi < secs.size(); ++gi) {
    const std::string& s = secs[gi];
    INFO(groups[gi].name);
    CHECK(s.find("data-name=\"" + groups[gi].name + "\"") != std::string::npos);
    CHECK(count(s, "<svg class=\"chart\"") == 1);
    std::string title;  // as the page writes it
    for (char c : groups[gi].title) title += c == '\'' ? std::string("&#39;") : std::string(1, c);
    CHECK(s.find("<h2>" + title) != std::string::npos);
    CHECK(s.find("<p class=\"desc\">") != std::string::npos);
    CHECK(count(s, "class=\"oom\"") == ooms_per_group[gi]);
    CHECK(count(s, "<table class=\"summary\"") == 1);
    for (const char* b : {"split_merge", "expandable"}) {
      const std::string be = std::string("data-backend=\"") + b + "\"";
      CHECK(count(s, "<polyline class=\"series\" " + be + " data-kind=\"reserved\"") == 1);
      CHECK(count(s, "<polyline class=\"series\" " + be + " data-kind=\"allocated\"") == 1);
      CHECK(count(s, "<svg class=\"segmap\" xmlns=\"http://www.w3.org/2000/svg\" " + be + " data-moment=\"peak\"") == 1);
      CHECK(count(s, "<tr " + be + ">") == 1);
    }
    // A limit line (every scenario runs under one).
    CHECK(s.find("class=\"limit\"") != std::string::npos);
    // OOM markers carry their verdict in a tooltip.
    if (ooms_per_group[gi]) CHECK(s.find("<g class=\"oom\" data-backend=\"split_merge\"><title>split_merge: out of memory at call") != std::string::npos);
  }
  // The first OOM of split_merge in the split-800-500-300 story: fragmentation, with its map.
  CHECK(secs[0].find("verdict: fragmentation") != std::string::npos);
  CHECK(count(secs[0], "data-moment=\"first-oom\"") == 1);  // expandable does not fail
  CHECK(secs[0].find("CUDA out of memory. Tried to allocate 800.00 MiB") != std::string::npos);
  // The "at a glance" table comes first when there are several groups.
  CHECK(page.find("At a glance") < page.find("<section class=\"card group\""));
}

TEST_CASE("report: replay groups escape odd names and mark every OOM") {
  const expseg::Trace t = odd_trace();
  const auto runs = replay_ab(t, "limit:3GiB");
  std::size_t ooms = 0;
  for (const auto& r : runs) ooms += r.ooms;
  REQUIRE(ooms >= 1);
  for (const auto& r : runs) CHECK(r.device == "sim:80GiB");
  const expseg::ReportGroup g = expseg::report_group(std::span<const expseg::ReplayResult>(runs), "Trace <description> with & and 'quotes'.");
  CHECK(g.name == t.name);
  CHECK(g.x_label == "event");
  CHECK(g.limit_bytes == (std::size_t{3} << 30));

  expseg::ReportOptions opt;
  opt.title = "A <title> & more";
  opt.subtitle = "sub \"title\" <b>not bold</b> from lat\xE9.csv";  // a Latin-1 byte: not UTF-8
  const expseg::ReportGroup groups[] = {g};
  const std::string page = expseg::render_html_report(groups, opt);
  const XmlCheck x = check_xml(page);
  INFO(x.error);
  REQUIRE(x.ok);

  CHECK(page.find("<trace>") == std::string::npos);
  CHECK(page.find("odd &lt;trace&gt; &amp; &quot;name&quot;.csv") != std::string::npos);
  CHECK(page.find("A &lt;title&gt; &amp; more") != std::string::npos);
  CHECK(page.find("<b>not bold</b>") == std::string::npos);
  CHECK(page.find("lat\xEF\xBF\xBD.csv") != std::string::npos);  // U+FFFD: the page stays UTF-8
  CHECK(page.find('\xE9') == std::string::npos);
  CHECK(page.find("Trace &lt;description&gt; with &amp; and &#39;quotes&#39;.") != std::string::npos);
  CHECK(count(page, "class=\"oom\"") == ooms);
  CHECK(count(page, "<svg class=\"chart\"") == 1);
  CHECK(count(page, "<polyline class=\"series\"") == 4);
  CHECK(count(page, "<svg class=\"segmap\"") >= 2);
  // A single group: no "at a glance" table.
  CHECK(page.find("At a glance") == std::string::npos);
}

TEST_CASE("report: a run without series, snapshot or OOMs still renders") {
  expseg::ReportGroup g;
  g.name = "bare";
  g.runs.resize(2);
  g.runs[0].backend = "split_merge";
  g.runs[1].backend = "expandable";
  g.runs[1].ooms = 2;
  g.runs[1].oom_at = {3, 5};
  const expseg::ReportGroup groups[] = {g};
  const std::string page = expseg::render_html_report(groups);
  const XmlCheck x = check_xml(page);
  INFO(x.error);
  CHECK(x.ok);
  CHECK(count(page, "class=\"oom\"") == 2);
  CHECK(count(page, "<svg class=\"chart\"") == 1);
  CHECK(count(page, "<svg class=\"segmap\"") == 0);
}

TEST_CASE("report: write_html_report writes the page and names the path it cannot write") {
  const auto runs = run_ab("split-800-500-300");
  const expseg::ReportGroup groups[] = {expseg::report_group(std::span<const expseg::ScenarioResult>(runs))};
  const std::filesystem::path path = std::filesystem::temp_directory_path() / ("expseg-report-test-" + std::to_string(::getpid()) + ".html");
  expseg::write_html_report(path.string(), groups);
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  CHECK(ss.str() == expseg::render_html_report(groups));
  std::filesystem::remove(path);

  const std::string bad = "/nonexistent-dir-expseg/report.html";
  try {
    expseg::write_html_report(bad, groups);
    FAIL("no exception");
  } catch (const expseg::error& e) {
    CHECK(std::string(e.what()).find(bad) != std::string::npos);
  }
}

TEST_CASE("report: write_html_report says why it cannot write (the system's reason)") {
  const auto runs = run_ab("split-800-500-300");
  const expseg::ReportGroup groups[] = {expseg::report_group(std::span<const expseg::ScenarioResult>(runs))};
  auto what = [&](const std::string& path) {
    try {
      expseg::write_html_report(path, groups);
    } catch (const expseg::error& e) {
      return std::string(e.what());
    }
    return std::string("<no exception>");
  };
  // No "expseg: " of its own: the command line puts "expseg COMMAND: error: " before it.
  CHECK(what("/nonexistent-dir-expseg/report.html") ==
        "cannot write the report to '/nonexistent-dir-expseg/report.html': No such file or directory");
  const std::string dir = std::filesystem::temp_directory_path().string();
  CHECK(what(dir) == "cannot write the report to '" + dir + "': Is a directory");
  if (std::filesystem::exists("/dev/full")) CHECK(what("/dev/full") == "cannot write the report to '/dev/full': No space left on device");
}


TEST_CASE("report regression: a run of one event labels the x axis with distinct whole steps inside the plot") {
  // An x range under 8 steps gave fractional tick steps (0.2): labels "0 0 0 1 1 1" at x = 0.4
  // and the like, and ticks past the plot's right edge (x 1.2 and 1.4 of a range of 1).
  expseg::ReportGroup g;
  g.name = "one";
  g.x_label = "event";
  g.runs.resize(1);
  g.runs[0].backend = "split_merge";
  g.runs[0].length = 1;
  g.runs[0].series.push_back({1, 512, 2 << 20});
  g.runs[0].peak_allocated_bytes = 512;
  g.runs[0].peak_reserved_bytes = 2 << 20;
  const expseg::ReportGroup groups[] = {g};
  const std::string page = expseg::render_html_report(groups);
  REQUIRE(check_xml(page).ok);
  // The x ticks: the labels under the plot (y = 16 + 280 + 19), and the tick lines' x.
  std::vector<std::string> labels;
  const std::string at = "y=\"315\" text-anchor=\"middle\">";
  for (std::size_t p = page.find(at); p != std::string::npos; p = page.find(at, p + 1)) {
    const std::size_t b = p + at.size();
    labels.push_back(page.substr(b, page.find('<', b) - b));
  }
  INFO("labels: " << [&] { std::string s; for (const auto& l : labels) s += l + " "; return s; }());
  REQUIRE(labels.size() >= 2);
  std::vector<std::string> sorted = labels;
  std::sort(sorted.begin(), sorted.end());
  CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
  const std::string tick = "\" y1=\"296\" y2=\"301\"";
  for (std::size_t p = page.find(tick); p != std::string::npos; p = page.find(tick, p + 1)) {
    const std::size_t x2 = page.rfind("x2=\"", p) + 4;
    CHECK(std::stod(page.substr(x2, p - x2)) <= 982.0);  // kL + plot width
  }
}

TEST_CASE("report regression: a tick step of 2.5 labels 2.5 and 7.5, and the x axis takes whole steps") {
  // A 10 GiB limit gave y ticks every 2.5 GiB labelled "0, 2, 5, 8, 10, 12 GiB" (no decimals for a
  // step of at least one unit), and 18 events x ticks every 2.5 labelled "0 2 5 8 10 12 15 18".
  expseg::ReportGroup g;
  g.name = "ticks";
  g.x_label = "event";
  g.limit_bytes = std::size_t{10} << 30;
  g.runs.resize(1);
  g.runs[0].backend = "split_merge";
  g.runs[0].length = 18;
  for (std::uint64_t e = 0; e < 18; ++e) g.runs[0].series.push_back({e, std::int64_t{9} << 30, std::int64_t{9} << 30});
  g.runs[0].peak_allocated_bytes = std::int64_t{9} << 30;
  g.runs[0].peak_reserved_bytes = std::int64_t{9} << 30;
  const expseg::ReportGroup groups[] = {g};
  const std::string page = expseg::render_html_report(groups);
  REQUIRE(check_xml(page).ok);
  for (const char* y : {">0\xC2\xA0GiB</text>", ">2.5\xC2\xA0GiB</text>", ">5\xC2\xA0GiB</text>", ">7.5\xC2\xA0GiB</text>", ">10\xC2\xA0GiB</text>"}) {
    CAPTURE(y);
    CHECK(page.find(y) != std::string::npos);
  }
  CHECK(page.find(">8\xC2\xA0GiB</text>") == std::string::npos);
  std::vector<std::string> labels;
  const std::string at = "y=\"315\" text-anchor=\"middle\">";
  for (std::size_t p = page.find(at); p != std::string::npos; p = page.find(at, p + 1)) {
    const std::size_t b = p + at.size();
    labels.push_back(page.substr(b, page.find('<', b) - b));
  }
  CHECK(labels == std::vector<std::string>{"0", "2", "4", "6", "8", "10", "12", "14", "16", "18"});
}

TEST_CASE("report regression: U+FFFE and U+FFFF in a name become U+FFFD (they are no XML characters)") {
  // Well-formed UTF-8, so they passed through esc(), but XML 1.0 forbids them: an XML parser
  // rejected the page of a trace whose file name held one.
  expseg::ReportGroup g;
  g.name = "trace \xEF\xBF\xBE and \xEF\xBF\xBF.csv";
  g.runs.resize(1);
  g.runs[0].backend = "split_merge";
  const expseg::ReportGroup groups[] = {g};
  const std::string page = expseg::render_html_report(groups);
  CHECK(page.find("\xEF\xBF\xBE") == std::string::npos);
  CHECK(page.find("\xEF\xBF\xBF") == std::string::npos);
  CHECK(page.find("trace \xEF\xBF\xBD and \xEF\xBF\xBD.csv") != std::string::npos);
}

TEST_CASE("report regression: C1 controls, DEL and every noncharacter in a name are replaced (HTML refuses them in text)") {
  expseg::ReportGroup g;
  // U+007F, U+0085, U+FDD0, U+1FFFE, U+10FFFF; U+00A0 and U+FDCF / U+FDF0 are fine and stay.
  g.name = "a\x7F" "b\xC2\x85" "c\xEF\xB7\x90" "d\xF0\x9F\xBF\xBE" "e\xF4\x8F\xBF\xBF" "f\xC2\xA0" "g\xEF\xB7\x8F\xEF\xB7\xB0.csv";
  g.runs.resize(1);
  g.runs[0].backend = "split_merge";
  const expseg::ReportGroup groups[] = {g};
  const std::string page = expseg::render_html_report(groups);
  CHECK(page.find("a b c\xEF\xBF\xBD" "d\xEF\xBF\xBD" "e\xEF\xBF\xBD" "f\xC2\xA0" "g\xEF\xB7\x8F\xEF\xB7\xB0.csv") != std::string::npos);
  for (const char* bad : {"\x7F", "\xC2\x85", "\xEF\xB7\x90", "\xF0\x9F\xBF\xBE", "\xF4\x8F\xBF\xBF"}) CHECK(page.find(bad) == std::string::npos);
  CHECK_MESSAGE(check_xml(page).ok, check_xml(page).error);
}

TEST_CASE("report regression: a limit near 2^64 is labelled with its value, not 0 bytes") {
  expseg::ReportGroup g;
  g.name = "huge limit";
  g.limit_bytes = SIZE_MAX;
  g.runs.resize(1);
  g.runs[0].backend = "split_merge";
  g.runs[0].peak_reserved_bytes = g.runs[0].peak_allocated_bytes = 1 << 20;
  const expseg::ReportGroup groups[] = {g};
  const std::string page = expseg::render_html_report(groups);
  CHECK(page.find("limit 0 bytes") == std::string::npos);
  CHECK(page.find("limit 17179869184.00 GiB (far above the chart)") != std::string::npos);
}

TEST_CASE("report regression: a replay whose requests were refused up front does not say every allocation was served") {
  // One request of 2^64-1 bytes (a negative size cast): refused before any allocator runs, no OOM.
  const std::string csv =
      "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x1000,1048576,0x0\n1,1,allocate,0x2000,18446744073709551615,0x0\n"
      "1,2,free,0x1000,1048576,0x0\n1,3,free,0x2000,18446744073709551615,0x0\n";
  const auto runs = replay_ab(expseg::parse_trace(csv, "refused.csv"), "");
  REQUIRE(runs.size() == 2);
  for (const auto& r : runs) {
    CHECK(r.ooms == 0);
    CHECK(r.refused_requests == 1);
    CHECK(r.skipped_frees == 1);
  }
  const expseg::ReportGroup groups[] = {expseg::report_group(std::span<const expseg::ReplayResult>(runs))};
  const std::string page = expseg::render_html_report(groups);
  CHECK(page.find("Every backend serves every allocation") == std::string::npos);
  CHECK(page.find("No backend runs out of memory; requests of 1 EiB or more were refused up front.") != std::string::npos);
  CHECK(count(page, "1 request of 1 EiB or more refused up front (no OOM of the allocator") == 2);
  CHECK(count(page, "1 free skipped or supplied") == 2);
  CHECK(check_xml(page).ok);
}

TEST_CASE("report regression: with only first-OOM snapshots there is no empty 'peak reserved' heading") {
  // A replay without snapshot_at_peak under oom_snapshot:true keeps the OOM's snapshot only: the
  // page announced "Segment maps at the moment of peak reserved" and drew none under it.
  expseg::ReplayOptions o;
  o.series_points = 100;
  std::vector<expseg::ReplayResult> runs{expseg::replay(odd_trace(), sim_config(expseg::BackendKind::split_merge, "limit:3GiB,oom_snapshot:true"), o)};
  REQUIRE(runs[0].first_oom);
  REQUIRE(runs[0].first_oom->snapshot);
  REQUIRE_FALSE(runs[0].peak_snapshot);
  const expseg::ReportGroup groups[] = {expseg::report_group(std::span<const expseg::ReplayResult>(runs))};
  const std::string page = expseg::render_html_report(groups);
  REQUIRE(check_xml(page).ok);
  CHECK(count(page, "data-moment=\"first-oom\"") == 1);
  CHECK(count(page, "data-moment=\"peak\"") == 0);
  CHECK(page.find("at the moment of peak reserved") == std::string::npos);
  CHECK(page.find("Segment maps at the first OOM") != std::string::npos);
}

TEST_CASE("report: a later OOM's tooltip does not claim the first OOM's verdict") {
  // Every later OOM of a run with no fragmentation OOM read "not fragmentation (capacity like the
  // first)", also where it was a limit OOM: only the first OOM's report is kept.
  expseg::ReportGroup g;
  g.name = "later-ooms";
  g.limit_bytes = std::size_t{1} << 30;
  expseg::ReportRun r;
  r.backend = "expandable";
  r.device = "sim:1GiB";
  r.ooms = 3;
  r.fragmentation_known = true;
  r.fragmentation_ooms = 0;
  r.length = 10;
  r.series = {expseg::SeriesPoint{0, 0, 0}, expseg::SeriesPoint{10, 1, 1}};
  r.oom_at = {2, 5, 8};
  expseg::OomReport first;
  first.verdict = expseg::OomVerdict::capacity;
  first.backend = "expandable";
  r.first_oom = first;
  g.runs.push_back(r);
  const std::string page = expseg::render_html_report(std::span<const expseg::ReportGroup>(&g, 1));
  CHECK(count(page, "class=\"oom\"") == 3);
  CHECK(page.find("verdict: capacity") != std::string::npos);  // the first one's, from its report
  CHECK(page.find("like the first") == std::string::npos);
  CHECK(count(page, "verdict: not fragmentation (limit or capacity)") == 2);
}

TEST_CASE("report: past 200 OOMs a run's markers merge by pixel column, each saying how many it stands for") {
  // One marker per OOM made the page grow without limit: 200,000 OOMs, 52 MB of markers drawn on
  // top of each other.
  constexpr std::size_t kOoms = 200000;
  expseg::ReportGroup g;
  g.name = "many-ooms";
  g.limit_bytes = std::size_t{1} << 30;
  expseg::ReportRun r;
  r.backend = "split_merge";
  r.ooms = kOoms;
  r.fragmentation_known = true;
  r.fragmentation_ooms = kOoms;
  r.length = 3 * kOoms;
  r.series = {expseg::SeriesPoint{0, 0, 0}, expseg::SeriesPoint{3 * kOoms, 1 << 20, 1 << 29}};
  for (std::size_t k = 0; k < kOoms; ++k) r.oom_at.push_back(3 * k + 1);
  expseg::OomReport first;
  first.verdict = expseg::OomVerdict::fragmentation;
  r.first_oom = first;
  g.runs.push_back(r);
  expseg::ReportRun few = r;  // 150 OOMs: one marker each, as before
  few.backend = "expandable";
  few.ooms = 150;
  few.fragmentation_ooms = 150;
  few.oom_at.resize(150);
  g.runs.push_back(few);
  const std::string page = expseg::render_html_report(std::span<const expseg::ReportGroup>(&g, 1));
  const XmlCheck x = check_xml(page);
  INFO(x.error);
  REQUIRE(x.ok);
  CHECK(page.size() < 1000000);

  CHECK(count(page, "<g class=\"oom\" data-backend=\"expandable\"><title>") == 150);
  // Every merged marker: "split_merge: K OOMs between step A and B (I–J of 200000)", K the OOMs in
  // [A, B]; together they count every OOM once.
  const std::string open = "<g class=\"oom\" data-backend=\"split_merge\"";
  const std::size_t markers = count(page, open);
  CHECK(markers > 200);
  CHECK(markers < 1000);  // at most one per pixel column of the plot
  std::size_t total = 0, next = 1;
  for (std::size_t at = page.find(open); at != std::string::npos; at = page.find(open, at + 1)) {
    const std::size_t t = page.find("<title>", at) + 7;
    const std::string title = page.substr(t, page.find("</title>", t) - t);
    INFO(title);
    std::size_t k = 0, a = 0, b = 0, i = 0, j = 0, n = 0;
    REQUIRE(std::sscanf(title.c_str(), "split_merge: %zu OOMs between step %zu and %zu (%zu\xE2\x80\x93%zu of %zu)", &k, &a, &b, &i, &j, &n) == 6);
    CHECK(k == (b - 1) / 3 - (a - 1) / 3 + 1);  // the OOMs at 1, 4, 7, ... in [a, b]
    CHECK(i == next);
    CHECK(j == i + k - 1);
    CHECK(n == kOoms);
    CHECK(page.compare(at + open.size(), 13 + std::to_string(k).size(), " data-ooms=\"" + std::to_string(k) + "\"") == 0);
    CHECK(title.find("verdict: fragmentation") != std::string::npos);
    total += k;
    next = j + 1;
  }
  CHECK(total == kOoms);
}

TEST_CASE("report: a scenario card says when the run's limit or sizes are not the story's") {
  // The card told the story's 2064 MiB limit for a run under --conf limit:1GiB; then it listed the
  // story's own sizes and limit as "overridden" beside a seed that was.
  auto description = [](const char* name, const char* extra, std::size_t min_size = 0, std::size_t max_size = 0, std::uint64_t seed = 0) {
    expseg::ScenarioOptions o;
    o.min_size = min_size;
    o.max_size = max_size;
    o.seed = seed;
    const std::vector<expseg::ScenarioResult> runs{expseg::run_scenario(name, sim_config(expseg::BackendKind::split_merge, extra), o),
                                                   expseg::run_scenario(name, sim_config(expseg::BackendKind::expandable, extra), o)};
    return expseg::report_group(std::span<const expseg::ScenarioResult>(runs)).description;
  };
  const std::string axis = " The chart's x axis counts the allocator's calls: each allocation and each free.";
  const std::string story(expseg::find_scenario("split-800-500-300")->description);
  CHECK(description("split-800-500-300", "") == story + axis);
  CHECK(description("split-800-500-300", "limit:2064MiB") == story + axis);  // the story's own, given
  CHECK(description("split-800-500-300", "limit:1GiB") == story + " This run: limit 1024.00 MiB (the story's default overridden)." + axis);
  const std::string churn(expseg::find_scenario("random-churn")->description);
  CHECK(description("random-churn", "") == churn + axis);
  CHECK(description("random-churn", "", 4096, std::size_t{512} << 20) == churn + axis);
  CHECK(description("random-churn", "", std::size_t{1} << 20, std::size_t{64} << 20) ==
        churn + " This run: sizes 1024.00 KiB\xE2\x80\x93" "64.00 MiB (the story's default overridden)." + axis);
  CHECK(description("random-churn", "limit:2GiB") == churn + " This run: limit 2.00 GiB (the story's default overridden)." + axis);
  CHECK(description("random-churn", "limit:2GiB", std::size_t{1} << 20, std::size_t{64} << 20, 5).ends_with(
      " This run: seed 5, sizes 1024.00 KiB\xE2\x80\x93" "64.00 MiB, limit 2.00 GiB (the story's defaults overridden)." + axis));
}

TEST_CASE("report: the page names the size an OOM tried to allocate as its report does, and the request beside it") {
  // The tooltip and the segment map's heading said "Tried to allocate 419.34 MiB" (the request)
  // where the report said 420.00 MiB (the new segment split_merge asked the device for).
  std::string csv = "Thread,Time,Action,Pointer,Size,Stream\n";
  csv += "1,0,allocate,0x1000,104857600,0x0\n";
  csv += "1,1,allocate,0x2000,439713546,0x0\n";  // 419.34 MiB: a 420 MiB segment, past the limit
  csv += "1,2,free,0x1000,104857600,0x0\n";
  const expseg::Trace t = expseg::parse_trace(csv, "tried.csv");
  expseg::ReplayOptions o;
  o.series_points = 100;
  std::vector<expseg::ReplayResult> runs{expseg::replay(t, sim_config(expseg::BackendKind::split_merge, "limit:500MiB,oom_snapshot:true"), o)};
  REQUIRE(runs[0].first_oom);
  const std::string& message = runs[0].first_oom->message;
  REQUIRE(message.find("Tried to allocate 420.00 MiB.") != std::string::npos);
  REQUIRE(expseg::format_bytes(runs[0].first_oom->requested_bytes) == "419.34 MiB");
  const expseg::ReportGroup groups[] = {expseg::report_group(std::span<const expseg::ReplayResult>(runs))};
  const std::string page = expseg::render_html_report(groups);
  REQUIRE(check_xml(page).ok);
  CHECK(page.find("Tried to allocate 420.00 MiB (requested 419.34 MiB); allocated") != std::string::npos);  // the marker's tooltip
  CHECK(page.find("trying to allocate 420.00 MiB (requested 419.34 MiB)") != std::string::npos);          // the map's heading
  CHECK(page.find("allocate 419.34 MiB") == std::string::npos);

  // A request the report names as it is: no "requested" beside it.
  std::vector<expseg::ReplayResult> exact{expseg::replay(odd_trace(), sim_config(expseg::BackendKind::split_merge, "limit:3GiB"), o)};
  REQUIRE(exact[0].first_oom);
  const expseg::ReportGroup exact_groups[] = {expseg::report_group(std::span<const expseg::ReplayResult>(exact))};
  const std::string exact_page = expseg::render_html_report(exact_groups);
  CHECK(exact_page.find("Tried to allocate 2.00 GiB; allocated") != std::string::npos);
}

TEST_CASE("report: runs that allocated nothing show no reserved/allocated ratio, not 0.00x") {
  expseg::ReportGroup g;
  g.name = "nothing";
  for (const char* b : {"split_merge", "expandable"}) {
    expseg::ReportRun r;
    r.backend = b;
    r.length = 2;
    r.series = {expseg::SeriesPoint{0, 0, 0}, expseg::SeriesPoint{1, 0, 0}};
    g.runs.push_back(r);
  }
  const expseg::ReportGroup groups[] = {g, g};  // two groups: the "at a glance" table too
  const std::string page = expseg::render_html_report(groups);
  REQUIRE(check_xml(page).ok);
  CHECK(page.find("0.00\xC3\x97") == std::string::npos);
  CHECK(page.find("Peak reserved / peak allocated: split_merge \xE2\x80\x94, expandable \xE2\x80\x94.") != std::string::npos);
  CHECK(page.find("0\xC2\xA0" "B reserved, nothing allocated") != std::string::npos);
}

TEST_CASE("report: another seed's card qualifies the story's outcome, and counts fragmentation OOMs by the 98% test") {
  // With --seed 1 the kv-cache card said "expandable segments keep serving them" next to a takeaway
  // of an expandable OOM, and every OOM count came from the first report's verdict ("limit", at 96.2%
  // of the limit: a fragmentation OOM by the project's own test).
  const expseg::ScenarioInfo* info = expseg::find_scenario("kv-cache-decode");
  REQUIRE(info != nullptr);
  const std::string story(info->description);
  const std::string outcome(info->outcome);
  REQUIRE(story.ends_with(outcome));
  CHECK(info->seed == 7);
  auto group = [](std::uint64_t seed) {
    expseg::ScenarioOptions o;
    o.seed = seed;
    const std::vector<expseg::ScenarioResult> runs{expseg::run_scenario("kv-cache-decode", sim_config(expseg::BackendKind::split_merge), o),
                                                   expseg::run_scenario("kv-cache-decode", sim_config(expseg::BackendKind::expandable), o)};
    CHECK(runs[1].seed == (seed ? seed : 7));
    return expseg::report_group(std::span<const expseg::ScenarioResult>(runs));
  };
  const std::string axis = " The chart's x axis counts the allocator's calls: each allocation and each free.";
  CHECK(group(0).description == story + axis);
  CHECK(group(7).description == story + axis);  // the story's own, given
  const expseg::ReportGroup g = group(1);
  CHECK(g.description == story.substr(0, story.size() - outcome.size()) +
                             "With the story's own seed (7), in a split pool the many slightly different sizes fragment the cache until "
                             "sequences are evicted for lack of memory at about half the 384 MiB limit; expandable segments keep serving "
                             "them. This run: seed 1 (the story's default overridden). The chart's x axis counts the allocator's calls: each "
                             "allocation and each free.");
  REQUIRE(g.runs.size() == 2);
  CHECK(g.runs[1].ooms == 1);
  CHECK(g.runs[1].ooms_below_98 == 1);
  CHECK(g.runs[1].first_oom->verdict == expseg::OomVerdict::limit);
  const std::string page = expseg::render_html_report(std::span<const expseg::ReportGroup>(&g, 1));
  CHECK(check_xml(page).ok);
  CHECK(page.find("<p class=\"takeaway bad\">Every backend fails: split_merge 12 OOMs (fragmentation: 12 at \xE2\x89\xA4 98% of the limit); "
                  "expandable 1 OOM (fragmentation: 1 at \xE2\x89\xA4 98% of the limit). Peak reserved / peak allocated: split_merge 1.35\xC3\x97, "
                  "expandable 1.04\xC3\x97.</p>") != std::string::npos);
  CHECK(page.find("<th class=\"l\">first OOM report&#39;s verdict</th>") != std::string::npos);
  CHECK(page.find("<th>OOMs at \xE2\x89\xA4 98% of the limit (fragmentation)</th>") != std::string::npos);
  CHECK(page.find("<td class=\"l\">limit</td><td>368.98 MiB</td><td>384.00 MiB</td><td>1.04\xC3\x97</td><td>1</td><td>1</td>") != std::string::npos);
  CHECK(page.find("<b>Why expandable failed</b> (the first OOM report&#39;s verdict: limit)") != std::string::npos);
}
