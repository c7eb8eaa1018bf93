// The OOM report: what PyTorch (or CuPy) would print, then why it happened and what the other
// backend would have done with the same live set.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string_view>

#include "allocator_impl.hpp"
#include "core/text.hpp"

namespace expseg {

namespace {

using core::hex;

// 838860800 -> "838,860,800" (CuPy's message format).
std::string with_commas(std::size_t v) {
  std::string digits = std::to_string(v);
  std::string out;
  const std::size_t n = digits.size();
  for (std::size_t i = 0; i < n; ++i) {
    out += digits[i];
    if ((n - i - 1) % 3 == 0 && i + 1 < n) out += ',';
  }
  return out;
}

// What format_bytes shows for `v`, in hundredths of a byte: "150.00 MiB" is 15000 hundredths of a
// MiB. The figures a reader adds up, exactly.
__extension__ typedef unsigned __int128 Hundredths;  // past 64 bits: 100 x a byte count
Hundredths shown_bytes(std::size_t v) {
  const std::string text = format_bytes(v);
  Hundredths n = 0;
  std::size_t i = 0;
  for (; i < text.size() && text[i] != ' '; ++i)
    if (text[i] != '.') n = n * 10 + static_cast<unsigned>(text[i] - '0');
  if (text.find('.') == std::string::npos) return n * 100;  // "N bytes"
  const std::string_view unit = std::string_view(text).substr(i + 1);
  return n * (unit == "KiB" ? std::size_t{1} << 10 : unit == "MiB" ? std::size_t{1} << 20 : std::size_t{1} << 30);
}

using LiveAllocation = detail::CounterfactualCheck::Live;

// Replays the live set, in address order, into a fresh allocator of the other backend on a
// simulated device of the same size and limit, then asks for the failed request. A fresh pool, not
// this run's history: what the other backend would have cached and split on the way can make its
// answer differ either way (a recording's replay, expseg explain, tells for the run itself), and
// the message says "in a fresh pool". `live_set_unfit`: the live set alone did not fit, so the
// request was never asked (not_evaluated; was: "would have failed too").
Counterfactual run_counterfactual(const Config& base, BackendKind other, std::size_t device_total, std::size_t granularity,
                                  std::size_t limit, const std::vector<LiveAllocation>& live, std::size_t requested,
                                  driver::stream_t stream, bool& live_set_unfit) {
  live_set_unfit = false;
  Config c = base.with_backend(other);  // under policy:cupy, split_merge without PyTorch's rules
  c.device = DeviceKind::sim;
  c.sim_granularity = granularity;
  c.sim_capacity = std::max(device_total / granularity * granularity, granularity);
  c.sim_host_backed = false;
  c.sim_latency = false;
  c.record = false;
  c.oom_snapshot = false;
  c.oom_counterfactual = false;
  c.oom_dump.clear();  // the check's own OOM is not the user's: no dump of it
  c.limit = Limit{limit, 0.0};
  try {
    Allocator a(c);
    try {
      for (const LiveAllocation& l : live) a.allocate(l.requested, l.stream);
    } catch (const out_of_memory&) {
      live_set_unfit = true;
      return Counterfactual::not_evaluated;
    }
    a.allocate(requested, stream);
    return Counterfactual::would_succeed;
  } catch (const out_of_memory&) {
    return Counterfactual::would_fail;
  } catch (const std::exception&) {
    // Host memory running out (a plain std::bad_alloc) is no answer about the other backend.
    return Counterfactual::not_evaluated;
  }
}

// The message's last sentence: the other backend's answer (`live_count`: the live set it was given),
// or why it was not asked.
std::string counterfactual_sentence(const OomReport& r, std::size_t live_count, const char* why_not, bool simulated) {
  std::string s = " The " + r.other_backend + " backend";
  if (!simulated && r.counterfactual == Counterfactual::would_fail)  // the live requested bytes plus the request do not fit
    return s + " would have failed too.";
  const std::string given = ", given the same " + std::to_string(live_count) + " live allocation" + (live_count == 1 ? "" : "s") +
                            (r.limit_bytes ? " and limit" : "") + " in a fresh pool, would have ";
  switch (r.counterfactual) {
    case Counterfactual::would_succeed:
      s += given + "served this request.";
      break;
    case Counterfactual::would_fail:
      s += given + "failed too.";
      break;
    case Counterfactual::not_evaluated:  // said, so that no answer is not read as one
      s += " was not asked";
      s += why_not;
      break;
  }
  return s;
}

constexpr const char* kCheckFailed = ": its check could not run (host memory ran out, or its simulated device could not be built).";

}  // namespace

// The figures every report gives, from the allocator's own counts (no driver call).
void Allocator::Impl::fill_report_figures(OomReport& r, std::size_t requested, driver::stream_t asked_on) const {
  r.backend = to_string(config.backend);
  r.device = driver->device();
  r.stream = backends::shown_stream(asked_on);
  r.requested_bytes = requested;
  r.rounded_bytes = backend->round_size(requested);
  r.device_total_bytes = ctx.device_total;
  r.limit_bytes = ctx.limit;
  r.allocated_bytes = static_cast<std::size_t>(stats.allocated_bytes[kAllPools].current);
  r.reserved_bytes = static_cast<std::size_t>(stats.reserved_bytes[kAllPools].current);
  r.live_requested_bytes = static_cast<std::size_t>(stats.requested_bytes[kAllPools].current);
}

std::shared_ptr<OomReport> Allocator::Impl::build_oom_report(std::size_t requested, driver::stream_t stream, driver::stream_t asked_on,
                                                             CounterfactualCheck* deferred) {
  auto r = std::make_shared<OomReport>();
  fill_report_figures(*r, requested, asked_on);
  driver::MemInfo mi;
  // cuMemGetInfo can fail here (a context gone bad): the free memory is then unknown, and what
  // depends on it says so. (`mi` is set afresh in the handler; an optimised build was seen to
  // report an arbitrary figure as free when the handler relied on its initial value.)
  std::string mem_info_error;
  try {
    mi = driver->mem_info();
  } catch (const std::exception& e) {
    mi = driver::MemInfo{0, ctx.device_total};
    mem_info_error = e.what();
    if (mem_info_error.empty()) mem_info_error = "cuMemGetInfo failed";
  } catch (...) {
    mi = driver::MemInfo{0, ctx.device_total};
    mem_info_error = "cuMemGetInfo failed";
  }
  const bool free_known = mem_info_error.empty();
  r->device_total_bytes = mi.total;
  r->device_free_bytes = mi.free;
  r->device_free_known = free_known;
  const backends::FreeSummary fs = backend->free_summary(r->rounded_bytes > SIZE_MAX / 2 ? 0 : r->rounded_bytes, stream);
  r->largest_free_block_bytes = fs.largest_free_block;
  r->free_blocks = fs.free_blocks;

  // What the request needs at the least: the memory live blocks (pending frees included) occupy,
  // counted the way this backend must hold it (whole frames for expandable), plus the request.
  const std::size_t active = static_cast<std::size_t>(stats.active_bytes[kAllPools].current);
  const std::size_t footprint = std::max(fs.live_footprint, active);
  r->live_footprint_bytes = footprint;
  r->page_slack_bytes = fs.live_page_slack;
  r->partial_pages = fs.live_partial_pages;
  const bool overflow = r->rounded_bytes > SIZE_MAX / 2;
  // Free memory of live graph pools is kept for their graphs' replays: no more use to the request
  // than live memory (not fragmentation, and no backend without those pools to compare with).
  const std::size_t pools = fs.graph_pool_bytes;
  // So is memory cached for other streams that capture a CUDA graph now, until the capture ends.
  const std::size_t kept = fs.capture_kept_bytes;
  const std::size_t need = overflow ? SIZE_MAX : footprint + pools + kept + std::max(fs.request_footprint, r->rounded_bytes);
  // What this process could hold at most (free memory unknown: at least what it holds).
  const std::size_t obtainable = mi.free + r->reserved_bytes;
  if (overflow || need > mi.total) {
    r->verdict = OomVerdict::capacity;
  } else if (ctx.limit != 0 && need > ctx.limit && !(free_known && obtainable < ctx.limit)) {
    // (Past both the limit and what the device can give this process, the lower bound is the one
    // that binds: raising the limit would not help.)
    r->verdict = OomVerdict::limit;
  } else if (need > obtainable) {
    // Other processes hold the rest of the device; or, free memory unknown, maybe not.
    r->verdict = free_known ? OomVerdict::capacity : OomVerdict::unknown;
  } else {
    r->verdict = OomVerdict::fragmentation;
  }
  // The driver said out of memory (memory, or expandable's address range for a new segment) where
  // the limit and the device's free memory leave room for all the request needs beside what expseg
  // holds: nothing had to fit between live blocks, the device said no.
  const std::size_t room = std::min(ctx.limit != 0 ? ctx.limit : mi.total, obtainable);
  const std::size_t growth = overflow ? SIZE_MAX : std::max(fs.request_footprint, r->rounded_bytes);
  const backends::Context::Refusal refused =
      r->verdict == OomVerdict::fragmentation && r->reserved_bytes <= room && growth <= room - r->reserved_bytes
          ? ctx.refused
          : backends::Context::Refusal::none;
  if (refused != backends::Context::Refusal::none) r->verdict = OomVerdict::capacity;

  const BackendKind other = config.backend == BackendKind::expandable ? BackendKind::split_merge : BackendKind::expandable;
  r->other_backend = to_string(other);
  // Freed blocks that still hold their memory: frees waiting for other streams' work (record_stream),
  // and frees held until a capture ends (frees_after_capture). A block freed twice over streams is
  // counted once.
  std::vector<const core::Block*> waiting;
  for (const StreamEvents* se : busy_queues) se->queue.for_each([&](const PendingFree& pf) { waiting.push_back(pf.block); });
  std::sort(waiting.begin(), waiting.end());
  waiting.erase(std::unique(waiting.begin(), waiting.end()), waiting.end());
  const std::size_t held = frees_after_capture.size();
  // The other backend cannot be asked about a CUDA graph capture underway: its check replays the
  // live set into an allocator with no capture, which gives back memory a capture keeps.
  const bool capture_underway = ctx.capturing || stream_capturing(asked_on);
  CounterfactualCheck here;  // the check, when it runs under the lock (no `deferred`)
  CounterfactualCheck& check = deferred != nullptr ? *deferred : here;
  // The other backend is asked only when it might succeed. What this backend needs (`need`) counts
  // its own overheads (expandable: whole pages), which the other may not have: a live set scattered
  // over partly used pages can still fit split_merge's segments. Only the live requested bytes plus
  // the request, which every backend must hold, past the limit or what this process could hold,
  // decide without it.
  // Free memory unknown: only the device's total bounds it, and the simulated device is the whole
  // device, which answers for this process only where the limit binds before it.
  const std::size_t capacity = std::min(mi.total ? mi.total : ctx.device_total, free_known ? obtainable : SIZE_MAX);
  const bool simulable = free_known || (ctx.limit != 0 && ctx.limit <= r->reserved_bytes);
  const std::size_t at_least = overflow ? SIZE_MAX : r->live_requested_bytes + requested;
  if (overflow || at_least > capacity || (ctx.limit != 0 && at_least > ctx.limit)) {
    r->counterfactual = Counterfactual::would_fail;
  } else if (config.oom_counterfactual && refused == backends::Context::Refusal::none && simulable && pools == 0 && !capture_underway &&
             kept == 0 && driver->granularity() != 0) {
    // (A device that refused what its figures leave room for is no device the figures can simulate.)
    // A copy of what the simulation needs, so that it can run without the lock.
    std::vector<LiveAllocation>& live_set = check.live;
    live_set.reserve(live.size() + waiting.size() + frees_after_capture.size());
    live.for_each([&](const core::Block* b) { live_set.push_back({b->addr, b->requested, b->stream}); });
    for (const core::Block* b : waiting) live_set.push_back({b->addr, b->requested, b->stream});
    for (const core::Block* b : frees_after_capture) live_set.push_back({b->addr, b->requested, b->stream});
    check.config = config;
    check.capacity = capacity;
    check.granularity = driver->granularity();
    check.limit = ctx.limit;
    check.requested = requested;
    check.stream = stream;
    check.pending = true;
  }

  std::ostringstream os;
  // A stream that finds no memory sets badbit and drops the text: throw instead (the caller's short report).
  os.exceptions(std::ios::badbit);
  const std::size_t unallocated = r->reserved_unallocated_bytes();
  // As PyTorch, memory cached in private pools (CUDA graph pools; of the request's own pool, the
  // blocks too small for it) counts as allocated, not as reserved but unallocated: the request
  // cannot use it. Whole blocks: the free blocks the message counts are these bytes' blocks.
  const std::size_t in_pools = std::min(fs.graph_pool_free_bytes, unallocated);
  if (config.backend == BackendKind::split_merge && config.policy == PoolPolicy::cupy) {
    os << "Out of memory allocating " << with_commas(r->rounded_bytes) << " bytes (allocated so far: " << with_commas(r->reserved_bytes)
       << " bytes";
    if (ctx.limit) os << ", limit set to: " << with_commas(ctx.limit) << " bytes";
    os << ").";
  } else {
    // PyTorch names the size it asked the device for (for split_merge, the new segment's size).
    const std::size_t tried = config.backend == BackendKind::split_merge ? std::max(r->rounded_bytes, fs.request_footprint) : r->rounded_bytes;
    os << "CUDA out of memory. Tried to allocate " << format_bytes(tried) << ". GPU " << r->device << " has a total capacity of "
       << format_bytes(mi.total) << " of which ";
    if (free_known)
      os << format_bytes(mi.free) << " is free. ";
    else
      os << "an unknown amount is free (" << mem_info_error << "). ";  // driver_error: "cuMemGetInfo failed: ..."
    // PyTorch 2.9+ prints its allowed figure only under a memory fraction below 1 (at 1 it sets no
    // limit): a limit of all the device's memory, or more, is none here too (as for garbage collection).
    if (ctx.limit != 0 && ctx.limit < ctx.device_total) os << format_bytes(ctx.limit) << " allowed; ";
    os << "Of the allocated memory " << format_bytes(r->allocated_bytes + in_pools) << " is allocated by expseg, ";
    if (in_pools != 0) os << "with " << format_bytes(in_pools) << " allocated in private pools (e.g., CUDA Graphs), ";
    os << "and " << format_bytes(unallocated - in_pools) << " is reserved by expseg but unallocated.";
    if (config.backend == BackendKind::split_merge && r->verdict == OomVerdict::fragmentation)
      os << " If reserved but unallocated memory is large try setting EXPSEG_ALLOC_CONF=backend:expandable to avoid fragmentation.";
  }
  os << "\nexpseg verdict: " << to_string(r->verdict) << ". ";
  // Live (active) bytes also count frees that still hold their memory (waiting for other streams'
  // work or a capture's end): PyTorch's allocated bytes leave a block at its free.
  const std::size_t still_held = active > r->allocated_bytes ? active - r->allocated_bytes : 0;
  switch (r->verdict) {
    case OomVerdict::capacity:
    case OomVerdict::limit: {
      if (refused == backends::Context::Refusal::address_range) {
        os << "No address range could be reserved for a new segment (cuMemAddressReserve: out of memory), although the device has "
           << format_bytes(mi.free) << " of memory free: its virtual address space ran out, not its memory (each stream's segments "
           << "reserve expandable_va_size, by default twice the device's memory).";
        break;
      }
      if (refused == backends::Context::Refusal::memory) {
        os << "The driver refused the memory the request needs (" << format_bytes(growth) << ") with out of memory, although the device "
           << "reports " << format_bytes(mi.free) << " free" << (ctx.limit ? " and the limit leaves room for it" : "")
           << ": another process may have held that memory at the time.";
        break;
      }
      // The figures the verdict compared: what live blocks occupy and what the request needs, in this
      // backend's units (whole pages; a new segment).
      const bool pages = config.backend == BackendKind::expandable;
      os << "The live allocations (" << format_bytes(active);
      if (still_held != 0) os << ", " << format_bytes(still_held) << " of it in frees waiting for other streams' work or a capture's end";
      if (footprint > active) os << ", occupying " << format_bytes(footprint) << " of whole pages";
      os << ") plus the request (" << format_bytes(r->rounded_bytes);
      if (!overflow && fs.request_footprint > r->rounded_bytes)
        os << ", needing " << format_bytes(fs.request_footprint) << (pages ? " of whole pages" : " as a new segment");
      if (pools != 0)
        os << ")" << (kept != 0 ? ", " : " and ") << format_bytes(pools)
           << " cached for CUDA graph pools (kept for their graphs until release_graph_pool";
      if (kept != 0)
        os << ") and " << format_bytes(kept) << " cached for streams that are capturing a CUDA graph (which cannot be given back until "
           << "the capture ends";
      std::size_t bound = ctx.limit;
      if (r->verdict == OomVerdict::capacity && !free_known) {
        bound = mi.total;
        os << ") exceed the device's memory (" << format_bytes(mi.total) << ")";
      } else if (r->verdict == OomVerdict::capacity) {
        bound = std::min(obtainable, mi.total);
        os << ") exceed what the device can give this process (" << format_bytes(bound) << " of " << format_bytes(mi.total) << ")";
      } else {
        os << ") exceed the limit of " << format_bytes(ctx.limit);
      }
      // Two decimals can hide the excess (150.00 + 50.00 against 200.00): then the exact bytes show it.
      if (!overflow && shown_bytes(footprint) + shown_bytes(growth) + shown_bytes(pools) + shown_bytes(kept) <= shown_bytes(bound))
        os << " (" << with_commas(need) << " bytes > " << with_commas(bound) << ")";
      os << ".";
      // Against the device as against a limit: live bytes plus the request may fit where the pages
      // they occupy do not (and the other backend may then serve it); say what those pages hold.
      if (r->page_slack_bytes != 0)
        os << " Of those pages, " << format_bytes(r->page_slack_bytes) << " in " << r->partial_pages << " page"
           << (r->partial_pages == 1 ? " is" : "s are") << " free but shared with live allocations: pages ("
           << format_bytes(driver->granularity()) << ") are the smallest unit memory is mapped in, so only a request smaller than such a gap"
           << ", on the stream of the allocations beside it, can use it; allocation sizes in multiples of " << format_bytes(driver->granularity()) << " leave no such gaps.";
      break;
    }
    case OomVerdict::fragmentation: {
      // The figures of the message's first sentence: free memory of other CUDA graph pools is no
      // place for the request (as allocated to it), and is named apart.
      const std::size_t outside_blocks = r->free_blocks - std::min(r->free_blocks, fs.graph_pool_free_blocks);
      const std::size_t largest_outside = fs.largest_free_outside_pools;
      os << "Enough memory is free in total, but there is no place for the request: " << format_bytes(unallocated - in_pools)
         << " is reserved but unallocated";
      if (still_held != 0 || kept != 0) {
        os << " (";
        if (still_held != 0) os << format_bytes(still_held) << " of it in frees that still wait for other streams' work or a capture's end";
        if (still_held != 0 && kept != 0) os << "; ";
        if (kept != 0) os << format_bytes(kept) << " of it cached for streams that are capturing a CUDA graph, kept until the capture ends";
        os << ")";
      }
      os << " in " << outside_blocks << " free block" << (outside_blocks == 1 ? "" : "s");
      if (outside_blocks != 0) os << ", the largest " << format_bytes(largest_outside);
      if (fs.graph_pool_free_blocks != 0)
        os << " (besides " << format_bytes(in_pools) << " in " << fs.graph_pool_free_blocks << " free block"
           << (fs.graph_pool_free_blocks == 1 ? "" : "s") << " cached for CUDA graph pools, the largest "
           << format_bytes(fs.largest_graph_pool_block) << ", kept for their graphs until release_graph_pool)";
      os << ", and the "
         << (ctx.limit != 0 && ctx.limit <= std::min(mi.total, obtainable) ? "limit"  // whichever bound is the lower
             : ctx.limit != 0 && !free_known                                 ? "limit or the device"  // which one is not known
                                                                             : "device")
         << " leaves no room for more.";
      // Free blocks the request cannot be served from (another stream's, split_merge's other pool)
      // would read as a place for it when large enough: say what it could use.
      // Expandable takes other streams' idle memory back, except where a capture underway forbids
      // the synchronization that comes first: that, not the stream rule, is then the reason.
      // split_merge gives nothing back then.
      if (capture_underway && config.backend == BackendKind::expandable) {
        os << " A CUDA graph capture is underway: idle memory of other streams goes back only where the synchronization that must "
           << "come first leaves the capture valid (docs/CUDA_GRAPHS.md).";
      } else if (capture_underway) {
        os << " A CUDA graph capture is underway: split_merge gives no cached memory back until it ends (each cuMemFree could "
           << "invalidate the capture), so free blocks this request cannot use stay cached.";
      } else if (largest_outside >= r->rounded_bytes && fs.largest_usable_block < largest_outside) {
        os << " The largest free block this request could use is " << format_bytes(fs.largest_usable_block);
        // The stream (and pool) rule only where a larger block lies elsewhere than an oversize one.
        const bool elsewhere = largest_outside > std::max(fs.largest_usable_block, fs.oversize_block);
        if (elsewhere || fs.oversize_block == 0) {
          os << ": free blocks serve only requests on their own stream";
          if (config.backend == BackendKind::split_merge && config.policy != PoolPolicy::cupy)
            os << " (and small-pool blocks, from 2 MiB segments, only requests of at most 1 MiB; large-pool blocks only larger ones)";
        }
        if (fs.oversize_block != 0) {
          os << (elsewhere ? "; the" : ": the") << " free block of " << format_bytes(fs.oversize_block)
             << " on its stream is oversize (max_split_size_mb: " << format_bytes(config.max_split_size)
             << " or more), and oversize blocks serve only requests ";
          if (r->rounded_bytes < config.max_split_size)
            os << "of at least that size";
          else
            os << "they exceed by less than max_non_split_rounding_mb (" << format_bytes(config.max_non_split_rounding) << ")";
        }
        os << ".";
      } else if (fs.cache_serves) {
        // The last retry completed frees that waited for other streams' work; merged with free
        // neighbours they made a place, which that retry (a new segment, as PyTorch's) did not use.
        os << " A free block this request could use (" << format_bytes(fs.largest_usable_block)
           << ") came free during its own last retry, when frees waiting for other streams' work completed; as in PyTorch, that "
           << "retry asks the device for a new segment and does not look in the cache again, so the same request made again is "
           << "served from it.";
      }
      // Expandable moves free memory to the request by unmapping it where it lies (another stream's
      // idle memory, or its own not placed right): say what could not move.
      if (!capture_underway && fs.handle_pinned_bytes != 0)
        os << " Of the free memory, " << format_bytes(fs.handle_pinned_bytes)
           << " lies in physical handles that live allocations use in part: a handle goes back to the device only whole, so "
           << "that memory stays where it is while they live (without a limit a block may be placed in part of a free handle; "
           << "with one, e.g. limit:100%, blocks never use part of a handle).";
      // A pool's free block large enough for the request serves only that pool's allocations.
      if (!capture_underway && fs.largest_graph_pool_block >= r->rounded_bytes && fs.largest_usable_block < r->rounded_bytes)
        os << " The free block of " << format_bytes(fs.largest_graph_pool_block)
           << " is cached for a CUDA graph pool: only allocations routed to that pool can use it until release_graph_pool gives it back.";
      break;
    }
    case OomVerdict::unknown:  // a full report's only when the free memory is unknown
      os << "The live allocations (" << format_bytes(footprint) << ") plus the request (" << format_bytes(growth)
         << ") fit the device and the limit but are more than the " << format_bytes(r->reserved_bytes)
         << " expseg holds, and the device's free memory could not be read: whether other processes hold the rest of the "
         << "device (capacity) or expseg's free memory is too scattered (fragmentation) is not known.";
      break;
  }
  // Frees that still hold their memory count in the requested bytes, as in PyTorch's stats: the
  // text says so.
  os << "\nexpseg: backend " << r->backend << ", device " << driver->kind() << ":" << r->device << ", stream " << hex(r->stream) << ", "
     << live.size() << " live allocation" << (live.size() == 1 ? "" : "s");
  if (!waiting.empty())
    os << (held != 0 ? ", " : " and ") << waiting.size() << " free" << (waiting.size() == 1 ? "" : "s") << " waiting for other streams' work";
  if (held != 0)
    os << (waiting.empty() ? " and " : ", and ") << held << " free" << (held == 1 ? "" : "s") << " held until a CUDA graph capture ends";
  os << " (" << format_bytes(r->live_requested_bytes) << " requested).";
  // The other backend's answer ends the message: added by finish_counterfactual, here or later.
  const bool evaluate = check.pending;
  if (!evaluate) {
    const char* why_not = !config.oom_counterfactual ? " (oom_counterfactual:false)."
                          : refused != backends::Context::Refusal::none
                              ? ": a simulation of the figures above cannot tell what a device that refused them would have done."
                          : !simulable ? ": its check needs the device's free memory, which could not be read."
                          : pools != 0 ? ": its check does not model memory kept for CUDA graph pools."
                          : capture_underway
                              ? ": its check does not model a CUDA graph capture underway (which keeps memory a request could otherwise get back)."
                          : kept != 0 ? ": its check does not model memory cached for a stream that is capturing a CUDA graph, which cannot be "
                                        "given back until the capture ends."
                          : driver->granularity() == 0 ? ": the device does not support CUDA virtual memory management, which it maps memory with."
                                                       : kCheckFailed;
    os << counterfactual_sentence(*r, 0, why_not, false);
  }
  r->message = os.str();
  if (config.oom_snapshot) r->snapshot = std::make_shared<const Snapshot>(snapshot_locked());
  if (evaluate && deferred == nullptr) finish_counterfactual(*r, check);
  return r;
}

void Allocator::Impl::finish_counterfactual(OomReport& r, CounterfactualCheck& check) noexcept {
  check.pending = false;
  if (auto* probe = counterfactual_probe.load(std::memory_order_acquire); probe != nullptr) probe();
  std::vector<LiveAllocation>& live_set = check.live;
  std::sort(live_set.begin(), live_set.end(), [](const LiveAllocation& a, const LiveAllocation& b) { return a.addr < b.addr; });
  live_set.erase(std::unique(live_set.begin(), live_set.end(), [](const LiveAllocation& a, const LiveAllocation& b) { return a.addr == b.addr; }),
                 live_set.end());
  const BackendKind other = check.config.backend == BackendKind::expandable ? BackendKind::split_merge : BackendKind::expandable;
  bool live_set_unfit = false;
  try {
    r.counterfactual = run_counterfactual(check.config, other, check.capacity, check.granularity, check.limit, live_set, check.requested,
                                          check.stream, live_set_unfit);
  } catch (...) {
    r.counterfactual = Counterfactual::not_evaluated;
    live_set_unfit = false;
  }
  try {
    const std::string unfit = ": a fresh pool of it could not hold the " + std::to_string(live_set.size()) + " live allocation" +
                              (live_set.size() == 1 ? "" : "s") + " themselves" + (check.limit ? " under the limit" : "") +
                              " (after this run's own history it might have; a recording's replay tells: record:true, then expseg explain).";
    // strong guarantee: whole or not at all
    r.message += counterfactual_sentence(r, live_set.size(), live_set_unfit ? unfit.c_str() : kCheckFailed, true);
  } catch (...) {
    // No host memory for the sentence: no answer, rather than one the message does not give.
    r.counterfactual = Counterfactual::not_evaluated;
  }
}

std::shared_ptr<const OomReport> Allocator::Impl::short_oom_report(std::size_t requested, driver::stream_t asked_on) const noexcept {
  try {
    auto r = std::make_shared<OomReport>();
    fill_report_figures(*r, requested, asked_on);
    r->live_footprint_bytes = static_cast<std::size_t>(stats.active_bytes[kAllPools].current);
    r->device_free_known = false;  // not read: no figure
    // The verdict is not evaluated: the message and the verdict say so rather than give a guess.
    r->verdict = OomVerdict::unknown;
    char limit_text[48] = "no limit";
    if (r->limit_bytes != 0) std::snprintf(limit_text, sizeof limit_text, "limit %zu", r->limit_bytes);
    char text[360];
    std::snprintf(text, sizeof text,
                  "CUDA out of memory. Tried to allocate %zu bytes on GPU %d (%s backend; %zu bytes allocated by expseg, "
                  "%zu reserved, %s). expseg: host memory also ran out while building the report of this "
                  "out-of-memory error, so its verdict was not evaluated.",
                  r->rounded_bytes, r->device, r->backend.c_str(), r->allocated_bytes, r->reserved_bytes, limit_text);
    r->message = text;
    return r;
  } catch (...) {
    return no_memory_report;  // made with the allocator: needs no memory now
  }
}

}  // namespace expseg
