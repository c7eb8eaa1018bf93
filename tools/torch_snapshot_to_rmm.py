#!/usr/bin/env python3
"""Convert a PyTorch memory snapshot into the RMM CSV trace that expseg replays.

In your PyTorch program (https://pytorch.org/docs/stable/torch_cuda_memory.html):
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    ... run the work (and the OOM) ...
    torch.cuda.memory._dump_snapshot("snapshot.pickle")
Then:
    python3 tools/torch_snapshot_to_rmm.py snapshot.pickle trace.rmm.csv.gz   # convert (gzip when .gz)
    python3 tools/torch_snapshot_to_rmm.py snapshot.pickle --check            # events, skipped frees, peak live bytes
    python3 tools/torch_snapshot_to_rmm.py snapshot.pickle t.rmm.csv.gz --replay split_merge expandable
                                                     # replays on the simulated device through libexpseg
The trace keeps the device's 'alloc' and 'free_completed' events (a block is reusable only once its free has
completed), with requested sizes and streams. Frees of blocks allocated before the recording started (or
dropped from the front of the max_entries ring) are skipped and counted. Loading the pickle needs no torch.
"""
import argparse
import gzip
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"
U64 = (1 << 64) - 1


class ConvertError(Exception):
    pass


def load_snapshot(path):
    with open(path, "rb") as f:
        try:
            snap = pickle.load(f)
        except Exception as e:  # a truncated or foreign file
            raise ConvertError("%s: not a readable pickle (%s: %s)" % (path, type(e).__name__, e)) from e
    if not isinstance(snap, dict) or "device_traces" not in snap:
        raise ConvertError("%s: not a PyTorch memory snapshot (no 'device_traces'); write it with "
                           "torch.cuda.memory._dump_snapshot() after torch.cuda.memory._record_memory_history()" % path)
    return snap


def pick_device(snap, device):
    traces = snap["device_traces"]
    if device is not None:
        if device < 0 or device >= len(traces):
            raise ConvertError("no device %d in the snapshot (it has %d device trace(s))" % (device, len(traces)))
        return device
    used = [d for d, t in enumerate(traces) if t]
    if not used:
        raise ConvertError("the snapshot has no trace events: was _record_memory_history() enabled before the work ran?")
    if len(used) > 1:
        raise ConvertError("the snapshot has events for devices %s: choose one with --device" % used)
    return used[0]


def convert(snap, device=None, oom_events=False):
    """(events, info): events are (action, pointer, size, stream) with action 'allocate', 'free' or
    'allocate failure'; info counts what was kept and skipped and the peak of live requested bytes."""
    device = pick_device(snap, device)
    live = {}  # addr -> requested size
    events = []
    info = dict(device=device, entries=0, actions={}, allocations=0, frees=0, skipped_frees=0, implicit_frees=0,
                ooms=0, live_requested=0, peak_live_requested=0, live_at_end=0)
    cur = 0
    for e in snap["device_traces"][device]:
        info["entries"] += 1
        action = e.get("action")
        info["actions"][action] = info["actions"].get(action, 0) + 1
        if action == "alloc":
            addr, size, stream = e["addr"] & U64, int(e["size"]), e.get("stream", 0) & U64
            if addr in live:  # its free is missing from the trace: free it first so that pairing holds
                info["implicit_frees"] += 1
                events.append(("free", addr, live[addr], stream))
                cur -= live.pop(addr)
            live[addr] = size
            events.append(("allocate", addr, size, stream))
            info["allocations"] += 1
            cur += size
            if cur > info["peak_live_requested"]:
                info["peak_live_requested"] = cur
        elif action == "free_completed":
            addr, stream = e["addr"] & U64, e.get("stream", 0) & U64
            size = live.pop(addr, None)
            if size is None:  # allocated before the recording started
                info["skipped_frees"] += 1
                continue
            events.append(("free", addr, size, stream))
            info["frees"] += 1
            cur -= size
        elif action == "oom":
            info["ooms"] += 1
            if oom_events:
                events.append(("allocate failure", 0, int(e.get("size", 0)), e.get("stream", 0) & U64))
    info["live_requested"] = cur
    info["live_at_end"] = len(live)
    return events, info


def write_trace(events, path):
    """Writes RMM's CSV (Time = the event's index, as in benchmarks/traces); gzip when path ends in .gz."""
    lines = [HEADER]
    lines.extend("1,%d,%s,0x%x,%d,0x%x\n" % (i, a, p, s, st) for i, (a, p, s, st) in enumerate(events))
    text = "".join(lines)
    if path.endswith(".gz"):
        with gzip.open(path, "wt", compresslevel=6) as f:
            f.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)


def read_trace(path):
    """Reads back a trace written by write_trace (or expseg's recorder): [(action, pointer, size, stream)]."""
    opener = gzip.open if path.endswith(".gz") else open
    events = []
    with opener(path, "rt") as f:
        header = f.readline()
        if header.strip() != HEADER.strip():
            raise ConvertError("%s: not an RMM CSV trace (header %r)" % (path, header.strip()))
        for n, line in enumerate(f, start=2):
            cols = line.rstrip("\n").split(",")
            if len(cols) < 6:
                raise ConvertError("%s:%d: expected 6 columns" % (path, n))
            action = cols[2]
            if action == "deallocate":
                action = "free"
            events.append((action, int(cols[3], 0), int(cols[4]), int(cols[5], 0)))
    return events


def describe(info, out=sys.stdout):
    gib = info["peak_live_requested"] / (1 << 30)
    print("device %d: %d trace entries %s" % (info["device"], info["entries"], json.dumps(info["actions"], sort_keys=True)), file=out)
    print("  kept: %d allocations, %d frees%s" % (info["allocations"], info["frees"],
          (", %d OOM events" % info["ooms"]) if info["ooms"] else ""), file=out)
    if info["skipped_frees"]:
        print("  skipped %d frees of blocks allocated before the recording started (recording began mid-run, or "
              "max_entries dropped the oldest entries)" % info["skipped_frees"], file=out)
    if info["implicit_frees"]:
        print("  WARNING: %d allocations reused an address whose free is missing; a free was inserted before each"
              % info["implicit_frees"], file=out)
    print("  live at the end: %d allocations, %d bytes" % (info["live_at_end"], info["live_requested"]), file=out)
    print("  peak live requested bytes: %d (%.3f GiB)" % (info["peak_live_requested"], gib), file=out)


# ---------------------------------------------------------------------------------------------
# Replay on the simulated device through libexpseg's C API (one subprocess per backend: the C API
# takes its configuration once per process).

def replay_child(trace_path, backend, sim_conf):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import expseg  # tools/expseg.py
    conf = "device:sim,sim_capacity:141GiB,backend:%s" % backend
    if sim_conf:
        conf += "," + sim_conf
    expseg.configure(conf)
    lib = expseg.load()
    events = read_trace(trace_path)
    ptrs = {}
    ooms = 0
    t0 = time.perf_counter()
    malloc, free = lib.expseg_malloc, lib.expseg_free
    for action, pointer, size, stream in events:
        if action == "allocate":
            p = malloc(size, 0, stream) if size else None
            if size and not p:
                ooms += 1
            ptrs[pointer] = p
        elif action == "free":
            p = ptrs.pop(pointer, None)
            if p:
                free(p, 0, 0, None)
    secs = time.perf_counter() - t0
    s = expseg.stats()
    print(json.dumps(dict(backend=backend, config=expseg.config(), events=len(events), ooms=ooms, seconds=round(secs, 3),
                          peak_allocated=s["allocated_bytes.all.peak"], peak_reserved=s["reserved_bytes.all.peak"],
                          peak_requested=s["requested_bytes.all.peak"])), flush=True)


def replay(trace_path, backends, sim_conf=""):
    """Replays the trace on the simulated device with each backend; returns their result dicts."""
    results = []
    for b in backends:
        cmd = [sys.executable, os.path.abspath(__file__), "--replay-child", b, trace_path]
        if sim_conf:
            cmd += ["--sim-conf", sim_conf]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0 or not p.stdout.strip():
            raise ConvertError("replay on %s failed (exit %d):\n%s" % (b, p.returncode, (p.stderr or p.stdout)[-3000:]))
        results.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return results


def print_replays(results, torch_peak_allocated=None, out=sys.stdout):
    for r in results:
        line = "  replay %-12s peak allocated %15d  peak reserved %15d  peak requested %15d  ooms %d  (%.1f s)" % (
            r["backend"], r["peak_allocated"], r["peak_reserved"], r["peak_requested"], r["ooms"], r["seconds"])
        if torch_peak_allocated:
            line += "  vs PyTorch's peak allocated: %+.3f%%" % (100.0 * (r["peak_allocated"] - torch_peak_allocated) / torch_peak_allocated)
        print(line, file=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("snapshot", help="pickle from torch.cuda.memory._dump_snapshot()")
    ap.add_argument("output", nargs="?", help="RMM CSV trace to write (.gz: gzip)")
    ap.add_argument("--device", type=int, default=None, help="device trace to convert (default: the only one with events)")
    ap.add_argument("--check", action="store_true", help="print counts and the peak of live requested bytes")
    ap.add_argument("--oom-events", action="store_true", help="also write PyTorch's OOM events as 'allocate failure' lines")
    ap.add_argument("--replay", nargs="+", metavar="BACKEND", choices=["split_merge", "expandable"],
                    help="replay the trace on the simulated device (needs libexpseg.so, see tools/expseg.py)")
    ap.add_argument("--sim-conf", default="", help="extra expseg configuration for --replay (e.g. limit:20GiB)")
    ap.add_argument("--torch-peak-allocated", type=int, default=None, help="PyTorch's allocated_bytes.all.peak, to compare with --replay")
    ap.add_argument("--replay-child", nargs=2, metavar=("BACKEND", "TRACE"), help=argparse.SUPPRESS)
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--replay-child"]:  # internal: python3 this.py --replay-child BACKEND TRACE [--sim-conf S]
        sim = argv[argv.index("--sim-conf") + 1] if "--sim-conf" in argv else ""
        replay_child(argv[2], argv[1], sim)
        return 0
    args = ap.parse_args(argv)
    if not args.output and not args.check and not args.replay:
        ap.error("give an output path, --check, or --replay")
    try:
        snap = load_snapshot(args.snapshot)
        events, info = convert(snap, args.device, args.oom_events)
        if args.check or args.output:
            describe(info)
        trace = args.output
        if trace:
            write_trace(events, trace)
            print("wrote %s (%d events)" % (trace, len(events)))
        if args.replay:
            tmp = None
            if not trace:
                tmp = tempfile.NamedTemporaryFile(suffix=".rmm.csv.gz", delete=False)
                tmp.close()
                trace = tmp.name
                write_trace(events, trace)
            try:
                print_replays(replay(trace, args.replay, args.sim_conf), args.torch_peak_allocated)
            finally:
                if tmp:
                    os.unlink(tmp.name)
    except (ConvertError, OSError) as e:
        print("torch_snapshot_to_rmm: error: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
