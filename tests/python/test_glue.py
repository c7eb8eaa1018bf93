#!/usr/bin/env python3
"""Smoke test of the Python glue without a GPU: tools/expseg.py loads libexpseg.so (EXPSEG_LIBRARY, set by
meson), drives the C API on the simulated device through ctypes, and tools/torch_snapshot_to_rmm.py converts
a synthetic PyTorch snapshot and replays it. Run: EXPSEG_LIBRARY=build/lib/libexpseg.so python3 tests/python/test_glue.py
"""
import gzip
import json
import os
import pickle
import subprocess
import sys
import tempfile
import unittest

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
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.rmm.csv.gz")
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
            self.assertEqual(info["frees"], 1)
            self.assertEqual(info["skipped_frees"], 1)
            self.assertEqual(info["ooms"], 1)
            self.assertEqual(info["peak_live_requested"], 3 * MiB + 5 * MiB + 3)
            self.assertEqual([e[0] for e in events], ["allocate", "allocate", "free", "allocate", "allocate"])
            out = os.path.join(d, "t.rmm.csv.gz")
            env = dict(os.environ)
            p = subprocess.run([sys.executable, os.path.join(TOOLS, "torch_snapshot_to_rmm.py"), pkl, out, "--check",
                                "--replay", "split_merge", "expandable"], capture_output=True, text=True, env=env)
            self.assertEqual(p.returncode, 0, p.stderr + p.stdout)
            self.assertIn("skipped 1 frees", p.stdout)
            self.assertIn("peak live requested bytes: %d" % (8 * MiB + 3), p.stdout)
            self.assertIn("replay split_merge", p.stdout)
            self.assertIn("replay expandable", p.stdout)
            self.assertEqual(conv.read_trace(out), events)
            for r in conv.replay(out, ["split_merge", "expandable"]):
                self.assertEqual(r["peak_requested"], 8 * MiB + 3)
                self.assertEqual(r["ooms"], 0)
            # Not a snapshot: a clear error, exit 1.
            bad = os.path.join(d, "bad.pickle")
            with open(bad, "wb") as f:
                pickle.dump({"x": 1}, f)
            p = subprocess.run([sys.executable, os.path.join(TOOLS, "torch_snapshot_to_rmm.py"), bad, "--check"],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 1)
            self.assertIn("not a PyTorch memory snapshot", p.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
