#!/usr/bin/env python3
"""torch.compile(mode="reduce-overhead") under expseg: PyTorch's CUDA graph trees allocate through expseg's
graph pools (tools/expseg.py, _GraphTrees).

    python3 tests/gpu/torch_compile.py

For each backend, in a fresh process under install_torch("backend:<b>"), on the real GPU with the real PyTorch:
  - inference: a compiled function called with new values each step (warm-up, recording, replays) gives what
    eager PyTorch gives, and its graphs are not skipped;
  - training: a compiled model's forward and backward (warm-up, recording, replays), losses as eager's;
  - after replays, a function the trees never warmed up, called on a replayed output, makes the trees put the pool
    back to a checkpoint (setCheckpointPoolState); every output is right, and the replayed output the new
    function reads is not overwritten by the memory it allocates;
  - PyTorch's own checks of the trees' bookkeeping against the pool (slow_path_cudagraph_asserts, on by
    default) run on expseg's pool blocks and pass.

Exit status: 0 passed, 1 a failure, 77 skipped (no torch, no CUDA device, or no compiler for Triton). The library
comes from $EXPSEG_LIBRARY (else <repo>/build/lib/libexpseg.so).
"""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(backend):
    if not __debug__:
        raise SystemExit("%s: the checks are asserts; run without -O and PYTHONOPTIMIZE" % os.path.basename(__file__))
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import expseg
    expseg.install_torch("backend:%s" % backend)
    import torch
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    assert inductor_config.triton.cudagraph_trees and inductor_config.triton.slow_path_cudagraph_asserts
    trees = torch.cuda.CUDAGraph._expseg_trees
    torch.manual_seed(0)

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-3, atol=1e-2)

    # Inference.
    def f(x, w):
        y = torch.relu(x @ w) + 1.0
        return (y * 2).sum(dim=1), y

    x = torch.randn(256, 512, device="cuda")
    w = torch.randn(512, 512, device="cuda") / 16
    cf = torch.compile(f, mode="reduce-overhead")
    for step in range(6):
        xi = x * (step + 1)
        got = cf(xi, w)
        want = f(xi, w)
        assert all(close(a, b) for a, b in zip(got, want)), "inference step %d differs from eager" % step
    assert trees.calls["get_checkpoint"] >= 1 and trees.calls["begin"] >= 1 and trees.calls["check"] >= 1, trees.calls
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])

    # Training: forward and backward graphs.
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    eager_model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    eager_model.load_state_dict(model.state_dict())
    compiled = torch.compile(model, mode="reduce-overhead")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.01)
    for step in range(5):
        xb = torch.randn(64, 512, device="cuda")
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(xb).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        eager_loss = eager_model(xb).square().mean()
        eager_loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        assert abs(float(loss) - float(eager_loss)) <= 1e-3 * max(1.0, abs(float(eager_loss))), (step, float(loss), float(eager_loss))

    # After replays, a function never warmed up, on a replayed output: the trees put the pool back to a checkpoint.
    def g(y):
        return y * 3 - 1

    def h(y):
        big = torch.ones(64, 1 << 20, device="cuda")  # 256 MiB of intermediates in the pool
        return (y[:, :64] @ big[:, :64 * 1024].reshape(64, 64, 1024)[0]).sum(dim=1) + y.sum(dim=1)

    cg = torch.compile(g, mode="reduce-overhead")
    ch = torch.compile(h, mode="reduce-overhead")
    base = torch.randn(256, 512, device="cuda")
    for step in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        out = cg(base + step)
        assert close(out, g(base + step)), "g at step %d" % step
    before = trees.calls["set_checkpoint"]
    for step in range(5):
        torch.compiler.cudagraph_mark_step_begin()
        out = cg(base + step)
        kept = out.clone()
        got = ch(out)
        assert close(got, h(kept)), "h at step %d" % step
        assert torch.equal(out, kept), "the replayed output g gave was overwritten at step %d" % step
    assert trees.calls["set_checkpoint"] > before, trees.calls
    # Once the trees are gone and the outputs with them, every block the glue restored has been freed.
    del out, kept, got, cf, cg, ch, compiled
    torch._dynamo.reset()
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    assert not trees.restored, trees.restored
    torch.cuda.synchronize()
    print("torch_compile %s: PASS (reduce-overhead inference, training, a checkpoint restored after replays; "
          "trees' calls: %s)" % (backend, trees.calls), flush=True)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return 0
    try:
        import torch
    except ImportError:
        print("torch_compile: SKIPPED (no torch)")
        return 77
    if not torch.cuda.is_available():
        # Skipped only where there is no GPU to test: a machine with an NVIDIA device whose driver
        # torch cannot use is a failure (as a skip it would pass unseen on the GPU machines).
        if os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia/gpus"):
            print("torch_compile: FAILED (an NVIDIA device is present, but torch.cuda.is_available() is False)")
            return 1
        print("torch_compile: SKIPPED (no CUDA device)")
        return 77
    try:
        import triton  # noqa: F401  (inductor's GPU code generator)
    except ImportError:
        print("torch_compile: SKIPPED (no triton)")
        return 77
    failed = 0
    child_env = {k: v for k, v in os.environ.items() if k != "PYTHONOPTIMIZE"}
    for backend in ("split_merge", "expandable"):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", backend], timeout=600, env=child_env)
        if r.returncode != 0:
            print("torch_compile %s: FAIL (exit %d)" % (backend, r.returncode), flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
