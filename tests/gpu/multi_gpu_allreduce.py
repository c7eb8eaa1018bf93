#!/usr/bin/env python3
"""NCCL all-reduce on 2 GPUs of tensors allocated through expseg (issue 8).

    python3 tests/gpu/multi_gpu_allreduce.py [--backend split_merge|expandable|both] [--timeout S]

One process per GPU (torch.multiprocessing.spawn, world size 2); each rank makes expseg PyTorch's CUDA
allocator with tools/expseg.py install_torch(conf) before any CUDA tensor exists, allocates tensors of
several sizes and dtypes, checks that each one is an allocated block of expseg's allocator (snapshot),
all-reduces them with NCCL (SUM) and checks the exact sum. Each backend ('backend:split_merge',
'backend:expandable') runs in a fresh set of processes of its own. NVLink multicast stays off
(NCCL_NVLS_ENABLE=0): on a shared host it can put the GPUs out of service.

Prints PASS/FAIL per backend and a summary. Exit status: 0 all passed, 1 a failure, 77 skipped (fewer than 2
GPUs, or no torch); the library comes from $EXPSEG_LIBRARY (else <repo>/build/lib/libexpseg.so).
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import traceback

# Keep NVLink multicast off, also for the processes started below (they inherit the environment).
for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    if os.environ.get(_key) != _value:
        if _key in os.environ:
            print("multi_gpu_allreduce: forcing %s=%s (was %r)" % (_key, _value, os.environ[_key]), flush=True)
        os.environ[_key] = _value

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

WORLD = 2
SKIP = 77
# Elements per tensor: a small-pool block, odd sizes, and > 64 MiB of float32 (a large block, and under
# expandable several physical handles once the allocator is warm).
SIZES = [1, 1000, 256 * 1024 + 3, 17 * 1024 * 1024 + 5]
BACKENDS = {"split_merge": "backend:split_merge", "expandable": "backend:expandable"}


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def allocated_blocks(expseg_mod, device):
    """Addresses of the blocks expseg's allocator on `device` has handed out (snapshot)."""
    blocks = set()
    for seg in expseg_mod.snapshot(device).get("segments", []):
        for b in seg.get("blocks", []):
            if b.get("state") == "allocated":
                blocks.add(int(b["address"], 16))
    return blocks


def rank_main(rank, world, conf, port):
    """One rank: runs in a process of its own (spawn), on GPU `rank`."""
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0", "NCCL_NVLS_ENABLE must stay 0"
    import expseg
    expseg.install_torch(conf)  # first: before anything touches CUDA
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    kwargs = dict(backend="nccl", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    try:
        dist.init_process_group(device_id=torch.device("cuda", rank), **kwargs)
    except TypeError:  # older PyTorch: no device_id
        dist.init_process_group(**kwargs)
    errors = []
    try:
        cfg = expseg.config(rank)
        if conf not in cfg:
            errors.append("rank %d: expseg's allocator for device %d has config %r, not %r" % (rank, rank, cfg, conf))
        # sum over ranks r of (base * (r + 1) + r)
        scale = world * (world + 1) // 2
        shift = world * (world - 1) // 2
        for n in SIZES:
            for dtype in (torch.float32, torch.int64):
                base = torch.arange(n, device="cuda", dtype=torch.int64) % 1000
                x = (base * (rank + 1) + rank).to(dtype)
                torch.cuda.synchronize()
                if x.data_ptr() not in allocated_blocks(expseg, rank):
                    errors.append("rank %d: tensor of %d %s at 0x%x is not an allocation of expseg's allocator"
                                  % (rank, n, dtype, x.data_ptr()))
                dist.all_reduce(x, op=dist.ReduceOp.SUM)
                expected = (base * scale + shift).to(dtype)
                torch.cuda.synchronize()
                if not torch.equal(x, expected):
                    bad = (x != expected).nonzero()
                    i = int(bad[0, 0]) if bad.numel() else -1
                    errors.append("rank %d: all_reduce of %d %s: %d wrong elements, first at %d: %s != %s"
                                  % (rank, n, dtype, bad.shape[0], i, x[i].item(), expected[i].item()))
                del x, expected, base
        stats = expseg.stats(rank)
        peak = stats.get("allocated_bytes.all.peak", 0)
        if peak < SIZES[-1] * 8:
            errors.append("rank %d: expseg's allocated_bytes.all.peak is %d, less than the largest tensor: the tensors "
                          "did not come from expseg" % (rank, peak))
        print("rank %d (%s): %d all-reduces checked; expseg on device %d: allocated peak %d B, reserved peak %d B"
              % (rank, conf, 2 * len(SIZES), rank, peak, stats.get("reserved_bytes.all.peak", 0)), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if errors:
        raise RuntimeError("\n".join(errors))


def run_one(backend):
    """Both ranks for one backend, in this process (a fresh one per backend: see main)."""
    import torch.multiprocessing as mp
    conf = BACKENDS[backend]
    port = free_port()
    try:
        mp.spawn(rank_main, args=(WORLD, conf, port), nprocs=WORLD, join=True)
    except Exception:  # noqa: BLE001 - any failure of a rank is the test's failure
        traceback.print_exc()
        print("FAIL: all-reduce with %s" % conf, flush=True)
        return 1
    print("PASS: all-reduce with %s on %d GPUs" % (conf, WORLD), flush=True)
    return 0


def gpu_count():
    """Visible GPUs, without initialising CUDA in this process (the ranks are spawned, not forked)."""
    import torch
    return torch.cuda.device_count()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["split_merge", "expandable", "both"], default="both")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per backend run (default 300)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # internal: run one backend here
    args = parser.parse_args()
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print("SKIPPED: multi_gpu_allreduce needs PyTorch (%s)" % e, flush=True)
        return SKIP
    if args.one:
        return run_one(args.backend)
    n = gpu_count()
    if n < WORLD:
        print("SKIPPED: multi_gpu_allreduce needs %d GPUs, %d visible" % (WORLD, n), flush=True)
        return SKIP
    backends = ["split_merge", "expandable"] if args.backend == "both" else [args.backend]
    results = {}
    for b in backends:
        start = time.time()
        # A process group of its own, so that a hung run is killed with the ranks it spawned.
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--one", "--backend", b],
                                start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
            results[b] = "PASS" if code == 0 else "FAIL (exit %d)" % code
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            results[b] = "FAIL (timed out after %d s: NCCL hang?)" % args.timeout
        print("multi_gpu_allreduce: backend:%s %s in %.1f s" % (b, results[b], time.time() - start), flush=True)
    print("multi_gpu_allreduce summary: " + ", ".join("backend:%s %s" % kv for kv in results.items()), flush=True)
    ok = all(v == "PASS" for v in results.values())
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
