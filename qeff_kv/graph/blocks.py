"""A retained-state graph cut into blocks of consecutive decoder layers at the residual stream, for running it a
block at a time (verification of a float graph in bounded memory: :mod:`qeff_kv.export.probe_runner`).

The cut is found from the graph's structure, not its node names. A layer's *anchors* are the nodes that read its
state inputs (past key/value, recurrent states; reading only a state's ``Shape`` does not count). Each node's level
is the last layer whose anchors it depends on (``-1``: the prologue: embedding, mask, RoPE, positions), so a
layer's attention and MLP stand on its level, and the next layer's input norm and projections too (they come before
its anchors). Between layers ``i-1`` and ``i`` the cut is moved back to the residual stream: the latest node ``r``
on level ``i-1`` whose descendants on that level can all move to level ``i`` with nothing but ``r``'s outputs and
prologue-like values crossing the cut (``r`` is the residual ``Add``; in a fused graph, the
``SkipSimplifiedLayerNormalization`` that adds the residual and normalizes it for the next layer: both cross); a
value of an earlier layer read past the cut counts as crossing. Where no such node exists, where an anchor depends
on a later layer, a layer's state output is computed on another level, or node names that carry ``layers.N``
disagree with the level found, the graph is not cut (:class:`BlockCutError`); callers then run it whole (or refuse).
Any cut the search accepts is a correct partition (every value a block reads from an earlier one is carried): the
checks keep the cut at the residual stream, so a block's memory is its layers' weights and a few activations.

Each block is a graph of its own (:func:`block_model`): its nodes; the constants and initializers they read
(copied into every block that reads them; external data keeps pointing at the original data file, so a block's
file is written beside the graph); the original inputs it reads; the values earlier blocks computed (carried in);
its states' outputs, the values later blocks read (carried out), and the graph's outputs it computes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import onnx
from onnx import helper

#: a node name's layer, where the tracer wrote one (``/model/layers.3/mlp/...``): a check of the structural cut only
_LAYER_IN_NAME = re.compile(r"(?:^|/)layers\.(0|[1-9][0-9]*)(?:/|$)")
_MAX_CANDIDATES = 2000
#: reading only a value's shape is no dependence on its data
_SHAPE_OPS = ("Shape", "Size")


class BlockCutError(ValueError):
    """The graph cannot be cut cleanly at the residual stream (the message says where)."""


@dataclass
class Block:
    """One block: the layers it holds, its node indices and what flows in and out."""

    first: int                                          # first layer (inclusive)
    last: int                                           # last layer (inclusive)
    nodes: list[int] = field(default_factory=list)      # indices into the graph's nodes, in order
    inputs: list[str] = field(default_factory=list)     # the graph's own inputs it reads
    carried_in: list[str] = field(default_factory=list)
    carried_out: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)    # the graph's own outputs it computes
    initializers: list[str] = field(default_factory=list)
    weight_bytes: int = 0


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The values a node reads: its inputs and the outer values its subgraphs (If/Loop/Scan bodies) read."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            inner = {i.name for i in g.input} | {t.name for t in g.initializer}
            inner |= {o for n in g.node for o in n.output}
            names += [v for n in g.node for v in node_reads(n) if v not in inner]
    return names


def tensor_bytes(t: onnx.TensorProto) -> int:
    count = 1
    for d in t.dims:
        count *= d
    return count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


class Cut:
    """The levels of a graph's nodes (see the module docstring); ``layers``: the layers that hold state, in
    order; ``states``: ``(layer, input name, output name)`` of each state pair."""

    def __init__(self, model: onnx.ModelProto, states: list[tuple[int, str, str]]):
        g = model.graph
        self.model, self.nodes = model, list(g.node)
        self.inits = {t.name: t for t in g.initializer}
        if len(g.sparse_initializer):
            raise BlockCutError("the graph has sparse initializers")
        self.graph_inputs = {i.name for i in g.input} - set(self.inits)
        self.producer: dict[str, int] = {}
        self.reads = [node_reads(n) for n in self.nodes]
        known = set(self.graph_inputs) | set(self.inits) | {""}
        for k, n in enumerate(self.nodes):
            if any(v not in known and v not in self.producer for v in self.reads[k]):
                raise BlockCutError(f"node {n.name or n.op_type!r} reads a value computed after it (not sorted)")
            for o in n.output:
                self.producer[o] = k
        self.consumers: dict[str, list[int]] = {}
        for k, names in enumerate(self.reads):
            for v in names:
                self.consumers.setdefault(v, []).append(k)
        self.layers = sorted({layer for layer, _, _ in states})
        self.states = states
        self.const = self._constants()
        self.separators: set[int] = set()
        self.level = self._levels()
        self._check_states()
        for i in self.layers[1:]:
            self._move_to_residual(i)
        self._check_names()

    # ------------------------------------------------------------------------------------------- levels
    def _constants(self) -> list[bool]:
        """Nodes that read no graph input (constants, views of weights): copied into each block that reads them."""
        const = []
        for k in range(len(self.nodes)):
            const.append(all(v in self.inits or (v in self.producer and const[self.producer[v]])
                             for v in self.reads[k]))
        return const

    def _levels(self) -> list[int]:
        """Each node's level; and ``self.data``: whether its value depends on a layer's state values (not only on
        shapes: a mask built from a state's length is a prologue-like value, whichever layer computes it)."""
        anchor_of: dict[str, int] = {inp: layer for layer, inp, _ in self.states}
        level, self.data = [], []
        for k, n in enumerate(self.nodes):
            lv = max((level[self.producer[v]] for v in self.reads[k] if v in self.producer), default=-1)
            self.data.append(n.op_type not in _SHAPE_OPS and (any(v in anchor_of for v in self.reads[k]) or any(
                self.data[self.producer[v]] for v in self.reads[k] if v in self.producer)))
            anchors = {anchor_of[v] for v in self.reads[k] if v in anchor_of} if n.op_type not in _SHAPE_OPS else set()
            if len(anchors) > 1:
                raise BlockCutError(f"node {n.name or n.op_type!r} reads the states of layers {sorted(anchors)}")
            if anchors:
                (layer,) = anchors
                if lv > layer:
                    raise BlockCutError(f"layer {layer}'s state is read after layer {lv}'s")
                lv = layer
            level.append(-1 if self.const[k] else lv)
        return level

    def _check_states(self) -> None:
        for layer, _, out in self.states:
            k = self.producer.get(out)
            if k is None or self.level[k] != layer:
                raise BlockCutError(f"layer {layer}'s state output is not computed in layer {layer}")

    # ----------------------------------------------------------------------------------- the residual cut
    def _descendants_on(self, start: int, lv: int) -> set[int]:
        out, todo = set(), [start]
        while todo:
            k = todo.pop()
            for o in self.nodes[k].output:
                for c in self.consumers.get(o, ()):
                    if c not in out and self.level[c] == lv and not self.const[c]:
                        out.add(c)
                        todo.append(c)
        return out

    def _crossing(self, on_level: list[int], lv: int, moved: set[int]) -> set[str]:
        """Values computed on level ``lv`` (the nodes ``on_level``), not moved, that depend on state data and are read
        on a later level (or by a node of ``moved``, which moves up)."""
        crossing = set()
        for p in on_level:
            if p in moved or not self.data[p]:
                continue
            for o in self.nodes[p].output:
                if any(not self.const[c] and (self.level[c] > lv or c in moved) for c in self.consumers.get(o, ())):
                    crossing.add(o)
        return crossing

    def _earlier_reads(self, prev: int) -> tuple[set[str], dict[int, list[str]]]:
        """Values computed before level ``prev`` that depend on state data: those read after it (they would cross the
        cut too), and those each node on ``prev`` reads (they cross where that node moves up)."""
        after, on_prev = set(), {}
        for c, names in enumerate(self.reads):
            if self.const[c] or self.level[c] < prev:
                continue
            old = [v for v in names if v in self.producer and self.data[self.producer[v]]
                   and self.level[self.producer[v]] < prev]
            if old and self.level[c] > prev:
                after.update(old)
            elif old:
                on_prev[c] = old
        return after, on_prev

    def _move_to_residual(self, i: int) -> None:
        prev = self.layers[self.layers.index(i) - 1]
        on_level = [k for k, lv in enumerate(self.level) if lv == prev and not self.const[k]]
        after, on_prev = self._earlier_reads(prev)
        for k in list(reversed(on_level))[:_MAX_CANDIDATES]:
            moved = self._descendants_on(k, prev)
            crossing = self._crossing(on_level, prev, moved) | after
            crossing.update(v for m in moved for v in on_prev.get(m, ()))
            if moved and crossing <= set(self.nodes[k].output):
                for m in moved:
                    self.level[m] = i
                self.separators.add(k)   # a fused residual add and norm carries the next layer's name
                return
        raise BlockCutError(f"no residual value separates layer {prev} from layer {i}")

    def _check_names(self) -> None:
        for k, n in enumerate(self.nodes):
            m = _LAYER_IN_NAME.search(n.name)
            if m and not self.const[k] and self.level[k] >= 0 and int(m.group(1)) != self.level[k] \
                    and k not in self.separators:
                raise BlockCutError(f"node {n.name!r} falls in layer {self.level[k]} by the graph's structure")

    # ------------------------------------------------------------------------------------------ blocks
    def blocks(self, per_block: int) -> list[Block]:
        """Consecutive layers, ``per_block`` to a block; the prologue joins the first, the head the last."""
        groups = [self.layers[j:j + per_block] for j in range(0, len(self.layers), max(1, per_block))]
        where = {layer: b for b, grp in enumerate(groups) for layer in grp}
        block_of = [where.get(lv, 0 if lv < 0 else len(groups) - 1) if not c else -1
                    for lv, c in zip(self.level, self.const)]
        out_names = [o.name for o in self.model.graph.output]
        blocks = [Block(first=grp[0], last=grp[-1]) for grp in groups]
        for b, block in enumerate(blocks):
            mine = {k for k, bb in enumerate(block_of) if bb == b}
            need = self._with_constants(mine)
            block.nodes = sorted(need)
            made = {o for k in need for o in self.nodes[k].output}
            reads = {v for k in need for v in self.reads[k]}
            block.inputs = [i.name for i in self.model.graph.input if i.name in reads and i.name not in self.inits]
            block.initializers = sorted(v for v in reads if v in self.inits)
            block.weight_bytes = sum(tensor_bytes(self.inits[v]) for v in block.initializers)
            block.carried_in = sorted(v for v in reads if v in self.producer and v not in made)
            block.outputs = [o for o in out_names if o in made]
            later = {v for k, bb in enumerate(block_of) if bb > b for v in self.reads[k]}
            block.carried_out = sorted(v for v in later if v in self.producer and block_of[self.producer[v]] == b)
        return blocks

    def _with_constants(self, mine: set[int]) -> set[int]:
        need, todo = set(mine), list(mine)
        while todo:
            for v in self.reads[todo.pop()]:
                p = self.producer.get(v)
                if p is not None and self.const[p] and p not in need:
                    need.add(p)
                    todo.append(p)
        return need

    def block_model(self, block: Block, carried_types: dict[str, tuple[int, int]]) -> onnx.ModelProto:
        """The block as a model of its own; ``carried_types``: ``name -> (ONNX element type, rank)`` of the values it
        is handed (known once the earlier blocks have run)."""
        g = self.model.graph
        by_name = {v.name: v for v in list(g.input) + list(g.output) + list(g.value_info)}
        inputs = [by_name[n] for n in block.inputs]
        for v in block.carried_in:
            elem, rank = carried_types[v]
            inputs.append(helper.make_tensor_value_info(v, elem, [f"{v}_d{j}" for j in range(rank)]))
        outputs = [by_name[n] for n in block.outputs] + [helper.ValueInfoProto(name=v) for v in block.carried_out]
        graph = helper.make_graph([self.nodes[k] for k in block.nodes], f"{g.name}_block_{block.first}", inputs,
                                  outputs, initializer=[self.inits[v] for v in block.initializers])
        model = helper.make_model(graph, opset_imports=list(self.model.opset_import),
                                  ir_version=self.model.ir_version, functions=list(self.model.functions))
        return model
