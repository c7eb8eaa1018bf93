// expseg replay / scenario / study: the A/B runs, their tables, and the HTML picture.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <string>
#include <vector>

#include "cli.hpp"
#include "expseg/allocator.hpp"
#include "expseg/errors.hpp"
#include "expseg/oom_dump.hpp"
#include "expseg/report.hpp"
#include "expseg/scenarios.hpp"
#include "expseg/trace.hpp"

#ifndef EXPSEG_VERSION
#define EXPSEG_VERSION "unknown"
#endif

namespace expseg::cli {
namespace {

// Resolution of the pictures' time axes.
constexpr std::size_t kScenarioPoints = 600;
constexpr std::size_t kReplayPoints = 800;

const std::vector<OptionSpec> kRunOptions = {
    {"--backend", true}, {"--device", true}, {"--conf", true}, {"--json", false}, {"--html", true},
};

std::vector<OptionSpec> with(std::vector<OptionSpec> base, std::initializer_list<OptionSpec> more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

// One progress line on stderr, redrawn in place; only when stderr is a terminal.
class Progress {
 public:
  Progress() : on_(stderr_is_tty()) {}
  ~Progress() { clear(); }
  void show(const std::string& text) {
    if (!on_) return;
    std::fprintf(stderr, "\r\033[K  %s", text.c_str());
    std::fflush(stderr);
    shown_ = true;
  }
  void clear() {
    if (on_ && shown_) std::fprintf(stderr, "\r\033[K");
    shown_ = false;
  }

 private:
  bool on_;
  bool shown_ = false;
};

std::string backend_list(const std::vector<BackendKind>& b) {
  std::string s;
  for (std::size_t i = 0; i < b.size(); ++i) s += (i ? (i + 1 == b.size() ? " and " : ", ") : "") + std::string(to_string(b[i]));
  return s;
}

std::string now_text() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M", &tm);
  return buf;
}

std::string command_line(int argc, char** argv) {
  std::string s = "expseg";
  for (int i = 1; i < argc; ++i) {
    // Quoted for a POSIX shell wherever it holds more than plain characters, so that a copy of the
    // line runs this command and nothing else ('a;b.html' stays one argument).
    const std::string a = argv[i];
    const bool plain = !a.empty() && a.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-+=.,:/@%") == std::string::npos;
    if (plain) {
      s += " " + a;
      continue;
    }
    s += " '";
    for (const char c : a) s += c == '\'' ? std::string("'\\''") : std::string(1, c);
    s += "'";
  }
  return s;
}

// --- scenarios -----------------------------------------------------------------------------------

using ScenarioGroup = std::vector<ScenarioResult>;  // one scenario, one result per backend

std::vector<ScenarioGroup> run_scenarios(const std::vector<std::string>& names, const Setup& setup, bool picture, const ScenarioOptions& options, bool json) {
  std::vector<ScenarioGroup> out;
  Progress progress;
  for (const std::string& name : names) {
    ScenarioGroup g;
    for (BackendKind b : setup.backends) {
      Config c = setup.config.with_backend(b);
      ScenarioOptions o = options;
      if (picture) {
        o.series_points = kScenarioPoints;
        o.snapshot_at_peak = true;
        c.oom_snapshot = true;  // a segment map at the first OOM
      }
      progress.show("scenario " + name + " on " + to_string(b) + " ...");
      ScenarioResult r = run_scenario(name, c, o, setup.device);
      if (json) {
        progress.clear();
        std::printf("%s\n", r.to_json().c_str());
        flush_stdout();
      }
      g.push_back(std::move(r));
    }
    out.push_back(std::move(g));
  }
  return out;
}

std::string verdict_text(const std::optional<OomVerdict>& v) { return v ? to_string(*v) : "-"; }

// expseg's own test of a fragmentation OOM (live requested bytes + the request <= 98% of the limit);
// the OOM report's verdict counts whole pages and can say "limit" at 96% full, or the reverse.
std::string below_98_text(const ScenarioResult& r) { return r.limit_bytes ? std::to_string(r.ooms_below_98) : std::string("-"); }

// "fragmentation: 17 at <= 98% of limit", "none at <= 98% of limit"; empty without a limit or an OOM.
std::string below_98_words(const ScenarioResult& r) {
  if (r.limit_bytes == 0 || r.ooms == 0) return "";
  return r.ooms_below_98 ? "fragmentation: " + std::to_string(r.ooms_below_98) + " at <= 98% of limit" : "none at <= 98% of limit";
}

constexpr const char* kBelow98Note =
    "OOMs at <= 98% of limit: the failed request plus the live requested bytes were at most 98% of the limit, expseg's test of a "
    "fragmentation OOM. The first OOM report's verdict weighs whole pages and held memory instead, so the two can differ.";

void print_scenario_table(const std::vector<ScenarioGroup>& groups) {
  Table t({{"scenario", false},
           {"backend", false},
           {"outcome", false},
           {"first OOM report's verdict", false},
           {"peak allocated", true},
           {"peak reserved", true},
           {"limit", true},
           {"OOMs", true},
           {"OOMs at <= 98% of limit", true},
           {"lowest fill", true},
           {"time", true},
           {"in driver", true}});
  // lowest fill: the least (live requested bytes + request) / limit at which a request failed; an
  // allocator that fails only for the limit keeps it near 100%. in driver: the part of the time
  // spent in driver calls (on the simulated device the latency model's, with sim_latency:true).
  auto fill_text = [](const ScenarioResult& r) {
    if (r.ooms == 0 || r.limit_bytes == 0) return std::string("-");
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * r.lowest_oom_fill);
    return std::string(buf);
  };
  for (const ScenarioGroup& g : groups)
    for (const ScenarioResult& r : g)
      t.add({r.scenario, r.backend, r.ok ? "ok" : std::to_string(r.ooms) + (r.ooms == 1 ? " OOM" : " OOMs"), verdict_text(r.verdict),
             size_text(r.peak_allocated_bytes), size_text(r.peak_reserved_bytes), r.limit_bytes ? format_bytes(r.limit_bytes) : "-",
             std::to_string(r.ooms), below_98_text(r), fill_text(r), seconds_text(r.seconds), r.driver_seconds > 0 ? seconds_text(r.driver_seconds) : "-"});
  t.print(stdout);
  bool any_oom = false;
  for (const ScenarioGroup& g : groups)
    for (const ScenarioResult& r : g) any_oom = any_oom || (r.ooms != 0 && r.limit_bytes != 0);
  if (any_oom) {
    std::printf("\n");
    print_indented(stdout, kBelow98Note, 0, terminal_width(1));
  }
}

// After the table: why each failing backend failed, in the words of its first OOM report.
void print_scenario_failures(const std::vector<ScenarioGroup>& groups) {
  bool header = false;
  for (const ScenarioGroup& g : groups)
    for (const ScenarioResult& r : g) {
      if (!r.first_oom) continue;
      if (!header) std::printf("\nWhy the failures happened (the first OOM report of each failing run):\n");
      header = true;
      const std::string below = below_98_words(r);
      std::printf("\n  %s on %s: %zu OOM%s%s, the first OOM report's verdict: %s\n", r.scenario.c_str(), r.backend.c_str(), r.ooms,
                  r.ooms == 1 ? "" : "s", below.empty() ? "" : (" (" + below + ")").c_str(), to_string(r.first_oom->verdict));
      print_indented(stdout, r.first_oom->message, 4, terminal_width(1));
    }
}

// --- replays -------------------------------------------------------------------------------------

using ReplayGroup = std::vector<ReplayResult>;  // one trace, one result per backend

// One trace on every backend of the setup.
ReplayGroup replay_trace(const Trace& trace, const Setup& setup, bool picture, bool lenient, bool json) {
  ReplayGroup g;
  for (BackendKind b : setup.backends) {
    Config c = setup.config.with_backend(b);
    ReplayOptions o;
    o.progress = true;  // drawn only when stderr is a terminal
    o.lenient = lenient;
    if (picture) {
      o.series_points = kReplayPoints;
      o.snapshot_at_peak = true;
    }
    ReplayResult r = replay(trace, c, o, setup.device);
    if (json) {
      std::printf("%s\n", r.to_json().c_str());
      flush_stdout();
    }
    g.push_back(std::move(r));
  }
  return g;
}

// Runs `f` on the trace read from `path`; a trace_error from the replay, which names the trace by
// its file name, names the path as given instead (two run.csv in different directories).
template <class F>
auto with_trace_path(const std::string& path, F&& f) {
  try {
    return f();
  } catch (const trace_error& e) {
    if (e.file() == path) throw;
    const std::string what = e.what();
    const std::size_t prefix = e.file().size() + (e.line() != 0 ? 1 + std::to_string(e.line()).size() : 0) + 2;
    throw trace_error(path, e.line(), what.size() >= prefix ? what.substr(prefix) : what);
  }
}

// Reads and replays the traces one at a time (only one is in memory at once).
std::vector<ReplayGroup> run_replays(const std::vector<std::string>& paths, const Setup& setup, bool picture, bool lenient, bool json) {
  std::vector<ReplayGroup> out;
  for (const std::string& path : paths)  // trace_error: exit 2
    out.push_back(with_trace_path(path, [&] { return replay_trace(read_trace(path), setup, picture, lenient, json); }));
  return out;
}

void print_replay_table(const std::vector<ReplayGroup>& groups) {
  Table t({{"trace", false},
           {"backend", false},
           {"device", false},
           {"events", true},
           {"peak allocated", true},
           {"peak reserved", true},
           {"reserved/allocated", true},
           {"OOMs", true},
           {"time (ms)", true},
           {"in driver (ms)", true},
           {"replayed/s", true}});
  // Three significant digits or more: whole seconds with 3 decimals showed 0.004 against 0.010.
  auto ms = [](double s) {
    const double v = s * 1e3;
    return fixed(v, v < 1 ? 3 : v < 100 ? 2 : 1);
  };
  bool skipped = false;
  for (const ReplayGroup& g : groups)
    for (const ReplayResult& r : g) {
      skipped = skipped || r.driver_events != 0;
      t.add({terminal_text(r.trace), r.backend, r.device, with_commas(r.events), size_text(r.peak_allocated_bytes), size_text(r.peak_reserved_bytes),
             ratio_text(r.peak_reserved_bytes, r.peak_allocated_bytes), std::to_string(r.ooms), ms(r.seconds),
             r.driver_seconds > 0 ? ms(r.driver_seconds) : "-", rate_text(r.seconds > 0 ? static_cast<double>(r.operations) / r.seconds : 0.0)});
    }
  t.print(stdout);
  std::printf("\nreplayed/s: the trace's allocations, frees and pool events replayed per second of \"time\"%s.\n",
              skipped ? " (its map/unmap events are not replayed: a backend maps its own memory)" : "");
}

void print_replay_failures(const std::vector<ReplayGroup>& groups) {
  bool header = false;
  bool any_oom = false, any_skipped = false, any_refused = false;
  for (const ReplayGroup& g : groups)
    for (const ReplayResult& r : g) {
      any_oom = any_oom || r.first_oom;
      any_skipped = any_skipped || r.skipped_frees;
      any_refused = any_refused || r.refused_requests;
    }
  // Frees skipped or supplied (--lenient) and requests refused up front without an OOM are no
  // failure: the heading says what follows.
  std::string extras = any_refused ? "requests refused up front" : "";
  if (any_skipped) extras += std::string(any_refused ? ", " : "") + "frees skipped or supplied";
  if (!extras.empty() && !any_oom) extras[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(extras[0])));  // it starts the heading
  const std::string heading = !any_oom       ? extras + " (no run failed):"
                              : extras.empty() ? "Why the failures happened (the first OOM report of each failing run):"
                                               : "Why the failures happened (the first OOM report of each failing run), and " + extras + ":";
  for (const ReplayGroup& g : groups)
    for (const ReplayResult& r : g) {
      if (!r.first_oom && !r.skipped_frees && !r.refused_requests) continue;
      if (!header) std::printf("\n%s\n", heading.c_str());
      header = true;
      if (r.first_oom) {
        std::printf("\n  %s on %s: %zu OOM%s, first verdict: %s\n", terminal_text(r.trace).c_str(), r.backend.c_str(), r.ooms, r.ooms == 1 ? "" : "s",
                    to_string(r.first_oom->verdict));
        print_indented(stdout, r.first_oom->message, 4, terminal_width(1));
      } else {
        std::printf("\n  %s on %s:\n", terminal_text(r.trace).c_str(), r.backend.c_str());
      }
      if (r.refused_requests)
        std::printf("    (%zu request%s of 1 EiB or more refused up front: no OOM of the allocator, which num_ooms does not count either)\n",
                    r.refused_requests, r.refused_requests == 1 ? "" : "s");
      // skipped_frees also counts, under --lenient, the frees missing before a pointer was allocated again,
      // which the replay supplies: the note names both.
      if (r.skipped_frees)
        std::printf("    (%zu free%s skipped or supplied: frees of allocations that failed here, or of pointers the trace never\n"
                    "    allocated, are skipped; with --lenient, a free missing before a pointer is allocated again is supplied)\n",
                    r.skipped_frees, r.skipped_frees == 1 ? "" : "s");
    }
}

// --- the picture ---------------------------------------------------------------------------------

// On the simulated device the driver calls take no time: the time columns show the allocator's own
// host time only, which makes a backend that makes fewer but costlier driver calls look slow. What
// the tables and the picture then say about time (empty on a GPU, where the times are measured).
std::string sim_time_note(const Config& config, bool study) {
  if (config.device != DeviceKind::sim) return "";
  std::string s =
      "Times on the simulated device: the time columns are the host's time in the allocator alone (from a run of their own: the "
      "picture's samples of every step are taken in another); the simulated driver calls "
      "take none, so they leave out what each backend's driver calls (cuMemCreate, cuMemMap, cuMemSetAccess, cuMemAlloc, ...) "
      "cost on a GPU. ";
  if (config.sim_latency)
    s += std::string("\"in driver\" is the H200 latency model's estimate of those calls (sim_latency:true") +
         (study ? ", on by default in study" : "") + "), not included in the time: compare backends by the two together.";
  else
    s += "--conf sim_latency:true adds the H200 latency model's estimate of those calls (\"in driver\").";
  return s;
}

void write_picture(const std::string& path, const std::vector<ScenarioGroup>& scenarios, const std::vector<ReplayGroup>& replays,
                   const std::vector<std::string>& trace_descriptions, const Setup& setup, const std::string& title, const std::string& command,
                   bool study = false) {
  std::vector<ReportGroup> groups;
  for (const ScenarioGroup& g : scenarios) groups.push_back(report_group(std::span<const ScenarioResult>(g)));
  for (std::size_t i = 0; i < replays.size(); ++i)
    groups.push_back(report_group(std::span<const ReplayResult>(replays[i]), i < trace_descriptions.size() ? trace_descriptions[i] : std::string()));
  ReportOptions o;
  o.title = title;
  o.subtitle = backend_list(setup.backends) + " on " + setup.device_label + " \xC2\xB7 expseg " + EXPSEG_VERSION + " \xC2\xB7 " + now_text() +
               " \xC2\xB7 " + command + (setup.env_conf.empty() ? std::string() : " \xC2\xB7 EXPSEG_ALLOC_CONF=" + setup.env_conf);
  o.note = sim_time_note(setup.config, study);
  write_html_report(path, groups, o);  // expseg::error when it cannot be written: exit 1
}

void print_picture_hint(const std::string& path) {
  const std::string abs = absolute_path(path);
  std::printf("\nThe picture: %s\n", abs.c_str());
  std::printf("  open it with:   %s %s\n", open_command().c_str(), abs.c_str());
  std::printf("  or in a browser: file://%s\n", abs.c_str());
}

// Fails before the runs (which take a while) when the picture could not be written to `path`: the
// same runtime failure (exit 1) write_html_report would report after them, with the system's reason.
// Creates nothing: a file this check had to create is removed again.
void check_picture_path(const std::string& path, const std::vector<std::string>& inputs = {}) {
  std::error_code ec;
  // The picture must not replace a trace it is drawn from (--html given the trace's own name).
  for (const std::string& in : inputs)
    if (std::filesystem::equivalent(path, in, ec))
      throw UsageError("--html " + path + " is the input " + in + " itself: writing the picture would overwrite it; give --html another file");
  // A FIFO (a named one, or /dev/stdout into a pipe) is not opened to check it: opening it blocks
  // until a reader comes (was: a hang before the runs), and closing it again ends a named FIFO's
  // reader's input before the picture is written. The picture is written to it after the runs, where
  // it waits for a reader as any writer of a FIFO does.
  if (struct stat st; ::stat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode)) return;
  const bool existed = std::filesystem::exists(std::filesystem::symlink_status(path, ec));
  // No O_TRUNC: a kept file stays as it is. O_NONBLOCK: a socket or a device that would block is
  // refused (with the system's reason), not waited on.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK, 0666);
  if (fd < 0) throw error("cannot write the report to '" + path + "': " + std::strerror(errno));
  ::close(fd);
  if (!existed) ::unlink(path.c_str());
}

// --seed N, N >= 1: ScenarioOptions::seed 0 stands for each scenario's own seed, so a 0 given here
// would silently run that seed (random-churn's is 1) instead of a seed of its own.
std::uint64_t parse_seed(const std::string& text) {
  const std::uint64_t seed = parse_u64("--seed", text);
  if (seed == 0) throw UsageError("bad --seed value '0': seeds start at 1 (without --seed, each scenario runs its own)");
  return seed;
}

// "sim:80GiB (the simulated device: CUDA is not usable here (...))"
// The environment's configuration too: it changes every run (a limit, a rounding) where the command
// line does not show it.
void print_device_line(const Setup& setup) {
  std::printf("Device: %s, %s\n", setup.device_label.c_str(), setup.device_note.c_str());
  if (!setup.env_conf.empty()) std::printf("Configuration from the environment: EXPSEG_ALLOC_CONF=%s\n", terminal_text(setup.env_conf).c_str());
  std::printf("\n");
}


}  // namespace

// --- replay ----------------------------------------------------------------------------------------

int cmd::replay(int argc, char** argv) {
  const Args args = parse_args(argc, argv, 2, with(kRunOptions, {{"--lenient", false}}));
  if (args.positional.empty()) throw UsageError("missing TRACE: give one or more RMM allocation logs (.csv or .csv.gz)");
  const Setup setup = make_setup(args);
  const bool json = args.has("--json");
  const auto html = args.get("--html");
  for (const std::string& p : args.positional) {
    std::error_code ec;
    if (!std::filesystem::exists(p, ec)) throw InputError(p + ": no such trace file");
  }
  if (html) check_picture_path(*html, args.positional);
  if (!json) print_device_line(setup);
  const std::vector<ReplayGroup> groups = run_replays(args.positional, setup, html.has_value(), args.has("--lenient"), json);
  if (!json) {
    print_replay_table(groups);
    print_replay_failures(groups);
  }
  if (html) {
    write_picture(*html, {}, groups, {}, setup, "expseg replay: A/B", command_line(argc, argv));
    if (!json) print_picture_hint(*html);
    else std::fprintf(stderr, "expseg replay: the picture is in %s\n", absolute_path(*html).c_str());
  }
  return kExitOk;
}

// --- scenario --------------------------------------------------------------------------------------

int cmd::scenario(int argc, char** argv) {
  const Args args = parse_args(argc, argv, 2, with(kRunOptions, {{"--all", false}, {"--list", false}, {"--seed", true}, {"--sizes", true}}));
  if (args.has("--list")) {
    if (!args.positional.empty()) throw UsageError("--list takes no scenario name");
    for (const auto& [name, values] : args.values)  // none of them changes the list: say so rather than ignore them
      if (name != "--list") throw UsageError("--list prints the scenarios: it takes no other option (got " + name + ")");
    bool first = true;
    for (const ScenarioInfo& s : list_scenarios()) {
      if (!first) std::printf("\n");
      first = false;
      std::printf("%s  %s%s\n", std::string(s.name).c_str(), std::string(s.title).c_str(),
                  s.limit_bytes ? (" (limit " + format_bytes(s.limit_bytes) + ")").c_str() : "");
      // One paragraph, wrapped at 96 columns and indented.
      std::string d(s.description), line;
      std::size_t pos = 0;
      while (pos < d.size()) {
        std::size_t end = d.find(' ', pos);
        if (end == std::string::npos) end = d.size();
        const std::string word = d.substr(pos, end - pos);
        if (!line.empty() && line.size() + 1 + word.size() > 96) {
          std::printf("    %s\n", line.c_str());
          line.clear();
        }
        line += (line.empty() ? "" : " ") + word;
        pos = end + 1;
      }
      if (!line.empty()) std::printf("    %s\n", line.c_str());
    }
    return kExitOk;
  }
  std::vector<std::string> names;
  if (args.has("--all")) {
    if (!args.positional.empty()) throw UsageError("give a scenario NAME or --all, not both (got '" + args.positional.front() + "')");
    for (const ScenarioInfo& s : list_scenarios()) names.emplace_back(s.name);
  } else {
    if (args.positional.empty()) throw UsageError("missing scenario NAME (or --all, or --list to see them)");
    for (const std::string& n : args.positional) {
      if (find_scenario(n) == nullptr) {
        std::string valid;
        for (const ScenarioInfo& s : list_scenarios()) valid += (valid.empty() ? "" : ", ") + std::string(s.name);
        throw UsageError("unknown scenario '" + n + "'; valid scenarios: " + valid);
      }
      names.push_back(n);
    }
  }
  ScenarioOptions options;
  options.seed = args.get("--seed") ? parse_seed(*args.get("--seed")) : 0;
  if (args.get("--seed") && !args.has("--all"))  // --all: the seed goes to the random stories among them
    for (const std::string& n : names)
      if (!find_scenario(n)->random) {
        std::string random;
        for (const ScenarioInfo& s : list_scenarios())
          if (s.random) random += (random.empty() ? "" : ", ") + std::string(s.name);
        throw UsageError("--seed applies to the random stories only (" + random + "); '" + n + "' is fixed");
      }
  if (const auto sizes = args.get("--sizes")) {
    if (args.has("--all"))  // --all runs every scenario, and only random-churn takes sizes
      throw UsageError("--sizes applies to random-churn only, and --all runs every scenario: run it alone, e.g. "
                       "expseg scenario random-churn --sizes " + *sizes);
    for (const std::string& n : names)
      if (n != "random-churn") throw UsageError("--sizes applies to random-churn only (got scenario '" + n + "')");
    // MIN and MAX are checked by name: split at the first '-', "-1MiB-2MiB" would give an empty MIN.
    const std::string bad = "bad --sizes value '" + *sizes + "': ";
    if (sizes->front() == '-') throw UsageError(bad + "sizes cannot be negative; expected MIN-MAX, e.g. 1MiB-64MiB");
    const std::size_t dash = sizes->find('-');
    if (dash == std::string::npos) throw UsageError("--sizes takes MIN-MAX, e.g. 1MiB-64MiB (got '" + *sizes + "')");
    auto size_of = [&bad](const std::string& part, const char* which) {
      if (part.empty()) throw UsageError(bad + which + " is missing; expected MIN-MAX, e.g. 1MiB-64MiB");
      if (part.front() == '-') throw UsageError(bad + "sizes cannot be negative; expected MIN-MAX, e.g. 1MiB-64MiB");
      try {
        return parse_bytes(part, "--sizes");
      } catch (const config_error&) {
        throw UsageError(bad + which + " '" + part + "' is not a size; expected bytes or a number with a unit, e.g. 1MiB-64MiB");
      }
    };
    options.min_size = size_of(sizes->substr(0, dash), "MIN");
    options.max_size = size_of(sizes->substr(dash + 1), "MAX");
    if (options.min_size == 0 || options.min_size > options.max_size)
      throw UsageError("--sizes needs 0 < MIN <= MAX (got '" + *sizes + "')");
    if (options.max_size > (std::size_t{1} << 40)) throw UsageError("--sizes goes up to 1TiB (got '" + *sizes + "')");
  }
  const Setup setup = make_setup(args);
  const bool json = args.has("--json");
  const auto html = args.get("--html");
  if (html) check_picture_path(*html);
  if (!json) print_device_line(setup);
  const std::vector<ScenarioGroup> groups = run_scenarios(names, setup, html.has_value(), options, json);
  if (!json) {
    print_scenario_table(groups);
    print_scenario_failures(groups);
  }
  if (html) {
    write_picture(*html, groups, {}, {}, setup, "expseg scenario: A/B", command_line(argc, argv));
    if (!json) print_picture_hint(*html);
    else std::fprintf(stderr, "expseg scenario: the picture is in %s\n", absolute_path(*html).c_str());
  }
  return kExitOk;
}

// --- study -----------------------------------------------------------------------------------------

int cmd::study(int argc, char** argv) {
  const Args args = parse_args(argc, argv, 2, with(kRunOptions, {{"--trace", true}, {"--seed", true}, {"--lenient", false}}));
  const bool lenient = args.has("--lenient");
  // "--trace A B C": paths after a --trace are traces too.
  std::vector<std::string> traces = args.all("--trace");
  if (!args.positional.empty()) {
    if (traces.empty()) throw UsageError("unexpected argument '" + args.positional.front() + "' (traces go after --trace)");
    traces.insert(traces.end(), args.positional.begin(), args.positional.end());
  }
  std::vector<std::string> descriptions;
  std::string trace_note;
  if (traces.empty()) {
    for (const ShippedTrace& t : shipped_traces()) {
      traces.push_back(t.path);
      descriptions.push_back(t.description);
    }
    if (traces.empty())
      trace_note = "The shipped traces were not found next to the sources this binary was built from; pass --trace PATH to replay one.";
  }
  for (const std::string& p : traces) {
    std::error_code ec;
    if (!std::filesystem::exists(p, ec)) throw InputError(p + ": no such trace file");
  }
  const std::uint64_t seed = args.get("--seed") ? parse_seed(*args.get("--seed")) : 0;
  Setup setup = make_setup(args);
  // The study compares the backends' times too: on the simulated device its driver calls are charged
  // the H200's latencies ("in driver"), unless the configuration says otherwise.
  if (setup.config.device == DeviceKind::sim && !conf_sets(args, "sim_latency")) setup.config.sim_latency = true;
  const bool json = args.has("--json");
  const std::string html = args.get("--html").value_or("expseg-study.html");
  check_picture_path(html, traces);
  // The traces are read and checked as their replays will check them (pairing, pool lines;
  // trace_error, exit 2) before the scenarios run, not after.
  std::vector<Trace> read;
  read.reserve(traces.size());
  for (const std::string& p : traces) {
    read.push_back(read_trace(p));
    if (!lenient) with_trace_path(p, [&] { validate_for_replay(read.back()); });
  }

  std::vector<std::string> names;
  for (const ScenarioInfo& s : list_scenarios()) names.emplace_back(s.name);

  if (!json) {
    std::printf("expseg study: %zu scenarios%s, A/B on %s\n", names.size(),
                traces.empty() ? "" : (traces.size() == 1 ? " and 1 trace" : " and " + std::to_string(traces.size()) + " traces").c_str(),
                backend_list(setup.backends).c_str());
    print_device_line(setup);
    if (const std::string note = sim_time_note(setup.config, true); !note.empty()) {
      print_indented(stdout, note, 0, terminal_width(1));
      std::printf("\n");
    }
  }
  ScenarioOptions options;
  options.seed = seed;
  const std::vector<ScenarioGroup> scenarios = run_scenarios(names, setup, true, options, json);
  if (!json) {
    std::printf("Scenarios\n\n");
    print_scenario_table(scenarios);
    print_scenario_failures(scenarios);
  }
  std::vector<ReplayGroup> replays;
  for (const Trace& t : read) replays.push_back(replay_trace(t, setup, true, lenient, json));
  if (!json) {
    if (!replays.empty()) {
      std::printf("\nTraces\n\n");
      print_replay_table(replays);
      print_replay_failures(replays);
    }
    if (!trace_note.empty()) std::printf("\n%s\n", trace_note.c_str());

    // The A/B in one line per story.
    std::printf("\nVerdict\n\n");
    std::vector<Table::Column> cols{{"run", false}};
    for (std::size_t i = 0; i < setup.backends.size(); ++i) {
      cols.push_back({"", false});
      cols.push_back({"", false});
    }
    Table t(std::move(cols));
    // kind: what the OOMs were, "" when none.
    auto cell = [](const std::string& backend, std::size_t ooms, const std::string& kind, std::int64_t res, std::int64_t alloc) {
      std::string s = backend + ": " + (ooms ? std::to_string(ooms) + (ooms == 1 ? " OOM" : " OOMs") : std::string("ok"));
      if (!kind.empty()) s += " (" + kind + ")";
      // Nothing allocated: no ratio (the tables' "-"), said in words here.
      return std::make_pair(s, alloc > 0 ? "reserved " + ratio_text(res, alloc) + " allocated" : std::string("reserved/allocated n/a"));
    };
    for (const ScenarioGroup& g : scenarios) {
      std::vector<std::string> row{g.empty() ? "" : g.front().scenario};
      for (const ScenarioResult& r : g) {
        std::string kind = below_98_words(r);
        if (kind.empty() && r.first_oom) kind = "first report: " + std::string(to_string(r.first_oom->verdict));
        auto [a, b] = cell(r.backend, r.ooms, kind, r.peak_reserved_bytes, r.peak_allocated_bytes);
        row.push_back(a);
        row.push_back(b);
      }
      t.add(row);
    }
    for (const ReplayGroup& g : replays) {
      std::vector<std::string> row{g.empty() ? "" : terminal_text(g.front().trace)};
      for (const ReplayResult& r : g) {
        auto [a, b] = cell(r.backend, r.ooms, r.first_oom ? "first report: " + std::string(to_string(r.first_oom->verdict)) : std::string(),
                           r.peak_reserved_bytes, r.peak_allocated_bytes);
        row.push_back(a);
        row.push_back(b);
      }
      t.add(row);
    }
    t.print(stdout, 2, false);
  }
  std::string title = "expseg study: ";  // the backends that ran: "split_merge vs expandable", "expandable"
  for (std::size_t i = 0; i < setup.backends.size(); ++i) title += (i ? " vs " : "") + std::string(to_string(setup.backends[i]));
  write_picture(html, scenarios, replays, descriptions, setup, title, command_line(argc, argv), true);
  if (!json) print_picture_hint(html);
  else std::fprintf(stderr, "expseg study: the picture is in %s (open it with: %s %s)\n", absolute_path(html).c_str(), open_command().c_str(), absolute_path(html).c_str());
  return kExitOk;
}


// --- explain ---------------------------------------------------------------------------------------

namespace {

// "800.00 MiB, 300.00 MiB, 2 x 20.00 MiB" of the largest `n` sizes (equal ones counted).
std::string largest_sizes(std::vector<std::size_t> sizes, std::size_t n) {
  std::sort(sizes.begin(), sizes.end(), std::greater<>());
  std::string out;
  std::size_t shown = 0;
  for (std::size_t i = 0; i < sizes.size() && shown < n; ++shown) {
    std::size_t j = i;
    while (j < sizes.size() && sizes[j] == sizes[i]) ++j;
    if (!out.empty()) out += ", ";
    if (j - i > 1) out += std::to_string(j - i) + " x ";
    out += format_bytes(sizes[i]);
    i = j;
  }
  if (sizes.empty()) out = "-";
  return out;
}

void print_dump_summary(const std::string& path, const OomDump& d) {
  const OomReport& r = d.report;
  // Everything printed from the dump goes through terminal_text: the file may come from anywhere.
  std::printf("%s: OOM %llu of process %lld, device %d, written by expseg %s\n", terminal_text(path).c_str(),
              static_cast<unsigned long long>(d.oom_number), static_cast<long long>(d.pid), d.device, terminal_text(d.version).c_str());
  std::printf("  backend %s, %s, device %s\n\nThe report:\n", terminal_text(r.backend).c_str(),
              r.limit_bytes ? ("limit " + format_bytes(r.limit_bytes)).c_str() : "no limit", format_bytes(r.device_total_bytes).c_str());
  print_indented(stdout, terminal_text(r.message), 4, terminal_width(1));

  std::vector<std::size_t> live, pending, free_mapped;
  std::map<std::uint64_t, std::size_t> live_by_stream;
  std::size_t reserved = 0, mapped = 0, live_requested = 0, free_bytes = 0;
  for (const SegmentInfo& seg : d.snapshot.segments) {
    reserved += seg.size;
    mapped += seg.mapped_bytes;
    for (const BlockInfo& b : seg.blocks) {
      switch (b.state) {
        case BlockState::allocated:
          live.push_back(b.requested);
          live_requested += b.requested;
          live_by_stream[b.stream] += b.requested;
          break;
        case BlockState::pending_free: pending.push_back(b.size); break;
        case BlockState::free_mapped:
          free_mapped.push_back(b.size);
          free_bytes += b.size;
          break;
        case BlockState::free_unmapped: break;
      }
    }
  }
  std::printf("\nAt the OOM (the dump's snapshot):\n");
  Table t({{"", false}, {"", false}});
  const bool expandable = d.snapshot.backend == "expandable";
  t.add({"segments", std::to_string(d.snapshot.segments.size()) + " (" + format_bytes(expandable ? mapped : reserved) + " of device memory)"});
  t.add({"live allocations", with_commas(live.size()) + ", " + format_bytes(live_requested) + " requested; the largest: " + largest_sizes(live, 5)});
  if (live_by_stream.size() > 1) {
    std::string streams;
    for (const auto& [stream, bytes] : live_by_stream) {
      char hex[32];
      std::snprintf(hex, sizeof hex, "0x%llx", static_cast<unsigned long long>(stream));
      if (!streams.empty()) streams += ", ";
      streams += std::string(hex) + ": " + format_bytes(bytes);
    }
    t.add({"live by stream", streams});
  }
  t.add({"free blocks", with_commas(free_mapped.size()) + ", " + format_bytes(free_bytes) + " backed by memory; the largest: " +
                            largest_sizes(free_mapped, 5)});
  if (!pending.empty()) t.add({"waiting frees", with_commas(pending.size()) + " (freed, waiting for streams that used them)"});
  if (r.partial_pages) t.add({"partly used pages", with_commas(r.partial_pages) + ", " + format_bytes(r.page_slack_bytes) + " free inside them"});
  t.print(stdout, 2, false);
}

// The report's other-backend sentence placed the live allocations in a fresh pool; the replay takes the
// other backend through the run's own history (what it cached and split on the way). Where the two
// answers for the dumped request differ, says so: the replay's is the one about this run.
void print_counterfactual_check(const OomReport& r, const Trace& trace, const std::vector<ReplayResult>& results) {
  if (r.counterfactual == Counterfactual::not_evaluated) return;
  std::size_t failed = trace.events.size();  // the dumped request: the trace's last failed allocation of its size
  for (std::size_t i = trace.events.size(); i-- > 0;)
    if (trace.events[i].action == TraceAction::allocate_failure && trace.events[i].size == r.requested_bytes) {
      failed = i;
      break;
    }
  if (failed == trace.events.size()) return;
  for (const ReplayResult& res : results) {
    if (res.backend != r.other_backend) continue;
    const bool fails = std::find(res.oom_events.begin(), res.oom_events.end(), failed) != res.oom_events.end();
    if (fails == (r.counterfactual == Counterfactual::would_fail)) return;
    // A replay that failed a request this run served holds other allocations from there on (less:
    // the failed block and its later free are skipped), so what it does with the dumped request is
    // no answer for this run.
    std::size_t diverged = failed;
    for (const std::uint64_t k : res.oom_events)
      if (k < diverged && trace.events[k].action == TraceAction::allocate) diverged = static_cast<std::size_t>(k);
    if (diverged != failed) {
      const TraceEvent& e = trace.events[diverged];
      const std::string where = e.line != 0 ? "line " + std::to_string(e.line) + " of the trace" : "event " + std::to_string(diverged + 1);
      std::printf("\nNote: replayed through this run's events, the %s backend ran out of memory earlier, at a request of %s\n"
                  "(%s) that this run served; from there it holds other allocations than this run, so what it does\n"
                  "with this request is no answer for this run.\n",
                  r.other_backend.c_str(), format_bytes(e.size).c_str(), where.c_str());
      return;
    }
    std::printf("\nNote: the report says the %s backend would have %s this request; it placed the live allocations in a fresh\n"
                "pool. Replayed through this run's events, %s %s it: its own history (what it cached and split on the way)\n"
                "decides, so for this run the replay's answer is the one that holds.\n",
                r.other_backend.c_str(), fails ? "served" : "failed", r.other_backend.c_str(), fails ? "fails" : "serves");
  }
}

}  // namespace

int cmd::explain(int argc, char** argv) {
  const Args args = parse_args(argc, argv, 2, {{"--backend", true}, {"--html", true}, {"--no-replay", false}});
  if (args.positional.size() != 1) throw UsageError("give one OOM dump (the file oom_dump:PATH wrote)");
  const std::string path = args.positional.front();
  const auto html = args.get("--html");
  if (html && args.has("--no-replay")) throw UsageError("--html draws the replay: it cannot go with --no-replay");
  if (args.has("--backend") && args.has("--no-replay")) throw UsageError("--backend picks the replay's backends: it cannot go with --no-replay");
  OomDump d;
  try {
    d = read_oom_dump(path);
  } catch (const expseg::error& e) {
    throw InputError(e.what());
  }
  if (html) check_picture_path(*html, {path});  // the dump; its trace is checked once found
  print_dump_summary(path, d);

  std::printf("\n");
  if (d.trace.empty()) {
    std::printf("No trace: the event recorder was off. With record:true next to oom_dump, the events that led to the OOM\n"
                "are written beside the dump, and 'expseg explain' replays them on both backends.\n");
    return kExitOk;
  }
  std::error_code ec;
  {
    // The trace was written beside the dump, under the path the program saw (relative to its
    // directory, or absolute on its machine): beside the dump is where it is now, also for a dump
    // copied elsewhere with its trace, where the old path may be missing or hold another run's trace.
    // Its name as the dump gives it first; then as the dump's own name gives it (a path that is
    // not UTF-8 comes back from the JSON with U+FFFD in place of its odd bytes).
    const std::filesystem::path dir = std::filesystem::path(path).parent_path();
    for (const std::filesystem::path& beside :
         {dir / std::filesystem::path(d.trace).filename(), dir / std::filesystem::path(oom_dump_trace_path(path)).filename()})
      if (std::filesystem::is_regular_file(beside, ec)) {
        d.trace = beside.string();
        break;
      }
  }
  if (!std::filesystem::exists(d.trace, ec)) {
    std::printf("The trace %s (%zu events) is not there any more.\n", terminal_text(d.trace).c_str(), d.trace_events);
    return kExitOk;
  }
  // Only a file: a dump names its trace by the path its program saw, and a FIFO or a device there
  // (/dev/stdin) would block the reading, or feed it what is not a trace.
  if (!std::filesystem::is_regular_file(d.trace, ec))
    throw InputError(terminal_text(path) + ": the trace it names, " + terminal_text(d.trace) + ", is not a regular file (the recorder writes one): not read");
  if (html) check_picture_path(*html, {path, d.trace});
  if (args.has("--no-replay")) {
    std::printf("The events that led here: %s (%zu events%s).\n", terminal_text(d.trace).c_str(), d.trace_events,
                d.trace_complete ? "" : "; it does not start from an empty allocator");
    return kExitOk;
  }

  // The dump's configuration on a simulated device of the dump's device size, under its limit.
  Setup setup;
  std::string conf_note;
  try {
    setup.config = Config::parse(d.config);
  } catch (const config_error& e) {
    conf_note = " (the dump's configuration is not one this version reads, so the defaults: " + std::string(e.what()) + ")";
  }
  setup.config.device = DeviceKind::sim;
  // A dump from a GPU run carries the default sim_granularity (the H200's 2 MiB page); one edited or
  // written on a simulated device may carry any: a page larger than the device would replay on a
  // device of one page (was: a 1 TiB "device" with OOMs at 0 bytes, exit 0).
  if (setup.config.sim_granularity > d.report.device_total_bytes && d.report.device_total_bytes != 0) {
    conf_note += " (the dump's sim_granularity, " + format_bytes(setup.config.sim_granularity) + ", is more than the device's " +
                 format_bytes(d.report.device_total_bytes) + ": pages of " + format_bytes(Config{}.sim_granularity) + " instead)";
    setup.config.sim_granularity = Config{}.sim_granularity;
  }
  const std::size_t g = setup.config.sim_granularity;
  // Other processes and the CUDA context hold memory no trace records: the replay's device is what
  // this process could hold at the OOM (its reserved memory and what was free), as the verdict counted.
  const std::size_t total = d.report.device_total_bytes;
  // (Free memory unknown at the OOM: the whole device, the verdict's only bound then.)
  const std::size_t obtainable = !d.report.device_free_known ? total
                                 : d.report.device_free_bytes + std::min(d.report.reserved_bytes, SIZE_MAX - d.report.device_free_bytes);
  const std::size_t usable = std::min(total, obtainable);
  setup.config.sim_capacity = std::max(usable / g * g, g);
  setup.config.sim_host_backed = false;
  setup.config.limit = Limit{d.report.limit_bytes, 0.0};
  setup.config.record = false;
  setup.config.oom_dump.clear();
  setup.backends = args.get("--backend") ? parse_backends(*args.get("--backend"))
                                         : std::vector<BackendKind>{BackendKind::split_merge, BackendKind::expandable};
  setup.device_label = device_label(setup.config, 0);
  // An expandable run under policy:cupy with PyTorch's rules (roundup_power2_divisions, say): its
  // split_merge is CuPy's pool, which has none of them (was: the replay stopped at split_merge's
  // refusal of the dump's own configuration, halfway through the output).
  std::vector<std::string> reset;
  for (BackendKind b : setup.backends) {
    std::vector<std::string> keys;
    (void)setup.config.with_backend(b, &keys);
    if (!keys.empty()) reset = keys;
  }
  Trace trace = with_trace_path(d.trace, [&] { return read_trace(d.trace); });
  const std::size_t read_events = trace.events.size();
  // A trace cut or changed since the dump is replayed leniently (frees of what it no longer holds
  // skipped and counted), as one that does not start from an empty allocator is.
  const bool lenient = !d.trace_complete || read_events != d.trace_events;
  // A trace that does not start from an empty allocator misses the allocations of what was live
  // before it (e.g. the weights): replayed alone it holds less than the run and may not run out.
  const SeededBlocks seeded = d.trace_complete ? SeededBlocks{} : seed_live_before_trace(trace, d.snapshot);
  std::printf("The events that led here: %s (%zu events), replayed on %s%s%s%s:\n\n", terminal_text(d.trace).c_str(), d.trace_events,
              setup.device_label.c_str(), d.report.limit_bytes ? (" under the limit of " + format_bytes(d.report.limit_bytes)).c_str() : "",
              d.trace_complete       ? ""
              : seeded.blocks != 0 ? " (leniently: the trace does not start from an empty allocator)"
                                   : " (leniently: the trace does not start from an empty allocator, so the replay holds less memory than the run did)",
              conf_note.c_str());
  if (read_events != d.trace_events)
    std::printf("Note: the trace holds %zu events, the dump says it wrote %zu: it was cut or changed since, or is another\n"
                "run's; the replay below is of what it holds, leniently.\n\n",
                read_events, d.trace_events);
  if (seeded.blocks != 0)
    std::printf("Seeded: %zu block%s (%s) %s live before the trace's first event (allocated before the recording began, or\n"
                "their allocation dropped from its ring); the replay allocates them first, as the trace's frees and the dump's\n"
                "snapshot give them, but not the free memory the run's cache held then.\n\n",
                seeded.blocks, seeded.blocks == 1 ? "" : "s", format_bytes(seeded.bytes).c_str(), seeded.blocks == 1 ? "was" : "were");
  // What a trace cannot carry, said before the replay is read as the run's double.
  std::size_t waiting = 0;
  for (const auto& seg : d.snapshot.segments)
    for (const auto& b : seg.blocks) waiting += b.state == BlockState::pending_free;
  if (usable < total)
    std::printf("Note: other processes (and the CUDA context) held %s of the device's %s at the OOM; the replay's device\n"
                "has the %s this process could hold.\n\n",
                format_bytes(total - usable).c_str(), format_bytes(total).c_str(), format_bytes(usable).c_str());
  if (!reset.empty()) {
    std::string names;
    for (const std::string& k : reset) names += (names.empty() ? "" : ", ") + k;
    std::printf("Note: split_merge replays under policy:cupy, CuPy's pool, which has none of PyTorch's rules: without the dump's\n"
                "%s.\n\n", names.c_str());
  }
  if (d.limit_changed)
    std::printf("Note: the limit changed while these events were recorded; the replay applies the last one (%s) from the first\n"
                "event, so it may run out of memory elsewhere than the run did.\n\n",
                d.report.limit_bytes ? format_bytes(d.report.limit_bytes).c_str() : "none");
  if (waiting != 0)
    std::printf("Note: %zu free%s waiting for other streams at the OOM (record_stream); a trace holds frees as the program made\n"
                "them, so the replay frees them at once and may not run out of memory where the run did.\n\n",
                waiting, waiting == 1 ? " was" : "s were");
  const std::vector<ReplayGroup> groups = {
      with_trace_path(d.trace, [&] { return replay_trace(trace, setup, html.has_value(), lenient, false); })};
  print_replay_table(groups);
  print_replay_failures(groups);
  print_counterfactual_check(d.report, trace, groups.front());
  if (html) {
    write_picture(*html, {}, groups, {"The events that led to " + path + ", replayed on the simulated device."}, setup,
                  "expseg explain: " + path, command_line(argc, argv));
    print_picture_hint(*html);
  }
  return kExitOk;
}

}  // namespace expseg::cli
