#!/usr/bin/env python3
"""PyTorch on the device machine, in the same call as kvwire's own runs (scripts/device_session.sh):

  baselines  the device's ceilings and the field's kernels on the shapes kvwire runs:
             a read-bandwidth kernel (a sum over 2 GiB), a device-to-device copy, cuBLAS's bf16
             GEMM at 8192^3, and PyTorch's SDPA (causal, GQA, bf16) over the 1B and 8B
             attention shapes at 2K and 16K tokens;
  oracle     stories260K in float32 through Hugging Face transformers on the GPU, an engine
             independent of kvwire: its greedy ids from BOS against REFERENCE.json and against
             `kvwire timing --backend cuda` on the same ids, and its teacher-forced argmax.

Prints one `phase<TAB>status<TAB>detail` line per check for the session's summary and writes
every figure to --json. Times are medians of CUDA-event-timed repetitions after warm-ups, on
random data (never zeros).
"""
import argparse
import json
import os
import subprocess
import sys


def median_ms(fn, warmup=3, reps=10):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def baselines(out, rows):
    import torch
    import torch.nn.functional as F
    dev = torch.device("cuda")
    # Read bandwidth: one pass over 2 GiB of bf16 (a reduction reads each byte once and writes
    # nothing), the ceiling decode's bytes-per-step is set against.
    x = torch.randn(1 << 30, dtype=torch.bfloat16, device=dev)
    ms = median_ms(lambda: x.sum(dtype=torch.float32))
    out["read_gbps"] = x.numel() * 2 / ms / 1e6
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    out["copy_gbps_read_plus_written"] = 2 * x.numel() * 2 / ms / 1e6
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    ms = median_ms(lambda: a @ b)
    out["gemm_bf16_tflops"] = 2 * 8192**3 / ms / 1e9
    del a, b
    rows.append(("torch_ceilings", "pass",
                 f"read {out['read_gbps']:.0f} GB/s, copy {out['copy_gbps_read_plus_written']:.0f}"
                 f" GB/s (r+w), bf16 GEMM {out['gemm_bf16_tflops']:.0f} TFLOP/s"))
    sdpa = {}
    for name, heads, kv_heads, head_dim in (("1b", 32, 8, 64), ("8b", 32, 8, 128)):
        for length in (2048, 16384):
            q = torch.randn(1, heads, length, head_dim, dtype=torch.bfloat16, device=dev)
            k = torch.randn(1, kv_heads, length, head_dim, dtype=torch.bfloat16, device=dev)
            v = torch.randn_like(k)
            ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                  enable_gqa=True))
            flops = 2 * 2 * heads * head_dim * length * length / 2  # causal: half of QK and PV
            sdpa[f"{name}_{length}"] = {"ms": ms, "tflops": flops / ms / 1e9}
    out["sdpa"] = sdpa
    rows.append(("torch_sdpa", "pass", ", ".join(
        f"{k} {v['ms']:.2f} ms ({v['tflops']:.0f} TFLOP/s)" for k, v in sdpa.items())))


def oracle(args, out, rows):
    import torch
    from transformers import AutoModelForCausalLM
    model_dir = os.path.join(args.shared, "models", "stories260K-hf")
    with open(os.path.join(model_dir, "REFERENCE.json")) as f:
        ref = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).cuda().eval()
    steps = len(ref["greedy_from_bos"]["ids"])
    ids = [1]
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids], device="cuda")).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
        tf = ref["teacher_forced"]["ids"]
        logits = model(torch.tensor([tf], device="cuda")).logits[0].float()
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(tf[1:], device="cuda"),
                                                reduction="sum").item()
    torch_ids = ids[1:]
    out["torch_greedy_ids"] = torch_ids
    out["torch_teacher_forced_sum_nll"] = nll
    ref_ok = torch_ids == ref["greedy_from_bos"]["ids"]
    nll_ok = abs(nll - ref["teacher_forced"]["sum_nll"]) < 1e-3 * abs(ref["teacher_forced"]["sum_nll"])
    rows.append(("torch_vs_reference", "pass" if ref_ok and nll_ok else "FAIL",
                 f"greedy ids {'equal' if ref_ok else 'differ'}, sum_nll {nll:.4f} vs "
                 f"{ref['teacher_forced']['sum_nll']}"))
    if not args.kvwire:
        return
    cmd = [args.kvwire, "timing", "--backend", args.backend, "--model", model_dir,
           "--prompt-ids", "1", "--decode", str(steps - 1)]  # the prefill samples the first
    try:
        # Well inside the phase's own limit: a hang here must not take the rows above with it.
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=40)
    except subprocess.TimeoutExpired:
        rows.append(("kvwire_vs_torch", "FAIL", "kvwire timing did not finish in 40 s"))
        return
    if p.returncode != 0:
        last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "(no message)"
        rows.append(("kvwire_vs_torch", "FAIL", f"kvwire timing exit {p.returncode}: {last}"))
        return
    kv_ids = json.loads(p.stdout)["runs"][0]["ids"]
    out["kvwire_greedy_ids"] = kv_ids
    same = next((i for i, (a, b) in enumerate(zip(kv_ids, torch_ids)) if a != b), None)
    rows.append(("kvwire_vs_torch", "pass" if same is None and len(kv_ids) == len(torch_ids)
                 else "FAIL", f"{args.backend}: {len(kv_ids)} greedy ids" +
                 (" equal torch's" if same is None else f", first difference at step {same}")))


class Rows(list):
    """Rows printed as they are added, so that a phase cut off by its timeout keeps them."""

    def append(self, row):
        super().append(row)
        print("\t".join(row), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", required=True, help="the folder with models/ and data/")
    ap.add_argument("--kvwire", default="", help="the kvwire binary (empty: no comparison)")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--json", required=True)
    ap.add_argument("--skip-baselines", action="store_true")
    args = ap.parse_args()
    rows, out = Rows(), {}
    try:
        import torch
        if not torch.cuda.is_available():
            print("torch\tskip\tno CUDA device visible to PyTorch", flush=True)
            return 0
        out["device"] = torch.cuda.get_device_name()
        out["torch"] = torch.__version__
    except ImportError:
        print("torch\tskip\tPyTorch is not installed")
        return 0
    for step in ([] if args.skip_baselines else [baselines]) + [oracle]:
        try:
            step(args, out, rows) if step is oracle else step(out, rows)
        except Exception as e:  # one failed check must not hide the others
            rows.append((step.__name__, "FAIL", f"{type(e).__name__}: {e}"[:300]))
        with open(args.json, "w") as f:  # after each step, for the same reason
            json.dump(out, f, indent=1)
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
