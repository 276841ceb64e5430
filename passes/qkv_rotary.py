"""qkv_rotary: a generation step's attention input, from the q / k / v projection to the cache write, as one
accelc::qkv_rotary call (kernels/qkv_rotary.py; #89's few-launch step).

The step program (accelc.static_cache) computes, in each decoder layer of a Llama-like model:

    y = linear(x, W_qkv)                       sibling_linears' stacked q / k / v, or the model's own (Phi-3's
                                               qkv_proj); norm_linear's RMSNorm taken in
    q, k, v = narrow(y, -1, ...) -> view (B, S, H, D) -> transpose(1, 2)        (or slices: Phi-3)
    q, k = rope(q, cos, sin), rope(k, cos, sin)        the rotary pass's calls (its kernel, or its reference call
                                                       left to the Inductor glue); a partial rotation of all D
                                                       columns (Phi-3: cat of the rotation and an empty slice) too
    kv = cache.index_copy_(3, positions, stack((k, v)))    the static cache's write; attention reads kv[0], kv[1]

which a decode step launched as the GEMV, two rotary kernels (one glue group under Inductor) and the write's glue.
Here the group becomes one call that writes the cache and returns q and the rows written; attention reads the
cache as before (its halves now read after the call, where they were read after the write). The layer's original
is every node of the group (the projection's and rotations' own originals inlined), returning q and the stacked
rows, so the guard checks and races the whole as one layer and a revert puts it all back.

Runs last, on what the passes before left: a float projection (a weight-only int8 / fp8 one keeps its own GEMV),
no residual or activation of its own, each value of the group read only inside it, q's readers after the write.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from accelc import meta
from accelc.capture import erase_dead
from accelc.graph_order import in_graph_order
from accelc.kernels.qkv_rotary import why_unsupported
from accelc.kernels.rotary import rotary_embedding_ref
from accelc.meta import attr_value
from accelc.passes.norm_linear import norm_of
from accelc.records import Rewrite
from accelc.rewrite import Pass, inline, register_layer, replace_uses, unique_name

QKV_ROTARY = torch.ops.accelc.qkv_rotary.default
LINEAR = torch.ops.accelc.linear.default
ROTARY = (torch.ops.accelc.rotary_embedding.default, rotary_embedding_ref)
_PLAIN = {"residual": None, "activation": "none", "residual_first": False}


def _sole(n: fx.Node, name: str | tuple) -> fx.Node | None:
    """n's one reader, where its op is `name` (one of them)."""
    u = meta.sole_user(n)
    names = (name,) if isinstance(name, str) else name
    return u if u is not None and u.op == "call_function" and meta.op_name(u) in names else None


def _split(n: fx.Node, width: int):
    """(start, length) of the columns a narrow or slice of the projection's last dim takes, or None."""
    name = meta.op_name(n)
    if name == "narrow":
        dim, start, length = meta.arg(n, 1, "dim"), meta.arg(n, 2, "start"), meta.arg(n, 3, "length")
    elif name == "slice" and meta.arg(n, 4, "step", 1) == 1:
        dim, start, end = meta.arg(n, 1, "dim", 0), meta.arg(n, 2, "start", 0), meta.arg(n, 3, "end")
        start = 0 if start is None else start
        length = min(width if end is None else end, width) - start if isinstance(end, (int, type(None))) else None
    else:
        return None
    ok = dim in (-1, 2) and isinstance(start, int) and isinstance(length, int) and 0 <= start and length > 0
    return (start, length) if ok else None


def _below(n: fx.Node, limit: int) -> list:
    """The nodes that read n, and those that read them, breadth first, at most `limit`."""
    seen, todo = [], list(n.users)
    while todo and len(seen) < limit:
        u = todo.pop(0)
        if u not in seen:
            seen.append(u)
            todo += list(u.users)
    return seen


def _heads(split: fx.Node):
    """split -> view / reshape (B, S, H, D) [-> an RMSNorm of each head] -> transpose(1, 2): (the transpose, the
    norm as norm_linear.norm_of finds it, or None), or None."""
    view = _sole(split, ("view", "reshape", "_unsafe_view"))
    if view is None:
        return None
    t, norm = _sole(view, "transpose"), None
    if t is None:       # (Qwen3's q_norm / k_norm: the norm's nodes between the view and the transpose)
        t = next((u for u in _below(view, 12) if meta.op_name(u) == "transpose"), None)
        norm = norm_of(t.args[0]) if t is not None and isinstance(t.args[0], fx.Node) else None
        if norm is None or norm[0] is not view or len(t.args[0].users) != 1:
            return None
    if sorted(d % 4 for d in (meta.arg(t, 1, "dim0"), meta.arg(t, 2, "dim1"))) != [1, 2]:
        return None
    shape = meta.tensor_meta(view).shape if meta.tensor_meta(view) is not None else ()
    return (t, norm) if len(shape) == 4 else None


def _empty(n: fx.Node) -> bool:
    m = meta.tensor_meta(n)
    return m is not None and len(m.shape) == 4 and m.shape[-1] == 0


def _rope(t: fx.Node):
    """The rotation of the heads `t`: (its output, the rotary call, cos, sin, the nodes between), or None. The call
    reads t, or an alias of it; a partial rotation of all D columns (Phi-3's `cat((rope(t[..., :D]), t[..., D:]))`)
    reads the whole head through an alias and concatenates an empty slice after it."""
    aliases = [u for u in t.users if meta.op_name(u) == "alias"]
    calls = [u for a in (t, *aliases) for u in a.users if u.op == "call_function" and u.target in ROTARY
             and u.args[0] is a and len(u.args) == 3]
    if len(calls) != 1 or any(list(a.users) != calls for a in aliases):
        return None
    r = calls[0]
    rest = [u for u in t.users if u is not r and u not in aliases]
    if not rest:
        return r, r, r.args[1], r.args[2], aliases
    cat = meta.sole_user(rest[0])
    if not (len(rest) == 1 and meta.op_name(rest[0]) == "slice" and _empty(rest[0]) and cat is not None
            and meta.op_name(cat) == "cat" and list(cat.args[0]) == [r, rest[0]] and meta.arg(cat, 1, "dim", 0) in (-1, 3)
            and list(r.users) == [cat]):
        return None
    return cat, r, r.args[1], r.args[2], aliases + rest


def _up(n, steps: int):
    """The node `steps` first arguments above n, or None."""
    for _ in range(steps):
        n = n.args[0] if isinstance(n, fx.Node) and n.args else None
    return n if isinstance(n, fx.Node) else None


def _group(write: fx.Node):
    """The nodes of one layer's attention input ending in the cache write `write` (see the module docstring):
    a dict of its parts, or None where the graph is not that."""
    cache, dim, positions, src = (list(write.args) + [None] * 4)[:4]
    if not (isinstance(cache, fx.Node) and cache.op == "get_attr" and dim == 3 and isinstance(src, fx.Node)
            and meta.op_name(src) == "stack" and meta.arg(src, 1, "dim", 0) == 0 and len(src.args[0]) == 2
            and len(src.users) == 1 and isinstance(positions, fx.Node)):
        return None
    k_out, v_t = src.args[0]
    lin = _up(v_t, 3)        # transpose <- view <- narrow or slice <- the projection
    width = meta.tensor_meta(lin).shape[-1] if meta.tensor_meta(lin) is not None else None
    if not (isinstance(lin, fx.Node) and lin.target is LINEAR and meta.rewrite_of(lin) is not None and width
            and len(lin.users) == 3):
        return None
    parts = {}
    for split in lin.users:
        at, heads = _split(split, width), _heads(split)
        if at is None or heads is None:
            return None
        parts[at[0]] = (split, heads[0], at[1], heads[1])
    (q_at, q), (k_at, k), (v_at, v) = sorted(parts.items())
    lengths = [q[2], k[2], v[2]]
    if q_at != 0 or k_at != lengths[0] or v_at != lengths[0] + lengths[1] or sum(lengths) != width or v[1] is not v_t \
            or v[3] is not None or (q[3] is None) != (k[3] is None):
        return None
    found_q, found_k = _rope(q[1]), _rope(k[1])
    if found_q is None or found_k is None or found_k[0] is not k_out or len(k_out.users) != 1 \
            or found_q[2:4] != found_k[2:4]:
        return None
    heads = [m for p in (q, k, v) for m in (p[0], meta.sole_user(p[0]), p[1])]
    norms = [p[3] for p in (q, k)] if q[3] is not None else None        # (h, weight, eps, its nodes, its layer)
    inner = [n for nm in norms or () for n in ([nm[4]] if nm[4] is not None else nm[3])]
    return dict(lin=lin, heads=heads, q_out=found_q[0], k_out=k_out, stack=src, write=write, cache=cache,
                inner=[*inner, *found_q[4], found_q[1], *found_k[4], found_k[1]], positions=positions,
                cos=found_k[2], sin=found_k[3], lengths=lengths, norms=norms)


def _linear_args(lin: fx.Node) -> dict:
    """accelc::linear's arguments by name."""
    return {**dict(zip(("x", "weight", "bias", "residual", "activation", "residual_first", "allow_tf32"), lin.args)),
            **lin.kwargs}


def _why_not(gm, g: dict, order: dict) -> str | None:
    kw = _linear_args(g["lin"])
    if any(kw.get(k, v) != v for k, v in _PLAIN.items()):
        return "the projection has a residual or activation of its own"
    cache = attr_value(gm, g["cache"])
    D = cache.shape[-1] if isinstance(cache, torch.Tensor) and cache.dim() == 5 else 0
    q_len, k_len, v_len = g["lengths"]
    if not D or q_len % D or k_len != v_len or k_len % D:
        return "the projection's q / k / v widths are not whole heads of the cache's head dim"
    x = meta.tensor_meta(kw.get("x"))
    for split, length in zip(g["heads"][::3], g["lengths"]):   # heads of D consecutive columns each, as the kernel reads
        view = meta.tensor_meta(meta.sole_user(split))
        if x is None or len(x.shape) != 3 or view is None or view.shape != (*x.shape[:2], length // D, D):
            return "the heads are not split as (batch, length, heads, the cache's head dim)"
    norms = g["norms"]
    if norms is not None:
        weights = [nm[1] for nm in norms]
        if norms[0][2] != norms[1][2] or not isinstance(norms[0][2], (int, float)):
            return "q's and k's head norms have different or no constant eps"
        if any(w is None or w.op != "get_attr" or attr_value(gm, w).dtype != x.dtype for w in weights):
            return "a head norm's weight is not a parameter of the model's dtype"
    if any(order[u] < order[g["write"]] for u in g["q_out"].users):
        return "q is read before the cache write"
    ts = [meta.meta_tensor(kw.get("x")), meta.meta_tensor(kw.get("weight")), meta.meta_tensor(kw.get("bias")),
          meta.meta_tensor(g["cos"]), meta.meta_tensor(g["sin"]), cache.to("meta"), meta.meta_tensor(g["positions"]),
          q_len // D, k_len // D, meta.meta_tensor(kw.get("norm_weight")), kw.get("norm_eps"),
          *((attr_value(gm, nm[1]).to("meta") for nm in norms) if norms else (None, None)),
          float(norms[0][2]) if norms else None]
    if any(t is None for t in ts[:2] + ts[3:5] + ts[6:7]) or (kw.get("bias") is not None and ts[2] is None) \
            or (kw.get("norm_weight") is not None and ts[9] is None):
        return "input shapes unknown"
    return why_unsupported(*ts)


def _original(gm, g: dict) -> tuple[fx.GraphModule, list]:
    """The group's nodes as one module (the layers among them, the projection and an accelc rotation, as their
    originals), returning (q rotated, the stacked rows written); its inputs, the outside nodes it reads."""
    nodes = in_graph_order([g["lin"], *g["heads"], *g["inner"], g["q_out"], g["k_out"], g["stack"], g["write"]])
    inside, env, inputs = set(nodes), {}, []
    graph = fx.Graph()

    def outside(a: fx.Node):      # (the cache an input, as the model's state: a weight a get_attr)
        if a not in env:
            weight = a.op == "get_attr" and a is not g["cache"]
            env[a] = graph.get_attr(a.target) if weight else graph.placeholder(f"in{len(inputs)}")
            env[a].meta.update(a.meta)
            if not weight:
                inputs.append(a)
        return env[a]
    for n in nodes:      # (placeholders first)
        rw = meta.rewrite_of(n)
        for a in (rw.inputs if rw is not None else n.all_input_nodes):
            if a not in inside:
                outside(a)
    for n in nodes:
        rw = meta.rewrite_of(n)
        if rw is not None:
            env[n], _ = inline(graph, rw.original, [env[a] for a in rw.inputs])
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
            env[n].meta.update(n.meta)
    graph.output((env[g["q_out"]], env[g["stack"]]))
    return fx.GraphModule(gm, graph, class_name="OriginalLayer"), inputs


def _take(gm, g: dict) -> fx.Node:
    lin, write = g["lin"], g["write"]
    rw = meta.rewrite_of(lin)
    kw = _linear_args(lin)
    D = attr_value(gm, g["cache"]).shape[-1]
    original, inputs = _original(gm, g)
    graph = gm.graph
    with graph.inserting_before(write):
        new = graph.call_function(QKV_ROTARY, (kw["x"], kw["weight"], kw.get("bias"), g["cos"], g["sin"], g["cache"],
                                               g["positions"], g["lengths"][0] // D, g["lengths"][1] // D),
                                  {**{k: kw[k] for k in ("norm_weight", "norm_eps") if kw.get(k) is not None},
                                   **(dict(q_norm=g["norms"][0][1], k_norm=g["norms"][1][1],
                                           head_eps=float(g["norms"][0][2])) if g["norms"] else {})})
        q = graph.call_function(operator.getitem, (new, 0))
    new.meta[meta.PATH] = meta.path(lin)
    q.meta.update({k: v for k, v in g["q_out"].meta.items() if k != meta.REWRITE})
    norm = "rms_norm+" if kw.get("norm_eps") is not None else ""
    register_layer(gm, new, Rewrite(
        layer=unique_name(gm, f"{rw.layer}+rotary+cache"), kind="qkv_rotary", kernel=f"accelc::{norm}qkv_rotary",
        original=original, inputs=inputs, aux=list(rw.aux),
        note="q / k / v, their rotation and the cache write in one kernel"))
    replace_uses(gm, g["q_out"], q)
    replace_uses(gm, write, g["cache"])       # (attention reads the cache after the call, as after the write)
    graph.erase_node(write)
    erase_dead(list(dict.fromkeys([g["stack"], g["q_out"], g["k_out"], *g["inner"], *g["heads"], lin])))
    return new


def _transform(gm: fx.GraphModule, ctx) -> int:
    count = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}   # (once: a take changes no other layer's nodes' order)
    for write in [n for n in gm.graph.nodes if n.op == "call_function" and meta.op_name(n) == "index_copy_"]:
        g = _group(write)
        if g is None:
            continue
        reason = _why_not(gm, g, order)
        if reason:
            rw = meta.rewrite_of(g["lin"])        # (beside the note it has: the norm's, say)
            rw.note = "; ".join(filter(None, (rw.note, f"rotation and cache write not taken in: {reason}")))
            continue
        _take(gm, g)
        count += 1
    return count


PASS = Pass("qkv_rotary", transform=_transform)
