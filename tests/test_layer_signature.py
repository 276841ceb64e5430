"""accelc.layer_signature: what the speed race takes for the same work (twin layers timed once)."""
import torch
from torch import fx, nn

from accelc.layer_signature import signature, value


class _Weighted(nn.Module):
    def __init__(self, n, k):
        super().__init__()
        self.sub = nn.Module()
        self.sub.weight = nn.Parameter(torch.randn(n, k))

    def forward(self, x):
        return torch.nn.functional.gelu(x @ self.sub.weight.t())


def _key(module, x):
    gm = fx.symbolic_trace(module)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    return signature(node, (x,), {}, gm)


def test_twins_share_a_key_and_other_work_does_not():
    x = torch.randn(3, 8)
    a, b = _key(_Weighted(16, 8), x), _key(_Weighted(16, 8), x)
    assert a == b and hash(a) == hash(b)                  # other weights (values, names) of the same sizes
    assert _key(_Weighted(32, 8), x) != a                 # a weight of other sizes (a dotted get_attr)
    assert _key(_Weighted(16, 8), torch.randn(5, 8)) != a   # inputs of other sizes
    assert _key(_Weighted(16, 8), x.t().contiguous().t()) != a    # other strides
    assert _key(_Weighted(16, 8), x.half()) != a          # another dtype


def test_values_as_keys():
    t = torch.randn(2, 3)
    assert value(t) == value(torch.zeros(2, 3)) and value(t) != value(t[:, 1:])
    assert value((1, 2.0, "s", None, slice(1, None), ...)) == (1, 2.0, "s", None, ("slice", 1, None, None), ...)
    thing = object()
    assert value(thing) == value(thing) and value(thing) != value(object())   # an unknown object: itself only


def test_flops_of_twin_nodes_counted_once_and_the_same(monkeypatch):
    """accelc.flops.node_flops counts an op on the same sizes once (a model's repeated blocks) and gives every node
    the FLOPs it gave when each was counted alone."""
    from accelc import flops
    from accelc.capture.trace import capture

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(4))).eval()
    gm, _, _ = capture(model, (torch.randn(3, 16),))
    counters = []
    real = flops.FlopCounterMode
    monkeypatch.setattr(flops, "FlopCounterMode", lambda *a, **k: counters.append(1) or real(*a, **k))
    shared = flops.node_flops(gm)
    once = len(counters)
    counters.clear()
    unique = iter(range(10 ** 6))
    monkeypatch.setattr(flops, "value", lambda v: next(unique))     # every node a key of its own: counted alone
    alone = flops.node_flops(gm)
    assert shared == alone and sum(shared.values()) == 4 * 2 * 3 * (16 * 32 + 32 * 16)
    assert once * 3 < len(counters), (once, len(counters))
