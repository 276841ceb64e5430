"""LayerRunner: runs a rewritten graph node by node and hands every rewritten node (a layer) to a
callback, which decides what flows on from it: the guard checks each layer there and lets eager's
output flow on, the report and the race record each layer's inputs, the int8 pass its activations."""
from __future__ import annotations

from typing import Callable

from torch import fx
from torch.utils import _pytree as pytree

from accelc import meta


class LayerRunner(fx.Interpreter):
    """fx.Interpreter over a rewritten graph.

    at_layer(runner, node, rewrite) runs in place of each node that calls an accelc op and returns
    the value that flows on (runner.run_as_graph(node): the accelc call itself; runner.layer_inputs(
    rewrite): the values its original subgraph reads). Every value a layer's original subgraph and its
    fallback read stays alive until the layer has run: the rewritten graph alone may have stopped
    reading them (`x @ W.T` becomes linear(x, t(W.T)) while the original reads W.T, which plain
    garbage collection frees once t(W.T) has run)."""

    def __init__(self, gm: fx.GraphModule, at_layer: Callable | None = None):
        super().__init__(gm)
        self.at_layer = at_layer
        seen, self.user_to_last_uses = set(), {}
        for node in reversed(gm.graph.nodes):
            reads = list(node.all_input_nodes)
            rw = meta.rewrite_of(node)
            if rw is not None:
                reads += rw.inputs
                if rw.fallback is not None:
                    reads += [a for a in pytree.tree_leaves((rw.fallback.args, rw.fallback.kwargs))
                              if isinstance(a, fx.Node)]
            for n in reads:
                if n not in seen:
                    seen.add(n)
                    self.user_to_last_uses.setdefault(node, []).append(n)

    def run_node(self, n):
        rw = meta.rewrite_of(n)
        if rw is None or self.at_layer is None:
            return super().run_node(n)
        return self.at_layer(self, n, rw)

    def run_as_graph(self, n: fx.Node):
        """The node's own value, as the graph computes it (the accelc call)."""
        return super().run_node(n)

    def layer_inputs(self, rw) -> list:
        """The values the layer's original subgraph reads, in its placeholders' order."""
        return [self.env[i] for i in rw.inputs]
