"""An OpenAI-compatible server on the batched engine:

    python -m tr_engine.serve --model NAME_OR_PATH [--host 127.0.0.1] [--port 8000] [--batch N] [--max-queued Q]
        [--served-model-name NAME] [--matrix FILE | --no-persist] [--save-every S] [--grace S] [--access-log]
        [--prefix-reuse on|off] [--prefill-chunk N] [--method hybrid|tr|pld|ar] [--tree ...] [--dtype D] ...

Every request joins the running batch as it arrives (tr_engine/serving/scheduler.py), so each client gets exactly what
it would get alone while Token Recycling's one matrix learns from every client, and a conversation's next turn finds its
earlier turns still in a slot's cache (prefix reuse, least recently used slots emptied first). A long prompt joins
--prefill-chunk tokens at a time, one chunk between two steps, so the streams already running keep going meanwhile.
The endpoints and their errors:
tr_engine/serving/openai_api.py. HTTP and server-sent events are FastAPI on uvicorn, as vLLM and SGLang serve theirs.

Under tensor parallelism (`torchrun --nproc-per-node N -m tr_engine.serve --tp N ...`) every rank runs the batch loop
and rank 0 alone serves HTTP, telling the others which requests join and leave at each step (scheduler.Lockstep).

The matrix is loaded at start (the same file the chat keeps, unless --matrix says otherwise) and saved atomically,
every --save-every seconds between two steps and at the end. SIGTERM or Ctrl-C stops the server: it takes no new
connections, lets running requests finish for up to --grace seconds (then ends them with an error), saves the matrix
and exits 0. A second Ctrl-C skips the wait (the matrix is still saved).
"""

import os
import signal
import socket
import sys
import threading

import uvicorn

from tr_engine.cli.args import add_engine_args, add_matrix_args, engine_from_args, integer, load_matrix, real, \
    sampling_from_args
from tr_engine.cli.common import EXIT_BUG, ArgumentParser, run
from tr_engine.errors import MatrixFileError, UserError, warn
from tr_engine.serving.protocol import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, timed_protocol

DEFAULT_PREFILL_CHUNK = 256  # (the engine's: tr_engine/engine.py, which imports torch)
DEFAULT_PORT = 8000
DEFAULT_BATCH = 8
DEFAULT_MAX_QUEUED = 64
DEFAULT_MAX_CONNECTIONS = 512  # uvicorn's limit_concurrency: open connections and running requests
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this long
DEFAULT_GRACE_S = 5.0
DEFAULT_SAVE_EVERY_S = 300.0
SHUTDOWN_MARGIN_S = 10.0  # after the grace period: for the cancelled requests' last events to reach their clients


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m tr_engine.serve",
                        description="Serve the OpenAI API (/v1/chat/completions, /v1/completions) on the batched "
                                    "engine.")
    add_engine_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                        "only; 0.0.0.0: every interface)")
    ap.add_argument("--port", type=integer(0, 65535), default=DEFAULT_PORT,
                    help=f"port to listen on (default {DEFAULT_PORT}; 0: any free port, printed at start)")
    ap.add_argument("--batch", type=integer(1), default=DEFAULT_BATCH, metavar="N",
                    help=f"sequences decoded together (default {DEFAULT_BATCH}); more requests wait for a slot")
    ap.add_argument("--max-queued", type=integer(0), default=DEFAULT_MAX_QUEUED, metavar="Q",
                    help=f"requests that may wait for a slot (default {DEFAULT_MAX_QUEUED}); past it, 503 with "
                         "Retry-After")
    ap.add_argument("--served-model-name", default=None, metavar="NAME",
                    help="the model's id in the API (default: the model folder's name)")
    ap.add_argument("--max-body-bytes", type=integer(1024), default=None, metavar="B",
                    help="the largest request body taken (default: 64 bytes per token of each sequence's context, at "
                         "least 1 MiB); a larger one gets a 413 before it is read")
    ap.add_argument("--max-connections", type=integer(1), default=DEFAULT_MAX_CONNECTIONS, metavar="C",
                    help=f"open connections at most (default {DEFAULT_MAX_CONNECTIONS}); past it, new ones get a 503")
    ap.add_argument("--header-timeout", type=real(0.1), default=HEADER_TIMEOUT_S, metavar="S",
                    help=f"seconds a client has to send a whole request head once it connects or starts one (default "
                         f"{HEADER_TIMEOUT_S:g}); a slower one's connection is closed")
    ap.add_argument("--body-timeout", type=real(0.1), default=BODY_TIMEOUT_S, metavar="S",
                    help=f"the longest pause within a request body (default {BODY_TIMEOUT_S:g} s); past it, "
                         "408")
    ap.add_argument("--grace", type=real(0.0), default=DEFAULT_GRACE_S, metavar="S",
                    help=f"on SIGTERM or Ctrl-C, seconds running requests may take to finish (default "
                         f"{DEFAULT_GRACE_S:g}) before they are cancelled and the matrix is saved")
    ap.add_argument("--save-every", type=real(0.0), default=DEFAULT_SAVE_EVERY_S, metavar="S",
                    help=f"also save the matrix every S seconds while serving (default {DEFAULT_SAVE_EVERY_S:g}; 0: "
                         "only at the end), so a killed server loses little of what it learned")
    ap.add_argument("--prefix-reuse", choices=("on", "off"), default="on",
                    help="on (default): a request whose prompt starts with what a free slot holds (the conversation's "
                         "earlier turns, a shared system prompt) prefills only the rest; off: every request prefills "
                         "its whole prompt")
    ap.add_argument("--prefill-chunk", type=integer(0), default=DEFAULT_PREFILL_CHUNK, metavar="N",
                    help="a prompt that arrives while others decode is prefilled N tokens at a time, one chunk "
                         "between two of their steps, so it holds them up for one chunk at a time (default "
                         f"{DEFAULT_PREFILL_CHUNK}; 0: whole prompts; on a CPU with the compiled kernels, where chunks "
                         "are exact)")
    ap.add_argument("--access-log", action="store_true", help="log every request's line on stderr")
    add_matrix_args(ap)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sampling = sampling_from_args(args)  # bad values are refused before the model loads
    leader = args.tp == 1 or os.environ.get("RANK", "0") == "0"  # (--tp under torchrun: rank 0 alone serves HTTP)
    listener = listen(args.host, args.port) if leader else None  # and a port that is taken
    from tr_engine.serving.openai_api import Defaults, create_app  # imports torch and FastAPI: after the checks
    from tr_engine.model.weights import server_malloc
    from tr_engine.serving.scheduler import Scheduler

    server_malloc()  # (so that what a request takes goes back to the system: its docstring)
    engine = engine_from_args(args)
    engine.prefill_chunk = args.prefill_chunk or None
    save_to = load_matrix(args, engine)
    # The batch loop runs here, on the thread that loaded the model, and HTTP on a thread of its own: one OpenMP team
    # for every parallel op (tr_engine/serving/scheduler.py says what a second one costs).
    scheduler = Scheduler(engine, args.method, args.max_queued, thread=False, prefix_reuse=args.prefix_reuse == "on",
                          seed_from_prompt=args.seed_from_prompt)
    if engine.model.shard.rank != 0:
        return follow(scheduler)
    name = args.served_model_name or engine.folder.name
    app = create_app(scheduler, name, Defaults(sampling), args.max_body_bytes, args.body_timeout)
    config = uvicorn.Config(app, log_level="info" if args.access_log else "warning", access_log=args.access_log,
                            lifespan="off", timeout_graceful_shutdown=args.grace + SHUTDOWN_MARGIN_S,
                            limit_concurrency=args.max_connections, timeout_keep_alive=KEEP_ALIVE_S,
                            http=timed_protocol(args.header_timeout))
    server = uvicorn.Server(config)  # (off the main thread, uvicorn leaves the signals to us)

    failed = []

    def http() -> None:
        try:
            server.run(sockets=[listener])
        except BaseException as e:  # uvicorn ends a failed start with SystemExit: a thread would swallow it
            failed.append(f"{type(e).__name__}: {e}")
        finally:  # however HTTP ends, the batch loop ends too (after the grace, when a signal began it)
            scheduler.close(args.grace)

    def stop(signum, frame) -> None:
        """SIGINT or SIGTERM: HTTP takes no new connections and waits for the running responses; the scheduler
        lets running requests finish for the grace period, then ends them (an error event, a 503), so that every
        response is whole before uvicorn's own, later deadline. A second signal ends them at once."""
        grace = 0.0 if server.should_exit else args.grace
        server.should_exit = True
        threading.Thread(target=scheduler.close, args=(grace,), daemon=True).start()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    host, port = listener.getsockname()[:2]
    print(f"tr-engine serving {name} ({args.method}, batch {args.batch}) at http://{host}:{port}/v1; "
          "Ctrl-C to stop", file=sys.stderr, flush=True)
    web = threading.Thread(target=http, name="tr-engine-http", daemon=True)
    web.start()
    stop_saving = threading.Event()
    if save_to is not None and args.save_every > 0:
        threading.Thread(target=save_now_and_then, args=(scheduler, save_to, args.save_every, stop_saving),
                         daemon=True).start()
    try:
        scheduler.run()  # until a signal (or HTTP's end) closes it and the last request has ended
    finally:  # the matrix, whatever ended the loop
        stop_saving.set()
        server.should_exit = True
        web.join(args.grace + 2 * SHUTDOWN_MARGIN_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if save_to is not None and save(engine, save_to):
            print(f"saved the recycling matrix to {save_to}", file=sys.stderr, flush=True)
    if failed or not server.started:
        print(f"error: the HTTP server stopped ({failed[0] if failed else 'it never started'}); its log above says "
              "why", file=sys.stderr, flush=True)
        return EXIT_BUG
    return 0


def follow(scheduler) -> int:
    """A rank other than 0 under --tp: the same batch loop, admitting and dropping what rank 0 decides
    (scheduler.Lockstep), until rank 0 closes it. Signals are left to rank 0 (torchrun sends each to every rank):
    rank 0 finishes the running requests within its grace period and then ends the loop on every rank; a rank that
    stopped on its own would end the run for all of them mid-answer."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        scheduler.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def save(engine, path) -> bool:
    try:
        engine.save_matrix(path)
        return True
    except MatrixFileError as e:  # the old file stays; serving goes on
        warn(str(e))
        return False


def save_now_and_then(scheduler, path, every: float, stop: threading.Event) -> None:
    """Every `every` seconds, save the matrix from the batch's thread between two steps (a consistent snapshot)."""
    while not stop.wait(every):
        scheduler.between_steps(lambda: save(scheduler.engine, path))


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound now: a taken port or a bad address is a one-line error before the model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host!r} is not an address here ({e.strerror}); use 127.0.0.1 or 0.0.0.0")
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port, or stop what uses it")
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    sys.exit(run(main))
