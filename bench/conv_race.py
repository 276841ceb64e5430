"""accelc::conv2d's TMA-rectangle race: the nested-loop kernel of commit 1252e02 against today's, each
config forced, three runs each (bench/results/conv_race-*.md holds the reading and the fix).

    python bench/conv_race.py      # in a git checkout, on a GPU; writes $OUT/race.json (default /tmp)

Configs with 8 warps are built here directly: kernels/conv.py's rect_config now refuses them.
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import torch
import triton

from accelc.kernels import conv as new
from accelc.numerics import rel_l2


def _nested_kernel():
    src = subprocess.run(["git", "show", "1252e02:kernels/conv.py"], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    src = src[:src.index("@torch.library.custom_op")].replace('Tuner("conv2d"', 'Tuner("conv2d_nested"')
    path = os.path.join(tempfile.mkdtemp(), "conv_nested.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("conv_nested", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rect(bh, bw, bn, bk, stages, warps):
    return triton.Config({"BLOCK_M": bh * bw, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "RECT": True,
                          "BLOCK_H": bh, "BLOCK_W": bw}, num_stages=stages, num_warps=warps)

def run(mod, cfg, N, C, H, W, K, reps=3):
    torch.manual_seed(0)
    x = torch.randn(N, C, H, W, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = mod.pack_weight(torch.randn(K, C, 3, 3, device="cuda", dtype=torch.float16) / (C * 9) ** 0.5)
    b = torch.randn(K, device="cuda", dtype=torch.float16)
    args = ((1, 1), (1, 1, 1, 1), (1, 1), "relu", False)
    ref = mod.conv2d_ref(x.float(), w.float(), b.float(), None, *args)
    errs, outs = [], []
    with _Force(mod.TUNER, cfg):
        for _ in range(reps):
            o = mod.conv2d_launch(x, w, b, None, *args); torch.cuda.synchronize()
            outs.append(o); errs.append(rel_l2(o.float(), ref))
    return errs, all(torch.equal(outs[0], o) for o in outs[1:])

class _Force:
    def __init__(self, t, cfg): self.t, self.cfg = t, cfg
    def __enter__(self):
        self.saved = self.t.pick
        self.t.calls.clear(); self.t.chosen.clear()
        self.t.pick = lambda key, sizes, launch: self.cfg
    def __exit__(self, *a):
        self.t.pick = self.saved; self.t.calls.clear(); self.t.chosen.clear()

def main():
    old = _nested_kernel()
    rows = []
    shapes = [(32, 128, 28, 28, 128), (32, 128, 27, 29, 128), (8, 128, 28, 28, 128), (32, 192, 28, 28, 192),
              (32, 64, 56, 56, 64), (32, 256, 14, 14, 256)]
    variants = {
        "cfg6 8x16 bn128 bk64 s3 w8": (8, 16, 128, 64, 3, 8),
        "cfg7 16x8 bn128 bk64 s3 w8": (16, 8, 128, 64, 3, 8),
        "16x8 bn128 bk64 s2 w8": (16, 8, 128, 64, 2, 8),
        "16x8 bn128 bk64 s4 w8": (16, 8, 128, 64, 4, 8),
        "16x8 bn128 bk64 s3 w4": (16, 8, 128, 64, 3, 4),
        "16x8 bn64 bk64 s3 w8": (16, 8, 64, 64, 3, 8),
        "16x8 bn128 bk32 s3 w8": (16, 8, 128, 32, 3, 8),
        "cfg8 8x16 bn64 bk64 s4 w4": (8, 16, 64, 64, 4, 4),
    }
    for label, v in variants.items():
        for shape in shapes:
            for name, mod in (("nested", old), ("flat", new)):
                cfg = _rect(*v)
                try:
                    errs, same = run(mod, cfg, *shape)
                    rows.append(dict(kernel=name, config=label, shape=shape, max_err=max(errs), same=same))
                except Exception as e:
                    rows.append(dict(kernel=name, config=label, shape=shape, error=str(e)[:100]))
    out = os.environ.get("OUT", "/tmp")
    json.dump(rows, open(f"{out}/race.json", "w"), indent=1)
    for r in rows:
        print(f"{r['kernel']:6s} {r['config']:28s} {'x'.join(map(str, r['shape'])):18s} "
              + (f"err {r['max_err']:.1e} same {r['same']}" if "max_err" in r else r["error"]))

if __name__ == '__main__':
    main()
