"""A generation step's decoder as one accelc::decode_step call (kernels/decode_step.py: the persistent kernel for one
token; #89 item 3), where the step program (accelc.static_cache, after the passes) runs a Llama-like layer as the
few-launch chain:

    q, _ = qkv_rotary(h, W_qkv, b, cos, sin, cache, positions, Hq, Hkv, norm_weight=, norm_eps=)
    a = flash_attention(q, cache[0], cache[1], mask, False, scale) -> reshape / transpose / reshape
    h2 = linear(a, W_o, None, h)                           (h through a cast to its own dtype, if any)
    g = gated_linear(h2, W_gu, None, I, act, norm_weight=, norm_eps=)
    h = linear(g, W_down, None, h2)
    ... every layer, then logits = linear(slice(rms_norm(h, w, None, eps), 1, -1), W_head)

`find(gm)` reads the chain off the graph (or says why it cannot); `take(gm)` puts the one call in its place. The
call runs the same kernels for a prompt (more than one row) and the persistent kernel for one token.
"""
from __future__ import annotations

import torch
from torch import fx

from accelc import meta, runtime
from accelc.kernels.decode_schedule import Dims
from accelc.meta import attr_value
from accelc.passes.norm_linear import norm_of

OPS = torch.ops.accelc
QKV, FLASH, LINEAR, GATED, RMS = (OPS.qkv_rotary.default, OPS.flash_attention.default, OPS.linear.default,
                                  OPS.gated_linear.default, OPS.rms_norm.default)
VIEWS = ("reshape", "view", "transpose", "_unsafe_view")


def _through_casts(n):
    """n, or what it casts where it is a cast to its own dtype (the residual's `to(float32)` of an fp32 model)."""
    while isinstance(n, fx.Node) and meta.op_name(n) == "to" and n.args and isinstance(n.args[0], fx.Node):
        src, val, got = n.args[0], n.args[0].meta.get("val"), n.meta.get("val")
        if val is None or got is None or val.dtype != got.dtype:
            break
        n = src
    return n


def _kw(n: fx.Node, names: tuple) -> list:
    """n's arguments by the op's schema names, positional or keyword."""
    schema = n.target._schema.arguments
    out = []
    for name in names:
        i = next(j for j, a in enumerate(schema) if a.name == name)
        out.append(n.args[i] if len(n.args) > i else n.kwargs.get(name, schema[i].default_value))
    return out


def _plus_residual(n, residual) -> bool:
    """n is accelc::linear(x, W) + residual: no bias, activation, norm or residual-first order of its own."""
    if n is None or n.target is not LINEAR:
        return False
    b, res, act, first, nw = _kw(n, ("bias", "residual", "activation", "residual_first", "norm_weight"))
    return b is None and _through_casts(res) is residual and act == "none" and not first and nw is None


def _user(n: fx.Node, target):
    return next((u for u in n.users if u.target is target), None)


def _after_views(n: fx.Node):
    """The first node past a run of view ops (from n, n's only reader), each read by its only reader."""
    n = meta.sole_user(n)
    while n is not None and n.op == "call_function" and meta.op_name(n) in VIEWS:
        n = meta.sole_user(n)
    return n


def _same(a, b) -> bool:
    """Two nodes computing the same thing from the same inputs (the layers' cos / sin unsqueezes)."""
    if a is b:
        return True
    return (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.op == b.op == "call_function"
            and a.target is b.target and a.args == b.args and a.kwargs == b.kwargs)


def _final(gm: fx.GraphModule, h: fx.Node):
    """(the final norm's weight, its eps, the LM head's linear, the nodes between) after the last layer's output h,
    the norm an accelc::rms_norm, the glue's own (norm_linear.norm_of), or taken into the head; else why not."""
    for head in (n for n in gm.graph.nodes if n.op == "call_function" and n.target is LINEAR):
        x, w, b, res, act, nw, neps = _kw(head, ("x", "weight", "bias", "residual", "activation", "norm_weight",
                                                 "norm_eps"))
        if not (isinstance(x, fx.Node) and meta.op_name(x) == "slice" and tuple(x.args[1:3]) == (1, -1)):
            continue
        src = x.args[0]
        if nw is not None and src is h:
            found = (nw, neps, [x])
        else:
            got = norm_of(src) if nw is None else None
            if got is None or got[0] is not h:
                continue
            found = (got[1], got[2], [src, *(got[3] or []), x])
        if b is not None or res is not None or act != "none" or found[0] is None:
            return "the LM head has a bias, a residual or an activation, or its norm no weight"
        return found[0], found[1], head, found[2] + [head]
    return "the last layer's output does not reach an LM head on the last position through a final RMSNorm"


def find(gm: fx.GraphModule):
    """(the chain's parts, None) or (None, why the step is not such a chain)."""
    qkvs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is QKV]
    if not qkvs:
        return None, "no accelc::qkv_rotary layer in the step"
    layers, nodes = [], []
    h = _kw(qkvs[0], ("x",))[0]
    common = None
    for n in qkvs:
        x, w, b, cos, sin, cache, pos, hq, hkv, nw, eps, qn = _kw(n, ("x", "weight", "bias", "cos", "sin", "cache",
                                                                    "positions", "q_heads", "kv_heads", "norm_weight",
                                                                    "norm_eps", "q_norm"))
        if x is not h:
            return None, f"{n.name} does not read the layer before it"
        if nw is None or qn is not None:
            return None, f"{n.name}: a projection without its RMSNorm, or with per-head norms"
        if common is None:
            common = (cos, sin, pos, hq, hkv, b is not None)
        elif not (_same(cos, common[0]) and _same(sin, common[1]) and pos is common[2]
                  and (hq, hkv, b is not None) == common[3:]):
            return None, f"{n.name}: rotary inputs, positions or heads differ from the first layer's"
        if set(meta.op_name(u) for u in n.users) != {"getitem"} or any(u.args[1] != 0 for u in n.users):
            return None, f"{n.name}: the rows it writes are read"
        q = next(iter(n.users))
        att = meta.sole_user(q)
        if att is None or att.target is not FLASH:
            return None, f"{n.name}: q is not read by accelc::flash_attention alone"
        aq, ak, av, mask, causal, scale, *rest = _kw(att, ("q", "k", "v", "mask", "is_causal", "scale", "qk_int8",
                                                           "empty_nan", "fp8"))
        halves = all(meta.op_name(t) == "select" and t.args[0] is cache and t.args[1:] == (0, i)
                     for i, t in enumerate((ak, av)))
        if causal or any(rest) or mask is None or not halves:
            return None, f"{att.name}: not the cache's decode attention under a mask"
        o = _after_views(att)
        if not _plus_residual(o, h):
            return None, f"{att.name}: its output does not reach an output projection plus the layer's input"
        gu = _user(o, GATED) or next((_user(u, GATED) for u in o.users if _through_casts(u) is o), None)
        if gu is None:
            return None, f"{o.name}: no gated MLP reads it"
        gx, wgu, gb, inter, act, _, gnw, geps = _kw(gu, ("x", "weight", "bias", "n", "activation", "allow_tf32",
                                                         "norm_weight", "norm_eps"))
        if gx is not o or gb is not None or gnw is None:
            return None, f"{gu.name}: not a normalized, unbiased gated MLP"
        down = meta.sole_user(gu)
        if not _plus_residual(down, o):
            return None, f"{gu.name}: its output does not reach a down projection plus the attention's output"
        wo, wd = _kw(o, ("weight",))[0], _kw(down, ("weight",))[0]
        layers.append(dict(n1=nw, wqkv=w, b=b, wo=wo, n2=gnw, wgu=wgu, wd=wd, cache=cache, eps=(eps, geps),
                           inter=inter, act=act, mask=mask, scale=scale))
        nodes += [n, q, att, o, gu, down]
        h = down
    final = _final(gm, h)
    if isinstance(final, str):
        return None, final
    fw, feps, head, tail = final
    first = layers[0]
    for i, lay in enumerate(layers):
        if (lay["eps"], lay["inter"], lay["act"], lay["scale"]) != (first["eps"], first["inter"], first["act"],
                                                                    first["scale"]) or lay["mask"] is not first["mask"]:
            return None, f"layer {i} differs from the first in its norms, MLP, mask or scale"
    return dict(layers=layers, x=_kw(qkvs[0], ("x",))[0], cos=common[0], sin=common[1], positions=common[2],
                heads=common[3:5], bias=common[5], norm=fw, eps=feps, head_w=_kw(head, ("weight",))[0], head=head,
                nodes=nodes + tail), None


def take(gm: fx.GraphModule) -> str | None:
    """The chain replaced by one accelc::decode_step call in gm (recompiled); or why not, gm unchanged."""
    c, why = find(gm)
    if c is None:
        return why
    first = c["layers"][0]
    cache = attr_value(gm, first["cache"])
    head = attr_value(gm, c["head_w"])
    dims = Dims(layers=len(c["layers"]), hidden=head.shape[1], q_heads=c["heads"][0], kv_heads=c["heads"][1],
                head_dim=cache.shape[-1], inter=first["inter"], vocab=head.shape[0], max_len=cache.shape[3],
                bias=c["bias"], activation=first["act"])
    weights = []
    for lay in c["layers"]:
        weights += [lay["n1"], lay["wqkv"], lay["b"] if c["bias"] else lay["wqkv"], lay["wo"], lay["n2"], lay["wgu"],
                    lay["wd"]]
    graph = gm.graph
    with graph.inserting_before(c["head"]):
        call = graph.call_function(OPS.decode_step.default, (
            c["x"], c["cos"], c["sin"], c["positions"], first["mask"], weights, [lay["cache"] for lay in c["layers"]],
            c["norm"], c["head_w"], dims.as_list(), [float(first["eps"][0]), float(first["eps"][1]), float(c["eps"])],
            float(first["scale"])))
    call.meta.update({k: v for k, v in c["head"].meta.items() if k == "val"})
    c["head"].replace_all_uses_with(call)
    doomed, changed = set(c["nodes"]), True
    while changed:      # (the chain's nodes, readers first, and the casts and views between them)
        changed = False
        for n in reversed(list(graph.nodes)):
            if not n.users and n.op == "call_function" and (n in doomed or not n.is_impure()):
                graph.erase_node(n)
                changed = True
    graph.lint()
    gm.recompile()
    return None


MODES = ("auto", "persistent", "chain")      # OptimizeConfig.decode_step


class _Seen(fx.Interpreter):
    """Runs a graph, keeping the values of `nodes`."""

    def __init__(self, gm, nodes):
        super().__init__(gm)
        self.nodes, self.seen = set(nodes), {}

    def run_node(self, n):
        out = super().run_node(n)
        if n in self.nodes:
            self.seen[n] = out
        return out


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A graph module over a copy of gm's graph, sharing its tensors."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen          # (the call's flattening of inputs and outputs, as gm's)
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _differs(gm, trial, c: dict, inputs: tuple, tol: float) -> str | None:
    """Why trial's step is not gm's on `inputs` (the decode race's): its outputs, or the cache rows it writes at
    the token's positions, past `tol` (relative L2), or it does not decode one token; else None."""
    from accelc.numerics import rel_l2
    watch = _Seen(gm, [c["positions"], c["x"]])
    with torch.no_grad():
        want = watch.run(*inputs)
        x, pos = watch.seen[c["x"]], watch.seen[c["positions"]]
        if x.shape[0] * x.shape[1] != 1:
            return f"it serves one token of one sequence, the step decodes {x.shape[0]} x {x.shape[1]}"
        caches = [attr_value(gm, lay["cache"]) for lay in c["layers"]]
        rows = [t[:, :, :, pos].clone() for t in caches]
        got = trial(*inputs)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and rel_l2(a, b) > tol:
            return f"its output is {rel_l2(a, b):.1e} off the chain's"
    for i, (t, r) in enumerate(zip(caches, rows)):
        if rel_l2(t[:, :, :, pos], r) > tol:
            return f"layer {i}'s cache rows are {rel_l2(t[:, :, :, pos], r):.1e} off the chain's"
    return None


def offer(gm: fx.GraphModule, ctx, before=None) -> str:
    """A generation step's decode as one persistent kernel (take) where it gives the chain's step on the guard's
    race inputs (a decode step) and, under OptimizeConfig.decode_step "auto", is the faster of the two on a GPU;
    what was decided, in words (the summary's generation line), "" where nothing was offered. before(): called
    just before gm changes (the layer records of the chain it replaces, kept for the summary)."""
    mode = ctx.config.decode_step
    if mode == "chain" or ctx.race is None or not any(n.target is QKV for n in gm.graph.nodes):
        return ""
    c, why = find(gm)
    if c is None:
        return f"the chain of kernels (not one persistent kernel: {why})"
    if mode == "auto" and not runtime.can_time(ctx.device):     # (nothing to race: no trial made and checked)
        return "the chain of kernels (one persistent kernel is raced against it on a GPU only)"
    trial = _copy(gm)
    take(trial)
    inputs = ctx.race[0]
    dtype = attr_value(gm, c["head_w"]).dtype
    bad = _differs(gm, trial, c, inputs, 2 * ctx.config.tolerance_for(dtype))
    if bad:
        return f"the chain of kernels (one persistent kernel not taken: {bad})"
    if mode == "auto":
        from accelc.latency import layer_ms
        with torch.no_grad():
            chain = layer_ms(lambda: gm(*inputs), ctx.device, rep_ms=50)[0]
            one = layer_ms(lambda: trial(*inputs), ctx.device, rep_ms=50)[0]
        if one >= chain:
            return f"the chain of kernels, {chain * 1e3:.0f} us a step (one persistent kernel: {one * 1e3:.0f} us)"
        line = f"one persistent kernel, {one * 1e3:.0f} us a step (the chain of kernels: {chain * 1e3:.0f} us)"
    else:
        line = "one persistent kernel (OptimizeConfig.decode_step='persistent': not raced)"
    if before is not None:
        before()
    gm.graph = trial.graph      # (the graph checked and raced is the one kept; gm recompiles)
    return line
