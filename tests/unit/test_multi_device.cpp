// Several devices and several processes, on the simulated device (issue 8): per-device separation,
// peer-access bookkeeping, IPC export/import round trips (in-process, host-backed), the handle's
// wire format, descriptor passing (SCM_RIGHTS, pidfd_getfd) and the error cases.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "capi_fixture.hpp"
#include "driver_contract.hpp"
#include "expseg/ipc.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::Allocator;
using expseg::driver::dev_ptr;
using expseg::BackendKind;
using expseg::ImportedMemory;
using expseg::IpcKind;
using expseg::IpcMemHandle;
using expseg::kAllPools;
using expseg::OwnedFd;
using expseg::driver::Fault;
using expseg::driver::Op;
using expseg::driver::SimOptions;

namespace {

const BackendKind kBackends[] = {BackendKind::split_merge, BackendKind::expandable};
const char* name(BackendKind b) { return expseg::to_string(b); }
constexpr std::uint64_t kDeviceSpan = std::uint64_t{1} << 56;  // sim_driver.cpp: each device's address span

template <class E = std::exception, class F>
std::string what_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no exception>";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::size_t open_fds() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

struct SocketPair {
  OwnedFd a, b;
  SocketPair() {
    int sv[2] = {-1, -1};
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    a.reset(sv[0]);
    b.reset(sv[1]);
  }
};

// Host-backed pattern helpers: simulated device addresses are host addresses.
void fill(void* p, std::size_t n, unsigned seed) {
  auto* b = static_cast<unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>((i * 131 + seed) & 0xff);
}
bool holds(const void* p, std::size_t n, unsigned seed) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i)
    if (b[i] != static_cast<unsigned char>((i * 131 + seed) & 0xff)) return false;
  return true;
}

bool same_file(int fd1, int fd2) {
  struct stat s1{}, s2{};
  return ::fstat(fd1, &s1) == 0 && ::fstat(fd2, &s2) == 0 && s1.st_dev == s2.st_dev && s1.st_ino == s2.st_ino;
}

// An allocator on a simulated device `device` of `count`, with the handle type of its config.
SimAllocator sim_alloc(const expseg::Config& c, int device = 0, int count = 2) {
  SimOptions o;
  o.device = device;
  o.device_count = count;
  o.shareable = static_cast<expseg::driver::ShareableHandle>(c.ipc_handle);
  return make_sim_allocator(c, o);
}

std::size_t mapped_runs(const Allocator& a, std::vector<expseg::AddressRange>* out = nullptr) {
  std::size_t n = 0;
  for (const auto& seg : a.snapshot().segments) {
    n += seg.mapped_ranges.size();
    if (out) out->insert(out->end(), seg.mapped_ranges.begin(), seg.mapped_ranges.end());
  }
  return n;
}

// Expandable with several mapped runs: 2 MiB handles, a hole unmapped between two live blocks.
struct Holey {
  SimAllocator s;
  void* a = nullptr;
  void* c = nullptr;
  explicit Holey(int count = 2)
      : s(sim_alloc(sim_config(BackendKind::expandable, 8 * GiB, "expandable_max_handle:2MiB"), 0, count)) {
    a = s->allocate(3 * MiB);
    void* b = s->allocate(64 * MiB);
    c = s->allocate(10 * MiB);
    s->deallocate(b);
    s->release_cached();
  }
};

expseg::Config host_config(BackendKind b, const std::string& extra = "") {
  expseg::Config c = sim_config(b, 1 * GiB, extra);
  c.sim_host_backed = true;
  return c;
}

}  // namespace

TEST_SUITE("multi_device") {

TEST_CASE("multi-device: each device has its own allocator, stats and address span") {
  for (BackendKind b : kBackends) {
    CAPTURE(std::string(name(b)));
    Allocator d0(sim_config(b), 0);
    Allocator d1(sim_config(b), 1);
    CHECK(d0.device() == 0);
    CHECK(d1.device() == 1);
    CHECK(d1.device_info().index == 1);
    void* p0 = d0.allocate(3 * MiB);
    void* p1 = d1.allocate(5 * MiB);
    void* q1 = d1.allocate(1 * MiB);
    CHECK(d0.stats().allocation[kAllPools].current == 1);
    CHECK(d1.stats().allocation[kAllPools].current == 2);
    CHECK(d0.stats().allocated_bytes[kAllPools].current == static_cast<std::int64_t>(3 * MiB));
    CHECK(d1.stats().allocated_bytes[kAllPools].current == static_cast<std::int64_t>(6 * MiB));

    // Disjoint addresses: device d hands out addresses from its own span.
    CHECK(addr(p0) < kDeviceSpan);
    CHECK(addr(p1) >= kDeviceSpan);
    CHECK(addr(q1) >= kDeviceSpan);
    for (const auto& s0 : d0.snapshot().segments)
      for (const auto& s1 : d1.snapshot().segments)
        CHECK((s0.address + s0.size <= s1.address || s1.address + s1.size <= s0.address));

    // A pointer of one device is foreign to the other, whatever the operation.
    CHECK(contains(what_of<expseg::invalid_pointer>([&] { d1.deallocate(p0); }), "not allocated by this expseg allocator (device 1)"));
    CHECK(contains(what_of<expseg::invalid_pointer>([&] { d0.deallocate(p1); }), "not allocated by this expseg allocator (device 0)"));
    CHECK(contains(what_of<expseg::invalid_pointer>([&] { d1.record_stream(p0, nullptr); }), "device 1"));
    CHECK(contains(what_of<expseg::invalid_pointer>([&] { (void)d0.export_ipc(q1); }), "device 0"));

    // Freeing and emptying one device's cache leaves the other's state alone.
    const auto before = d1.stats();
    d0.deallocate(p0);
    d0.release_cached();
    CHECK(d0.stats().reserved_bytes[kAllPools].current == 0);
    CHECK(d1.stats().reserved_bytes[kAllPools].current == before.reserved_bytes[kAllPools].current);
    CHECK(d1.stats().allocation[kAllPools].current == 2);
    d1.deallocate(p1);
    d1.deallocate(q1);
    d0.validate();
    d1.validate();
  }
}

TEST_CASE("multi-device: simulated devices hand out addresses from disjoint spans") {
  SimOptions o;
  o.device_count = 4;
  o.device = 0;
  expseg::driver::SimDriver s0(o);
  o.device = 3;
  expseg::driver::SimDriver s3(o);
  const std::size_t g = s0.granularity();
  const auto r0 = s0.reserve(64 * g);
  const auto r3 = s3.reserve(64 * g);
  const auto m0 = s0.mem_alloc(100);
  const auto m3 = s3.mem_alloc(100);
  CHECK(r0 < kDeviceSpan);
  CHECK(m0 < kDeviceSpan);
  CHECK(r3 >= 3 * kDeviceSpan);
  CHECK(r3 < 4 * kDeviceSpan);
  CHECK(m3 >= 3 * kDeviceSpan);
  CHECK(m3 < 4 * kDeviceSpan);
  s0.free_reserve(r0, 64 * g);
  s3.free_reserve(r3, 64 * g);
  s0.mem_free(m0);
  s3.mem_free(m3);
  o.device_count = 300;
  o.device = 255;
  CHECK_THROWS_AS(expseg::driver::SimDriver{o}, std::invalid_argument);
}

TEST_CASE("multi-device: simulated drivers of one device alive at once take disjoint addresses, each its own sequence") {
  // Was: each SimDriver began at its device's span start, so two allocators of one simulated device
  // handed out the same addresses, and a pointer of one freed through the other freed one of its
  // blocks (on CUDA the other allocator calls it foreign).
  SimOptions o;
  o.granularity = 64 * 1024;
  const std::size_t g = o.granularity;
  auto calls = [g](expseg::driver::SimDriver& d) {  // a fixed sequence; what each call returned
    std::vector<dev_ptr> out;
    const dev_ptr r = d.reserve(8 * g);
    out.push_back(r);
    out.push_back(d.mem_alloc(100));
    d.free_reserve(r, 8 * g);
    out.push_back(d.reserve(4 * g));
    return out;
  };
  std::vector<dev_ptr> alone;
  {
    expseg::driver::SimDriver d(o);
    alone = calls(d);
  }
  {
    expseg::driver::SimDriver a(o);
    expseg::driver::SimDriver b(o);
    const std::vector<dev_ptr> in_a = calls(a);
    const std::vector<dev_ptr> in_b = calls(b);
    CHECK(in_a == alone);  // the first driver's addresses are those of a driver alone
    // The second's are the same sequence, in a part of the span of its own.
    const dev_ptr offset = in_b[0] - in_a[0];
    CHECK(offset >= (std::uint64_t{1} << 50));
    for (std::size_t i = 0; i < in_b.size(); ++i) CHECK(in_b[i] - offset == in_a[i]);
    // The ranges still held (a's and b's mem_alloc and last reserve) are disjoint.
    CHECK((in_a[1] + g <= in_b[1] || in_b[1] + g <= in_a[1]));
    CHECK(in_b[2] >= in_a[1] + g);
    {
      // A third, while both live: another part again.
      expseg::driver::SimDriver c(o);
      const std::vector<dev_ptr> in_c = calls(c);
      CHECK(in_c[0] != in_a[0]);
      CHECK(in_c[0] != in_b[0]);
    }
  }
  // All gone: a fresh driver starts where one alone did.
  expseg::driver::SimDriver again(o);
  CHECK(calls(again) == alone);
}

TEST_CASE("multi-device: two allocators of one simulated device refuse each other's pointers") {
  for (BackendKind b : kBackends) {
    CAPTURE(std::string(name(b)));
    Allocator one(sim_config(b), 0);
    Allocator two(sim_config(b), 0);
    void* p = one.allocate(3 * MiB);
    void* q = two.allocate(3 * MiB);
    CHECK(p != q);
    for (const auto& s1 : one.snapshot().segments)
      for (const auto& s2 : two.snapshot().segments)
        CHECK((s1.address + s1.size <= s2.address || s2.address + s2.size <= s1.address));
    CHECK(contains(what_of<expseg::invalid_pointer>([&] { two.deallocate(p); }), "not allocated by this expseg allocator"));
    CHECK(two.stats().allocation[kAllPools].current == 1);
    one.deallocate(p);
    two.deallocate(q);
    one.validate();
    two.validate();
  }
}

TEST_CASE("multi-device: enable_peer_access re-grants every mapped run once and later growth includes the peer") {
  Holey h;
  auto& sim = *h.s.sim;
  std::vector<expseg::AddressRange> runs;
  const std::size_t nruns = mapped_runs(*h.s, &runs);
  REQUIRE(nruns >= 2);  // the freed 64 MiB in the middle was unmapped
  for (const auto& r : runs) CHECK(sim.granted_devices(r.address) == std::vector<int>{0});

  const std::uint64_t before = sim.calls(Op::set_access);
  h.s->enable_peer_access(1);
  CHECK(sim.calls(Op::set_access) - before == nruns);  // one cuMemSetAccess per mapped run
  CHECK(sim.access_devices() == std::vector<int>{0, 1});
  CHECK(h.s->device_info().access_devices == std::vector<int>{0, 1});
  for (const auto& r : runs) {
    CHECK(sim.granted_devices(r.address) == std::vector<int>{0, 1});
    CHECK(sim.granted_devices(r.address + r.size - 1) == std::vector<int>{0, 1});
  }

  // Again, or the own device: nothing to do.
  const std::uint64_t after = sim.calls(Op::set_access);
  h.s->enable_peer_access(1);
  h.s->enable_peer_access(0);
  CHECK(sim.calls(Op::set_access) == after);

  // Growth maps new handles: they are granted to the peer as they are mapped.
  void* big = h.s->allocate(40 * MiB);
  CHECK(sim.calls(Op::set_access) > after);
  CHECK(sim.granted_devices(addr(big)) == std::vector<int>{0, 1});
  CHECK(sim.granted_devices(addr(big) + 40 * MiB - 1) == std::vector<int>{0, 1});
  h.s->deallocate(big);
  h.s->deallocate(h.a);
  h.s->deallocate(h.c);
  h.s->validate();
}

TEST_CASE("multi-device: a failure halfway through the re-grant is retried in full by the next call") {
  Holey h;
  auto& sim = *h.s.sim;
  std::vector<expseg::AddressRange> runs;
  const std::size_t nruns = mapped_runs(*h.s, &runs);
  REQUIRE(nruns >= 2);
  sim.inject_fault(Op::set_access, 2, Fault::error);
  // The driver's words, then what they mean here (was: the driver's words alone).
  const std::string msg = what_of<expseg::driver_error>([&] { h.s->enable_peer_access(1); });
  CHECK(msg.rfind("cuMemSetAccess failed: ", 0) == 0);
  CHECK(contains(msg, "enable_peer_access(1) on device 0: access to the memory already mapped was granted only in part"));
  CHECK(contains(msg, "call enable_peer_access again to complete it"));
  CHECK(msg.find("cuMemSetAccess failed", 1) == std::string::npos);  // said once
  CHECK(sim.granted_devices(runs[1].address) == std::vector<int>{0});  // not granted yet
  const std::uint64_t before = sim.calls(Op::set_access);
  h.s->enable_peer_access(1);
  CHECK(sim.calls(Op::set_access) - before == nruns);
  for (const auto& r : runs) CHECK(sim.granted_devices(r.address) == std::vector<int>{0, 1});
  h.s->validate();
  h.s->deallocate(h.a);
  h.s->deallocate(h.c);
}

TEST_CASE("multi-device: split_merge peer access is the driver's (no per-range grants)") {
  auto s = sim_alloc(sim_config(BackendKind::split_merge), 0, 2);
  void* p = s->allocate(30 * MiB);
  const std::uint64_t before = s.sim->calls(Op::set_access);
  s->enable_peer_access(1);
  CHECK(s.sim->access_devices() == std::vector<int>{0, 1});
  CHECK(s.sim->calls(Op::set_access) == before);
  s->deallocate(p);
  s->validate();
}

TEST_CASE("multi-device: enable_peer_access errors name the device") {
  for (BackendKind b : kBackends) {
    CAPTURE(std::string(name(b)));
    auto s = sim_alloc(sim_config(b), 0, 2);
    CHECK(contains(what_of<expseg::error>([&] { s->enable_peer_access(2); }), "no device 2 (2 sim devices visible)"));
    CHECK(contains(what_of<expseg::error>([&] { s->enable_peer_access(-1); }), "no device -1"));
    CHECK(s.sim->access_devices() == std::vector<int>{0});
    auto single = sim_alloc(sim_config(b), 0, 1);
    CHECK(contains(what_of<expseg::error>([&] { single->enable_peer_access(1); }), "enable_peer_access(1) on device 0"));

    // Through the public API the simulated host has every device an allocator may have (0 to 254),
    // seen alike from each.
    Allocator a(sim_config(b), 0);
    a.enable_peer_access(7);
    a.enable_peer_access(8);
    CHECK(a.device_info().access_devices == std::vector<int>{0, 7, 8});
    CHECK(contains(what_of<expseg::error>([&] { a.enable_peer_access(expseg::driver::kSimMaxDevices); }),
                   "no device 255 (255 sim devices visible)"));
  }
}

TEST_CASE("ipc: export/import round trip in-process on the host-backed simulator") {
  struct Case {
    BackendKind backend;
    const char* extra;
    IpcKind kind;
  };
  const Case cases[] = {
      {BackendKind::split_merge, "", IpcKind::cuda_ipc},
      {BackendKind::expandable, "ipc_handle:posix_fd,expandable_max_handle:2MiB", IpcKind::posix_fd},
      {BackendKind::expandable, "ipc_handle:posix_fd", IpcKind::posix_fd},
      {BackendKind::expandable, "ipc_handle:fabric,expandable_max_handle:2MiB", IpcKind::fabric},
  };
  for (const Case& k : cases) {
    CAPTURE(std::string(name(k.backend)));
    CAPTURE(k.extra);
    auto s = sim_alloc(host_config(k.backend, k.extra));
    void* pad = s->allocate(3 * MiB);
    const std::size_t size = 5 * MiB + 1000;
    void* p = s->allocate(size);
    fill(pad, 3 * MiB, 7);
    fill(p, size, 1);
    const auto stats_before = s->stats();
    const auto live_before = s.sim->live();

    IpcMemHandle h = s->export_ipc(p);
    CHECK(h.kind == k.kind);
    CHECK(h.device_kind == "sim");
    CHECK(h.device == 0);
    CHECK(h.exporter_pid == static_cast<std::int64_t>(::getpid()));
    CHECK(h.size == size);
    CHECK(h.offset > 0);  // the pad lies before it in the same range
    CHECK(h.offset + h.size <= h.range_bytes);
    CHECK(h.fallback_reason.empty());
    if (k.backend == BackendKind::split_merge) {
      REQUIRE(h.pieces.size() == 1);
      CHECK(h.offset == 3 * MiB);  // both in one 20 MiB segment
      CHECK(h.range_bytes == 20 * MiB);
    } else {
      CHECK((addr(p) - h.offset) % (2 * MiB) == 0);
      if (contains(k.extra, "max_handle:2MiB")) CHECK(h.pieces.size() >= 3);  // 5 MiB across 2 MiB handles
    }
    CHECK(h.needs_fds() == (k.kind == IpcKind::posix_fd));
    CHECK(h.has_fds());
    CHECK(h.fds().size() == (k.kind == IpcKind::posix_fd ? h.pieces.size() : 0));

    // Bytes and descriptors over a Unix socket, as between two processes.
    SocketPair sp;
    expseg::send_ipc_handle(sp.a.get(), h);
    IpcMemHandle got = expseg::recv_ipc_handle(sp.b.get());
    CHECK(got.kind == h.kind);
    CHECK(got.offset == h.offset);
    CHECK(got.size == h.size);
    CHECK(got.range_bytes == h.range_bytes);
    REQUIRE(got.pieces.size() == h.pieces.size());
    for (std::size_t i = 0; i < h.pieces.size(); ++i) {
      CHECK(got.pieces[i].bytes == h.pieces[i].bytes);
      CHECK(got.pieces[i].handle == h.pieces[i].handle);
      CHECK(got.pieces[i].remote_fd == h.pieces[i].remote_fd);
      if (h.needs_fds()) {
        CHECK(got.pieces[i].fd.get() != h.pieces[i].fd.get());
        CHECK(same_file(got.pieces[i].fd.get(), h.pieces[i].fd.get()));  // the same memfd
      }
    }

    {
      ImportedMemory m = s->import_ipc(got);
      REQUIRE(m);
      CHECK(m.size() == size);
      CHECK(m.device() == 0);
      CHECK(m.kind() == k.kind);
      if (k.backend == BackendKind::split_merge) {
        CHECK(m.get() == p);  // the simulator opens cuMemAlloc memory in-process at its own address
      } else {
        CHECK(m.get() != p);  // a mapping of its own
        CHECK(s.sim->live().handles == live_before.handles + h.pieces.size());
      }
      CHECK(holds(m.get(), size, 1));  // sees what the exporter wrote
      fill(m.get(), size, 2);          // and the exporter sees what it writes
      CHECK(holds(p, size, 2));
      CHECK(holds(pad, 3 * MiB, 7));   // the neighbour is untouched
      // A second import of the same handle maps it again.
      ImportedMemory m2 = s->import_ipc(got);
      CHECK(holds(m2.get(), size, 2));
      m2.close();
      CHECK_FALSE(m2);
      CHECK(m2.get() == nullptr);
      m2.close();  // closing an empty one does nothing
      // The import is not the allocator's memory.
      CHECK(s->stats().allocated_bytes[kAllPools].current == stats_before.allocated_bytes[kAllPools].current);
      CHECK(s->stats().reserved_bytes[kAllPools].current == stats_before.reserved_bytes[kAllPools].current);
      ImportedMemory moved = std::move(m);
      CHECK_FALSE(m);  // NOLINT(bugprone-use-after-move): moved-from is empty
      CHECK(holds(moved.get(), size, 2));
    }  // ~ImportedMemory releases everything
    const auto live_after = s.sim->live();
    CHECK(live_after.handles == live_before.handles);
    CHECK(live_after.mappings == live_before.mappings);
    CHECK(live_after.reservations == live_before.reservations);
    s->deallocate(p);
    s->deallocate(pad);
    s->validate();
    s.alloc.reset();
    const auto end = s.sim->live();
    CHECK(end.handles == 0);
    CHECK(end.mappings == 0);
    CHECK(end.reservations == 0);
    CHECK(end.mem_allocs == 0);
  }
}

TEST_CASE("ipc: an expandable import keeps its physical memory when the exporter is gone") {
  auto s = sim_alloc(host_config(BackendKind::expandable, "ipc_handle:posix_fd"));
  const std::size_t size = 8 * MiB;
  void* p = s->allocate(size);
  fill(p, size, 9);
  IpcMemHandle h = s->export_ipc(p);
  ImportedMemory m = s->import_ipc(h);
  s->deallocate(p);
  s->release_cached();
  s.alloc.reset();  // the exporter's allocator unmaps and releases everything it holds
  CHECK(holds(m.get(), size, 9));
  CHECK(s.sim->live().handles == h.pieces.size());
  m.close();
  CHECK(s.sim->live().handles == 0);
  CHECK(s.sim->live().physical_bytes == size);  // the handle's open descriptors still hold it, as on CUDA
  h = IpcMemHandle{};  // closes them
  CHECK(s.sim->live().physical_bytes == 0);
}

TEST_CASE("ipc: descriptors taken with pidfd_getfd, or a clear error naming the fallback") {
  auto s = sim_alloc(host_config(BackendKind::expandable, "ipc_handle:posix_fd,expandable_max_handle:2MiB"));
  void* p = s->allocate(5 * MiB);
  fill(p, 5 * MiB, 3);
  IpcMemHandle h = s->export_ipc(p);
  const std::vector<std::uint8_t> bytes = h.serialize();
  IpcMemHandle got = IpcMemHandle::deserialize(bytes);
  CHECK_FALSE(got.has_fds());
  CHECK(contains(what_of<expseg::ipc_error>([&] { (void)s->import_ipc(got); }), "recv_ipc_handle"));
  try {
    got.fetch_fds_from_exporter();
    MESSAGE("pidfd_getfd works here");
    REQUIRE(got.has_fds());
    for (std::size_t i = 0; i < h.pieces.size(); ++i) CHECK(same_file(got.pieces[i].fd.get(), h.pieces[i].fd.get()));
    ImportedMemory m = s->import_ipc(got);
    CHECK(holds(m.get(), 5 * MiB, 3));
    // A descriptor the exporter does not have.
    const std::string msg = what_of<expseg::ipc_error>([] { (void)expseg::pidfd_get_fds(::getpid(), std::vector<int>{987654}); });
    CHECK(contains(msg, "no open descriptor 987654"));
    CHECK(contains(msg, "SCM_RIGHTS"));
  } catch (const expseg::ipc_error& e) {
    MESSAGE("pidfd_getfd refused here: " << e.what());
    CHECK((e.sys_errno() == EPERM || e.sys_errno() == ENOSYS));
    CHECK(contains(e.what(), "SCM_RIGHTS"));
  }
  // No such process: ESRCH, or the same refusal.
  const std::string gone = what_of<expseg::ipc_error>([] { (void)expseg::pidfd_get_fds(0x3ffffff0, std::vector<int>{3}); });
  CHECK(contains(gone, "pid 1073741808"));
  CHECK(contains(gone, "SCM_RIGHTS"));
  CHECK_THROWS_AS(expseg::pidfd_get_fds(-5, std::vector<int>{3}), expseg::ipc_error);
  CHECK(expseg::pidfd_get_fds(::getpid(), std::vector<int>{}).empty());
  CHECK_NOTHROW(expseg::allow_fd_fetch_by(-1));
  CHECK_NOTHROW(expseg::allow_fd_fetch_by(::getpid()));
  s->deallocate(p);
}

TEST_CASE("ipc: a descriptor that names another file than the exporter's is refused, changing nothing") {
  // Was: only the exporter's descriptor numbers travelled. pidfd_getfd took whatever held such a
  // number once the exporter had destroyed its handle (another handle's memory, or its stdout), and
  // descriptors of another handle were taken as this one's: on CUDA, the import maps that memory.
  auto s = sim_alloc(host_config(BackendKind::expandable, "ipc_handle:posix_fd,expandable_max_handle:2MiB"));
  void* p = s->allocate(4 * MiB);
  void* q = s->allocate(4 * MiB);
  fill(p, 4 * MiB, 1);
  fill(q, 4 * MiB, 2);
  const std::vector<std::uint8_t> p_bytes = [&] {
    IpcMemHandle hp = s->export_ipc(p);
    return hp.serialize();
  }();  // hp destroyed: its descriptors closed, their numbers free again
  IpcMemHandle hq = s->export_ipc(q);
  REQUIRE(hq.pieces.size() == 2);
  IpcMemHandle got = IpcMemHandle::deserialize(p_bytes);
  REQUIRE(got.pieces.size() == 2);
  CHECK((got.pieces[0].file_dev != 0 || got.pieces[0].file_ino != 0));
  // q's descriptors handed over as p's (SCM_RIGHTS of the wrong handle):
  std::vector<OwnedFd> wrong;
  for (const auto& piece : hq.pieces) wrong.emplace_back(::dup(piece.fd.get()));
  const std::string msg = what_of<expseg::ipc_error>([&] { got.adopt_fds(std::move(wrong)); });
  CHECK(contains(msg, "names another file than the exporter's descriptor"));
  CHECK(contains(msg, "keep the handle until the importer has its descriptors"));
  CHECK_FALSE(got.has_fds());  // nothing taken
  // Taken from the exporter by number: the numbers p's handle named may now be q's.
  try {
    got.fetch_fds_from_exporter();
    FAIL("pidfd_getfd took descriptors that name another file");
  } catch (const expseg::ipc_error& e) {
    const std::string what = e.what();
    CAPTURE(what);
    // pidfd_getfd refused here (EPERM/ENOSYS), a number nothing holds (EBADF), or the refusal above.
    CHECK((contains(what, "names another file") || contains(what, "SCM_RIGHTS")));
  }
  CHECK_FALSE(got.has_fds());
  // The right descriptors still import.
  IpcMemHandle again = IpcMemHandle::deserialize(hq.serialize());
  std::vector<OwnedFd> right;
  for (const auto& piece : hq.pieces) right.emplace_back(::dup(piece.fd.get()));
  again.adopt_fds(std::move(right));
  {
    ImportedMemory m = s->import_ipc(again);
    CHECK(holds(m.get(), 4 * MiB, 2));
  }
  s->deallocate(p);
  s->deallocate(q);
  s->validate();
}

TEST_CASE("ipc: export errors: freed, unknown, interior pointers, expandable without ipc_handle") {
  for (BackendKind b : kBackends) {
    CAPTURE(std::string(name(b)));
    auto s = sim_alloc(sim_config(b, 8 * GiB, b == BackendKind::expandable ? "ipc_handle:posix_fd" : ""));
    void* p = s->allocate(4 * MiB);
    void* q = s->allocate(4 * MiB);
    s->deallocate(q);
    CHECK(contains(what_of<expseg::invalid_pointer>([&] { (void)s->export_ipc(q); }), "already freed"));
    int local = 0;
    CHECK(contains(what_of<expseg::invalid_pointer>([&] { (void)s->export_ipc(&local); }), "not allocated by this expseg allocator"));
    CHECK(contains(what_of<expseg::invalid_pointer>([&] { (void)s->export_ipc(static_cast<char*>(p) + 512); }), "not the start of a live allocation"));
    CHECK_THROWS_AS((void)s->export_ipc(nullptr), expseg::invalid_pointer);
    s->deallocate(p);
    s->validate();
  }
  // Expandable physical memory created without a shareable type cannot be exported.
  Allocator a(sim_config(BackendKind::expandable));
  void* p = a.allocate(1 * MiB);
  const std::string msg = what_of<expseg::ipc_error>([&] { (void)a.export_ipc(p); });
  CHECK(contains(msg, "ipc_handle:none"));
  CHECK(contains(msg, "ipc_handle:posix_fd"));
  CHECK(a.device_info().ipc_handle == expseg::IpcHandle::none);
  a.deallocate(p);
  Allocator fd(sim_config(BackendKind::expandable, 8 * GiB, "ipc_handle:posix_fd"));
  CHECK(fd.device_info().ipc_handle == expseg::IpcHandle::posix_fd);
  CHECK(fd.device_info().ipc_fallback_reason.empty());
}

TEST_CASE("ipc: a failing export or import leaks nothing") {
  auto s = sim_alloc(host_config(BackendKind::expandable, "ipc_handle:posix_fd,expandable_max_handle:2MiB"));
  void* p = s->allocate(5 * MiB);
  const std::size_t fds = open_fds();
  s.sim->inject_fault(Op::export_handle, 2, Fault::error);
  CHECK_THROWS_AS((void)s->export_ipc(p), expseg::driver_error);
  CHECK(open_fds() == fds);  // the descriptor of the first piece was closed again
  IpcMemHandle h = s->export_ipc(p);
  REQUIRE(h.pieces.size() >= 3);
  const auto live = s.sim->live();
  for (Op op : {Op::reserve, Op::import_handle, Op::map, Op::set_access}) {
    CAPTURE(expseg::driver::op_name(op));
    s.sim->inject_fault(op, op == Op::import_handle || op == Op::map ? 2 : 1, Fault::error);
    CHECK_THROWS_AS((void)s->import_ipc(h), expseg::driver_error);
    const auto now = s.sim->live();
    CHECK(now.handles == live.handles);
    CHECK(now.mappings == live.mappings);
    CHECK(now.reservations == live.reservations);
  }
  // Another simulated device cannot import it, and is left as it was.
  auto other = sim_alloc(host_config(BackendKind::expandable, "ipc_handle:posix_fd"));
  CHECK_THROWS_AS((void)other->import_ipc(h), expseg::driver_error);
  CHECK(other.sim->live().reservations == 0);
  CHECK(other.sim->live().handles == 0);
  // The free import_ipc builds a driver of its own: the simulator cannot import there.
  CHECK(contains(what_of<expseg::ipc_error>([&] { (void)expseg::import_ipc(h, 0, host_config(BackendKind::expandable)); }), "in-process"));
  s->deallocate(p);
  s->validate();
}

TEST_CASE("ipc: pidfd_getfd is not tried for an exporter in another PID namespace") {
  auto s = sim_alloc(host_config(BackendKind::expandable, "ipc_handle:posix_fd,expandable_max_handle:2MiB"));
  void* p = s->allocate(3 * MiB);
  IpcMemHandle h = s->export_ipc(p);
  struct stat ns {};
  const bool have_proc = ::stat("/proc/self/ns/pid", &ns) == 0;
  // The exporter says which PID namespace numbers its pid (0 where /proc cannot tell).
  CHECK(h.exporter_pid_namespace == (have_proc ? static_cast<std::uint64_t>(ns.st_ino) : 0));
  if (have_proc) {
    // Another container's exporter whose pid is ours: the descriptors it names are ours, not its
    // own. Before, pidfd_getfd took them from this process.
    IpcMemHandle other = IpcMemHandle::deserialize(h.serialize());
    other.exporter_pid_namespace = ns.st_ino + 1;
    bool refused = false;
    try {
      other.fetch_fds_from_exporter();
    } catch (const expseg::ipc_error& e) {
      refused = true;
      CHECK(contains(e.what(), "another PID namespace"));
      CHECK(contains(e.what(), "SCM_RIGHTS"));
      CHECK(e.sys_errno() == 0);  // refused before any system call
    }
    CHECK(refused);
    CHECK_FALSE(other.has_fds());
  } else {
    MESSAGE("no /proc/self/ns/pid here: the namespace check is not exercised");
  }
  s->deallocate(p);
}

TEST_CASE("ipc: a child forked after unshare(CLONE_NEWPID) exports its own PID namespace, not its parent's") {
  // Was: the namespace was read once per process and a fork child inherited it: a child in a new
  // PID namespace (pid 1 there) exported its parent's namespace, and an importer in the parent's
  // namespace passed the check and ran pidfd_getfd on whatever process had pid 1 there.
  struct stat ns {};
  if (::stat("/proc/self/ns/pid", &ns) != 0) {
    MESSAGE("no /proc/self/ns/pid here: the namespace check is not exercised");
    return;
  }
  auto s = sim_alloc(host_config(BackendKind::expandable, "ipc_handle:posix_fd,expandable_max_handle:2MiB"));
  void* p = s->allocate(3 * MiB);
  { const IpcMemHandle warm = s->export_ipc(p); }  // the parent exports first (a cache would be filled now)
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t helper = ::fork();
  REQUIRE(helper >= 0);
  if (helper == 0) {  // the helper: a new user and PID namespace for its children
    ::close(fds[0]);
    std::uint64_t msg[3] = {0, 0, 0};  // {unshare ok, exported namespace, the child's own namespace}
    if (::unshare(CLONE_NEWUSER | CLONE_NEWPID) == 0) {
      const pid_t child = ::fork();
      if (child == 0) {
        struct stat own {};
        msg[0] = 1;
        try {
          const IpcMemHandle h = s->export_ipc(p);
          msg[1] = h.exporter_pid_namespace;
        } catch (...) {
          msg[1] = 1;
        }
        msg[2] = ::stat("/proc/self/ns/pid", &own) == 0 ? static_cast<std::uint64_t>(own.st_ino) : 2;
        (void)!::write(fds[1], msg, sizeof msg);
        ::_exit(0);
      }
      int st = 0;
      if (child > 0) ::waitpid(child, &st, 0);
      ::_exit(child > 0 ? 0 : 3);
    }
    (void)!::write(fds[1], msg, sizeof msg);  // unshare refused (a container's seccomp, say)
    ::_exit(0);
  }
  ::close(fds[1]);
  std::uint64_t msg[3] = {9, 9, 9};
  const ssize_t n = ::read(fds[0], msg, sizeof msg);
  ::close(fds[0]);
  int st = 0;
  ::waitpid(helper, &st, 0);
  REQUIRE(n == static_cast<ssize_t>(sizeof msg));
  if (msg[0] == 0) {
    MESSAGE("unshare(CLONE_NEWUSER | CLONE_NEWPID) refused here: a child in another PID namespace is not exercised");
  } else {
    CHECK(msg[2] != static_cast<std::uint64_t>(ns.st_ino));  // the child is in a namespace of its own
    CHECK(msg[1] == msg[2]);                                   // and its handle says so (was: the parent's)
  }
  s->deallocate(p);
}

TEST_CASE("ipc: the handle's bytes round-trip, and malformed bytes are refused") {
  IpcMemHandle h;
  h.kind = IpcKind::posix_fd;
  h.device_kind = "cuda";
  h.device = 3;
  h.exporter_pid = 4242;
  h.exporter_pid_namespace = 4026531836;
  h.offset = 1536;
  h.size = 3 * MiB;
  h.range_bytes = 6 * MiB;
  h.fallback_reason = "fabric handles are not available (...), using posix_fd";
  for (int i = 0; i < 3; ++i) {
    expseg::IpcPiece piece;
    piece.bytes = 2 * MiB;
    piece.handle[0] = static_cast<std::uint8_t>(i + 1);
    piece.handle[63] = 0xAB;
    piece.remote_fd = 40 + i;
    h.pieces.push_back(std::move(piece));
  }
  const std::vector<std::uint8_t> bytes = h.serialize();
  const IpcMemHandle back = IpcMemHandle::deserialize(bytes);
  CHECK(back.kind == h.kind);
  CHECK(back.device_kind == h.device_kind);
  CHECK(back.device == 3);
  CHECK(back.exporter_pid == 4242);
  CHECK(back.exporter_pid_namespace == 4026531836);
  CHECK(back.offset == 1536);
  CHECK(back.size == 3 * MiB);
  CHECK(back.range_bytes == 6 * MiB);
  CHECK(back.fallback_reason == h.fallback_reason);
  REQUIRE(back.pieces.size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(back.pieces[i].bytes == 2 * MiB);
    CHECK(back.pieces[i].handle == h.pieces[i].handle);
    CHECK(back.pieces[i].remote_fd == 40 + i);
    CHECK_FALSE(back.pieces[i].fd);
  }
  CHECK(back.serialize() == bytes);
  // Received with its descriptors (SCM_RIGHTS: numbered in this process) and passed on: the handle
  // still names the exporter's descriptors, the ones its pid goes with.
  {
    IpcMemHandle got = IpcMemHandle::deserialize(bytes);
    for (auto& piece : got.pieces) piece.fd = expseg::OwnedFd(::dup(0));
    REQUIRE(got.pieces[0].fd.get() != 40);
    const IpcMemHandle forwarded = IpcMemHandle::deserialize(got.serialize());
    for (int i = 0; i < 3; ++i) CHECK(forwarded.pieces[i].remote_fd == 40 + i);
    CHECK(forwarded.exporter_pid == 4242);
  }

  // Every truncation, a trailing byte, a wrong magic or version.
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    CAPTURE(n);
    CHECK_THROWS_AS((void)IpcMemHandle::deserialize(std::span(bytes.data(), n)), expseg::ipc_error);
  }
  std::vector<std::uint8_t> longer = bytes;
  longer.push_back(0);
  CHECK(contains(what_of<expseg::ipc_error>([&] { (void)IpcMemHandle::deserialize(longer); }), "trailing"));
  std::vector<std::uint8_t> magic = bytes;
  magic[0] ^= 0xff;
  CHECK(contains(what_of<expseg::ipc_error>([&] { (void)IpcMemHandle::deserialize(magic); }), "magic"));
  std::vector<std::uint8_t> version = bytes;
  version[8] = 99;
  CHECK(contains(what_of<expseg::ipc_error>([&] { (void)IpcMemHandle::deserialize(version); }), "version 99"));
  std::vector<std::uint8_t> kind = bytes;
  kind[12] = 9;
  CHECK(contains(what_of<expseg::ipc_error>([&] { (void)IpcMemHandle::deserialize(kind); }), "unknown kind"));

  // Inconsistent contents are refused too.
  IpcMemHandle bad = IpcMemHandle::deserialize(bytes);
  bad.range_bytes = 8 * MiB;
  CHECK(contains(what_of<expseg::ipc_error>([&] { (void)IpcMemHandle::deserialize(bad.serialize()); }), "add up"));
  bad.range_bytes = 6 * MiB;
  bad.offset = 5 * MiB;
  CHECK(contains(what_of<expseg::ipc_error>([&] { (void)IpcMemHandle::deserialize(bad.serialize()); }), "inside the exported range"));
  bad.offset = 0;
  bad.device_kind = "tpu";
  CHECK(contains(what_of<expseg::ipc_error>([&] { (void)IpcMemHandle::deserialize(bad.serialize()); }), "unknown device kind"));

  // Descriptors: the count must match the pieces.
  IpcMemHandle need = IpcMemHandle::deserialize(bytes);
  std::vector<OwnedFd> two;
  two.emplace_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  two.emplace_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  CHECK(contains(what_of<expseg::ipc_error>([&] { need.adopt_fds(std::move(two)); }), "2 descriptors for a posix_fd handle that needs 3"));
  CHECK_THROWS_AS((void)need.fds(), expseg::ipc_error);
  CHECK(expseg::to_string(IpcKind::cuda_ipc) == std::string("cuda_ipc"));
  CHECK(expseg::to_string(IpcKind::fabric) == std::string("fabric"));
}

TEST_CASE("ipc: send_fds/recv_fds wait on non-blocking sockets as on blocking ones") {
  // Was: EAGAIN was a failure: a receiver called before the message came failed at once, and a
  // message larger than the socket's buffer failed midway (the stream then carried no other).
  SocketPair sp;
  for (int fd : {sp.a.get(), sp.b.get()}) REQUIRE(::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK) == 0);
  std::vector<std::uint8_t> payload(4 << 20);  // far more than a Unix socket buffers
  for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::uint8_t>(i * 13 + 1);
  OwnedFd null_fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  REQUIRE(null_fd);
  const int raw[] = {null_fd.get(), null_fd.get()};
  std::string recv_error;
  std::vector<std::uint8_t> bytes;
  std::vector<OwnedFd> got;
  std::thread receiver([&] {  // usually asks before anything was sent
    try {
      bytes = expseg::recv_fds(sp.b.get(), got);
    } catch (const std::exception& e) {
      recv_error = e.what();
    }
  });
  std::string send_error;
  try {
    expseg::send_fds(sp.a.get(), payload, raw);
  } catch (const std::exception& e) {
    send_error = e.what();
  }
  receiver.join();
  CHECK(send_error.empty());
  CHECK(recv_error.empty());
  CHECK(bytes == payload);
  REQUIRE(got.size() == 2);
  CHECK(same_file(got[0].get(), null_fd.get()));
  // A peer gone is still an error, not a wait.
  sp.a.reset();
  CHECK(contains(what_of<expseg::ipc_error>([&] { (void)expseg::recv_fds(sp.b.get(), got); }), "closed"));
}

TEST_CASE("ipc: send_fds/recv_fds carry any number of descriptors and bytes") {
  rlimit lim{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &lim) == 0);
  const std::size_t room = lim.rlim_cur == RLIM_INFINITY ? 100000 : static_cast<std::size_t>(lim.rlim_cur);
  const std::size_t used = open_fds();
  const std::size_t n = std::min<std::size_t>(600, room > used + 20 ? (room - used - 20) / 2 : 0);
  if (n <= 250) MESSAGE("open-file limit " << room << " allows only " << n << " descriptors: one batch checked");
  std::vector<OwnedFd> mine;
  std::vector<int> raw;
  for (std::size_t i = 0; i < n; ++i) {
    mine.emplace_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    REQUIRE(mine.back());
    raw.push_back(mine.back().get());
  }
  std::vector<std::uint8_t> payload(1 << 20);
  for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::uint8_t>(i * 7);
  SocketPair sp;
  std::string send_error;
  std::thread sender([&] {  // the payload is larger than the socket buffer: send while receiving
    try {
      expseg::send_fds(sp.a.get(), payload, raw);
    } catch (const std::exception& e) {
      send_error = e.what();
    }
  });
  std::vector<OwnedFd> got;
  const std::vector<std::uint8_t> bytes = expseg::recv_fds(sp.b.get(), got);
  sender.join();
  CHECK(send_error.empty());
  CHECK(bytes == payload);
  REQUIRE(got.size() == n);
  for (std::size_t i = 0; i < n; ++i) {
    CHECK(same_file(got[i].get(), raw[i]));
    CHECK((::fcntl(got[i].get(), F_GETFD) & FD_CLOEXEC) != 0);
  }
  got.clear();

  // An empty message, then garbage, then a closed peer.
  expseg::send_fds(sp.a.get(), {}, {});
  CHECK(expseg::recv_fds(sp.b.get(), got).empty());
  const char junk[16] = "not a message!!";
  REQUIRE(::send(sp.a.get(), junk, sizeof junk, 0) == static_cast<ssize_t>(sizeof junk));
  CHECK(contains(what_of<expseg::ipc_error>([&] { (void)expseg::recv_fds(sp.b.get(), got); }), "not sent by send_fds"));
  sp.a.reset();
  CHECK(contains(what_of<expseg::ipc_error>([&] { (void)expseg::recv_fds(sp.b.get(), got); }), "closed"));
  CHECK(got.empty());
  // Sending on something that is not a socket names the call.
  CHECK(contains(what_of<expseg::ipc_error>([&] { expseg::send_fds(raw.empty() ? 0 : raw[0], payload, raw); }), "send"));
}

}  // TEST_SUITE

TEST_CASE_FIXTURE(CApiFixture, "multi-device: the C API's expandable allocators grant one another's devices once a process uses several (peer_access:auto)") {
  // PyTorch's and CuPy's cudaDeviceEnablePeerAccess reaches cuMemAlloc memory only: without a grant,
  // a cross-device copy from expandable memory faults (PyTorch's own expandable segments are granted
  // by its enablePeerAccess, which a pluggable allocator never hears of).
  auto access = [](int device) {  // its own device first, then the peers in the order granted: sorted
    std::vector<int> v = expseg::capi::allocator_for_tests(device)->device_info().access_devices;
    std::sort(v.begin(), v.end());
    return v;
  };
  SUBCASE("expandable, auto (the default)") {
    REQUIRE(expseg_configure("device:sim,backend:expandable") == EXPSEG_SUCCESS);
    void* p0 = expseg_malloc(64 * MiB, 0, nullptr);
    REQUIRE(p0 != nullptr);
    CHECK(access(0) == std::vector<int>{0});  // one device: nothing to grant
    void* p2 = expseg_malloc(8 * MiB, 2, nullptr);
    REQUIRE(p2 != nullptr);
    CHECK(access(0) == std::vector<int>{0, 2});  // memory mapped before the second device came too
    CHECK(access(2) == std::vector<int>{0, 2});
    void* p5 = expseg_malloc(8 * MiB, 5, nullptr);
    REQUIRE(p5 != nullptr);
    CHECK(access(0) == std::vector<int>{0, 2, 5});
    CHECK(access(2) == std::vector<int>{0, 2, 5});
    CHECK(access(5) == std::vector<int>{0, 2, 5});
    for (auto [p, d] : {std::pair{p0, 0}, std::pair{p2, 2}, std::pair{p5, 5}}) expseg_free(p, 0, d, nullptr);
  }
  SUBCASE("peer_access:none, and split_merge (cuMemAlloc memory: the frameworks' own call covers it)") {
    for (const char* conf : {"device:sim,backend:expandable,peer_access:none", "device:sim,backend:split_merge"}) {
      CAPTURE(conf);
      expseg::capi::reset_for_tests();
      REQUIRE(expseg_configure(conf) == EXPSEG_SUCCESS);
      void* p0 = expseg_malloc(64 * MiB, 0, nullptr);
      void* p1 = expseg_malloc(8 * MiB, 1, nullptr);
      REQUIRE((p0 != nullptr && p1 != nullptr));
      CHECK(access(0) == std::vector<int>{0});
      CHECK(access(1) == std::vector<int>{1});
      expseg_free(p0, 0, 0, nullptr);
      expseg_free(p1, 0, 1, nullptr);
    }
  }
}
