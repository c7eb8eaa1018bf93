#!/usr/bin/env python3
"""Convert a PyTorch memory snapshot into the RMM CSV trace that expseg replays.

In your PyTorch program (https://pytorch.org/docs/stable/torch_cuda_memory.html):
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    ... run the work (and the OOM) ...
    torch.cuda.memory._dump_snapshot("snapshot.pickle")
Then:
    python3 tools/torch_snapshot_to_rmm.py snapshot.pickle trace.rmm.csv.gz   # convert (gzip when .gz)
    python3 tools/torch_snapshot_to_rmm.py snapshot.pickle --check            # events, blocks live before the recording, peak live bytes
    python3 tools/torch_snapshot_to_rmm.py snapshot.pickle t.rmm.csv.gz --replay split_merge expandable
                                                     # replays on the simulated device through libexpseg
The trace keeps the device's 'alloc' and 'free_completed' events (a block is reusable only once its free has
completed; 'free_requested' where the recording skipped 'free_completed'), with requested sizes and streams. Blocks already allocated when the recording began (before
_record_memory_history(), or whose 'alloc' the max_entries ring dropped) are allocated at the start of the
trace, as PyTorch's memory_viz counts them: those the trace frees, and those the snapshot's segments show
allocated (e.g. the model's weights). Loading the pickle needs no torch.
"""
import argparse
import gzip
import json
import os
import pickle
import reprlib
import subprocess
import sys
import tempfile
import time

HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"
U64 = (1 << 64) - 1


class ConvertError(Exception):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """A PyTorch memory snapshot holds dicts, lists, strings and numbers only: a pickle that names a class or a
    function (which pickle.load would import and call, running whatever the file says) is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError("it names %s.%s, and a PyTorch memory snapshot holds only dicts, lists, strings "
                                     "and numbers (refused: loading it would run code)" % (module, name))


def _short(v):
    """repr of v for a message, cut short (a deeply nested or huge value must not make the message fail)."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, 80, 80
    return r.repr(v)


def load_snapshot(path):
    with open(path, "rb") as f:
        try:
            snap = _PlainUnpickler(f).load()
        except Exception as e:  # a truncated or foreign file
            raise ConvertError("%s: not a readable pickle (%s: %s)" % (path, type(e).__name__, e)) from e
    if not isinstance(snap, dict) or "device_traces" not in snap:
        raise ConvertError("%s: not a PyTorch memory snapshot (no 'device_traces'); write it with "
                           "torch.cuda.memory._dump_snapshot() after torch.cuda.memory._record_memory_history()" % path)
    return snap


def pick_device(snap, device):
    traces = snap["device_traces"]
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ConvertError("'device_traces' is not a list of per-device event lists: not a PyTorch memory snapshot")
    if device is not None:
        if device < 0 or device >= len(traces):
            raise ConvertError("no device %d in the snapshot (it has %d device trace(s))" % (device, len(traces)))
        return device
    # A device whose trace holds only 'snapshot' entries (PyTorch records one in every device's trace at each
    # _snapshot() from the second on, allocated there or not) is not a device the work ran on.
    # (A malformed entry counts too: reading the device's trace then says what is wrong with it.)
    used = [d for d, t in enumerate(traces)
            if any(not isinstance(e, dict) or not isinstance(e.get("action"), str) or e["action"] in _WORK_ACTIONS for e in t)]
    if not used:
        raise ConvertError("the snapshot has no trace events: was _record_memory_history() enabled before the work ran?")
    if len(used) > 1:
        raise ConvertError("the snapshot has events for devices %s: choose one with --device" % used)
    return used[0]


_WORK_ACTIONS = ("alloc", "free_requested", "free_completed", "oom")


def free_action(snap, device):
    """The action that frees a block in this device's trace: 'free_completed' (the block is reusable once its
    free has completed), or 'free_requested' when the trace has none of those but has requests
    (_record_memory_history(skip_actions=["free_completed"])): without it, nothing would ever be freed."""
    has = {a: False for a in ("free_requested", "free_completed")}
    for e in snap["device_traces"][device]:
        if isinstance(e, dict) and isinstance(e.get("action"), str) and e["action"] in has:
            has[e["action"]] = True
    return "free_requested" if has["free_requested"] and not has["free_completed"] else "free_completed"


def _int(obj, key, where, default=None):
    """obj[key] as an int, or a ConvertError that says where (a malformed snapshot must not end in a traceback)."""
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConvertError("%s: %r is %s, expected an integer" % (where, key, "missing" if v is None else _short(v)))
    if v < 0 and "size" in key:  # addresses and streams may come as signed 64-bit values; sizes may not
        raise ConvertError("%s: %r is %d, expected a size (>= 0)" % (where, key, v))
    if v > U64 or v < -(1 << 63):  # a 64-bit value, as the device's
        raise ConvertError("%s: %r is %d, which does not fit in 64 bits" % (where, key, v))
    return v


def _requested_size(block, where, size):
    """A segment block's requested bytes: 'requested_size'; PyTorch 2.0's snapshots have none, and keep it
    as 'real_size' in the block's first 'history' entry (as _memory_viz.py reads them); else the rounded size."""
    if "requested_size" in block:
        return _int(block, "requested_size", where)
    history = block.get("history")
    if isinstance(history, list) and history and isinstance(history[0], dict) and "real_size" in history[0]:
        return _int(history[0], "real_size", where + " history 0")
    return size


def _trace_entries(snap, device):
    """The device's trace entries, each checked to be a dict with an action."""
    for i, e in enumerate(snap["device_traces"][device]):
        if not isinstance(e, dict) or not isinstance(e.get("action"), str):
            raise ConvertError("device %d trace entry %d is not a trace entry (a dict with an 'action' string): %s"
                               % (device, i, _short(e)))
        yield i, e


def _live_before_trace(snap, device):
    """[(addr, requested size, stream)] of the blocks that were allocated when the trace begins: those it frees
    without having allocated them (allocated before the recording started, or their 'alloc' dropped from the
    front of the max_entries ring), and those the snapshot's segments show allocated that the trace never
    allocated (e.g. the model's weights). PyTorch's memory_viz counts both; leaving them out would replay the
    trace with less memory held than the job held."""
    initial, seen, live = [], set(), set()
    freeing = free_action(snap, device)
    for i, e in _trace_entries(snap, device):
        action = e["action"]
        if action not in ("alloc", freeing):
            continue
        where = "device %d trace entry %d (%s)" % (device, i, action)
        addr = _int(e, "addr", where) & U64
        if action == "alloc":
            live.add(addr)
        elif addr not in live and addr not in seen:  # its first appearance is its free
            initial.append((addr, _int(e, "size", where), _int(e, "stream", where, 0) & U64))
        else:
            live.discard(addr)
        seen.add(addr)
    segments = snap.get("segments") or []
    if not isinstance(segments, list):
        raise ConvertError("'segments' is not a list: not a PyTorch memory snapshot")
    for s, seg in enumerate(segments):
        where = "segment %d" % s
        if not isinstance(seg, dict) or not isinstance(seg.get("blocks", []), list):
            raise ConvertError("%s is not a segment (a dict with a list of 'blocks')" % where)
        if seg.get("device", device) != device:
            continue
        addr = _int(seg, "address", where)
        for b, block in enumerate(seg.get("blocks", [])):
            bwhere = "%s block %d" % (where, b)
            if not isinstance(block, dict):
                raise ConvertError("%s is not a block (a dict)" % bwhere)
            size = _int(block, "size", bwhere)
            addr = _int(block, "address", bwhere, addr)  # older snapshots give only the segment's address
            # allocated, or freed by the program while another stream still uses it: memory held either way
            if block.get("state") in ("active_allocated", "active_pending_free") and (addr & U64) not in live:
                if addr & U64 not in seen:
                    initial.append((addr & U64, _requested_size(block, bwhere, size),
                                    _int(seg, "stream", where, 0) & U64))
                    seen.add(addr & U64)
            addr += size
    return initial


def convert(snap, device=None, oom_events=False):
    """(events, info): events are (action, pointer, size, stream) with action 'allocate', 'free' or
    'allocate failure'; info counts what was kept and skipped and the peak of live requested bytes.
    The blocks live when the trace begins (see _live_before_trace) are allocated first."""
    device = pick_device(snap, device)
    freeing = free_action(snap, device)
    live = {}  # addr -> requested size
    events = []
    info = dict(device=device, entries=0, actions={}, allocations=0, frees=0, skipped_frees=0, implicit_frees=0,
                ooms=0, live_requested=0, peak_live_requested=0, live_at_end=0, live_before=0, live_before_bytes=0,
                free_action=freeing, warnings=[])
    cur = 0
    for addr, size, stream in _live_before_trace(snap, device):
        live[addr] = size
        events.append(("allocate", addr, size, stream))
        info["live_before"] += 1
        info["live_before_bytes"] += size
        cur += size
    info["peak_live_requested"] = cur
    for i, e in _trace_entries(snap, device):
        info["entries"] += 1
        action = e["action"]
        info["actions"][action] = info["actions"].get(action, 0) + 1
        where = "device %d trace entry %d (%s)" % (device, i, action)
        if action == "alloc":
            addr, size, stream = _int(e, "addr", where) & U64, _int(e, "size", where), _int(e, "stream", where, 0) & U64
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
        elif action == freeing:
            addr, stream = _int(e, "addr", where) & U64, _int(e, "stream", where, 0) & U64
            size = live.pop(addr, None)
            if size is None:  # a second free of a block the trace already freed
                info["skipped_frees"] += 1
                continue
            events.append(("free", addr, size, stream))
            info["frees"] += 1
            cur -= size
        elif action == "oom":
            info["ooms"] += 1
            if oom_events:
                events.append(("allocate failure", 0, _int(e, "size", where, 0), _int(e, "stream", where, 0) & U64))
    info["live_requested"] = cur
    info["live_at_end"] = len(live)
    if freeing == "free_requested":
        info["warnings"].append(
            "the trace has no 'free_completed' entries (recorded with skip_actions?): each block is freed at its "
            "'free_requested', so a free that waited for another stream's work (record_stream) ends early (compare "
            "--replay's peak with allocated_bytes.all.peak then, not active_bytes)")
    # Recorded without history (_record_memory_history(True) of the legacy API keeps 1 entry, enabled="state"
    # none): the trace is the end state only, not the run.
    history = info["allocations"] + info["frees"] + info["skipped_frees"]
    if history <= 1 and info["live_before"] > 1:
        info["warnings"].append(
            "the trace holds %d alloc/free entr%s: the recording kept almost no history, so the trace is "
            "the blocks live at the snapshot, not the run that led there (_record_memory_history(True) keeps 1 entry, "
            "enabled='state' none); record with torch.cuda.memory._record_memory_history(max_entries=1_000_000)"
            % (history, "y" if history == 1 else "ies"))
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
    if info["live_before"]:
        print("  %d allocations (%d bytes) were live when the recording began (allocated before it started, or "
              "max_entries dropped the oldest entries): allocated first" % (info["live_before"], info["live_before_bytes"]),
              file=out)
    if info["skipped_frees"]:
        print("  skipped %d frees of blocks the trace had already freed" % info["skipped_frees"], file=out)
    if info["implicit_frees"]:
        print("  WARNING: %d allocations reused an address whose free is missing; a free was inserted before each"
              % info["implicit_frees"], file=out)
    print("  live at the end: %d allocations, %d bytes" % (info["live_at_end"], info["live_requested"]), file=out)
    print("  peak live requested bytes: %d (%.3f GiB)" % (info["peak_live_requested"], gib), file=out)


def warn(info, out=sys.stderr):
    for w in info["warnings"]:
        print("torch_snapshot_to_rmm: WARNING: %s" % w, file=out)


# ---------------------------------------------------------------------------------------------
# Replay on the simulated device through libexpseg's C API (one subprocess per backend: the C API
# takes its configuration once per process).

def replay_conf(backend, sim_conf):
    conf = "device:sim,sim_capacity:141GiB,backend:%s" % backend
    return conf + "," + sim_conf if sim_conf else conf


def check_replay_conf(backends, sim_conf):
    """Raises ConvertError when --sim-conf holds what expseg refuses (a typo), before anything is
    converted or written. Only configures: this process creates no allocator. A library that cannot
    be loaded, or an EXPSEG_ALLOC_CONF it refuses, is not --sim-conf's fault: those are left to the
    replay, after the trace is written."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import expseg  # tools/expseg.py
    for b in backends:
        try:
            expseg.configure(replay_conf(b, ""))
        except expseg.ExpsegError:
            return
        try:
            expseg.configure(replay_conf(b, sim_conf))
        except expseg.ExpsegError as e:
            raise ConvertError("--sim-conf %r: %s" % (sim_conf, e))


def replay_child(trace_path, backend, sim_conf):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import expseg  # tools/expseg.py
    expseg.configure(replay_conf(backend, sim_conf))
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
        elif action == "allocate failure" and size:
            # Failed when recorded (--oom-events): asked again, as expseg replay does; given straight
            # back if it succeeds now (was: skipped, so the converter's replay never reproduced the OOM).
            p = malloc(size, 0, stream)
            if p:
                free(p, 0, 0, None)
            else:
                ooms += 1
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
            line += "  vs PyTorch's peak: %+.3f%%" % (100.0 * (r["peak_allocated"] - torch_peak_allocated) / torch_peak_allocated)
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
    ap.add_argument("--torch-peak-allocated", type=int, default=None,
                    help="PyTorch's active_bytes.all.peak (torch.cuda.memory_stats()), to compare with --replay's peak "
                         "allocated: the trace frees a block where its free completed, as active_bytes counts it "
                         "(allocated_bytes drops at the free's request: the two differ where frees waited for other "
                         "streams' work)")
    ap.add_argument("--replay-child", nargs=2, metavar=("BACKEND", "TRACE"), help=argparse.SUPPRESS)
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--replay-child"]:  # internal: python3 this.py --replay-child BACKEND TRACE [--sim-conf S]
        sim = argv[argv.index("--sim-conf") + 1] if "--sim-conf" in argv else ""
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import expseg  # tools/expseg.py
        try:
            replay_child(argv[2], argv[1], sim)
        except expseg.ExpsegError as e:  # the parent reports it: a message, not a traceback
            print("expseg: %s" % e, file=sys.stderr)
            return 1
        return 0
    args = ap.parse_args(argv)
    if not args.output and not args.check and not args.replay:
        ap.error("give an output path, --check, or --replay")
    try:
        if args.replay:
            check_replay_conf(args.replay, args.sim_conf)
        snap = load_snapshot(args.snapshot)
        events, info = convert(snap, args.device, args.oom_events)
        warn(info)
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
