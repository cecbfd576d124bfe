"""One-shot generation from the command line:

    python -m tr_engine.generate --model NAME_OR_PATH --prompt TEXT [--max-new-tokens N] [--dtype D] [--json]
        [--method tr|pld|hybrid|ar] [--tree 2.2.2|adaptive|FILE] [--matrix-k K] [--seed-from-prompt] [--matrix FILE]
        [--temperature T] [--top-k K] [--top-p P] [--seed S]
    python -m tr_engine.generate --prompts-file FILE [--batch N] ...

The model's chat template is applied unless --no-template. User errors print one line and exit with status 2
(tr_engine/cli/common.py has the other statuses). With --prompts-file, every line of FILE is one request (text, or a
JSON list of {"role", "content"} messages), decoded up to --batch at a time (tr_engine/core/batch.py), and each answer
is one
JSON line on stdout, in the file's order; a request that cannot run gets {"index": i, "error": ...} (and a line on
stderr) while the others finish, and the exit status is then 2.
"""

import json
import os
import sys
from pathlib import Path

from tr_engine.cli.args import add_engine_args, engine_from_args, integer, sampling_from_args
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.errors import MatrixFileError, UserError, warn


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m tr_engine.generate", description="Generate one answer.")
    add_engine_args(ap)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="the user's message (or raw text with --no-template)")
    what.add_argument("--prompts-file", type=Path, metavar="FILE",
                      help="one request per line (text, or a JSON list of messages), answered as JSON lines")
    ap.add_argument("--batch", type=integer(1), default=8, metavar="N",
                    help="with --prompts-file: sequences decoded together (more are queued; default 8)")
    ap.add_argument("--max-new-tokens", type=integer(1), default=256)
    ap.add_argument("--no-template", action="store_true", help="feed the prompt as raw text, no chat template")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="decode past the end-of-sequence token to --max-new-tokens (a benchmark's fixed length)")
    ap.add_argument("--matrix", default=None, help="load the recycling matrix from FILE if it exists; save it back")
    ap.add_argument("--json", action="store_true", help="print ids, text and timings as one JSON object")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sampling = sampling_from_args(args)
    prompts = read_prompts(args.prompts_file) if args.prompts_file else None
    engine = engine_from_args(args)
    if args.matrix and Path(args.matrix).is_file():
        engine.load_matrix(args.matrix)  # a file that is not a matrix for this model stops here, left as it is
    speaks = engine.model.shard.rank == 0  # --tp: every rank decodes alike; rank 0 alone prints and saves the matrix
    if not speaks:
        sys.stdout, args.matrix = open(os.devnull, "w"), None
    if prompts is not None:
        return answer_file(engine, prompts, args, sampling)
    result = engine.generate(args.prompt, args.max_new_tokens, chat_template=not args.no_template,
                             method=args.method, seed_from_prompt=args.seed_from_prompt,
                             sampling=sampling, ignore_eos=args.ignore_eos)
    try:
        if args.json:
            print(json.dumps({**result.as_dict(), "cpu_tier": engine.cpu_tier,
                              "cpu_threads": engine.cpu_threads}, ensure_ascii=False), flush=True)
        else:
            print(result.text, flush=True)
            g = result.generation
            mat = f", {result.mean_accepted:.2f} tokens/step" if args.method != "ar" else ""
            if speaks:
                print(f"[{len(g.token_ids)} tokens, {result.tokens_per_s:.1f} tok/s{mat}, prefill "
                      f"{g.prefill_s:.2f}s]", file=sys.stderr)
    finally:  # the answer is out first: a matrix that cannot be saved is a warning, never a lost answer
        if args.matrix:
            try:
                engine.save_matrix(args.matrix)
            except MatrixFileError as e:
                warn(str(e))
    return 0


def read_prompts(path: Path) -> list:
    """The requests of a prompts file: each line a prompt, or a JSON list of messages (a line that starts with "[");
    a line that is neither stays as it is, for the engine to refuse alone."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"--prompts-file {path} does not exist; give a file with one prompt per line")
    except IsADirectoryError:
        raise UserError(f"--prompts-file {path} is a directory; give a file with one prompt per line")
    except UnicodeDecodeError as e:
        raise UserError(f"--prompts-file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8")
    except OSError as e:
        raise UserError(f"--prompts-file {path} cannot be read ({e.strerror or e})")
    prompts = []
    for line in lines:
        if line.lstrip().startswith("["):
            try:
                line = json.loads(line)
            except json.JSONDecodeError as e:
                line = BadLine(f"not a JSON list of messages ({e.msg} at column {e.colno})")
        prompts.append(line)
    if not prompts:
        raise UserError(f"--prompts-file {path} holds no prompts; write one per line")
    return prompts


class BadLine(str):
    """A prompts-file line that could not be read: the engine refuses it (not a prompt), with this reason."""


def answer_file(engine, prompts: list, args, sampling) -> int:
    bad = {i: p for i, p in enumerate(prompts) if isinstance(p, BadLine)}
    results = engine.generate_batch([p if i not in bad else [] for i, p in enumerate(prompts)], args.max_new_tokens,
                                    chat_template=not args.no_template, method=args.method,
                                    sampling=sampling, seed=args.seed, seed_from_prompt=args.seed_from_prompt,
                                    ignore_eos=args.ignore_eos)
    failed = 0
    for i, r in enumerate(results):
        error = f"prompt {i}: {bad[i]}" if i in bad else r.error
        if error is not None:
            failed += 1
            print(f"error: {error}", file=sys.stderr, flush=True)
            print(json.dumps({"index": i, "error": error}, ensure_ascii=False), flush=True)
        else:
            print(json.dumps({"index": i, **r.as_dict(), "cpu_tier": engine.cpu_tier,
                              "cpu_threads": engine.cpu_threads}, ensure_ascii=False), flush=True)
    if args.matrix:
        try:
            engine.save_matrix(args.matrix)
        except MatrixFileError as e:
            warn(str(e))
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(run(main))
