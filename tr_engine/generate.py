"""One-shot generation from the command line:

    python -m tr_engine.generate --model NAME_OR_PATH --prompt TEXT [--max-new-tokens N] [--dtype D] [--json]
        [--method tr|pld|hybrid|ar] [--tree 2.2.2|adaptive|FILE] [--matrix-k K] [--seed-from-prompt] [--matrix FILE]
        [--temperature T] [--top-k K] [--top-p P] [--seed S]

The model's chat template is applied unless --no-template. User errors print one line and exit with status 2
(tr_engine/cli.py has the other statuses).
"""

import json
import sys
from pathlib import Path

from tr_engine.cli import ArgumentParser, run, warn
from tr_engine.cli_args import add_engine_args, engine_from_args, integer, sampling_from_args
from tr_engine.errors import MatrixFileError


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m tr_engine.generate", description="Generate one answer.")
    add_engine_args(ap)
    ap.add_argument("--prompt", required=True, help="the user's message (or raw text with --no-template)")
    ap.add_argument("--max-new-tokens", type=integer(1), default=256)
    ap.add_argument("--no-template", action="store_true", help="feed the prompt as raw text, no chat template")
    ap.add_argument("--matrix", default=None, help="load the recycling matrix from FILE if it exists; save it back")
    ap.add_argument("--json", action="store_true", help="print ids, text and timings as one JSON object")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sampling = sampling_from_args(args)
    engine = engine_from_args(args)
    if args.matrix and Path(args.matrix).is_file():
        engine.load_matrix(args.matrix)  # a file that is not a matrix for this model stops here, left as it is
    result = engine.generate(args.prompt, args.max_new_tokens, chat_template=not args.no_template,
                             method=args.method, seed_from_prompt=args.seed_from_prompt,
                             temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    try:
        if args.json:
            print(json.dumps(result.as_dict(), ensure_ascii=False), flush=True)
        else:
            print(result.text, flush=True)
            g = result.generation
            mat = f", {result.mean_accepted:.2f} tokens/step" if args.method != "ar" else ""
            print(f"[{len(g.token_ids)} tokens, {result.tokens_per_s:.1f} tok/s{mat}, prefill {g.prefill_s:.2f}s]",
                  file=sys.stderr)
    finally:  # the answer is out first: a matrix that cannot be saved is a warning, never a lost answer
        if args.matrix:
            try:
                engine.save_matrix(args.matrix)
            except MatrixFileError as e:
                warn(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
