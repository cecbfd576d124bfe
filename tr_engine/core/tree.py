"""Static draft trees: a tree is a list of rank paths from the root (the last committed token); [0, 1] is the
rank-1 candidate of the rank-0 candidate. Everything a decode step needs is precomputed once per tree.

Token index 0 of a verify step is the root; nodes follow in breadth-first order (index 1..n), so each depth is a
contiguous range and a parent always comes before its children.
"""

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from tr_engine.errors import InvalidValue, UserError

# The paper's default tree "2.2.2" (80 nodes, depth 6), shipped with the package (shared/data/tree_2.2.2.json).
TREES = Path(__file__).parent / "trees"
# The most nodes a tree may have. A verify step's cost grows with its tokens (and its logits are [T, V] floats:
# 1024 x 128k vocab is 0.5 GB); the paper's tree has 80, the adaptive trees at most 127, and on the hardware measured
# here no tree past a few hundred tokens repays its verify.
MAX_TREE_NODES = 1023
MAX_TREE_FILE_BYTES = 1 << 20  # the largest tree in rank paths is ~0.5 MB of JSON (a 1023-node chain)


class TreeCache:
    """Trees by shape, the `size` most recently used kept. A decode loop's shapes recur, so a step seldom builds one;
    a server that runs for days meets rare shapes without end, and those leave one at a time (the least recently used)
    instead of growing its memory or emptying the cache at once."""

    def __init__(self, size: int):
        self.size, self.trees = size, OrderedDict()

    def get(self, key, make) -> "DraftTree":
        """The tree cached under `key`, or make() cached there."""
        tree = self.trees.get(key)
        if tree is None:
            tree = self.trees[key] = make()
            if len(self.trees) > self.size:
                self.trees.popitem(last=False)
        else:
            self.trees.move_to_end(key)
        return tree


@dataclass(frozen=True)
class DraftTree:
    paths: tuple[tuple[int, ...], ...]  # the n nodes' rank paths, breadth-first
    parent: torch.Tensor  # [n+1] int64, index of each token's parent (root: 0)
    rank: torch.Tensor  # [n+1] int64, candidate rank within the parent's matrix row (root: 0)
    depth: torch.Tensor  # [n+1] int64, root 0
    mask: torch.Tensor  # [n+1, n+1] bool, True where token i may attend to token j (its ancestors and itself)
    levels: tuple[tuple[int, int], ...]  # [start, end) token indices of depth 1, 2, …
    children: tuple[tuple[int, ...], ...]  # per token index, its children's indices in rank order

    @property
    def size(self) -> int:
        """Tokens in a verify step: the root plus the n nodes."""
        return len(self.paths) + 1

    def child(self, node: int, tokens: list[int], token: int) -> int | None:
        """The child of `node` that drafts `token` (`tokens`: the draft's, by node), the lowest-ranked of equal
        siblings, or None: the one step of every descent (acceptance, sampled acceptance, a graft)."""
        return next((c for c in self.children[node] if tokens[c] == token), None)

    def to(self, device) -> "DraftTree":
        move = {f: getattr(self, f).to(device) for f in ("parent", "rank", "depth", "mask")}
        return DraftTree(self.paths, levels=self.levels, children=self.children, **move)


def build_tree(paths, k: int | None = None) -> DraftTree:
    """Validate rank paths (at most MAX_TREE_NODES, prefix-closed, no duplicates, ranks < k) and precompute the
    buffers."""
    if len(paths) > MAX_TREE_NODES:
        raise InvalidValue(f"the draft tree has {len(paths)} nodes; at most {MAX_TREE_NODES} are allowed (a verify "
                           f"step of {MAX_TREE_NODES + 1} tokens already costs more than it can save)")
    for p in paths:
        if not isinstance(p, (list, tuple)) or not all(type(r) is int for r in p):
            raise InvalidValue(f"draft tree node {_short(p)} is not a list of integer ranks like [0, 1]")
    paths = [tuple(p) for p in paths]
    seen = set()
    for p in paths:
        if not p:
            raise UserError("a draft tree node has an empty path; the root is implicit, list only its descendants")
        if p in seen:
            raise UserError(f"draft tree node {list(p)} appears twice; remove the duplicate")
        if min(p) < 0 or (k is not None and max(p) >= k):
            raise UserError(f"draft tree node {list(p)} uses rank {max(p)}, but the matrix keeps only k = {k} "
                            f"candidates per token; raise --matrix-k or change the tree")
        seen.add(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise UserError(f"draft tree node {list(p)} has no parent {list(p[:-1])}; a tree must be prefix-closed")
    paths = sorted(paths, key=lambda p: (len(p), p))  # breadth-first, then by ranks
    index = {p: i + 1 for i, p in enumerate(paths)}  # token index; root is 0
    n = len(paths)
    parent = [0] + [index.get(p[:-1], 0) for p in paths]
    rank = [0] + [p[-1] for p in paths]
    depth = [0] + [len(p) for p in paths]
    mask = ancestor_mask(parent)
    levels, children = [], [[] for _ in range(n + 1)]
    for i in range(1, n + 1):
        children[parent[i]].append(i)
        if not levels or depth[i] != depth[levels[-1][0]]:
            levels.append([i, i + 1])
        else:
            levels[-1][1] = i + 1
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return DraftTree(tuple(paths), as_long(parent), as_long(rank), as_long(depth), mask,
                     tuple(map(tuple, levels)), tuple(map(tuple, children)))


def ancestor_mask(parent: list[int]) -> torch.Tensor:
    """bool [n, n], True where token j is token i's ancestor or i itself; parent[i] < i, the root (0) its own."""
    n = len(parent)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while True:  # walk up to the root, marking every ancestor
            mask[i, j] = True
            if j == 0:
                break
            j = parent[j]
    return mask


def sample_tree_mask(T: int) -> torch.Tensor:
    """A plausible draft tree's mask for T tokens, for measuring costs: the paper's 2.2.2 tree at T = 81, otherwise
    the first T tokens of a breadth-first tree with 4 children per node. bool [T, T]."""
    if T == load_tree("2.2.2").size:
        return load_tree("2.2.2").mask
    return ancestor_mask([0] + [(i - 1) // 4 for i in range(1, T)])


def trie_children(parent: list[int], token: list[int]) -> list[dict[int, int]]:
    """Per node of a trie given by its nodes' parents and tokens (node 0 the root, each parent before its children),
    its children by token: the descent table of the candidates hybrid drafting grafts (adaptive.Candidates,
    suffix.Continuations)."""
    kids = [{} for _ in parent]
    for i in range(1, len(parent)):
        kids[parent[i]][token[i]] = i
    return kids


def graft(tree: DraftTree, parents: list[int]) -> DraftTree:
    """`tree` with new nodes appended after its nodes, the i-th under token index `parents[i]` (a node of the tree,
    or an earlier new one): hybrid drafting's candidates from outside the matrix (prompt lookup's chain, the suffix
    index's continuations) hung on the matrix's tree. They are not matrix candidates: their rank is -1, their paths
    end in negative ranks (-1 for a parent's first new child, -2 for its second, ...), and `levels` still covers only
    the matrix's nodes (what retrieve expands)."""
    n, length = tree.size, len(parents)
    parent = tree.parent.tolist() + list(parents)
    depth = tree.depth.tolist()
    mask = torch.zeros(n + length, n + length, dtype=torch.bool)
    mask[:n, :n] = tree.mask.cpu()
    children = [list(c) for c in tree.children] + [[] for _ in range(length)]
    paths = list(tree.paths)
    grafted = [0] * (n + length)  # new children so far, per token index
    for i in range(n, n + length):
        up = parent[i]
        if not 0 <= up < i:
            raise ValueError(f"a grafted node's parent must come before it: node {i}, parent {up}")
        mask[i] = mask[up]
        mask[i, i] = True
        depth.append(depth[up] + 1)
        children[up].append(i)
        grafted[up] += 1
        paths.append((paths[up - 1] if up else ()) + (-grafted[up],))
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    out = DraftTree(tuple(paths), as_long(parent), as_long(tree.rank.tolist() + [-1] * length), as_long(depth),
                    mask, tree.levels, tuple(map(tuple, children)))
    return out.to(tree.parent.device)


def truncate_tree(tree: DraftTree, size: int) -> DraftTree:
    """The tree's first `size` tokens (root included): a tree again, since every parent comes before its children.
    For a verify step near the end of the cache, when the whole tree does not fit."""
    keep = lambda xs: tuple(x for x in xs if x < size)  # noqa: E731
    levels = tuple((a, min(b, size)) for a, b in tree.levels if a < size)
    return DraftTree(tree.paths[: size - 1], tree.parent[:size], tree.rank[:size], tree.depth[:size],
                     tree.mask[:size, :size].contiguous(), levels, tuple(keep(c) for c in tree.children[:size]))


def chain_tree(length: int) -> DraftTree:
    """A single path of `length` rank-0 nodes (prompt lookup's drafts; length 0 is a plain decode step)."""
    return build_tree([(0,) * d for d in range(1, length + 1)])


def load_tree(spec: str | Path = "2.2.2", k: int | None = None) -> DraftTree:
    """A shipped tree by name ("2.2.2") or a JSON file ({"nodes": [[0], [1], [0, 0], …]} or a bare list)."""
    path = TREES / f"{spec}.json" if (TREES / f"{spec}.json").is_file() else Path(spec)
    try:
        size = path.stat().st_size  # checked before reading: a tree file could be anything
        data = json.loads(path.read_bytes()) if size <= MAX_TREE_FILE_BYTES else None
    except FileNotFoundError:
        raise UserError(f"no draft tree file at {path}; pass --tree adaptive, 2.2.2 or a JSON file of rank paths")
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise UserError(f"{path} is not valid JSON ({type(e).__name__}); a tree file is "
                        '{"nodes": [[0], [1], [0, 0], …]}')
    except OSError as e:
        raise UserError(f"{path} cannot be read as a draft tree file ({e.strerror}); pass --tree with a JSON file")
    except ValueError as e:  # a path with a NUL byte
        raise UserError(f"--tree {spec!r} is not a valid path ({e}); pass adaptive, 2.2.2 or a JSON file")
    if size > MAX_TREE_FILE_BYTES:
        raise InvalidValue(f"{path} is {size} bytes, too large for a draft tree file (at most {MAX_TREE_NODES} "
                           f"nodes, {MAX_TREE_FILE_BYTES} bytes); pass a smaller --tree")
    nodes = data["nodes"] if isinstance(data, dict) and "nodes" in data else data
    if not isinstance(nodes, list):  # the nodes themselves are checked by build_tree
        raise UserError(f"{path}: expected a list of rank paths like [[0], [1], [0, 0]]")
    return build_tree(nodes, k)


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:40] + "…"
