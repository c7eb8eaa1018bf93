// Error helpers and OOM report serialisation (see errors.hpp).
#include "expseg/errors.hpp"

#include <charconv>

#include "core/json.hpp"
#include "expseg/snapshot.hpp"

namespace expseg {

const char* to_string(OomVerdict v) noexcept {
  switch (v) {
    case OomVerdict::capacity: return "capacity";
    case OomVerdict::limit: return "limit";
    case OomVerdict::fragmentation: return "fragmentation";
    case OomVerdict::unknown: return "unknown";
  }
  return "unknown";
}

const char* to_string(Counterfactual c) noexcept {
  switch (c) {
    case Counterfactual::not_evaluated: return "not_evaluated";
    case Counterfactual::would_succeed: return "would_succeed";
    case Counterfactual::would_fail: return "would_fail";
  }
  return "unknown";
}

std::string OomReport::to_json() const { return to_json(true); }

std::string OomReport::to_json(bool with_snapshot) const {
  // The stream is a handle, written as hex like the snapshot's streams.
  char stream_hex[2 + 16] = {'0', 'x'};
  auto r = std::to_chars(stream_hex + 2, stream_hex + sizeof stream_hex, stream, 16);

  core::JsonWriter w;
  w.begin_object();
  w.field("backend", backend);
  w.field("device", device);
  w.field("stream", std::string_view(stream_hex, static_cast<std::size_t>(r.ptr - stream_hex)));
  w.field("requested_bytes", std::uint64_t{requested_bytes});
  w.field("rounded_bytes", std::uint64_t{rounded_bytes});
  w.field("device_total_bytes", std::uint64_t{device_total_bytes});
  w.key("device_free_bytes");
  if (device_free_known) {
    w.value(std::uint64_t{device_free_bytes});
  } else {
    w.null();  // not read: no figure (0 would read as a full device)
  }
  w.field("limit_bytes", std::uint64_t{limit_bytes});
  w.field("allocated_bytes", std::uint64_t{allocated_bytes});
  w.field("reserved_bytes", std::uint64_t{reserved_bytes});
  w.field("reserved_unallocated_bytes", std::uint64_t{reserved_unallocated_bytes()});
  w.field("live_requested_bytes", std::uint64_t{live_requested_bytes});
  w.field("live_footprint_bytes", std::uint64_t{live_footprint_bytes});
  w.field("page_slack_bytes", std::uint64_t{page_slack_bytes});
  w.field("partial_pages", std::uint64_t{partial_pages});
  w.field("largest_free_block_bytes", std::uint64_t{largest_free_block_bytes});
  w.field("free_blocks", std::uint64_t{free_blocks});
  w.field("verdict", to_string(verdict));
  w.field("other_backend", other_backend);
  w.field("counterfactual", to_string(counterfactual));
  w.field("message", message);
  w.field("dump_path", dump_path);
  w.key("snapshot");
  if (snapshot && with_snapshot) {
    w.raw(snapshot->to_json());
  } else {
    w.null();
  }
  w.end_object();
  return w.take();
}

}  // namespace expseg
