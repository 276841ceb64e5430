"""accelc::conv2d's candidates: the config tables the tuner races (row tiles by pointers, pixel rectangles by the
copy engine, split reductions, the RGB stem's ROWS path, grouped convs' narrow tiles, the Gluon conv's), which of
them a call's sizes are offered (prune_configs), and the config used without tuning and in the interpreter. The
kernels and their launch are kernels/conv.py."""
from __future__ import annotations

import triton

from accelc.kernels.gemm_configs import gluon_config as gemm_gluon_config


def config(bm, bn, bk, stages, warps, split=1, row_step=1) -> triton.Config:
    """Tiles of BLOCK_M pixels in row-major order, gathered with pointers. (BLOCK_H / BLOCK_W
    only size the descriptor boxes, which every launch with descriptors encodes.) split: the
    reduction in that many slices (see _conv_kernel's SPLIT). row_step: kernel rows a K step
    on the ROWS path (which ignores bk)."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "RECT": False,
                          "BLOCK_H": 8, "BLOCK_W": 8, "SPLIT": split, "ROW_STEP": row_step},
                         num_stages=stages, num_warps=warps)


def rect_config(bh, bw, bn, bk, stages, warps, split=1) -> triton.Config:
    """Tiles of bh x bw output pixels, each tap's patch one TMA box (stride-1 convs on NHWC).

    One warpgroup (4 warps) only. The (1, bh, bw, BLOCK_K) box cannot be reshaped to the
    (BLOCK_M, BLOCK_K) operand in shared memory, so Triton (3.6) loads it into registers and
    feeds a register-operand wgmma; the box's stage is then refilled by TMA one iteration later
    with no CTA-wide barrier after the read (no gpu.barrier in the TTGIR). With two warpgroups one
    can run an iteration ahead and refill the stage the other is still reading: wrong,
    run-to-run different results (ResNet-50 stage-2 3x3 convs, 8 warps and 3-4 stages, H100 and
    H200). In one warpgroup the refill
    at the end of iteration j comes after a wgmma wait that needs iteration j's first wgmma done,
    which needs all four warps to have issued it, so all are past iteration j-1's read of that
    stage (and no 4-warp run has failed: tests/test_candidates.py)."""
    if warps != 4:
        raise ValueError("TMA-rectangle conv configs take 4 warps (one warpgroup): see rect_config")
    return triton.Config({"BLOCK_M": bh * bw, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "RECT": True,
                          "BLOCK_H": bh, "BLOCK_W": bw, "SPLIT": split, "ROW_STEP": 1},
                         num_stages=stages, num_warps=warps)


# H100 candidates: 128-pixel row tiles (ResNet layers have 1.5k-100k pixels at batch 32), K tiles
# of 64-128 channels, 32-64 channels a reduction step; for stride-1 convs also 8x16 / 16x8 / 8x8
# pixel rectangles by TMA (8x8 suits 7x7 and 14x14 maps), one warpgroup each (rect_config).
CONFIGS = [config(128, 128, 64, 3, 8), config(128, 64, 64, 4, 4), config(64, 128, 64, 4, 4),
           config(128, 128, 32, 4, 8), config(64, 64, 64, 4, 4), config(128, 64, 32, 4, 4),
           rect_config(8, 16, 128, 64, 3, 4), rect_config(16, 8, 128, 64, 3, 4),
           rect_config(8, 16, 64, 64, 4, 4), rect_config(8, 8, 128, 64, 4, 4),
           rect_config(8, 8, 64, 64, 4, 4)]
# few output tiles and a long reduction (batch 1-8 at 14x14 and 7x7: 8-64 tiles of 64 channels
# on 132 SMs, 2304-4608 deep): the reduction in 2-8 slices, summed by _splitk_reduce
SPLIT_CONFIGS = [rect_config(8, 8, 64, 64, 4, 4, split=s) for s in (2, 4, 8)] \
    + [config(64, 64, 64, 4, 4, split=s) for s in (2, 4, 8)]
CONFIGS += SPLIT_CONFIGS


def rows_config(bm, bn, stages, warps, row_step=1) -> triton.Config:
    """A tile of the ROWS path (an RGB stem; its K step is the padded kernel row, so BLOCK_K is unused).

    One warpgroup (4 warps) only, for the RECT path's reason (rect_config): the input run is zeroed past S in
    registers (tl.where) before the dot, so Triton (3.6) feeds a register-operand wgmma from a pipelined
    shared-memory stage, refilled without a CTA-wide barrier after the read. With 8 warps one warpgroup ran
    ahead and refilled a stage the other was still reading: run-to-run different results (ResNet's stem,
    256 x 64 tiles, H200; bench/conv_rows_race.py)."""
    if warps != 4:
        raise ValueError("ROWS conv configs take 4 warps (one warpgroup): see rows_config")
    return config(bm, bn, 16, stages, warps, row_step=row_step)


# the ROWS path (an RGB stem)
ROWS_CONFIGS = [rows_config(128, 64, 3, 4), rows_config(128, 64, 2, 4), rows_config(256, 64, 3, 4),
                rows_config(64, 64, 3, 4), rows_config(128, 128, 3, 4),
                rows_config(128, 64, 3, 4, row_step=2), rows_config(64, 64, 3, 4, row_step=2),
                rows_config(256, 64, 3, 4, row_step=2)]
CONFIGS += ROWS_CONFIGS
# grouped convs (ResNeXt / RegNet groups of 8-64 channels in and out): tiles as narrow as a group
GROUPED_CONFIGS = [config(128, 16, 16, 3, 4), config(128, 32, 16, 3, 4), config(128, 32, 32, 3, 4),
                   config(64, 32, 32, 4, 4), config(128, 64, 32, 3, 4), config(256, 64, 64, 3, 8),
                   config(64, 64, 64, 4, 4), config(256, 32, 32, 3, 8)]
GROUPED_ONLY = [c for c in GROUPED_CONFIGS if c not in CONFIGS]
CONFIGS += GROUPED_ONLY


def gluon_config(bh, bw, bn, bk, stages, consumers, warps) -> triton.Config:
    """A candidate of the warp-specialized Gluon conv (kernels/conv_hopper.py, sm90): the GEMM's candidate
    (gemm.gluon_config: ring, MMA warpgroups, register split) with its rows a bh x bw pixel rectangle."""
    cfg = gemm_gluon_config(bh * bw, bn, bk, stages, consumers, warps)
    cfg.kwargs.update(RECT=True, BLOCK_H=bh, BLOCK_W=bw, SPLIT=1, ROW_STEP=1)
    return cfg


# The Gluon conv's candidates (stride 1 and 2, C a multiple of 64): the GEMM's ping-pong and one-consumer tiles
# as pixel rectangles, 8 x 8 for 7 x 7 and 14 x 14 maps, 64 channels wide for ResNet's first stage. Built for
# sm90 with triton 3.6 and 3.9 without spills (bench/gluon_compile.py --kernel conv), stride 1 and 2.
GLUON_CONFIGS = [gluon_config(8, 16, 128, 64, 4, 2, 4), gluon_config(16, 8, 128, 64, 4, 2, 4),
                 gluon_config(8, 16, 256, 64, 3, 1, 8), gluon_config(8, 8, 128, 64, 6, 2, 4),
                 gluon_config(8, 16, 64, 64, 6, 2, 4)]
CONFIGS += GLUON_CONFIGS
SPLIT_TILES = 66       # split only where the unsplit grid fills at most half of an H100's 132 SMs
SPLIT_MIN_STEPS = 8    # reduction steps (BLOCK_K channels of one tap) each slice keeps at least


def tiles(kw, sizes) -> int:
    """Output tiles (programs before splitting) of a config."""
    rows = (sizes["N"] * triton.cdiv(sizes["OH"], kw["BLOCK_H"]) * triton.cdiv(sizes["OW"], kw["BLOCK_W"])
            if kw["RECT"] else triton.cdiv(sizes["M"], kw["BLOCK_M"]))
    return rows * triton.cdiv(sizes["K"], kw["BLOCK_N"])


def prune_configs(configs, sizes):
    steps = sizes["R"] * sizes["S"] * triton.cdiv(sizes["C"], 64)

    def split_ok(c):
        s = c.kwargs["SPLIT"]
        return s == 1 or (sizes["C"] >= 16 and tiles(c.kwargs, sizes) <= SPLIT_TILES
                          and steps >= s * SPLIT_MIN_STEPS)
    if sizes.get("groups", 1) > 1:    # a group's few channels: the small tiles, unsplit, no rectangles
        keep = [c for c in GROUPED_CONFIGS if c.kwargs["BLOCK_N"] <= max(16, triton.next_power_of_2(sizes["K"]))
                and c.kwargs["BLOCK_K"] <= max(16, triton.next_power_of_2(sizes["C"]))]
        return keep or GROUPED_CONFIGS[:1]
    keep = [c for c in configs if c.kwargs["BLOCK_N"] <= max(64, triton.next_power_of_2(sizes["K"]))
            and (sizes["rect"] or not c.kwargs["RECT"] or c.kwargs.get("GLUON")) and split_ok(c)
            and (c in ROWS_CONFIGS) == sizes["rows"]
            and c not in GROUPED_ONLY
            and (not c.kwargs.get("GLUON") or sizes.get("gluon") and sizes["C"] % c.kwargs["BLOCK_K"] == 0)]
    return keep or [c for c in configs if not c.kwargs["RECT"] and (c in ROWS_CONFIGS) == sizes["rows"]][:1]


def default_config(sizes) -> triton.Config:
    """The config used without tuning (ACCELC_AUTOTUNE=0)."""
    if sizes["rect"]:
        return rect_config(8, 8, 64, 32, 3, 4)
    return config(128, 32, 32, 3, 4) if sizes.get("groups", 1) > 1 else config(64, 64, 32, 3, 4)


def interpreter_config(sizes) -> triton.Config:
    """The interpreter has no device to time configs on; its time goes by programs and reduction
    steps, not by their size: tiles of 32 pixels x 32 channels x 16 deep (rect: 4 x 8 pixels), or
    64 x 64 x 32 (rect: 8 x 8 pixels) along dims that large (a whole model's convs: fewer programs
    and steps; the conv tests' small shapes keep several small tiles and their tails). Grouped
    convs keep the small tiles."""
    big = sizes.get("groups", 1) == 1
    bn = 64 if big and sizes["K"] >= 64 else 32
    bk = 32 if big and sizes["C"] >= 32 else 16
    if sizes["rect"]:
        side = 8 if big and min(sizes["OH"], sizes["OW"]) >= 8 else 4
        return rect_config(side, 8, bn, bk, 1, 4)
    return config(64 if big and sizes["M"] >= 64 else 32, bn, bk, 1, 4)
