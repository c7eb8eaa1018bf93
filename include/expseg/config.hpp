// expseg configuration: one options table (lib/config.cpp), read from EXPSEG_ALLOC_CONF or a string.
//
// Syntax is PyTorch's PYTORCH_CUDA_ALLOC_CONF: comma-separated `key:value` pairs, e.g.
//   EXPSEG_ALLOC_CONF=backend:expandable,limit:20GiB
// PyTorch's own keys are accepted with their meaning, so a PYTORCH_CUDA_ALLOC_CONF can be pasted:
//   expandable_segments:True|False, max_split_size_mb:N, roundup_power2_divisions:N or [a:b,...,>:c],
//   garbage_collection_threshold:F, max_non_split_rounding_mb:N, per_process_memory_fraction:F,
//   large_segment_size_mb:N and expandable_segments_reserve:F|NG (PyTorch after 2.11),
//   backend:native (PyTorch's caching allocator: keeps the backend, split_merge unless
//   expandable_segments:True, in either order). Accepted, their values checked, and ignored:
//   release_lock_on_cudamalloc, pinned_* and graph_capture_record_stream_reuse (host-side options of
//   PyTorch with nothing to do in a device allocator, also in their ROCm spellings *_hipmalloc,
//   *_hip_host_register), throw_on_cudamalloc_oom (what expseg always does) and
//   expandable_segments_reserve_by_class (expseg has no stream classes). As in PyTorch, one trailing
//   comma is accepted (also inside a roundup_power2_divisions list).
// Unknown keys and bad values throw expseg::config_error naming the key and listing valid ones.
// `expseg config` (tools) prints the table; Config::options() returns it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// The public API keeps default visibility; the rest of libexpseg.so is built hidden.
#pragma GCC visibility push(default)

namespace expseg {

enum class BackendKind : std::uint8_t { split_merge, expandable };
enum class DeviceKind : std::uint8_t { cuda, sim };
// split_merge presets: PyTorch's caching allocator (default) or CuPy's memory pool.
enum class PoolPolicy : std::uint8_t { pytorch, cupy };
// Shareable handle type for expandable physical memory (IPC).
enum class IpcHandle : std::uint8_t { none, posix_fd, fabric };
// peer_access:auto|none (the C API's allocators; a C++ Allocator grants through enable_peer_access).
enum class PeerAccess : std::uint8_t { automatic, none };

const char* to_string(BackendKind) noexcept;
const char* to_string(DeviceKind) noexcept;
const char* to_string(PoolPolicy) noexcept;
const char* to_string(IpcHandle) noexcept;
const char* to_string(PeerAccess) noexcept;

// A memory limit: absolute bytes, or a fraction of device memory (CuPy's CUPY_GPU_MEMORY_LIMIT
// "50%" semantics / PyTorch's per-process memory fraction). Unset means "the device's capacity".
struct Limit {
  std::size_t bytes = 0;   // used when fraction == 0
  double fraction = 0.0;   // in (0, 1]; 0 when bytes is used
  bool is_set() const noexcept { return bytes != 0 || fraction != 0.0; }
  // The limit in bytes for a device of `device_total` bytes (0 when unset).
  std::size_t resolve(std::size_t device_total) const noexcept;
  bool operator==(const Limit&) const = default;
};

// The largest expandable_va_size (1 PiB): beyond the virtual address space of any GPU, and small
// enough that rounding it up to any granularity cannot overflow. The default (2x device memory) is
// held to it too.
inline constexpr std::size_t kMaxExpandableVaSize = std::size_t{1} << 50;

inline constexpr std::size_t kRoundupIntervals = 16;  // PyTorch's intervals: 1 MiB .. 64 GiB

struct Config {
  // --- which allocator ---
  BackendKind backend = BackendKind::split_merge;   // backend:split_merge|expandable
  PoolPolicy policy = PoolPolicy::pytorch;          // policy:pytorch|cupy (split_merge presets)
  DeviceKind device = DeviceKind::cuda;             // device:cuda|sim

  // --- simulated device (device:sim) ---
  std::size_t sim_capacity = std::size_t{80} << 30;    // sim_capacity:80GiB
  std::size_t sim_granularity = std::size_t{2} << 20;  // sim_granularity:2MiB
  bool sim_host_backed = false;                        // sim_host_backed:true -> allocations hold real bytes
  bool sim_latency = false;                            // sim_latency:true -> H200 driver latency model

  // --- limit ---
  Limit limit;  // limit:20GiB | limit:50% | per_process_memory_fraction:0.5

  // --- split_merge, PyTorch semantics ---
  std::size_t max_split_size = SIZE_MAX;              // max_split_size_mb (MiB, >= large_segment_size)
  std::size_t max_non_split_rounding = std::size_t{20} << 20;  // max_non_split_rounding_mb (>= large_segment_size)
  // large_segment_size_mb: the segment a request of more than 1 MiB and less than 10 MiB gets
  // (PyTorch's kLargeBuffer, a key in PyTorch after 2.11). Invariant: > 10 MiB, and at most
  // max_split_size and max_non_split_rounding (PyTorch refuses smaller ones).
  std::size_t large_segment_size = std::size_t{20} << 20;
  std::array<std::size_t, kRoundupIntervals> roundup_power2_divisions{};  // 0 = off
  double garbage_collection_threshold = 0.0;          // in (0, 1); 0 = off

  // --- expandable ---
  // expandable_va_size: VA reserved per segment, in bytes (va_size) or as a share of device memory
  // (va_fraction, "N%", PyTorch's expandable_segments_reserve:F). At most one is nonzero; both 0 =
  // 2x device memory. expandable_va_bytes() resolves them.
  std::size_t va_size = 0;
  double va_fraction = 0.0;
  std::size_t max_handle_size = 0;  // expandable_max_handle: largest physical handle; 0 = policy default
  IpcHandle ipc_handle = IpcHandle::none;  // ipc_handle:none|posix_fd|fabric
  // peer_access:auto: once the C API has allocators on two or more devices of a process, each
  // expandable one grants the others' devices that can reach it (enable_peer_access), as PyTorch's
  // expandable segments are granted when it enables peer access for a cross-device copy: the
  // frameworks' cudaDeviceEnablePeerAccess reaches cuMemAlloc memory only, not cuMemMap's.
  PeerAccess peer_access = PeerAccess::automatic;

  // --- observability ---
  bool record = false;              // record:true -> event recorder on from the start
  std::size_t record_ring = 0;      // record_ring:N -> keep only the last N events (0 = all)
  bool oom_snapshot = false;        // oom_snapshot:true -> attach a snapshot to every OOM report
  bool oom_counterfactual = true;   // oom_counterfactual:false -> skip the other-backend check
  // oom_dump:PATH -> at every OOM, write the report, a snapshot, the config and (when recording)
  // the recorded trace to PATH (%p: process id, %d: device, %n: the OOM's number, %%: '%').
  // "" (printed and parsed as none) = off. A ',' in the path only inside balanced [...] (items are
  // split at commas); see expand_oom_dump_path().
  std::string oom_dump;

  // Parse `text` over the defaults. Empty text gives the defaults. EXPSEG_ALLOC_CONF is not read:
  // from_env() reads it (and Allocator() uses from_env()).
  static Config parse(std::string_view text);
  // Config::parse(getenv("EXPSEG_ALLOC_CONF")) or the defaults when it is unset.
  static Config from_env();
  // Apply `text` over this config's current values (later keys win).
  void apply(std::string_view text);
  // The keys `text` names, in order, trimmed, split at commas outside [...] as apply() splits them
  // (a class name inside expandable_segments_reserve_by_class's [...] is not a key). Throws
  // config_error where apply() would refuse the text's shape (unbalanced brackets, empty items).
  static std::vector<std::string> keys_of(std::string_view text);
  // This configuration with backend `b`, as an A/B comparison or the OOM report's other-backend check
  // runs it: split_merge under policy:cupy is CuPy's pool, which has none of PyTorch's rules
  // (validate() refuses them there), so those an expandable configuration sets (e.g.
  // roundup_power2_divisions, which expandable applies) go back to their defaults; `reset`, where
  // given, gets their keys.
  Config with_backend(BackendKind b, std::vector<std::string>* reset = nullptr) const;
  // Canonical `key:value,...` form; parse(to_string()) == *this.
  std::string to_string() const;
  // Throws config_error (naming the key) when the values cannot work together, as creating an
  // Allocator with this config would: device:sim settings the simulated device cannot honour (e.g.
  // an expandable segment of 2x a sim_capacity above 512 TiB). Each key alone is checked when parsed.
  void validate() const;
  // The VA an expandable segment reserves on a device of `device_total` bytes, before rounding to
  // pages; saturates at SIZE_MAX (callers bound it by kMaxExpandableVaSize).
  std::size_t expandable_va_bytes(std::size_t device_total) const noexcept;

  bool operator==(const Config&) const = default;

  struct Option {
    const char* name;
    const char* type;
    const char* default_value;
    const char* help;
  };
  // The options table, in the order `expseg config` prints it.
  static std::span<const Option> options();
};

// An oom_dump pattern with %p, %d, %n, %% replaced (the pattern was checked when it was parsed;
// any other '%' sequence is copied as it is).
std::string expand_oom_dump_path(std::string_view pattern, long pid, int device, std::uint64_t oom_number);

// "80GiB", "512MiB", "2GB", "4096", "1.5GiB" -> bytes; a fraction of a byte rounds down, but a
// nonzero size below one byte ("0.5") is an error, not 0. Throws config_error(key) on bad input.
std::size_t parse_bytes(std::string_view text, std::string_view key = "size");
// 1536 -> "1.50 KiB" (PyTorch's format_size: B, KiB, MiB, GiB with two decimals).
std::string format_bytes(std::size_t bytes);

// The device an allocator of `config` runs on, as results and the CLI name it: "sim:80GiB" (the
// simulated device and its capacity) or "cuda:0".
std::string device_label(const Config& config, int device);

}  // namespace expseg

#pragma GCC visibility pop
