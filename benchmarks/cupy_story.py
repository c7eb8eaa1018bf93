#!/usr/bin/env python3
"""The 800/500/300 story through CuPy, on expseg and on CuPy's own pool, under a 2064 MiB limit (issue 5).

A 2000 MiB array is allocated and freed; 800, 500 and 300 MiB arrays are allocated and the 500 freed; then
800 MiB is asked for. 900 MiB is cached but no contiguous 800 MiB exists, and the limit forbids a new segment.
One subprocess per variant:
  expseg-expandable   tools/expseg.py install_cupy("backend:expandable,limit:2064MiB")              expect: succeeds
  expseg-cupy-policy  install_cupy("backend:split_merge,policy:cupy,limit:2064MiB")                 expect: CuPy's OOM
  cupy-pool           CuPy's own pool: cupy.get_default_memory_pool().set_limit(size=2064 MiB)      expect: OOM
What CuPy 14.2 printed on an H200: "Out of memory allocating 838,860,800 bytes (allocated so far:
2,097,152,000 bytes, limit set to: 2,164,260,864 bytes)."

Usage (after `meson setup build && ninja -C build`): python3 benchmarks/cupy_story.py   (~30 s)
Exit status 0 when every variant behaves as expected.
"""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")
MiB = 1 << 20
LIMIT = 2064 * MiB
RESULT_TAG = "CUPY_STORY_RESULT "

VARIANTS = {  # name -> (expseg configuration or None for CuPy's pool, expected to succeed)
    "expseg-expandable": ("backend:expandable,limit:2064MiB", True),
    "expseg-cupy-policy": ("backend:split_merge,policy:cupy,limit:2064MiB", False),
    "cupy-pool": (None, False),
}


def child(variant):
    conf, _ = VARIANTS[variant]
    expseg = None
    if conf is not None:
        sys.path.insert(0, TOOLS)
        import expseg  # tools/expseg.py
        expseg.install_cupy(conf)  # before CuPy's first allocation
    import cupy as cp
    pool = None
    if conf is None:
        pool = cp.get_default_memory_pool()
        pool.set_limit(size=LIMIT)

    big = cp.empty(2000 * MiB, dtype=cp.uint8)
    del big
    a = cp.empty(800 * MiB, dtype=cp.uint8)
    b = cp.empty(500 * MiB, dtype=cp.uint8)
    c = cp.empty(300 * MiB, dtype=cp.uint8)
    del b
    d = None
    try:
        d = cp.empty(800 * MiB, dtype=cp.uint8)
        d.fill(7)  # touch it: the memory must be usable
        cp.cuda.runtime.deviceSynchronize()
        ok, msg, exc = True, "", ""
    except cp.cuda.memory.OutOfMemoryError as e:
        ok, msg, exc = False, str(e), type(e).__module__ + "." + type(e).__name__
    res = dict(variant=variant, ok=ok, exception=exc, message=msg, cupy=cp.__version__)
    if expseg is not None:
        s = expseg.stats()
        res.update(allocator="expseg " + expseg.config(), allocated=s["allocated_bytes.all.current"],
                   reserved=s["reserved_bytes.all.current"], peak_reserved=s["reserved_bytes.all.peak"])
        if not ok:
            rep = expseg.oom_report_json() or {}
            res.update(verdict=rep.get("verdict"), counterfactual=rep.get("counterfactual"))
    else:
        res.update(allocator="cupy MemoryPool, set_limit(%d)" % LIMIT, allocated=pool.used_bytes(), reserved=pool.total_bytes())
    del a, c, d
    if expseg is not None:
        # CuPy passes the allocator no stream: expseg must still allocate for CuPy's current stream.
        s1 = cp.cuda.Stream()
        with s1:
            x = cp.empty(4 * MiB, dtype=cp.uint8)
            x.fill(1)
        on = [int(blk["stream"], 16) for seg in expseg.snapshot()["segments"] for blk in seg["blocks"]
              if int(blk["address"], 16) == x.data.ptr]
        res.update(stream_ok=on == [s1.ptr], stream_seen=on, stream_expected=s1.ptr)
        s1.synchronize()
        del x
    print(RESULT_TAG + json.dumps(res), flush=True)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return 0
    if len(sys.argv) > 1:
        print(__doc__)
        return 2
    sys.path.insert(0, TOOLS)
    import expseg  # only to find the library before starting the runs
    try:
        lib = expseg.library_path()
        expseg.load()
    except expseg.ExpsegError as e:
        raise SystemExit("cupy_story.py: %s" % e)
    env = {k: v for k, v in os.environ.items() if k not in ("EXPSEG_ALLOC_CONF", "CUPY_GPU_MEMORY_LIMIT")}
    if os.path.isfile(lib):
        env["EXPSEG_LIBRARY"] = os.path.abspath(lib)
    print("expseg library: %s" % lib)
    results = {}
    for v in VARIANTS:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", v], env=env, capture_output=True,
                           text=True, timeout=300)
        lines = [l for l in p.stdout.splitlines() if l.startswith(RESULT_TAG)]
        if not lines:
            print("%-20s FAILED (exit %d)\n%s" % (v, p.returncode, (p.stderr or p.stdout)[-3000:]))
            results[v] = None
            continue
        results[v] = json.loads(lines[-1][len(RESULT_TAG):])

    all_ok = True
    print()
    for v, (conf, expect_ok) in VARIANTS.items():
        r = results[v]
        if r is None:
            all_ok = False
            continue
        good = r["ok"] == expect_ok and r.get("stream_ok", True)
        if not r.get("stream_ok", True):
            print("FAIL  %-20s allocated for stream %s, CuPy's current stream was %#x" % (v, r["stream_seen"], r["stream_expected"]))
        all_ok = all_ok and good
        print("%s  %-20s %s (expected: %s)  [%s]" % ("PASS" if good else "FAIL", v, "succeeded" if r["ok"] else "OOM",
              "succeeds" if expect_ok else "OOM", r["allocator"]))
        print("      allocated %d, reserved %d%s" % (r["allocated"], r["reserved"],
              ", verdict %s, %s backend: %s" % (r.get("verdict"), "expandable", r.get("counterfactual")) if r.get("verdict") else ""))
        if r["message"]:
            print("      " + r["exception"] + ": " + r["message"].replace("\n", "\n      "))
    ours, theirs = results.get("expseg-cupy-policy"), results.get("cupy-pool")
    if ours and theirs and not ours["ok"] and not theirs["ok"]:
        same = ours["message"].split("\n")[0] == theirs["message"].split("\n")[0]
        print("\nexpseg policy:cupy's first line %s CuPy's own message" % ("is identical to" if same else "differs from"))
    print("\n%s" % ("ALL AS EXPECTED" if all_ok else "SOME VARIANTS DID NOT BEHAVE AS EXPECTED"))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
