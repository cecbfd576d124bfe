"""Mutation check: plant each bug below, one at a time, in a copy of the working tree, run the tests meant to guard
against it, and report which of them fail. A bug that no test catches is a claim nobody guards.

    python tests/mutants.py [--only NAME ...] [--fast] [--all-names]    (make mutants; not in CI: ~12 minutes here)

Each mutant is a one-line source change (its text must occur exactly once, so a refactor that moves the code makes
the script say so instead of silently testing nothing). The copy holds the tracked and untracked files and the built
op library; its tests run with PYTHONPATH on the copy, so commands the tests start import the mutated package too.
First the selected tests run unmutated (all must pass), then once per mutant. --fast leaves out the tests that load
the default model. Exit status 0 when every mutant is caught.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Mutant:
    name: str
    bug: str  # what a user would see
    file: str
    old: str
    new: str
    files: list[str]  # test files, run without the slow tests
    slow: list[str] = field(default_factory=list)  # slow tests (node ids), left out by --fast


MUTANTS = [
    Mutant("never-drafts", "the adaptive tree prices every draft out (measured cost curve x100): every step is plain",
           "tr_engine/core/cost.py", "rel.append(round(top, 4))", "rel.append(round(top if T == 1 else 100 * top, 4))",
           ["tests/test_speculative.py", "tests/test_adaptive.py"],
           ["tests/test_speculative.py::test_smollm2_fp32_methods_emit_the_ar_tokens",
            "tests/test_speculative.py::test_smollm2_half_speculative_decoding_is_bitwise_lossless"]),
    Mutant("no-compaction", "accepted nodes' K/V stay where the verify wrote them",
           "tr_engine/core/speculative.py", "        ops.compact_kv_(cache.data, src, L + 1)\n", "        del src\n",
           ["tests/test_speculative.py", "tests/test_sampling.py"]),
    Mutant("compact-first-node-only", "compaction moves the first accepted node and leaves the rest",
           "tr_engine/core/speculative.py", "src = torch.tensor([L + i for i in path], device=cache.data.device)",
           "src = torch.tensor([L + i for i in path[:1]], device=cache.data.device)",
           ["tests/test_speculative.py", "tests/test_sampling.py"]),
    Mutant("sampling-bias-5%", "sampling favours the most likely token: its probability x1.05",
           "tr_engine/core/sampling.py", "        p = probabilities(logits, self.sampling)\n",
           "        p = probabilities(logits, self.sampling)\n        p[p.argmax()] *= 1.05\n",
           ["tests/test_sampling.py"]),
    Mutant("sampling-bias-2%", "sampling favours the most likely token: its probability x1.02",
           "tr_engine/core/sampling.py", "        p = probabilities(logits, self.sampling)\n",
           "        p = probabilities(logits, self.sampling)\n        p[p.argmax()] *= 1.02\n",
           ["tests/test_sampling.py"]),
    Mutant("chat-prompt-newline", "chat --prompt answers its message with a stray newline at the end",
           "tr_engine/cli/chat.py", "turn(session, args.prompt, ", 'turn(session, args.prompt + "\\n", ',
           ["tests/test_chat.py"]),
    Mutant("drafting-one-token-short", "drafting methods answer max_new_tokens - 1 tokens through the engine",
           "tr_engine/engine.py", "speculative_steps(self.runners.runner, self.slot, ids, drafter, max_new_tokens,",
           "speculative_steps(self.runners.runner, self.slot, ids, drafter, max_new_tokens - 1,",
           ["tests/test_chat.py"]),
    # Caught before the guards above were written; kept so that they stay caught.
    Mutant("accept-last-sibling", "acceptance descends to the last matching sibling, not the first",
           "tr_engine/core/speculative.py", "(c for c in draft.tree.children[node] if tokens[c] == predicted[node])",
           "(c for c in reversed(draft.tree.children[node]) if tokens[c] == predicted[node])",
           ["tests/test_speculative.py"]),
    Mutant("no-tree-mask", "a verify's tokens attend to every other draft token, not their ancestors alone",
           "tr_engine/core/speculative.py", "tree_mask=draft.tree.mask if draft.tree.size > 1 else None,",
           "tree_mask=None,",
           ["tests/test_speculative.py"]),
    Mutant("recycle-shifted", "recycling writes each node's top-k into the row of the token after it",
           "tr_engine/core/drafters.py", "        self.matrix.recycle_(draft.tokens, logits)\n",
           "        self.matrix.recycle_(draft.tokens.roll(1), logits)\n",
           ["tests/test_speculative.py"]),
]


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored) and the built op library."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    built = [str(p.relative_to(ROOT)) for p in (ROOT / "tr_engine").glob("_C*.so")]
    if not built:
        sys.exit("error: the op library is not built; run `make install` first")
    for rel in filter(None, listed + built):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(tree: Path, mutant: Mutant, fast: bool, report: Path) -> tuple[set[str], int, float]:
    """Run the mutant's tests in `tree`: the names of those that failed, how many ran, seconds."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    calls = [mutant.files + ["-m", "not slow"]] + ([] if fast or not mutant.slow else [mutant.slow])
    failed, ran, t0 = set(), 0, time.perf_counter()
    for i, args in enumerate(calls):
        xml = report.with_suffix(f".{i}.xml")
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args],
                       cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not xml.is_file():
            failed.add(f"(pytest did not run: {' '.join(args)})")
            continue
        for case in ET.parse(xml).getroot().iter("testcase"):
            if case.find("skipped") is not None:
                continue
            ran += 1
            if case.find("failure") is not None or case.find("error") is not None:
                failed.add(f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}")
    return failed, ran, time.perf_counter() - t0


def grouped(failed: set[str]) -> list[str]:
    """Failed tests by function: a parametrized test's cases as one name with their count."""
    counts: dict[str, int] = {}
    for name in failed:
        base = name.split("[", 1)[0]
        counts[base] = counts.get(base, 0) + 1
    return [name if n == 1 else f"{name} ({n} cases)" for name, n in sorted(counts.items())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/mutants.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=[m.name for m in MUTANTS], help="these mutants alone")
    ap.add_argument("--fast", action="store_true", help="leave out the tests that load the default model")
    ap.add_argument("--all-names", action="store_true", help="name every case of a parametrized test that fails")
    args = ap.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    with tempfile.TemporaryDirectory(prefix="tr-mutants-") as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(tree)
        for m in mutants:  # every mutant must apply, before any test runs
            count = (tree / m.file).read_text().count(m.old)
            if count != 1:
                sys.exit(f"error: mutant {m.name}: its text occurs {count} times in {m.file} (expected once); "
                         "update tests/mutants.py to the code as it is now")
        baseline = Mutant("none", "", "", "", "", sorted({f for m in mutants for f in m.files}),
                          sorted({t for m in mutants for t in m.slow}))
        failed, ran, seconds = run_tests(tree, baseline, args.fast, Path(tmp) / "baseline")
        print(f"unmutated: {ran} tests, {len(failed)} failed ({seconds:.0f} s)", flush=True)
        if failed:
            print("\n".join(f"  {t}" for t in sorted(failed)))
            sys.exit("error: the tests fail without a mutant; fix them first")
        survivors = []
        print("\n| mutant | the bug | tests run | caught by |\n|---|---|---|---|")
        for m in mutants:
            path = tree / m.file
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new))
            try:
                failed, ran, seconds = run_tests(tree, m, args.fast, Path(tmp) / m.name)
            finally:
                path.write_text(original)
            caught = ", ".join(sorted(failed) if args.all_names else grouped(failed)) or "**nothing: it survives**"
            print(f"| {m.name} | {m.bug} | {ran} ({seconds:.0f} s) | {len(failed)}: {caught} |", flush=True)
            if not failed:
                survivors.append(m.name)
    print(f"\n{len(mutants) - len(survivors)} of {len(mutants)} mutants caught"
          + (f"; surviving: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
