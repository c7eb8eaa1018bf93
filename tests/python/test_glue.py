#!/usr/bin/env python3
"""Smoke test of the Python glue without a GPU: tools/expseg.py loads libexpseg.so (EXPSEG_LIBRARY, set by
meson), drives the C API on the simulated device through ctypes, and tools/torch_snapshot_to_rmm.py converts
a synthetic PyTorch snapshot and replays it. Run: EXPSEG_LIBRARY=build/lib/libexpseg.so python3 tests/python/test_glue.py
"""
import ctypes
import functools
import gzip
import json
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
import unittest
import warnings
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools")
sys.path.insert(0, TOOLS)

import expseg  # noqa: E402  (tools/expseg.py)
import torch_snapshot_to_rmm as conv  # noqa: E402

MiB = 1 << 20


class GlueTest(unittest.TestCase):
    def setUp(self):
        os.environ.pop("EXPSEG_ALLOC_CONF", None)
        self.lib = expseg.load()
        self.lib.expseg_reset_for_tests.restype = None
        self.lib.expseg_reset_for_tests()

    def tearDown(self):
        self.lib.expseg_reset_for_tests()

    def test_version_and_library(self):
        self.assertRegex(expseg.version(), r"^\d+\.\d+\.\d+$")
        self.assertTrue(expseg.library_path())

    def test_library_not_found_names_where_it_looked(self):
        # Was: "libexpseg.so not found: ... (`meson setup build && ninja -C build` in DIR gives build/lib/libexpseg.so)",
        # without the path it had looked at, and the same for a copy of expseg.py outside an expseg checkout.
        with tempfile.TemporaryDirectory() as d:
            os.mkdir(os.path.join(d, "tools"))
            shutil.copy(expseg.__file__, os.path.join(d, "tools", "expseg.py"))
            env = dict(os.environ)
            env.pop("EXPSEG_LIBRARY", None)
            env["LD_LIBRARY_PATH"] = ""
            code = ("import sys; sys.path.insert(0, %r); import expseg\n"
                    "try:\n    expseg.library_path()\nexcept expseg.ExpsegError as e:\n    print(e)\n"
                    "else:\n    print('FOUND')\n" % os.path.join(d, "tools"))
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout
            if out.strip() == "FOUND":
                self.skipTest("an installed libexpseg.so is on the system library path")
            built = os.path.join(d, "build", "lib", "libexpseg.so")
            self.assertIn("Looked for: $EXPSEG_LIBRARY (unset), %s (no such file)" % built, out)
            self.assertIn("%s is not an expseg checkout" % d, out)
            open(os.path.join(d, "meson.build"), "w").close()  # now it looks like one
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout
            self.assertIn("`meson setup build && ninja -C build` in %s (or tools/study.sh, tools/build.sh) gives %s"
                          % (d, built), out)

    def test_no_cuda_driver_says_to_use_the_simulated_device(self):
        # Was: "... cannot load the CUDA driver library: libcuda.so.1: cannot open shared object file ..." alone.
        # EXPSEG_LIBCUDA naming a library that is not there stands for a machine without a driver, so this
        # runs on every machine (a process loads the driver once: a child process of its own).
        code = """
import expseg, sys
try:
    expseg.set_limit(1 << 30)  # device 0 on the default device, cuda
except expseg.ExpsegError as e:
    print("code", e.code == expseg.DRIVER)
    print(str(e))
else:
    print("no error")
expseg.configure("device:sim")  # the advice works in the same process
expseg.set_limit(1 << 30)
print("sim limit", expseg.get_limit()[0])
"""
        env = dict(os.environ, EXPSEG_LIBCUDA="/nonexistent/expseg-test/libcuda.so.1", PYTHONPATH=TOOLS)
        env.pop("EXPSEG_ALLOC_CONF", None)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("code True", r.stdout)
        self.assertIn("cannot load the CUDA driver library that EXPSEG_LIBCUDA names", r.stdout)
        self.assertIn("no GPU? use device:sim (EXPSEG_ALLOC_CONF=device:sim)", r.stdout)
        self.assertIn('from Python: expseg.configure("device:sim") before the first allocation', r.stdout)
        self.assertIn("sim limit %d" % (1 << 30), r.stdout)

    def test_peer_access_and_ipc(self):
        expseg.configure("device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:expandable,ipc_handle:posix_fd")
        expseg.enable_peer_access(1, device=0)
        expseg.enable_peer_access(0, device=0)  # its own device: nothing to do
        for peer in (64, -1):  # out of range
            with self.assertRaises(expseg.ExpsegError) as e:
                expseg.enable_peer_access(peer, device=0)
            self.assertEqual(e.exception.code, expseg.INVALID_DEVICE)
        p = self.lib.expseg_malloc(3 * MiB, 0, None)
        ctypes.memset(p, 0x5A, 3 * MiB)  # host-backed: the simulated device's memory is host memory
        handle, fds = expseg.ipc_export(p)
        self.assertIsInstance(handle, bytes)
        self.assertTrue(fds)
        try:
            q, size = expseg.ipc_import(handle, fds)
        finally:
            for fd in fds:
                os.close(fd)  # the caller's: lent to the import only
        self.assertEqual(size, 3 * MiB)
        self.assertEqual(ctypes.string_at(q, 3 * MiB), b"\x5a" * (3 * MiB))
        expseg.ipc_close(q)
        with self.assertRaises(expseg.ExpsegError) as e:
            expseg.ipc_close(q)
        self.assertEqual(e.exception.code, expseg.INVALID_POINTER)
        with self.assertRaises(expseg.ExpsegError) as e:
            expseg.ipc_export(p + 4096)
        self.assertEqual(e.exception.code, expseg.INVALID_POINTER)
        with self.assertRaises(expseg.ExpsegError) as e:
            expseg.ipc_import(b"garbage" * 10)
        self.assertEqual(e.exception.code, expseg.IPC)
        for bad in ("text", None):
            with self.assertRaises(expseg.ExpsegError) as e:
                expseg.ipc_import(bad)
            self.assertEqual(e.exception.code, expseg.INVALID_ARGUMENT)
        with self.assertRaises(expseg.ExpsegError) as e:
            expseg.ipc_export(-1)
        self.assertEqual(e.exception.code, expseg.INVALID_ARGUMENT)
        self.lib.expseg_free(p, 0, 0, None)
        self.assertEqual(expseg.stats()["allocation.all.current"], 0)

    def test_ipc_import_checks_the_descriptors(self):
        expseg.configure("device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:expandable,ipc_handle:posix_fd")
        p = self.lib.expseg_malloc(2 * MiB, 0, None)
        handle, fds = expseg.ipc_export(p)
        try:
            # ctypes would wrap fd + 2**32 around into fd itself and pass True as descriptor 1: the import
            # must not use descriptors the caller did not give.
            for bad in ([fd + (1 << 32) for fd in fds], [True] * len(fds), [1.5] * len(fds), ["3"] * len(fds)):
                with self.assertRaises(expseg.ExpsegError) as e:
                    expseg.ipc_import(handle, bad)
                self.assertEqual(e.exception.code, expseg.INVALID_ARGUMENT)
        finally:
            for fd in fds:
                os.close(fd)
        self.lib.expseg_free(p, 0, 0, None)
        self.assertEqual(expseg.stats()["allocation.all.current"], 0)

    def test_bad_arguments_of_import_and_close_raise(self):
        expseg.configure("device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:expandable,ipc_handle:posix_fd")
        p = self.lib.expseg_malloc(2 * MiB, 0, None)
        handle, fds = expseg.ipc_export(p)
        try:
            for bad in (5, object()):  # not a list of descriptors
                with self.assertRaises(expseg.ExpsegError) as e:
                    expseg.ipc_import(handle, bad)
                self.assertEqual(e.exception.code, expseg.INVALID_ARGUMENT)
            try:  # None: no descriptors, taken from the exporter (this process) with pidfd_getfd
                expseg.ipc_close(expseg.ipc_import(handle, None)[0])
            except expseg.ExpsegError as e:  # where the platform refuses pidfd_getfd
                self.assertEqual(e.code, expseg.IPC, str(e))
            q, _ = expseg.ipc_import(handle, fds)
        finally:
            for fd in fds:
                os.close(fd)
        for bad in (None, "0x1000", -1, 1 << 64, 1.5):
            with self.assertRaises(expseg.ExpsegError) as e:
                expseg.ipc_close(bad)
            self.assertEqual(e.exception.code, expseg.INVALID_ARGUMENT, repr(bad))
        for bad in (q + 1, p):  # not the start of an open import
            with self.assertRaises(expseg.ExpsegError) as e:
                expseg.ipc_close(bad)
            self.assertEqual(e.exception.code, expseg.INVALID_POINTER)
            self.assertIn("not memory expseg_ipc_import mapped", str(e.exception))
        with self.assertRaises(expseg.ExpsegError) as e:
            expseg.ipc_close(q, device=64)
        self.assertEqual(e.exception.code, expseg.INVALID_DEVICE)
        expseg.ipc_close(q)
        self.lib.expseg_free(p, 0, 0, None)

    def test_malloc_free_and_stats(self):
        expseg.configure("device:sim,sim_capacity:4GiB,backend:expandable")
        self.assertIn("backend:expandable", expseg.config())
        self.assertEqual(expseg.stats()["allocation.all.current"], 0)  # no allocator yet: zero stats
        p = self.lib.expseg_cupy_malloc(None, 3 * MiB, 0)
        q = self.lib.expseg_malloc(5 * MiB, 0, None)
        self.assertTrue(p and q and p != q)
        s = expseg.stats()
        self.assertEqual(s["allocation.all.current"], 2)
        self.assertEqual(s["requested_bytes.all.current"], 8 * MiB)
        self.assertEqual(s["cupy"]["used_bytes"], s["allocated_bytes.all.current"])
        snap = expseg.snapshot()
        self.assertEqual(snap["backend"], "expandable")
        sizes = sorted(b["requested"] for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "allocated")
        self.assertEqual(sizes, [3 * MiB, 5 * MiB])
        self.lib.expseg_cupy_free(None, p, 0)
        self.lib.expseg_free(q, 0, 0, None)
        self.assertEqual(self.lib.expseg_last_error_code(), expseg.SUCCESS)
        self.assertEqual(expseg.stats()["allocation.all.current"], 0)
        expseg.release_cached()
        self.assertEqual(expseg.stats()["reserved_bytes.all.current"], 0)
        expseg.reset_peak_stats()
        self.assertEqual(expseg.stats()["allocated_bytes.all.peak"], 0)

    def test_release_stream(self):
        expseg.configure("device:sim,sim_capacity:4GiB,backend:expandable")
        stream = ctypes.c_void_p(0x7000)  # a stream the simulated device has not seen: it synchronizes at once
        p = self.lib.expseg_malloc(8 * MiB, 0, stream)
        with self.assertRaisesRegex(expseg.ExpsegError, "in use"):
            expseg.release_stream(0x7000)
        self.lib.expseg_free(p, 0, 0, stream)
        self.assertGreater(expseg.stats()["reserved_bytes.all.current"], 0)
        expseg.release_stream(0x7000)
        self.assertEqual(expseg.stats()["reserved_bytes.all.current"], 0)
        with self.assertRaisesRegex(expseg.ExpsegError, "only a stream the program created"):
            expseg.release_stream(None)
        # Past 64 bits: refused, not wrapped around into stream 0x7000 (was: released it).
        with self.assertRaisesRegex(expseg.ExpsegError, "stream must be a device address"):
            expseg.release_stream((1 << 64) + 0x7000)

    def test_oom_report(self):
        expseg.configure("device:sim,sim_capacity:4GiB,backend:split_merge")
        self.assertEqual(expseg.oom_report(), "")
        self.assertIsNone(expseg.oom_report_json())
        expseg.set_limit(16 * MiB)
        self.assertFalse(self.lib.expseg_cupy_malloc(None, 32 * MiB, 0))
        self.assertEqual(self.lib.expseg_last_error_code(), expseg.OUT_OF_MEMORY)
        self.assertIn("Tried to allocate", expseg.oom_report())
        rep = expseg.oom_report_json()
        self.assertEqual(rep["requested_bytes"], 32 * MiB)
        self.assertEqual(rep["verdict"], "limit")
        self.assertEqual(expseg.stats()["num_ooms"], 1)

    def test_on_oom_and_oom_dump(self):
        # The callback sees the report (with the dump's path) before the caller sees NULL, and may
        # call expseg; the dump is a JSON file with the report, the snapshot and the recorded trace.
        with tempfile.TemporaryDirectory() as tmp:
            pattern = os.path.join(tmp, "oom-%p-%n.json")
            expseg.configure("device:sim,sim_capacity:4GiB,backend:split_merge,record:true,oom_dump:" + pattern)
            seen = []
            expseg.on_oom(lambda rep: seen.append((rep, expseg.stats()["num_ooms"], self.lib.expseg_last_error_code())))
            try:
                expseg.set_limit(64 * MiB)
                p = self.lib.expseg_cupy_malloc(None, 8 * MiB, 0)
                self.assertTrue(p)
                self.assertFalse(self.lib.expseg_cupy_malloc(None, 64 * MiB, 0))
                self.assertEqual(len(seen), 1)
                rep, ooms_inside, _ = seen[0]
                self.assertEqual(rep["requested_bytes"], 64 * MiB)
                self.assertEqual(rep["device"], 0)
                self.assertEqual(ooms_inside, 1)  # the callback could call into expseg
                path = os.path.join(tmp, "oom-%d-1.json" % os.getpid())
                self.assertEqual(rep["dump_path"], path)
                self.assertEqual(expseg.oom_report_json()["dump_path"], path)
                with open(path) as f:
                    dump = json.load(f)
                self.assertEqual(dump["format"], "expseg-oom-dump/1")
                self.assertEqual(dump["report"]["requested_bytes"], 64 * MiB)
                self.assertEqual(dump["pid"], os.getpid())
                live = [b for seg in dump["snapshot"]["segments"] for b in seg["blocks"] if b["state"] == "allocated"]
                self.assertEqual([b["requested"] for b in live], [8 * MiB])
                with open(dump["trace"]) as f:
                    lines = f.read().splitlines()
                self.assertEqual(lines[0], "Thread,Time,Action,Pointer,Size,Stream")
                self.assertEqual(lines[-1].split(",")[2:5:2], ["allocate failure", str(64 * MiB)])
                expseg.on_oom(None)
                self.assertFalse(self.lib.expseg_cupy_malloc(None, 64 * MiB, 0))
                self.assertEqual(len(seen), 1)  # removed: not called again
                self.assertTrue(os.path.exists(os.path.join(tmp, "oom-%d-2.json" % os.getpid())))
                self.lib.expseg_cupy_free(None, p, 0)
            finally:
                expseg.on_oom(None)

    def test_errors_raise(self):
        with self.assertRaises(expseg.ExpsegError) as cm:
            expseg.configure("device:sim,bogus_key:1")
        self.assertEqual(cm.exception.code, expseg.CONFIG)
        self.assertIn("bogus_key", str(cm.exception))
        expseg.configure("device:sim")
        p = self.lib.expseg_cupy_malloc(None, MiB, 0)
        self.assertTrue(p)
        with self.assertRaises(expseg.ExpsegError) as cm:
            expseg.configure("device:sim,backend:expandable")
        self.assertEqual(cm.exception.code, expseg.ALREADY_INITIALIZED)
        self.lib.expseg_cupy_free(None, p + 4096, 0)  # not a live allocation: recorded, harmless
        self.assertEqual(self.lib.expseg_last_error_code(), expseg.INVALID_POINTER)
        self.lib.expseg_cupy_free(None, p, 0)
        self.assertEqual(expseg.stats()["allocation.all.current"], 0)
        with self.assertRaises(expseg.ExpsegError) as cm:
            expseg.stats(device=64)
        self.assertEqual(cm.exception.code, expseg.INVALID_DEVICE)
        with self.assertRaises(expseg.ExpsegError) as cm:
            expseg.record_write("/nonexistent-dir-of-expseg/t.rmm.csv")
        self.assertEqual(cm.exception.code, expseg.IO)

    def test_out_of_range_arguments_raise_instead_of_wrapping(self):
        expseg.configure("device:sim")
        for bad in (2 ** 32, -1, expseg.MAX_DEVICES, "0", True):
            with self.assertRaises(expseg.ExpsegError) as cm:
                expseg.stats(bad)
            self.assertEqual(cm.exception.code, expseg.INVALID_DEVICE)
        for bad in (-1, 2 ** 64, 1.5):
            with self.assertRaises(expseg.ExpsegError) as cm:
                expseg.set_limit(bad)
            self.assertEqual(cm.exception.code, expseg.INVALID_ARGUMENT)
        for bad in (2 ** 32, 2 ** 32 + 1, -1):  # ctypes wrapped these to devices 0 and 1 (and made their allocators)
            with self.assertRaises(expseg.ExpsegError) as cm:
                expseg.graph_pool_blocks(7, bad)
            self.assertEqual(cm.exception.code, expseg.INVALID_DEVICE)
        for bad in (-1, 2 ** 64):
            with self.assertRaises(expseg.ExpsegError) as cm:
                expseg.graph_pool_blocks(bad)
            self.assertEqual(cm.exception.code, expseg.INVALID_ARGUMENT)
        self.assertEqual(expseg.graph_pool_blocks(7), [])  # a query: no pool, and no allocator made for it
        self.assertEqual(expseg.initialized_devices(), [])
        self.assertEqual(expseg.get_limit(0)[0], 0)  # nothing was set
        with self.assertRaises(expseg.ExpsegError):
            expseg.record_start(0, ring=-5)

    def test_strings_streams_and_callbacks_of_the_wrong_kind_raise(self):
        # Was: configure('device:sim\0,limit:1MiB') set device:sim alone (ctypes cut at the NUL), and
        # record_write('a\0b') wrote a file named 'a'; bytes or an int raised AttributeError; 1.5 named
        # stream 1 (the legacy stream); on_oom(5) failed only at the OOM, as a printed traceback.
        for bad in ("device:sim\0,limit:1MiB", b"device:sim", 123):
            with self.assertRaises(expseg.ExpsegError) as cm:
                expseg.configure(bad)
            self.assertEqual(cm.exception.code, expseg.INVALID_ARGUMENT)
        expseg.configure("device:sim")
        self.assertIn("limit:0", expseg.config())
        with tempfile.TemporaryDirectory() as d:
            expseg.record_start(0)
            for bad in (os.path.join(d, "a\0b"), 7):
                with self.assertRaises(expseg.ExpsegError) as cm:
                    expseg.record_write(bad)
                self.assertEqual(cm.exception.code, expseg.INVALID_ARGUMENT)
            self.assertEqual(os.listdir(d), [])
        for bad in (1.5, "abc", True):
            with self.assertRaises(expseg.ExpsegError) as cm:
                expseg.release_stream(bad)
            self.assertEqual(cm.exception.code, expseg.INVALID_ARGUMENT)
        with self.assertRaises(expseg.ExpsegError) as cm:
            expseg.on_oom(5)
        self.assertEqual(cm.exception.code, expseg.INVALID_ARGUMENT)
        # One device as torch_snapshot's `devices`, as an index or a name.
        expseg.stats(0)
        self.assertEqual(expseg.torch_snapshot(devices=0), expseg.torch_snapshot(devices=[0]))
        self.assertEqual(expseg.torch_snapshot(devices="cuda:0"), expseg.torch_snapshot(devices=[0]))

    def test_devices_apart(self):
        expseg.configure("device:sim,sim_capacity:1GiB,sim_host_backed:true")
        p0 = self.lib.expseg_cupy_malloc(None, 2 * MiB, 0)
        p1 = self.lib.expseg_cupy_malloc(None, 6 * MiB, 1)
        self.assertTrue(p0 and p1)
        self.assertEqual(expseg.stats(0)["requested_bytes.all.current"], 2 * MiB)
        self.assertEqual(expseg.stats(1)["requested_bytes.all.current"], 6 * MiB)
        self.lib.expseg_cupy_free(None, p0, 0)
        self.lib.expseg_cupy_free(None, p1, 1)

    def test_record_trace(self):
        expseg.configure("device:sim,backend:expandable")
        expseg.record_start()
        ptrs = [self.lib.expseg_cupy_malloc(None, (i + 1) * MiB, 0) for i in range(4)]
        for p in ptrs:
            self.lib.expseg_cupy_free(None, p, 0)
        expseg.record_stop()
        self.assertFalse(expseg.record_partial())  # recorded from the allocator's first allocation
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.rmm.csv.gz")
            expseg.record_write(os.fsencode(path))  # a bytes path as os.open takes one (was: AttributeError)
            os.remove(path)
            expseg.record_write(path)
            with gzip.open(path, "rt") as f:
                lines = f.read().splitlines()
            self.assertEqual(lines[0], "Thread,Time,Action,Pointer,Size,Stream")
            allocs = [int(l.split(",")[4]) for l in lines[1:] if l.split(",")[2] == "allocate"]
            frees = [l for l in lines[1:] if l.split(",")[2] == "free"]
            self.assertEqual(allocs, [MiB, 2 * MiB, 3 * MiB, 4 * MiB])
            self.assertEqual(len(frees), 4)
            events = conv.read_trace(path)  # the converter reads expseg's own traces too
            self.assertEqual(sum(1 for e in events if e[0] == "allocate"), 4)
        expseg.record_start()  # afresh over the memory the frees left cached: not where a replay starts
        self.assertTrue(expseg.record_partial())
        expseg.record_stop()


def flatten_like_torch(nested):
    """What torch.cuda.memory_stats() does with torch._C._cuda_memoryStats' nested dict (PyTorch 2.x)."""
    result = []

    def add(prefix, obj):
        if isinstance(obj, dict):
            prefix = prefix + "." if prefix else prefix
            for k, v in obj.items():
                add(prefix + k, v)
        else:
            result.append((prefix, obj))

    add("", nested)
    return dict(sorted(result))


def open_fds():
    return len(os.listdir("/proc/self/fd"))


class IpcSendRecvTest(unittest.TestCase):
    """expseg.ipc_send / ipc_recv: the handle and any number of descriptors over a Unix socket, in the wire format
    of C++'s send_ipc_handle / recv_ipc_handle (interop through tests/python/ipc_echo.cpp, EXPSEG_IPC_ECHO)."""
    # 2 MiB pages and physical handles: an allocation of 300 pages spans 300 handles, more than one SCM_RIGHTS
    # message carries (253).
    CONF = ("device:sim,sim_host_backed:true,sim_capacity:1GiB,sim_granularity:2MiB,backend:expandable,"
            "ipc_handle:posix_fd,expandable_max_handle:2MiB")
    PAGES = 300

    def setUp(self):
        os.environ.pop("EXPSEG_ALLOC_CONF", None)
        self.lib = expseg.load()
        self.lib.expseg_reset_for_tests.restype = None
        self.lib.expseg_reset_for_tests()
        self.a, self.b = socket.socketpair()

    def tearDown(self):
        self.a.close()
        self.b.close()
        self.lib.expseg_reset_for_tests()

    def export_many(self):
        """A live allocation spanning PAGES handles, each page marked with its number; (ptr, handle, fds)."""
        expseg.configure(self.CONF)
        p = self.lib.expseg_malloc(self.PAGES * 2 * MiB, 0, None)
        self.assertTrue(p)
        for i in range(self.PAGES):
            ctypes.memset(p + i * 2 * MiB, i % 251, 16)
        handle, fds = expseg.ipc_export(p)
        self.assertEqual(len(fds), self.PAGES)
        return p, handle, fds

    def check_import(self, handle, fds):
        q, size = expseg.ipc_import(handle, fds)
        self.assertEqual(size, self.PAGES * 2 * MiB)
        for i in range(self.PAGES):
            self.assertEqual(ctypes.string_at(q + i * 2 * MiB, 16), bytes([i % 251]) * 16, "page %d" % i)
        expseg.ipc_close(q)

    def send_in_thread(self, fn):
        errors = []

        def run():
            try:
                fn()
            except BaseException as e:  # noqa: B036  reported by join()
                errors.append(e)
        t = threading.Thread(target=run)
        t.start()
        return lambda: (t.join(), errors and self.fail("sender: %r" % errors[0]))

    def test_round_trip_with_more_descriptors_than_one_message_carries(self):
        before = open_fds()
        p, handle, fds = self.export_many()
        join = self.send_in_thread(lambda: expseg.ipc_send(self.a, handle, fds))
        got_handle, got = expseg.ipc_recv(self.b)
        join()
        self.assertEqual(got_handle, handle)
        self.assertEqual(len(got), len(fds))
        for mine, theirs in zip(fds, got):  # the same memory, in order; the sender's descriptors stay open
            self.assertEqual(os.fstat(mine).st_ino, os.fstat(theirs).st_ino)
            self.assertNotEqual(mine, theirs)
        for fd in fds:
            os.close(fd)
        self.check_import(got_handle, got)
        for fd in got:
            os.close(fd)
        self.lib.expseg_free(p, 0, 0, None)
        self.assertEqual(expseg.stats()["allocation.all.current"], 0)
        expseg.release_cached()  # the simulator's memory: a memfd per physical handle
        self.assertEqual(open_fds(), before)

    def test_partial_writes_are_reassembled(self):
        # A stream socket may hand the message over in pieces: the header split, the handle byte by byte.
        r, w = os.pipe()
        handle = b"EXPSGIPC" + bytes(range(40))
        header = struct.pack("<IIQ", 0x44465845, 1, len(handle))

        def send():
            self.a.sendmsg([header[:5]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", r))])
            self.a.sendall(header[5:])
            for i in range(len(handle)):
                self.a.sendall(handle[i:i + 1])
        join = self.send_in_thread(send)
        got_handle, got = expseg.ipc_recv(self.b)
        join()
        self.assertEqual(got_handle, handle)
        self.assertEqual(len(got), 1)
        self.assertEqual(os.fstat(got[0]).st_ino, os.fstat(r).st_ino)
        for fd in got + [r, w]:
            os.close(fd)

    def test_interop_with_cpp(self):
        echo = os.environ.get("EXPSEG_IPC_ECHO")
        if not echo:
            self.skipTest("EXPSEG_IPC_ECHO is not set (meson sets it to build/tests/expseg_ipc_echo)")
        before = open_fds()

        def echo_through_cpp(mode, handle, fds):
            a, b = socket.socketpair()
            with a:
                with b:
                    child = subprocess.Popen([echo, str(b.fileno()), mode], pass_fds=[b.fileno()],
                                             stderr=subprocess.PIPE, text=True)
                a.settimeout(30)  # a disagreement on the framing hangs both ends: fail instead
                try:
                    join = self.send_in_thread(lambda: expseg.ipc_send(a, handle, fds))
                    got = expseg.ipc_recv(a)
                    join()
                except expseg.ExpsegError as e:
                    child.kill()
                    self.fail("%s (expseg_ipc_echo: %s)" % (e, child.communicate()[1]))
            _, err = child.communicate(timeout=60)
            self.assertEqual(child.returncode, 0, err)
            return got

        # A real export: C++'s recv_ipc_handle parses it and takes its descriptors, send_ipc_handle sends it back.
        p, handle, fds = self.export_many()
        got_handle, got = echo_through_cpp("handle", handle, fds)
        self.assertEqual(got_handle, handle)
        self.assertEqual([os.fstat(fd).st_ino for fd in got], [os.fstat(fd).st_ino for fd in fds])
        self.check_import(got_handle, got)
        for fd in fds + got:
            os.close(fd)
        self.lib.expseg_free(p, 0, 0, None)
        expseg.release_cached()
        # The framing alone: C++'s recv_fds / send_fds. 252 descriptors are two batches of expseg's 250 but would
        # fit one SCM_RIGHTS message (253): both ends must count the batches alike.
        pipes = [os.pipe() for _ in range(252)]
        synthetic = b"EXPSGIPC" + os.urandom(1000)
        got_handle, got = echo_through_cpp("fds", synthetic, [r for r, _ in pipes])
        self.assertEqual(got_handle, synthetic)
        self.assertEqual([os.fstat(fd).st_ino for fd in got], [os.fstat(r).st_ino for r, _ in pipes])
        for fd in got + [fd for pair in pipes for fd in pair]:
            os.close(fd)
        self.assertEqual(open_fds(), before)

    def test_a_bad_peer_raises_and_leaks_nothing(self):
        r, w = os.pipe()
        header = struct.Struct("<IIQ")

        def received_after(*messages, close=True):
            """ipc_recv's error after the peer sent `messages` ((bytes, fds) each) and closed (or not)."""
            a, b = socket.socketpair()
            try:
                for data, fds in messages:
                    if fds:
                        a.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("%di" % len(fds), *fds))])
                    else:
                        a.sendall(data)
                if close:
                    a.close()
                else:
                    b.settimeout(0.2)
                before = open_fds()
                with self.assertRaises(expseg.ExpsegError) as e:
                    expseg.ipc_recv(b)
                self.assertEqual(open_fds(), before, "descriptors received before the error must be closed")
                self.assertEqual(e.exception.code, expseg.IPC)
                return str(e.exception)
            finally:
                a.close()
                b.close()

        handle = b"EXPSGIPC" + bytes(20)
        self.assertIn("closed the socket after 0 of 16 bytes", received_after())
        self.assertIn("closed the socket after 4 of 16 bytes", received_after((b"\x45\x58\x46\x44", [r])))
        self.assertIn("not sent by ipc_send", received_after((b"GET / HTTP/1.1\r\n\r\n", [r, w])))
        self.assertIn("implausible", received_after((header.pack(0x44465845, 1 << 30, 10), [r])))
        self.assertIn("implausible", received_after((header.pack(0x44465845, 1, 1 << 40), [r])))
        # 300 descriptors announced, the first batch sent, then the peer goes away.
        self.assertIn("closed the socket after 0 of 1 bytes of a batch",
                      received_after((header.pack(0x44465845, 300, len(handle)), [r] * 250)))
        self.assertIn("after 3 of %d bytes of the handle" % len(handle),
                      received_after((header.pack(0x44465845, 2, len(handle)), [r, w]), (b"EXP", [])))
        self.assertIn("received 3 descriptors, the sender sent 2",
                      received_after((header.pack(0x44465845, 2, len(handle)), [r, w]), (handle, [r])))
        self.assertIn("does not hold an expseg IPC handle",
                      received_after((header.pack(0x44465845, 2, 5), [r, w]), (b"hello", [])))
        self.assertIn("does not hold an expseg IPC handle", received_after((header.pack(0x44465845, 0, 0), [])))
        self.assertIn("timed out", received_after((header.pack(0x44465845, 2, len(handle)), [r, w]), close=False))
        os.close(r)
        os.close(w)

    def test_bad_arguments_raise(self):
        r, w = os.pipe()
        handle = b"EXPSGIPC" + bytes(20)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        dgram = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        closed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        closed.close()
        try:
            for sock in (None, 3, "sock", udp, dgram[0], closed):
                with self.assertRaises(expseg.ExpsegError) as e:
                    expseg.ipc_send(sock, handle, [r])
                self.assertEqual(e.exception.code, expseg.INVALID_ARGUMENT, repr(sock))
                with self.assertRaises(expseg.ExpsegError) as e:
                    expseg.ipc_recv(sock)
                self.assertEqual(e.exception.code, expseg.INVALID_ARGUMENT, repr(sock))
        finally:
            for s in (udp,) + dgram:
                s.close()
        for bad in (None, "EXPSGIPC", [handle], b"garbage", b""):
            with self.assertRaises(expseg.ExpsegError) as e:
                expseg.ipc_send(self.a, bad, [r])
            self.assertEqual(e.exception.code, expseg.INVALID_ARGUMENT, repr(bad))
        for bad in ([-1], [True], [1.5], ["3"], [r + (1 << 32)], 5, r):
            with self.assertRaises(expseg.ExpsegError) as e:
                expseg.ipc_send(self.a, handle, bad)
            self.assertEqual(e.exception.code, expseg.INVALID_ARGUMENT, repr(bad))
        # A descriptor that is not open: the system call refuses, before anything is written.
        with self.assertRaises(expseg.ExpsegError) as e:
            expseg.ipc_send(self.a, handle, [w + 1000])
        self.assertEqual(e.exception.code, expseg.IPC)
        self.assertIn("Bad file descriptor", str(e.exception))
        # The caller's descriptors stay open; None and () are no descriptors.
        for fds in ([r, w], None, ()):
            expseg.ipc_send(self.a, handle, fds)
            got_handle, got = expseg.ipc_recv(self.b)
            self.assertEqual((got_handle, len(got)), (handle, len(fds or ())))
            for fd in got:
                os.close(fd)
        os.fstat(r)
        os.fstat(w)
        self.b.close()  # the peer has gone
        with self.assertRaises(expseg.ExpsegError) as e:
            expseg.ipc_send(self.a, handle, [r])
        self.assertEqual(e.exception.code, expseg.IPC)
        self.assertIn("Broken pipe", str(e.exception))
        os.close(r)
        os.close(w)


class FakeTorch:
    """The parts of torch that expseg's install_torch patch replaces, behaving as under PyTorch's pluggable allocator
    (the memory API raises "does not yet support", record_stream does nothing); the real thing is checked on the GPU
    by tests/gpu/torch_oom.py."""
    NAMES = ["_cuda_memoryStats", "_cuda_resetPeakMemoryStats", "_cuda_resetAccumulatedMemoryStats", "_cuda_emptyCache",
             "_cuda_setMemoryFraction", "_cuda_getMemoryFraction", "_cuda_memorySnapshot",
             "_cuda_record_memory_history", "_cuda_record_memory_history_legacy",
             # CUDA graph trees' (torch.compile(mode="reduce-overhead")) entry points into the allocator's pools
             "_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool", "_cuda_releasePool",
             "_cuda_checkPoolLiveAllocations", "_cuda_getCheckpointState", "_cuda_setCheckpointPoolState"]

    def __init__(self):
        def unsupported(name):
            def fn(*_args, **_kwargs):
                raise RuntimeError("CUDAPluggableAllocator does not yet support " + name)
            return fn
        self._C = types.SimpleNamespace(**{n: unsupported(n) for n in self.NAMES})
        self._C._cuda_emptyCache = lambda: None  # PyTorch: no reset function set, nothing happens
        self.settings = []  # PyTorch's own allocator settings (its pinned host memory keys still apply)
        self._C._accelerator_setAllocatorSettings = self.settings.append
        self.raw_deleted = []
        self._C._cuda_cudaCachingAllocator_raw_delete = self.raw_deleted.append
        self._C._has_Standard_Deleter = lambda storage_ptr: False  # a storage made from a data pointer
        self.freed_storages = []
        self._C._free_And_Remove_DeleterFn = self.freed_storages.append

        # Storages as the trees hand them over (StorageImpl pointers, weakly referenced).
        storages = {}

        class Storage:
            def __init__(self, ptr):
                self.ptr = ptr
                self.cdata = len(storages) + 1000
                storages[self.cdata] = weakref.ref(self)

            def data_ptr(self):
                return self.ptr

        class UntypedStorage:
            @staticmethod
            def _new_with_weak_ptr(cdata):
                return storages[cdata]()

        class StorageWeakRef:
            def __init__(self, storage):
                self.ref = weakref.ref(storage)

            def expired(self):
                return self.ref() is None

        self.Storage, self.UntypedStorage = Storage, UntypedStorage
        self.multiprocessing = types.SimpleNamespace(reductions=types.SimpleNamespace(StorageWeakRef=StorageWeakRef))

        class Tensor:
            def __init__(self, ptr, device=0):
                self.ptr, self.is_cuda, self.device, self.torch_recorded = ptr, True, types.SimpleNamespace(index=device), []

            def untyped_storage(self):
                return types.SimpleNamespace(data_ptr=lambda: self.ptr)

            def record_stream(self, stream):
                self.torch_recorded.append(stream)

        class graph:  # torch.cuda.graph, the context manager
            def __init__(self, cuda_graph, pool=None, stream=None):
                self.cuda_graph = cuda_graph

        class CUDAGraph:  # records what the glue calls of PyTorch's own methods
            def __init__(self):
                self.calls = []

            def capture_begin(self, pool=None, capture_error_mode="global"):
                self.calls.append(("capture_begin", pool, capture_error_mode))

            def capture_end(self):
                self.calls.append(("capture_end",))

            def reset(self):
                self.calls.append(("reset",))

            def pool(self):
                return (0, 5)

        self.Tensor = Tensor
        self.cuda = types.SimpleNamespace(current_device=lambda: 0, CUDAGraph=CUDAGraph,
                                          current_stream=lambda device=None: types.SimpleNamespace(cuda_stream=None),
                                          graphs=types.SimpleNamespace(graph=graph), graph=graph)


class TorchApiTest(unittest.TestCase):
    """install_torch's routing of PyTorch's memory API to expseg (expseg._patch_torch), on the simulated device."""

    def setUp(self):
        os.environ.pop("EXPSEG_ALLOC_CONF", None)
        self.lib = expseg.load()
        self.lib.expseg_reset_for_tests.restype = None
        self.lib.expseg_reset_for_tests()
        self.torch = FakeTorch()
        expseg._patch_torch(self.torch)

    def tearDown(self):
        self.lib.expseg_reset_for_tests()

    def test_memory_stats_and_resets(self):
        expseg.configure("device:sim,sim_capacity:4GiB,backend:expandable")
        p = self.lib.expseg_malloc(8 * MiB + 5, 0, None)
        q = self.lib.expseg_malloc(700, 0, None)
        C = self.torch._C
        nested = C._cuda_memoryStats(0)
        self.assertEqual(nested["allocated_bytes"]["all"]["current"], expseg.stats()["allocated_bytes.all.current"])
        self.assertEqual(nested["requested_bytes"]["all"]["current"], 8 * MiB + 705)
        self.assertEqual(nested["allocation"]["small_pool"]["current"], 1)
        flat = expseg.stats()
        del flat["cupy"]
        self.assertEqual(flatten_like_torch(nested), flat)  # torch.cuda.memory_stats() gives expseg's keys back
        self.lib.expseg_free(p, 0, 0, None)
        C._cuda_resetPeakMemoryStats(0)
        self.assertEqual(expseg.stats()["requested_bytes.all.peak"], 700)
        self.assertEqual(expseg.stats()["allocation.all.allocated"], 2)
        C._cuda_resetAccumulatedMemoryStats(0)
        s = expseg.stats()
        self.assertEqual((s["allocation.all.allocated"], s["allocation.all.freed"]), (0, 0))  # as PyTorch: the totals restart
        self.lib.expseg_free(q, 0, 0, None)

    def test_empty_cache_covers_every_device(self):
        expseg.configure("device:sim,sim_capacity:1GiB")
        for d in (0, 3):
            self.lib.expseg_free(self.lib.expseg_malloc(6 * MiB, d, None), 0, d, None)
            self.assertGreater(expseg.stats(d)["reserved_bytes.all.current"], 0)
        self.assertEqual(expseg.initialized_devices(), [0, 3])
        self.torch._C._cuda_emptyCache()
        self.assertEqual([expseg.stats(d)["reserved_bytes.all.current"] for d in (0, 3)], [0, 0])

    def test_allocator_settings_at_run_time_say_they_do_not_change_expseg(self):
        # torch.cuda.memory._set_allocator_settings("expandable_segments:False") reached PyTorch's own allocator
        # only and changed nothing of expseg's, without a word.
        import warnings
        C = self.torch._C
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            C._accelerator_setAllocatorSettings("expandable_segments:False,pinned_use_cuda_host_register:True")
            C._accelerator_setAllocatorSettings("pinned_num_register_threads:8")  # host memory only: PyTorch's
        self.assertEqual(self.torch.settings, ["expandable_segments:False,pinned_use_cuda_host_register:True",
                                               "pinned_num_register_threads:8"])
        self.assertEqual(len(caught), 1)
        self.assertIs(caught[0].category, RuntimeWarning)
        self.assertIn("_set_allocator_settings('expandable_segments:False,pinned_use_cuda_host_register:True') does "
                      "not change its allocators (expandable_segments;", str(caught[0].message))
        expseg._patch_torch(self.torch)  # patched once
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            C._accelerator_setAllocatorSettings("max_split_size_mb:64")
        self.assertEqual(len(caught), 1)

    def test_memory_fraction_is_the_limit(self):
        expseg.configure("device:sim,sim_capacity:4GiB,backend:expandable")
        C = self.torch._C
        C._cuda_setMemoryFraction(0.25, 0)
        self.assertEqual(expseg.get_limit(0), (1 << 30, 4 << 30))
        self.assertEqual(C._cuda_getMemoryFraction(0), 0.25)
        self.assertIsNone(self.lib.expseg_malloc(1536 * MiB, 0, None))  # over the fraction: OOM for the limit
        self.assertEqual(expseg.oom_report_json(0)["verdict"], "limit")
        C._cuda_setMemoryFraction(1.0, 0)  # the whole device: no limit
        self.assertEqual(expseg.get_limit(0), (0, 4 << 30))
        self.assertEqual(C._cuda_getMemoryFraction(0), 1.0)
        p = self.lib.expseg_malloc(1536 * MiB, 0, None)
        self.assertTrue(p)
        self.lib.expseg_free(p, 0, 0, None)
        C._cuda_setMemoryFraction(0.0, 0)  # PyTorch: nothing may be allocated
        self.assertIsNone(self.lib.expseg_malloc(MiB, 0, None))
        self.assertEqual(C._cuda_getMemoryFraction(0), 0.0)  # read back as set (the limit is 1 byte)
        expseg.set_limit(3 << 30, 0)  # changed behind PyTorch's back: the fraction follows the limit
        self.assertEqual(C._cuda_getMemoryFraction(0), 0.75)

    def test_memory_fraction_from_the_configuration_reads_back_as_pytorch_has_it(self):
        # PyTorch's per_process_memory_fraction:0 is a limit of 0 bytes (expseg's: 1 byte), whose
        # fraction get_per_process_memory_fraction() reads as 0.0; at 1 there is no limit.
        C = self.torch._C
        expseg.configure("device:sim,sim_capacity:4GiB,per_process_memory_fraction:0")
        self.assertIsNone(self.lib.expseg_malloc(MiB, 0, None))
        self.assertEqual(C._cuda_getMemoryFraction(0), 0.0)  # was: 1 / 4 GiB
        self.lib.expseg_reset_for_tests()
        expseg.configure("device:sim,sim_capacity:4GiB,per_process_memory_fraction:1")
        self.assertEqual(expseg.get_limit(0), (0, 4 << 30))  # was: (4 GiB, 4 GiB)
        self.assertEqual(C._cuda_getMemoryFraction(0), 1.0)

    def test_record_stream_reaches_expseg(self):
        expseg.configure("device:sim")
        p = self.lib.expseg_malloc(4 * MiB, 0, None)
        t = self.torch.Tensor(p)
        other = types.SimpleNamespace(cuda_stream=0x77)
        t.record_stream(other)
        self.assertEqual(t.torch_recorded, [other])  # PyTorch's own record_stream still runs first
        self.lib.expseg_free(p, 0, 0, None)
        # Freed, but waiting for the other stream: still active (without record_stream it would be 0).
        self.assertEqual(expseg.stats()["active_bytes.all.current"], 4 * MiB)
        self.assertEqual(expseg.snapshot()["segments"][0]["blocks"][0]["state"], "pending_free")
        # PyTorch's snapshot counts an active block's requested bytes in its segment, allocated or waiting.
        seg = self.torch._C._cuda_memorySnapshot(None)["segments"][0]
        self.assertEqual((seg["allocated_size"], seg["active_size"], seg["requested_size"]), (0, 4 * MiB, 4 * MiB))
        # Memory expseg did not allocate (a tensor from DLPack or from_blob): PyTorch's no-op, no error.
        foreign = ctypes.create_string_buffer(64)
        self.torch.Tensor(ctypes.addressof(foreign)).record_stream(other)
        self.assertEqual(self.lib.expseg_last_error_code(), expseg.SUCCESS)

    def test_history_covers_devices_first_used_later(self):
        expseg.configure("device:sim,sim_capacity:1GiB")
        self.lib.expseg_free(self.lib.expseg_malloc(MiB, 0, None), 0, 0, None)
        C = self.torch._C
        C._cuda_record_memory_history("all", "all", "all", 100000, False, False, False, [], False, True)
        for d in (0, 2):  # device 2 has no allocator yet
            self.lib.expseg_free(self.lib.expseg_malloc(3 * MiB, d, None), 0, d, None)
        C._cuda_record_memory_history(None, None, "all", 0, False, False, False, [], False, True)
        self.lib.expseg_free(self.lib.expseg_malloc(5 * MiB, 3, None), 0, 3, None)  # after: not recorded
        traces = C._cuda_memorySnapshot(None)["device_traces"]
        self.assertEqual(len(traces), 4)
        allocs = [[e["size"] for e in t if e["action"] == "alloc"] for t in traces]
        self.assertEqual(allocs, [[3 * MiB], [], [3 * MiB], []])

    def test_graph_capture_opens_an_expseg_graph_pool(self):
        # On the simulated device nothing captures: expseg refuses the pool, and the glue ends PyTorch's capture
        # before raising, so that no stream is left capturing. (The GPU suite's torch_graph.py runs real graphs.)
        expseg.configure("device:sim,sim_capacity:1GiB")
        g = self.torch.cuda.CUDAGraph()
        with self.assertRaises(expseg.ExpsegError) as cm:
            g.capture_begin(capture_error_mode="thread_local")
        self.assertIn("not capturing", str(cm.exception))
        self.assertEqual(g.calls, [("capture_begin", None, "thread_local"), ("capture_end",)])
        # A pool= argument reaches PyTorch unchanged; reset() is PyTorch's, and releases nothing never begun.
        g2 = self.torch.cuda.CUDAGraph()
        with self.assertRaises(expseg.ExpsegError):
            g2.capture_begin((0, 9))
        g2.reset()
        self.assertEqual(g2.calls, [("capture_begin", (0, 9), "global"), ("capture_end",), ("reset",)])
        expseg._patch_torch(self.torch)  # a second patch wraps nothing twice
        self.assertTrue(self.torch.cuda.CUDAGraph._expseg_patched)

    def test_graph_trees_use_expseg_graph_pools(self):
        # torch.compile(mode="reduce-overhead")'s CUDA graph trees, as PyTorch calls them (the GPU suite's
        # torch_compile.py runs the real thing): a warm-up routed into the pool, the trees' checks of its blocks,
        # a checkpoint, and the pool put back to it after replays.
        for backend in ("split_merge", "expandable"):
            self.lib.expseg_reset_for_tests()
            expseg.configure("device:sim,sim_capacity:1GiB,backend:" + backend)
            C, lib, pool = self.torch._C, self.lib, (0, 7)
            trees = self.torch.cuda.CUDAGraph._expseg_trees
            restored_before = trees.calls["restored_blocks"]
            C._cuda_beginAllocateCurrentThreadToPool(0, pool)
            a = lib.expseg_malloc(3 << 20, 0, None)
            b = lib.expseg_malloc(1 << 20, 0, None)
            C._cuda_endAllocateToPool(0, pool)  # the pool's use stays, as a recorded graph holds one
            outside = lib.expseg_malloc(1 << 20, 0, None)  # not routed any more
            # Snapshots name the pool's segments by PyTorch's pool id, as PyTorch's own do.
            pool_ids = {seg["address"]: seg["segment_pool_id"] for seg in expseg.torch_snapshot([0])["segments"]}
            self.assertEqual(pool_ids[max(lo for lo in pool_ids if lo <= a)], pool)
            self.assertEqual(pool_ids[max(lo for lo in pool_ids if lo <= outside)], (0, 0))
            self.assertTrue(C._cuda_checkPoolLiveAllocations(0, pool, {a, b}))
            self.assertFalse(C._cuda_checkPoolLiveAllocations(0, pool, {a}))
            self.assertFalse(C._cuda_checkPoolLiveAllocations(0, pool, {a, b, outside}))
            state = C._cuda_getCheckpointState(0, pool)
            self.assertEqual(len(state.blocks), 2)
            # The trees free the recorded outputs (their storages give up their memory), replays write them again
            # and hand out storages without a deleter; recording anew puts the pool back to the checkpoint.
            lib.expseg_free(a, 0, 0, None)
            lib.expseg_free(b, 0, 0, None)
            self.assertTrue(C._cuda_checkPoolLiveAllocations(0, pool, set()))
            replay_output = self.torch.Storage(a)
            C._cuda_setCheckpointPoolState(0, state, [], [replay_output.cdata])
            self.assertTrue(C._cuda_checkPoolLiveAllocations(0, pool, {a, b}))
            self.assertTrue(C._has_Standard_Deleter(replay_output.cdata))  # its block is freed when it dies
            self.assertFalse(C._has_Standard_Deleter(replay_output.cdata + 1))  # PyTorch's answer for others
            self.assertEqual(lib.expseg_release_graph_pool(0, 12345), expseg.INVALID_ARGUMENT)  # an error left behind
            C._cuda_cudaCachingAllocator_raw_delete(b)  # an output dead since the replay: expseg's block
            C._cuda_cudaCachingAllocator_raw_delete(outside)  # not restored: PyTorch's raw_delete
            self.assertEqual(self.torch.raw_deleted, [outside])
            self.assertTrue(C._cuda_checkPoolLiveAllocations(0, pool, {a}))
            del replay_output  # its block is freed at the trees' next call into the pool
            self.assertTrue(C._cuda_checkPoolLiveAllocations(0, pool, set()))
            # Restored again; the trees end the generation while the output lives: its block is freed now.
            C._cuda_setCheckpointPoolState(0, state, [], [])
            C._cuda_cudaCachingAllocator_raw_delete(b)
            replay_output = self.torch.Storage(a)
            C._cuda_setCheckpointPoolState(0, state, [], [replay_output.cdata])  # a stays, b is made again
            C._cuda_cudaCachingAllocator_raw_delete(b)
            self.assertTrue(C._cuda_checkPoolLiveAllocations(0, pool, {a}))
            C._free_And_Remove_DeleterFn(replay_output.cdata)
            self.assertTrue(C._cuda_checkPoolLiveAllocations(0, pool, set()))
            C._free_And_Remove_DeleterFn(replay_output.cdata + 1)  # not one of expseg's: PyTorch's
            self.assertEqual(self.torch.freed_storages, [replay_output.cdata + 1])
            del replay_output
            self.assertEqual(trees.calls["restored_blocks"] - restored_before, 5)
            # Misuse: a stale storage (PyTorch passes none), a state that is not expseg's, an end without a begin.
            with self.assertRaises(expseg.ExpsegError):
                C._cuda_setCheckpointPoolState(0, state, [1234], [])
            with self.assertRaises(expseg.ExpsegError):
                C._cuda_setCheckpointPoolState(0, object(), [], [])
            with self.assertRaises(expseg.ExpsegError):
                C._cuda_endAllocateToPool(0, pool)
            C._cuda_releasePool(0, pool)
            with self.assertRaises(expseg.ExpsegError):
                C._cuda_releasePool(0, pool)
            lib.expseg_free(outside, 0, 0, None)
            self.torch.raw_deleted.clear()
            self.torch.freed_storages.clear()
            self.assertEqual(expseg.stats()["allocated_bytes.all.current"], 0)

    def test_history_leaves_a_free_still_waiting_uncompleted(self):
        # Was: every free without a later "free completed" line got a free_completed entry right after its
        # free_requested, also one still waiting for another stream at the snapshot: memory_viz's timeline
        # ended the block there while the snapshot's segments still held it (active_pending_free).
        for backend in ("split_merge", "expandable"):
            with self.subTest(backend=backend):
                self.lib.expseg_reset_for_tests()
                expseg.configure("device:sim,sim_capacity:4GiB,backend:" + backend)
                C = self.torch._C
                C._cuda_record_memory_history("all", "all", "all", 100000, False, False, False, [], False, True)
                p = self.lib.expseg_malloc(4 * MiB, 0, None)
                q = self.lib.expseg_malloc(2 * MiB, 0, None)
                self.torch.Tensor(p).record_stream(types.SimpleNamespace(cuda_stream=0x77))
                self.lib.expseg_free(p, 0, 0, None)  # waits for stream 0x77's work
                self.lib.expseg_free(q, 0, 0, None)  # completes at once
                snap = C._cuda_memorySnapshot(None)
                C._cuda_record_memory_history(None, None, "all", 0, False, False, False, [], False, True)
                pending = [blk for s in snap["segments"] for blk in s["blocks"] if blk["state"] == "active_pending_free"]
                self.assertEqual([blk["address"] for blk in pending], [p])
                by_addr = {}
                for e in snap["device_traces"][0]:
                    if e["action"] in ("alloc", "free_requested", "free_completed"):
                        by_addr.setdefault(e["addr"], []).append(e["action"])
                self.assertEqual(by_addr[p], ["alloc", "free_requested"])
                self.assertEqual(by_addr[q], ["alloc", "free_requested", "free_completed"])

    def test_snapshot_and_history_in_torch_format(self):
        expseg.configure("device:sim,sim_capacity:4GiB,backend:expandable,limit:64MiB")
        C = self.torch._C
        C._cuda_record_memory_history("all", "all", "all", 100000, False, False, False, [], False, True)
        a = self.lib.expseg_malloc(3 * MiB, 0, None)
        b = self.lib.expseg_malloc(5 * MiB + 3, 0, None)
        self.lib.expseg_free(a, 0, 0, None)
        self.assertIsNone(self.lib.expseg_malloc(128 * MiB, 0, None))  # over the limit: an "oom" entry
        c = self.lib.expseg_malloc(MiB, 0, None)
        C._cuda_record_memory_history(None, None, "all", 0, False, False, False, [], False, True)
        snap = C._cuda_memorySnapshot(None)
        self.assertEqual(len(snap["device_traces"]), 1)
        segs = snap["segments"]
        self.assertTrue(segs and all(s["is_expandable"] and s["device"] == 0 for s in segs))
        mapped = sum(r["size"] for seg in expseg.snapshot()["segments"] for r in seg["mapped_ranges"])
        self.assertEqual(sum(s["total_size"] for s in segs), mapped)  # mapped memory only, no address space
        for s in segs:  # the blocks tile each segment, as in PyTorch's snapshots
            end = s["address"]
            for blk in s["blocks"]:
                self.assertEqual(blk["address"], end)
                end += blk["size"]
            self.assertEqual(end, s["address"] + s["total_size"])
        live = sorted(blk["requested_size"] for s in segs for blk in s["blocks"] if blk["state"] == "active_allocated")
        self.assertEqual(live, [MiB, 5 * MiB + 3])
        actions = [e["action"] for e in snap["device_traces"][0]]
        self.assertEqual([e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"], [3 * MiB, 5 * MiB + 3, MiB])
        self.assertEqual(actions.count("free_requested"), 1)
        self.assertEqual(actions.count("oom"), 1)
        self.assertIn("segment_map", actions)
        # The project's own PyTorch-snapshot converter reads it back: the same allocations, replayable.
        with tempfile.TemporaryDirectory() as d:
            pkl, out = os.path.join(d, "snap.pickle"), os.path.join(d, "t.rmm.csv")
            with open(pkl, "wb") as f:
                pickle.dump(snap, f)
            p = subprocess.run([sys.executable, os.path.join(TOOLS, "torch_snapshot_to_rmm.py"), pkl, out, "--check"],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("peak live requested bytes: %d" % (8 * MiB + 3), p.stdout)
        self.lib.expseg_free(b, 0, 0, None)
        self.lib.expseg_free(c, 0, 0, None)

    def test_torch_snapshot_trace_ends_where_its_segments_stand_under_threads(self):
        # The segments and the trace came from two calls: another thread's allocations in between gave
        # memory_viz events the segments do not hold (half of the snapshots of a busy program). Checked as
        # memory_viz reads a snapshot: walking the trace back from the segments' state.
        expseg.configure("device:sim,sim_capacity:8GiB,backend:split_merge")
        expseg.record_start(ring=2000)  # a window: the churn goes on as long as the snapshots do
        stop = threading.Event()
        steps = [0]

        def churn():
            live, x = [], 1
            while not stop.is_set():
                x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
                if len(live) < 32 and (x >> 60) < 9:
                    live.append(self.lib.expseg_malloc(((x >> 33) % 512 + 1) * 4096, 0, None))
                elif live:
                    self.lib.expseg_free(live.pop((x >> 20) % len(live)), 0, 0, None)
                steps[0] += 1
            for p in live:
                self.lib.expseg_free(p, 0, 0, None)

        def walk_back_problems(snap):
            held = {blk["address"] for seg in snap["segments"] for blk in seg["blocks"]
                    if blk["state"] == "active_allocated"}
            problems = 0
            for e in reversed(snap["device_traces"][0]):
                if e["action"] == "alloc":  # allocated then: held from then on, unless freed later (seen first)
                    problems += e["addr"] not in held
                    held.discard(e["addr"])
                elif e["action"] == "free_completed":  # freed then: not held right after, held before
                    problems += e["addr"] in held
                    held.add(e["addr"])
            return problems

        worker = threading.Thread(target=churn)
        worker.start()
        try:
            while steps[0] < 200:  # the churn is under way
                time.sleep(0.001)
            mismatched, during = 0, 0
            for _ in range(30):
                before = steps[0]
                snap = expseg.torch_snapshot(0)
                during += steps[0] != before
                mismatched += walk_back_problems(snap) != 0
        finally:
            stop.set()
            worker.join()
        self.assertGreater(during, 0)  # other-thread allocations happened while snapshots were taken
        self.assertEqual(mismatched, 0)

    def test_torch_snapshot_completes_a_deferred_free_at_its_completion(self):
        # A free that waited for another stream (record_stream) completes later, on its own line;
        # PyTorch's trace has free_requested then, free_completed when the stream's work is done.
        csv_text = ("Thread,Time,Action,Pointer,Size,Stream\n"
                    "1,00:00:01.000000,allocate,0x1000,512,0x0\n"
                    "1,00:00:02.000000,free,0x1000,512,0x0\n"           # deferred: completed below
                    "1,00:00:03.000000,allocate,0x2000,512,0x0\n"
                    "1,00:00:04.000000,free,0x2000,512,0x0\n"           # at once
                    "1,00:00:05.000000,free completed,0x1000,512,0x0\n"
                    "1,00:00:06.000000,allocate,0x1000,512,0x0\n"
                    "1,00:00:07.000000,free,0x1000,512,0x0\n")          # at once, same address again

        class Lib:
            def expseg_snapshot_json_with_trace(self, device, path):
                with open(path.decode(), "w") as f:
                    f.write(csv_text)
                return json.dumps({"backend": "split_merge", "segments": []}).encode()

        real = expseg.load
        expseg.load = lambda: Lib()
        try:
            snap, trace = expseg._snapshot_and_trace(0)
        finally:
            expseg.load = real
        self.assertEqual(snap["segments"], [])
        got = [(e["action"], e["addr"], e["time_us"] // 1000000) for e in trace]
        self.assertEqual(got, [("alloc", 0x1000, 1), ("free_requested", 0x1000, 2),
                               ("alloc", 0x2000, 3), ("free_requested", 0x2000, 4), ("free_completed", 0x2000, 4),
                               ("free_completed", 0x1000, 5),
                               ("alloc", 0x1000, 6), ("free_requested", 0x1000, 7), ("free_completed", 0x1000, 7)])


def install_fakes():
    """FakeTorch in sys.modules with what install_torch itself touches, and a CuPy stand-in whose
    CFunctionAllocator calls expseg's C pair."""
    torch = FakeTorch()

    class CUDAPluggableAllocator:
        def __init__(self, path, malloc_name, free_name):
            # As PyTorch's: loads the library and takes both functions' addresses (a missing name raises).
            lib = ctypes.CDLL(path)
            self.malloc_fn = ctypes.cast(getattr(lib, malloc_name), ctypes.c_void_p).value
            self.free_fn = ctypes.cast(getattr(lib, free_name), ctypes.c_void_p).value
            self.path, self.malloc_name, self.free_name = path, malloc_name, free_name

    torch.cuda.is_initialized = lambda: False
    torch.cuda.memory = types.SimpleNamespace(CUDAPluggableAllocator=CUDAPluggableAllocator,
                                              change_current_allocator=lambda alloc: None)
    sys.modules["torch"] = torch
    proto = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    class CFunctionAllocator:  # cupy.cuda.memory.CFunctionAllocator(param, malloc_fn, free_fn, owner)
        def __init__(self, param, malloc_fn, free_fn, owner):
            self.fn = proto(malloc_fn)
            self.param = param

        def malloc(self, size):
            return types.SimpleNamespace(ptr=self.fn(self.param, size, 0) or 0)

    cupy = types.ModuleType("cupy")
    current = types.SimpleNamespace(ptr=0)  # cupy.cuda.get_current_stream(): tests set .ptr
    cupy.cuda = types.SimpleNamespace(memory=types.SimpleNamespace(CFunctionAllocator=CFunctionAllocator),
                                      set_allocator=lambda fn: None, runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                      get_current_stream=lambda: current)
    sys.modules["cupy"], sys.modules["cupy.cuda"] = cupy, cupy.cuda
    return torch


class InstallTest(unittest.TestCase):
    """install_torch / install_cupy with stand-ins, and the PyTorch-facing argument handling (each case failed
    before its fix)."""

    def setUp(self):
        os.environ["EXPSEG_ALLOC_CONF"] = "device:sim,sim_capacity:4GiB"
        self.lib = expseg.load()
        self.lib.expseg_reset_for_tests.restype = None
        self.lib.expseg_reset_for_tests()
        expseg._torch_allocator = expseg._torch_conf = expseg._torch_oom_error = None
        expseg._cupy_allocator = expseg._cupy_conf = None

    def tearDown(self):
        self.lib.expseg_reset_for_tests()
        expseg._torch_allocator = expseg._torch_conf = expseg._torch_oom_error = None
        expseg._cupy_allocator = expseg._cupy_conf = None
        for m in ("torch", "cupy", "cupy.cuda"):
            sys.modules.pop(m, None)
        os.environ.pop("EXPSEG_ALLOC_CONF", None)

    def test_install_without_the_package_says_so(self):
        # Was: a bare ModuleNotFoundError("No module named 'torch'") raised from inside install_torch.
        for module, install, what in (("torch", expseg.install_torch, "PyTorch"), ("cupy", expseg.install_cupy, "CuPy")):
            sys.modules[module] = None  # `import module` raises ImportError, installed or not
            with self.assertRaises(expseg.ExpsegError) as cm:
                install("backend:expandable")
            self.assertEqual(cm.exception.code, expseg.INVALID_ARGUMENT)
            self.assertIn("expseg.install_%s: %s is not installed in this Python" % (module, what), str(cm.exception))
            self.assertIn("pip install", str(cm.exception))
            self.assertIsNone(expseg._torch_allocator if module == "torch" else expseg._cupy_allocator)

    def fake_torch_library(self):
        path = os.environ.get("EXPSEG_FAKE_TORCH_LIBRARY")
        if not path:
            self.skipTest("EXPSEG_FAKE_TORCH_LIBRARY is not set (meson sets it to build/tests/libexpseg_fake_torch.so)")
        return path

    def test_torch_library_built_for_the_running_pytorch_raises_its_oom_type(self):
        # PyTorch takes an OOM for one only as c10::OutOfMemoryError (torch.cuda.OutOfMemoryError): was always
        # expseg_torch_malloc's std::bad_alloc, a plain RuntimeError that cuDNN's OOM recoveries do not catch.
        fake = self.fake_torch_library()
        torch = install_fakes()
        torch.__version__ = "0.0.0+expseg.test"  # what the stand-in says it was built for
        torch.cuda.OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {})
        os.environ["EXPSEG_TORCH_LIBRARY"] = fake
        try:
            alloc = expseg.install_torch("backend:expandable")
        finally:
            del os.environ["EXPSEG_TORCH_LIBRARY"]
        self.assertEqual((alloc.path, alloc.malloc_name, alloc.free_name),
                         (fake, "expseg_torch_c10_malloc", "expseg_torch_c10_free"))
        self.assertIs(expseg.torch_oom_error(), torch.cuda.OutOfMemoryError)
        # Its functions serve the allocator the glue configured (one libexpseg.so in the process).
        malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(alloc.malloc_fn)
        free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(alloc.free_fn)
        p = malloc(3 * MiB, 0, None)
        self.assertTrue(p)
        self.assertEqual(expseg.stats()["allocated_bytes.all.current"], 3 * MiB)
        self.assertIn("backend:expandable", expseg.config())
        free(p, 3 * MiB, 0, None)
        self.assertEqual(expseg.stats()["allocated_bytes.all.current"], 0)

    def test_torch_library_for_another_pytorch_is_not_used_and_says_so(self):
        fake = self.fake_torch_library()
        torch = install_fakes()
        torch.__version__ = "2.11.0+cu130"
        torch.cuda.OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {})
        os.environ["EXPSEG_TORCH_LIBRARY"] = fake
        try:
            with self.assertWarns(RuntimeWarning) as cm:
                alloc = expseg.install_torch("backend:expandable")
        finally:
            del os.environ["EXPSEG_TORCH_LIBRARY"]
        self.assertIn("%s was built for PyTorch 0.0.0+expseg.test, and this is PyTorch 2.11.0+cu130: an OOM raises "
                      "RuntimeError, not torch.cuda.OutOfMemoryError" % fake, str(cm.warning))
        self.assertEqual((alloc.path, alloc.malloc_name, alloc.free_name),
                         (expseg.library_path(), "expseg_torch_malloc", "expseg_free"))
        self.assertIs(expseg.torch_oom_error(), RuntimeError)

    def test_torch_library_that_cannot_be_used_falls_back(self):
        # libexpseg.so itself in its place: it has no expseg_torch_c10_built_for.
        install_fakes()
        os.environ["EXPSEG_TORCH_LIBRARY"] = expseg.library_path()
        try:
            with self.assertWarns(RuntimeWarning) as cm:
                alloc = expseg.install_torch("backend:expandable")
        finally:
            del os.environ["EXPSEG_TORCH_LIBRARY"]
        self.assertIn("cannot be loaded here", str(cm.warning))
        self.assertEqual(alloc.malloc_name, "expseg_torch_malloc")
        self.assertIs(expseg.torch_oom_error(), RuntimeError)

    def test_torch_library_absent_or_not_asked_for(self):
        self.fake_torch_library()
        torch = install_fakes()
        torch.__version__ = "0.0.0+expseg.test"
        torch.cuda.OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {})
        self.assertIsNone(expseg.torch_oom_error())
        # None built (no PyTorch where expseg was built): libexpseg.so's throwing malloc, no warning.
        found = expseg._torch_library_path
        expseg._torch_library_path = lambda: None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                alloc = expseg.install_torch("backend:expandable")
        finally:
            expseg._torch_library_path = found
        self.assertEqual((alloc.path, alloc.malloc_name, alloc.free_name),
                         (expseg.library_path(), "expseg_torch_malloc", "expseg_free"))
        self.assertIs(expseg.torch_oom_error(), RuntimeError)
        # raise_on_oom=False: expseg_malloc returns NULL, whatever library there is.
        self.lib.expseg_reset_for_tests()
        expseg._torch_allocator = expseg._torch_conf = expseg._torch_oom_error = None
        os.environ["EXPSEG_TORCH_LIBRARY"] = os.environ["EXPSEG_FAKE_TORCH_LIBRARY"]
        try:
            alloc = expseg.install_torch("backend:expandable", raise_on_oom=False)
        finally:
            del os.environ["EXPSEG_TORCH_LIBRARY"]
        self.assertEqual((alloc.path, alloc.malloc_name), (expseg.library_path(), "expseg_malloc"))
        self.assertIsNone(expseg.torch_oom_error())

    def test_torch_library_found_by_the_loader_as_libexpseg_is(self):
        # libexpseg.so found by name (LD_LIBRARY_PATH, an install): was not looked for there, so install_torch
        # fell back to RuntimeError without a word.
        fake = self.fake_torch_library()
        with tempfile.TemporaryDirectory() as d:
            os.symlink(fake, os.path.join(d, "libexpseg_torch.so"))
            code = ("import sys; sys.path.insert(0, %r); import expseg; expseg.load(); expseg._lib_path = 'libexpseg.so'; "
                    "print(expseg._torch_library_path())" % TOOLS)
            env = dict(os.environ, LD_LIBRARY_PATH=d, PATH="/nonexistent")  # no gcc or ld for find_library either
            env.pop("EXPSEG_TORCH_LIBRARY", None)
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "libexpseg_torch.so")

    def test_torch_library_variable_naming_no_file_is_refused(self):
        install_fakes()
        os.environ["EXPSEG_TORCH_LIBRARY"] = "/nonexistent/libexpseg_torch.so"
        try:
            with self.assertRaises(expseg.ExpsegError) as cm:
                expseg.install_torch("backend:expandable")
        finally:
            del os.environ["EXPSEG_TORCH_LIBRARY"]
        self.assertEqual(cm.exception.code, expseg.INVALID_ARGUMENT)
        self.assertIn("EXPSEG_TORCH_LIBRARY='/nonexistent/libexpseg_torch.so': no such file", str(cm.exception))
        self.assertIsNone(expseg._torch_allocator)

    def test_torch_after_cupy_shares_its_allocators(self):
        # CuPy, then PyTorch, in one process: was ALREADY_INITIALIZED from expseg_configure, and a conf-less
        # install_torch() reset the configuration CuPy had set.
        install_fakes()
        alloc = expseg.install_cupy("backend:expandable")
        p = alloc(4 * MiB).ptr
        self.assertTrue(p)
        expseg.install_torch("backend:expandable")
        expseg.install_torch("backend:expandable")  # the same again: the same allocator
        self.assertIn("backend:expandable", expseg.config())
        self.lib.expseg_cupy_free(None, p, 0)

    def test_cupy_allocates_for_its_current_stream(self):
        # CuPy passes the allocator no stream: every CuPy allocation was made for the legacy default stream, so
        # a block freed after work on one CuPy stream was handed at once to work on another.
        install_fakes()
        alloc = expseg.install_cupy("backend:split_merge")
        cupy = sys.modules["cupy"]

        def stream_of(ptr):
            for seg in expseg.snapshot()["segments"]:
                for b in seg["blocks"]:
                    if int(b["address"], 16) == ptr:
                        return int(b["stream"], 16)
            self.fail("no block at %#x" % ptr)

        cupy.cuda.get_current_stream().ptr = 0x5000
        p1 = alloc(3 * MiB).ptr
        self.assertEqual(stream_of(p1), 0x5000)
        self.lib.expseg_cupy_free(None, p1, 0)
        cupy.cuda.get_current_stream().ptr = 0x6000
        p2 = alloc(3 * MiB).ptr
        self.assertEqual(stream_of(p2), 0x6000)
        self.assertNotEqual(p2, p1)  # the block cached for stream 0x5000 is not handed to 0x6000
        cupy.cuda.get_current_stream().ptr = 0x5000
        p3 = alloc(3 * MiB).ptr
        self.assertEqual(p3, p1)  # but is to its own stream again
        cupy.cuda.get_current_stream().ptr = 0
        p0 = alloc(MiB).ptr
        self.assertEqual(stream_of(p0), 0)
        for p in (p2, p3, p0):
            self.lib.expseg_cupy_free(None, p, 0)

    def test_cupy_oom_error_carries_its_own_report(self):
        # The OutOfMemoryError was built from the device's last report: another thread's OOM on the same device
        # between this thread's failed allocation and the read gave this thread the other request's report.
        install_fakes()
        cupy = sys.modules["cupy"]

        class OutOfMemoryError(MemoryError):  # cupy.cuda.memory.OutOfMemoryError(size, total, limit=0)
            def __init__(self, size, total, limit=0):
                super().__init__("Out of memory allocating %s bytes (allocated so far: %s bytes)." % (
                    format(size, ","), format(total, ",")))

        base = cupy.cuda.memory.CFunctionAllocator
        other = {}

        class Interleaved(base):  # another thread's OOM lands right after this thread's malloc returns NULL
            def malloc(self, size):
                mem = base.malloc(self, size)
                if not mem.ptr:
                    t = threading.Thread(target=lambda: other.setdefault("ptr", self.fn(self.param, 200 * MiB, 0)))
                    t.start()
                    t.join()
                return mem

        cupy.cuda.memory.OutOfMemoryError = OutOfMemoryError
        cupy.cuda.memory.CFunctionAllocator = Interleaved
        alloc = expseg.install_cupy("backend:split_merge,limit:64MiB")
        with self.assertRaises(OutOfMemoryError) as cm:
            alloc(100 * MiB)
        self.assertFalse(other["ptr"])  # the other thread's 200 MiB failed too, after this one's
        self.assertIn("Tried to allocate 200.00 MiB", expseg.oom_report())  # the device's last report: the other's
        self.assertIn("Tried to allocate 100.00 MiB", cm.exception.expseg_report)
        self.assertNotIn("200.00 MiB", str(cm.exception))

    def test_install_without_conf_keeps_what_is_configured(self):
        install_fakes()
        expseg.install_cupy("backend:expandable")
        expseg.set_limit(0)  # creates device 0's allocator (no limit); get_limit() is a query
        expseg.install_torch()
        self.assertIn("backend:expandable", expseg.config())

    def test_the_second_framework_with_another_conf_is_refused(self):
        # PyTorch with one string, then CuPy with another: was the second replacing the first's configuration
        # without a word (max_split_size_mb gone, the backend switched).
        install_fakes()
        expseg.install_torch("backend:expandable,max_split_size_mb:128")
        with self.assertRaises(expseg.ExpsegError) as cm:
            expseg.install_cupy("limit:2GiB")
        self.assertEqual(cm.exception.code, expseg.ALREADY_INITIALIZED)
        self.assertIn("expseg.install_cupy('limit:2GiB'): expseg.install_torch('backend:expandable,max_split_size_mb:128') "
                      "configured the allocators PyTorch and CuPy share", str(cm.exception))
        self.assertIsNone(expseg._cupy_allocator)
        self.assertIn("backend:expandable", expseg.config())
        self.assertIn("max_split_size_mb:128", expseg.config())
        expseg.install_cupy("backend:expandable,max_split_size_mb:128")  # the same string: shared
        self.assertIsNotNone(expseg._cupy_allocator)

    def test_a_conf_that_can_no_longer_apply_says_so(self):
        install_fakes()
        expseg.set_limit(0)  # creates device 0's allocator (no limit); get_limit() is a query
        with self.assertRaises(expseg.ExpsegError) as cm:
            expseg.install_torch("backend:expandable")
        self.assertEqual(cm.exception.code, expseg.ALREADY_INITIALIZED)
        self.assertIn("install_torch('backend:expandable'): an expseg allocator already exists", str(cm.exception))

    def test_second_install_with_other_options_raises(self):
        torch = install_fakes()
        expseg.install_torch("backend:expandable", raise_on_oom=False, patch_torch=False)
        with self.assertRaises(expseg.ExpsegError) as cm:  # was: the first allocator, silently
            expseg.install_torch("backend:expandable")
        self.assertEqual(cm.exception.code, expseg.ALREADY_INITIALIZED)
        self.assertIn("raise_on_oom=False", str(cm.exception))
        with self.assertRaises(RuntimeError):
            torch._C._cuda_memoryStats(0)  # still PyTorch's own (patch_torch=False)

    def test_history_modes_pytorch_bounds_keep_one_entry(self):
        # PyTorch keeps max_entries for "all" only; "state", the legacy default and max_entries=0 keep one.
        torch = FakeTorch()
        expseg._patch_torch(torch)
        C = torch._C
        starts = [lambda: C._cuda_record_memory_history("state", "all", "all", sys.maxsize, False, False, False, [],
                                                        False, True),
                  lambda: C._cuda_record_memory_history_legacy(True, True, 1, False, False, False, False, False, [],
                                                               False, True),
                  lambda: C._cuda_record_memory_history("all", "all", "all", 0, False, False, False, [], False, True)]
        for start in starts:
            start()
            for _ in range(100):
                self.lib.expseg_free(self.lib.expseg_malloc(MiB, 0, None), 0, 0, None)
            # One entry, as PyTorch's ring of one (was every event, then a free's two entries).
            self.assertEqual(len(C._cuda_memorySnapshot(None)["device_traces"][0]), 1)
            C._cuda_record_memory_history(None, None, "all", 0, False, False, False, [], False, True)
        C._cuda_record_memory_history("all", "all", "all", sys.maxsize, False, False, False, [], False, True)
        for _ in range(100):
            self.lib.expseg_free(self.lib.expseg_malloc(MiB, 0, None), 0, 0, None)
        self.assertEqual(len(C._cuda_memorySnapshot(None)["device_traces"][0]), 300)  # "all": 100 x (alloc, 2 free)
        C._cuda_record_memory_history(None, None, "all", 0, False, False, False, [], False, True)
        C._cuda_record_memory_history("all", "all", "all", 10, False, False, False, [], False, True)
        for _ in range(100):
            self.lib.expseg_free(self.lib.expseg_malloc(MiB, 0, None), 0, 0, None)
        # At most max_entries entries, as PyTorch returns, counting a free as its two entries (was up to 20).
        trace = C._cuda_memorySnapshot(None)["device_traces"][0]
        self.assertEqual(len(trace), 10)
        self.assertEqual(trace[-1]["action"], "free_completed")
        self.assertEqual(trace[-2]["action"], "free_requested")
        self.assertEqual(trace[-3]["action"], "alloc")

    def test_config_of_a_device_not_yet_used_includes_the_record_default(self):
        self.lib.expseg_set_record_default(1, 100)
        before = expseg.config(3)  # "the one it would be created with"
        self.lib.expseg_free(self.lib.expseg_malloc(MiB, 3, None), 0, 3, None)
        self.assertEqual(before, expseg.config(3))
        self.assertIn("record:true", before)

    def test_devices_as_pytorch_names_them(self):
        self.lib.expseg_free(self.lib.expseg_malloc(MiB, 1, None), 0, 1, None)
        cuda1 = types.SimpleNamespace(type="cuda", index=1)  # a torch.device
        for d in ("cuda:1", cuda1, 1):
            self.assertEqual(expseg.stats(d)["num_device_alloc"], 1)
        self.assertEqual(expseg.stats(None)["num_device_alloc"], 0)  # the current device: 0 before CUDA starts
        self.assertEqual(expseg.stats("cuda")["num_device_alloc"], 0)
        # "cuda:\u00b2" (superscript two) raised ValueError, and "cuda:\u0663" (Arabic-Indic three) was device 3.
        for bad, why in (("cpu", "not a CUDA device"), ("cuda:x", "not a CUDA device"),
                         ("cuda:\u00b2", "not a CUDA device"), ("cuda:\u0663", "not a CUDA device"),
                         (types.SimpleNamespace(type="cpu", index=None), "not a CUDA device"),
                         (1.5, "not a device index"), ("cuda:64", "out of range")):
            with self.assertRaises(expseg.ExpsegError) as cm:
                expseg.stats(bad)
            self.assertEqual(cm.exception.code, expseg.INVALID_DEVICE)
            self.assertIn(why, str(cm.exception))


class ConverterTest(unittest.TestCase):
    """tools/torch_snapshot_to_rmm.py on a synthetic snapshot with the shape of torch.cuda.memory._snapshot()."""

    def snapshot(self):
        A, B, C, OLD = 0x7F0000000000, 0x7F0000200000, 0x7F0000400000, 0x7E0000000000
        trace = [
            {"action": "free_requested", "addr": OLD, "size": 512, "stream": 0, "frames": []},
            {"action": "free_completed", "addr": OLD, "size": 512, "stream": 0, "frames": []},  # allocated before recording
            {"action": "segment_alloc", "addr": A, "size": 20 * MiB, "stream": 0, "frames": []},
            {"action": "alloc", "addr": A, "size": 3 * MiB, "stream": 0, "frames": [{"filename": "x.py", "line": 1, "name": "f"}]},
            {"action": "alloc", "addr": B, "size": 5 * MiB + 3, "stream": 0, "frames": []},
            {"action": "free_requested", "addr": A, "size": 3 * MiB, "stream": 0, "frames": []},
            {"action": "free_completed", "addr": A, "size": 3 * MiB, "stream": 0, "frames": []},
            {"action": "alloc", "addr": C, "size": MiB, "stream": 0x55, "frames": []},
            {"action": "oom", "device_free": 0, "size": 64 * MiB, "stream": 0, "frames": []},
            {"action": "alloc", "addr": A, "size": 2 * MiB, "stream": 0, "frames": []},
        ]
        return {"segments": [], "device_traces": [trace], "allocator_settings": {}}

    def test_convert_check_replay(self):
        with tempfile.TemporaryDirectory() as d:
            pkl = os.path.join(d, "snapshot.pickle")
            with open(pkl, "wb") as f:
                pickle.dump(self.snapshot(), f)
            events, info = conv.convert(conv.load_snapshot(pkl))
            self.assertEqual(info["allocations"], 4)
            self.assertEqual(info["frees"], 2)
            self.assertEqual((info["live_before"], info["live_before_bytes"]), (1, 512))  # OLD, allocated first
            self.assertEqual(info["skipped_frees"], 0)
            self.assertEqual(info["ooms"], 1)
            self.assertEqual(info["peak_live_requested"], 3 * MiB + 5 * MiB + 3)
            self.assertEqual([e[0] for e in events], ["allocate", "free", "allocate", "allocate", "free", "allocate",
                                                      "allocate"])
            out = os.path.join(d, "t.rmm.csv.gz")
            env = dict(os.environ)
            p = subprocess.run([sys.executable, os.path.join(TOOLS, "torch_snapshot_to_rmm.py"), pkl, out, "--check",
                                "--replay", "split_merge", "expandable"], capture_output=True, text=True, env=env)
            self.assertEqual(p.returncode, 0, p.stderr + p.stdout)
            self.assertIn("1 allocations (512 bytes) were live when the recording began", p.stdout)
            self.assertIn("peak live requested bytes: %d" % (8 * MiB + 3), p.stdout)
            self.assertIn("replay split_merge", p.stdout)
            self.assertIn("replay expandable", p.stdout)
            self.assertEqual(conv.read_trace(out), events)
            for r in conv.replay(out, ["split_merge", "expandable"]):
                self.assertEqual(r["peak_requested"], 8 * MiB + 3)
                self.assertEqual(r["ooms"], 0)
            # With --oom-events, the converter's replay asks for the failed request again, as expseg replay does
            # (was: skipped, so a limit that reproduces the OOM there gave 0 OOMs here).
            oom_events, _ = conv.convert(conv.load_snapshot(pkl), oom_events=True)
            self.assertIn("allocate failure", [e[0] for e in oom_events])
            out_oom = os.path.join(d, "oom.rmm.csv.gz")
            conv.write_trace(oom_events, out_oom)
            for r in conv.replay(out_oom, ["split_merge", "expandable"], "limit:40MiB"):
                self.assertEqual(r["ooms"], 1, r)
            for r in conv.replay(out_oom, ["split_merge", "expandable"]):  # no limit: it fits now, and is given back
                self.assertEqual(r["ooms"], 0, r)
                self.assertEqual(r["peak_requested"], 64 * MiB + MiB + 5 * MiB + 3)
            # A typo in --sim-conf: refused before anything is converted or written, with expseg's message
            # (was: the replay child's traceback, after the trace was written).
            typo_out = os.path.join(d, "typo.rmm.csv.gz")
            p = subprocess.run([sys.executable, os.path.join(TOOLS, "torch_snapshot_to_rmm.py"), pkl, typo_out,
                                "--replay", "split_merge", "--sim-conf", "limti:3"], capture_output=True, text=True)
            self.assertEqual(p.returncode, 1, p.stderr + p.stdout)
            self.assertIn("torch_snapshot_to_rmm: error: --sim-conf 'limti:3'", p.stderr)
            self.assertIn("unknown option 'limti'", p.stderr)
            self.assertNotIn("Traceback", p.stderr)
            self.assertFalse(os.path.exists(typo_out))
            # A bad EXPSEG_ALLOC_CONF is not --sim-conf's fault: the trace is written, the replay says why.
            env_out = os.path.join(d, "env.rmm.csv.gz")
            p = subprocess.run([sys.executable, os.path.join(TOOLS, "torch_snapshot_to_rmm.py"), pkl, env_out,
                                "--replay", "split_merge", "--sim-conf", "limit:3GiB"], capture_output=True, text=True,
                               env=dict(os.environ, EXPSEG_ALLOC_CONF="garbage:1"))
            self.assertEqual(p.returncode, 1, p.stderr + p.stdout)
            self.assertNotIn("--sim-conf", p.stderr)
            self.assertIn("EXPSEG_ALLOC_CONF", p.stderr)
            self.assertIn("unknown option 'garbage'", p.stderr)
            self.assertNotIn("Traceback", p.stderr)
            self.assertTrue(os.path.exists(env_out))
            # Not a snapshot: a clear error, exit 1.
            bad = os.path.join(d, "bad.pickle")
            with open(bad, "wb") as f:
                pickle.dump({"x": 1}, f)
            p = subprocess.run([sys.executable, os.path.join(TOOLS, "torch_snapshot_to_rmm.py"), bad, "--check"],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 1)
            self.assertIn("not a PyTorch memory snapshot", p.stderr)

    def test_blocks_live_before_the_trace_are_allocated_first(self):
        # A real snapshot's trace starts after memory was allocated: the weights W were allocated before
        # _record_memory_history() and appear only in the segments; the ring dropped the 'alloc' of X, freed in
        # the trace. Both held memory the whole time, as PyTorch's memory_viz draws them.
        W, X, A, Y = 0x7F0000000000, 0x7F0040000000, 0x7F0080000000, 0x7F00A0000000
        trace = [
            {"action": "alloc", "addr": A, "size": 256 * MiB, "stream": 7, "frames": []},
            {"action": "free_requested", "addr": X, "size": 512 * MiB, "stream": 0, "frames": []},
            {"action": "free_completed", "addr": X, "size": 512 * MiB, "stream": 0, "frames": []},
            {"action": "free_requested", "addr": A, "size": 256 * MiB, "stream": 7, "frames": []},
            {"action": "free_completed", "addr": A, "size": 256 * MiB, "stream": 7, "frames": []},
            {"action": "alloc", "addr": X, "size": 100, "stream": 0, "frames": []},  # X's address reused
        ]
        segments = [
            {"device": 0, "address": W, "total_size": 1024 * MiB, "stream": 5, "blocks": [
                {"address": W, "size": 1000 * MiB, "requested_size": 1000 * MiB - 1, "state": "active_allocated"},
                {"address": W + 1000 * MiB, "size": 24 * MiB, "requested_size": 0, "state": "inactive"}]},
            {"device": 0, "address": X, "total_size": 512 * MiB, "stream": 0, "blocks": [
                {"address": X, "size": 512, "requested_size": 100, "state": "active_allocated"},  # the trace's
                {"address": X + 512, "size": 512 * MiB - 512, "requested_size": 0, "state": "inactive"}]},
            {"device": 1, "address": Y, "total_size": 2 * MiB, "stream": 0, "blocks": [  # another device's
                {"address": Y, "size": 2 * MiB, "requested_size": 2 * MiB, "state": "active_allocated"}]},
        ]
        events, info = conv.convert({"segments": segments, "device_traces": [trace, []]})
        self.assertEqual(events[:2], [("allocate", X, 512 * MiB, 0), ("allocate", W, 1000 * MiB - 1, 5)])
        self.assertEqual((info["live_before"], info["skipped_frees"]), (2, 0))
        self.assertEqual(info["peak_live_requested"], 512 * MiB + 1000 * MiB - 1 + 256 * MiB)
        self.assertEqual((info["live_at_end"], info["live_requested"]), (2, 1000 * MiB - 1 + 100))
        # Every free follows its allocation, and no address is allocated twice at once.
        live = set()
        for action, addr, _size, _stream in events:
            if action == "allocate":
                self.assertNotIn(addr, live)
                live.add(addr)
            else:
                live.remove(addr)

    def test_a_trace_recorded_without_free_completed_frees_at_free_requested(self):
        # _record_memory_history(skip_actions=["free_completed"]): 100 steps of a 4 GiB buffer at 20 addresses.
        # Was: no free kept, 20 blocks live at the end, a replay peak of 80 GiB for a run that held 4 GiB.
        trace = []
        for i in range(100):
            a = 0x7F0000000000 + (i % 20) * (4 << 30)
            trace.append({"action": "alloc", "addr": a, "size": 4 << 30, "stream": 0})
            trace.append({"action": "free_requested", "addr": a, "size": 4 << 30, "stream": 0})
        events, info = conv.convert({"segments": [], "device_traces": [trace]})
        self.assertEqual(info["free_action"], "free_requested")
        self.assertEqual((info["allocations"], info["frees"], info["implicit_frees"]), (100, 100, 0))
        self.assertEqual((info["live_at_end"], info["peak_live_requested"]), (0, 4 << 30))
        self.assertEqual(len(info["warnings"]), 1)
        self.assertIn("no 'free_completed' entries", info["warnings"][0])
        # With free_completed present, free_requested stays a request (the block is reused at its completion).
        trace.append({"action": "free_completed", "addr": 0x7F0000000000, "size": 4 << 30, "stream": 0})
        _, info = conv.convert({"segments": [], "device_traces": [trace]})
        self.assertEqual(info["free_action"], "free_completed")
        self.assertEqual(info["warnings"], [])

    def test_a_pytorch_2_0_block_gives_its_requested_size_in_its_history(self):
        # PyTorch 2.0's segment blocks have no 'requested_size': 'history'[0]['real_size'] holds it (was: the
        # rounded 20 MiB of a 19 MiB request seeded).
        seg = {"device": 0, "address": 0x10000000, "total_size": 20 * MiB, "stream": 0, "blocks": [
            {"address": 0x10000000, "size": 20 * MiB, "state": "active_allocated",
             "history": [{"addr": 0x10000000, "real_size": 19 * MiB, "frames": []}]}]}
        trace = [{"action": "alloc", "addr": 0x90000000, "size": MiB, "stream": 0}]
        events, info = conv.convert({"segments": [seg], "device_traces": [trace]})
        self.assertEqual(events[0], ("allocate", 0x10000000, 19 * MiB, 0))
        self.assertEqual(info["live_before_bytes"], 19 * MiB)

    def test_a_device_with_only_snapshot_entries_is_not_chosen(self):
        # PyTorch records a 'snapshot' entry in every device's trace at each _snapshot() from the second on.
        # Was: "the snapshot has events for devices [0, 1]: choose one with --device".
        work = [{"action": "alloc", "addr": 0x1000, "size": MiB, "stream": 0},
                {"action": "snapshot", "addr": 0, "size": 0, "stream": 0}]
        snap = {"segments": [], "device_traces": [[{"action": "snapshot", "addr": 0, "size": 0, "stream": 0}], work]}
        _, info = conv.convert(snap)
        self.assertEqual(info["device"], 1)
        snap["device_traces"][0].insert(0, {"action": "alloc", "addr": 0x2000, "size": MiB, "stream": 0})
        with self.assertRaisesRegex(conv.ConvertError, r"devices \[0, 1\]: choose one with --device"):
            conv.convert(snap)

    def test_a_recording_without_history_is_warned_about(self):
        # _record_memory_history(True) (legacy: 1 entry) or enabled="state": the trace is the end state only.
        seg = {"device": 0, "address": 0x10000000, "total_size": 30 << 30, "stream": 0, "blocks": [
            {"address": 0x10000000 + k * (10 << 30), "size": 10 << 30, "requested_size": 10 << 30, "state": "active_allocated"}
            for k in range(3)]}
        snap = {"segments": [seg], "device_traces": [[{"action": "free_completed", "addr": 0x90000000, "size": MiB, "stream": 0}]]}
        with tempfile.TemporaryDirectory() as d:
            pkl = os.path.join(d, "s.pickle")
            with open(pkl, "wb") as f:
                pickle.dump(snap, f)
            p = subprocess.run([sys.executable, os.path.join(TOOLS, "torch_snapshot_to_rmm.py"), pkl, "--check"],
                               capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("WARNING: the trace holds 1 alloc/free entry: the recording kept almost no history", p.stderr)
        self.assertIn("_record_memory_history(max_entries=1_000_000)", p.stderr)
        _, info = conv.convert(self.snapshot())  # a recording with history: no warning
        self.assertEqual(info["warnings"], [])

    def test_malformed_snapshots_fail_with_a_message(self):
        ok = {"action": "alloc", "addr": 0x1000, "size": 5, "stream": 0}
        cases = [
            ({"device_traces": 5}, "not a list"),
            ({"device_traces": [[5]]}, "trace entry 0 is not a trace entry"),
            ({"device_traces": [[ok, {"action": "alloc", "size": 5}]]}, "trace entry 1 (alloc): 'addr' is missing"),
            ({"device_traces": [[dict(ok, addr="0x1000")]]}, "'addr' is '0x1000'"),
            ({"device_traces": [[dict(ok, size=None)]]}, "'size' is missing"),
            ({"device_traces": [[dict(ok, size=-5)]]}, "'size' is -5, expected a size"),
            ({"device_traces": [[ok]], "segments": [{"device": 0, "blocks": []}]}, "segment 0: 'address' is missing"),
            ({"device_traces": [[ok]], "segments": [{"device": 0, "address": 0, "blocks": [{"state": "x"}]}]},
             "segment 0 block 0: 'size' is missing"),
            # Were a TypeError traceback (a list as the action), a RecursionError from the message's repr, and a
            # size of 2^70 written out for the replay to refuse.
            ({"device_traces": [[dict(ok, action=["alloc"])]]}, "trace entry 0 is not a trace entry (a dict with an 'action' string)"),
            ({"device_traces": [[dict(ok, size=functools.reduce(lambda a, _: [a], range(5000), 1))]]}, "'size' is [[[[...]]]], expected an integer"),
            ({"device_traces": [[dict(ok, size=1 << 70)]]}, "'size' is %d, which does not fit in 64 bits" % (1 << 70)),
        ]
        for snap, why in cases:
            with self.assertRaises(conv.ConvertError, msg=why) as cm:
                conv.convert(snap)
            self.assertIn(why, str(cm.exception))
        with tempfile.TemporaryDirectory() as d:  # the command says so, without a traceback
            bad = os.path.join(d, "bad.pickle")
            with open(bad, "wb") as f:
                pickle.dump(cases[2][0], f)
            p = subprocess.run([sys.executable, os.path.join(TOOLS, "torch_snapshot_to_rmm.py"), bad, "--check"],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 1)
            self.assertIn("torch_snapshot_to_rmm: error: device 0 trace entry 1 (alloc): 'addr' is missing", p.stderr)
            self.assertNotIn("Traceback", p.stderr)

    def test_a_pickle_that_would_run_code_is_refused(self):
        # pickle.load imported and called whatever the file named: a "snapshot" from someone else ran their code.
        with tempfile.TemporaryDirectory() as d:
            marker = os.path.join(d, "ran")

            class Payload:
                def __reduce__(self):
                    return (open, (marker, "w"))

            bad = os.path.join(d, "evil.pickle")
            with open(bad, "wb") as f:
                pickle.dump({"device_traces": [[]], "x": Payload()}, f)
            with self.assertRaises(conv.ConvertError) as cm:
                conv.load_snapshot(bad)
            self.assertIn("names io.open, and a PyTorch memory snapshot holds only dicts, lists, strings and numbers", str(cm.exception))
            self.assertFalse(os.path.exists(marker))
            p = subprocess.run([sys.executable, os.path.join(TOOLS, "torch_snapshot_to_rmm.py"), bad, "--check"],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 1)
            self.assertNotIn("Traceback", p.stderr)
            self.assertFalse(os.path.exists(marker))


class CompareTest(unittest.TestCase):
    """benchmarks/compare.py, the A/B table of the benchmarks against PyTorch and the driver."""

    @classmethod
    def setUpClass(cls):
        sys.path.insert(0, os.path.join(os.path.dirname(TOOLS), "benchmarks"))
        import compare  # noqa: E402
        cls.compare = compare

    def test_a_file_that_is_not_benchmark_output_is_refused(self):
        # Was: a table of dashes, "errors: 0" and exit 0 for any JSON object; a list, or "benchmarks": null,
        # a traceback.
        with tempfile.TemporaryDirectory() as d:
            for text in ('{"errors": {}, "notes": []}', '[1, 2]', '{"benchmarks": null}', '{"benchmarks": [3]}'):
                path = os.path.join(d, "x.json")
                with open(path, "w") as f:
                    f.write(text)
                doc, problem = self.compare.load_bench_json(path)
                self.assertIsNone(doc, text)
                self.assertIn("is not Google Benchmark's JSON output", problem)
                p = subprocess.run([sys.executable, self.compare.__file__, "--check-bench", path], capture_output=True, text=True)
                self.assertEqual(p.returncode, 1, text)
                self.assertNotIn("Traceback", p.stderr)
            path = os.path.join(d, "ok.json")
            with open(path, "w") as f:
                json.dump({"benchmarks": [{"name": "pair/expandable:sim/512B", "run_type": "iteration", "real_time": 1.0,
                                           "time_unit": "ns", "ns_per_pair": 9.0}]}, f)
            doc, problem = self.compare.load_bench_json(path)
            self.assertIsNone(problem)
            self.assertEqual(len(doc["benchmarks"]), 1)

    def test_the_simulated_table_leaves_the_cuda_baselines_out(self):
        # Was: the table "expseg on the simulated device" had cuMemAlloc/cuMemAllocAsync/vmm columns from the GPU
        # run and met "exp <= 2x vmm1" with a simulated allocation against a real driver call.
        runs = {"pair/expandable:sim/512B": {"ns_per_pair": 50.0}, "pair/cuMemAlloc:cuda/512B": {"ns_per_pair": 9000.0},
                "growth/expandable:sim/1GiB": {"real_time": 5.0, "time_unit": "us"},
                "growth/vmm_1handle:cuda/1GiB": {"real_time": 270.0, "time_unit": "us"}}
        rows = {r[0]: r for r in self.compare.build_rows(runs, {}, {}, "sim")}
        self.assertEqual(rows["pair 512B"][3]["expseg expandable"], 50.0)
        self.assertIsNone(rows["pair 512B"][3]["cuMemAlloc"])
        self.assertIsNone(rows["growth 1GiB (first alloc)"][3]["vmm 1 handle"])
        self.assertIsNone(rows["growth 1GiB (first alloc)"][4])  # no target against the driver
        rows = {r[0]: r for r in self.compare.build_rows(dict(runs, **{"pair/expandable:cuda/512B": {"ns_per_pair": 80.0}}), {}, {}, "cuda")}
        self.assertEqual(rows["pair 512B"][3]["cuMemAlloc"], 9000.0)
        self.assertEqual(rows["growth 1GiB (first alloc)"][4], ("vmm", 2.0))

    def test_the_simulated_table_leaves_pytorchs_gpu_figures_out(self):
        # Was: PyTorch's GPU pairs, growth and scenario times stood beside expseg's simulated ones, with ratios
        # and targets ("growth 1GiB 0.89 vs 175 µs"), whenever expseg_bench had no :cuda runs.
        runs = {"pair/expandable:sim/512B": {"ns_per_pair": 50.0},
                "growth/expandable:sim/1GiB": {"real_time": 5.0, "time_unit": "us"}}
        label = self.compare.TORCH_MODES[0][0]
        torch_res = {label: {"pair_ns": {"512": 400.0}, "churn64_ns": 800.0}}
        growth_res = {label: {str(self.compare.GiB): {"first_us": 175.0}}}
        rows = {r[0]: r for r in self.compare.build_rows(runs, torch_res, growth_res, "sim")}
        self.assertIsNone(rows["pair 512B"][3][label])
        self.assertIsNone(rows["growth 1GiB (first alloc)"][3][label])
        rows = {r[0]: r for r in self.compare.build_rows(runs, torch_res, growth_res, "cuda")}
        self.assertEqual(rows["pair 512B"][3][label], 400.0)
        self.assertEqual(rows["growth 1GiB (first alloc)"][3][label], 175.0)


class WorkloadsChecksTest(unittest.TestCase):
    """benchmarks/workloads.py's order of runs and its checks over rounds (the GPU runs themselves are not here)."""

    @classmethod
    def setUpClass(cls):
        sys.path.insert(0, os.path.join(os.path.dirname(TOOLS), "benchmarks"))
        import workloads  # noqa: E402  (torch is imported by its child processes only)
        cls.wl = workloads

    @staticmethod
    def row(variant, ms, k, loss=7.0, status="ok"):
        if status != "ok":
            return dict(workload="resnet50-train-varsize", variant=variant, status=status, round=k)
        return dict(workload="resnet50-train-varsize", variant=variant, status="ok", exit_code=0, round=k,
                    peak_allocated=100, peak_reserved=101, mean_step_ms=ms, final_loss=loss, mean_loss=loss)

    def checks(self, rows):
        return {name: (ok, detail) for name, ok, detail in self.wl.checks_for("resnet50-train-varsize", rows, "/nonexistent")}

    def time_check(self, rows):
        return self.checks(rows)["expseg-expandable mean step time <= %.2f x torch-classic's" % self.wl.TIME_MAX]

    def test_rounds_reverse_the_order_of_the_variants(self):
        order = list(self.wl.run_order(["a", "b"], ["x", "y", "z"], 3))
        self.assertEqual(order[:6], [(1, "a", "x"), (1, "a", "y"), (1, "a", "z"), (1, "b", "x"), (1, "b", "y"), (1, "b", "z")])
        self.assertEqual(order[6:9], [(2, "a", "z"), (2, "a", "y"), (2, "a", "x")])
        self.assertEqual(order[12:15], [(3, "a", "x"), (3, "a", "y"), (3, "a", "z")])
        self.assertEqual(len(order), 18)

    def test_the_time_check_takes_the_means_over_rounds(self):
        # Round 1 alone is a FAIL (x1.10); over both rounds expseg's mean (20.0) is under classic's (20.5).
        r1 = [self.row("torch-classic", 20.0, 1), self.row("expseg-expandable", 22.0, 1)]
        r2 = [self.row("expseg-expandable", 18.0, 2), self.row("torch-classic", 21.0, 2)]
        ok, detail = self.time_check(r1)
        self.assertFalse(ok)
        self.assertIn("x1.100; one round", detail)
        ok, detail = self.time_check(r1 + r2)
        self.assertTrue(ok, detail)
        self.assertIn("means over 2 rounds 20.00 ms vs 20.50 ms (x0.976; each round x1.100 x0.857)", detail)
        ok, detail = self.time_check(r1 + [self.row("expseg-expandable", 23.0, 2), self.row("torch-classic", 21.0, 2)])
        self.assertFalse(ok, detail)

    def test_every_other_check_must_hold_in_every_round(self):
        rows = [self.row("torch-classic", 20.0, 1), self.row("expseg-expandable", 20.0, 1),
                self.row("torch-classic", 20.0, 2), self.row("expseg-expandable", 20.0, 2, loss=7.5)]
        ok, detail = self.checks(rows)["losses within rel %g of torch-classic" % self.wl.LOSS_RTOL]
        self.assertFalse(ok)
        self.assertTrue(detail.startswith("round 2: expseg-expandable 7.5 vs 7"), detail)
        ok, detail = self.checks(rows[:3] + [self.row("expseg-expandable", 20.0, 2)])[
            "losses within rel %g of torch-classic" % self.wl.LOSS_RTOL]
        self.assertTrue(ok)
        self.assertTrue(detail.startswith("all 2 rounds"), detail)

    def test_a_failed_run_fails_its_round_and_takes_the_time_check_away(self):
        rows = [self.row("torch-classic", 20.0, 1), self.row("expseg-expandable", 20.0, 1),
                self.row("torch-classic", 0, 2, status="FAILED (exit 1)"), self.row("expseg-expandable", 20.0, 2)]
        checks = self.checks(rows)
        self.assertEqual(checks["all variants ran"], (False, "round 2: failed: torch-classic"))
        self.assertTrue(checks["expseg-expandable reserved/allocated <= %.2f" % self.wl.RATIO_MAX][0])
        self.assertNotIn("expseg-expandable mean step time <= %.2f x torch-classic's" % self.wl.TIME_MAX, checks)


if __name__ == "__main__":
    unittest.main(verbosity=2)
