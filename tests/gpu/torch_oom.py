#!/usr/bin/env python3
"""An OOM inside PyTorch under expseg raises torch.cuda.OutOfMemoryError with expseg's report, and PyTorch goes on.

    python3 tests/gpu/torch_oom.py

For each backend, in a fresh process: tools/expseg.py install_torch("backend:<b>,limit:3GiB") before any
CUDA tensor exists; a matmul; 800 MiB kept live; torch.empty(4 GiB) must raise torch.cuda.OutOfMemoryError
(RuntimeError where libexpseg_torch.so was not built for this PyTorch; with EXPSEG_REQUIRE_TORCH_LIBRARY=1,
as meson and gpu_session.sh set where they built it, only torch.cuda.OutOfMemoryError passes) whose message
starts with PyTorch's first sentence and holds expseg's verdict (limit); then allocations and a kernel must still work
and expseg's stats must show the live tensors. The OOM also goes through expseg.on_oom (the callback sees
the report before PyTorch raises) and oom_dump with record:true (the dump file holds the report and a
snapshot with the 800 MiB tensor; its trace ends with the failed 4 GiB request). (PyTorch's pluggable allocator does not check malloc's result
for NULL: without the throwing expseg_torch_malloc the OOM would hand out a tensor at address 0.)

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
    import json
    import expseg
    expseg.install_torch("backend:%s,limit:3GiB,record:true,oom_dump:%s/oom-%%p-%%n.json" % (backend, tmp))
    seen = []
    expseg.on_oom(lambda rep: seen.append(rep))
    import torch
    x = torch.randn(2048, 2048, device="cuda")
    expected = float((x.double() @ x.double()).sum())
    got = float((x @ x).double().sum())
    assert abs(got - expected) <= 1e-3 * max(1.0, abs(expected)), (got, expected)
    oom_error = expseg.torch_oom_error()
    if os.environ.get("EXPSEG_REQUIRE_TORCH_LIBRARY") == "1":  # libexpseg_torch.so was built for this PyTorch
        assert oom_error is torch.cuda.OutOfMemoryError, oom_error
    else:
        assert oom_error in (torch.cuda.OutOfMemoryError, RuntimeError), oom_error
    keep = torch.empty(800 * MiB, dtype=torch.uint8, device="cuda")
    try:
        torch.empty(4096 * MiB, dtype=torch.uint8, device="cuda")
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
        assert type(e) is oom_error, (type(e), oom_error)
        msg = str(e)
        assert msg.startswith("CUDA out of memory. Tried to allocate 4.00 GiB"), msg[:300]
        assert "expseg verdict: limit" in msg, msg[:600]
    else:
        raise AssertionError("torch.empty(4 GiB) under a 3 GiB limit did not raise")
    assert len(seen) == 1 and seen[0]["requested_bytes"] == 4096 * MiB, [r.get("requested_bytes") for r in seen]
    path = os.path.join(tmp, "oom-%d-1.json" % os.getpid())
    assert seen[0]["dump_path"] == path, seen[0]["dump_path"]
    assert "written to " + path in msg, msg[-600:]
    with open(path) as f:
        dump = json.load(f)
    assert dump["report"]["verdict"] == "limit", dump["report"]["verdict"]
    live = [b["requested"] for seg in dump["snapshot"]["segments"] for b in seg["blocks"] if b["state"] == "allocated"]
    assert 800 * MiB in live, live
    with open(dump["trace"]) as f:
        last = f.read().splitlines()[-1].split(",")
    assert last[2] == "allocate failure" and int(last[4]) == 4096 * MiB, last
    after = torch.ones(1 << 20, device="cuda")
    assert float(after.sum()) == float(1 << 20)
    s = expseg.stats()
    assert s["num_ooms"] == 1, s["num_ooms"]
    assert s["allocated_bytes.all.current"] >= 800 * MiB + (4 << 20), s["allocated_bytes.all.current"]
    del keep, after, x
    torch.cuda.synchronize()
    recovery = check_cudnn_recovery(torch, expseg, oom_error)
    print("torch_oom %s: PASS (%s with the report, on_oom called, oom_dump written; allocations and "
          "kernels work afterwards; %s)" % (backend, "torch.cuda.OutOfMemoryError" if oom_error is not RuntimeError
                                            else "RuntimeError", recovery),
          flush=True)


def check_cudnn_recovery(torch, expseg, oom_error):
    """PyTorch's own OOM recovery: cuDNN's convolutions catch c10::OutOfMemoryError when an algorithm's workspace
    does not fit, and go on with one that needs less (aten/src/ATen/native/cudnn/Conv_v8.cpp). A convolution's
    backward pass whose first algorithm wants a large workspace (8x512x32x32 fp32, 3x3: 1.13 GiB with cuDNN 9.19),
    under a limit that holds its tensors but not that workspace: with libexpseg_torch.so it must complete, after
    at least one OOM (else the recovery was not exercised: a failure), with the gradients of an unlimited run.
    Without that library the OOM is a RuntimeError that cuDNN lets through: reported, not required."""
    MiB = 1 << 20
    torch.backends.cudnn.allow_tf32 = False  # the recovered algorithm's gradients match the first's closely
    torch.manual_seed(0)
    x = torch.randn(8, 512, 32, 32, device="cuda")
    conv = torch.nn.Conv2d(512, 512, 3, padding=1).cuda()

    def backward():
        xx = x.detach().requires_grad_(True)
        conv(xx).backward(torch.ones(8, 512, 32, 32, device="cuda"))
        grads = (xx.grad, conv.weight.grad)
        conv.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return grads

    expseg.set_limit(0)
    want = [g.double().cpu() for g in backward()]
    torch.cuda.empty_cache()
    expseg.reset_peak_stats()
    before = expseg.stats()["allocated_bytes.all.current"]
    backward()
    extra = expseg.stats()["allocated_bytes.all.peak"] - before  # the pass's tensors and its workspace
    torch.cuda.empty_cache()
    s = expseg.stats()
    ooms = s["num_ooms"]
    expseg.set_limit(s["reserved_bytes.all.current"] + int(0.6 * extra) // (2 * MiB) * 2 * MiB)
    try:
        got = backward()
    except RuntimeError as e:
        assert oom_error is RuntimeError, "cuDNN did not recover from the OOM: %s: %s" % (type(e).__name__, str(e)[:300])
        return "cuDNN's OOM recovery did not run (RuntimeError: %s)" % str(e).splitlines()[0][:80]
    finally:
        expseg.set_limit(0)
    failed = expseg.stats()["num_ooms"] - ooms
    assert failed >= 1, ("the limit left room for the first algorithm's workspace (%d MiB extra): the recovery was "
                         "not exercised" % (extra // MiB))
    for g, w in zip(got, want):
        err = float((g.double().cpu() - w).abs().max())
        assert err <= 1e-3 * max(1.0, float(w.abs().max())), err
    return "cuDNN recovered from %d OOMs of its workspace, same gradients" % failed


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return 0
    try:
        import torch
    except ImportError:
        print("torch_oom: SKIPPED (no torch)")
        return 77
    if not torch.cuda.is_available():
        # Skipped only where there is no GPU to test: a machine with an NVIDIA device whose driver
        # torch cannot use is a failure (as a skip it would pass unseen on the GPU machines).
        if os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia/gpus"):
            print("torch_oom: FAILED (an NVIDIA device is present, but torch.cuda.is_available() is False)")
            return 1
        print("torch_oom: SKIPPED (no CUDA device)")
        return 77
    failed = 0
    import tempfile
    tmp = tempfile.mkdtemp(prefix="expseg-torch-oom-")
    child_env = {k: v for k, v in os.environ.items() if k != "PYTHONOPTIMIZE"}  # the child's asserts must run
    for backend in ("split_merge", "expandable"):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", backend, tmp], timeout=300,
                           env=child_env)
        if r.returncode != 0:
            print("torch_oom %s: FAIL (exit %d)" % (backend, r.returncode), flush=True)
            failed += 1
    if not failed:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)  # kept when a child failed: the dumps are the evidence
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
