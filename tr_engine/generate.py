"""One-shot generation from the command line:

    python -m tr_engine.generate --model NAME_OR_PATH --prompt TEXT [--max-new-tokens N] [--dtype D] [--json]
        [--method tr|pld|ar] [--tree 2.2.2|FILE] [--topk K] [--seed-from-prompt] [--matrix FILE]

The model's chat template is applied unless --no-template. User errors print one line and exit with status 2.
"""

import argparse
import json
import sys
from pathlib import Path

from tr_engine.errors import UserError
from tr_engine.models import DEFAULT_MODEL


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tr_engine.generate", description="Generate one answer.")
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"model folder or known name (default {DEFAULT_MODEL})")
    ap.add_argument("--model-dir", default=None, help="folder that holds known models by name (searched first)")
    ap.add_argument("--prompt", required=True, help="the user's message (or raw text with --no-template)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    ap.add_argument("--max-context", type=int, default=None, help="KV-cache capacity in tokens")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all available)")
    ap.add_argument("--ops", default="kernels", choices=["kernels", "reference"], help="compiled ops or their references")
    ap.add_argument("--no-template", action="store_true", help="feed the prompt as raw text, no chat template")
    ap.add_argument("--method", default="tr", choices=["tr", "pld", "ar"],
                    help="tr: Token Recycling (default); pld: prompt lookup; ar: plain greedy. Same output tokens")
    ap.add_argument("--tree", default="2.2.2", help="draft tree: 2.2.2 (the paper's) or a JSON file of rank paths")
    ap.add_argument("--topk", type=int, default=8, help="candidates kept per token in the recycling matrix")
    ap.add_argument("--seed-from-prompt", action="store_true", help="seed the matrix from the prompt's prefill")
    ap.add_argument("--matrix", default=None, help="load the recycling matrix from FILE if it exists; save it back")
    ap.add_argument("--json", action="store_true", help="print ids, text and timings as one JSON object")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from tr_engine.engine import Engine

    try:
        engine = Engine.from_pretrained(args.model, args.device, args.dtype, args.max_context, args.model_dir,
                                        args.ops, args.threads, args.tree, args.topk)
        if args.matrix and Path(args.matrix).is_file():
            engine.load_matrix(args.matrix)
        result = engine.generate(args.prompt, args.max_new_tokens, chat_template=not args.no_template,
                                 method=args.method, seed_from_prompt=args.seed_from_prompt)
        if args.matrix:
            engine.save_matrix(args.matrix)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result.as_dict(), ensure_ascii=False))
    else:
        print(result.text)
        g = result.generation
        mat = f", {result.mean_accepted:.2f} tokens/step" if args.method != "ar" else ""
        print(f"[{len(g.token_ids)} tokens, {result.tokens_per_s:.1f} tok/s{mat}, prefill {g.prefill_s:.2f}s]",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
