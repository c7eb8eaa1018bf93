// Shared pieces of the expseg command line (see cli.hpp).
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>

#include "cli.hpp"
#include "expseg/allocator.hpp"
#include "expseg/errors.hpp"

namespace expseg::cli {

std::optional<std::string> Args::get(const std::string& name) const {
  auto it = values.find(name);
  if (it == values.end() || it->second.empty()) return std::nullopt;
  return it->second.back();
}

std::vector<std::string> Args::all(const std::string& name) const {
  auto it = values.find(name);
  return it == values.end() ? std::vector<std::string>{} : it->second;
}

Args parse_args(int argc, char** argv, int first, const std::vector<OptionSpec>& specs) {
  Args a;
  bool options_done = false;
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (options_done || arg.size() < 2 || arg[0] != '-') {
      a.positional.push_back(arg);
      continue;
    }
    if (arg == "--") {
      options_done = true;
      continue;
    }
    if (arg == "-h" || arg == "--help") {
      a.values["--help"].push_back("");
      continue;
    }
    std::string name = arg, value;
    bool inline_value = false;
    if (auto eq = arg.find('='); eq != std::string::npos && arg.rfind("--", 0) == 0) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    const OptionSpec* spec = nullptr;
    for (const OptionSpec& s : specs)
      if (name == s.name) spec = &s;
    if (spec == nullptr) throw UsageError("unknown option '" + name + "'");
    if (spec->takes_value) {
      if (!inline_value) {
        if (i + 1 >= argc) throw UsageError("option '" + name + "' needs a value");
        value = argv[++i];
      }
      if (value.empty()) throw UsageError("option '" + name + "' needs a non-empty value");
    } else if (inline_value) {
      throw UsageError("option '" + name + "' takes no value (got '" + arg + "')");
    }
    // --conf layers (each applies over the ones before) and --trace lists; any other value given
    // twice would silently lose the first.
    if (spec->takes_value && name != "--conf" && name != "--trace" && a.has(name))
      throw UsageError("option '" + name + "' given twice ('" + a.values[name].back() + "', then '" + value + "'); give it once");
    a.values[name].push_back(value);
  }
  return a;
}

std::uint64_t parse_u64(const std::string& option, const std::string& text) {
  std::uint64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  // A number of digits only that does not fit is not "not an integer": say what the bound is.
  if (ec == std::errc::result_out_of_range && p == text.data() + text.size())
    throw UsageError("bad " + option + " value '" + text + "': the number is too large (at most " + std::to_string(UINT64_MAX) + ")");
  if (ec != std::errc() || p != text.data() + text.size())
    throw UsageError("bad " + option + " value '" + text + "': expected a non-negative integer");
  return v;
}

std::vector<BackendKind> parse_backends(const std::string& text) {
  std::vector<BackendKind> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    const std::string item = text.substr(start, comma - start);
    start = comma + 1;
    if (item == "all" || item == "both") {
      for (BackendKind k : {BackendKind::split_merge, BackendKind::expandable})
        if (std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
      continue;
    }
    if (item.empty()) throw UsageError("bad --backend value '" + text + "': empty backend name; expected split_merge, expandable or both");
    Config c;
    try {
      c.apply("backend:" + item);  // the library's own names and aliases (native keeps the default, split_merge)
    } catch (const config_error&) {
      throw UsageError("bad --backend value '" + item + "': expected split_merge, expandable (or both, or a comma-separated list)");
    }
    if (std::find(out.begin(), out.end(), c.backend) == out.end()) out.push_back(c.backend);
  }
  return out;
}

namespace {
// User text echoed in a message: control and non-ASCII bytes as \xNN (as the library's config
// messages quote it), cut at 200 bytes.
std::string echo(const std::string& text) {
  constexpr std::size_t kMax = 200;
  std::string out;
  for (std::size_t i = 0; i < text.size() && i < kMax; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c >= 0x7f || c == '\\') {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    } else {
      out += text[i];
    }
  }
  if (text.size() > kMax) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}
}  // namespace

Config base_config(const Args& args) {
  Config c;
  const char* env = std::getenv("EXPSEG_ALLOC_CONF");
  try {
    c = Config::from_env();
  } catch (const config_error& e) {
    throw InputError(std::string(e.what()) + "\n(in EXPSEG_ALLOC_CONF=" + echo(env ? env : "") + ")");
  }
  for (const std::string& text : args.all("--conf")) {
    try {
      c.apply(text);
    } catch (const config_error& e) {
      throw InputError(std::string(e.what()) + "\n(in --conf " + echo(text) + ")");
    }
  }
  try {
    c.validate();
  } catch (const config_error& e) {
    throw InputError(e.what());
  }
  return c;
}

namespace {
// Whether a key:value,... text sets one of `keys` (items split as Config::apply splits them: a
// class name inside expandable_segments_reserve_by_class:[...] is not a key). A text apply refuses
// names nothing (base_config has already reported it).
bool text_names(const std::string& text, std::initializer_list<std::string_view> keys) {
  try {
    for (const std::string& key : Config::keys_of(text))
      if (std::find(keys.begin(), keys.end(), key) != keys.end()) return true;
  } catch (const config_error&) {
  }
  return false;
}

// Whether a --conf string sets one of `keys` (e.g. the backend: backend:B or PyTorch's
// expandable_segments:B).
bool conf_names(const Args& args, std::initializer_list<std::string_view> keys) {
  for (const std::string& text : args.all("--conf"))
    if (text_names(text, keys)) return true;
  return false;
}
}  // namespace

bool conf_sets(const Args& args, std::string_view key) {
  const char* env = std::getenv("EXPSEG_ALLOC_CONF");
  return conf_names(args, {key}) || (env != nullptr && text_names(env, {key}));
}

Setup make_setup(const Args& args) {
  Setup s;
  s.config = base_config(args);
  if (const char* env = std::getenv("EXPSEG_ALLOC_CONF")) s.env_conf = env;
  // The job's EXPSEG_ALLOC_CONF, still set in the shell that now replays its trace, names the job's
  // dump: a simulated run writing there replaced the job's dump and its trace (the evidence the
  // replay is about) with its own. Only --conf oom_dump asks these commands for dumps; the recorder,
  // which only feeds a dump's trace, goes with the dump unless --conf names it.
  if (!s.config.oom_dump.empty() && !conf_names(args, {"oom_dump"})) {
    std::fprintf(stderr, "note: oom_dump in EXPSEG_ALLOC_CONF is not used by this command (it would overwrite that job's dump); "
                         "--conf oom_dump:PATH writes this run's dumps\n");
    s.config.oom_dump.clear();
    if (!conf_names(args, {"record"})) s.config.record = false;
  }
  const bool conf_backend = conf_names(args, {"backend", "expandable_segments"});
  if (args.get("--backend")) {
    // Both would pick the backend, one of them silently ignored: the caller must choose.
    if (conf_backend) throw UsageError("--backend and a --conf backend (backend: or expandable_segments:) both pick the backend; give one");
    s.backends = parse_backends(*args.get("--backend"));
  } else if (conf_backend) {
    s.backends = {s.config.backend};  // --conf backend:B (or expandable_segments:True) picks one
  } else {
    s.backends = {BackendKind::split_merge, BackendKind::expandable};  // A/B
  }

  std::string why;
  if (auto dev = args.get("--device")) {
    const std::string& d = *dev;
    if (d == "sim:" || d == "cuda:")  // an empty shell variable, most likely: say so, do not guess
      throw UsageError("bad --device value '" + d + "': nothing after the ':' (expected sim:CAPACITY, e.g. sim:80GiB, or cuda:N)");
    if (conf_names(args, {"device"}))  // one of them would be ignored: the caller chooses
      throw UsageError("--device " + d + " and a --conf device: both pick the device; give one");
    if (d == "sim" || d.rfind("sim:", 0) == 0) {
      s.config.device = DeviceKind::sim;
      if (d.size() > 4) {
        if (conf_names(args, {"sim_capacity"}))
          throw UsageError("--device " + d + " and --conf sim_capacity: both give the simulated device's capacity; give one");
        try {
          s.config.sim_capacity = parse_bytes(std::string_view(d).substr(4), "--device");
        } catch (const config_error&) {
          throw UsageError("bad --device value '" + d + "': the capacity must be bytes or a number with a unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. sim:80GiB");
        }
        if (s.config.sim_capacity == 0) throw UsageError("bad --device value '" + d + "': the capacity must be more than 0");
        // sim:80 is 80 bytes, not a device: say so here rather than let the page size take the blame.
        const std::string_view cap = std::string_view(d).substr(4);
        if (s.config.sim_capacity < s.config.sim_granularity && cap.find_first_not_of("0123456789") == std::string_view::npos)
          throw UsageError("bad --device value '" + d + "': a capacity without a unit is a number of bytes, and " + std::string(cap) +
                           " bytes is less than one page of the simulated device; did you mean sim:" + std::string(cap) + "GiB?");
      }
      s.device_note = "the simulated device (--device " + d + ")";
    } else if (d == "cuda" || d.rfind("cuda:", 0) == 0) {
      if (d.size() > 5) {
        std::uint64_t n = 0;
        try {
          n = parse_u64("--device", d.substr(5));
        } catch (const UsageError&) {  // quote the whole value, not the index alone ('-1')
          throw UsageError("bad --device value '" + d + "': expected cuda:N with N a device index (0, 1, ...)");
        }
        if (n > 1024) throw UsageError("bad --device value '" + d + "': no such device index");
        s.device = static_cast<int>(n);
      }
      if (!cuda_available(&why)) throw std::runtime_error("--device " + d + ": CUDA is not usable here: " + why);
      // Before the "Device:" line and a driver error from deep inside the run (was: exit 1 with
      // cuDeviceGet's CUDA_ERROR_INVALID_DEVICE).
      if (const int visible = cuda_device_count(); s.device >= visible)
        throw UsageError("bad --device value '" + d + "': no such device; " + std::to_string(visible) + " visible (cuda:0" +
                         (visible > 1 ? " to cuda:" + std::to_string(visible - 1) : std::string()) + ")");
      s.config.device = DeviceKind::cuda;
      s.device_note = "the GPU (--device " + d + ")";
    } else {
      throw UsageError("bad --device value '" + d + "': expected sim, sim:CAPACITY (e.g. sim:80GiB), cuda or cuda:N");
    }
  } else if (s.config.device == DeviceKind::sim) {
    s.device_note = "the simulated device (device:sim in the configuration)";
  } else if (conf_sets(args, "device")) {
    // device:cuda in --conf or EXPSEG_ALLOC_CONF asks for the GPU as --device cuda does: no fallback
    // to the simulator (was: taken from the environment, it fell back with a note).
    const char* where = conf_names(args, {"device"}) ? "--conf" : "EXPSEG_ALLOC_CONF";
    if (!cuda_available(&why)) throw std::runtime_error(std::string(where) + " device:cuda: CUDA is not usable here: " + why);
    s.device_note = std::string("the GPU (device:cuda in ") + where + ")";
  } else if (cuda_available(&why)) {
    s.config.device = DeviceKind::cuda;
    s.device_note = "the GPU (CUDA is usable; --device sim for the simulator)";
  } else {
    s.config.device = DeviceKind::sim;
    s.device_note = "the simulated device: CUDA is not usable here ('expseg info' says why)";
  }
  s.device_label = device_label(s.config, s.device);
  // Before any run: a configuration that one of the backends would refuse (e.g. --device sim:1024TiB,
  // where an expandable segment would reserve 2 PiB) fails now, not after the other backend's run.
  for (BackendKind b : s.backends) {
    Config c = s.config;
    c.backend = b;
    try {
      c.validate();
    } catch (const config_error& e) {
      throw InputError(std::string(e.what()) + " (backend " + to_string(b) + ")");
    }
  }
  return s;
}

// --- output ------------------------------------------------------------------------------------

namespace {
// Display width of UTF-8 text (every code point one column: enough for our ASCII tables).
std::size_t width(const std::string& s) {
  std::size_t w = 0;
  for (unsigned char c : s)
    if ((c & 0xC0) != 0x80) ++w;
  return w;
}
}  // namespace

void Table::print(std::FILE* out, int indent, bool header) const {
  std::vector<std::size_t> w(cols_.size(), 0);
  for (std::size_t c = 0; c < cols_.size(); ++c) w[c] = header ? width(cols_[c].title) : 0;
  for (const auto& row : rows_)
    for (std::size_t c = 0; c < cols_.size() && c < row.size(); ++c) w[c] = std::max(w[c], width(row[c]));
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s(static_cast<std::size_t>(indent), ' ');
    for (std::size_t c = 0; c < cols_.size(); ++c) {
      const std::string cell = c < cells.size() ? cells[c] : "";
      const std::string pad(w[c] - std::min(w[c], width(cell)), ' ');
      if (c) s += "  ";
      if (cols_[c].right) s += pad + cell;
      else if (c + 1 < cols_.size()) s += cell + pad;
      else s += cell;
    }
    while (!s.empty() && s.back() == ' ') s.pop_back();
    std::fprintf(out, "%s\n", s.c_str());
  };
  if (header) {
    std::vector<std::string> head;
    for (const Column& c : cols_) head.push_back(c.title);
    line(head);
    std::vector<std::string> rule;
    for (std::size_t c = 0; c < cols_.size(); ++c) rule.push_back(std::string(w[c], '-'));
    line(rule);
  }
  for (const auto& row : rows_) line(row);
}

std::string with_commas(std::uint64_t n) {
  // Built forwards (not with insert(): g++ 12 -O3 warns falsely, -Wrestrict, on that).
  const std::string digits = std::to_string(n);
  std::string s;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i != 0 && (digits.size() - i) % 3 == 0) s.push_back(',');
    s.push_back(digits[i]);
  }
  return s;
}

std::string fixed(double v, int decimals) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, decimals);
  return std::string(buf, r.ptr);
}

std::string seconds_text(double s) {
  if (s < 0.001) return fixed(s * 1e6, 0) + " us";
  if (s < 1.0) return fixed(s * 1e3, 1) + " ms";
  return fixed(s, 2) + " s";
}

std::string rate_text(double r) {
  if (!(r > 0)) return "-";
  if (r >= 1e9) return fixed(r / 1e9, 2) + "G/s";
  if (r >= 1e6) return fixed(r / 1e6, 2) + "M/s";
  if (r >= 1e3) return fixed(r / 1e3, 1) + "k/s";
  return fixed(r, 0) + "/s";
}

std::string ratio_text(std::int64_t num, std::int64_t den) {
  if (den <= 0) return "-";
  return fixed(static_cast<double>(num) / static_cast<double>(den), 2) + "x";
}

std::string size_text(std::int64_t bytes) { return format_bytes(static_cast<std::size_t>(std::max<std::int64_t>(bytes, 0))); }

void print_indented(std::FILE* out, const std::string& text, int indent, std::size_t wrap) {
  const std::string pad(static_cast<std::size_t>(indent), ' ');
  const std::size_t room = wrap > pad.size() + 30 ? wrap - pad.size() : 0;
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t nl = text.find('\n', start);
    if (nl == std::string::npos) nl = text.size();
    std::string line = text.substr(start, nl - start);
    start = nl + 1;
    // Word-wrap to `room` columns (0: never).
    while (room != 0 && line.size() > room) {
      std::size_t cut = line.rfind(' ', room);
      if (cut == std::string::npos || cut == 0) break;
      std::fprintf(out, "%s%s\n", pad.c_str(), line.substr(0, cut).c_str());
      line.erase(0, cut + 1);
    }
    std::fprintf(out, "%s%s\n", pad.c_str(), line.c_str());
  }
}

std::string terminal_text(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    } else {
      out += ch;
    }
  }
  return out;
}

std::size_t terminal_width(int fd) {
  if (::isatty(fd) != 1) return 0;
  if (const char* c = std::getenv("COLUMNS")) {
    const int n = std::atoi(c);
    if (n > 20) return static_cast<std::size_t>(n);
  }
  winsize ws{};
  if (::ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 20) return ws.ws_col;
  return 100;
}

void flush_stdout() {
  if (std::fflush(stdout) != 0) throw OutputError(std::strerror(errno));
}

bool stderr_is_tty() { return ::isatty(2) == 1; }
bool stdout_is_tty() { return ::isatty(1) == 1; }

std::string absolute_path(const std::string& path) {
  std::error_code ec;
  auto p = std::filesystem::absolute(path, ec);
  if (ec) return path;
  return p.lexically_normal().string();
}

std::string open_command() {
#ifdef __APPLE__
  return "open";
#else
  return "xdg-open";
#endif
}

std::vector<ShippedTrace> shipped_traces() {
  std::vector<ShippedTrace> out;
#ifdef EXPSEG_SHIPPED_TRACES_DIR
  static const ShippedTrace kTraces[] = {
      {"resnet50-train-varsize.rmm.csv.gz",
       "A ResNet-50 training run with variable batch sizes, recorded from PyTorch's caching allocator as an RMM "
       "allocation log on an H200 (benchmarks/traces): activations and workspaces of changing sizes come and go every "
       "iteration, so a split pool caches blocks of many sizes that later requests cannot reuse exactly. Without a "
       "limit, the question is how much more than the live bytes each backend holds, and how fast it serves the requests."},
      {"gpt2-train-varlen.rmm.csv.gz",
       "GPT-2 small training with random batch sizes and sequence lengths, recorded by expseg's own event recorder "
       "under PyTorch on an H200 (benchmarks/workloads.py --record): 13.1 GiB of activations at the peak, whose sizes change "
       "with every batch. Without a limit, PyTorch's classic allocator held 17.96 GiB for it, its expandable segments 14.10 GiB."},
  };
  for (const ShippedTrace& t : kTraces) {
    const std::string path = std::string(EXPSEG_SHIPPED_TRACES_DIR) + "/" + t.path;
    std::error_code ec;
    if (std::filesystem::is_regular_file(path, ec)) out.push_back({path, t.description});
  }
#endif
  return out;
}

}  // namespace expseg::cli
