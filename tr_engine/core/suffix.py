"""A suffix index over everything the engine has decoded: every finished request's prompt and answer, shared by all
sequences as the recycling matrix is, so that a draft can copy what followed the same words in an earlier request
(SuffixDecoding, NeurIPS 2025; SAM-Decoding, ACL 2025). Where the matrix remembers one row of candidates per token
(the last writer wins), the index remembers whole continuations, and how often each followed.

Storage, bounded by a byte budget (max_bytes): a ring of token ids holding the requests end to end, a separator
after each, the oldest overwritten first; and a hash chain per context of ORDER tokens, as LZ77 compressors find
earlier matches: head[h] is the latest position whose preceding ORDER tokens hash to h (plus one: 0 is none), prev[p]
the one before it with the same hash. The arrays are reserved at the bound but never filled up front (a position is
read only once written; the heads' 0 is the operating system's fresh page), so an index costs memory as it learns,
not at creation: that is what lets every engine keep one by default. A lookup walks the chain of the history's last
ORDER tokens (newest first, at most MAX_WALK links, stopping at the first position the ring has overwritten),
measures how far back each match agrees with the history (up to MAX_MATCH tokens), keeps the matches of the longest
agreement (the deepest node of a suffix tree; at most MAX_USED, the sequence's own text first, then the newest), and
counts what followed them: a trie of continuations, each node's count the number of matches that continued with its
path. A node's count over the matches' is its
empirical probability; the drafts take the likeliest nodes. The history's own earlier text is searched too (it is not
in the index until its request ends).

Exactness is not the index's business: its drafts are verified by the model like any other.
"""

import io
import mmap
from array import array
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
_MIX_INTS = tuple(int(m) for m in _MIX)
_MASK64 = (1 << 64) - 1


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
        self.tokens = _reserved(self.capacity, np.int32)
        self.prev = _reserved(self.capacity, np.int64)
        self.head = _reserved(self.buckets, np.int64)  # position + 1 (0: none)
        self.total = 0  # tokens ever written: the ring holds positions total - capacity .. total - 1
        self.requests = 0

    @property
    def nbytes(self) -> int:
        """The most memory the index can have made resident: its held tokens' ring and chain entries (written in
        order), and the pages of heads they can have touched (one page per held token at most: the buckets are
        scattered, so a few thousand tokens touch every page of the heads)."""
        held = min(self.total, self.capacity)
        return held * (self.tokens.itemsize + self.prev.itemsize) + min(self.head.nbytes, held * mmap.PAGESIZE)

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
        before[first] = self.head[h[first]] - 1
        self.prev[positions % self.capacity] = before
        self.head[h[last]] = positions[last] + 1

    def continuations(self, history: list[int], depth: int = 16, own: bool = True) -> Continuations | None:
        """What followed the longest-agreeing earlier occurrences of the history's end, up to `depth` tokens each, as
        a trie: occurrences in the index and, with `own`, in the history itself (the prompt and the answer so far,
        not yet in the index); None when neither holds its last ORDER tokens.

        Written in plain Python over the arrays' buffers, not numpy: a lookup runs right after a forward has streamed
        the weights through every cache, and there each numpy call's cold code cost more than its work (a dozen of
        them took ~0.4 ms a step on a Zen 4, 3.7x their time in a warm loop). A match's agreement is counted back
        from its end, stopping at the first difference, and only the matches kept have their continuations read."""
        n = len(history)
        if n < ORDER:
            return None
        span = min(n, MAX_MATCH)  # the history's tail that agreement is measured against
        found = _own_matches(history, span) if own else []  # (first: its own text is the likeliest to go on as it did)
        ring = self._matches(history, span)
        best = max((a for a, _ in found + ring), default=0)
        if best < ORDER:
            return None
        kept = [(True, q) for a, q in found if a == best][:MAX_USED]
        kept += [(False, q) for a, q in ring if a == best][: MAX_USED - len(kept)]
        parent, token, count = [0], [int(history[-1])], [len(kept)]
        children: list[dict[int, int]] = [{}]
        for mine, q in kept:
            node = 0
            for t in history[q : q + depth] if mine else self._ahead(q, depth):
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
        return Continuations(parent, token, count, len(kept), best)

    def _bucket(self, context: list[int]) -> int:
        """_hash of one context of ORDER ids, in Python's integers (the same bits: uint64 arithmetic, wrapped)."""
        h = context[0] * _MIX_INTS[0] & _MASK64
        for i in range(1, ORDER):
            h ^= (context[i] * _MIX_INTS[i] & _MASK64) + (h << 6) + (h >> 2) & _MASK64
        return h & (self.buckets - 1)

    def _matches(self, history: list[int], span: int) -> list[tuple[int, int]]:
        """The index's newest MAX_WALK occurrences of the history's last ORDER tokens, as (agreement with the
        history's last `span` tokens, the position after the occurrence: where its continuation starts)."""
        if not self.total:
            return []
        oldest, cap = max(self.total - self.capacity, 0), self.capacity
        tokens, prev = memoryview(self.tokens), memoryview(self.prev)
        q = memoryview(self.head)[self._bucket(history[-ORDER:])] - 1
        found = []
        for _ in range(MAX_WALK):
            if q - ORDER < oldest:  # empty, or (partly) overwritten: the rest of the chain is older still
                break
            a, low = 0, min(span, q - oldest)  # (positions before the oldest held one agree with nothing)
            while a < low and tokens[(q - 1 - a) % cap] == history[-1 - a]:
                a += 1
            found.append((a, q))
            q = prev[q % cap]
        return found

    def _ahead(self, q: int, depth: int) -> list[int]:
        """The up to `depth` tokens the ring holds from position q on (SEPARATORs included; none past the newest)."""
        stop, cap = min(q + depth, self.total), self.capacity
        i, j = q % cap, (stop - 1) % cap + 1
        return self.tokens[i:j].tolist() if i < j else self.tokens[i:].tolist() + self.tokens[:j].tolist()

    def copy_(self, other: "SuffixIndex") -> None:
        """Hold what `other` holds (a loaded index; the same bound), in place: the drafters that share this one see
        it."""
        if other.capacity != self.capacity:
            raise ValueError(f"a suffix index of {other.capacity} tokens cannot replace one of {self.capacity}")
        held = min(other.total, other.capacity)  # (what it has written: the rest was never read, nor made resident)
        self.tokens[:held], self.prev[:held] = other.tokens[:held], other.prev[:held]
        if self.total:
            self.head[np.flatnonzero(self.head)] = 0
        used = np.flatnonzero(other.head)  # (only the heads in use: a copy of all would make every page resident)
        self.head[used] = other.head[used]
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


def _reserved(n: int, dtype) -> np.ndarray:
    """n zeros in fresh anonymous pages of the operating system's, resident only once written (the ring's in order as
    it fills, the heads' as buckets are first used), in small pages: numpy asks for huge ones on big arrays, and one
    head written would then make 2 MB resident."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # (Windows: no private anonymous maps; zeros, resident as numpy makes them)
        return np.zeros(n, dtype=dtype)
    size = max(n * np.dtype(dtype).itemsize, 1)
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared ones fill pages when read)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(pages, dtype=dtype, count=n)


def _own_matches(history: list[int], span: int) -> list[tuple[int, int]]:
    """_matches' answer for the history itself: its newest MAX_WALK earlier occurrences of its last ORDER tokens
    (each followed by at least one token of the history), found by bytes.rfind over the ids as 4-byte ints (as prompt
    lookup finds its n-grams; a match at an offset that is not a multiple of 4 straddles two ids and is skipped)."""
    n = len(history)
    ids = array("i", history).tobytes()
    needle, end, found = ids[-4 * ORDER :], 4 * (n - 1), []  # (an occurrence ends before the last token)
    while len(found) < MAX_WALK and (at := ids.rfind(needle, 0, end)) >= 0:
        end = at + 4 * ORDER - 1  # the next one to the left starts before this one
        if at % 4:
            continue
        q = at // 4 + ORDER
        a, low = ORDER, min(span, q)
        while a < low and history[q - 1 - a] == history[-1 - a]:
            a += 1
        found.append((a, q))
    return found


def beside(matrix_path: str | Path) -> Path:
    """Where the suffix index is saved beside a recycling matrix file: m.pt -> m.suffix.pt."""
    path = Path(matrix_path)
    return path.with_name(f"{path.stem}.suffix{path.suffix}")
