"""The chat: `python -m tr_engine.chat [--model vicuna-7b]`.

Streams each answer as its tokens are accepted, keeps the conversation in the model's chat template, reuses the KV
cache across turns (a new turn prefills only its own tokens), and keeps the recycling matrix across turns and
sessions (saved per model on exit, loaded at start). At a terminal: /reset /stats /method /temperature /help /quit,
Ctrl-C stops an answer and keeps the conversation, Ctrl-D quits. With stdin not a terminal, each line is a turn and
only the answers go to stdout (statistics to stderr). User errors print one line and exit with status 2.
"""

import os
import sys
import threading

from tr_engine import checks
from tr_engine.cli.args import add_engine_args, add_matrix_args, engine_from_args, integer, load_matrix, \
    sampling_from_args
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.core.methods import methods
from tr_engine.errors import MatrixFileError, UserError, one_line, warn
from tr_engine.model.parallel import ALONE, heartbeat_s

HELP = """commands:
  /reset          start a new conversation (the recycling matrix is kept)
  /stats          MAT, tokens/s, accepted-length histogram and time per phase: last answer and session
  /method M       decode with M: tr (Token Recycling), pld (prompt lookup), hybrid (both) or ar (plain decoding);
                  same tokens
  /temperature T  0: greedy; above 0: sample (with --top-k/--top-p as given), the model's distribution whatever
                  the method
  /help           this list
  /quit           save the matrix and exit (Ctrl-D too)
Ctrl-C stops the current answer; what it had said stays in the conversation."""


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m tr_engine.chat", description="Chat with a model, Token Recycling on.")
    add_engine_args(ap)
    ap.add_argument("--prompt", default=None, help="answer this one message and exit")
    ap.add_argument("--system", default=None, help="a system message to start the conversation with")
    ap.add_argument("--max-new-tokens", type=integer(1), default=512, help="longest answer, in tokens (default 512)")
    add_matrix_args(ap)
    ap.add_argument("--quiet", action="store_true", help="no status line after each answer")
    return ap


class Session:
    """One conversation: its messages, the decode method, and the statistics of every answer."""

    def __init__(self, engine, method: str, max_new_tokens: int, system: str | None, seed_from_prompt: bool,
                 sampling=None):
        from tr_engine.core.sampling import GREEDY  # imports torch: after argument parsing, so --help is instant

        self.engine, self.method, self.max_new_tokens = engine, method, max_new_tokens
        self.system, self.seed_from_prompt, self.sampling = system, seed_from_prompt, sampling or GREEDY
        self.results = []  # GenerateResult of each finished answer, this session
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.engine.reset_cache()

    def ask(self, text: str, out) -> None:
        """Stream the answer to `text` into `out`; the conversation keeps it, interrupted (Ctrl-C) or not."""
        self.messages.append({"role": "user", "content": text})
        pieces = []
        stream = self.engine.stream(self.messages, self.max_new_tokens, method=self.method,
                                    seed_from_prompt=self.seed_from_prompt, reuse_cache=True, sampling=self.sampling)
        try:
            pieces.append(next(stream))  # the prompt is checked and prefilled here: a refused turn is not kept
        except StopIteration as done:
            self.results.append(done.value)
            self.messages.append({"role": "assistant", "content": ""})
            return
        except UserError:
            self.messages.pop()
            raise
        except KeyboardInterrupt:  # during the prefill: no answer began, so the question goes too
            self.messages.pop()
            print("\n[interrupted before the answer began; the question was dropped from the conversation]",
                  file=sys.stderr, flush=True)
            raise
        out.write(pieces[0])
        out.flush()
        try:
            while True:
                try:
                    piece = next(stream)
                except StopIteration as done:
                    self.results.append(done.value)
                    break
                pieces.append(piece)
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            stream.close()
            out.write("\n")
            out.flush()
            print("[interrupted; the answer so far stays in the conversation]", file=sys.stderr, flush=True)
            raise
        finally:
            self.messages.append({"role": "assistant", "content": "".join(pieces)})

    def status_line(self) -> str:
        r = self.results[-1]
        g = r.generation
        mat = f", MAT {r.mean_accepted:.2f}" if self.method != "ar" else ""
        sampled = "" if self.sampling.greedy else f", {self.sampling.describe()}"
        return (f"[{len(g.token_ids)} tokens, {r.tokens_per_s:.1f} tok/s{mat}, {self.method}{sampled}, "
                f"prefill {g.prompt_tokens} tokens in {g.prefill_s:.2f}s]")

    def stats(self) -> str:
        tier, threads = self.engine.cpu_tier, self.engine.threads
        following = f" (following the load, up to {threads.most})" if threads is not None else ""
        kernels = (f"kernels: CPU tier {tier}, {self.engine.cpu_threads} threads{following}" if tier
                   else f"kernels: {self.engine.model.device.type}")
        if not self.results:
            return f"no answers yet; {kernels}"
        return "\n".join([describe("last answer", self.results[-1:]), describe("session", self.results), kernels])


def describe(title: str, results) -> str:
    """MAT, tokens/s, accepted-length histogram and seconds per phase over some answers."""
    gens = [r.generation for r in results]
    tokens = sum(len(g.token_ids) for g in gens)
    seconds = sum(g.prefill_s + g.decode_s for g in gens)
    lengths = [a for g in gens for a in g.accept_lengths]
    histogram = {}
    for a in lengths:
        histogram[a] = histogram.get(a, 0) + 1
    phases = {}
    for g in gens:
        for name, s in g.phase_s.items():
            phases[name] = phases.get(name, 0.0) + s
    lines = [f"{title}: {len(gens)} answer(s), {tokens} tokens in {seconds:.2f}s = "
             f"{tokens / seconds if seconds else 0.0:.1f} tok/s; "
             f"MAT {sum(lengths) / len(lengths) if lengths else 0.0:.2f} over {len(lengths)} steps",
             "  accepted per step: " + (" ".join(f"{k}:{v}" for k, v in sorted(histogram.items())) or "-"),
             f"  prefill {sum(g.prefill_s for g in gens):.3f}s, decode {sum(g.decode_s for g in gens):.3f}s"
             + "".join(f", {name} {s:.3f}s" for name, s in phases.items())]
    return "\n".join(lines)


def command(session: Session, line: str) -> bool:
    """Run a /command; False means quit."""
    word, _, arg = line.partition(" ")
    if word == "/quit":
        return False
    if word == "/reset":
        session.reset()
        print("[new conversation]", file=sys.stderr)
    elif word == "/stats":
        print(session.stats(), file=sys.stderr)
    elif word == "/method":
        if arg.strip() not in methods():
            print(f"usage: /method {'|'.join(methods())}", file=sys.stderr)
        else:
            session.method = arg.strip()
            print(f"[method {session.method}]", file=sys.stderr)
    elif word == "/temperature":
        try:
            s = session.sampling
            session.sampling = type(s)(float(arg), s.top_k, s.top_p)
            print(f"[{session.sampling.describe()}]", file=sys.stderr)
        except (ValueError, UserError) as e:
            print(f"usage: /temperature T, a number >= 0 ({e})", file=sys.stderr)
    elif word == "/help":
        print(HELP, file=sys.stderr)
    else:
        print(f"unknown command {one_line(word)}; /help lists them", file=sys.stderr)
    return True


def turn(session: Session, text: str, quiet: bool) -> None:
    session.ask(text, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not quiet:
        print(session.status_line(), file=sys.stderr, flush=True)


class Heartbeat:
    """Under --tp, while rank 0 waits for a line of input (a person thinking, a slow pipe), the other ranks wait for
    it in a collective, which ends the run past $TR_ENGINE_TP_TIMEOUT_S. So rank 0 sends them an empty line, which
    they skip, every parallel.heartbeat_s() seconds from a thread of its own; a line's handling holds `busy`, so that
    no heartbeat falls among its collectives."""

    def __init__(self, shard):
        self.shard, self.busy, self.stopped = shard, threading.Lock(), threading.Event()
        if shard.world > 1 and shard.rank == 0:
            threading.Thread(target=self._beat, name="tr-engine-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self.stopped.wait(heartbeat_s()):
            with self.busy:
                if self.stopped.is_set():
                    return
                try:
                    self.shard.from_rank0("")
                except UserError:  # a rank is gone: the next line's collective says so, on the main thread
                    return

    def stop(self) -> None:
        with self.busy:
            self.stopped.set()


def handle(session: Session, line: str, quiet: bool, heartbeat: Heartbeat) -> str:
    """One input line, a /command or a turn: "quit", "ok", or "failed" (a user error, reported; the chat goes on).
    Under --tp, rank 0 (which reads the input) hands the line to the other ranks first (follow())."""
    with heartbeat.busy:
        session.engine.model.shard.from_rank0(line)
        return handle_here(session, line, quiet)


def handle_here(session: Session, line: str, quiet: bool) -> str:
    line = line.strip()
    if not line:
        return "ok"
    try:
        checks.text(line, "this line")  # before the /command test: a command cannot hold bad bytes either
        if line.startswith("/"):
            return "ok" if command(session, line) else "quit"
        turn(session, line, quiet)
        return "ok"
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return "failed"


def interactive(session: Session, quiet: bool, heartbeat: Heartbeat) -> None:
    print(f"tr-engine chat: {session.engine.folder.name}, method {session.method}. /help for commands, "
          "Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /quit to exit)", file=sys.stderr)
            continue
        try:
            if handle(session, line, quiet, heartbeat) == "quit":
                return
        except KeyboardInterrupt:  # the answer was stopped; Session.ask kept what it said
            continue


def piped(session: Session, lines, quiet: bool, heartbeat: Heartbeat) -> bool:
    """Each line a turn or a command; False if a turn failed (it is reported and the rest still run)."""
    ok = True
    for line in lines:
        result = handle(session, line, quiet, heartbeat)
        if result == "quit":
            break
        ok = ok and result == "ok"
    return ok


def follow(session: Session) -> None:
    """A rank other than 0 under --tp: take each line rank 0 reads and decode it in step, silently, until rank 0
    says the input has ended (None)."""
    shard = session.engine.model.shard
    while (line := shard.from_rank0(None)) is not None:
        handle_here(session, line, quiet=True)  # (a heartbeat's empty line does nothing)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # Bytes that are not UTF-8 arrive as lone surrogates, and the turn that holds them is refused with one line
    # (tr_engine.checks.text); the rest of the input still runs.
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    sampling = sampling_from_args(args)  # bad values are refused before the model loads
    if args.prompt is not None and not args.prompt.strip():  # (as generate refuses it, before the model loads)
        raise UserError("--prompt is empty; give some text to answer, or leave --prompt out to chat")
    engine = engine_from_args(args)
    save_to = load_matrix(args, engine)
    shard = engine.model.shard
    if shard.rank != 0:  # --tp: rank 0 reads the input, answers and saves the matrix; the others decode in step
        sys.stdout, save_to = open(os.devnull, "w"), None
    status = 0
    heartbeat = Heartbeat(shard if args.prompt is None else ALONE)
    try:
        session = Session(engine, args.method, args.max_new_tokens, args.system, args.seed_from_prompt, sampling)
        if args.prompt is not None:
            turn(session, args.prompt, args.quiet or shard.rank != 0)
        elif shard.rank != 0:
            follow(session)
        elif sys.stdin.isatty():
            interactive(session, args.quiet, heartbeat)
        elif not piped(session, sys.stdin, args.quiet, heartbeat):
            status = 2
    finally:  # on the way out whatever happened (Ctrl-C, SIGTERM, an error): the answers are out, now the matrix
        heartbeat.stop()
        if shard.world > 1 and shard.rank == 0 and args.prompt is None:
            shard.from_rank0(None)  # the input has ended: the other ranks stop
        if save_to is not None:
            try:
                engine.save_matrix(save_to)
            except MatrixFileError as e:
                warn(str(e))
    return status


if __name__ == "__main__":
    sys.exit(run(main))
