"""The server under load, as clients see it: `python -m tr_engine.serve` in a child process, and N concurrent clients
(1, 4, 16) of OpenAI's own `openai` package, each streaming dev-split questions.

    python -m bench.serve [--clients 1 4 16] [--methods ar hybrid] [--questions 32] [--max-new-tokens 128]
    python -m bench.serve --soak [--requests 500] [--soak-clients 16] [--suffix-index MB --kill]
    python -m bench.serve --multi-turn [--batch 4]

Load: for each method and client count a fresh server (its matrix and suffix index warmed first on other questions, so
that no row drafts from the answers an earlier row gave), the same questions in every row, taken from one shared list
by whichever client is free. Reported: total throughput (every answer's
tokens over the wall clock), time to first token (TTFT: request sent to its first text) and time per output token
after the first (TPOT: the rest of the answer's time over its remaining tokens), p50 and p99 over the requests; and
whether every answer equals plain decoding's (the ar rows, one client).

Soak (--soak): one server with its matrix in a file, `--requests` requests from `--soak-clients` clients with random
lengths, every one streamed and a random tenth dropped after a few events (a client gone). Reported: the server's
resident memory (VmRSS) after the first 50 requests and after the last (must stay within 10%), the requests that
failed other than the dropped ones (must be none), SIGTERM's exit status (or with --kill, SIGKILL's), and whether what
it saved loads. With `--suffix-index MB` the server keeps a suffix index of that bound, saved beside the matrix: its
size is sampled every 50 requests (it must never pass the bound) and it must load after the end.
Multi-turn (--multi-turn): the dev split's two-turn conversations, each turn a request with the conversation so far,
on a server with prefix reuse and on one without: the second turns' TTFT both ways, the prompt tokens found cached
(`usage.prompt_tokens_details.cached_tokens` and the `/metrics` counter), and whether every answer is the same.
Writes serve.{md,json}, serve_soak.{md,json} or serve_multi_turn.{md,json}.
"""

import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from bench.batch import percentile

CLIENTS = (1, 4, 16)
METHODS = ("ar", "hybrid")
SOAK_BASELINE = 50
TOLERANCE = 0.10


class Server:
    """A `python -m tr_engine.serve` child on a free port."""

    def __init__(self, args, *flags: str):
        import openai

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tr_engine.serve", "--model", args.model, "--dtype", args.dtype, "--threads",
             str(args.threads), "--port", str(self.port), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).resolve().parents[1])
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=600)
        deadline = time.time() + 600
        while True:
            try:
                self.model = self.client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                if self.process.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"error: the server did not start: {self.process.stdout.read()}")
                time.sleep(0.5)

    def new_client(self):
        """An `openai` client of this server, its first request (and the library's lazy imports) done."""
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                               timeout=600)
        client.models.list()
        return client

    def rss_mb(self) -> float:
        from bench.machine import rss_kb

        return rss_kb(self.process.pid) / 1024

    def stop(self, kill: bool = False) -> tuple[int, str]:
        """SIGTERM (a graceful end), or with `kill` SIGKILL (what an out-of-memory killer or a crash does)."""
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        out, _ = self.process.communicate(timeout=120)
        return self.process.returncode, out

    def metrics(self) -> dict[str, float]:
        """/metrics' unlabelled values by name."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as response:
            lines = response.read().decode().splitlines()
        return {line.split()[0]: float(line.split()[1]) for line in lines
                if line.startswith("tr_engine_") and "{" not in line}


def ask(client, model: str, question: str | list[dict], max_tokens: int, drop_after: int | None = None) -> dict:
    """One streamed request (a question, or a conversation's messages): its text, token count, TTFT and TPOT (None
    when dropped on purpose), and the prompt tokens the server found cached (prefix reuse)."""
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else question
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages,
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text, first, last, usage, events, spec = [], None, None, None, 0, {}
    for chunk in stream:
        events += 1
        if chunk.choices and chunk.choices[0].finish_reason:  # (the last chunk carries the speculative numbers)
            spec = (chunk.model_extra.get("metrics") or {}).get("speculative_decoding") or {}
        if drop_after is not None and events > drop_after:
            stream.close()  # the client goes away mid-answer
            return {"dropped": True}
        if chunk.usage is not None:
            usage = chunk.usage
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            text.append(piece)
    tokens = usage.completion_tokens
    ttft = (first if first is not None else time.perf_counter()) - t0
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    return {"text": "".join(text), "tokens": tokens, "ttft": ttft, "tpot": tpot, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": cached or 0, "mat": spec.get("mean_acceptance_length")}


def load(server: Server, questions: list[str], clients: int, max_tokens: int) -> dict:
    todo = list(enumerate(questions))
    results = [None] * len(questions)
    lock = threading.Lock()

    def client(own):
        while True:
            with lock:
                if not todo:
                    return
                i, q = todo.pop(0)
            results[i] = ask(own, server.model, q, max_tokens)

    own = [server.new_client() for _ in range(clients)]  # connected and warm before the clock starts
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in own]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttft, tpot = [r["ttft"] for r in results], [r["tpot"] for r in results if r["tpot"] is not None]
    return {"clients": clients, "requests": len(results), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "ttft_ms_p50": 1e3 * percentile(ttft, 0.5),
            "ttft_ms_p99": 1e3 * percentile(ttft, 0.99), "tpot_ms_p50": 1e3 * percentile(tpot, 0.5),
            "tpot_ms_p99": 1e3 * percentile(tpot, 0.99),
            "mat": sum(r["mat"] for r in results) / len(results), "texts": [r["text"] for r in results]}


def run_load(args, questions: list[str], warm: list[str]) -> dict:
    rows = {}
    for method in args.methods:
        for clients in args.clients:  # a fresh server a row: none drafts from what an earlier row answered (its index
            server = Server(args, "--method", method, "--batch", str(max(args.clients)), "--no-persist",  # and matrix
                            "--max-queued", "1024")  # would remember the same questions: hybrid drew 12.6 a step)
            try:
                for q in warm:  # the matrix, hot (as a server's is after its first requests)
                    ask(server.client, server.model, q, args.max_new_tokens)
                row = load(server, questions, clients, args.max_new_tokens)
            finally:
                code, out = server.stop()
            if code != 0:
                raise SystemExit(f"error: the {method} server exited with {code}: {out}")
            rows[f"{method}@{clients}"] = row
            print(f"{method}, {clients} clients: {row['tokens_per_s']:.1f} tok/s, TTFT p50 "
                  f"{row['ttft_ms_p50']:.0f} ms, TPOT p50 {row['tpot_ms_p50']:.1f} ms", file=sys.stderr, flush=True)
    base = rows[f"{args.methods[0]}@{args.clients[0]}"]
    want = base["texts"]
    for row in rows.values():
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["identical"] = sum(a == b for a, b in zip(row.pop("texts"), want))
    return rows


def metric(server: Server, name: str) -> float:
    """A counter of the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f"tr_engine_{name} "):
                return float(line.split()[-1])
    raise SystemExit(f"error: the server's /metrics has no tr_engine_{name}")


def multi_turn(args, conversations: list[list[str]]) -> dict:
    """Each two-turn conversation through the API, one request at a time: the first turn, then the second with the
    first's answer in its messages; once on a server with prefix reuse and once without. Returns per mode the
    second turns' TTFTs, their prompt and cached tokens, the server's reused-token counter, and every answer."""
    modes = {}
    for reuse in ("off", "on"):
        server = Server(args, "--batch", str(args.batch), "--no-persist", "--prefix-reuse", reuse)
        try:
            answers, second = [], []
            for turns in conversations:
                messages = [{"role": "user", "content": turns[0]}]
                first = ask(server.client, server.model, messages, args.max_new_tokens)
                messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": turns[1]}]
                then = ask(server.client, server.model, messages, args.max_new_tokens)
                answers += [first["text"], then["text"]]
                second.append(then)
                print(f"prefix reuse {reuse}: second turn {len(second)} TTFT {1e3 * then['ttft']:.0f} ms, "
                      f"{then['cached_tokens']}/{then['prompt_tokens']} prompt tokens cached", file=sys.stderr,
                      flush=True)
            reused = metric(server, "prefix_reused_tokens_total")
        finally:
            code, out = server.stop()
        if code != 0:
            raise SystemExit(f"error: the server (--prefix-reuse {reuse}) exited with {code}: {out}")
        ttft = [r["ttft"] for r in second]
        modes[reuse] = {"ttft_ms": [1e3 * t for t in ttft], "ttft_ms_p50": 1e3 * percentile(ttft, 0.5),
                        "ttft_ms_mean": 1e3 * sum(ttft) / len(ttft),
                        "prompt_tokens": [r["prompt_tokens"] for r in second],
                        "cached_tokens": [r["cached_tokens"] for r in second], "reused_counter": reused,
                        "answers": answers}
    on, off = modes["on"], modes["off"]
    return {"conversations": len(conversations), "modes": modes,
            "identical": sum(a == b for a, b in zip(on["answers"], off["answers"])), "answers": len(on["answers"]),
            "ttft_ratio_p50": off["ttft_ms_p50"] / on["ttft_ms_p50"],
            "ttft_ratio_mean": off["ttft_ms_mean"] / on["ttft_ms_mean"]}


def write_multi_turn(folder: Path, r: dict, info: dict, args) -> str:
    from bench.machine import machine_line, save_results

    on, off = r["modes"]["on"], r["modes"]["off"]
    prompt, cached = sum(on["prompt_tokens"]), sum(on["cached_tokens"])
    lines = ["# Prefix reuse across requests: two-turn conversations through the API", "",
             f"{machine_line(info)}. {args.model} in {args.dtype}, `python -m tr_engine.serve --batch {args.batch}` "
             f"(default method), the dev split's {r['conversations']} two-turn conversations, one request at a time: "
             "the first turn, then the second with the first's answer in its messages; greedy, "
             f"{args.max_new_tokens} new tokens at most, {args.threads} threads. Once with `--prefix-reuse on` (the "
             "default: the second turn finds the first turn's prompt and answer in a slot and prefills only what is "
             "new) and once with `--prefix-reuse off`. TTFT: request sent to its first text, second turns only.", "",
             "| prefix reuse | TTFT p50 ms | TTFT mean ms | prompt tokens (2nd turns) | cached (usage) | "
             "`tr_engine_prefix_reused_tokens_total` |", "|---|---|---|---|---|---|"]
    for name, m in (("off", off), ("on", on)):
        lines.append(f"| {name} | {m['ttft_ms_p50']:.0f} | {m['ttft_ms_mean']:.0f} | {sum(m['prompt_tokens'])} | "
                     f"{sum(m['cached_tokens'])} | {m['reused_counter']:.0f} |")
    lines += ["", f"- second turn's TTFT, without reuse over with: **{r['ttft_ratio_p50']:.2f}x** (p50), "
              f"{r['ttft_ratio_mean']:.2f}x (mean); {cached} of the second turns' {prompt} prompt tokens were "
              f"found cached ({100 * cached / max(prompt, 1):.0f}%)",
              f"- identical answers with and without reuse: {r['identical']}/{r['answers']} (both turns of every "
              "conversation)", ""]
    text = "\n".join(lines)
    return save_results(folder / "serve_multi_turn", text, {"args": _args(args), **r}, info)


def soak(args, questions: list[str]) -> dict:
    from tr_engine.engine import Engine

    matrix = Path(args.out) / ".soak_matrix.pt"
    index = matrix.with_suffix(".suffix.pt")
    for f in (matrix, index):
        f.unlink(missing_ok=True)
    extra = ("--suffix-index", str(args.suffix_index))  # (0: none; the server keeps 64 MB unless told)
    server = Server(args, "--matrix", str(matrix), "--max-queued", "1024", "--save-every", str(args.save_every),
                    *extra)
    rng = random.Random(0)
    plan = [(rng.choice(questions), rng.randint(8, 160), rng.randint(1, 6) if rng.random() < 0.1 else None)
            for _ in range(args.requests)]
    lock, done, failures, dropped, rss, samples = threading.Lock(), [0], [], [0], {}, []

    def client(own):
        while True:
            with lock:
                if not plan:
                    return
                question, max_tokens, drop = plan.pop()
            try:
                r = ask(own, server.model, question, max_tokens, drop)
                if r.get("dropped"):
                    with lock:
                        dropped[0] += 1
            except Exception as e:  # noqa: BLE001 (every failure is counted and reported)
                with lock:
                    failures.append(f"{type(e).__name__}: {e}")
            with lock:
                done[0] += 1
                if done[0] == SOAK_BASELINE:
                    rss["after_50"] = server.rss_mb()
                if done[0] % 50 == 0:
                    m = server.metrics()
                    samples.append({"requests": done[0], "rss_mb": server.rss_mb(),
                                    "index_tokens": m.get("tr_engine_suffix_index_tokens"),
                                    "index_bytes": m.get("tr_engine_suffix_index_bytes")})
                    print(f"{done[0]} requests, server RSS {samples[-1]['rss_mb']:.0f} MB, suffix index "
                          f"{samples[-1]['index_tokens']} tokens", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(server.new_client(),)) for _ in range(args.soak_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(1.0)  # the last dropped requests leave at their next step
    rss["after_last"] = server.rss_mb()
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as response:
        metrics = [line for line in response.read().decode().splitlines() if line.startswith("tr_engine_")]
    bound = server.metrics().get("tr_engine_suffix_index_bound_bytes")
    code, out = server.stop(kill=args.kill)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, suffix_bytes=args.suffix_index << 20)
    try:  # what the server saved last (periodically, or at its graceful end) loads: the matrix and the index beside it
        engine.load_matrix(matrix)
        loads = bool(engine.matrix.table.any()) and (not args.suffix_index or engine.drafting.suffix.requests > 0)
    except Exception as e:  # noqa: BLE001
        loads = f"{type(e).__name__}: {e}"
    for f in (matrix, index):
        f.unlink(missing_ok=True)
    growth = rss["after_last"] / rss["after_50"] - 1
    within = all(x["index_bytes"] <= bound for x in samples) if args.suffix_index else None
    return {"requests": args.requests, "clients": args.soak_clients, "seconds": wall, "dropped": dropped[0],
            "failed": len(failures), "failures": failures[:10], "rss_mb_after_50": rss["after_50"],
            "rss_mb_after_last": rss["after_last"], "rss_growth": growth, "rss_ok": abs(growth) <= TOLERANCE,
            "exit_status": code, "matrix_loads": loads, "server_log_tail": out[-2000:], "metrics": metrics,
            "samples": samples, "index_bound_bytes": bound, "index_within_bound": within}


def write_load(folder: Path, rows: dict, info: dict, args) -> str:
    from bench.machine import machine_line, save_results

    lines = ["# The server under load: OpenAI clients streaming dev-split questions", "",
             f"{machine_line(info)}. {args.model} in {args.dtype}, `python -m tr_engine.serve --batch "
             f"{max(args.clients)}`, {args.questions} dev-split questions (first turns) per row, greedy, "
             f"{args.max_new_tokens} new tokens at most, {args.threads} threads, the server's defaults otherwise (its "
             f"suffix index and prompt chunks too); a fresh server for each row, warmed on {args.warmup} other "
             "questions. Clients: threads of the `openai` package, each streaming one request "
             "at a time. Speedup: total tokens/s over the first row. TTFT: request sent to its first text. TPOT: "
             "the answer's time after its first text over its remaining tokens. Identical: answers equal to the "
             "first row's (plain decoding, one client).", "",
             "| method | clients | total tok/s | speedup | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
             "MAT | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in rows.items():
        method = key.split("@")[0]
        lines.append(f"| {method} | {r['clients']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | {r['tpot_ms_p50']:.1f} | "
                     f"{r['tpot_ms_p99']:.1f} | {r['mat']:.2f} | {r['identical']}/{r['requests']} |")
    text = "\n".join(lines) + "\n"
    return save_results(folder / "serve", text, {"args": _args(args), "rows": rows}, info)


def write_soak(folder: Path, r: dict, info: dict, args) -> str:
    from bench.machine import machine_line, save_results

    ended = "SIGKILL" if args.kill else "SIGTERM"
    verdict = (r["rss_ok"] and r["failed"] == 0 and r["exit_status"] == (-9 if args.kill else 0)
               and r["matrix_loads"] is True and r["index_within_bound"] is not False)
    index = (f", suffix index bounded at {args.suffix_index} MB (--suffix-index)" if args.suffix_index else "")
    lines = ["# Server soak run", "",
             f"{machine_line(info)}. {args.model} in {args.dtype}, `python -m tr_engine.serve` (default method and "
             f"batch, matrix in a file saved every {args.save_every:g} s{index}), {r['requests']} requests from "
             f"{r['clients']} concurrent `openai` clients, dev-split questions, 8 to 160 new tokens each at random, "
             f"all streamed, a random tenth dropped after 1 to 6 events; the server ended with {ended}.", "",
             f"- wall time: {r['seconds']:.0f} s",
             f"- dropped on purpose: {r['dropped']}; failed otherwise: {r['failed']}"
             + (f" ({'; '.join(r['failures'])})" if r["failures"] else ""),
             f"- server resident memory: {r['rss_mb_after_50']:.0f} MB after {SOAK_BASELINE} requests, "
             f"{r['rss_mb_after_last']:.0f} MB after the last ({100 * r['rss_growth']:+.1f}%; limit "
             f"±{100 * TOLERANCE:.0f}%)"]
    if args.suffix_index:
        tokens = [x["index_tokens"] for x in r["samples"]]
        most = max(x["index_bytes"] for x in r["samples"])
        lines.append(f"- suffix index: {most / 2**20:.1f} MB at most against its {r['index_bound_bytes'] / 2**20:.1f} "
                     f"MB bound (within: {r['index_within_bound']}); tokens held every 50 requests: "
                     f"{', '.join(f'{t:.0f}' for t in tokens[:: max(len(tokens) // 10, 1)])} (full once the oldest "
                     "requests are evicted)")
        lines.append("- RSS every 50 requests (MB): " + ", ".join(f"{x['rss_mb']:.0f}" for x in r["samples"][
            :: max(len(r['samples']) // 10, 1)]))
    lines += ["- the server's counters at the end: " + ", ".join(f"`{m}`" for m in r["metrics"]),
              f"- {ended}: exit status {r['exit_status']}; what it saved loads (the matrix"
              + (" and the suffix index beside it" if args.suffix_index else "") + f"): {r['matrix_loads']}",
              f"- verdict: {'pass' if verdict else 'FAIL'}", ""]
    text = "\n".join(lines)
    return save_results(folder / ("serve_soak_suffix" if args.suffix_index else "serve_soak"), text,
                        {"args": _args(args), **r}, info)


def _args(args) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def main(argv=None) -> int:
    from bench.machine import machine_info
    from bench.specbench import DEFAULT_QUESTIONS, load_questions
    from tr_engine.cli.common import ArgumentParser
    from tr_engine.cli.args import integer

    ap = ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=["ar", "tr", "pld", "hybrid"])
    ap.add_argument("--clients", nargs="+", type=integer(1), default=list(CLIENTS))
    ap.add_argument("--questions", type=integer(1), default=32, help="questions per row, spread over the file")
    ap.add_argument("--warmup", type=integer(0), default=4, help="other questions that warm the matrix first")
    ap.add_argument("--questions-file", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--max-new-tokens", type=integer(1), default=128)
    ap.add_argument("--threads", type=integer(1), default=2)
    ap.add_argument("--soak", action="store_true", help="the soak run instead of the load table")
    ap.add_argument("--multi-turn", action="store_true",
                    help="two-turn conversations with and without prefix reuse instead of the load table")
    ap.add_argument("--batch", type=integer(1), default=4, help="--multi-turn: the server's --batch")
    ap.add_argument("--requests", type=integer(SOAK_BASELINE + 1), default=500, help="--soak: requests in all")
    ap.add_argument("--soak-clients", type=integer(1), default=16, help="--soak: concurrent clients")
    ap.add_argument("--suffix-index", type=integer(0), default=0, metavar="MB",
                    help="--soak: the server keeps a suffix index of this bound (written to serve_soak_suffix.*)")
    ap.add_argument("--save-every", type=float, default=10.0, metavar="S", help="--soak: the server's --save-every")
    ap.add_argument("--kill", action="store_true", help="--soak: end the server with SIGKILL, not SIGTERM")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    rows = load_questions(args.questions_file, None, None)
    texts = [" ".join(r["turns"][0].split()) for r in rows]
    info = machine_info()
    if args.multi_turn:
        conversations = [r["turns"][:2] for r in rows if len(r["turns"]) >= 2]
        print(write_multi_turn(args.out, multi_turn(args, conversations), info, args))
        return 0
    if args.soak:
        print(write_soak(args.out, soak(args, texts), info, args))
        return 0
    step = max(len(texts) // (args.questions + args.warmup), 1)
    spread = texts[::step]
    questions, warm = spread[: args.questions], spread[args.questions: args.questions + args.warmup]
    print(write_load(args.out, run_load(args, questions, warm), info, args))
    return 0


if __name__ == "__main__":
    from tr_engine.cli.common import run as run_cli

    raise SystemExit(run_cli(main))
