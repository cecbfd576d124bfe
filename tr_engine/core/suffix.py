"""A suffix index over everything the engine has decoded: every finished request's prompt and answer, shared by all
sequences as the recycling matrix is, so that a draft can copy what followed the same words in an earlier request
(SuffixDecoding, NeurIPS 2025; SAM-Decoding, ACL 2025). Where the matrix remembers one row of candidates per token
(the last writer wins), the index remembers whole continuations, and how often each followed.

Storage, bounded by a byte budget (max_bytes): a ring of token ids holding the requests end to end, a separator
after each, the oldest overwritten first; and a hash chain per context of ORDER tokens, as LZ77 compressors find
earlier matches: head[h] is the latest position whose preceding ORDER tokens hash to h, prev[p] the one before it with
the same hash. A lookup walks the chain of the history's last ORDER tokens (newest first, at most MAX_WALK links,
stopping at the first position the ring has overwritten), measures how far back each match agrees with the history
(up to MAX_MATCH tokens), keeps the matches of the longest agreement (the deepest node of a suffix tree; at most
MAX_USED, the sequence's own text first, then the newest), and counts what followed them: a trie of continuations,
each node's count the number of matches that continued with its path. A node's count over the matches' is its
empirical probability; the drafts take the likeliest nodes. The history's own earlier text is searched too (it is not
in the index until its request ends).

Exactness is not the index's business: its drafts are verified by the model like any other.
"""

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tr_engine.core.tree import trie_children
from tr_engine.errors import UserError
from tr_engine.files import atomic_write, load_state, signals_deferred

ORDER = 3  # context tokens a position is indexed under
MAX_MATCH = 32  # how far back a match's agreement with the history is measured
MAX_WALK = 64  # chain links followed per lookup (the newest matches first)
MAX_USED = 16  # matches whose continuations make the trie (of the longest-agreeing: the sequence's own, then newest)
SEPARATOR = -1  # after each request in the ring: no context or continuation runs across it
DEFAULT_MAX_BYTES = 64 << 20
BYTES_PER_TOKEN = 20  # the ring (int32), the chain (int64) and at most one head (int64) per position
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9], dtype=np.uint64)[:ORDER]


class IndexFileError(UserError):
    """A saved suffix index that cannot be read or written."""


@dataclass
class Continuations:
    """What followed the matches of a history's suffix: a trie (node 0 the root, the history's last token; each
    parent before its children), each node with its token and count; `matches` is the root's count, `agree` how
    many tokens of the history the matches agreed with."""

    parent: list[int]
    token: list[int]
    count: list[int]
    matches: int
    agree: int

    def confidence(self, node: int) -> float:
        """The share of its parent's matches that went on with `node`'s token, discounted for little evidence (one
        match of one: 1/2; nine of nine: 9/10): what the drafts' acceptance rates are learned by, as the matrix's
        confidences are."""
        return self.count[node] / (self.count[self.parent[node]] + 1)

    def children(self) -> list[dict[int, int]]:
        """Per node, its children by token."""
        return trie_children(self.parent, self.token)


class SuffixIndex:
    def __init__(self, vocab_size: int, max_bytes: int = DEFAULT_MAX_BYTES):
        if type(max_bytes) is not int or max_bytes < BYTES_PER_TOKEN * 1024:
            raise UserError(f"the suffix index needs at least {BYTES_PER_TOKEN * 1024} bytes, got {max_bytes!r}")
        self.vocab_size = vocab_size
        self.capacity = max_bytes // BYTES_PER_TOKEN  # tokens the ring holds
        self.buckets = 1 << (self.capacity.bit_length() - 1)  # a power of two <= capacity
        self.tokens = np.full(self.capacity, SEPARATOR, dtype=np.int32)
        self.prev = np.full(self.capacity, -1, dtype=np.int64)
        self.head = np.full(self.buckets, -1, dtype=np.int64)
        self.total = 0  # tokens ever written: the ring holds positions total - capacity .. total - 1
        self.requests = 0

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.prev.nbytes + self.head.nbytes

    def _hash(self, contexts: np.ndarray) -> np.ndarray:
        """Bucket of each row of ORDER token ids."""
        mixed = contexts.astype(np.uint64) * _MIX
        h = mixed[..., 0]
        for i in range(1, ORDER):
            h = h ^ (mixed[..., i] + (h << np.uint64(6)) + (h >> np.uint64(2)))
        return (h & np.uint64(self.buckets - 1)).astype(np.int64)

    def add(self, ids: list[int]) -> None:
        """Remember one request's tokens (its prompt and answer), a separator after them."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and not (0 <= ids.min() and ids.max() < self.vocab_size):
            raise ValueError(f"token ids outside 0..{self.vocab_size - 1}")
        self._append(np.concatenate([ids[-(self.capacity - 1):], [SEPARATOR]]))
        self.requests += 1

    def _append(self, seq: np.ndarray) -> None:
        """Write `seq` (token ids and separators) after what the ring holds and index each position whose ORDER
        tokens before it lie in `seq`, are no separator, and are followed by a token."""
        start, n = self.total, len(seq)
        self.tokens[(start + np.arange(n)) % self.capacity] = seq
        self.total += n
        if n <= ORDER:
            return
        windows = np.lib.stride_tricks.sliding_window_view(seq, ORDER + 1)  # [n - ORDER, ORDER + 1]: context, next
        ok = (windows != SEPARATOR).all(axis=1)
        positions = start + ORDER + np.nonzero(ok)[0]
        if positions.size == 0:
            return
        h = self._hash(windows[ok, :ORDER])
        order = np.lexsort((positions, h))  # by bucket, then position: each bucket's chain links in order
        h, positions = h[order], positions[order]
        first = np.r_[True, h[1:] != h[:-1]]
        last = np.r_[h[1:] != h[:-1], True]
        before = np.empty_like(positions)
        before[1:] = positions[:-1]
        before[first] = self.head[h[first]]
        self.prev[positions % self.capacity] = before
        self.head[h[last]] = positions[last]

    def continuations(self, history: list[int], depth: int = 16, own: bool = True) -> Continuations | None:
        """What followed the longest-agreeing earlier occurrences of the history's end, up to `depth` tokens each, as
        a trie: occurrences in the index and, with `own`, in the history itself (the prompt and the answer so far,
        not yet in the index); None when neither holds its last ORDER tokens."""
        if len(history) < ORDER:
            return None
        tail = np.asarray(history[-MAX_MATCH:], dtype=np.int64)
        found = [self._matches(tail, depth)]
        if own:  # (first: the sequence's own text is the likeliest to go on as it did)
            found.insert(0, _own_matches(np.asarray(history, dtype=np.int64), tail, depth))
        agree = np.concatenate([a for a, _ in found])
        if agree.size == 0 or int(agree.max()) < ORDER:
            return None
        best = int(agree.max())
        cont = np.concatenate([c for _, c in found])[agree == best][:MAX_USED]
        parent, token, count = [0], [int(history[-1])], [len(cont)]
        children: list[dict[int, int]] = [{}]
        for row in cont.tolist():
            node = 0
            for t in row:
                if t == SEPARATOR:
                    break
                child = children[node].get(t)
                if child is None:
                    child = children[node][t] = len(parent)
                    parent.append(node)
                    token.append(t)
                    count.append(0)
                    children.append({})
                count[child] += 1
                node = child
        return Continuations(parent, token, count, len(cont), best)

    def _matches(self, tail: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The index's newest MAX_WALK occurrences of the tail's last ORDER tokens: each one's agreement with the
        tail, and the `depth` tokens that followed it (SEPARATOR-padded) [m, depth]."""
        oldest = max(self.total - self.capacity, 0)
        q = int(self.head[int(self._hash(tail[-ORDER:][None])[0])]) if self.total else -1
        found = []
        for _ in range(MAX_WALK):
            if q - ORDER < oldest:  # empty, or (partly) overwritten: the rest of the chain is older still
                break
            found.append(q)
            q = int(self.prev[q % self.capacity])
        found = np.asarray(found, dtype=np.int64)
        back = found[:, None] - len(tail) + np.arange(len(tail))  # [m, span] the positions that would agree
        seen = self.tokens[back % self.capacity].astype(np.int64)
        seen[back < oldest] = SEPARATOR
        ahead = found[:, None] + np.arange(depth)
        cont = self.tokens[ahead % self.capacity].astype(np.int64)
        cont[ahead >= self.total] = SEPARATOR
        return _agreement(seen, tail), cont

    def copy_(self, other: "SuffixIndex") -> None:
        """Hold what `other` holds (a loaded index; the same bound), in place: the drafters that share this one see
        it."""
        if other.capacity != self.capacity:
            raise ValueError(f"a suffix index of {other.capacity} tokens cannot replace one of {self.capacity}")
        self.tokens[:], self.prev[:], self.head[:] = other.tokens, other.prev, other.head
        self.total, self.requests = other.total, other.requests

    def content(self) -> np.ndarray:
        """The ring's tokens, oldest first (separators included)."""
        held = min(self.total, self.capacity)
        return self.tokens[(self.total - held + np.arange(held)) % self.capacity]

    def save(self, path: str | Path, fingerprint: str) -> None:
        """Write the index's tokens to `path` atomically (the chains are rebuilt at load); IndexFileError when the
        file cannot be written (the old one kept)."""
        state = {"tokens": torch.from_numpy(self.content().copy()), "vocab_size": self.vocab_size,
                 "fingerprint": fingerprint, "requests": self.requests}
        buffer = io.BytesIO()
        try:
            with signals_deferred():
                torch.save(state, buffer)
                atomic_write(path, buffer.getvalue())
        except OSError as e:
            raise IndexFileError(f"could not save the suffix index to {path} ({e.strerror or e}); any previous file "
                                 "there is kept; give it a writable path") from None

    @classmethod
    def load(cls, path: str | Path, vocab_size: int, fingerprint: str,
             max_bytes: int = DEFAULT_MAX_BYTES) -> "SuffixIndex":
        """An index from a file `save` wrote for this vocabulary, checked before use (IndexFileError otherwise); a
        file larger than `max_bytes` allows keeps its newest tokens."""
        def bad(what: str) -> IndexFileError:
            return IndexFileError(f"{path} is not a valid suffix index file ({what}); delete it to start fresh")

        data = load_state(path, IndexFileError, "suffix index", "--matrix")  # (it is saved beside the matrix)
        if not isinstance(data, dict) or not {"tokens", "vocab_size", "fingerprint", "requests"} <= data.keys():
            raise bad("not a dict with tokens, vocab_size, fingerprint and requests")
        tokens = data["tokens"]
        if type(data["vocab_size"]) is not int or not isinstance(data["fingerprint"], str) \
                or type(data["requests"]) is not int or data["requests"] < 0:
            raise bad("its vocab_size, fingerprint or requests are not what save writes")
        if data["vocab_size"] != vocab_size or data["fingerprint"] != fingerprint:
            raise IndexFileError(f"{path} was made for another vocabulary ({data['vocab_size']} tokens, tokenizer "
                                 f"{data['fingerprint']}; this model: {vocab_size}, {fingerprint}); delete it")
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int32 or tokens.dim() != 1:
            raise bad("its tokens are not a 1-D int32 tensor")
        if tokens.numel() and not (SEPARATOR <= int(tokens.min()) and int(tokens.max()) < vocab_size):
            raise bad(f"token ids outside 0..{vocab_size - 1}")
        index = cls(vocab_size, max_bytes)
        seq = tokens.numpy().astype(np.int64)[-index.capacity:]
        index._append(seq)
        index.requests = data["requests"]
        return index


def _agreement(seen: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """For each row of `seen` [m, len(tail)] (the tokens before a match), how many of its last tokens equal the
    tail's (a hash collision agrees with fewer than ORDER)."""
    same = (seen == tail)[:, ::-1]
    return np.where(same.all(axis=1), same.shape[1], np.argmin(same, axis=1)).astype(np.int64)


def _own_matches(history: np.ndarray, tail: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """_matches' answer for the history itself: its newest MAX_WALK earlier occurrences of its last ORDER tokens
    (each followed by at least one token of the history)."""
    n = len(history)
    if n <= ORDER:
        return np.zeros(0, dtype=np.int64), np.zeros((0, depth), dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(history[:-1], ORDER)  # window i ends before position i+ORDER
    found = (np.nonzero((windows == history[-ORDER:]).all(axis=1))[0] + ORDER)[::-1][:MAX_WALK]
    padded = np.concatenate([np.full(len(tail), SEPARATOR), history, np.full(depth, SEPARATOR)])
    back = found[:, None] - len(tail) + np.arange(len(tail)) + len(tail)
    ahead = found[:, None] + np.arange(depth) + len(tail)
    return _agreement(padded[back], tail), padded[ahead]


def beside(matrix_path: str | Path) -> Path:
    """Where the suffix index is saved beside a recycling matrix file: m.pt -> m.suffix.pt."""
    path = Path(matrix_path)
    return path.with_name(f"{path.stem}.suffix{path.suffix}")
