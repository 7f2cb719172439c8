"""The fusion pass: group maximal regions of pointwise ops into ``prim::FusionGroup`` nodes.

Within each block, consumers pull their producers into one group, scanning in reverse topological order and
repeating until nothing changes, as the legacy fuser did. A group runs where its last member stood, so a
union is valid only if no node between the group's first and last member needs a member's value (it would
run before the group) and no node in that range has side effects (a mutation such as ``add_`` splits
groups: a member moved past it could read the mutated value).

The graphs seen here carry no dtype or device; which inputs a group can really run on is decided at run
time by the executor, which falls back otherwise.

After grouping, :func:`lower_fusion_groups` replaces each ``prim::FusionGroup`` by a call of the
``fuser::fusion_group`` operator with the group's integer key.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from . import ops, settings

MAX_GROUP_ARGS = 128  # inputs + outputs of one group, as the legacy fuser capped it
# A group must replace at least this many eager kernels. One kernel's worth (an op alone, or an op and a cast
# that eager skips when the dtype already matches, as prepare's in-place and batch norm rewrites add) removes
# no launch and no intermediate tensor, and a group call costs more host time than an eager op
# (README bench, H200: a group call costs 17-42 us of host time, an eager op about 7-8 us).
MIN_GROUP_KERNELS = 2

_TENSOR_TYPES = (torch._C.TensorType,)


def _is_tensor(v: torch._C.Value) -> bool:
    return isinstance(v.type(), _TENSOR_TYPES)


def _is_constant(v: torch._C.Value) -> bool:
    return v.node().kind() == "prim::Constant"


def _inlined_constant(v: torch._C.Value) -> bool:
    """Constants copied into a group: non-tensors, and 0-dim tensors (traced Python scalars, which reach
    Python ops as plain numbers, so they cannot be passed as tensor inputs). Larger tensor constants are
    group inputs."""
    if not _is_constant(v):
        return False
    if not _is_tensor(v):
        return True
    val = v.toIValue()  # a wrapped number comes back as a Python number
    if isinstance(val, torch.Tensor):
        return val.dim() == 0 and val.device.type == "cpu"
    return isinstance(val, (bool, int, float))


def fusable_op(node: torch._C.Node) -> Optional[ops.OpDef]:
    """The op-table entry of ``node`` if the pass may put it in a group, else None.

    Non-tensor arguments must be constants, except ``float`` values, which become kernel arguments.
    """
    if not node.kind().startswith("aten::") or node.outputsSize() != 1 or list(node.blocks()):
        return None
    schema = node.schema()
    if schema == ops.PERMUTE.schemas[0]:  # a view read through by the kernel (fuser/views.py): constant dims
        return ops.PERMUTE if _constant_ints(node.inputsAt(1)) is not None else None
    op = ops.lookup(schema)
    if op is None:
        red = ops.lookup_reduction(schema)
        return red if red is not None and _is_tensor(node.output()) and reduced_dims(node) is not None else None
    if not _is_tensor(node.output()):
        return None
    if op.concat:
        return op if concat_list(node) is not None else None
    for i, v in enumerate(node.inputs()):
        if _is_tensor(v):
            continue
        if _is_constant(v):
            val = v.toIValue()
            if op.variant_arg == i:
                if val not in op.exprs:
                    return None
            elif not (val is None or isinstance(val, (bool, int, float))):
                return None
            continue
        if v.type().kind() != "FloatType":
            return None
    return op


def _constant_ints(v: torch._C.Value) -> Optional[list]:
    """The value of a constant int list, else None."""
    val = v.toIValue() if _is_constant(v) else None
    return list(val) if isinstance(val, (list, tuple)) and all(_is_int(d) for d in val) else None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def fold_permute_dims(graph: torch._C.Graph, block: torch._C.Block) -> int:
    """A permute's dims built by a ``prim::ListConstruct`` of int constants (as tracing records ``x.permute(0, 3, 1,
    2)``) become one list constant, which a group holds as it holds other constants. Returns the permutes changed."""
    done = 0
    for node in list(block.nodes()):
        if node.kind() != "aten::permute" or node.schema() != ops.PERMUTE.schemas[0]:
            continue
        lst = node.inputsAt(1).node()
        if lst.kind() != "prim::ListConstruct" or len(lst.output().uses()) != 1:
            continue  # (a list used elsewhere may be changed before the permute reads it: dims[0] = 1)
        items = [v.toIValue() if _is_constant(v) else None for v in lst.inputs()]
        if not all(_is_int(i) for i in items):
            continue
        const = graph.insertConstant(items)
        const.node().moveBefore(node)
        node.replaceInput(1, const)
        if not lst.output().uses():
            lst.destroy()
        done += 1
    return done


def reduced_dims(node: torch._C.Node) -> Optional[tuple]:
    """The dims a reduction, or an op made of reductions (softmax, layer_norm, rms_norm, std: ``ops.Reduction``),
    reduces, when it may join a group: its arguments constants (a normalization's weight and bias may be
    tensors), the dims the last k of any rank (-1, or -2 and -1, ...; the row kernels reduce trailing dims, and
    this holds for every input's rank), or for a plain reduction the first k (0, or 0 and 1: column kernels).
    None otherwise. The executor checks the rest per call (the shapes, and
    eager's own checks of a normalization's arguments) and falls back when the form does not hold."""
    op = ops.lookup_reduction(node.schema())
    if op is None:
        return None
    tensors = ops.COMPOSITE_TENSOR_ARGS.get(op.name, ())
    consts = []
    for i, v in enumerate(list(node.inputs())):
        if i == 0 or (i in tensors and _is_tensor(v)):
            consts.append(None)
        elif _is_constant(v):
            consts.append(v.toIValue())
        else:
            return None
    dims = ops.reduced_dims(op.name, consts)
    if dims is None:
        return None
    if sorted(dims) == list(range(-len(dims), 0)):
        return tuple(sorted(dims))
    # or the first k dims, for a sum, mean, amax or amin: a column kernel's form (fuser/rows/outer.py)
    red = op.reduction
    return tuple(sorted(dims)) if sorted(dims) == list(range(len(dims))) and not (red.variance or red.composite) \
        else None


def concat_list(cat: torch._C.Node) -> Optional[torch._C.Node]:
    """The ``prim::ListConstruct`` of a fusable ``cat``: used by the cat alone, tensor items, constant dim."""
    lst = cat.inputsAt(0).node()
    if lst.kind() != "prim::ListConstruct" or lst.owningBlock() != cat.owningBlock():
        return None
    if len(lst.output().uses()) != 1 or not _is_constant(cat.inputsAt(1)):
        return None
    items = list(lst.inputs())
    return lst if items and all(_is_tensor(v) for v in items) else None


def _has_side_effects(node: torch._C.Node) -> bool:
    kind = node.kind()
    if kind in ("prim::Constant", "prim::ListConstruct", "prim::TupleConstruct", "prim::ListUnpack",
                "prim::TupleUnpack", "prim::FusionGroup", *GROUP_CALLS):
        return False
    for block in node.blocks():
        if any(_has_side_effects(n) for n in block.nodes()):
            return True
    if kind.startswith("aten::"):
        schema = node.schema()
        return schema == "(no schema)" or "!" in schema
    # prim::SetAttr, prim::CallMethod, prim::Print, prim::RaiseException, unknown ops...
    return kind not in _PURE_PRIMS


_PURE_PRIMS = frozenset(("prim::GetAttr", "prim::If", "prim::Loop", "prim::dtype", "prim::device",
                         "prim::NumToTensor", "prim::unchecked_cast", "prim::TupleIndex", "prim::ListIndex",
                         "prim::shape", "prim::layout", "prim::requires_grad", "prim::ConstantChunk",
                         # fuser's own ops that the passes insert: they return views, mutate nothing
                         "fuser::broadcasting_chunk", "fuser::batch_norm_params"))


def _users_in_block(value: torch._C.Value, block: torch._C.Block) -> list[torch._C.Node]:
    """The nodes of ``block`` that use ``value``, directly or inside their sub-blocks."""
    users = []
    for use in value.uses():
        user = use.user
        while user is not None and user.owningBlock() != block:
            owner = user.owningBlock().owningNode()
            user = owner
        if user is not None:
            users.append(user)
    return users


class _Group:
    __slots__ = ("members",)

    def __init__(self, node: torch._C.Node):
        self.members = [node]


class _BlockFuser:
    def __init__(self, block: torch._C.Block):
        self.block = block
        self.nodes = list(block.nodes())
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.ops = {n: fusable_op(n) for n in self.nodes}
        self.barriers = [i for i, n in enumerate(self.nodes) if _has_side_effects(n)]
        self.group_of: dict[torch._C.Node, _Group] = {}
        # a cat and its list are one unit from the start (a group must never take a list as an input)
        for n in self.nodes:
            op = self.ops[n]
            if op is not None and op.concat:
                lst = concat_list(n)
                if lst not in self.pos or self._check([lst, n]) != []:
                    self.ops[n] = None
                    continue
                g = self.group_of[n] = self.group_of[lst] = _Group(n)
                g.members = [lst, n]

    def _group(self, node: torch._C.Node) -> _Group:
        g = self.group_of.get(node)
        if g is None:
            g = self.group_of[node] = _Group(node)
        return g

    def _external_inputs(self, members: Iterable[torch._C.Node]) -> list[torch._C.Value]:
        mset = set(members)
        seen, out = set(), []
        for m in sorted(mset, key=self.pos.__getitem__):
            for v in m.inputs():
                if v.node() in mset or _inlined_constant(v):
                    continue
                if v.unique() not in seen:
                    seen.add(v.unique())
                    out.append(v)
        return out

    def _outputs(self, members: Iterable[torch._C.Node]) -> list[torch._C.Value]:
        mset = set(members)
        outs = []
        for m in sorted(mset, key=self.pos.__getitem__):
            v = m.output()
            if any(u not in mset for u in _users_in_block(v, self.block)) or self._returned(v):
                outs.append(v)
        return outs

    def _private(self, v: torch._C.Value, mset: set) -> bool:
        """Whether ``v`` is computed in the group and seen by no one outside it. A group output that may alias
        such a value (``type_as`` returns its first input when dtypes match) can be a fresh tensor instead:
        no one could observe the difference."""
        return (v.node() in mset and not self._returned(v)
                and all(u in mset for u in _users_in_block(v, self.block)))

    def _fresh(self, v: torch._C.Value, mset: set) -> bool:
        """Whether group output ``v`` may be a fresh tensor: eager's is one, or a view or the very tensor of a value
        no one outside sees. An op that may return its input (``type_as``, ``permute``) is followed down to the op
        that computed the value: ``x.permute(1, 0).type_as(y)`` is ``x`` itself in eager, a view users write through."""
        while self.ops[v.node()].aliases_input:
            v = v.node().inputsAt(0)
            if not self._private(v, mset):
                return False
        return True

    def _returned(self, v: torch._C.Value) -> bool:
        return any(u.user.kind() == "prim::Return" and u.user.owningBlock() == self.block for u in v.uses())

    def _check(self, members: list[torch._C.Node]) -> Optional[list[torch._C.Node]]:
        """None if ``members`` cannot form a group; otherwise the nodes inside the group's span that use a
        member's value and so must move after the group (possibly none)."""
        mset = set(members)
        lo = min(self.pos[m] for m in members)
        hi = max(self.pos[m] for m in members)
        if any(lo < b < hi for b in self.barriers):
            return None
        tainted = {m.output().unique() for m in members}
        deferred, deferred_outs = [], set()
        # up to and including the last member, where the group will run: a residual ``x + f(x)`` has its last
        # member reading f's result, which depends on a member and so would move after the group
        for i in range(lo + 1, hi + 1):
            n = self.nodes[i]
            uses = {v.unique() for v in _node_uses(n)}
            if n in mset:
                if uses & deferred_outs:
                    return None  # a member needs a node that needs a member: a cycle
                continue
            if uses & (tainted | deferred_outs):
                g = self.group_of.get(n)
                if g is not None and len(g.members) > 1:
                    return None
                deferred.append(n)
                deferred_outs.update(o.unique() for o in n.outputs())
        outs = self._outputs(members)
        if any(not self._fresh(v, mset) for v in outs):
            return None
        if any(self.ops[m] is ops.PERMUTE for m in members) and (any(
                op is None or op.reduction is not None or op.concat or op.random for op in map(self.ops.get, members))
                or self.spaces(members) is None):
            return None
        reduced = {reduced_dims(m) for m in members
                   if self.ops.get(m) is not None and self.ops[m].reduction is not None}
        if len(reduced) > 1:  # one set of reduced dims per group (a row kernel)
            return None
        # a group with a reduction runs eager's ops under autograd (no reduction derivatives yet), where rand_like
        # would draw eager's numbers, not the kernel's Philox ones that a no-grad call of the same group draws
        if reduced and any(getattr(self.ops.get(m), "random", False) for m in members):
            return None
        for m in members:  # a cat's result is not consumed inside its own group (it is not a map value)
            op = self.ops.get(m)
            if op is not None and op.concat and any(u in mset for u in _users_in_block(m.output(), self.block)):
                return None
        if len(self._external_inputs(members)) + len(outs) > MAX_GROUP_ARGS:
            return None
        return deferred

    def spaces(self, members: Iterable[torch._C.Node]) -> Optional[dict]:
        """Per member, the chain of member permutes between it and the group's outputs (``fuser/views.py``), or
        None where a member's value would be needed in two (read through a permute and without it)."""
        mset = set(members)
        where: dict = {}
        for m in sorted(mset, key=self.pos.__getitem__, reverse=True):  # its users in the group come first
            v = m.output()
            users = _users_in_block(v, self.block)
            chains = {()} if self._returned(v) or any(u not in mset for u in users) else set()
            chains.update(where[u] + ((u,) if self.ops[u] is ops.PERMUTE else ()) for u in users if u in mset)
            if len(chains) > 1:
                return None
            where[m] = chains.pop() if chains else ()
        return where

    def group_inputs(self, members: list[torch._C.Node], where: dict) -> list[tuple]:
        """The group's inputs as (outer value, chain of permutes it is read through; ``where``: :meth:`spaces`'s): a
        value read in two spaces is two inputs. Tensors first, then float scalars (the runtime op takes them as two
        lists)."""
        mset = set(members)
        seen, out = set(), []
        for m in sorted(mset, key=self.pos.__getitem__):
            chain = where[m] + ((m,) if self.ops[m] is ops.PERMUTE else ())
            for v in m.inputs():
                if v.node() in mset or _inlined_constant(v) or (v.unique(), chain) in seen:
                    continue
                seen.add((v.unique(), chain))
                out.append((v, chain))
        return [x for x in out if _is_tensor(x[0])] + [x for x in out if not _is_tensor(x[0])]

    def _worth_a_kernel(self, members: list[torch._C.Node]) -> bool:
        """Whether the group replaces :data:`MIN_GROUP_KERNELS` eager kernels: table ops, a cat counting (eager
        writes its pieces first), an op that may return its input (``type_as``) not, and one op other than a
        cat (a bare cat is eager's own job)."""
        table = [self.ops[m] for m in members if self.ops[m] is not None]
        kernels = [op for op in table if not op.aliases_input]
        return len(kernels) >= MIN_GROUP_KERNELS and any(not op.concat for op in kernels)

    def _defer(self, nodes: list[torch._C.Node], after: torch._C.Node) -> None:
        """Move ``nodes`` (in order) right after ``after``; they only depend on values defined before it."""
        for n in nodes:
            n.moveAfter(after)
            after = n
        self.nodes = list(self.block.nodes())
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.barriers = [i for i, n in enumerate(self.nodes) if _has_side_effects(n)]

    def run(self) -> list[list[torch._C.Node]]:
        changed = True
        while changed:
            changed = False
            for consumer in reversed(self.nodes):
                if self.ops[consumer] is None:
                    continue
                group = self._group(consumer)
                producers = [v.node() for v in self._external_inputs(group.members)]
                producers = [p for p in producers if p in self.pos and self.ops[p] is not None]
                for p in sorted(set(producers), key=self.pos.__getitem__, reverse=True):
                    other = self._group(p)
                    if other is group:
                        continue
                    merged = group.members + other.members
                    deferred = self._check(merged)
                    if deferred is not None:
                        if deferred:
                            self._defer(deferred, max(merged, key=self.pos.__getitem__))
                        group.members = merged
                        for m in other.members:
                            self.group_of[m] = group
                        changed = True
        groups, seen = [], set()
        for n in self.nodes:
            g = self.group_of.get(n)
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                if self._worth_a_kernel(g.members):
                    groups.append(sorted(g.members, key=self.pos.__getitem__))
        return groups


def _node_uses(node: torch._C.Node) -> list[torch._C.Value]:
    vals = list(node.inputs())
    for block in node.blocks():
        for n in block.nodes():
            vals.extend(_node_uses(n))
        vals.extend(block.outputs())
    return vals


def build_subgraph(members: list[torch._C.Node], inputs: list, outputs: list[torch._C.Value],
                   spaces: Optional[dict] = None) -> torch._C.Graph:
    """A standalone graph of ``members`` (in order) with the given external inputs and outputs.

    ``inputs``: values, or (value, chain) pairs with ``spaces`` (per member, its chain: ``_BlockFuser.spaces``),
    where a value read through different permutes is one input per chain.
    Non-tensor constants are cloned into the subgraph, so they are part of its identity.
    """
    sub = torch._C.Graph()
    ext: dict = {}  # (outer value, chain) -> the subgraph's input
    for v in inputs:
        v, chain = v if isinstance(v, tuple) else (v, ())
        nv = sub.addInput()
        nv.setType(v.type())
        ext[v.unique(), chain] = nv
    vmap: dict[int, torch._C.Value] = {}  # members' results and the constants cloned
    for m in members:
        chain = () if spaces is None else spaces[m] + ((m,) if m.kind() == "aten::permute" else ())
        local = {}
        for v in m.inputs():
            u = v.unique()
            got = vmap.get(u)
            if got is None:
                got = ext.get((u, chain))
            if got is None:
                assert _inlined_constant(v), "precondition: every other input is an external input"
                c = sub.createClone(v.node(), lambda x: x)
                sub.insertNode(c)
                got = vmap[u] = c.output()
            local[u] = got
        c = sub.createClone(m, lambda x: local[x.unique()])
        sub.insertNode(c)
        for a, b in zip(m.outputs(), c.outputs()):
            vmap[a.unique()] = b
    for v in outputs:
        sub.registerOutput(vmap[v.unique()])
    return sub


CHUNK_SCHEMA = "aten::chunk(Tensor(a -> *) self, int chunks, int dim=0) -> Tensor(a)[]"


def _chunk_tree(block_nodes: list, pos: dict, chunk: torch._C.Node) -> Optional[list[torch._C.Node]]:
    """The fusable nodes whose only use is (transitively) the chunked value, in order; None if none."""
    root = chunk.inputsAt(0).node()
    if root not in pos or fusable_op(root) is None or fusable_op(root).aliases_input:
        return None
    tree, todo = {root}, [root]
    while todo:
        n = todo.pop()
        for v in n.inputs():
            p = v.node()
            if p in tree or p not in pos or not _is_tensor(v) or _is_constant(v):
                continue
            op = fusable_op(p)
            if op is None or op.aliases_input:
                continue
            if all(u.user in tree for u in v.uses()):
                tree.add(p)
                todo.append(p)
    # a node may have joined before one of its other users did; keep only nodes whose uses stay inside
    changed = True
    while changed:
        changed = False
        for n in list(tree):
            if n is not root and not all(u.user in tree for u in n.output().uses()):
                tree.discard(n)
                changed = True
    if not all(u.user == chunk for u in root.output().uses()):
        return None
    return sorted(tree, key=pos.__getitem__)


def move_chunks(graph: torch._C.Graph, block: torch._C.Block) -> int:
    """Chunk motion: ``(a * b + c).chunk(n, d)`` becomes the same pointwise tree applied to the chunks of
    its inputs, so the ops before a chunk join the group of the ops after it (an LSTM cell's gate sums).

    Inputs are chunked by ``fuser::broadcasting_chunk`` at run time: an input broadcast along the chunked
    dim (a bias row, a 0-dim tensor) is passed whole to every chunk, so shapes and type promotion stay
    eager's. Returns the number of chunks moved.
    """
    moved = 0
    while True:
        nodes = list(block.nodes())
        pos = {n: i for i, n in enumerate(nodes)}
        for chunk in nodes:
            if chunk.kind() != "aten::chunk" or chunk.schema() != CHUNK_SCHEMA:
                continue
            if not (_is_constant(chunk.inputsAt(1)) and _is_constant(chunk.inputsAt(2))):
                continue
            uses = chunk.output().uses()
            if len(uses) != 1 or uses[0].user.kind() != "prim::ListUnpack":
                continue
            tree = _chunk_tree(nodes, pos, chunk)
            if tree is None:
                continue
            lo = pos[tree[0]]
            if any(_has_side_effects(nodes[i]) for i in range(lo + 1, pos[chunk])):
                continue  # a tree node moved past this could read a mutated value
            _rewrite_chunk(graph, chunk, uses[0].user, tree)
            moved += 1
            break
        else:
            return moved


def _rewrite_chunk(graph, chunk, unpack, tree) -> None:
    tset = set(tree)
    leaves, seen = [], set()
    for n in tree:
        for v in n.inputs():
            if v.node() not in tset and _is_tensor(v) and v.unique() not in seen:
                seen.add(v.unique())
                leaves.append(v)
    n_out = unpack.outputsSize()
    lst = graph.create("prim::ListConstruct", leaves)
    lst.output().setType(torch._C.ListType.ofTensors())
    nconst = graph.insertConstant(n_out)
    call = graph.create("fuser::broadcasting_chunk",
                        [lst.output(), chunk.inputsAt(1), chunk.inputsAt(2), nconst], 1)
    call.output().setType(torch._C.ListType.ofTensors())
    parts = graph.create("prim::ListUnpack", [call.output()], len(leaves) * n_out)
    nconst.node().moveBefore(chunk)
    for n in (lst, call, parts):
        n.insertBefore(chunk)
    part_values = list(parts.outputs())
    for v in part_values:
        v.setType(torch._C.TensorType.get())
    for k in range(n_out):
        vmap = {leaf.unique(): part_values[j * n_out + k] for j, leaf in enumerate(leaves)}
        for n in tree:
            clone = graph.createClone(n, lambda x: vmap.get(x.unique(), x))
            clone.insertBefore(chunk)
            vmap[n.output().unique()] = clone.output()
        unpack.outputsAt(k).replaceAllUsesWith(vmap[chunk.inputsAt(0).unique()])
    unpack.destroy()
    chunk.destroy()
    for n in reversed(tree):
        n.destroy()


def fuse_block(graph: torch._C.Graph, block: torch._C.Block) -> int:
    """Group fusable nodes of ``block`` (and its nested blocks) into ``prim::FusionGroup`` nodes.

    Returns the number of groups made.
    """
    made = 0
    for node in list(block.nodes()):
        for sub in node.blocks():
            made += fuse_block(graph, sub)
    move_chunks(graph, block)
    fold_permute_dims(graph, block)
    fuser = _BlockFuser(block)
    for members in fuser.run():
        where = fuser.spaces(members)
        inputs = fuser.group_inputs(members, where)
        outputs = fuser._outputs(members)
        sub = build_subgraph(members, inputs, outputs, where)
        group = graph.create("prim::FusionGroup", [v for v, _ in inputs], len(outputs))
        group.g_("Subgraph", sub)
        group.insertBefore(members[-1])
        for old, new in zip(outputs, group.outputs()):
            new.setType(old.type())
            old.replaceAllUsesWith(new)
        for m in reversed(members):
            m.destroy()
        made += 1
    return made


def fuse_graph(graph: torch._C.Graph) -> int:
    """Run the fusion pass over a whole graph, in place. Returns the number of groups made.

    Tensor types are erased first: the pass decides nothing from a traced graph's recorded shapes, dtypes and
    devices (a call may bring others), and a ``prim::FusionGroup``'s values must agree on their device for
    TorchScript's lint, which a recorded device and a parameter's untyped ``prim::GetAttr`` do not.
    With ``settings.strict_pass`` (the tests) the result is checked by that lint here, so a test that calls
    the pass directly fails where it made an invalid graph; ``integration.run_pass`` lints always.
    """
    torch._C._jit_pass_erase_shape_information(graph)
    made = fuse_block(graph, graph.block())
    if settings.strict_pass:
        torch._C._jit_pass_lint(graph)
    return made


def _all_nodes(block: torch._C.Block) -> Iterable[torch._C.Node]:
    for n in list(block.nodes()):
        yield n
        for b in n.blocks():
            yield from _all_nodes(b)


def fusion_groups(graph: torch._C.Graph) -> list[torch._C.Node]:
    """Every ``prim::FusionGroup`` node of ``graph``, nested blocks included."""
    return [n for n in _all_nodes(graph.block()) if n.kind() == "prim::FusionGroup"]


# the operators a lowered group is a call of: its outputs in a list, or a group of one output's tensor alone; a
# group of one output and 1 to FIXED_INPUTS tensor inputs, its tensors each an argument (fusion_group1_t<n>); and a
# group of 1 to CHUNK_OUTPUTS outputs and 1 to FIXED_INPUTS tensor arguments, where an argument may be a tensor whose
# chunks (prim::ConstantChunk's outputs) the group takes: the whole tensor passed, the call making the chunks
# (fusion_group<m>_c<n>, its outputs each a result of its own). The chunks then cost the native hot path no dispatch:
# an LSTM cell's gates chunked by TorchScript's interpreter cost about 3 us of a 12 us call on the CPU.
FIXED_INPUTS = 4
CHUNK_OUTPUTS = 3
FIXED_CALLS = tuple(f"fuser::fusion_group1_t{n}" for n in range(1, FIXED_INPUTS + 1))
CHUNK_CALLS = tuple(f"fuser::fusion_group{m}_c{n}" for m in range(1, CHUNK_OUTPUTS + 1)
                    for n in range(1, FIXED_INPUTS + 1))
GROUP_CALLS = ("fuser::fusion_group", "fuser::fusion_group1", *FIXED_CALLS, *CHUNK_CALLS)


def chunk_call(outputs: int, tensors: int) -> str:
    return CHUNK_CALLS[(outputs - 1) * FIXED_INPUTS + tensors - 1]


def is_group_call(node: torch._C.Node) -> bool:
    return node.kind() in GROUP_CALLS


def group_call_args(node: torch._C.Node) -> tuple[list, torch._C.Value, torch._C.Value, torch._C.Value,
                                                       torch._C.Value]:
    """A group call's arguments: its tensor values (the list construct's inputs; [] where the list is not one; a
    chunked call's whole tensors, see :func:`group_call_chunks`), and the values of its scalars list, key, digest
    and ir."""
    args = list(node.inputs())
    if node.kind() in FIXED_CALLS:
        return args[:-4], *args[-4:]
    if node.kind() in CHUNK_CALLS:
        return args[:-5], *args[-4:]
    tlist, slist, key, digest, ir = args
    tensors = list(tlist.node().inputs()) if tlist.node().kind() == "prim::ListConstruct" else []
    return tensors, slist, key, digest, ir


def group_call_chunks(node: torch._C.Node) -> Optional[list[tuple[int, int, int, int]]]:
    """A chunked call's group inputs, each (tensor argument, chunk index, chunks, dim): the argument itself where
    chunks is 1, else that chunk of it as ``prim::ConstantChunk[chunks, dim]`` makes it; the arguments in order for
    an empty list or a call of another kind; None where the list is not a constant."""
    if node.kind() not in CHUNK_CALLS:
        return []
    v = list(node.inputs())[-5]
    if _is_constant(v):
        flat = list(v.toIValue())
    elif v.node().kind() == "prim::ListConstruct" and all(_is_constant(x) for x in v.node().inputs()):
        flat = [x.toIValue() for x in v.node().inputs()]
    else:
        return None
    return [tuple(flat[i:i + 4]) for i in range(0, len(flat), 4)]


def group_call_key(node: torch._C.Node) -> int:
    """The spec key of a group call (a constant of the graph)."""
    return group_call_args(node)[2].toIValue()


def _chunk_of(v: torch._C.Value) -> Optional[tuple[torch._C.Node, torch._C.Value, int, int]]:
    """(the node that chunks, tensor, chunks, dim) where ``v`` is an output of ``prim::ConstantChunk``, or of the
    ``prim::ListUnpack`` of an ``aten::chunk`` with constant arguments and as many outputs as chunks (TorchScript
    makes that a ``prim::ConstantChunk`` after the pass), in more than one chunk; None otherwise."""
    node = v.node()
    if node.kind() == "prim::ConstantChunk":
        found = node, node.inputsAt(0), node.i("chunks"), node.i("dim")
    elif node.kind() == "prim::ListUnpack":
        chunk = node.inputsAt(0).node()
        if (chunk.kind() != "aten::chunk" or chunk.schema() != CHUNK_SCHEMA or len(chunk.output().uses()) != 1
                or not (_is_constant(chunk.inputsAt(1)) and _is_constant(chunk.inputsAt(2)))
                or chunk.inputsAt(1).toIValue() != node.outputsSize()):
            return None
        found = chunk, chunk.inputsAt(0), chunk.inputsAt(1).toIValue(), chunk.inputsAt(2).toIValue()
    else:
        return None
    return found if found[2] > 1 else None  # (a chunk of 1 checks its dim: it stays)


def _same_node(a: torch._C.Node, b: torch._C.Node) -> bool:
    return a.kind() == b.kind() and [o.unique() for o in a.outputs()] == [o.unique() for o in b.outputs()]


def _call_may_chunk(v: torch._C.Value, group: torch._C.Node) -> bool:
    """Whether the call of ``group`` may make chunk ``v`` itself (see _chunk_of) in place of the node that makes it:
    the group alone uses that node's chunks (every one of them where a list unpack needs their exact count), and the
    node stands before the group in its block with nothing between them that has side effects (a write to the
    chunked tensor would change the chunks; a chunk in an outer block would make its error conditional on a branch
    or a loop's trip). Chunks used elsewhere too stay: TorchScript's autodiff, given such a chunk and the call both,
    returned a gradient of the wrong input."""
    unpack = v.node()
    if any(not _same_node(u.user, group) for o in unpack.outputs() for u in o.uses()):
        return False
    if unpack.kind() == "prim::ListUnpack" and any(not o.uses() for o in unpack.outputs()):
        return False
    chunk = _chunk_of(v)[0]
    between = None  # the nodes of the group's block after the chunk, once it is found there
    for n in group.owningBlock().nodes():
        if between is None:
            if _same_node(n, chunk):
                between = []
        elif _same_node(n, group):
            return not any(_has_side_effects(m) for m in between)
        else:
            between.append(n)
    return False  # the chunk is in another block


def _call_arguments(group: torch._C.Node, tensors: list) -> tuple[list, list[int]]:
    """A group's tensor inputs as a chunked call's arguments: the tensors, where each input that is a chunk the call
    may make (see _call_may_chunk) is replaced by the chunked tensor (once), and the flat chunk list
    (group_call_chunks)."""
    args: list = []
    chunks: list[int] = []
    for v in tensors:
        chunk = _chunk_of(v)
        if chunk is not None and not _call_may_chunk(v, group):
            chunk = None
        source, entry = (v, (0, 1, 0)) if chunk is None else (chunk[1], (v.offset(), *chunk[2:]))
        for j, a in enumerate(args):
            if a.unique() == source.unique():
                break
        else:
            j = len(args)
            args.append(source)
        chunks += [j, *entry]
    return args, chunks


def lower_fusion_groups(graph: torch._C.Graph, register: Callable[[torch._C.Node], tuple[int, str, str]]) -> None:
    """Replace each ``prim::FusionGroup`` by ``fuser::fusion_group(tensors, scalars, key, digest, ir)`` and a
    ``prim::ListUnpack`` of its outputs, or, for a group of one output, by ``fuser::fusion_group1`` (the same
    arguments, its tensor alone), or by one of the fixed-arity calls (see FIXED_CALLS and CHUNK_CALLS);
    ``register`` gives a group's (key, digest, ir)."""
    chunk_nodes = set()  # (the unique of each chunk node's first output)
    for group in fusion_groups(graph):
        key, digest, ir = register(group)
        inputs = list(group.inputs())
        tensors = [v for v in inputs if _is_tensor(v)]
        scalars = [v for v in inputs if not _is_tensor(v)]
        slist = graph.create("prim::ListConstruct", scalars)
        slist.output().setType(torch._C.ListType.ofFloats())
        consts = [graph.insertConstant(value) for value in (key, digest, ir)]
        for c in consts:
            c.node().moveBefore(group)
        n_out = group.outputsSize()
        args, chunks = _call_arguments(group, tensors)
        chunked = any(chunks[i + 2] != 1 for i in range(0, len(chunks), 4))
        made = [slist]
        if chunked and len(args) <= FIXED_INPUTS and n_out <= CHUNK_OUTPUTS:
            chunk_nodes |= {v.node().outputsAt(0).unique() for k, v in enumerate(tensors) if chunks[4 * k + 2] != 1}
            clist = graph.insertConstant(chunks)
            clist.node().moveBefore(group)
            call = graph.create(chunk_call(n_out, len(args)), [*args, clist, slist.output(), *consts], n_out)
        elif n_out == 1 and 1 <= len(tensors) <= FIXED_INPUTS:
            call = graph.create(FIXED_CALLS[len(tensors) - 1], [*tensors, slist.output(), *consts], 1)
        elif 2 <= n_out <= CHUNK_OUTPUTS and 1 <= len(tensors) <= FIXED_INPUTS:
            clist = graph.create("prim::ListConstruct", [])  # (constant propagation folds it)
            clist.output().setType(torch._C.ListType.ofInts())
            made.append(clist)
            call = graph.create(chunk_call(n_out, len(tensors)), [*tensors, clist.output(), slist.output(), *consts],
                                n_out)
        else:
            tlist = graph.create("prim::ListConstruct", tensors)
            tlist.output().setType(torch._C.ListType.ofTensors())
            call = graph.create(GROUP_CALLS[n_out == 1], [tlist.output(), slist.output(), *consts], 1)
            made.append(tlist)
            if n_out != 1:
                call.output().setType(torch._C.ListType.ofTensors())
        made.append(call)
        if n_out != 1 and call.kind() == GROUP_CALLS[0]:
            made.append(graph.create("prim::ListUnpack", [call.output()], n_out))
        for n in made:
            n.insertBefore(group)
        for old, new in zip(group.outputs(), made[-1].outputs()):
            new.setType(old.type())
            old.replaceAllUsesWith(new)
        group.destroy()
    # a chunk whose every output is now made by the calls runs no more
    for node in [n for n in _all_nodes(graph.block()) if n.kind() in ("prim::ConstantChunk", "prim::ListUnpack")]:
        if node.outputsAt(0).unique() in chunk_nodes and not any(o.uses() for o in node.outputs()):
            source = node.inputsAt(0).node()
            node.destroy()
            if source.kind() == "aten::chunk" and not source.output().uses():
                source.destroy()


def raise_fusion_calls(graph: torch._C.Graph, subgraph_of: Callable[[int], Optional[torch._C.Graph]]) -> None:
    """The inverse of :func:`lower_fusion_groups`, for display: turn each group call whose list inputs (and
    unpacked outputs) are still in place back into a ``prim::FusionGroup`` node."""
    for call in [n for n in _all_nodes(graph.block()) if is_group_call(n)]:
        fixed = call.kind() in FIXED_CALLS + CHUNK_CALLS
        tensors, slist, kval, dval, irval = group_call_args(call)
        tlist = None if fixed else call.inputsAt(0)
        if (not fixed and tlist.node().kind() != "prim::ListConstruct") or not _is_constant(kval):
            continue
        chunks = group_call_chunks(call)
        if chunks is None:
            continue
        clist = list(call.inputs())[-5] if call.kind() in CHUNK_CALLS else None
        if call.kind() != GROUP_CALLS[0]:
            results = call
        else:
            uses = call.output().uses()
            if len(uses) != 1 or uses[0].user.kind() != "prim::ListUnpack":
                continue
            results = uses[0].user
        sub = subgraph_of(kval.toIValue())
        if sub is None:
            continue
        if slist.node().kind() == "prim::ListConstruct":
            scalars = list(slist.node().inputs())
        elif _is_constant(slist):  # constant propagation folds a list of constants
            scalars = []
            for x in slist.toIValue():
                c = graph.insertConstant(float(x))
                c.node().moveBefore(call)
                scalars.append(c)
        else:
            continue
        if chunks:  # the group's inputs: the chunks made again by prim::ConstantChunk nodes
            made: dict = {}
            inputs = []
            for j, i, n, dim in chunks:
                if n == 1:
                    inputs.append(tensors[j])
                    continue
                if (j, n, dim) not in made:
                    node = graph.create("prim::ConstantChunk", [tensors[j]], n)
                    node.i_("chunks", n)
                    node.i_("dim", dim)
                    node.insertBefore(call)
                    for o in node.outputs():
                        o.setType(tensors[j].type())
                    made[j, n, dim] = node
                inputs.append(made[j, n, dim].outputsAt(i))
            tensors = inputs
        group = graph.create("prim::FusionGroup", tensors + scalars, results.outputsSize())
        group.g_("Subgraph", sub.copy())
        group.insertBefore(call)
        for old, new in zip(results.outputs(), group.outputs()):
            new.setType(old.type())
            old.replaceAllUsesWith(new)
        if results is not call:
            results.destroy()
        call.destroy()
        for n in [v.node() for v in (tlist, clist, slist, kval, dval, irval) if v is not None]:
            if n.kind() in ("prim::ListConstruct", "prim::Constant") and not n.output().uses():
                n.destroy()
