// The expseg command line: shared pieces (argument parsing, device and backend selection, tables).
// Tools use only the public API (include/expseg/).
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "expseg/config.hpp"

namespace expseg::cli {

// Exit codes.
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;  // runtime failure (driver error, cannot write a file, ...)
constexpr int kExitUsage = 2;    // bad command line or bad input (trace, config)

// A bad command line: main() prints "expseg COMMAND: message", the command's usage, and exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Bad input other than the command line (a trace or config value): printed as-is, exit 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Standard output could not be written (a full disk, a closed pipe): main() prints "expseg COMMAND:
// error writing standard output: REASON" and exits 1. Thrown by flush_stdout().
struct OutputError : std::runtime_error {
  using std::runtime_error::runtime_error;  // the reason, strerror's words
};

// --- argument parsing --------------------------------------------------------------------------

struct OptionSpec {
  const char* name;  // "--backend"
  bool takes_value;
};

struct Args {
  std::vector<std::string> positional;
  std::map<std::string, std::vector<std::string>> values;  // option -> every value given (flags: "")
  bool has(const std::string& name) const { return values.count(name) != 0; }
  // The last value of an option (only --conf and --trace may be given more than once).
  std::optional<std::string> get(const std::string& name) const;
  std::vector<std::string> all(const std::string& name) const;
};

// Parses argv[first..argc) against `specs`. Accepts "--name value" and "--name=value"; "--" ends
// the options. Throws UsageError for unknown options and missing values. "-h"/"--help" set "--help".
Args parse_args(int argc, char** argv, int first, const std::vector<OptionSpec>& specs);

// --- run setup ---------------------------------------------------------------------------------

struct Setup {
  Config config;                        // EXPSEG_ALLOC_CONF + --conf, with the device chosen
  std::vector<BackendKind> backends;    // A/B order
  int device = 0;
  std::string device_label;             // "sim:80GiB", "cuda:0"
  std::string device_note;              // why this device (e.g. "CUDA is not usable here: ...")
  std::string env_conf;                 // EXPSEG_ALLOC_CONF as read ("" when unset): shown, as it changes the runs
};

// Reads EXPSEG_ALLOC_CONF, applies --conf, parses --backend and --device. Throws UsageError for a
// malformed option, InputError for a bad config value, std::runtime_error when --device cuda is
// asked for on a machine where CUDA is not usable.
Setup make_setup(const Args& args);
Config base_config(const Args& args);  // EXPSEG_ALLOC_CONF + --conf only
// Whether EXPSEG_ALLOC_CONF or a --conf names `key` (e.g. sim_latency), whatever its value.
bool conf_sets(const Args& args, std::string_view key);
std::vector<BackendKind> parse_backends(const std::string& text);
std::uint64_t parse_u64(const std::string& option, const std::string& text);

// --- output ------------------------------------------------------------------------------------

// An aligned text table: left-aligned text columns, right-aligned numeric ones.
class Table {
 public:
  struct Column {
    std::string title;
    bool right;
  };
  explicit Table(std::vector<Column> columns) : cols_(std::move(columns)) {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  bool empty() const { return rows_.empty(); }
  void print(std::FILE* out, int indent = 0, bool header = true) const;

 private:
  std::vector<Column> cols_;
  std::vector<std::vector<std::string>> rows_;
};

std::string with_commas(std::uint64_t n);          // 41787 -> "41,787"
std::string fixed(double v, int decimals);         // locale-independent
std::string seconds_text(double s);                // "0.034 s", "12 ms"
std::string rate_text(double per_second);          // "1.23M/s"
std::string ratio_text(std::int64_t num, std::int64_t den);  // "1.43x" or "-"
std::string size_text(std::int64_t bytes);         // format_bytes of a signed count
// Prints `text` line by line, indented; words wrap at `wrap` columns (0: no wrapping).
void print_indented(std::FILE* out, const std::string& text, int indent, std::size_t wrap = 0);
// Flushes stdout (JSON lines go out as each run ends); throws OutputError when that fails, so that a
// run whose results cannot be written stops there.
void flush_stdout();
// Text read from a file (an OOM dump), made safe to print: control bytes other than newline and
// tab (escape sequences, NUL) are written \xNN, so the file cannot drive the terminal.
std::string terminal_text(std::string_view text);
// Columns of the terminal on `fd`, 0 when it is not a terminal (output then never wraps).
std::size_t terminal_width(int fd);
bool stderr_is_tty();
bool stdout_is_tty();
// "/abs/path" of a relative path (for "open it with" lines); the path itself when that fails.
std::string absolute_path(const std::string& path);
std::string open_command();  // "xdg-open" or "open"

// The traces shipped in benchmarks/traces (compile-time source path) that are there, with what each
// shows, in the order `expseg study` replays them.
struct ShippedTrace {
  std::string path;
  const char* description;
};
std::vector<ShippedTrace> shipped_traces();

}  // namespace expseg::cli

namespace expseg::cli::cmd {
int info(int argc, char** argv);
int config(int argc, char** argv);
int replay(int argc, char** argv);
int scenario(int argc, char** argv);
int study(int argc, char** argv);
int explain(int argc, char** argv);
}  // namespace expseg::cli::cmd
