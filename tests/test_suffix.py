"""The suffix index (tr_engine/core/suffix.py): its continuations are what a brute-force scan of the remembered text
finds, within its bound, across the ring's wrap, and through a save and load; hostile files are refused in one line."""

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tr_engine.core import suffix
from tr_engine.core.suffix import ORDER, SEPARATOR, IndexFileError, SuffixIndex

VOCAB = 6  # a small vocabulary: many repeats, long agreements


def brute(content: list[int], history: list[int], depth: int, walk: int):
    """The continuations by a scan of `content` (the ring, oldest first): the newest `walk` positions preceded by the
    history's last ORDER tokens, those that agree longest with the history, and what followed each."""
    tail = history[-suffix.MAX_MATCH:]
    found = [i for i in range(len(content) - 1, ORDER - 1, -1)
             if content[i - ORDER:i] == history[-ORDER:] and SEPARATOR not in content[i - ORDER:i + 1]][:walk]

    def agree(i):
        n = 0
        while n < len(tail) and i - 1 - n >= 0 and content[i - 1 - n] == tail[-1 - n]:
            n += 1
        return n

    if not found:
        return None
    best = max(agree(i) for i in found)
    paths = {}
    for i in (i for i in found if agree(i) == best):
        path = ()
        for t in content[i:i + depth]:
            if t == SEPARATOR:
                break
            path += (t,)
            paths[path] = paths.get(path, 0) + 1
    return best, sum(1 for i in found if agree(i) == best), paths


def as_paths(c):
    """A Continuations' nodes as {token path from the root: count}."""
    path_of, out = {0: ()}, {}
    for node in range(1, len(c.parent)):
        path_of[node] = path_of[c.parent[node]] + (c.token[node],)
        out[path_of[node]] = c.count[node]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_continuations_are_a_brute_force_scans_across_the_wrap(seed, monkeypatch):
    monkeypatch.setattr(suffix, "MAX_WALK", 10**6)  # every occurrence: the scan's answer exactly
    monkeypatch.setattr(suffix, "MAX_USED", 10**6)
    rng = random.Random(seed)
    index = SuffixIndex(VOCAB, max_bytes=suffix.BYTES_PER_TOKEN * 1024)
    for _ in range(60):  # ~3000 tokens through a 1024-token ring: it wraps about three times
        index.add([rng.randrange(VOCAB) for _ in range(rng.randrange(0, 90))])
        content = index.content().tolist()
        assert len(content) == min(index.total, index.capacity)
        for _ in range(5):
            history = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
            # the index alone; then with the history's own earlier occurrences, as if it followed the ring's text
            for own, text in ((False, content), (True, content + [SEPARATOR] + history)):
                got, want = index.continuations(history, depth=6, own=own), brute(text, history, 6, 10**6)
                if want is None or len(history) < ORDER:
                    assert got is None
                    continue
                assert (got.agree, got.matches, as_paths(got)) == want
                assert got.token[0] == history[-1] and got.count[0] == got.matches


def test_a_lookups_bucket_is_the_one_its_context_was_indexed_under():
    """A lookup hashes one context in Python's integers, the index's writes hash them in numpy's uint64: the same
    buckets, or a lookup would miss what was indexed (ids up to a large vocabulary's, where the products wrap)."""
    rng = np.random.default_rng(0)
    index = SuffixIndex(1 << 20, max_bytes=suffix.BYTES_PER_TOKEN * 4096)
    contexts = rng.integers(0, 1 << 20, size=(500, ORDER))
    assert [index._bucket(c) for c in contexts.tolist()] == index._hash(contexts).tolist()


def test_an_own_match_straddling_two_ids_is_not_a_match():
    """The history's own occurrences are found in its ids' bytes: bytes that happen to match across two ids (here
    the high bytes of one and the low bytes of the next) are no occurrence."""
    index = SuffixIndex(1 << 17, max_bytes=suffix.BYTES_PER_TOKEN * 1024)
    tail = [0x00010000, 0x00010000, 0x00010000]  # bytes 00 00 01 00 x3
    straddle = [0, 0x01000000, 0x01000000, 0x01000000, 0]  # the same bytes from byte 5 on: inside ids 1 to 4
    assert index.continuations(straddle + tail) is None
    c = index.continuations(tail + [7] + tail)  # a real occurrence, followed by 7
    assert c.agree == ORDER and as_paths(c) == {(7,) + tuple(tail[:i]): 1 for i in range(ORDER + 1)}


def test_a_lookup_walks_only_the_newest_matches(monkeypatch):
    monkeypatch.setattr(suffix, "MAX_WALK", 3)
    index = SuffixIndex(100, max_bytes=suffix.BYTES_PER_TOKEN * 2048)
    for follow in (10, 11, 12, 13, 14):
        index.add([1, 2, 3, follow])
    c = index.continuations([7, 1, 2, 3], own=False)
    assert c.matches == 3 and sorted(as_paths(c)) == [(12,), (13,), (14,)]


def test_a_trie_is_made_of_the_sequences_own_matches_first_then_the_newest(monkeypatch):
    monkeypatch.setattr(suffix, "MAX_USED", 3)
    index = SuffixIndex(100, max_bytes=suffix.BYTES_PER_TOKEN * 2048)
    for follow in (10, 11, 12, 13):
        index.add([1, 2, 3, follow])
    c = index.continuations([1, 2, 3, 20, 1, 2, 3])  # its own "1 2 3" went on with 20
    assert c.matches == 3 and sorted(as_paths(c)) == [(12,), (13,), (20,), (20, 1), (20, 1, 2), (20, 1, 2, 3)]


def test_the_index_stays_within_its_bound_and_keeps_the_newest_tokens():
    bound = suffix.BYTES_PER_TOKEN * 4096
    index = SuffixIndex(50_000, max_bytes=bound)
    assert index.nbytes == 0  # (it costs memory as it learns)
    rng = np.random.default_rng(0)
    sizes = []
    for _ in range(100):
        index.add(rng.integers(0, 50_000, 700).tolist())
        sizes.append(index.nbytes)
    assert sizes == sorted(sizes) and sizes[0] > 0 and sizes[-1] <= bound
    last = list(range(9000))  # longer than the ring: its end is kept
    index.add(last)
    assert index.nbytes == sizes[-1]  # (full since the sixth request)
    assert index.content().tolist() == last[-(index.capacity - 1):] + [SEPARATOR]
    assert as_paths(index.continuations([8990, 8991, 8992], depth=3)) == {(8993,): 1, (8993, 8994): 1,
                                                                        (8993, 8994, 8995): 1}


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the process's resident memory from /proc")
def test_an_index_costs_memory_as_it_learns_not_at_its_bound():
    """Every engine keeps one by default: a 1 GB bound must not make a process 1 GB bigger, created, fed a few
    requests, saved and loaded again."""
    before = resident_bytes()
    index = SuffixIndex(50_000, max_bytes=1 << 30)
    for i in range(4):
        index.add(list(range(i, i + 500)))
    again = SuffixIndex(50_000, max_bytes=1 << 30)
    again.copy_(index)
    grown = resident_bytes() - before
    assert grown < 24 << 20, f"{grown >> 20} MB resident for two indexes of 2,000 tokens each"
    assert again.continuations([7, 8, 9]).token[1] == 10


def test_nothing_runs_across_requests_and_bad_ids_are_refused():
    index = SuffixIndex(100, max_bytes=suffix.BYTES_PER_TOKEN * 1024)
    index.add([1, 2, 3])
    index.add([4, 5, 6])
    assert index.continuations([1, 2, 3], own=False) is None  # (3 ended its request: nothing followed it)
    assert index.continuations([3, 4, 5]) is None  # (no request holds 3, 4, 5 together)
    assert index.continuations([9, 4, 5]) is None
    index.add([4, 5, 6, 7])
    assert as_paths(index.continuations([4, 5, 6])) == {(7,): 1}
    for bad in ([100], [-1], [5, 1000]):
        with pytest.raises(ValueError):
            index.add(bad)


def test_save_and_load_give_the_same_drafts(tmp_path):
    rng = random.Random(1)
    index = SuffixIndex(VOCAB, max_bytes=suffix.BYTES_PER_TOKEN * 2048)
    for _ in range(40):
        index.add([rng.randrange(VOCAB) for _ in range(rng.randrange(0, 90))])
    index.save(tmp_path / "index.pt", "tok")
    again = SuffixIndex.load(tmp_path / "index.pt", VOCAB, "tok", max_bytes=suffix.BYTES_PER_TOKEN * 2048)
    assert again.content().tolist() == index.content().tolist() and again.requests == index.requests
    for _ in range(50):
        history = [rng.randrange(VOCAB) for _ in range(10)]
        a, b = index.continuations(history), again.continuations(history)
        assert (a is None and b is None) or (as_paths(a), a.agree, a.matches) == (as_paths(b), b.agree, b.matches)
    smaller = SuffixIndex.load(tmp_path / "index.pt", VOCAB, "tok", max_bytes=suffix.BYTES_PER_TOKEN * 1024)
    assert len(index.content()) > smaller.capacity  # a file larger than the bound keeps its newest tokens
    assert smaller.content().tolist() == index.content().tolist()[-smaller.capacity:]


def good_state():
    return {"tokens": torch.tensor([1, 2, 3, SEPARATOR], dtype=torch.int32), "vocab_size": 10,
            "fingerprint": "tok", "requests": 1}


@pytest.mark.parametrize("change, says", [
    (lambda s: s.pop("tokens"), "not a dict with"),
    (lambda s: s.update(tokens=s["tokens"].long()), "not a 1-D int32"),
    (lambda s: s.update(tokens=torch.tensor([[1]], dtype=torch.int32)), "not a 1-D int32"),
    (lambda s: s.update(tokens=torch.tensor([1, 10], dtype=torch.int32)), "outside 0..9"),
    (lambda s: s.update(tokens=torch.tensor([-2], dtype=torch.int32)), "outside 0..9"),
    (lambda s: s.update(requests=-1), "requests"),
    (lambda s: s.update(vocab_size="10"), "vocab_size"),
    (lambda s: s.update(vocab_size=11), "another vocabulary"),
    (lambda s: s.update(fingerprint="other"), "another vocabulary"),
])
def test_hostile_index_files_are_refused_in_one_line(tmp_path, change, says):
    state = good_state()
    change(state)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(IndexFileError, match=says) as e:
        SuffixIndex.load(tmp_path / "bad.pt", 10, "tok", max_bytes=suffix.BYTES_PER_TOKEN * 1024)
    assert "\n" not in str(e.value)


def test_unreadable_index_files_are_refused_in_one_line(tmp_path):
    (tmp_path / "garbage.pt").write_bytes(b"\x80\x04not a file at all")
    (tmp_path / "folder.pt").mkdir()
    for path, says in ((tmp_path / "garbage.pt", "is not a suffix index file"), (tmp_path / "folder.pt", "directory"),
                       (tmp_path / "missing.pt", "no suffix index")):
        with pytest.raises(IndexFileError, match=says):
            SuffixIndex.load(path, 10, "tok")
    torch.save(good_state(), tmp_path / "ok.pt")
    assert SuffixIndex.load(tmp_path / "ok.pt", 10, "tok").content().tolist() == [1, 2, 3, SEPARATOR]


# --- hybrid drafting from the index -----------------------------------------------------------------------------


def test_hybrid_grafts_the_index_branches_under_the_tree():
    from tr_engine.core.drafters import PromptLookup, TokenRecycling
    from tr_engine.core.hybrid import Hybrid
    from tr_engine.core.matrix import RecyclingMatrix
    from tr_engine.core.tree import build_tree

    matrix = RecyclingMatrix(20, 2)
    matrix.table[3] = torch.tensor([4, 5])  # the tree drafts 3 -> 4, 5
    index = SuffixIndex(20, max_bytes=suffix.BYTES_PER_TOKEN * 1024)
    index.add([1, 2, 3, 4, 6, 7])  # two earlier requests continued "1 2 3" with 4 6 7 and 9 9
    index.add([1, 2, 3, 9, 9])
    hybrid = Hybrid(TokenRecycling(matrix, build_tree([[0], [1]])), PromptLookup("cpu", length=4), index)
    draft = hybrid.propose([8, 1, 2, 3])  # (static tree: every candidate joins)
    # (the newest match first:) 9 9 hang under the root; 4 is the tree's own node, so 6 7 hang under it
    assert draft.tokens.tolist() == [3, 4, 5, 9, 9, 6, 7]
    assert draft.tree.parent.tolist() == [0, 0, 0, 0, 3, 1, 5]
    hybrid.learn(draft, [4, 6, 7, 11])  # the index's first branch came true
    learned = hybrid.suffix_stats.tries[0]  # (the matches agreed on 3 tokens: the first run class)
    assert learned != [0.0] * len(learned)
    hybrid.remember([5, 5, 5])
    assert index.requests == 3


def test_a_match_is_trusted_as_far_as_it_has_run():
    """The index's nodes are priced by the acceptance learned for their run: the tokens their match has agreed with
    by the time it drafts them (the history's agreement plus the node's depth less one). Where matches that agreed on
    3 tokens went wrong and matches that had run 32 and more went on, a fresh 3-token match's first node is priced
    low and a long match's nodes high; and the 3-token match's own deep nodes, had its first ones come true, are
    priced by the runs they would have."""
    from tr_engine.core.adaptive import confidence_bin
    from tr_engine.core.drafters import PromptLookup, TokenRecycling
    from tr_engine.core.hybrid import RUNS, Hybrid, run_class
    from tr_engine.core.matrix import RecyclingMatrix
    from tr_engine.core.tree import build_tree

    index = SuffixIndex(64, max_bytes=suffix.BYTES_PER_TOKEN * 1024)
    index.add(list(range(1, 48)))  # one earlier request: 1 2 ... 47
    hybrid = Hybrid(TokenRecycling(RecyclingMatrix(64, 2), build_tree([[0]])), PromptLookup("cpu", length=4), index)
    long_run = [60, 61] + list(range(1, 35))  # agrees with it on MAX_MATCH tokens: goes on with 35 36 ...
    fresh = [60, 61, 62, 3, 4, 5]  # agrees on 3: would go on with 6 7 ...
    assert hybrid.offered(long_run).agree == suffix.MAX_MATCH and hybrid.offered(fresh).agree == suffix.ORDER
    for _ in range(40):
        draft = hybrid.propose(long_run)
        hybrid.learn(draft, list(range(35, 48)) + [0])  # every node came true
        draft = hybrid.propose(fresh)
        hybrid.learn(draft, [59, 0])  # its first node did not
    assert run_class(suffix.MAX_MATCH) == len(RUNS) and run_class(suffix.ORDER) == 0
    long_values = hybrid.candidates(long_run, [], hybrid.offered(long_run)).value
    fresh_values = hybrid.candidates(fresh, [], hybrid.offered(fresh)).value
    assert long_values[1] > 0.9 and long_values[8] > 0.6 and fresh_values[1] < 0.2
    rates = hybrid.suffix_stats.rates()
    bin_ = confidence_bin(0.5)  # (one match: each node is half sure)
    assert fresh_values[30] / fresh_values[29] == pytest.approx(rates[run_class(suffix.ORDER + 29)][bin_])
    assert run_class(suffix.ORDER + 29) == len(RUNS)


def test_a_node_counts_for_every_source_that_proposed_it():
    """The matrix, prompt lookup and the index proposing one token is one node, counted for all three: a step's
    draft and accepted tokens by source (the numbers the server reports) follow the node's bits."""
    from tr_engine.core.drafters import LOOKUP, MATRIX, SUFFIX, PromptLookup, TokenRecycling
    from tr_engine.core.hybrid import Hybrid
    from tr_engine.core.generation import DraftCounts
    from tr_engine.core.matrix import RecyclingMatrix
    from tr_engine.core.tree import build_tree

    matrix = RecyclingMatrix(20, 2)
    matrix.table[3] = torch.tensor([4, 5])  # the tree drafts 3 -> 4, 5
    index = SuffixIndex(20, max_bytes=suffix.BYTES_PER_TOKEN * 1024)
    index.add([1, 2, 3, 4, 6, 7])  # the index continues "1 2 3" with 4 6 7
    hybrid = Hybrid(TokenRecycling(matrix, build_tree([[0], [1]])), PromptLookup("cpu", length=4), index)
    draft = hybrid.propose([3, 4, 6, 8, 1, 2, 3])  # prompt lookup copies what followed the earlier 3: 4 6 8 1
    assert draft.tokens.tolist() == [3, 4, 5, 6, 7, 8, 1]
    assert draft.tree.parent.tolist() == [0, 0, 0, 1, 3, 3, 5]
    assert draft.sources == [0, MATRIX | LOOKUP | SUFFIX, MATRIX, LOOKUP | SUFFIX, SUFFIX, LOOKUP, LOOKUP]
    counts = DraftCounts()
    counts.count(draft.tree.size, draft.sources, [1, 3, 5])  # 4 6 8 accepted
    counts.count(1, [0], [])  # a plain step: nothing drafted
    counts.count(3, [], [1])  # a drafter that does not say where its nodes came from: the totals alone
    assert (counts.drafted, counts.accepted, counts.histogram) == (8, 4, {3: 1, 0: 1, 1: 1})
    assert counts.by_source == {"matrix": [2, 1], "lookup": [4, 3], "suffix": [3, 2]}


def test_hybrid_with_an_index_is_plain_decoding_and_drafts_earlier_answers(tiny_factory):
    """Lossless alone and in a batch, and the index pays: asked again, a prompt's answer is drafted from the first
    time's, many tokens a step (a random tiny model, where the matrix and prompt lookup draft little)."""
    from curves import FREE

    from tr_engine.engine import Engine

    engine = Engine.from_pretrained(str(tiny_factory("suffix", dtype=torch.float64, vocab_size=300)), dtype="float64")
    prompts = ["the cat sat on the mat", "one two three four", "hello there, how are you"]
    plain = [engine.generate(p, max_new_tokens=40, method="ar").token_ids for p in prompts]
    index = SuffixIndex(engine.model.config.vocab_size, max_bytes=suffix.BYTES_PER_TOKEN * 4096)
    drafter = engine.new_drafter("hybrid", cost=FREE, suffix=index)
    first = [engine.generate(p, max_new_tokens=40, drafter=drafter) for p in prompts]
    assert [g.token_ids for g in first] == plain and index.requests == 3
    again = [engine.generate(p, max_new_tokens=40, drafter=drafter) for p in prompts]
    assert [g.token_ids for g in again] == plain
    steps = lambda gens: sum(g.generation.steps for g in gens)  # noqa: E731
    assert steps(again) * 3 <= steps(first)  # the whole answer was in the index
    batch = engine.new_drafter("hybrid", cost=FREE, suffix=index)
    engine.drafting.drafters["hybrid"] = batch  # (generate_batch decodes with the engine's own drafter)
    assert [r.token_ids for r in engine.generate_batch(prompts, max_new_tokens=40, method="hybrid")] == plain
    assert index.requests == 9


def test_the_index_is_saved_beside_the_matrix_and_loaded_with_it(tiny_factory, tmp_path):
    """The command line keeps a suffix index by default (--suffix-index 64), beside its --matrix file (hot start); a
    hostile one is refused in one line, the run stopped before answering (exit 2); --suffix-index 0 keeps none."""
    from cli import call_main

    from tr_engine.cli import generate
    from tr_engine.core.suffix import beside

    folder = str(tiny_factory("suffix", dtype=torch.float64, vocab_size=300))
    matrix = tmp_path / "m.pt"
    # (the default method and index; the static tree, which takes every candidate of the index: how many the adaptive
    # one affords depends on the cost curve measured beside a busy test worker, where it once took 1 of 24)
    command = ["--model", folder, "--prompt", "one two three four", "--max-new-tokens", "24", "--tree", "2.2.2",
               "--matrix", str(matrix), "--json"]
    runs = []
    for _ in range(2):  # (each run the command's main() afresh, in this process: its engine, loading the files)
        proc = call_main(generate.main, *command)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout))
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    # The second run drafted the first one's answer from the loaded index: a third of it at least.
    suffix = [r["speculative_decoding"]["by_source"]["suffix"]["num_accepted_tokens"] for r in runs]
    steps = [r["steps"] for r in runs]
    assert suffix[1] >= 8 and suffix[1] > suffix[0] and steps[1] < steps[0], (suffix, steps)
    saved = torch.load(beside(matrix), weights_only=True)
    assert saved["requests"] == 2 and beside(matrix).name == "m.suffix.pt"
    torch.save({**saved, "tokens": torch.tensor([1, 5000], dtype=torch.int32)}, beside(matrix))
    proc = call_main(generate.main, *command)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not a valid suffix index" in proc.stderr
    alone = tmp_path / "alone.pt"
    for _ in range(2):
        proc = call_main(generate.main, *command[:-2], str(alone), "--json", "--suffix-index", "0")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["speculative_decoding"]["by_source"]["suffix"]["num_draft_tokens"] == 0
    assert alone.is_file() and not beside(alone).exists()
