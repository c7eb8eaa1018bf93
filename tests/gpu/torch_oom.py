#!/usr/bin/env python3
"""An OOM inside PyTorch under expseg raises RuntimeError with expseg's report, and PyTorch goes on.

    python3 tests/gpu/torch_oom.py

For each backend, in a fresh process: tools/expseg.py install_torch("backend:<b>,limit:3GiB") before any
CUDA tensor exists; a matmul; 800 MiB kept live; torch.empty(4 GiB) must raise RuntimeError whose message
holds PyTorch's first sentence and expseg's verdict (limit); then allocations and a kernel must still work
and expseg's stats must show the live tensors. (PyTorch's pluggable allocator does not check malloc's result
for NULL: without the throwing expseg_torch_malloc the OOM would hand out a tensor at address 0.)

Exit status: 0 passed, 1 a failure, 77 skipped (no torch, or no CUDA device). The library comes from
$EXPSEG_LIBRARY (else <repo>/build/lib/libexpseg.so).
"""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20


def child(backend):
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import expseg
    expseg.install_torch("backend:%s,limit:3GiB" % backend)
    import torch
    x = torch.randn(2048, 2048, device="cuda")
    expected = float((x.double() @ x.double()).sum())
    got = float((x @ x).double().sum())
    assert abs(got - expected) <= 1e-3 * max(1.0, abs(expected)), (got, expected)
    keep = torch.empty(800 * MiB, dtype=torch.uint8, device="cuda")
    try:
        torch.empty(4096 * MiB, dtype=torch.uint8, device="cuda")
    except RuntimeError as e:
        msg = str(e)
        assert "Tried to allocate 4.00 GiB" in msg, msg[:300]
        assert "expseg verdict: limit" in msg, msg[:600]
    else:
        raise AssertionError("torch.empty(4 GiB) under a 3 GiB limit did not raise")
    after = torch.ones(1 << 20, device="cuda")
    assert float(after.sum()) == float(1 << 20)
    s = expseg.stats()
    assert s["num_ooms"] == 1, s["num_ooms"]
    assert s["allocated_bytes.all.current"] >= 800 * MiB + (4 << 20), s["allocated_bytes.all.current"]
    del keep, after, x
    torch.cuda.synchronize()
    print("torch_oom %s: PASS (RuntimeError with the report; allocations and kernels work afterwards)" % backend,
          flush=True)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return 0
    try:
        import torch
    except ImportError:
        print("torch_oom: SKIPPED (no torch)")
        return 77
    if not torch.cuda.is_available():
        print("torch_oom: SKIPPED (no CUDA device)")
        return 77
    failed = 0
    for backend in ("split_merge", "expandable"):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", backend], timeout=300)
        if r.returncode != 0:
            print("torch_oom %s: FAIL (exit %d)" % (backend, r.returncode), flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
