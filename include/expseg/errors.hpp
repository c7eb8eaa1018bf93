// expseg — errors thrown by the C++ API.
//
// Every error the C++ API throws derives from one of these (besides std::bad_alloc when the host
// itself runs out of memory). One exception, on purpose: expseg_torch_malloc, the entry point for
// PyTorch's pluggable allocator (expseg.h), throws expseg::out_of_memory on out of memory but
// std::invalid_argument (negative size) or std::runtime_error (any other failure) otherwise, which
// PyTorch turns into a Python RuntimeError carrying the message. The rule for all of them: when an
// operation throws, the allocator is left as it was before the call (no leaked driver resources,
// invariants hold), and it keeps serving; the give-backs (release_cached, set_limit, release_stream,
// end_graph_pool) keep what they gave back before a driver error, consistent all the same.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

// The public API keeps default visibility; the rest of libexpseg.so is built hidden.
#pragma GCC visibility push(default)

namespace expseg {

struct Snapshot;

// Base of the library's non-OOM errors.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A configuration string or option was malformed: names the key and lists the valid ones.
class config_error : public error {
 public:
  config_error(std::string key, const std::string& message) : error(message), key_(std::move(key)) {}
  // The key that was wrong ("" when the string itself could not be split into key:value pairs).
  const std::string& key() const noexcept { return key_; }

 private:
  std::string key_;
};

// A pointer passed to deallocate()/record_stream() is not a live allocation of this allocator:
// double free, interior pointer, a pointer of another allocator or device, or garbage.
class invalid_pointer : public error {
 public:
  using error::error;
};

// A CUDA driver call (or the simulated device standing in for it) failed with something other than
// running out of memory. Carries the call's name and the driver's own error name and string.
class driver_error : public error {
 public:
  driver_error(std::string call, int code, std::string code_name, std::string description)
      : error(call + " failed: " + code_name + " (" + std::to_string(code) + "): " + description),
        call_(std::move(call)), code_(code), code_name_(std::move(code_name)) {}
  const std::string& call() const noexcept { return call_; }
  int code() const noexcept { return code_; }
  const std::string& code_name() const noexcept { return code_name_; }
  // CUDA_ERROR_OUT_OF_MEMORY (2): the device itself has no memory left for this call.
  static constexpr int kOutOfMemoryCode = 2;
  bool is_out_of_memory() const noexcept { return code_ == kOutOfMemoryCode; }

 private:
  std::string call_;
  int code_;
  std::string code_name_;
};

// A malformed allocation trace (RMM CSV log): names the file and line.
class trace_error : public error {
 public:
  trace_error(const std::string& file, std::size_t line, const std::string& message)
      : error(compose(file, line, message)), file_(file), line_(line) {}
  const std::string& file() const noexcept { return file_; }
  std::size_t line() const noexcept { return line_; }  // 1-based; 0 when not tied to one line

 private:
  static std::string compose(const std::string& file, std::size_t line, const std::string& message) {
    std::string text = file;
    if (line != 0) {
      text += ':';
      text += std::to_string(line);
    }
    text += ": ";
    text += message;
    return text;
  }
  std::string file_;
  std::size_t line_;
};

// Why an allocation failed.
enum class OomVerdict : std::uint8_t {
  // capacity and limit compare what the backend must hold at the least: the live blocks as it holds
  // them (expandable: whole pages) and the request as it must be served (split_merge: a new segment,
  // e.g. PyTorch's 20 MiB one for a request of 1-10 MiB; expandable: whole pages). So a limit verdict
  // can come where the live requested bytes + request alone fit: the report's message gives both
  // figures, and the other backend's answer says whether its rounding would have fitted.
  capacity,       // that exceeds what the device has (or can give this process beside other processes' memory), or the
                  // device refused room the figures left (memory, address range)
  limit,          // that exceeds the configured limit, and the limit is the lower of the two bounds
  fragmentation,  // it fits, but the allocator has no place for the request (free memory lies in pieces)
  unknown,        // not evaluated: host memory ran out while the report was built (a short report), or
                  // the verdict needed the device's free memory, which could not be read
};
const char* to_string(OomVerdict) noexcept;

// What the other backend would have done with the same live set, placed afresh in a new pool (not
// after the run's own history, which `expseg explain` replays), and the same request. would_fail
// without a simulation where the live requested bytes plus the request exceed what any backend may
// hold; not_evaluated where it was not asked, or could not hold the live set itself afresh.
enum class Counterfactual : std::uint8_t { not_evaluated, would_succeed, would_fail };
const char* to_string(Counterfactual) noexcept;

// Everything expseg knows about one failed allocation. `message` is the full text; its first
// sentence reads like PyTorch's "CUDA out of memory. Tried to allocate ..." (CuPy's "Out of memory
// allocating ..." under policy:cupy) so users recognise it.
struct OomReport {
  std::string backend;               // "split_merge" or "expandable"
  int device = 0;
  std::uint64_t stream = 0;          // the stream the request was made on
  std::size_t requested_bytes = 0;   // what the caller asked for
  std::size_t rounded_bytes = 0;     // after the backend's rounding
  std::size_t device_total_bytes = 0;
  std::size_t device_free_bytes = 0;
  // false: the device's free memory could not be read (cuMemGetInfo failed while the report was
  // built, or a short report): device_free_bytes is 0 then, no figure, and JSON writes it as null.
  bool device_free_known = true;
  std::size_t limit_bytes = 0;       // 0: no limit configured
  std::size_t allocated_bytes = 0;   // live blocks (rounded sizes), as stats().allocated_bytes
  std::size_t reserved_bytes = 0;    // memory held from the device, as stats().reserved_bytes
  std::size_t live_requested_bytes = 0;        // sum of the live allocations' requested sizes, frees waiting for
                                               // another stream's work (record_stream) included: they hold their memory
  std::size_t live_footprint_bytes = 0;        // memory the live blocks occupy at the least (whole pages when expandable)
  // expandable: the free bytes inside the pages live blocks touch (live_footprint_bytes = live
  // blocks' bytes + this), in partly used pages: gaps that only a request smaller than them could use.
  std::size_t page_slack_bytes = 0;
  std::size_t partial_pages = 0;               // pages that live blocks use only partly
  std::size_t largest_free_block_bytes = 0;    // largest free contiguous block the backend holds
  std::size_t free_blocks = 0;                 // number of free blocks the backend holds
  OomVerdict verdict = OomVerdict::capacity;
  std::string other_backend;                   // the backend the counterfactual was run on
  Counterfactual counterfactual = Counterfactual::not_evaluated;
  std::string message;
  std::shared_ptr<const Snapshot> snapshot;    // with oom_snapshot:true, the allocator at the OOM
  std::string dump_path;                       // with oom_dump, the file this OOM was written to ("" if none)

  std::size_t reserved_unallocated_bytes() const noexcept {
    return reserved_bytes > allocated_bytes ? reserved_bytes - allocated_bytes : 0;
  }
  std::string to_json() const;
  std::string to_json(bool with_snapshot) const;  // with_snapshot false: "snapshot" is null
};

// Thrown by Allocator::allocate when memory cannot be found. Derives from std::bad_alloc so that
// code written for operator new handles it; report() says why it happened.
class out_of_memory : public std::bad_alloc {
 public:
  explicit out_of_memory(std::shared_ptr<const OomReport> report) : report_(std::move(report)) {}
  const char* what() const noexcept override { return report_->message.c_str(); }
  const OomReport& report() const noexcept { return *report_; }

 private:
  std::shared_ptr<const OomReport> report_;
};

}  // namespace expseg

#pragma GCC visibility pop
