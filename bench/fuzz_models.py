"""A testing module: random models for the differential fuzzer (bench/fuzz.py, tests/test_fuzz.py); not an
example model (accelc.models), so the CLI and the built-in model list never offer them.

`FuzzNet(seed, size)` draws a model from the ops accelc rewrites and the ops it does not, in the
spellings real model code uses: linears as nn.Linear, `x @ W.T`, `x @ W.t()`, einsum and addmm;
activations as modules, functions, in-place and written out; residual adds (also broadcast ones);
LayerNorm and a written-out RMSNorm; attention through SDPA (causal, masked) and written out;
a SwiGLU MLP; reshapes, transposes, slices and concatenations; convs of every kernel size, stride,
dilation and groups, BatchNorm, pooling, channels-last layout, flattening heads. Everything is
decided at build time from the seed, so the forward is traceable and the same seed gives the same
model. `describe()` lists the ops drawn: the fuzzer records it with every failure.
"""
from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from torch import nn

from fuzz_calls import CALLS, Restated, SizeBranch, Twin, call_class, optimized_twice, threaded  # noqa: F401

# size -> (batch, sequence lengths, widths, channels, image sides)
SIZES = {
    "tiny": dict(batch=(1, 2, 3), seq=(5, 8, 13), width=(16, 24, 32), channels=(3, 8, 16), side=(6, 9, 12)),
    "gpu": dict(batch=(1, 2, 4, 8), seq=(7, 64, 128, 197), width=(64, 96, 128, 256), channels=(3, 16, 32, 64),
                side=(14, 17, 28, 32)),
}

_ACTS = ["relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "relu_module", "relu_inplace", "gelu_written",
         "gelu_module"]


def _act(x, name):
    if name == "relu":
        return torch.relu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "tanh":
        return torch.tanh(x)
    if name == "relu_inplace":
        return F.relu(x, inplace=True)
    if name == "gelu_written":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    raise ValueError(name)


class FuzzNet(nn.Module):
    def __init__(self, seed: int, size: str = "tiny"):
        super().__init__()
        rng = random.Random(seed)
        s = SIZES[size]
        self.seed, self.kind = seed, rng.choice(["seq", "seq", "image"])
        self.batch = rng.choice(s["batch"])
        self.channels_last_input = self.kind == "image" and rng.random() < 0.3
        self.steps: list[tuple] = []
        self.relu_module, self.gelu_module = nn.ReLU(), nn.GELU()
        self.mods = nn.ModuleDict()
        self.params = nn.ParameterDict()
        if self.kind == "seq":
            self.in_shape = (rng.choice(s["seq"]), rng.choice(s["width"]))
            self._build_seq(rng, s, self.in_shape[1])
        else:
            self.in_shape = (rng.choice(s["channels"]), rng.choice(s["side"]), rng.choice(s["side"]))
            self._build_image(rng, s, self.in_shape[0])
        self.two_outputs = rng.random() < 0.2

    # -- building ------------------------------------------------------------------------------

    def _name(self, base):
        return f"{base}{len(self.steps)}"

    def _linear(self, d_in, d_out, bias=True):
        name = self._name("fc")
        self.mods[name] = nn.Linear(d_in, d_out, bias=bias)
        return name

    def _weight(self, d_out, d_in):
        name = self._name("w")
        self.params[name] = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        return name

    def _build_seq(self, rng, s, d):
        for _ in range(rng.randint(2, 6)):
            op = rng.choice(["linear", "linear", "matmul_T", "matmul_t", "einsum", "addmm", "act", "residual_mlp",
                             "layernorm", "rmsnorm", "attention", "swiglu", "reshape", "slice_cat", "transpose_view",
                             "broadcast_residual", "softmax"])
            if op == "linear":
                d2 = rng.choice(s["width"])
                self.steps.append(("linear", self._linear(d, d2, rng.random() < 0.8), rng.choice(_ACTS + ["none"])))
                d = d2
            elif op in ("matmul_T", "matmul_t", "einsum"):
                d2 = rng.choice(s["width"])
                self.steps.append((op, self._weight(d2, d)))
                d = d2
            elif op == "addmm":
                d2 = rng.choice(s["width"])
                w = self._name("w")
                self.params[w] = nn.Parameter(torch.randn(d, d2) / d ** 0.5)          # (K, N): GPT-2's Conv1D
                b = self._name("b")
                self.params[b] = nn.Parameter(torch.randn(d2) * 0.1)
                self.steps.append(("addmm", w, b))
                d = d2
            elif op == "act":
                self.steps.append(("act", rng.choice(_ACTS)))
            elif op == "residual_mlp":
                hidden = rng.choice(s["width"])
                self.steps.append(("residual_mlp", self._linear(d, hidden), rng.choice(_ACTS)))
                self.mods[self.steps[-1][1] + "_out"] = nn.Linear(hidden, d)
            elif op == "layernorm":
                name = self._name("ln")
                self.mods[name] = nn.LayerNorm(d)
                self.steps.append(("layernorm", name))
            elif op == "rmsnorm":
                name = self._name("g")
                self.params[name] = nn.Parameter(1.0 + 0.1 * torch.randn(d))
                self.steps.append(("rmsnorm", name))
            elif op == "attention":
                heads = [h for h in (1, 2, 4, 8) if d % h == 0 and d // h >= 8]
                h = rng.choice(heads)
                self.steps.append(("attention", self._linear(d, 3 * d), h, rng.choice(["sdpa", "sdpa_causal",
                                   "sdpa_mask", "written", "written_causal"])))
                self.mods[self.steps[-1][1] + "_out"] = nn.Linear(d, d)
            elif op == "swiglu":
                hidden = rng.choice(s["width"])
                self.steps.append(("swiglu", self._linear(d, hidden, False), hidden))
                self.mods[self.steps[-1][1] + "_up"] = nn.Linear(d, hidden, bias=False)
                self.mods[self.steps[-1][1] + "_down"] = nn.Linear(hidden, d, bias=False)
            elif op == "reshape" and d % 2 == 0:
                self.steps.append(("reshape",))
            elif op == "slice_cat" and d % 2 == 0:
                self.steps.append(("slice_cat",))
            elif op == "transpose_view":
                self.steps.append(("transpose_view",))
            elif op == "broadcast_residual":
                name = self._name("r")
                self.params[name] = nn.Parameter(torch.randn(d) if rng.random() < 0.5 else torch.randn(1, d))
                self.steps.append(("broadcast_residual", self._linear(d, d), name))
            elif op == "softmax":
                self.steps.append(("softmax",))
        self.out_width = d

    def _build_image(self, rng, s, c):
        h, w = self.in_shape[1:]
        for _ in range(rng.randint(2, 6)):
            op = rng.choice(["conv", "conv", "conv_bn_act", "basic_block", "pool", "channels_last", "act",
                             "depthwise"])
            if op in ("conv", "conv_bn_act", "depthwise"):
                k = rng.choice([1, 3, 3, 5, 7]) if op != "depthwise" else rng.choice([3, 7])
                stride = rng.choice([1, 1, 2])
                dil = rng.choice([1, 1, 2]) if k > 1 else 1
                pad = rng.choice([0, (k // 2) * dil])
                groups = c if op == "depthwise" else 1
                c2 = c if op == "depthwise" else rng.choice(s["channels"][1:])
                if (h + 2 * pad - dil * (k - 1) - 1) < 0 or (w + 2 * pad - dil * (k - 1) - 1) < 0:
                    continue
                name = self._name("conv")
                self.mods[name] = nn.Conv2d(c, c2, k, stride, pad, dil, groups, bias=rng.random() < 0.5)
                bn = None
                if op == "conv_bn_act" or rng.random() < 0.3:
                    bn = name + "_bn"
                    self.mods[bn] = nn.BatchNorm2d(c2)
                    with torch.no_grad():
                        self.mods[bn].running_mean.uniform_(-0.3, 0.3)
                        self.mods[bn].running_var.uniform_(0.5, 2.0)
                        self.mods[bn].weight.uniform_(0.5, 1.5)
                        self.mods[bn].bias.uniform_(-0.2, 0.2)
                self.steps.append(("conv", name, bn, rng.choice(_ACTS + ["none"]) if op != "conv" else "none"))
                h = (h + 2 * pad - dil * (k - 1) - 1) // stride + 1
                w = (w + 2 * pad - dil * (k - 1) - 1) // stride + 1
                c = c2
            elif op == "basic_block":
                name = self._name("block")
                self.mods[name] = nn.Conv2d(c, c, 3, 1, 1, bias=False)
                self.mods[name + "_bn"] = nn.BatchNorm2d(c)
                self.steps.append(("basic_block", name))
            elif op == "pool" and h >= 4 and w >= 4:
                self.steps.append(("pool", rng.choice(["max", "avg"])))
                h, w = h // 2, w // 2
            elif op == "channels_last":
                self.steps.append(("channels_last",))
            elif op == "act":
                self.steps.append(("act", rng.choice(_ACTS)))
        head = rng.choice(["mean", "flatten_view", "flatten", "none"])
        if head == "flatten_view" and (self.channels_last_input or any(st[0] == "channels_last" for st in self.steps)):
            head = "flatten"     # eager's own .view() fails on a channels-last tensor
        if head != "none":
            width = c if head == "mean" else c * h * w
            name = self._name("head")
            self.mods[name] = nn.Linear(width, rng.choice(s["width"]))
            self.steps.append(("head", head, name))

    def describe(self) -> str:
        """The ops drawn, with their variants (activation, attention form, conv kind, head)."""
        words = set(_ACTS) | {"sdpa", "sdpa_causal", "sdpa_mask", "written", "written_causal", "max", "avg",
                              "mean", "flatten_view", "flatten"}
        steps = []
        for step in self.steps:
            extra = [str(a) for a in step[1:] if isinstance(a, str) and a in words]
            if step[0] == "conv":
                conv = self.mods[step[1]]
                extra.insert(0, f"{conv.kernel_size[0]}x{conv.kernel_size[1]}/s{conv.stride[0]}/d{conv.dilation[0]}"
                                f"/g{conv.groups}{'+bn' if step[2] else ''}")
            steps.append(step[0] + (f"[{','.join(extra)}]" if extra else ""))
        return f"seed {self.seed}: {self.kind} {tuple(self.in_shape)} batch {self.batch}: " + " -> ".join(steps)

    # -- running -------------------------------------------------------------------------------

    def example_inputs(self, batch_size=None, generator=None):
        x = torch.randn(batch_size or self.batch, *self.in_shape, generator=generator)
        if self.channels_last_input:
            x = x.contiguous(memory_format=torch.channels_last)
        return (x,)

    def forward(self, x):
        first = None
        for step in self.steps:
            x = self._run(step, x)
            if first is None:
                first = x
        return (x, first) if self.two_outputs and first is not None else x

    def _run(self, step, x):
        op = step[0]
        m, p = self.mods, self.params
        if op == "linear":
            y = m[step[1]](x)
            return y if step[2] == "none" else self._act_any(step[2], y)
        if op == "matmul_T":
            return x @ p[step[1]].T
        if op == "matmul_t":
            return torch.matmul(x, p[step[1]].t())
        if op == "einsum":
            return torch.einsum("...d,ed->...e", x, p[step[1]])
        if op == "addmm":
            w, b = p[step[1]], p[step[2]]
            return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[1])
        if op == "act":
            return self._act_any(step[1], x)
        if op == "residual_mlp":
            return x + m[step[1] + "_out"](self._act_any(step[2], m[step[1]](x)))
        if op == "layernorm":
            return m[step[1]](x)
        if op == "rmsnorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * p[step[1]]
        if op == "attention":
            return self._attention(step, x)
        if op == "swiglu":
            return m[step[1] + "_down"](F.silu(m[step[1]](x)) * m[step[1] + "_up"](x))
        if op == "reshape":
            B, L, D = x.shape
            return x.view(B, L, 2, D // 2).transpose(-1, -2).reshape(B, L, D)
        if op == "slice_cat":
            d = x.shape[-1] // 2
            return torch.cat([x[..., :d] * 2.0, x[..., d:]], dim=-1)
        if op == "transpose_view":
            return x.transpose(0, 1).contiguous().transpose(0, 1)
        if op == "broadcast_residual":
            return torch.relu(m[step[1]](x) + p[step[2]])
        if op == "softmax":
            return x.softmax(-1) * x.shape[-1]
        if op == "conv":
            y = m[step[1]](x)
            if step[2] is not None:
                y = m[step[2]](y)
            return y if step[3] == "none" else self._act_any(step[3], y)
        if op == "basic_block":
            return torch.relu(m[step[1] + "_bn"](m[step[1]](x)) + x)
        if op == "pool":
            return F.max_pool2d(x, 2) if step[1] == "max" else F.avg_pool2d(x, 2)
        if op == "channels_last":
            return x.contiguous(memory_format=torch.channels_last)
        if op == "head":
            if step[1] == "mean":
                x = x.mean((2, 3))
            elif step[1] == "flatten_view":
                x = x.view(x.size(0), -1)              # LeNet / VGG: needs the NCHW layout
            else:
                x = torch.flatten(x, 1)
            return m[step[2]](x)
        raise ValueError(op)

    def _act_any(self, name, x):
        if name == "relu_module":
            return self.relu_module(x)
        if name == "gelu_module":
            return self.gelu_module(x)
        return _act(x, name)

    def _attention(self, step, x):
        B, L, D = x.shape
        h, style = step[2], step[3]
        q, k, v = self.mods[step[1]](x).split(D, dim=-1)
        q, k, v = (t.view(B, L, h, D // h).transpose(1, 2) for t in (q, k, v))
        if style.startswith("sdpa"):
            if style == "sdpa_mask":
                keep = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(1)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            else:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=style == "sdpa_causal")
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(D // h)
            if style == "written_causal":
                causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
                scores = scores.masked_fill(~causal, float("-inf"))
            o = scores.softmax(-1) @ v
        return self.mods[step[1] + "_out"](o.transpose(1, 2).reshape(B, L, D))


# relative L2 floors against the fp64 reference (a model's worth of roundings of each dtype)
FLOOR = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}

def run_case(seed: int, size: str = "tiny", device="cpu", dtype=torch.float32, config=None,
             reuse: bool = False) -> dict:
    """Optimize FuzzNet(seed) and compare it with eager against an fp64 reference, on a new draw
    of the inputs and at another batch size (reuse: the reuse class, Restated, for the call class). Returns a record: status "ok", "refused" (an
    AccelcError: a clean refusal), "invalid" (eager itself fails on the draw: not counted),
    "crash" (any other exception, where) or "mismatch" (error
    over max(FLOOR, 4 x eager's own error), non-finite where the reference is finite, or another
    memory layout than eager's)."""
    import collections
    import copy
    import traceback

    import accelc
    from accelc.errors import AccelcError, short_error
    from accelc.numerics import rel_l2
    from torch.utils import _pytree as pytree

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = FuzzNet(seed, size).to(device, dtype).eval()
    calls = "reuse" if reuse else call_class(seed)
    rec = dict(seed=seed, size=size, dtype=str(dtype).replace("torch.", ""), model=net.describe(), status="ok",
               calls=calls)
    model = (Twin(net) if calls == "alias" else SizeBranch(net) if calls in ("branch", "keywords")
             else Restated(net).to(device) if reuse else net).eval()
    twice = calls == "alias"

    def inputs(batch=None):
        one = tuple(t.to(device, dtype) for t in net.example_inputs(batch, generator=gen))
        return one + tuple(t.to(device, dtype) for t in net.example_inputs(batch, generator=gen)) if twice else one

    example = inputs()
    if twice:       # one tensor given as both inputs at optimize; two different ones at every call after
        example = (example[0], example[0])
    if calls in ("branch", "reuse") and net.batch == 1:    # optimized above 1, called at 1: the other branch
        example = inputs(2)
    try:
        with torch.no_grad():
            model(*[t.clone() for t in example])
    except Exception as e:     # a draw eager itself cannot run: not a test of accelc
        return dict(rec, status="invalid", reason=short_error(e))
    try:
        config = config or accelc.OptimizeConfig(only_if_faster=False)
        opt = optimized_twice(model, example, config, device) if reuse else accelc.optimize(model, example, config)
    except AccelcError as e:
        return dict(rec, status="refused", reason=short_error(e))
    except Exception as e:
        return dict(rec, status="crash", where="optimize", reason=short_error(e), trace=traceback.format_exc()[-2000:])
    rec.update(rewritten=len(opt.rewritten), reverted=sum(r.status == "reverted" for r in opt.layers),
               kinds=dict(collections.Counter(r.kind for r in opt.rewritten)))
    reference = copy.deepcopy(model).double()
    worst = 0.0
    batch0 = example[0].shape[0]
    others = [("new draw", batch0), ("other batch", batch0 + 2 if batch0 <= 2 else 1)]
    if calls in ("branch", "reuse"):
        others.append(("batch 1", 1))
    kwargs = dict(scale=2.0, bias=None) if calls == "keywords" else {}   # given at their defaults
    for label, batch in others:
        x = inputs(batch)
        try:
            with torch.no_grad():
                out = threaded(opt, x) if calls == "threads" else opt(*[t.clone() for t in x], **kwargs)
        except AccelcError as e:     # a clear refusal of these shapes: fine, not a wrong number
            rec.setdefault("refused_calls", []).append(f"{label}: {short_error(e)}")
            continue
        except Exception as e:
            return dict(rec, status="crash", where=f"call ({label}, batch {batch})", reason=short_error(e),
                        trace=traceback.format_exc()[-2000:])
        with torch.no_grad():
            eager = model(*[t.clone() for t in x])
            ref = reference(*[t.double() for t in x])
        for o, e, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(eager), pytree.tree_leaves(ref)):
            problem = ""
            finite = torch.isfinite(r)
            if o.shape != e.shape or o.dtype != e.dtype:
                problem = f"output {tuple(o.shape)} {o.dtype}, eager {tuple(e.shape)} {e.dtype}"
            elif any(e.is_contiguous(memory_format=f) and not o.is_contiguous(memory_format=f) for f in
                     ([torch.contiguous_format] + ([torch.channels_last] if e.dim() == 4 else []))):
                problem = f"output strides {o.stride()}, eager's {e.stride()} (contiguous)"
            elif not torch.isfinite(o[finite]).all():
                problem = "non-finite where the reference is finite"
            else:
                err, eager_err = rel_l2(o[finite], r[finite]), rel_l2(e[finite], r[finite])
                worst = max(worst, err)
                if err > max(FLOOR[dtype], 4 * eager_err):
                    problem = f"error {err:.2e} vs eager's {eager_err:.2e}"
            if problem:
                return dict(rec, status="mismatch", where=f"{label}, batch {batch}", reason=problem)
    return dict(rec, rel_error=worst)
