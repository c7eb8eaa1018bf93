// Snapshot serialisation (see snapshot.hpp).
#include "expseg/snapshot.hpp"

#include <charconv>

#include "core/json.hpp"

namespace expseg {

const char* to_string(BlockState s) noexcept {
  switch (s) {
    case BlockState::allocated: return "allocated";
    case BlockState::pending_free: return "pending_free";
    case BlockState::free_mapped: return "free_mapped";
    case BlockState::free_unmapped: return "free_unmapped";
  }
  return "unknown";
}

namespace {

// Addresses as "0x..." strings: JSON numbers are doubles to most readers and lose bits above 2^53.
std::string hex(std::uint64_t v) {
  char buf[2 + 16];
  buf[0] = '0';
  buf[1] = 'x';
  auto r = std::to_chars(buf + 2, buf + sizeof buf, v, 16);
  return std::string(buf, r.ptr);
}

}  // namespace

std::string Snapshot::to_json() const {
  core::JsonWriter w;
  w.begin_object();
  w.field("backend", backend);
  w.field("device", device);
  w.field("limit_bytes", std::uint64_t{limit_bytes});
  w.field("device_total_bytes", std::uint64_t{device_total_bytes});
  w.key("stats").raw(stats.to_json());
  w.key("segments").begin_array();
  for (const SegmentInfo& seg : segments) {
    w.begin_object();
    w.field("address", hex(seg.address));
    w.field("size", std::uint64_t{seg.size});
    w.field("mapped_bytes", std::uint64_t{seg.mapped_bytes});
    w.field("stream", hex(seg.stream));
    w.field("pool", seg.small_pool ? "small" : "large");
    w.field("physical_handles", std::uint64_t{seg.physical_handles});
    if (seg.graph_pool != 0) w.field("graph_pool", std::uint64_t{seg.graph_pool});
    w.key("blocks").begin_array();
    for (const BlockInfo& b : seg.blocks) {
      w.begin_object();
      w.field("address", hex(b.address));
      w.field("size", std::uint64_t{b.size});
      w.field("requested", std::uint64_t{b.requested});
      w.field("state", to_string(b.state));
      w.field("stream", hex(b.stream));
      w.end_object();
    }
    w.end_array();
    w.key("mapped_ranges").begin_array();
    for (const AddressRange& r : seg.mapped_ranges) {
      w.begin_object();
      w.field("address", hex(r.address));
      w.field("size", std::uint64_t{r.size});
      w.end_object();
    }
    w.end_array();
    w.end_object();
  }
  w.end_array();
  w.end_object();
  return w.take();
}

}  // namespace expseg
