#!/usr/bin/env python3
"""Real-workload A/B on a GPU: PyTorch's caching allocator vs expseg under PyTorch (issue 5).

Workloads (random weights, no downloads; the workloads PyTorch was first measured on, plus fixed seeds):
  gpt2-train-varlen       GPT-2 small training, batch 2-16, sequence 64-1024 tokens, bf16 autocast, AdamW (24 steps)
  gpt2-generate           GPT-2 small greedy generation: KV caches growing token by token, batch 1-24, prompt
                          16-400, 32-200 new tokens (10 rounds; one round = one step)
  resnet50-train-varsize  ResNet-50 training, batch 16-96, image side 160-288, channels-last, bf16 autocast, SGD (20 steps)
Variants, one subprocess each, same seeds:
  torch-classic           PyTorch's caching allocator (PYTORCH_CUDA_ALLOC_CONF unset)
  torch-expandable        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  expseg-split_merge      expseg, backend:split_merge, through CUDAPluggableAllocator (tools/expseg.py install_torch)
  expseg-expandable       expseg, backend:expandable, the same way
Each run makes two passes over the same step shapes. Pass 1 is real_traces.py's workload: the peaks (and the
--record trace) are taken at its end; its first step (warm-up) and its total time, growth of the pools included,
are shown apart. Pass 2 repeats the same shapes (rng re-seeded) once kernels are loaded and the pools have
grown. Its steps, each bracketed by torch.cuda.synchronize(), have different shapes, so the time check compares
"mean ms", pass 2's total time over its number of steps: the same sequence of shapes in every variant (steady-state
training or serving, where a long run spends its time). "median ms" is shown too; with ten steps of very different
sizes (generation: 250 ms to 1.2 s) it jumps between neighbouring shapes from run to run. Peaks of the
torch-* variants come from torch.cuda.memory_stats(), of the expseg-* variants from expseg's stats (PyTorch's
pluggable allocator has none). The losses are the last of pass 2; the tokens, both passes'.

Checks per workload (PASS/FAIL), with LOSS_RTOL = 2e-2 (relative; bf16 noise over a few steps):
  losses     final loss of every other variant within LOSS_RTOL of torch-classic's (generation: the greedy tokens
             are identical, checksum equal)
  reserved   expseg-expandable peak reserved <= torch-expandable peak reserved
  ratio      expseg-expandable peak reserved / peak allocated <= 1.02
  time       expseg-expandable mean step time (pass 2) <= 1.03 x torch-classic's; with --rounds N, each variant's
             mean over the N rounds. One run of a variant against one of another is within the host's spread
             on a shared GPU machine: single runs of one build have put ResNet-50's mean step from x0.83 to
             x1.33 of PyTorch classic's. Rounds alternate the order of the variants, so a slow stretch of the
             host falls on all of them; the other checks hold in every round.

Usage (from the repository root, after `meson setup build && ninja -C build`):
  python3 benchmarks/workloads.py --out OUT               all 12 runs, table, checks (~5 min on an H200)
  python3 benchmarks/workloads.py --quick --out OUT       smoke test: 3 steps per pass (~3 min)
  python3 benchmarks/workloads.py --rounds 3 --variants torch-classic,expseg-expandable --out OUT
        the time check over 3 alternating rounds of the two variants it compares (~8 min)
  python3 benchmarks/workloads.py --record --out OUT      also write each expseg run's trace to OUT/traces/
  python3 benchmarks/workloads.py --snapshot-check --out OUT
        GPT-2 training under torch-classic with torch.cuda.memory._record_memory_history, the snapshot converted
        by tools/torch_snapshot_to_rmm.py and replayed on the simulated device: prints PyTorch's peak
        allocated next to the trace's peak requested and each backend's replayed peak allocated (~1 min)
"""
import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")

LOSS_RTOL = 2e-2       # relative tolerance for losses (bf16 autocast)
RATIO_MAX = 1.02       # expseg expandable: peak reserved / peak allocated
TIME_MAX = 1.03        # expseg expandable step time / torch classic's

WORKLOADS = {  # name -> default steps (as real_traces.py)
    "gpt2-train-varlen": 24,
    "gpt2-generate": 10,
    "resnet50-train-varsize": 20,
}
QUICK_STEPS = 3

VARIANTS = {
    "torch-classic": dict(torch_conf=None, expseg_conf=None),
    "torch-expandable": dict(torch_conf="expandable_segments:True", expseg_conf=None),
    "expseg-split_merge": dict(torch_conf=None, expseg_conf="backend:split_merge"),
    "expseg-expandable": dict(torch_conf=None, expseg_conf="backend:expandable"),
}

RESULT_TAG = "WORKLOADS_RESULT "


# ---------------------------------------------------------------------------------------------
# The workloads. Each returns (step_fn, kind): step_fn(i) runs step i and returns something to read
# after the step's timing (a loss tensor, or generated tokens). rng is random.Random(7), as in
# real_traces.py, and it is drawn in the same order.

def gpt2_config():
    from transformers import GPT2Config
    return GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)


def make_gpt2_train(torch, rng):
    from transformers import GPT2LMHeadModel
    cfg = gpt2_config()
    model = GPT2LMHeadModel(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        b = rng.randint(2, 16)
        t = rng.choice([64, 128, 200, 333, 512, 640, 777, 1024])
        x = torch.randint(0, cfg.vocab_size, (b, t), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, "loss"


def make_gpt2_generate(torch, rng):
    from transformers import GPT2LMHeadModel
    cfg = gpt2_config()
    model = GPT2LMHeadModel(cfg).cuda()
    model.eval()

    def step(i):
        b = rng.randint(1, 24)
        t = rng.randint(16, 400)
        x = torch.randint(0, cfg.vocab_size, (b, t), device="cuda")
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=rng.randint(32, 200),
                                 do_sample=False, pad_token_id=0)
        return out[:, t:]
    return step, "tokens"


def make_resnet50_train(torch, rng):
    import torchvision
    # cudnn.benchmark=True would ask the allocator for cacheInfo(), which PyTorch's pluggable allocator lacks;
    # False is also PyTorch's default. Same for every variant.
    torch.backends.cudnn.benchmark = False
    model = torchvision.models.resnet50(num_classes=1000).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(i):
        b = rng.choice([16, 32, 48, 64, 96])
        s = rng.choice([160, 192, 224, 256, 288])
        x = torch.randn(b, 3, s, s, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (b,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, "loss"


MAKERS = {
    "gpt2-train-varlen": make_gpt2_train,
    "gpt2-generate": make_gpt2_generate,
    "resnet50-train-varsize": make_resnet50_train,
}


# ---------------------------------------------------------------------------------------------
# Child: one workload under one variant.

def child(workload, variant, steps, out_dir, record, snapshot_path, file_tag=""):
    """file_tag: added to the names of the files it writes (tokens/, traces/): ".r2" in round 2 of several,
    so that each round's files stay for its own checks."""
    import torch
    v = VARIANTS[variant]
    uses_expseg = v["expseg_conf"] is not None
    expseg = None
    if uses_expseg:
        sys.path.insert(0, TOOLS)
        import expseg  # tools/expseg.py
        # Before anything touches CUDA: PyTorch's allocator can only be swapped before CUDA is initialized.
        expseg.install_torch(v["expseg_conf"])
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device is available to PyTorch (torch %s, CUDA %s)" % (torch.__version__, torch.version.cuda))
    random.seed(0)
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    torch.empty(1, device="cuda")  # CUDA init, as real_traces.py
    if uses_expseg and record:
        expseg.record_start()
    if snapshot_path:
        torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python", context="alloc")
        torch.cuda.reset_peak_memory_stats()

    def allocator_stats():
        if uses_expseg:
            return expseg.stats()
        return torch.cuda.memory_stats()

    rng = random.Random(7)
    step_fn, kind = MAKERS[workload](torch, rng)

    def run_pass():
        times, values = [], []
        for i in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = step_fn(i)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            values.append(float(r.float().item()) if kind == "loss" else r.cpu().tolist())
            del r
        torch.cuda.synchronize()
        return times, values

    # Pass 1 is the workload of real_traces.py: the peaks (and a recorded trace or snapshot) are taken from it.
    times1, values1 = run_pass()
    s = allocator_stats()
    res = dict(workload=workload, variant=variant, steps=steps, torch=torch.__version__, cuda=torch.version.cuda,
               gpu=torch.cuda.get_device_name(0), first_step_ms=round(times1[0] * 1e3, 3),
               pass1_ms=round(sum(times1) * 1e3, 1), pass1_step_times_ms=[round(t * 1e3, 3) for t in times1])
    res.update(peak_allocated=s["allocated_bytes.all.peak"], peak_reserved=s["reserved_bytes.all.peak"],
               peak_requested=s.get("requested_bytes.all.peak"), retries=s.get("num_alloc_retries"),
               ooms=s.get("num_ooms"), device_allocs=s.get("num_device_alloc"), device_frees=s.get("num_device_free"))
    if uses_expseg:
        res["allocator"] = "expseg " + expseg.config()
        if record:
            tdir = os.path.join(out_dir, "traces")
            os.makedirs(tdir, exist_ok=True)
            res["trace"] = os.path.join(tdir, "%s.%s%s.rmm.csv.gz" % (workload, variant, file_tag))
            expseg.record_stop()
            expseg.record_write(res["trace"])
    else:
        segs = torch.cuda.memory_snapshot()
        res["torch_expandable_segments"] = any(seg.get("is_expandable", False) for seg in segs)
        res["allocator"] = "torch %s (expandable segments: %s)" % (
            os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "classic", res["torch_expandable_segments"])
    if snapshot_path:
        torch.cuda.memory._dump_snapshot(snapshot_path)
        torch.cuda.memory._record_memory_history(enabled=None)
        res["snapshot"] = snapshot_path
        values = values1
    else:
        # Pass 2 repeats the same shapes (rng re-seeded) once every kernel is loaded and chosen and the
        # allocator has grown: its steps give the steady-state time per step that the checks compare.
        rng.seed(7)
        times2, values2 = run_pass()
        res.update(step_ms=round(statistics.median(times2) * 1e3, 3), mean_step_ms=round(statistics.mean(times2) * 1e3, 3),
                   step_times_ms=[round(t * 1e3, 3) for t in times2])
        s2 = allocator_stats()
        res.update(peak_reserved_after_pass2=s2["reserved_bytes.all.peak"], retries_after_pass2=s2.get("num_alloc_retries"),
                   device_allocs_after_pass2=s2.get("num_device_alloc"), device_frees_after_pass2=s2.get("num_device_free"))
        values = values1 + values2
    if kind == "loss":
        res["final_loss"] = values[-1]
        res["mean_loss"] = sum(values) / len(values)
        res["losses"] = values
    else:
        flat = json.dumps(values, separators=(",", ":")).encode()
        res["checksum"] = hashlib.sha256(flat).hexdigest()[:16]
        res["generated_tokens"] = sum(len(row) for rnd in values for row in rnd)
        tok_dir = os.path.join(out_dir, "tokens")
        os.makedirs(tok_dir, exist_ok=True)
        res["tokens_file"] = os.path.join(tok_dir, "%s.%s%s.json" % (workload, variant, file_tag))
        with open(res["tokens_file"], "w") as f:
            json.dump(values, f)
    print(RESULT_TAG + json.dumps(res), flush=True)


def warmup_child(seconds=4.0):
    """Brings a cold machine to a steady state before the measured runs (the first process on a fresh GPU
    machine otherwise pays for page-cache misses, driver start-up and clock ramp-up, and that is the
    torch-classic run, since it goes first)."""
    import torch
    import torchvision  # noqa: F401  (read the libraries into the page cache)
    import transformers  # noqa: F401
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda().to(memory_format=torch.channels_last)
    img = torch.randn(64, 64, 112, 112, device="cuda").to(memory_format=torch.channels_last)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        y = x @ x
        with torch.autocast("cuda", dtype=torch.bfloat16):
            z = conv(img)
        torch.cuda.synchronize()
        n += 1
    del y, z
    print(RESULT_TAG + json.dumps(dict(warmup_iterations=n)), flush=True)


def warmup(args):
    t0 = time.perf_counter()
    print("warm-up (GPU clocks, page cache) ...", end=" ", flush=True)
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--warmup"], env=child_env("torch-classic", None),
                       capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        print("FAILED (exit %d); going on\n%s" % (p.returncode, (p.stderr or "")[-2000:]), flush=True)
    else:
        print("ok in %.1f s" % (time.perf_counter() - t0), flush=True)


# ---------------------------------------------------------------------------------------------
# Parent: runs the children, prints the table and the checks.

def child_env(variant, lib_path):
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "EXPSEG_ALLOC_CONF"):
        env.pop(k, None)
    conf = VARIANTS[variant]["torch_conf"]
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    if lib_path and os.path.isfile(lib_path):  # else a soname on the system path: the child finds it the same way
        env["EXPSEG_LIBRARY"] = lib_path
    env.update(TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1")
    return env


def run_child(workload, variant, steps, args, lib_path, snapshot_path=None, round_no=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, variant, "--steps", str(steps), "--out", args.out]
    if round_no is not None and args.rounds > 1:
        cmd += ["--file-tag", ".r%d" % round_no]
    if args.record and VARIANTS[variant]["expseg_conf"]:
        cmd.append("--record")
    if snapshot_path:
        cmd += ["--snapshot", snapshot_path]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=child_env(variant, lib_path), capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        err = (e.stderr or b"")
        err = err.decode(errors="replace") if isinstance(err, bytes) else err
        return dict(workload=workload, variant=variant, status="TIMEOUT after %d s" % args.timeout, stderr_tail=err[-4000:])
    wall = time.perf_counter() - t0
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG):])
            res.update(status="ok", wall_s=round(wall, 1), exit_code=p.returncode)
            if p.returncode != 0:  # the measurements are complete; something failed at exit
                res["stderr_tail"] = (p.stderr or "")[-2000:]
            return res
    return dict(workload=workload, variant=variant, status="FAILED (exit %d)" % p.returncode, wall_s=round(wall, 1),
                stderr_tail=(p.stderr or "")[-4000:], stdout_tail=(p.stdout or "")[-2000:])


def run_order(workloads, variants, rounds):
    """(round, workload, variant) in the order they run: round by round, each workload's variants in the
    given order in odd rounds and reversed in even ones, so that neither the first nor the last place
    (a host still settling, or slowing down) falls on one variant in every round."""
    for k in range(1, rounds + 1):
        for w in workloads:
            for v in (variants if k % 2 == 1 else variants[::-1]):
                yield k, w, v


def gb(n):
    return "%.3f" % (n / 1e9) if isinstance(n, (int, float)) else "-"


def token_agreement(a, b):
    """The share of equal tokens of two runs (their results' tokens_file), or None."""
    try:
        with open(a["tokens_file"]) as f:
            ta = json.load(f)
        with open(b["tokens_file"]) as f:
            tb = json.load(f)
    except (OSError, KeyError, ValueError):
        return None
    same = total = 0
    for ra, rb in zip(ta, tb):
        for xa, xb in zip(ra, rb):
            for u, w in zip(xa, xb):
                total += 1
                same += u == w
    return same / total if total else None


def round_checks(workload, rows, out_dir):
    """[(name, ok, detail)] for one workload's runs of one round: all but the time check."""
    by = {r["variant"]: r for r in rows if r.get("status") == "ok"}
    out = []
    failed = [r["variant"] for r in rows if r.get("status") != "ok"]
    out.append(("all variants ran", not failed, "failed: " + ", ".join(failed) if failed else "%d ok" % len(rows)))
    # A run that reported its results and then failed (a crash at teardown, a freed pointer at exit) is not a pass.
    exited = ["%s (exit %d)" % (r["variant"], r["exit_code"]) for r in rows if r.get("status") == "ok" and r.get("exit_code")]
    out.append(("every variant exited cleanly", not exited, ", ".join(exited) or "exit 0"))
    classic = by.get("torch-classic")
    if classic is not None:
        others = [v for v in by if v != "torch-classic"]
        if "final_loss" in classic:
            bad = []
            for v in others:
                ref, got = classic["final_loss"], by[v]["final_loss"]
                rel = abs(got - ref) / max(abs(ref), 1e-12)
                if not rel <= LOSS_RTOL:  # NaN fails too
                    bad.append("%s %.5g vs %.5g (rel %.2g; mean-loss rel %.2g)" % (
                        v, got, ref, rel, abs(by[v]["mean_loss"] - classic["mean_loss"]) / max(abs(classic["mean_loss"]), 1e-12)))
            out.append(("losses within rel %g of torch-classic" % LOSS_RTOL, not bad, "; ".join(bad) or "final loss %.5g" % classic["final_loss"]))
        else:
            bad = []
            for v in others:
                if by[v]["checksum"] != classic["checksum"]:
                    agree = token_agreement(by[v], classic)
                    bad.append("%s differs (token agreement %s)" % (v, "%.4f" % agree if agree is not None else "?"))
            out.append(("generated tokens equal torch-classic's", not bad, "; ".join(bad) or "checksum " + classic["checksum"]))
    ee, te = by.get("expseg-expandable"), by.get("torch-expandable")
    if te is not None:  # else the comparison below would be against classic PyTorch under another name
        out.append(("torch-expandable ran with expandable segments", bool(te.get("torch_expandable_segments")),
                    "PyTorch reports %s" % ("expandable segments" if te.get("torch_expandable_segments") else
                                            "none: was expandable_segments:True applied?")))
    if ee is not None and te is not None and te.get("torch_expandable_segments"):
        out.append(("expseg-expandable peak reserved <= torch-expandable's", ee["peak_reserved"] <= te["peak_reserved"],
                    "%s GB vs %s GB" % (gb(ee["peak_reserved"]), gb(te["peak_reserved"]))))
    if ee is not None:
        ratio = ee["peak_reserved"] / ee["peak_allocated"] if ee["peak_allocated"] else float("inf")
        out.append(("expseg-expandable reserved/allocated <= %.2f" % RATIO_MAX, ratio <= RATIO_MAX, "%.4f" % ratio))
    return out


def mean_step_over_rounds(rows, variant):
    """The variant's mean step time (pass 2) in each round it ran in, or None if a round lacks it."""
    runs = [r for r in rows if r["variant"] == variant]
    if not runs or any(r.get("status") != "ok" for r in runs):
        return None
    return [r["mean_step_ms"] for r in runs]


def checks_for(workload, rows, out_dir):
    """[(name, ok, detail)] for one workload over every round: each round's checks must hold in every round;
    the time check compares the variants' means over the rounds."""
    rounds = sorted({r.get("round", 1) for r in rows})
    seen = {}  # check name -> [(round, ok, detail)], in the first round's order
    for k in rounds:
        for name, ok, detail in round_checks(workload, [r for r in rows if r.get("round", 1) == k], out_dir):
            seen.setdefault(name, []).append((k, ok, detail))
    out = []
    for name, runs in seen.items():
        bad = [(k, d) for k, ok, d in runs if not ok]
        if len(rounds) == 1:
            out.append((name, not bad, runs[0][2]))
        elif bad:
            out.append((name, False, "round %d: %s" % bad[0]))
        else:  # a check that needs a variant a round lacks is not run there ("all variants ran" fails for it)
            out.append((name, True, "%s; the first: %s" % (
                "all %d rounds" % len(rounds) if len(runs) == len(rounds) else "%d of %d rounds" % (len(runs), len(rounds)),
                runs[0][2])))
    ee, classic = mean_step_over_rounds(rows, "expseg-expandable"), mean_step_over_rounds(rows, "torch-classic")
    if ee is not None and classic is not None:
        e_mean, c_mean = statistics.fmean(ee), statistics.fmean(classic)
        r = e_mean / c_mean
        if len(rounds) == 1:
            detail = "%.2f ms vs %.2f ms (x%.3f; one round, within the host's spread: see --rounds)" % (e_mean, c_mean, r)
        else:
            detail = "means over %d rounds %.2f ms vs %.2f ms (x%.3f; each round %s)" % (
                len(rounds), e_mean, c_mean, r, " ".join("x%.3f" % (e / c) for e, c in zip(ee, classic)))
        out.append(("expseg-expandable mean step time <= %.2f x torch-classic's" % TIME_MAX, r <= TIME_MAX, detail))
    return out


def print_table(results):
    several_rounds = len({r.get("round", 1) for r in results}) > 1
    hdr = ("workload", "variant", "peak alloc GB", "peak resv GB", "resv/alloc", "1st step ms", "pass 1 s", "median ms",
           "mean ms", "vs classic", "retries", "final loss / tokens")
    rows = [hdr]
    classic_ms = {(r["workload"], r.get("round", 1)): r["mean_step_ms"] for r in results
                  if r.get("status") == "ok" and r["variant"] == "torch-classic"}
    for r in results:
        variant = "%s #%d" % (r["variant"], r.get("round", 1)) if several_rounds else r["variant"]
        if r.get("status") != "ok":
            rows.append((r["workload"], variant, r.get("status", "?")) + ("",) * (len(hdr) - 3))
            continue
        ratio = "%.4f" % (r["peak_reserved"] / r["peak_allocated"]) if r["peak_allocated"] else "-"
        key = (r["workload"], r.get("round", 1))
        vs = "x%.3f" % (r["mean_step_ms"] / classic_ms[key]) if key in classic_ms else "-"
        val = "%.5f" % r["final_loss"] if "final_loss" in r else "sha %s (%d)" % (r["checksum"], r["generated_tokens"])
        rows.append((r["workload"], variant, gb(r["peak_allocated"]), gb(r["peak_reserved"]), ratio,
                     "%.1f" % r["first_step_ms"], "%.2f" % (r["pass1_ms"] / 1e3), "%.2f" % r["step_ms"],
                     "%.2f" % r["mean_step_ms"], vs, str(r.get("retries", "-")), val))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(hdr))]
    for k, row in enumerate(rows):
        print("  ".join(str(c).ljust(widths[i]) if i < 2 else str(c).rjust(widths[i]) for i, c in enumerate(row)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def resolve_library(variants):
    if not any(VARIANTS[v]["expseg_conf"] for v in variants):
        return None
    sys.path.insert(0, TOOLS)
    import expseg  # tools/expseg.py; only to find and check the library, no CUDA here
    try:
        path = expseg.library_path()
        expseg.load()
    except expseg.ExpsegError as e:
        raise SystemExit("workloads.py: %s" % e)
    return os.path.abspath(path) if os.path.isfile(path) else path


def snapshot_check(args, lib_path):
    """GPT-2 training under torch-classic with PyTorch's memory history on; convert and replay the snapshot."""
    sys.path.insert(0, TOOLS)
    import torch_snapshot_to_rmm as conv
    w = "gpt2-train-varlen"
    steps = QUICK_STEPS if args.quick else (args.steps or WORKLOADS[w])
    pkl = os.path.join(args.out, "%s.torch-snapshot.pickle" % w)
    print("snapshot check: %s, %d steps, torch-classic with torch.cuda.memory._record_memory_history ..." % (w, steps), flush=True)
    res = run_child(w, "torch-classic", steps, args, lib_path, snapshot_path=pkl)
    if res.get("status") != "ok":
        print("snapshot run FAILED: %s\n%s" % (res.get("status"), res.get("stderr_tail", "")))
        return False
    events, info = conv.convert(conv.load_snapshot(pkl))
    trace = os.path.join(args.out, "%s.from-torch-snapshot.rmm.csv.gz" % w)
    conv.write_trace(events, trace)
    conv.describe(info)
    print("wrote %s (%d events)" % (trace, len(events)))
    pa, pr = res["peak_allocated"], res.get("peak_requested")
    print("PyTorch (recorded run): peak allocated %d, peak requested %s, peak reserved %d" % (pa, pr, res["peak_reserved"]))
    print("converted trace:        peak live requested %d (%+.4f%% of PyTorch's peak allocated%s)" % (
        info["peak_live_requested"], 100.0 * (info["peak_live_requested"] - pa) / pa,
        ", %+.4f%% of its peak requested" % (100.0 * (info["peak_live_requested"] - pr) / pr) if pr else ""))
    ok = True
    if lib_path:
        replays = conv.replay(trace, ["split_merge", "expandable"])
        conv.print_replays(replays, pa)
        for r in replays:
            within = abs(r["peak_allocated"] - pa) / pa <= 0.01
            ok = ok and within and r["ooms"] == 0
            print("%s: replay on %s: peak allocated within 1%% of PyTorch's: %s" % ("PASS" if within else "FAIL", r["backend"], within))
        with open(os.path.join(args.out, "snapshot_check.json"), "w") as f:
            json.dump(dict(run=res, convert=info, replays=replays), f, indent=1)
    else:
        print("(no libexpseg.so: replay skipped)")
    print("replay it yourself: build/tools/expseg replay %s (see `expseg replay --help`)" % trace)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: all)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (default: all four)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: 24 / 10 / 20 as real_traces.py)")
    ap.add_argument("--out", default="workloads-out", help="directory for results.jsonl, tokens/, traces/")
    ap.add_argument("--record", action="store_true", help="record each expseg run's allocation trace (OUT/traces/*.rmm.csv.gz)")
    ap.add_argument("--quick", action="store_true", help="smoke test: %d steps per run" % QUICK_STEPS)
    ap.add_argument("--snapshot-check", action="store_true", help="only the PyTorch snapshot -> RMM trace -> replay check")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per run (default 420)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up process that runs before the measured runs")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every variant this many times, the order reversed each round; the time check takes the means (default 1)")
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--snapshot", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--file-tag", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        child(args.child[0], args.child[1], args.steps, args.out, args.record, args.snapshot, args.file_tag)
        return 0
    if args.warmup:
        warmup_child()
        return 0

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error("unknown workload %r (valid: %s)" % (w, ", ".join(WORKLOADS)))
    for v in variants:
        if v not in VARIANTS:
            ap.error("unknown variant %r (valid: %s)" % (v, ", ".join(VARIANTS)))
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    os.makedirs(args.out, exist_ok=True)
    if os.environ.get("EXPSEG_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        print("note: EXPSEG_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF from the environment are not passed to the runs")

    if args.snapshot_check:
        try:
            lib_path = resolve_library(["expseg-expandable"])
        except SystemExit as e:
            print("%s\n(the conversion runs without it; the replay on the simulated device is skipped)" % e)
            lib_path = None
        if not args.no_warmup:
            warmup(args)
        return 0 if snapshot_check(args, lib_path) else 1

    lib_path = resolve_library(variants)
    if lib_path:
        print("expseg library: %s" % lib_path)
    print("loss tolerance: relative %g (bf16 autocast); ratio limit %.2f; time limit x%.2f of torch-classic" % (LOSS_RTOL, RATIO_MAX, TIME_MAX))
    if args.record:
        print("recording is on: expseg runs' times include the event recorder")
    if args.quick:
        print("--quick: %d steps per run, so the step times (and the time check) are not meaningful" % QUICK_STEPS)
    if not args.no_warmup:
        warmup(args)
    results = []
    t_start = time.perf_counter()
    with open(os.path.join(args.out, "results.jsonl"), "w") as jf:
        for k, w, v in run_order(workloads, variants, args.rounds):
            steps = QUICK_STEPS if args.quick else (args.steps or WORKLOADS[w])
            tag = " (round %d of %d)" % (k, args.rounds) if args.rounds > 1 else ""
            print("[%6.1f s] %s / %s (%d steps)%s ..." % (time.perf_counter() - t_start, w, v, steps, tag), end=" ", flush=True)
            r = run_child(w, v, steps, args, lib_path, round_no=k)
            r["round"] = k
            results.append(r)
            if r.get("status") == "ok":
                print("ok in %.1f s: peak reserved %s GB, step %.2f ms" % (r["wall_s"], gb(r["peak_reserved"]), r["step_ms"]), flush=True)
                if r.get("exit_code"):
                    print("  WARNING: the run exited with code %d after reporting its results:\n  %s" % (
                        r["exit_code"], r.get("stderr_tail", "").replace("\n", "\n  ")))
                if v == "torch-expandable" and not r.get("torch_expandable_segments"):
                    print("  WARNING: PyTorch reports no expandable segment in this run: was expandable_segments:True applied?")
            else:
                print(r["status"], flush=True)
                print("  ---- stderr (tail) ----\n  " + r.get("stderr_tail", "").replace("\n", "\n  "), flush=True)
            jf.write(json.dumps(r) + "\n")
            jf.flush()

    print()
    print_table(results)
    print()
    all_ok = True
    summary = {}
    for w in workloads:
        rows = [r for r in results if r["workload"] == w]
        checks = checks_for(w, rows, args.out)
        summary[w] = [dict(check=n, ok=ok, detail=d) for n, ok, d in checks]
        for name, ok, detail in checks:
            all_ok = all_ok and ok
            print("%s  %-24s %-58s %s" % ("PASS" if ok else "FAIL", w, name, detail))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(dict(loss_rtol=LOSS_RTOL, ratio_max=RATIO_MAX, time_max=TIME_MAX, rounds=args.rounds, checks=summary,
                       all_pass=all_ok, total_s=round(time.perf_counter() - t_start, 1)), f, indent=1)
    print("\n%s in %.0f s; results in %s/results.jsonl, checks in %s/summary.json" % (
        "ALL PASS" if all_ok else "SOME CHECKS FAILED", time.perf_counter() - t_start, args.out, args.out))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
