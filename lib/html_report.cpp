// The HTML A/B report (see include/expseg/report.hpp): one self-contained page, inline CSS and SVG,
// a few lines of optional JavaScript for hover values. Everything is written as XHTML-compatible
// markup: non-void HTML elements always get an end tag (never "<div/>": an HTML parser would read
// that as an open tag), SVG elements may self-close, every attribute is quoted and every piece of
// text goes through esc(). The script and the style sheet contain no '<' and no '&', so they need
// no CDATA section to be well-formed XML.
#include "expseg/report.hpp"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string_view>

#include "core/text.hpp"
#include "expseg/config.hpp"

namespace expseg {

namespace {

// ---------------------------------------------------------------------------------------------
// Text helpers

std::string esc(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 8);
  // The page is UTF-8: bytes that are not well-formed UTF-8 (a file name may be anything) become
  // U+FFFD.
  core::append_utf8(out, text, [](char c, std::string& o) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&#39;"; break;
      default:
        // Control characters are not allowed in HTML text (nor, below 0x20, in XML 1.0): spaces.
        if ((static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t') || c == '\x7F') o += ' ';
        else o += c;
    }
  });
  // Well-formed UTF-8 that HTML still refuses in text: the C1 controls U+0080-U+009F (spaces, as the
  // C0 ones) and the noncharacters U+FDD0-U+FDEF and U+xFFFE/U+xFFFF of every plane (U+FFFD).
  // out is well-formed UTF-8 here, so a lead byte tells its sequence's length.
  std::string clean;
  for (std::size_t at = 0; at < out.size();) {
    const auto b0 = static_cast<unsigned char>(out[at]);
    const std::size_t len = std::min<std::size_t>(b0 < 0x80 ? 1 : b0 < 0xE0 ? 2 : b0 < 0xF0 ? 3 : 4, out.size() - at);
    char32_t cp = len == 1 ? b0 : len == 2 ? (b0 & 0x1Fu) : len == 3 ? (b0 & 0x0Fu) : (b0 & 0x07u);
    for (std::size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(out[at + k]) & 0x3Fu);
    if (cp >= 0x80 && cp <= 0x9F) clean += ' ';
    else if ((cp >= 0xFDD0 && cp <= 0xFDEF) || (cp & 0xFFFEu) == 0xFFFEu) clean += "\xEF\xBF\xBD";
    else clean.append(out, at, len);
    at += len;
  }
  return clean;
}

// Fixed-point number, locale-independent.
std::string fixed(double v, int decimals) {
  if (!std::isfinite(v)) return "0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, decimals);
  std::string s(buf, r.ptr);
  if (s == "-0" || s == "-0.0" || s == "-0.00") s.erase(0, 1);
  return s;
}

// SVG coordinate: two decimals, trailing zeros dropped.
std::string co(double v) {
  std::string s = fixed(v, 2);
  if (s.find('.') != std::string::npos) {
    while (!s.empty() && s.back() == '0') s.pop_back();
    if (!s.empty() && s.back() == '.') s.pop_back();
  }
  return s;
}

// Compact sizes for axes and headlines: "512 MiB", "1.5 GiB", "80 GiB".
std::string short_bytes(double bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024.0 && u < 5) {
    bytes /= 1024.0;
    ++u;
  }
  std::string s = fixed(bytes, std::fabs(bytes) >= 100 || u == 0 ? 0 : (std::fabs(bytes) >= 10 ? 1 : 2));
  if (s.find('.') != std::string::npos) {
    while (s.back() == '0') s.pop_back();
    if (s.back() == '.') s.pop_back();
  }
  return s + "\xC2\xA0" + units[u];  // no-break space
}

std::string bytes_text(std::int64_t b) { return format_bytes(static_cast<std::size_t>(std::max<std::int64_t>(b, 0))); }

// 1234567 -> "1.23M", 45000 -> "45k".
std::string short_count(double v) {
  auto trim = [](std::string s) {
    if (s.find('.') != std::string::npos) {
      while (s.back() == '0') s.pop_back();
      if (s.back() == '.') s.pop_back();
    }
    return s;
  };
  if (v >= 1e9) return trim(fixed(v / 1e9, 2)) + "G";
  if (v >= 1e6) return trim(fixed(v / 1e6, 2)) + "M";
  if (v >= 1e4) return trim(fixed(v / 1e3, 1)) + "k";
  return trim(fixed(v, 0));
}

std::string seconds_text(double s) {
  if (s < 1e-3) return fixed(s * 1e6, 0) + "\xC2\xA0\xC2\xB5s";
  if (s < 1.0) return fixed(s * 1e3, 1) + "\xC2\xA0ms";
  return fixed(s, 2) + "\xC2\xA0s";
}

std::string plural(std::size_t n, const char* one, const char* many) { return std::to_string(n) + " " + (n == 1 ? one : many); }

// ---------------------------------------------------------------------------------------------
// Colours

struct BackendStyle {
  const char* line;   // series colour
  const char* light;  // fills
};

BackendStyle backend_style(const std::string& backend, std::size_t index) {
  if (backend == "split_merge") return {"#e8590c", "#ffd8a8"};
  if (backend == "expandable") return {"#1971c2", "#a5d8ff"};
  static const BackendStyle others[] = {{"#7048e8", "#d0bfff"}, {"#2f9e44", "#b2f2bb"}, {"#c2255c", "#fcc2d7"}, {"#495057", "#dee2e6"}};
  return others[index % 4];
}

const char* state_colour(BlockState s) {
  switch (s) {
    case BlockState::allocated: return "#4263eb";
    case BlockState::pending_free: return "#fab005";
    case BlockState::free_mapped: return "#ff8787";
    case BlockState::free_unmapped: return "#f1f3f5";
  }
  return "#ced4da";
}

const char* state_label(BlockState s) {
  switch (s) {
    case BlockState::allocated: return "allocated";
    case BlockState::pending_free: return "pending free (waiting for a stream)";
    case BlockState::free_mapped: return "free, memory held (reserved but unallocated)";
    case BlockState::free_unmapped: return "free address range, no memory behind it";
  }
  return "?";
}

constexpr const char* kOomRed = "#e03131";
constexpr const char* kLimitColour = "#c92a2a";

// ---------------------------------------------------------------------------------------------
// Small derived facts

std::string verdict_of(const ReportRun& r) { return r.first_oom ? to_string(r.first_oom->verdict) : ""; }

std::string outcome_of(const ReportRun& r) { return r.ooms == 0 ? "ok" : plural(r.ooms, "OOM", "OOMs"); }

double ratio(const ReportRun& r) {
  return r.peak_allocated_bytes > 0 ? static_cast<double>(r.peak_reserved_bytes) / static_cast<double>(r.peak_allocated_bytes) : 0.0;
}

// The "expseg verdict: ..." sentence of an OOM message (its second line), or the first line.
std::string verdict_sentence(const OomReport& rep) {
  const std::string& m = rep.message;
  std::size_t at = m.find("expseg verdict:");
  if (at == std::string::npos) return m.substr(0, m.find('\n'));
  std::size_t end = m.find('\n', at);
  std::string s = m.substr(at + 15, end == std::string::npos ? std::string::npos : end - at - 15);
  while (!s.empty() && s.front() == ' ') s.erase(0, 1);
  const std::string v = std::string(to_string(rep.verdict)) + ". ";
  if (s.rfind(v, 0) == 0) s.erase(0, v.size());
  return s;
}

// "420.00 MiB (requested 419.34 MiB)": the size the OOM report's first sentence says it tried to
// allocate (split_merge names the new segment's size, as PyTorch does), so that the page and the
// report the user saw name one figure, then the caller's request where it differs. The report's
// figure is read from its message; where the message has none (CuPy's wording names the rounded
// size), the rounded size.
std::string tried_text(const OomReport& rep) {
  constexpr std::string_view kTried = "Tried to allocate ";
  std::string tried = format_bytes(rep.rounded_bytes);
  if (const std::size_t at = rep.message.find(kTried); at != std::string::npos) {
    const std::size_t from = at + kTried.size();
    // "... 420.00 MiB. GPU 0 ..." (or the short report's "... 440401920 bytes on GPU 0 ...")
    const std::size_t end = std::min(rep.message.find(". ", from), rep.message.find(" on GPU", from));
    if (end != std::string::npos && end - from <= 32) tried = rep.message.substr(from, end - from);
  }
  const std::string requested = format_bytes(rep.requested_bytes);
  return tried == requested ? tried : tried + " (requested " + requested + ")";
}

// "fragmentation: 17 at ≤ 98% of the limit", "none at ≤ 98% of the limit" (fill_known runs with OOMs).
std::string below_98_words(const ReportRun& r) {
  if (!r.fill_known || r.ooms == 0) return "";
  return r.ooms_below_98 ? "fragmentation: " + std::to_string(r.ooms_below_98) + " at \xE2\x89\xA4 98% of the limit"
                         : "none at \xE2\x89\xA4 98% of the limit";
}

// What the run's counts say of the verdict of an OOM other than the first (only the first one's
// report is kept).
std::string later_oom_verdict(const ReportRun& r) {
  if (r.fill_known)
    return " \xE2\x80\x94 " + std::to_string(r.ooms_below_98) + " of this run's " + std::to_string(r.ooms) +
           " OOMs were at \xE2\x89\xA4 98% of the limit (fragmentation)";
  if (r.fragmentation_known && r.fragmentation_ooms == r.ooms) return " \xE2\x80\x94 verdict: fragmentation";
  if (r.fragmentation_known && r.fragmentation_ooms == 0)
    return " \xE2\x80\x94 verdict: not fragmentation (limit or capacity)";  // which one, only the first OOM's report says
  if (r.fragmentation_known)
    return " \xE2\x80\x94 " + std::to_string(r.fragmentation_ooms) + " of this run's " + std::to_string(r.ooms) + " OOMs were fragmentation";
  if (r.first_oom) return " \xE2\x80\x94 the first OOM's verdict was " + std::string(to_string(r.first_oom->verdict));
  return "";
}

// The first OOM's verdict and figures, from its report.
std::string first_oom_verdict(const OomReport& rep) {
  return " \xE2\x80\x94 verdict: " + std::string(to_string(rep.verdict)) + ". Tried to allocate " + tried_text(rep) + "; allocated " +
         format_bytes(rep.allocated_bytes) + ", reserved " + format_bytes(rep.reserved_bytes) + ", largest free block " +
         format_bytes(rep.largest_free_block_bytes) + ".";
}

// The tooltip of the k-th OOM marker of a run.
std::string oom_tooltip(const ReportRun& r, std::size_t k, const std::string& x_label, std::uint64_t x) {
  std::string t = r.backend + ": out of memory at " + x_label + " " + std::to_string(x) + " (" + std::to_string(k + 1) + " of " + std::to_string(r.ooms) + ")";
  return t + (k == 0 && r.first_oom ? first_oom_verdict(*r.first_oom) : later_oom_verdict(r));
}

// The tooltip of a marker that stands for the OOMs first..last (indexes into oom_at) of a run.
std::string merged_oom_tooltip(const ReportRun& r, std::size_t first, std::size_t last, const std::string& x_label) {
  std::string t = r.backend + ": " + std::to_string(last - first + 1) + " OOMs between " + x_label + " " + std::to_string(r.oom_at[first]) + " and " +
                  std::to_string(r.oom_at[last]) + " (" + std::to_string(first + 1) + "\xE2\x80\x93" + std::to_string(last + 1) + " of " +
                  std::to_string(r.ooms) + ")";
  return t + (first == 0 && r.first_oom ? "; the first" + first_oom_verdict(*r.first_oom) : later_oom_verdict(r));
}

// Peak reserved over peak allocated, "1.37×"; "—" when nothing was allocated (no ratio).
std::string ratio_text(const ReportRun& r) {
  return r.peak_allocated_bytes > 0 ? fixed(ratio(r), 2) + "\xC3\x97" : std::string("\xE2\x80\x94");
}

// One-sentence takeaway of a group.
std::string takeaway(const ReportGroup& g) {
  if (g.runs.empty()) return "No runs.";
  std::vector<const ReportRun*> failed, fine;
  for (const ReportRun& r : g.runs) (r.ooms ? failed : fine).push_back(&r);
  auto names = [](const std::vector<const ReportRun*>& v) {
    std::string s;
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? (i + 1 == v.size() ? " and " : ", ") : "") + v[i]->backend;
    return s;
  };
  std::string s;
  if (!failed.empty() && !fine.empty()) {
    s = names(failed) + " runs out of memory";
    if (failed.size() == 1 && failed[0]->fill_known) s += " (" + outcome_of(*failed[0]) + ", " + below_98_words(*failed[0]) + ")";
    else if (failed.size() == 1 && failed[0]->first_oom) s += " (" + verdict_of(*failed[0]) + ")";
    s += " where " + names(fine) + (fine.size() == 1 ? " succeeds." : " succeed.");
  } else if (!failed.empty()) {
    s = g.runs.size() == 1 ? "The run fails: " : "Every backend fails: ";
    for (std::size_t i = 0; i < failed.size(); ++i) {
      if (i) s += "; ";
      s += failed[i]->backend + " " + outcome_of(*failed[i]);
      if (failed[i]->fill_known) s += " (" + below_98_words(*failed[i]) + ")";
      else if (failed[i]->first_oom) s += " (first: " + verdict_of(*failed[i]) + ")";
    }
    s += ".";
  } else if (std::any_of(g.runs.begin(), g.runs.end(), [](const ReportRun& r) { return r.refused_requests != 0; })) {
    // Not "every allocation": requests the trace made were refused before any allocator ran.
    s = g.runs.size() == 1 ? "The run has no OOM; requests of 1 EiB or more were refused up front."
                           : "No backend runs out of memory; requests of 1 EiB or more were refused up front.";
  } else {
    s = g.runs.size() == 1 ? "No allocation fails." : "Every backend serves every allocation.";
  }
  if (g.runs.size() >= 2) {
    s += " Peak reserved / peak allocated: ";
    for (std::size_t i = 0; i < g.runs.size(); ++i) {
      if (i) s += ", ";
      s += g.runs[i].backend + " " + ratio_text(g.runs[i]);
    }
    s += ".";
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Axis ticks

double nice_step(double raw) {
  if (raw <= 0) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / p;
  const double n = f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10;
  return n * p;
}

// The decimals that show every multiple of `step` exactly: a step of 2.5 needs one ("7.5", not "8").
int step_decimals(double step) {
  for (int d = 0; d < 3; ++d) {
    const double scaled = step * std::pow(10.0, d);
    if (std::fabs(scaled - std::round(scaled)) < 1e-9 * std::max(1.0, scaled)) return d;
  }
  return 3;
}

// Byte ticks: a nice step in one unit that suits the whole range, so every label reads alike
// ("0.5 GiB, 1 GiB, 1.5 GiB", not "512 MiB, 1 GiB").
struct ByteTicks {
  double step;
  double unit;
  const char* unit_name;
  std::string label(double v) const {
    const double x = v / unit;
    std::string s = fixed(x, step_decimals(step / unit));
    if (s.find('.') != std::string::npos) {
      while (s.back() == '0') s.pop_back();
      if (s.back() == '.') s.pop_back();
    }
    return s + "\xC2\xA0" + unit_name;
  }
};
ByteTicks byte_ticks(double max_bytes, int target) {
  static const std::pair<double, const char*> units[] = {{1.0, "B"}, {1024.0, "KiB"}, {1048576.0, "MiB"}, {1073741824.0, "GiB"}, {1099511627776.0, "TiB"}};
  std::pair<double, const char*> unit = units[0];
  for (const auto& u : units)
    if (max_bytes >= u.first) unit = u;
  return {nice_step(max_bytes / unit.first / target) * unit.first, unit.first, unit.second};
}

// ---------------------------------------------------------------------------------------------
// The chart

// Lines of earlier backends are drawn wider and first, so that where two backends hold exactly the
// same bytes (often), both colours stay visible: the later line runs inside the earlier one.
double line_width(bool reserved, std::size_t run, std::size_t runs) {
  const double base = reserved ? 2.0 : 1.4;
  return base + (reserved ? 1.6 : 1.3) * static_cast<double>(runs - 1 - std::min(run, runs - 1));
}

constexpr double kW = 1000, kH = 340;
constexpr double kL = 76, kR = 18, kT = 16, kB = 44;
constexpr std::size_t kMaxOomMarkers = 200;  // per run; more are merged by pixel column

void chart(std::string& o, const ReportGroup& g) {
  std::uint64_t xmax = 1;
  double ymax_data = 0;
  for (const ReportRun& r : g.runs) {
    xmax = std::max<std::uint64_t>(xmax, r.length);
    for (const SeriesPoint& p : r.series) {
      xmax = std::max<std::uint64_t>(xmax, p.event);
      ymax_data = std::max(ymax_data, static_cast<double>(std::max(p.reserved, p.allocated)));
    }
    for (std::uint64_t x : r.oom_at) xmax = std::max<std::uint64_t>(xmax, x);
    ymax_data = std::max(ymax_data, static_cast<double>(r.peak_reserved_bytes));
  }
  // The reference line: the limit, or the device's capacity when there is none.
  const bool has_limit = g.limit_bytes != 0;
  // The label from the integer: a double of a limit near 2^64 rounds to 2^64, which converts back to
  // size_t as undefined behaviour (it printed "limit 0 bytes").
  const std::size_t ref_bytes = has_limit ? g.limit_bytes : g.device_total_bytes;
  const double ref = static_cast<double>(ref_bytes);
  const char* ref_name = has_limit ? "limit" : "device capacity";
  const bool ref_on_chart = ref > 0 && (ymax_data <= 0 || ref <= 2.5 * ymax_data);
  double ymax = std::max(ymax_data, ref_on_chart ? ref : 0.0) * 1.08;
  if (ymax <= 0) ymax = 1024.0 * 1024 * 1024;
  const ByteTicks yt = byte_ticks(ymax, 5);
  ymax = std::ceil(ymax / yt.step - 1e-9) * yt.step;

  const double pw = kW - kL - kR, ph = kH - kT - kB;
  auto X = [&](double x) { return kL + pw * x / static_cast<double>(xmax); };
  auto Y = [&](double y) { return kT + ph * (1.0 - y / ymax); };

  o += "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 " + co(kW) + " " + co(kH) +
       "\" role=\"img\" preserveAspectRatio=\"xMidYMid meet\" data-x0=\"" + co(kL) + "\" data-x1=\"" + co(kL + pw) + "\" data-y0=\"" + co(kT + ph) +
       "\" data-y1=\"" + co(kT) + "\" data-xmax=\"" + std::to_string(xmax) + "\" data-ymax=\"" + co(ymax) + "\" data-xlabel=\"" + esc(g.x_label) + "\">\n";
  o += "<title>" + esc((g.title.empty() ? g.name : g.title) + ": allocated (dashed) and reserved (solid) bytes over time, per backend") + "</title>\n";
  o += "<rect class=\"plot\" x=\"" + co(kL) + "\" y=\"" + co(kT) + "\" width=\"" + co(pw) + "\" height=\"" + co(ph) + "\" fill=\"#ffffff\" stroke=\"#dee2e6\"/>\n";

  // Grid and axes.
  o += "<g class=\"axis\" font-size=\"12\" fill=\"#495057\">\n";
  for (double v = 0; v <= ymax + 1; v += yt.step) {
    const double y = Y(v);
    o += "<line x1=\"" + co(kL) + "\" x2=\"" + co(kL + pw) + "\" y1=\"" + co(y) + "\" y2=\"" + co(y) + "\" stroke=\"#f1f3f5\"/>";
    o += "<text x=\"" + co(kL - 8) + "\" y=\"" + co(y + 4) + "\" text-anchor=\"end\">" + esc(yt.label(v)) + "</text>\n";
  }
  // Whole steps: x counts calls or events (a run shorter than 8 would get 0.2, labels repeating; a
  // step of 2.5 would label "2, 5, 8" where the ticks stand at 2.5, 5, 7.5).
  double xs = std::max(1.0, nice_step(static_cast<double>(xmax) / 8));
  if (xs != std::floor(xs)) xs = std::floor(xs);
  for (double v = 0; v <= static_cast<double>(xmax) + 0.5; v += xs) {
    const double x = X(v);
    o += "<line x1=\"" + co(x) + "\" x2=\"" + co(x) + "\" y1=\"" + co(kT + ph) + "\" y2=\"" + co(kT + ph + 5) + "\" stroke=\"#adb5bd\"/>";
    o += "<text x=\"" + co(x) + "\" y=\"" + co(kT + ph + 19) + "\" text-anchor=\"middle\">" + esc(short_count(v)) + "</text>\n";
  }
  o += "<text x=\"" + co(kL + pw / 2) + "\" y=\"" + co(kH - 6) + "\" text-anchor=\"middle\" fill=\"#868e96\">" + esc(g.x_label) + "</text>\n";
  o += "</g>\n";

  // Samples are values after an event: drawn as steps (hold until the next sample), from 0 at x 0.
  auto steps = [&](const ReportRun& r, bool reserved) {
    std::vector<std::pair<double, double>> v;
    if (r.series.empty()) return v;
    if (r.series.front().event > 0) v.emplace_back(X(0), Y(0));
    for (std::size_t k = 0; k < r.series.size(); ++k) {
      const SeriesPoint& p = r.series[k];
      const double y = Y(static_cast<double>(reserved ? p.reserved : p.allocated));
      if (!v.empty()) v.emplace_back(X(static_cast<double>(p.event)), v.back().second);
      v.emplace_back(X(static_cast<double>(p.event)), y);
    }
    // Hold the last value to the end of the run.
    v.emplace_back(X(static_cast<double>(std::max<std::uint64_t>(r.length, r.series.back().event))), v.back().second);
    return v;
  };
  auto points = [](const std::vector<std::pair<double, double>>& v) {
    std::string pts;
    for (const auto& [x, y] : v) pts += co(x) + "," + co(y) + " ";
    if (!pts.empty()) pts.pop_back();
    return pts;
  };

  // Reserved-but-unallocated bands, then allocated (dashed), then reserved (solid).
  for (std::size_t i = 0; i < g.runs.size(); ++i) {
    const ReportRun& r = g.runs[i];
    if (r.series.empty()) continue;
    const BackendStyle st = backend_style(r.backend, i);
    std::vector<std::pair<double, double>> band = steps(r, true);
    const std::vector<std::pair<double, double>> low = steps(r, false);
    band.insert(band.end(), low.rbegin(), low.rend());
    const std::string pts = points(band);
    o += "<polygon class=\"gap\" data-backend=\"" + esc(r.backend) + "\" points=\"" + pts + "\" fill=\"" + st.line + "\" fill-opacity=\"0.10\" stroke=\"none\"/>\n";
  }
  for (const char* kind : {"allocated", "reserved"}) {
    const bool reserved = kind[0] == 'r';
    for (std::size_t i = 0; i < g.runs.size(); ++i) {
      const ReportRun& r = g.runs[i];
      const BackendStyle st = backend_style(r.backend, i);
      const std::string pts = points(steps(r, reserved));
      o += "<polyline class=\"series\" data-backend=\"" + esc(r.backend) + "\" data-kind=\"" + kind + "\" points=\"" + pts + "\" fill=\"none\" stroke=\"" +
           st.line + "\" stroke-width=\"" + co(line_width(reserved, i, g.runs.size())) + "\" stroke-linejoin=\"round\"" +
           (reserved ? "" : " stroke-dasharray=\"6 4\"") + "><title>" + esc(r.backend + " " + kind + " bytes") + "</title></polyline>\n";
    }
  }

  // The limit (or the device's capacity).
  if (ref > 0) {
    if (ref_on_chart) {
      const double y = Y(ref);
      o += "<g class=\"limit\"><line x1=\"" + co(kL) + "\" x2=\"" + co(kL + pw) + "\" y1=\"" + co(y) + "\" y2=\"" + co(y) + "\" stroke=\"" + kLimitColour +
           "\" stroke-width=\"1.5\" stroke-dasharray=\"2 3\"/><text x=\"" + co(kL + 8) + "\" y=\"" + co(y - 6) +
           "\" text-anchor=\"start\" font-size=\"12\" font-weight=\"600\" fill=\"" + kLimitColour + "\" stroke=\"#ffffff\" stroke-width=\"3\" paint-order=\"stroke\">" +
           esc(std::string(ref_name) + " " + format_bytes(ref_bytes)) + "</text></g>\n";
    } else {
      o += "<g class=\"limit\"><text x=\"" + co(kL + pw - 6) + "\" y=\"" + co(kT + 14) + "\" text-anchor=\"end\" font-size=\"12\" fill=\"" + kLimitColour + "\">" +
           esc(std::string("\xE2\x86\x91 ") + ref_name + " " + format_bytes(ref_bytes) + " (far above the chart)") + "</text></g>\n";
    }
  }

  // OOM markers, on the backend's reserved series: one per OOM up to kMaxOomMarkers; past that,
  // one per pixel column holding OOMs (a run of 200,000 OOMs made a 52 MB page of markers drawn
  // on top of each other).
  for (std::size_t i = 0; i < g.runs.size(); ++i) {
    const ReportRun& r = g.runs[i];
    const BackendStyle st = backend_style(r.backend, i);
    auto reserved_at = [&](std::uint64_t x) {
      if (r.series.empty()) return static_cast<double>(r.peak_reserved_bytes);
      // The last sample at or before x (samples are in x order).
      auto it = std::upper_bound(r.series.begin(), r.series.end(), x, [](std::uint64_t v, const SeriesPoint& p) { return v < p.event; });
      return static_cast<double>((it == r.series.begin() ? *it : *(it - 1)).reserved);
    };
    auto marker = [&](std::uint64_t x, const std::string& title, std::size_t ooms) {
      const double cx = X(static_cast<double>(x)), cy = Y(reserved_at(x));
      o += "<g class=\"oom\" data-backend=\"" + esc(r.backend) + "\"" + (ooms > 1 ? " data-ooms=\"" + std::to_string(ooms) + "\"" : std::string()) +
           "><title>" + esc(title) + "</title>";
      if (i % 2 == 0) {
        o += "<circle cx=\"" + co(cx) + "\" cy=\"" + co(cy) + "\" r=\"5.5\" fill=\"" + kOomRed + "\" stroke=\"" + st.line + "\" stroke-width=\"2\"/>";
      } else {
        o += "<path d=\"M" + co(cx) + " " + co(cy - 7) + "L" + co(cx + 7) + " " + co(cy) + "L" + co(cx) + " " + co(cy + 7) + "L" + co(cx - 7) + " " + co(cy) +
             "Z\" fill=\"" + kOomRed + "\" stroke=\"" + st.line + "\" stroke-width=\"2\"/>";
      }
      o += "</g>\n";
    };
    if (r.oom_at.size() <= kMaxOomMarkers) {
      for (std::size_t k = 0; k < r.oom_at.size(); ++k) marker(r.oom_at[k], oom_tooltip(r, k, g.x_label, r.oom_at[k]), 1);
      continue;
    }
    // oom_at is in x order: each column's OOMs are consecutive.
    for (std::size_t first = 0; first < r.oom_at.size();) {
      const auto column = static_cast<std::int64_t>(std::floor(X(static_cast<double>(r.oom_at[first]))));
      std::size_t last = first;
      while (last + 1 < r.oom_at.size() && static_cast<std::int64_t>(std::floor(X(static_cast<double>(r.oom_at[last + 1])))) == column) ++last;
      marker(r.oom_at[first], first == last ? oom_tooltip(r, first, g.x_label, r.oom_at[first]) : merged_oom_tooltip(r, first, last, g.x_label),
             last - first + 1);
      first = last + 1;
    }
  }
  // Hover crosshair (the script moves it; hidden without the script).
  o += "<line class=\"cross\" x1=\"0\" x2=\"0\" y1=\"" + co(kT) + "\" y2=\"" + co(kT + ph) + "\" stroke=\"#343a40\" stroke-width=\"1\" visibility=\"hidden\"/>\n";
  o += "</svg>\n";
}

// ---------------------------------------------------------------------------------------------
// Segment maps

struct MapFacts {
  std::size_t segments = 0;
  std::size_t va = 0, mapped = 0;
  std::size_t by_state[4] = {0, 0, 0, 0};
  std::size_t free_blocks = 0, largest_free = 0;
};

MapFacts facts(const Snapshot& s) {
  MapFacts f;
  f.segments = s.segments.size();
  for (const SegmentInfo& seg : s.segments) {
    f.va += seg.size;
    f.mapped += seg.mapped_bytes;
    for (const BlockInfo& b : seg.blocks) {
      f.by_state[static_cast<int>(b.state)] += b.size;
      if (b.state == BlockState::free_mapped) {
        ++f.free_blocks;
        f.largest_free = std::max(f.largest_free, b.size);
      }
    }
  }
  return f;
}

constexpr double kMapW = 1000, kRowH = 20, kRowGap = 7;
constexpr std::size_t kMaxRows = 24;

// Bytes per map row shared by every map of a group, so that the maps compare at a glance.
double map_row_bytes(const std::vector<const Snapshot*>& snaps) {
  double largest = 0, total = 0;
  for (const Snapshot* s : snaps) {
    double t = 0;
    for (const SegmentInfo& seg : s->segments) {
      largest = std::max(largest, static_cast<double>(seg.size));
      t += static_cast<double>(seg.size);
    }
    total = std::max(total, t);
  }
  return std::max({largest, total / 12.0, 1.0});
}

void segment_map(std::string& o, const Snapshot& s, const ReportRun& r, std::size_t run_index, const char* moment, const std::string& when, double row_bytes) {
  const BackendStyle st = backend_style(r.backend, run_index);
  const MapFacts f = facts(s);
  const bool expandable_like = f.by_state[static_cast<int>(BlockState::free_unmapped)] != 0 || f.va != f.mapped;

  o += "<div class=\"map\">\n<div class=\"maphead\"><span class=\"dot\" style=\"background:" + std::string(st.line) + "\"></span><b>" + esc(r.backend) + "</b> " +
       esc(when) + " \xE2\x80\x94 " + esc(plural(f.segments, "segment", "segments")) + ", reserved " + esc(format_bytes(f.mapped)) +
       ", allocated " + esc(format_bytes(f.by_state[0] + f.by_state[1]));
  if (expandable_like) o += ", address range in use " + esc(format_bytes(f.va));
  if (f.free_blocks == 0)
    o += "; nothing reserved but unallocated</div>\n";
  else
    o += "; <span class=\"waste\">reserved but unallocated " + esc(format_bytes(f.by_state[static_cast<int>(BlockState::free_mapped)])) + " in " +
         esc(plural(f.free_blocks, "block", "blocks")) + ", largest " + esc(format_bytes(f.largest_free)) + "</span></div>\n";

  // Flow layout: segments in address order, left to right, wrapping into rows of row_bytes.
  const double gap = s.segments.size() > 150 ? 0.0 : 3.0;
  struct Placed {
    const SegmentInfo* seg;
    double x, w;
    std::size_t row;
  };
  std::vector<Placed> placed;
  double cx = 0;
  std::size_t row = 0, dropped = 0;
  std::size_t dropped_bytes = 0;
  for (const SegmentInfo& seg : s.segments) {
    const double w = std::max(kMapW * static_cast<double>(seg.size) / row_bytes, 0.6);
    if (cx > 0 && cx + w > kMapW + 0.01) {
      ++row;
      cx = 0;
    }
    if (row >= kMaxRows) {
      ++dropped;
      dropped_bytes += seg.size;
      continue;
    }
    placed.push_back({&seg, cx, std::min(w, kMapW), row});
    cx += w + gap;
  }
  const std::size_t rows = placed.empty() ? 1 : placed.back().row + 1;
  const double h = static_cast<double>(rows) * (kRowH + kRowGap) + (dropped ? 18.0 : 0.0);

  o += "<svg class=\"segmap\" xmlns=\"http://www.w3.org/2000/svg\" data-backend=\"" + esc(r.backend) + "\" data-moment=\"" + moment + "\" viewBox=\"0 0 " +
       co(kMapW) + " " + co(h) + "\" preserveAspectRatio=\"xMinYMin meet\" role=\"img\">\n";
  o += "<title>" + esc(r.backend + " segments " + when + ": each bar is one segment, scaled to its size; colours are block states") + "</title>\n";
  if (placed.empty()) {
    o += "<text x=\"4\" y=\"14\" font-size=\"12\" fill=\"#868e96\">no segments: the allocator held no memory</text>\n";
  }
  for (const Placed& p : placed) {
    const SegmentInfo& seg = *p.seg;
    const double y = static_cast<double>(p.row) * (kRowH + kRowGap);
    // Bytes per state in this segment: the most common state is the background.
    std::size_t per[4] = {0, 0, 0, 0};
    for (const BlockInfo& b : seg.blocks) per[static_cast<int>(b.state)] += b.size;
    int bg = 0;
    for (int k = 1; k < 4; ++k)
      if (per[k] > per[bg]) bg = k;
    char addr[32];
    std::snprintf(addr, sizeof addr, "0x%llx", static_cast<unsigned long long>(seg.address));
    std::string tip = std::string("segment ") + addr + ": " + format_bytes(seg.size) + (seg.small_pool ? " (small pool)" : "") + ", " +
                      plural(seg.blocks.size(), "block", "blocks");
    for (int k = 0; k < 4; ++k)
      if (per[k]) tip += "; " + std::string(to_string(static_cast<BlockState>(k))) + " " + format_bytes(per[k]);
    o += "<g class=\"seg\"><title>" + esc(tip) + "</title>";
    o += "<rect x=\"" + co(p.x) + "\" y=\"" + co(y) + "\" width=\"" + co(p.w) + "\" height=\"" + co(kRowH) + "\" fill=\"" +
         state_colour(static_cast<BlockState>(bg)) + "\"/>";
    // Runs of blocks in one state; runs thinner than half a pixel are pooled and drawn in the
    // pool's majority state, so the element count stays bounded by the map's width.
    const double scale = seg.size ? p.w / static_cast<double>(seg.size) : 0.0;
    double run_x = p.x, run_w = 0;
    std::size_t pool[4] = {0, 0, 0, 0};
    auto flush = [&] {
      if (run_w <= 0) return;
      int best = 0;
      for (int k = 1; k < 4; ++k)
        if (pool[k] > pool[best]) best = k;
      if (best != bg)
        o += "<rect x=\"" + co(run_x) + "\" y=\"" + co(y) + "\" width=\"" + co(run_w) + "\" height=\"" + co(kRowH) + "\" fill=\"" +
             state_colour(static_cast<BlockState>(best)) + "\"/>";
      run_x += run_w;
      run_w = 0;
      std::fill(std::begin(pool), std::end(pool), 0);
    };
    int run_state = -1;
    for (const BlockInfo& b : seg.blocks) {
      const double w = static_cast<double>(b.size) * scale;
      const int k = static_cast<int>(b.state);
      // A new state after a run that is already wide enough: close the run.
      if (run_state != -1 && k != run_state && run_w >= 0.5) flush();
      pool[k] += b.size;
      run_w += w;
      run_state = k;
    }
    flush();
    o += "<rect x=\"" + co(p.x) + "\" y=\"" + co(y) + "\" width=\"" + co(p.w) + "\" height=\"" + co(kRowH) +
         "\" fill=\"none\" stroke=\"#868e96\" stroke-width=\"0.8\"/></g>\n";
  }
  if (dropped) {
    o += "<text x=\"4\" y=\"" + co(static_cast<double>(rows) * (kRowH + kRowGap) + 11) + "\" font-size=\"12\" fill=\"#868e96\">" +
         esc("\xE2\x80\xA6 and " + plural(dropped, "more segment", "more segments") + " (" + format_bytes(dropped_bytes) + ") not drawn") + "</text>\n";
  }
  o += "</svg>\n</div>\n";
}

// ---------------------------------------------------------------------------------------------
// Page pieces

const char* kStyle = R"CSS(
:root { --ink: #212529; --muted: #6c757d; --line: #dee2e6; }
* { box-sizing: border-box; }
body { margin: 0; background: #f1f3f5; color: var(--ink); font: 14px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 20px 48px; }
header h1 { margin: 0 0 2px; font-size: 26px; letter-spacing: -0.01em; }
header .sub { color: var(--muted); margin: 0 0 16px; }
header .note { margin: 0 0 16px; max-width: 70em; }
.card { background: #fff; border-radius: 10px; box-shadow: 0 1px 3px rgba(0,0,0,0.08), 0 4px 14px rgba(0,0,0,0.04); padding: 18px 22px; margin: 18px 0; }
h2 { margin: 0 0 4px; font-size: 20px; }
h2 .name { font: 13px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; color: var(--muted); font-weight: normal; margin-left: 8px; }
h3 { font-size: 14px; margin: 16px 0 6px; color: #343a40; }
p.desc { margin: 4px 0 10px; color: #343a40; max-width: 980px; }
p.takeaway { margin: 8px 0 12px; padding: 8px 12px; border-left: 4px solid #495057; background: #f8f9fa; font-weight: 500; }
p.takeaway.bad { border-left-color: #e03131; background: #fff5f5; }
p.takeaway.good { border-left-color: #2f9e44; background: #ebfbee; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 18px; align-items: center; font-size: 13px; color: #495057; margin: 4px 0 6px; }
.legend .item { display: inline-flex; align-items: center; gap: 6px; }
.ln { display: inline-block; width: 26px; height: 0; border-top-width: 3px; border-top-style: solid; }
.ln.dash { border-top-width: 2px; border-top-style: dashed; }
.ln.limit { border-top: 2px dotted #c92a2a; }
.mk { display: inline-block; width: 11px; height: 11px; border-radius: 50%; background: #e03131; border: 2px solid #495057; }
.mk.dia { border-radius: 1px; transform: rotate(45deg); width: 10px; height: 10px; }
.sq { display: inline-block; width: 14px; height: 12px; border: 1px solid #868e96; }
.dot { display: inline-block; width: 10px; height: 10px; border-radius: 50%; margin-right: 6px; vertical-align: baseline; }
.chartbox { position: relative; }
svg.chart { width: 100%; height: auto; display: block; }
svg.segmap { width: 100%; height: auto; display: block; margin: 4px 0 2px; }
.map { margin: 8px 0 12px; }
.maphead { font-size: 13px; color: #343a40; }
.waste { color: #c92a2a; }
.tip { position: absolute; pointer-events: none; background: rgba(33,37,41,0.92); color: #fff; font-size: 12px; padding: 6px 9px; border-radius: 6px; white-space: nowrap; display: none; line-height: 1.45; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0; }
th, td { padding: 5px 12px 5px 0; text-align: right; border-bottom: 1px solid #f1f3f5; white-space: nowrap; }
th { color: var(--muted); font-weight: 600; border-bottom: 1px solid var(--line); }
th:first-child, td:first-child { text-align: left; }
td.l, th.l { text-align: left; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; font-weight: 600; }
.badge.ok { background: #d3f9d8; color: #2b8a3e; }
.badge.bad { background: #ffe3e3; color: #c92a2a; }
.why { margin: 8px 0 0; font-size: 13px; }
.why p { margin: 4px 0; }
details { margin: 2px 0 8px; }
summary { cursor: pointer; color: #495057; font-size: 13px; }
pre { white-space: pre-wrap; background: #f8f9fa; border: 1px solid #e9ecef; border-radius: 6px; padding: 8px 10px; font-size: 12px; margin: 6px 0; }
.bars { width: 240px; }
.bar { position: relative; height: 9px; background: #f1f3f5; border-radius: 2px; margin: 2px 0; }
.bar span { position: absolute; left: 0; top: 0; bottom: 0; border-radius: 2px; }
.glance td { vertical-align: middle; }
.glance a { color: inherit; text-decoration: none; border-bottom: 1px dotted #adb5bd; }
.small { font-size: 12px; color: var(--muted); }
footer { color: var(--muted); font-size: 12px; margin-top: 24px; }
)CSS";

// Hover values on the charts: finds the nearest sample of every series under the pointer and
// shows them. Pure progressive enhancement: the page reads the same without it. No '<' or '&'.
const char* kScript = R"JS(
(function () {
  function fmt(b) {
    var u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    var i = 0;
    while (Math.abs(b) >= 1024) { if (i === 4) break; b = b / 1024; i = i + 1; }
    return b.toFixed(b >= 100 ? 0 : 2) + ' ' + u[i];
  }
  document.querySelectorAll('svg.chart').forEach(function (svg) {
    var box = svg.parentNode;
    var tip = box.querySelector('.tip');
    var cross = svg.querySelector('.cross');
    var x0 = +svg.dataset.x0, x1 = +svg.dataset.x1, y0 = +svg.dataset.y0, y1 = +svg.dataset.y1;
    var xmax = +svg.dataset.xmax, ymax = +svg.dataset.ymax, xlabel = svg.dataset.xlabel;
    var series = [];
    svg.querySelectorAll('polyline.series').forEach(function (p) {
      // An empty run draws an empty polyline: no points, rather than one at NaN.
      var pts = p.getAttribute('points').trim().split(/\s+/).filter(function (s) { return s.length > 0; }).map(function (s) {
        var c = s.split(','); return [+c[0], +c[1]];
      });
      series.push({ backend: p.dataset.backend, kind: p.dataset.kind, color: p.getAttribute('stroke'), pts: pts });
    });
    function nearest(pts, x) {
      var lo = 0, hi = pts.length - 1;
      while (hi - lo > 1) { var mid = (lo + hi) >> 1; if (pts[mid][0] > x) hi = mid; else lo = mid; }
      return (Math.abs(pts[hi][0] - x) > Math.abs(pts[lo][0] - x)) ? pts[lo] : pts[hi];
    }
    svg.addEventListener('mousemove', function (ev) {
      var pt = svg.createSVGPoint(); pt.x = ev.clientX; pt.y = ev.clientY;
      var loc = pt.matrixTransform(svg.getScreenCTM().inverse());
      if (loc.x > x1 || !(loc.x >= x0) || series.length === 0) { tip.style.display = 'none'; cross.setAttribute('visibility', 'hidden'); return; }
      cross.setAttribute('x1', loc.x); cross.setAttribute('x2', loc.x); cross.setAttribute('visibility', 'visible');
      var step = Math.round((loc.x - x0) / (x1 - x0) * xmax);
      var rows = {};
      var order = [];
      series.forEach(function (s) {
        if (s.pts.length === 0) return;
        var p = nearest(s.pts, loc.x);
        var v = (y0 - p[1]) / (y0 - y1) * ymax;
        if (!rows[s.backend]) { rows[s.backend] = { color: s.color }; order.push(s.backend); }
        rows[s.backend][s.kind] = v;
      });
      tip.textContent = '';
      var head = document.createElement('div');
      head.textContent = xlabel + ' ' + step.toLocaleString();
      tip.appendChild(head);
      order.forEach(function (b) {
        var line = document.createElement('div');
        var dot = document.createElement('span');
        dot.className = 'dot'; dot.style.background = rows[b].color;
        line.appendChild(dot);
        line.appendChild(document.createTextNode(b + ': reserved ' + fmt(rows[b].reserved) + ', allocated ' + fmt(rows[b].allocated)));
        tip.appendChild(line);
      });
      var r = box.getBoundingClientRect();
      tip.style.display = 'block';
      var left = ev.clientX - r.left + 14;
      if (left + tip.offsetWidth > r.width) left = ev.clientX - r.left - tip.offsetWidth - 14;
      tip.style.left = left + 'px';
      tip.style.top = (ev.clientY - r.top + 12) + 'px';
    });
    svg.addEventListener('mouseleave', function () { tip.style.display = 'none'; cross.setAttribute('visibility', 'hidden'); });
  });
})();
)JS";

void legend(std::string& o, const ReportGroup& g) {
  o += "<div class=\"legend\">";
  for (std::size_t i = 0; i < g.runs.size(); ++i) {
    const BackendStyle st = backend_style(g.runs[i].backend, i);
    o += "<span class=\"item\"><span class=\"ln\" style=\"border-top-color:" + std::string(st.line) + "\"></span>" + esc(g.runs[i].backend) + " reserved</span>";
    o += "<span class=\"item\"><span class=\"ln dash\" style=\"border-top-color:" + std::string(st.line) + "\"></span>" + esc(g.runs[i].backend) + " allocated</span>";
  }
  if (g.limit_bytes) o += "<span class=\"item\"><span class=\"ln limit\"></span>limit</span>";
  bool any_oom = false;
  for (const ReportRun& r : g.runs) any_oom = any_oom || r.ooms != 0;
  if (any_oom) {
    for (std::size_t i = 0; i < g.runs.size(); ++i) {
      if (!g.runs[i].ooms) continue;
      const BackendStyle st = backend_style(g.runs[i].backend, i);
      o += "<span class=\"item\"><span class=\"mk" + std::string(i % 2 ? " dia" : "") + "\" style=\"border-color:" + st.line + "\"></span>" +
           esc(g.runs[i].backend) + " out of memory (hover for the verdict)</span>";
    }
  }
  o += "<span class=\"item small\">shaded: reserved but unallocated</span>";
  o += "</div>\n";
}

void state_legend(std::string& o) {
  o += "<div class=\"legend\">";
  for (BlockState s : {BlockState::allocated, BlockState::free_mapped, BlockState::pending_free, BlockState::free_unmapped})
    o += "<span class=\"item\"><span class=\"sq\" style=\"background:" + std::string(state_colour(s)) + "\"></span>" + esc(state_label(s)) + "</span>";
  o += "</div>\n";
}

void summary_table(std::string& o, const ReportGroup& g) {
  const bool driver = std::any_of(g.runs.begin(), g.runs.end(), [](const ReportRun& r) { return r.driver_seconds > 0; });
  const bool fill = std::any_of(g.runs.begin(), g.runs.end(), [](const ReportRun& r) { return r.fill_known; });
  o += "<table class=\"summary\">\n<thead><tr><th>backend</th><th class=\"l\">outcome</th><th class=\"l\">first OOM report&#39;s verdict</th><th>peak allocated</th>"
       "<th>peak reserved</th><th>reserved / allocated</th><th>OOMs</th>";
  if (fill) o += "<th>OOMs at \xE2\x89\xA4 98% of the limit (fragmentation)</th>";
  o += "<th>time</th>";
  o += driver ? "<th>in driver</th></tr></thead>\n<tbody>\n" : "</tr></thead>\n<tbody>\n";
  for (std::size_t i = 0; i < g.runs.size(); ++i) {
    const ReportRun& r = g.runs[i];
    const BackendStyle st = backend_style(r.backend, i);
    o += "<tr data-backend=\"" + esc(r.backend) + "\"><td><span class=\"dot\" style=\"background:" + std::string(st.line) + "\"></span>" + esc(r.backend) +
         "</td><td class=\"l\"><span class=\"badge " + (r.ooms ? "bad" : "ok") + "\">" + esc(outcome_of(r)) + "</span></td><td class=\"l\">" +
         esc(r.first_oom ? verdict_of(r) : std::string("\xE2\x80\x94")) + "</td><td>" + esc(bytes_text(r.peak_allocated_bytes)) + "</td><td>" +
         esc(bytes_text(r.peak_reserved_bytes)) + "</td><td>" + ratio_text(r) +
         "</td><td>" + std::to_string(r.ooms) + "</td>";
    if (fill) o += "<td>" + (r.fill_known ? std::to_string(r.ooms_below_98) : std::string("\xE2\x80\x94")) + "</td>";
    o += "<td>" + esc(seconds_text(r.seconds)) + "</td>";
    if (driver) o += "<td>" + (r.driver_seconds > 0 ? esc(seconds_text(r.driver_seconds)) : std::string("\xE2\x80\x94")) + "</td>";
    o += "</tr>\n";
  }
  o += "</tbody>\n</table>\n";
  // What the command line's notes say of a replay, under its table (was: missing from the page, whose
  // takeaway then said every allocation was served).
  for (const ReportRun& r : g.runs) {
    if (r.refused_requests == 0 && r.skipped_frees == 0) continue;
    std::string n = r.backend + ": ";
    if (r.refused_requests)
      n += plural(r.refused_requests, "request", "requests") + " of 1 EiB or more refused up front (no OOM of the allocator, which num_ooms does not count either)";
    if (r.skipped_frees)
      n += std::string(r.refused_requests ? "; " : "") + plural(r.skipped_frees, "free", "frees") +
           " skipped or supplied (frees of allocations that failed here, or of pointers the trace never allocated, are skipped; with "
           "--lenient, a free missing before a pointer is allocated again is supplied)";
    o += "<p class=\"desc notes\" data-backend=\"" + esc(r.backend) + "\">" + esc(n + ".") + "</p>\n";
  }
  // The two counts of fragmentation differ (a run's OOMs counted by fill, its first report's verdict
  // by whole pages): the page says so, as the command line's tables do.
  if (fill)
    o += "<p class=\"desc\">OOMs at \xE2\x89\xA4 98% of the limit: the failed request plus the live requested bytes were at most 98% of the "
         "limit, expseg's test of a fragmentation OOM. The first OOM report's verdict weighs whole pages and held memory instead, so "
         "the two can differ.</p>\n";
}

std::string anchor(std::size_t index) {
  std::string s = "g";  // not "g" + to_string(): g++ 12 -O3 warns falsely (-Wrestrict) on that
  s += std::to_string(index + 1);
  return s;
}

void glance(std::string& o, std::span<const ReportGroup> groups) {
  o += "<section class=\"card glance\">\n<h2>At a glance</h2>\n";
  o += "<p class=\"desc\">For every story: whether each backend served every request, and its peak reserved memory (light bar) against its peak "
       "allocated memory (dark bar), on one scale per row. A light bar much longer than the dark one is memory the backend holds but cannot use.</p>\n";
  o += "<table>\n<thead><tr><th>run</th>";
  std::vector<std::string> backends;
  for (const ReportGroup& g : groups)
    for (const ReportRun& r : g.runs)
      if (std::find(backends.begin(), backends.end(), r.backend) == backends.end()) backends.push_back(r.backend);
  for (const std::string& b : backends) o += "<th class=\"l\">" + esc(b) + "</th><th class=\"l\">reserved vs allocated</th>";
  o += "</tr></thead>\n<tbody>\n";
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    const ReportGroup& g = groups[gi];
    double scale = static_cast<double>(g.limit_bytes);
    for (const ReportRun& r : g.runs) scale = std::max(scale, static_cast<double>(r.peak_reserved_bytes));
    if (scale <= 0) scale = 1;
    o += "<tr><td><a href=\"#" + anchor(gi) + "\">" + esc(g.title.empty() ? g.name : g.title) + "</a><div class=\"small\">" + esc(g.name) + "</div></td>";
    for (std::size_t bi = 0; bi < backends.size(); ++bi) {
      const ReportRun* r = nullptr;
      std::size_t idx = 0;
      for (std::size_t k = 0; k < g.runs.size(); ++k)
        if (g.runs[k].backend == backends[bi]) r = &g.runs[k], idx = k;
      if (!r) {
        o += "<td class=\"l\">\xE2\x80\x94</td><td></td>";
        continue;
      }
      const BackendStyle st = backend_style(r->backend, idx);
      o += "<td class=\"l\"><span class=\"badge " + std::string(r->ooms ? "bad" : "ok") + "\">" + esc(outcome_of(*r)) + "</span>" +
           (r->fill_known && r->ooms ? " <span class=\"small\">" + esc(below_98_words(*r)) + "</span>"
            : r->first_oom          ? " <span class=\"small\">first report: " + esc(verdict_of(*r)) + "</span>"
                                    : std::string()) +
           "</td>";
      o += "<td class=\"l bars\"><div class=\"bar\"><span style=\"width:" + fixed(100.0 * static_cast<double>(r->peak_reserved_bytes) / scale, 1) +
           "%;background:" + st.light + "\"></span><span style=\"width:" + fixed(100.0 * static_cast<double>(r->peak_allocated_bytes) / scale, 1) +
           "%;background:" + st.line + ";top:2px;bottom:2px\"></span></div><span class=\"small\">" +
           esc(short_bytes(static_cast<double>(r->peak_reserved_bytes)) + " reserved, " +
               (r->peak_allocated_bytes > 0 ? ratio_text(*r) + " allocated" : std::string("nothing allocated"))) + "</span></td>";
    }
    o += "</tr>\n";
  }
  o += "</tbody>\n</table>\n</section>\n";
}

void group_section(std::string& o, const ReportGroup& g, std::size_t index) {
  bool any_fail = false, all_fail = !g.runs.empty();
  for (const ReportRun& r : g.runs) {
    any_fail = any_fail || r.ooms != 0;
    all_fail = all_fail && r.ooms != 0;
  }
  o += "<section class=\"card group\" id=\"" + anchor(index) + "\" data-name=\"" + esc(g.name) + "\">\n";
  o += "<h2>" + esc(g.title.empty() ? g.name : g.title) + (g.title.empty() || g.title == g.name ? std::string() : "<span class=\"name\">" + esc(g.name) + "</span>") + "</h2>\n";
  if (!g.description.empty()) o += "<p class=\"desc\">" + esc(g.description) + "</p>\n";
  const char* cls = any_fail && !all_fail ? " bad" : (!any_fail ? " good" : " bad");
  o += "<p class=\"takeaway" + std::string(cls) + "\">" + esc(takeaway(g)) + "</p>\n";

  legend(o, g);
  o += "<div class=\"chartbox\">\n";
  chart(o, g);
  o += "<div class=\"tip\"></div>\n</div>\n";

  summary_table(o, g);
  for (std::size_t i = 0; i < g.runs.size(); ++i) {
    const ReportRun& r = g.runs[i];
    if (!r.first_oom) continue;
    o += "<div class=\"why\"><p><span class=\"dot\" style=\"background:" + std::string(backend_style(r.backend, i).line) + "\"></span><b>Why " + esc(r.backend) +
         " failed</b> (the first OOM report&#39;s verdict: " + esc(verdict_of(r)) + "): " + esc(verdict_sentence(*r.first_oom)) + "</p>\n";
    o += "<details><summary>the first OOM report, as the user saw it</summary><pre>" + esc(r.first_oom->message) + "</pre></details></div>\n";
  }

  // Segment maps: at peak reserved for every backend, then at the first OOM where it was kept.
  std::vector<const Snapshot*> snaps;
  for (const ReportRun& r : g.runs) {
    if (r.peak_snapshot) snaps.push_back(&*r.peak_snapshot);
    if (r.first_oom && r.first_oom->snapshot) snaps.push_back(r.first_oom->snapshot.get());
  }
  if (!snaps.empty()) {
    const double row_bytes = map_row_bytes(snaps);
    // Runs may have kept only the first OOM's snapshot (no snapshot_at_peak): no peak heading then.
    bool any_peak_snap = false;
    for (const ReportRun& r : g.runs) any_peak_snap = any_peak_snap || r.peak_snapshot;
    o += any_peak_snap ? "<h3>Segment maps at the moment of peak reserved</h3>\n" : "<h3>Segment maps</h3>\n";
    o += "<p class=\"small\">Each bar is one segment (a driver allocation, or an expandable segment drawn up to its high-water mark), in address "
         "order, on one scale for the whole group: a full row is " + esc(format_bytes(static_cast<std::size_t>(row_bytes))) + ".</p>\n";
    state_legend(o);
    for (std::size_t i = 0; i < g.runs.size(); ++i) {
      const ReportRun& r = g.runs[i];
      if (r.peak_snapshot)
        segment_map(o, *r.peak_snapshot, r, i, "peak", "at peak reserved", row_bytes);
    }
    bool any_oom_snap = false;
    for (const ReportRun& r : g.runs) any_oom_snap = any_oom_snap || (r.first_oom && r.first_oom->snapshot);
    if (any_oom_snap) {
      o += "<h3>Segment maps at the first OOM</h3>\n";
      for (std::size_t i = 0; i < g.runs.size(); ++i) {
        const ReportRun& r = g.runs[i];
        if (!(r.first_oom && r.first_oom->snapshot)) continue;
        std::string when = "at the first OOM";
        if (!r.oom_at.empty()) when += " (" + g.x_label + " " + std::to_string(r.oom_at.front()) + ")";
        when += ", trying to allocate " + tried_text(*r.first_oom);
        segment_map(o, *r.first_oom->snapshot, r, i, "first-oom", when, row_bytes);
      }
    }
  }
  o += "</section>\n";
}

std::string default_trace_description(const std::vector<ReportRun>& runs, const std::string& name) {
  std::string d = "The allocation trace " + name + " replayed";
  if (!runs.empty()) d += " on " + runs.front().device;
  d += ": every allocation and free of the recorded run, in order, asked of each backend in turn. The chart's x axis counts the "
       "trace's allocations and frees.";
  return d;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

ReportGroup report_group(std::span<const ScenarioResult> runs) {
  ReportGroup g;
  // A story's "steps" (a growth, an alloc-or-free draw) are not its calls: the x axis counts the
  // allocator's calls, each allocation and each free.
  g.x_label = "call";
  if (runs.empty()) return g;
  g.name = runs.front().scenario;
  if (const ScenarioInfo* info = find_scenario(g.name)) {
    g.title = std::string(info->title);
    g.description = std::string(info->description);
    // The description tells the story with its own limit and sizes: a run under others says so, or
    // the card names a limit the run did not have.
    const ScenarioResult& s = runs.front();
    const bool other_sizes = s.max_size != 0 && (s.min_size != info->min_size || s.max_size != info->max_size);
    // A random story's outcome sentences hold for its own seed only: another seed's card says so.
    const bool other_seed = info->random && s.seed != 0 && s.seed != info->seed;
    if (other_seed && !info->outcome.empty() && g.description.ends_with(info->outcome)) {
      std::string outcome(info->outcome);
      if (!outcome.empty() && outcome[0] >= 'A' && outcome[0] <= 'Z') outcome[0] = static_cast<char>(outcome[0] - 'A' + 'a');
      g.description.resize(g.description.size() - info->outcome.size());
      g.description += "With the story's own seed (" + std::to_string(info->seed) + "), " + outcome;
    }
    // Only what differs from the story's own.
    std::vector<std::string> changed;
    if (other_seed) changed.push_back("seed " + std::to_string(s.seed));
    if (other_sizes) changed.push_back("sizes " + format_bytes(s.min_size) + "\xE2\x80\x93" + format_bytes(s.max_size));
    if (s.limit_bytes != info->limit_bytes) changed.push_back(s.limit_bytes ? "limit " + format_bytes(s.limit_bytes) : std::string("no limit"));
    if (!changed.empty()) {
      g.description += " This run: ";
      for (std::size_t i = 0; i < changed.size(); ++i) g.description += (i ? ", " : "") + changed[i];
      g.description += " (the story's " + std::string(changed.size() == 1 ? "default" : "defaults") + " overridden).";
    }
  }
  g.description += " The chart's x axis counts the allocator's calls: each allocation and each free.";
  for (const ScenarioResult& s : runs) {
    ReportRun r;
    r.backend = s.backend;
    r.device = s.device;
    r.ooms = s.ooms;
    r.fragmentation_ooms = s.fragmentation_ooms;
    r.fragmentation_known = true;
    r.ooms_below_98 = s.ooms_below_98;
    r.fill_known = s.limit_bytes != 0;
    r.first_oom = s.first_oom;
    r.peak_allocated_bytes = s.peak_allocated_bytes;
    r.peak_reserved_bytes = s.peak_reserved_bytes;
    r.seconds = s.seconds;
    r.driver_seconds = s.driver_seconds;
    r.length = s.steps;
    r.series = s.series;
    // oom_steps counts the steps before the failed one; samples are taken after each step.
    for (std::uint64_t st : s.oom_steps) r.oom_at.push_back(st + 1);
    r.peak_snapshot = s.peak_snapshot;
    g.limit_bytes = std::max(g.limit_bytes, s.limit_bytes);
    if (s.peak_snapshot) g.device_total_bytes = std::max(g.device_total_bytes, s.peak_snapshot->device_total_bytes);
    g.runs.push_back(std::move(r));
  }
  return g;
}

ReportGroup report_group(std::span<const ReplayResult> runs, std::string description) {
  ReportGroup g;
  g.x_label = "event";
  if (runs.empty()) return g;
  g.name = runs.front().trace;
  for (const ReplayResult& s : runs) {
    ReportRun r;
    r.backend = s.backend;
    r.device = s.device;
    r.ooms = s.ooms;
    r.refused_requests = s.refused_requests;
    r.skipped_frees = s.skipped_frees;
    r.first_oom = s.first_oom;
    r.peak_allocated_bytes = s.peak_allocated_bytes;
    r.peak_reserved_bytes = s.peak_reserved_bytes;
    r.seconds = s.seconds;
    r.driver_seconds = s.driver_seconds;
    r.length = s.series.empty() ? s.events : s.series.back().event + 1;
    r.series = s.series;
    r.oom_at = s.oom_events;
    r.peak_snapshot = s.peak_snapshot;
    if (s.peak_snapshot) {
      g.limit_bytes = std::max(g.limit_bytes, s.peak_snapshot->limit_bytes);
      g.device_total_bytes = std::max(g.device_total_bytes, s.peak_snapshot->device_total_bytes);
    }
    if (s.first_oom) {
      g.limit_bytes = std::max(g.limit_bytes, s.first_oom->limit_bytes);
      g.device_total_bytes = std::max(g.device_total_bytes, s.first_oom->device_total_bytes);
    }
    g.runs.push_back(std::move(r));
  }
  g.description = description.empty() ? default_trace_description(g.runs, g.name) : std::move(description);
  // A trace's description speaks of a run without a limit (the shipped ones do): one under a limit says so.
  std::size_t limit = 0;
  for (const ReplayResult& s : runs) limit = std::max(limit, s.limit_bytes);
  if (limit != 0) {
    g.limit_bytes = std::max<std::size_t>(g.limit_bytes, limit);
    g.description += " This run: limit " + format_bytes(limit) + ".";
  }
  return g;
}

std::string render_html_report(std::span<const ReportGroup> groups, const ReportOptions& options) {
  std::string o;
  o.reserve(64 * 1024);
  o += "<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n";
  o += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"/>\n";
  o += "<title>" + esc(options.title) + "</title>\n<style>" + std::string(kStyle) + "</style>\n</head>\n<body>\n<main>\n";
  o += "<header>\n<h1>" + esc(options.title) + "</h1>\n";
  if (!options.subtitle.empty()) o += "<p class=\"sub\">" + esc(options.subtitle) + "</p>\n";
  if (!options.note.empty()) o += "<p class=\"note\">" + esc(options.note) + "</p>\n";
  o += "</header>\n";
  if (groups.size() > 1) glance(o, groups);
  for (std::size_t i = 0; i < groups.size(); ++i) group_section(o, groups[i], i);
  o += "<footer>Reading the charts: solid lines are reserved bytes (memory the allocator holds from the device), dashed lines are allocated "
       "bytes (live blocks); the shaded band between them is reserved but unallocated. Red markers are failed allocations; hover one for its "
       "verdict. Made by expseg; this page fetches nothing from the network.</footer>\n";
  o += "</main>\n<script>" + std::string(kScript) + "</script>\n</body>\n</html>\n";
  return o;
}

void write_html_report(const std::string& path, std::span<const ReportGroup> groups, const ReportOptions& options) {
  const std::string page = render_html_report(groups, options);
  // stdio rather than an ofstream: errno names the reason (no such directory, permission, disk full).
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
  if (!f) throw error("cannot write the report to '" + path + "': " + std::strerror(errno));
  const bool ok = std::fwrite(page.data(), 1, page.size(), f.get()) == page.size();
  const int err = ok ? 0 : errno;
  if (std::fclose(f.release()) != 0 || !ok)
    throw error("cannot write the report to '" + path + "': " + std::strerror(err ? err : errno));
}

}  // namespace expseg
