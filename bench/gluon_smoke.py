"""One forced call of every Gluon candidate (GEMM or attention) in its own process, so that a kernel
that faults or hangs is named and cannot poison the next: the first device step after a change to
kernels/attention_hopper.py or kernels/gemm_hopper.py, before the tests and benches.

    python bench/gluon_smoke.py [--kernel attention|gemm|w8a8|conv] [--timeout 120]
    python bench/gluon_smoke.py --kernel attention --wrap "compute-sanitizer --tool racecheck"

--wrap runs each child under a command (compute-sanitizer's racecheck / synccheck: the warp-specialized
kernels' shared-memory hazards and barrier misuse); the child then also runs the causal case.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import shlex
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import sys, torch
from accelc.kernels import flash_attention as fa, gemm
from accelc.numerics import rel_l2
i = int(sys.argv[1])
if sys.argv[2] == "attention":
    cfg = fa.GLUON_CONFIGS[i]
    D = 128 if cfg.kwargs.get("CONSUMERS", 2) == 2 else 64
    q, k, v = (torch.randn(2, 300, 4, D, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
    with fa.TUNER.force(cfg):
        out = fa.flash_attention(q, k, v)
        causal = fa.flash_attention(q, k, v, is_causal=True) if "wrapped" in sys.argv else None
    ref = fa.flash_attention_ref(q.float(), k.float(), v.float())
    if causal is not None:
        err = rel_l2(causal.float(), fa.flash_attention_ref(q.float(), k.float(), v.float(), is_causal=True))
        print(f"causal rel_l2 {err:.2e}")
elif sys.argv[2] == "control":
    sys.path.insert(0, sys.argv[-1])
    import gluon_ws_control
    cfg = f"warp_specialize control ({1 + 2 * i} worker partition(s) of 4 warps, no shared memory)"
    out, ref = gluon_ws_control.run(workers=1 + 2 * i)
elif sys.argv[2] == "conv":
    from accelc.kernels import conv
    cfg = conv.GLUON_CONFIGS[i]
    # padded: a 30 x 20 map, 1-padded (boxes clipped and zero-filled at every edge); interior: 34 x 34 unpadded,
    # every box inside the map (the copy engine clips nothing)
    pad, side = (0, (34, 34)) if "interior" in sys.argv else (1, (30, 20))
    x = torch.randn(2, 128, *side, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(256, 128, 3, 3, device="cuda", dtype=torch.float16) / 34
    with conv.TUNER.force(cfg):
        out = torch.ops.accelc.conv2d(x, conv.pack_weight(w), None, None, [1, 1], [pad] * 4, [1, 1])
        out2 = torch.ops.accelc.conv2d(x, conv.pack_weight(w), None, None, [2, 2], [pad] * 4, [1, 1])
    ref = torch.nn.functional.conv2d(x.float(), w.float(), padding=pad)
    ref2 = torch.nn.functional.conv2d(x.float(), w.float(), stride=2, padding=pad)
    print(f"stride 2 rel_l2 {rel_l2(out2.float(), ref2):.2e}")
elif sys.argv[2] == "w8a8":
    from accelc.kernels import int8_gemm
    cfg = int8_gemm.GLUON_CONFIGS[i]
    q = torch.randint(-127, 128, (1000, 768), device="cuda", dtype=torch.int8)
    w = torch.randint(-127, 128, (2304, 768), device="cuda", dtype=torch.int8)
    a_s, w_s = torch.rand(1000, device="cuda") / 100, torch.rand(2304, device="cuda") / 100
    with int8_gemm.TUNER.force(cfg):
        out = int8_gemm.int8_gemm_launch(q, a_s, w, w_s)
    ref = int8_gemm.int8_gemm_ref(q, a_s, w, w_s, out_dtype=torch.float32)
else:
    cfg = gemm.GLUON_CONFIGS[i]
    x = torch.randn(1000, 768, device="cuda", dtype=torch.float16)
    w = torch.randn(2304, 768, device="cuda", dtype=torch.float16) / 28
    with gemm.TUNER.force(cfg):
        out = gemm.linear_launch(x, w)
    ref = x.float() @ w.float().t()
torch.cuda.synchronize()
print(f"config {i} {getattr(cfg, 'kwargs', cfg)}: rel_l2 {rel_l2(out.float(), ref):.2e}")
'''


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("attention", "gemm", "w8a8", "conv", "control"), default="attention")
    ap.add_argument("--timeout", type=int, default=120)
    ap.add_argument("--jobs", type=int, default=1, help="children at once (1 for a timing-quiet GPU)")
    ap.add_argument("--wrap", default="", help="a command each child runs under, e.g. compute-sanitizer's")
    ap.add_argument("--interior", action="store_true", help="conv: an unpadded map of whole rectangles")
    args = ap.parse_args()
    from accelc.kernels import conv, flash_attention, gemm, int8_gemm
    owner = {"attention": flash_attention, "gemm": gemm, "w8a8": int8_gemm, "conv": conv}.get(args.kernel)
    n = 2 if owner is None else len(owner.GLUON_CONFIGS)
    def child(i):
        flags = (["wrapped"] if args.wrap else []) + (["interior"] if args.interior else [])
        cmd = [sys.executable, "-c", CHILD, str(i), args.kernel] + flags + [
            str(Path(__file__).resolve().parent)]
        try:
            done = subprocess.run(shlex.split(args.wrap) + cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return False, f"[{i}] TIMEOUT after {args.timeout} s (a hang: a barrier never completed?)"
        text = done.stdout.strip()[-1500:] if done.returncode == 0 else (done.stdout + done.stderr).strip()[-1500:]
        return done.returncode == 0, f"[{i}] rc={done.returncode} {text}"

    bad = 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:   # results printed in config order
        for ok, text in pool.map(child, range(n)):
            bad += not ok
            print(text, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
