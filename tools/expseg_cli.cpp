// expseg — the command line of the expseg GPU memory allocator.
//
//   expseg info                         version, CUDA, devices, the effective EXPSEG_ALLOC_CONF
//   expseg config                       the options table and the current configuration
//   expseg replay TRACE...              replay RMM allocation logs, A/B on both backends
//   expseg scenario NAME|--all|--list   the OOM stories, A/B on both backends
//   expseg study                        every scenario and the shipped traces, with an HTML picture
//   expseg explain DUMP.json            an OOM dump (oom_dump:PATH), its recorded events replayed A/B
//
// Exit codes: 0 ok, 1 runtime failure, 2 usage error or bad input. Uses the public API only.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

#include "cli.hpp"
#include "expseg/allocator.hpp"
#include "expseg/errors.hpp"

#ifndef EXPSEG_VERSION
#define EXPSEG_VERSION "unknown"
#endif

namespace expseg::cli {
namespace {

constexpr const char* kDeviceHelp =
    "  --device D        sim, sim:CAPACITY (bytes or a number with a unit: KiB, MiB, GiB, TiB, KB, MB, GB, TB),\n"
    "                    cuda or cuda:N. Default: sim when the configuration says device:sim, else\n"
    "                    cuda:0 when a CUDA device is usable, else sim; sim has the configured\n"
    "                    sim_capacity (80 GiB unless the configuration says otherwise)\n";
constexpr const char* kBackendHelp =
    "  --backend B[,B]   split_merge, expandable, or both (default: both, so every run is an A/B;\n"
    "                    a --conf backend:B or expandable_segments:B alone picks that one)\n";
// explain takes no --conf: the replay runs the dump's own configuration.
constexpr const char* kExplainBackendHelp =
    "  --backend B[,B]   split_merge, expandable, or both (default: both, so every run is an A/B)\n";
constexpr const char* kConfHelp =
    "  --conf K:V,...    configuration applied over EXPSEG_ALLOC_CONF (see 'expseg config'); repeatable\n";

struct CommandHelp {
  const char* name;
  const char* summary;
  const char* usage;
  std::string details;
};

const CommandHelp* find_help(std::string_view name) {
  static const CommandHelp helps[] = {
      {"info", "version, CUDA availability, devices and the effective configuration", "expseg info [--conf K:V,...]",
       std::string("Prints the expseg version, whether CUDA is usable here (and why not), every device with its total and\n"
                   "free memory and allocation granularity, and the effective EXPSEG_ALLOC_CONF.\n\nOptions:\n") +
           kConfHelp},
      {"config", "the configuration options table and the current configuration", "expseg config [--conf K:V,...]",
       std::string("Prints every option EXPSEG_ALLOC_CONF accepts (name, type, default, help) and the current configuration\n"
                   "in canonical key:value form. PyTorch's PYTORCH_CUDA_ALLOC_CONF keys are accepted too.\n\nOptions:\n") +
           kConfHelp},
      {"replay", "replay RMM allocation logs (CSV or .csv.gz) on both backends",
       "expseg replay TRACE... [--backend B[,B]] [--device D] [--conf K:V,...] [--json] [--html FILE] [--lenient]",
       std::string("Replays every allocation and free of each trace (RMM's logging_resource_adaptor CSV, plain or gzip)\n"
                   "against a fresh allocator per backend and compares peak allocated vs peak reserved memory, OOMs and time.\n\n"
                   "Options:\n") +
           kBackendHelp + kDeviceHelp + kConfHelp +
           "  --json            one JSON object per (trace, backend) per line, instead of the table\n"
           "  --html FILE       also write the A/B picture (a self-contained HTML page) to FILE\n"
           "  --lenient         replay a partial trace: skip frees of unknown pointers (and pool lines that do\n"
           "                    not pair up), free a pointer allocated again while live, instead of failing\n\n"
           "Example:\n  expseg replay benchmarks/traces/resnet50-train-varsize.rmm.csv.gz --device sim:80GiB\n"},
      {"scenario", "run the OOM scenarios A/B on both backends",
       "expseg scenario NAME|--all|--list [--backend B[,B]] [--device D] [--conf K:V,...] [--json] [--html FILE] [--seed N]\n"
       "                       [--sizes MIN-MAX]",
       std::string("Runs a named, deterministic allocation story that reproduces an OOM users hit, on each backend, and\n"
                   "says which backend failed and why (the first OOM report is printed after the table). Each story\n"
                   "runs under its own limit (--list shows it) unless the configuration sets a non-zero one.\n\n"
                   "Options:\n"
                   "  --list            list the scenarios with their descriptions\n"
                   "  --all             run every scenario\n") +
           kBackendHelp + kDeviceHelp + kConfHelp +
           "  --json            one JSON object per (scenario, backend) per line, instead of the table\n"
           "  --html FILE       also write the A/B picture (a self-contained HTML page) to FILE\n"
           "  --seed N          seed of the random stories, N >= 1 (default: each scenario's own)\n"
           "  --sizes MIN-MAX   random-churn only: draw sizes log-uniform in MIN-MAX instead of 4KiB-512MiB,\n"
           "                    e.g. 1MiB-64MiB (with --conf limit:SIZE for another limit than 3 GiB)\n\n"
           "Examples:\n  expseg scenario split-800-500-300 --device sim\n"
           "  expseg scenario random-churn --sizes 2MiB-16MiB --seed 2\n"},
      {"study", "every scenario and the shipped traces, A/B, with an HTML picture",
       "expseg study [--device D] [--html FILE] [--trace PATH...] [--backend B[,B]] [--conf K:V,...] [--json] [--seed N] [--lenient]",
       std::string("The main job of expseg: runs every scenario and the shipped ResNet-50 and GPT-2 traces on both\n"
                   "backends, prints the tables and the reasons of the failures, and writes one HTML page with a chart\n"
                   "of allocated and reserved memory over time per backend, OOM markers, the limit, and segment maps.\n\n"
                   "Options:\n") +
           kDeviceHelp +
           "  --html FILE       where to write the picture (default: expseg-study.html in the current directory)\n"
           "  --trace PATH...   replay these traces instead of the shipped ones; repeatable\n" +
           kBackendHelp + kConfHelp +
           "  --json            JSON lines instead of the tables (the picture is still written)\n"
           "  --seed N          seed of the random stories, N >= 1 (default: each scenario's own)\n"
           "  --lenient         replay the traces leniently, as expseg replay --lenient (partial traces)\n"},
      {"explain", "read an OOM dump (oom_dump:PATH) and replay the events that led to it on both backends",
       "expseg explain DUMP.json [--backend B[,B]] [--html FILE] [--no-replay]",
       std::string("Prints what the dump holds: the OOM report, the live allocations and free blocks at the OOM (the\n"
                   "largest of each), then, when the recorder was on (record:true), replays the recorded events on both\n"
                   "backends on a simulated device of the memory the process could hold at the OOM (the device's, less\n"
                   "what other processes held) under its limit, and says which backend fails where and why.\n\n"
                   "Options:\n") +
           kExplainBackendHelp +
           "  --html FILE       also write the replay's A/B picture (a self-contained HTML page) to FILE\n"
           "  --no-replay       print the dump only\n\n"
           "Example:\n  EXPSEG_ALLOC_CONF=record:true,record_ring:1000000,oom_dump:/tmp/oom-%p.json python3 train.py\n"
           "  expseg explain /tmp/oom-12345.json --html oom.html\n"},
  };
  for (const CommandHelp& h : helps)
    if (name == h.name) return &h;
  return nullptr;
}

void print_global_help(std::FILE* out) {
  std::fprintf(out,
               "expseg %s: GPU memory allocator with expandable (virtual-memory) and split/merge backends\n\n"
               "Usage: expseg COMMAND [OPTIONS]\n\nCommands:\n",
               EXPSEG_VERSION);
  for (const char* c : {"info", "config", "replay", "scenario", "study", "explain"}) {
    const CommandHelp* h = find_help(c);
    std::fprintf(out, "  %-9s %s\n", h->name, h->summary);
  }
  std::fprintf(out,
               "\nRun 'expseg COMMAND --help' for the options of a command.\n\n"
               "Examples:\n"
               "  expseg study                                   # all scenarios + the ResNet-50 and GPT-2 traces, A/B, with a picture\n"
               "  expseg scenario --list\n"
               "  expseg scenario split-800-500-300 --device sim\n"
               "  expseg replay my-run.rmm.csv.gz --device sim:80GiB --json\n\n"
               "Without a GPU everything runs on the simulated device. Configuration: EXPSEG_ALLOC_CONF=key:value,...\n"
               "(see 'expseg config'). Exit codes: 0 ok, 1 runtime failure, 2 usage error or bad input.\n");
}

void print_command_help(const CommandHelp& h) {
  std::printf("Usage: %s\n\n%s\n%s", h.usage, h.summary, h.details.c_str());
}

}  // namespace

// --- info --------------------------------------------------------------------------------------

int cmd::info(int argc, char** argv) {
  const Args args = parse_args(argc, argv, 2, {{"--conf", true}});
  if (!args.positional.empty()) throw UsageError("unexpected argument '" + args.positional.front() + "'");
  std::printf("expseg %s\n", EXPSEG_VERSION);

  std::string why;
  const bool cuda = cuda_available(&why);
  std::printf("CUDA: %s\n", cuda ? "usable" : ("not usable: " + why).c_str());

  // The configuration first: a bad EXPSEG_ALLOC_CONF is reported but does not hide the devices.
  const char* env = std::getenv("EXPSEG_ALLOC_CONF");
  std::optional<Config> conf;
  std::string conf_error;
  try {
    conf = base_config(args);
  } catch (const InputError& e) {
    conf_error = e.what();
  }
  const Config base = conf ? *conf : Config{};

  Table t({{"device", false}, {"name", false}, {"total", true}, {"free", true}, {"granularity", true}, {"GPUDirect RDMA", false}});
  int failures = 0;
  if (cuda) {
    Config c = base;
    c.device = DeviceKind::cuda;
    c.backend = BackendKind::split_merge;
    c.limit = Limit{};
    for (int i = 0; i < 1024; ++i) {
      try {
        Allocator a(c, i);  // builds no segment: only the driver and the device's memory info
        const DeviceInfo d = a.device_info();
        t.add({"cuda:" + std::to_string(i), d.name, format_bytes(d.total_bytes), format_bytes(d.free_bytes), format_bytes(d.granularity),
               d.gpu_direct_rdma ? "yes" : "no"});
      } catch (const std::exception& e) {
        if (i == 0) {
          std::printf("cuda:0: cannot open the device: %s\n", e.what());
          ++failures;
        }
        break;
      }
    }
  }
  std::string sim_error;  // a sim_ key the simulated device cannot honour (sim_granularity above sim_capacity, say)
  try {
    Config c = base;
    c.device = DeviceKind::sim;
    c.backend = BackendKind::split_merge;
    c.limit = Limit{};
    Allocator a(c, 0);
    const DeviceInfo d = a.device_info();
    t.add({device_label(c, 0), d.name, format_bytes(d.total_bytes), format_bytes(d.free_bytes), format_bytes(d.granularity), "-"});
  } catch (const std::exception& e) {
    sim_error = e.what();
  }
  std::printf("\nDevices:\n");
  t.print(stdout, 2);
  if (!sim_error.empty()) {
    std::printf("  sim: the simulated device cannot be built with this configuration: %s\n", sim_error.c_str());
    ++failures;
  }
  Config sim = base;
  sim.device = DeviceKind::sim;
  std::string default_device;
  if (base.device == DeviceKind::sim) default_device = device_label(sim, 0) + " (device:sim in the configuration)";
  else if (cuda) default_device = "cuda:0";
  else default_device = device_label(sim, 0) + " (the simulator: CUDA is not usable)";
  std::printf("\nDefault device of replay, scenario and study: %s\n", default_device.c_str());

  std::printf("\nEXPSEG_ALLOC_CONF=%s\n", env ? env : "(unset)");
  for (const std::string& c : args.all("--conf")) std::printf("--conf %s\n", c.c_str());
  if (!conf_error.empty()) {
    std::fprintf(stderr, "%s\n", conf_error.c_str());
    return kExitUsage;
  }
  std::printf("effective configuration:\n  %s\n", conf->to_string().c_str());
  return failures ? kExitFailure : kExitOk;
}

// --- config ------------------------------------------------------------------------------------

int cmd::config(int argc, char** argv) {
  const Args args = parse_args(argc, argv, 2, {{"--conf", true}});
  if (!args.positional.empty()) throw UsageError("unexpected argument '" + args.positional.front() + "'");
  const Config c = base_config(args);

  std::printf("Options of EXPSEG_ALLOC_CONF (key:value,key:value; PyTorch's PYTORCH_CUDA_ALLOC_CONF keys are accepted):\n\n");
  Table t({{"name", false}, {"type", false}, {"default", false}, {"help", false}});
  std::size_t fixed_width = 0;
  std::size_t w[3] = {4, 4, 7};
  for (const Config::Option& o : Config::options()) {
    w[0] = std::max(w[0], std::strlen(o.name));
    w[1] = std::max(w[1], std::strlen(o.type));
    w[2] = std::max(w[2], std::strlen(o.default_value));
  }
  fixed_width = 2 + w[0] + 2 + w[1] + 2 + w[2] + 2;
  // Wrap the help column to the terminal when printing to one; never when piped.
  const std::size_t cols = terminal_width(1);
  const std::size_t help_width = cols > fixed_width + 30 ? cols - fixed_width : 0;
  for (const Config::Option& o : Config::options()) {
    std::string help = o.help;
    if (help_width == 0 || help.size() <= help_width) {
      t.add({o.name, o.type, o.default_value, help});
      continue;
    }
    bool first = true;
    while (!help.empty()) {
      std::size_t cut = help.size() <= help_width ? help.size() : help.rfind(' ', help_width);
      if (cut == std::string::npos || cut == 0) cut = std::min(help.size(), help_width);
      t.add({first ? o.name : "", first ? o.type : "", first ? o.default_value : "", help.substr(0, cut)});
      help.erase(0, cut);
      while (!help.empty() && help.front() == ' ') help.erase(0, 1);
      first = false;
    }
  }
  t.print(stdout, 2);

  const char* env = std::getenv("EXPSEG_ALLOC_CONF");
  std::printf("\nCurrent configuration (EXPSEG_ALLOC_CONF=%s", env ? env : "unset");
  for (const std::string& s : args.all("--conf")) std::printf(", --conf %s", s.c_str());
  std::printf("):\n  %s\n", c.to_string().c_str());
  return kExitOk;
}

}  // namespace expseg::cli

namespace {

int run_command(int argc, char** argv) {
  using namespace expseg::cli;
  if (argc < 2) {
    print_global_help(stderr);
    std::fprintf(stderr, "\nexpseg: missing COMMAND\n");
    return kExitUsage;
  }
  const std::string command = argv[1];
  if (command == "-h" || command == "--help" || command == "help") {
    if (command == "help" && argc > 2) {
      if (const CommandHelp* h = find_help(argv[2])) {
        print_command_help(*h);
        return kExitOk;
      }
      std::fprintf(stderr, "expseg help: unknown command '%s'\n\n", argv[2]);
      print_global_help(stderr);
      return kExitUsage;
    }
    print_global_help(stdout);
    return kExitOk;
  }
  if (command == "--version" || command == "version") {
    if (argc > 2) {
      std::fprintf(stderr, "expseg %s: unexpected argument '%s'\n", command.c_str(), argv[2]);
      return kExitUsage;
    }
    std::printf("expseg %s\n", EXPSEG_VERSION);
    return kExitOk;
  }
  const CommandHelp* help = find_help(command);
  if (help == nullptr) {
    std::fprintf(stderr, "expseg: unknown command '%s'\n\n", command.c_str());
    print_global_help(stderr);
    return kExitUsage;
  }
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--") == 0) break;
    if (std::strcmp(argv[i], "-h") == 0 || std::strcmp(argv[i], "--help") == 0) {
      print_command_help(*help);
      return kExitOk;
    }
  }
  try {
    if (command == "info") return cmd::info(argc, argv);
    if (command == "config") return cmd::config(argc, argv);
    if (command == "replay") return cmd::replay(argc, argv);
    if (command == "scenario") return cmd::scenario(argc, argv);
    if (command == "explain") return cmd::explain(argc, argv);
    return cmd::study(argc, argv);
  } catch (const OutputError& e) {
    std::fprintf(stderr, "expseg %s: error writing standard output: %s\n", command.c_str(), e.what());
    return kExitFailure;
  } catch (const UsageError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "expseg %s: %s\nUsage: %s\nRun 'expseg %s --help' for details.\n", command.c_str(), e.what(), help->usage, command.c_str());
    return kExitUsage;
  } catch (const InputError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", e.what());
    return kExitUsage;
  } catch (const expseg::trace_error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", e.what());
    return kExitUsage;
  } catch (const expseg::config_error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", e.what());
    return kExitUsage;
  } catch (const std::bad_alloc& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "expseg %s: out of memory: %s\n", command.c_str(), e.what());
    return kExitFailure;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "expseg %s: error: %s\n", command.c_str(), e.what());
    return kExitFailure;
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace expseg::cli;
  const int rc = run_command(argc, argv);
  // Output that did not reach its file (a full disk, a closed pipe) is a failure the exit status
  // must tell: a script reading `expseg ... --json > out` would take a cut file for a run's result.
  // The last lines may still sit in stdio's buffer, so flush before asking.
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  if (flushed && !std::ferror(stdout)) return rc;
  // (A command that failed has said why, a failed flush included; its exit status stands.)
  if (rc != kExitOk) return rc;
  const std::string who = argc >= 2 && find_help(argv[1]) != nullptr ? std::string("expseg ") + argv[1] : std::string("expseg");
  // (The reason is lost when the failed write was an earlier one, stdio's buffer filling up.)
  std::fprintf(stderr, "%s: error writing standard output%s%s\n", who.c_str(), err ? ": " : "", err ? std::strerror(err) : "");
  return kExitFailure;
}
