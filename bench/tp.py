"""Tensor parallelism on this CPU: each rank's memory and the answers, TP=1 against TP=2 (and more), side by side.

    python -m bench.tp [--model smollm2-135m-instruct] [--dtype float32] [--tps 1 2] [--max-new-tokens 48]

Each configuration runs in fresh processes started as torchrun starts them (`spawn`, gloo), one thread per rank so
that N ranks use N cores (TP=1 gets one thread too: the same cores per rank). Reported per rank: resident memory
(VmRSS) after loading and after answering, and its share of the weights (the bytes of the tensors it holds);
per configuration: plain and hybrid decoding's tokens/s on the dev subset's first turns, and how many answers equal
TP=1's, token for token. On a CPU, TP=2 is a correctness and memory check: two ranks on two cores exchange every
layer's activations through gloo, which costs more than the halved matmuls save. Writes tp.{md,json}.
"""

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path


SUBSET = Path(__file__).resolve().parents[1] / "tests" / "data" / "dev_subset.jsonl"


def rss_mb() -> float:
    from bench.machine import rss_kb

    return rss_kb() / 1024


def worker(rank: int, world: int, port: int, args: dict, prompts: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from bench.shapes import held_bytes
    from tr_engine.engine import Engine

    engine = Engine.from_pretrained(args["model"], dtype=args["dtype"], tp=world, threads=1, max_context=1024)
    loaded = rss_mb()
    weights = held_bytes(engine.model)
    row = {"rank": rank, "rss_mb_loaded": loaded, "weights_mb": weights / 2**20}
    for method in ("ar", "hybrid"):
        engine.generate(prompts[0], 8, method=method)  # warm (and the adaptive tree's curve measured)
        t0, tokens, ids = time.perf_counter(), 0, []
        for p in prompts:
            r = engine.generate(p, args["max_new_tokens"], method=method)
            tokens, ids = tokens + len(r.token_ids), ids + [r.token_ids]
        row[f"{method}_tokens_per_s"] = tokens / (time.perf_counter() - t0)
        row[f"{method}_ids"] = ids
    row["rss_mb_after"] = rss_mb()
    Path(f"{out}.{rank}").write_text(json.dumps(row))
    if world > 1:  # every rank done, then out without gloo's teardown (tr_engine.model.parallel.leave says why)
        from tr_engine.model.parallel import leave

        leave()
        os._exit(0)


def run(args, prompts: list[str]) -> dict:
    import torch.multiprocessing as mp

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tp in args.tps:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            path = f"{tmp}/tp{tp}"
            mp.start_processes(worker, args=(tp, port, vars(args), prompts, path), nprocs=tp, start_method="spawn")
            out[tp] = [json.loads(Path(f"{path}.{r}").read_text()) for r in range(tp)]
            print(f"TP={tp}: " + ", ".join(f"rank {r['rank']} {r['rss_mb_loaded']:.0f} MB" for r in out[tp]),
                  file=sys.stderr, flush=True)
    base = out[args.tps[0]][0]
    for rows in out.values():
        for method in ("ar", "hybrid"):
            rows[0][f"{method}_same"] = sum(a == b for a, b in zip(rows[0][f"{method}_ids"], base["ar_ids"]))
    return out


def write(folder: Path, data: dict, info: dict, args, n: int) -> str:
    from bench.machine import machine_line, save_results

    lines = ["# Tensor parallelism on this CPU: memory per rank and answers, side by side", "",
             f"{machine_line(info)}. {args.model} in {args.dtype}; every rank one thread (one core), started as "
             f"torchrun starts them (spawn, gloo); the dev subset's {n} first turns, greedy, {args.max_new_tokens} "
             "new tokens at most. Weights: the bytes of the tensors the rank holds (its slice; packed matmul layouts "
             "included). Same: answers equal to the first configuration's plain decoding, token for token.", "",
             "| TP | rank | weights MB | RSS loaded MB | RSS after MB | plain tok/s | hybrid tok/s | plain same | "
             "hybrid same |", "|---|---|---|---|---|---|---|---|---|"]
    for tp, rows in data.items():
        for r in rows:
            same = (f"{r['ar_same']}/{n} | {r['hybrid_same']}/{n}" if r["rank"] == 0 else "- | -")
            lines.append(f"| {tp} | {r['rank']} | {r['weights_mb']:.0f} | {r['rss_mb_loaded']:.0f} | "
                         f"{r['rss_mb_after']:.0f} | {r['ar_tokens_per_s']:.1f} | {r['hybrid_tokens_per_s']:.1f} | "
                         f"{same} |")
    for rows in data.values():  # the token ids stay out of the record; whether they matched is in the table
        for r in rows:
            r.pop("ar_ids"), r.pop("hybrid_ids")
    return save_results(folder / "tp", "\n".join(lines) + "\n", {str(k): v for k, v in data.items()}, info)


def main(argv=None) -> int:
    from bench.machine import machine_info
    from tr_engine.cli.common import ArgumentParser
    from tr_engine.cli.args import integer

    ap = ArgumentParser(prog="python -m bench.tp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tps", nargs="+", type=integer(1), default=[1, 2])
    ap.add_argument("--max-new-tokens", type=integer(1), default=48)
    ap.add_argument("--questions-file", type=Path, default=SUBSET)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    prompts = [json.loads(line)["turns"][0] for line in args.questions_file.read_text().splitlines() if line.strip()]
    info = machine_info()
    print(write(args.out, run(args, prompts), info, args, len(prompts)))
    return 0


if __name__ == "__main__":
    from tr_engine.cli.common import run as run_cli

    raise SystemExit(run_cli(main))
