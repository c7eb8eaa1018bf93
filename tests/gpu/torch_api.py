#!/usr/bin/env python3
"""PyTorch's memory API works under expseg: the functions PyTorch's pluggable allocator cannot serve answer from
expseg after tools/expseg.py install_torch().

    python3 tests/gpu/torch_api.py

For each backend, in a fresh process under install_torch("backend:<b>"), on the real GPU with the real PyTorch:
  - torch.cuda.memory_allocated/max_memory_allocated/memory_reserved/memory_stats/memory_summary give expseg's
    figures, and follow tensors being made and freed; reset_peak_memory_stats and
    reset_accumulated_memory_stats reset them;
  - torch.cuda.empty_cache() gives expseg's cached memory back (and, during a capture, nothing, without an error);
  - set_per_process_memory_fraction(f) is expseg's limit (an allocation over it raises with verdict limit),
    get_per_process_memory_fraction reads it, 1.0 removes it;
  - Tensor.record_stream(s): a tensor freed while a kernel on s may still use it is not handed out again
    until that kernel is done (expseg holds the block as pending_free);
  - torch.cuda.memory._record_memory_history / _snapshot / _dump_snapshot: PyTorch's snapshot format, which
    PyTorch's own readers (torch.cuda._memory_viz.segsum, .trace) take;
  - CUDA graphs (torch.cuda.graph, a second graph sharing the pool): outputs right at every replay, eager
    tensors made after the capture untouched by replays, the graphs' memory given back once they are gone;
    under a limit, a capture (CUDAGraph.capture_begin) that needs the default stream's cached memory gets it on
    expandable (the capture's stream does not block) and fails with an OOM on split_merge, as in PyTorch.

Exit status: 0 passed, 1 a failure, 77 skipped (no torch, or no CUDA device). The library comes from
$EXPSEG_LIBRARY (else <repo>/build/lib/libexpseg.so).
"""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20


def child(backend, tmp):
    if not __debug__:  # python -O / PYTHONOPTIMIZE strips every assert below: the run would check nothing
        raise SystemExit("%s: the checks are asserts; run without -O and PYTHONOPTIMIZE" % os.path.basename(__file__))
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import pickle
    import expseg
    expseg.install_torch("backend:%s" % backend)
    import torch

    # Stats.
    a = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(3 * MiB + 5, dtype=torch.uint8, device="cuda")
    s = expseg.stats()
    assert torch.cuda.memory_allocated() == s["allocated_bytes.all.current"] >= 67 * MiB, torch.cuda.memory_allocated()
    assert torch.cuda.memory_reserved() == s["reserved_bytes.all.current"], torch.cuda.memory_reserved()
    requested = torch.cuda.memory_stats()["requested_bytes.all.current"]
    assert requested == s["requested_bytes.all.current"] >= 67 * MiB + 5, requested
    summary = torch.cuda.memory_summary()
    assert "Allocated memory" in summary and "GPU reserved memory" in summary, summary[:400]
    peak = torch.cuda.max_memory_allocated()
    del a
    assert torch.cuda.memory_allocated() < peak == torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    torch.cuda.reset_accumulated_memory_stats()
    st = torch.cuda.memory_stats()
    assert st["allocation.all.freed"] == 0 and st["allocation.all.allocated"] == 0 and st["allocation.all.current"] >= 1, st
    c = torch.empty(1 * MiB, dtype=torch.uint8, device="cuda")  # the region's one allocation, as PyTorch counts it
    st = torch.cuda.memory_stats()
    assert st["allocation.all.allocated"] == 1 and st["allocated_bytes.all.allocated"] == 1 * MiB, st
    del c

    # empty_cache gives the cached 64 MiB back.
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < reserved - 60 * MiB, (reserved, torch.cuda.memory_reserved())

    # Memory fraction = expseg's limit.
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.02)
    limit, dev_total = expseg.get_limit()
    assert dev_total == total and limit == int(0.02 * total), (limit, dev_total, total)
    assert abs(torch.cuda.get_per_process_memory_fraction() - 0.02) < 1e-9
    try:
        torch.empty(int(0.03 * total), dtype=torch.uint8, device="cuda")
    except RuntimeError as e:
        assert "expseg verdict: limit" in str(e), str(e)[:600]
        print("torch_api %s: the OOM surfaces as %s.%s" % (backend, type(e).__module__, type(e).__name__), flush=True)
    else:
        raise AssertionError("an allocation over set_per_process_memory_fraction(0.02) did not raise")
    torch.cuda.set_per_process_memory_fraction(1.0)
    assert expseg.get_limit()[0] == 0 and torch.cuda.get_per_process_memory_fraction() == 1.0
    big = torch.empty(int(0.03 * total), dtype=torch.uint8, device="cuda")
    del big

    # record_stream: the block waits for the other stream's kernel.
    side = torch.cuda.Stream()
    # A long kernel keeps the side stream busy for about 1 s, then 4 s, 16 s: a slow host that takes
    # longer than that to get to the checks below tries again, longer (the check needs it still busy).
    for cycles in (2_000_000_000, 8_000_000_000, 32_000_000_000):
        t = torch.ones(8 * MiB, dtype=torch.uint8, device="cuda")
        ptr = t.untyped_storage().data_ptr()
        t.add_(1)  # the first launch of a kernel loads it, which waits for the device: not while side must be busy
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
            t.add_(1)
            side_done = torch.cuda.Event()
            side_done.record(side)
        t.record_stream(side)
        del t
        states = {int(blk["address"], 16): blk["state"] for seg in expseg.snapshot()["segments"] for blk in seg["blocks"]}
        u = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        if side_done.query():  # finished too early to tell: again, longer
            torch.cuda.synchronize()
            del u
            continue
        assert states.get(ptr) == "pending_free", states.get(ptr)
        assert u.untyped_storage().data_ptr() != ptr, "memory still used by the side stream was handed out again"
        torch.cuda.synchronize()
        del u
        break
    else:
        raise AssertionError("the side stream's kernel finished before the checks three times (16 s the longest)")

    # Memory history and snapshots in PyTorch's format.
    torch.cuda.memory._record_memory_history(max_entries=100000)
    x = torch.empty(5 * MiB + 7, dtype=torch.uint8, device="cuda")
    y = torch.empty(1000, dtype=torch.uint8, device="cuda")
    del y
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live = [blk["requested_size"] for seg in snap["segments"] for blk in seg["blocks"] if blk["state"] == "active_allocated"]
    assert 5 * MiB + 7 in live, live
    trace = snap["device_traces"][0]
    assert [e["size"] for e in trace if e["action"] == "alloc"][-2:] == [5 * MiB + 7, 1000], trace[-6:]
    assert trace[-1]["action"] == "free_completed" and trace[-1]["size"] == 1000, trace[-1]
    assert {seg["is_expandable"] for seg in snap["segments"]} == {backend == "expandable"}
    assert len(torch.cuda.memory_snapshot()) == len(snap["segments"])
    path = os.path.join(tmp, "snapshot-%s.pickle" % backend)
    torch.cuda.memory._dump_snapshot(path)
    with open(path, "rb") as f:
        assert pickle.load(f)["segments"], path
    from torch.cuda import _memory_viz  # PyTorch's own readers (segsum checks that blocks tile each segment)
    summary = _memory_viz.segsum(snap)
    assert "segments: %d" % len(snap["segments"]) in summary, summary[-400:]
    assert "del " in _memory_viz.trace(snap)
    del x

    # CUDA graphs: the capture's memory comes from an expseg graph pool, so replays leave later tensors alone.
    # Everything on one capture stream, where a cache without graph pools hands a graph's freed intermediates
    # to the next tensors of that stream (a later graph's output, eager tensors), which every replay of the
    # first graph then overwrites.
    static_x = torch.randn(1 << 20, device="cuda")
    cap = torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap):  # warm-up, as PyTorch's docs ask
        for _ in range(2):
            (static_x * 2).relu().sum()
    torch.cuda.current_stream().wait_stream(cap)
    fork = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=cap):
        tmp = static_x * 2           # intermediates, freed during the capture
        tmp2 = tmp.relu() + 1
        freed_on_cap = {tmp.data_ptr(), tmp2.data_ptr()}
        del tmp
        static_y = tmp2 * 3
        del tmp2
        fork.wait_stream(cap)        # a stream the capture forks to: its allocations belong to the graph too
        with torch.cuda.stream(fork):
            forked = static_x + 2
            # As PyTorch's private pools (blocks keyed by stream): the fork gets none of the blocks freed on cap.
            assert forked.data_ptr() not in freed_on_cap, "the forked stream got a block freed on the capture stream"
            static_v = forked * 5
            del forked
        cap.wait_stream(fork)
    pool = graph.pool()
    # A second graph shares the pool (pool=), as torch.cuda.make_graphed_callables does; a third has its own.
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2, pool=pool, stream=cap):
        static_z = static_y + 1
    graph3 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph3, stream=cap):
        static_w = static_x - 5
        # As PyTorch's empty_cache() while a capture is underway: nothing given back, no error, the capture
        # intact (was: RuntimeError, expseg refusing to synchronize during the capture).
        torch.cuda.empty_cache()
    eager = []
    for stream in (cap, fork):  # eager tensors after the captures, on the streams the captures used
        with torch.cuda.stream(stream):
            for _ in range(4):
                eager.append(torch.full((1 << 20,), float(len(eager)), device="cuda"))
        torch.cuda.current_stream().wait_stream(stream)
    for step in range(3):
        static_x.copy_(torch.randn(1 << 20, device="cuda"))
        graph3.replay()
        graph.replay()
        graph2.replay()
        torch.cuda.synchronize()
        want = ((static_x * 2).relu() + 1) * 3
        assert torch.equal(static_y, want), "graph output wrong at replay %d" % step
        assert torch.equal(static_z, want + 1), "second graph's output wrong at replay %d" % step
        assert torch.equal(static_w, static_x - 5), "third graph's output overwritten at replay %d" % step
        assert torch.equal(static_v, (static_x + 2) * 5), "forked stream's output wrong at replay %d" % step
        for i, t in enumerate(eager):
            assert bool((t == float(i)).all()), "replay %d overwrote eager tensor %d" % (step, i)
    reserved_with_graphs = torch.cuda.memory_reserved()
    del graph, graph2, graph3, static_y, static_z, static_w, static_v, eager
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < reserved_with_graphs, (torch.cuda.memory_reserved(), reserved_with_graphs)
    assert float(torch.ones(1000, device="cuda").sum()) == 1000.0

    # Under a limit, a capture needs memory the default stream cached. torch.cuda.graph empties the cache before
    # it captures; CUDAGraph.capture_begin does not. The glue asks expseg before the capture whether the capture's
    # stream blocks (a torch.cuda.Stream does not): expandable then takes the default stream's idle memory back
    # during the capture (the legacy stream's synchronization is permitted while a non-blocking stream
    # captures); split_merge gives nothing back during a capture, as PyTorch, and the request fails.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 1024 * MiB) / total)
    cached = torch.empty(600 * MiB, dtype=torch.uint8, device="cuda")
    cached.fill_(3)
    held = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
    del cached  # 600 MiB cached for the default stream, its fill maybe still queued
    cap2 = torch.cuda.Stream()
    graph4 = torch.cuda.CUDAGraph()
    failure = None
    with torch.cuda.stream(cap2):
        graph4.capture_begin()
        try:
            big = torch.empty(800 * MiB, dtype=torch.uint8, device="cuda")
            big.fill_(7)
        except RuntimeError as e:
            failure = str(e)
        finally:
            graph4.capture_end()
    if backend == "expandable":
        assert failure is None, failure
        big.zero_()
        graph4.replay()
        torch.cuda.synchronize()
        for part in (big[:MiB], big[400 * MiB:401 * MiB], big[-MiB:]):  # small reads: the limit still holds
            assert int(part.sum()) == 7 * MiB, int(part.sum())
        del big
    else:
        assert failure is not None and "out of memory" in failure, failure
    del graph4, held
    gc.collect()
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    print("torch_api %s: PASS (memory_stats/allocated/reserved/summary, peak and accumulated resets, empty_cache, "
          "memory fraction, record_stream, memory history + snapshot in PyTorch's format, CUDA graphs in expseg graph pools, "
          "a capture under a limit)" % backend, flush=True)


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return 0
    try:
        import torch
    except ImportError:
        print("torch_api: SKIPPED (no torch)")
        return 77
    if not torch.cuda.is_available():
        # Skipped only where there is no GPU to test: a machine with an NVIDIA device whose driver
        # torch cannot use is a failure (as a skip it would pass unseen on the GPU machines).
        if os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia/gpus"):
            print("torch_api: FAILED (an NVIDIA device is present, but torch.cuda.is_available() is False)")
            return 1
        print("torch_api: SKIPPED (no CUDA device)")
        return 77
    import shutil
    import tempfile
    tmp = tempfile.mkdtemp(prefix="expseg-torch-api-")
    failed = 0
    child_env = {k: v for k, v in os.environ.items() if k != "PYTHONOPTIMIZE"}  # the child's asserts must run
    for backend in ("split_merge", "expandable"):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", backend, tmp], timeout=300,
                           env=child_env)
        if r.returncode != 0:
            print("torch_api %s: FAIL (exit %d)" % (backend, r.returncode), flush=True)
            failed += 1
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
