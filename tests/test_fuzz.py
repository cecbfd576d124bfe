"""The fuzz suite: random flags for the one-shot command, random bytes and command lines for the chat, random tree
files, matrix files and API arguments. Every case must end in a result or one of our errors (one line, status 2),
never another exception, and leave no matrix file corrupt and no temporary file behind.

Hypothesis (property-based testing) draws the cases and shrinks any failure to a small one. `make test` runs a
bounded number per test; `make fuzz` runs TR_ENGINE_FUZZ_SCALE times as many (the closing notes give the counts).
"""

import json
import math
import os
import string

import pytest
import torch
from cli import call_main
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tr_engine.cli import chat, generate
from tr_engine.core.matrix import RecyclingMatrix
from tr_engine.core.tree import MAX_TREE_NODES, build_tree, load_tree
from tr_engine.engine import Engine
from tr_engine.errors import UserError
from tr_engine.files import temporaries

SCALE = int(os.environ.get("TR_ENGINE_FUZZ_SCALE", "1"))


def fuzz(examples: int):
    """Hypothesis settings for a fuzz test: `examples` cases (times the scale), no deadline (a case loads a model)."""
    return settings(max_examples=examples * SCALE, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def folder(tiny_factory):
    return tiny_factory("float32", dtype=torch.float64)


def assert_ours(proc):
    """A command's outcome: success, or a user error as one line with status 2; never a bug's status or a
    traceback."""
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 2), (proc.returncode, proc.stderr)
    if proc.returncode == 2 and not proc.stdout:  # refused before any answer: exactly one line
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr


@pytest.fixture(scope="module")
def tiny_engine(folder):
    return Engine.from_pretrained(str(folder))


def assert_clean(path, engine):
    """No temporary file beside the matrix, and the matrix file, if one was saved, loads for the model (any k)."""
    assert temporaries(path) == []
    if path.exists():
        RecyclingMatrix.load(path, engine.model.config.vocab_size, engine.tokenizer.fingerprint())


# --- the one-shot command's flags --------------------------------------------------------------------------------

junk = st.text(alphabet=string.printable + "é東\udcff", max_size=12)
numbers = st.one_of(st.integers(-10**20, 10**20).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
                    junk)
# Each flag: values the command takes, and values it must refuse (or survive). A case draws a few flags, most of
# them good, so that many cases get as far as an answer.
FLAGS = {
    "--method": (st.sampled_from(["ar", "tr", "pld", "hybrid"]), junk),
    "--dtype": (st.sampled_from(["float32", "bfloat16", "float16", "float64", "fp16"]), junk),
    "--device": (st.just("cpu"), st.one_of(st.sampled_from(["cuda", "cuda:1", "mps", "xpu", "cpu:0", ""]), junk)),
    "--max-context": (st.integers(64, 512).map(str), st.one_of(st.integers(-5, 63).map(str), numbers)),
    "--threads": (st.integers(1, 2).map(str), numbers),
    "--ops": (st.sampled_from(["kernels", "reference"]), junk),
    "--tree": (st.sampled_from(["adaptive", "2.2.2"]),
               st.one_of(st.sampled_from(["", "no-such-tree.json", "/", "a\0b"]), junk)),
    "--matrix-k": (st.integers(1, 16).map(str), numbers),
    "--cuda-graphs": (st.just("off"), st.one_of(st.just("on"), junk)),  # on: refused on a CPU, in one line
    "--temperature": (st.sampled_from(["0", "1e-45", "0.7", "1", "1e300"]),
                      st.one_of(st.sampled_from(["inf", "nan", "-1"]), numbers)),
    "--top-k": (st.integers(0, 500).map(str), numbers),
    "--top-p": (st.sampled_from(["0.9", "1", "1e-300", "0.5"]), st.one_of(st.sampled_from(["0", "1.5"]), numbers)),
    "--seed": (st.integers(0, 2**63 - 1).map(str), numbers),
    "--max-new-tokens": (st.integers(1, 12).map(str), numbers),
    "--prompt": (st.text(min_size=1, max_size=40).filter(str.strip),
                 st.sampled_from(["", "   ", "hi \udcff\udcfe", "\0", "<|im_end|>"])),
}
SWITCHES = ["--no-template", "--json", "--seed-from-prompt"]


@st.composite
def generate_argv(draw):
    argv = ["--max-new-tokens", "6"]
    for name in draw(st.lists(st.sampled_from(sorted(FLAGS)), max_size=6, unique=True)):
        good, bad = FLAGS[name]
        value = draw(bad if draw(st.integers(0, 4)) == 0 else good)
        argv += [f"{name}={value}"]  # '=' so that a value starting with '-' stays a value
    argv += draw(st.lists(st.sampled_from(SWITCHES), max_size=2, unique=True))
    if draw(st.integers(0, 9)) == 0:
        argv += [draw(st.sampled_from(["--bogus", "-x", "--prompt"]))]
    return argv


@fuzz(40)
@given(argv=generate_argv())
def test_fuzz_the_one_shot_command(folder, tiny_engine, tmp_path, argv):
    matrix = tmp_path / "fuzz-m.pt"  # (call_main gives the worker its thread count back after a --threads case)
    proc = call_main(generate.main, "--model", str(folder), "--prompt", "hello", *argv, "--matrix", str(matrix))
    event(f"status {proc.returncode}")  # --hypothesis-show-statistics: how many cases got as far as an answer
    assert_ours(proc)
    assert_clean(matrix, tiny_engine)


# --- the chat's stdin --------------------------------------------------------------------------------------------

commands = st.one_of(
    st.sampled_from(["/reset", "/stats", "/help", "/method", "/method ar", "/method tr", "/method pld",
                     "/method hybrid", "/method x", "/temperature", "/temperature 0", "/temperature 0.8",
                     "/temperature 1e-45", "/temperature nan", "/temperature inf", "/temperature -1",
                     "/temperature 1e999", "/unknown", "/", "//"]),
    st.builds(lambda w, a: f"/{w} {a}", st.text(alphabet=string.ascii_lowercase, max_size=12), junk),
)
text_lines = st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\n\r\x0b\x0c\x1c"
                                            "\x1d\x1e\x85\u2028\u2029"), max_size=30)
chat_input = st.one_of(
    st.binary(max_size=200),  # anything at all
    st.lists(st.one_of(commands, text_lines, st.binary(max_size=20).map(lambda b: b.decode("latin-1"))),
             max_size=6).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogateescape")),
)


@fuzz(30)
@given(data=chat_input, method=st.sampled_from(["tr", "hybrid", "ar"]))
def test_fuzz_the_chat_stdin(folder, tiny_engine, tmp_path, data, method):
    matrix = tmp_path / "fuzz-chat.pt"
    proc = call_main(chat.main, "--model", str(folder), "--max-new-tokens", "4", "--quiet", "--method", method,
                     "--matrix", str(matrix), stdin=data)
    event(f"status {proc.returncode}, {'answered' if proc.stdout else 'no answer'}")
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 2), proc.stderr
    assert matrix.is_file()  # saved on the way out, whatever the input was
    assert_clean(matrix, tiny_engine)


# --- tree files --------------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 20), st.floats(allow_nan=False), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=30,
)
rank_paths = st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=5), max_size=40)


@st.composite
def trees(draw):
    """A prefix-closed tree of rank paths (a valid tree, when its ranks are below k), sometimes with one defect."""
    paths = []
    for _ in range(draw(st.integers(0, 60))):
        parent = draw(st.sampled_from([()] + paths))
        if len(parent) < 8:
            paths.append(parent + (draw(st.integers(0, 7)),))
    paths = [list(p) for p in dict.fromkeys(paths)]
    if paths and draw(st.integers(0, 3)) == 0:  # one defect: a duplicate, an orphan, a bad rank, a wrong type
        i = draw(st.integers(0, len(paths) - 1))
        paths.append(draw(st.sampled_from([paths[i], [9, 9, 9, 9], [-1], ["0"], [0.5], [True], 7, None])))
    return draw(st.permutations(paths))


tree_files = st.one_of(
    st.binary(max_size=100),
    json_values.map(lambda v: json.dumps(v).encode()),
    rank_paths.map(lambda p: json.dumps(p).encode()),
    trees().map(lambda p: json.dumps(p).encode()),
    trees().map(lambda p: json.dumps({"nodes": p}).encode()),
)


@fuzz(200)
@given(content=tree_files, k=st.integers(1, 16))
def test_fuzz_tree_files(tmp_path, content, k):
    path = tmp_path / "tree.json"
    path.write_bytes(content)
    try:
        tree = load_tree(str(path), k)
    except UserError as e:
        event("refused")
        assert "\n" not in str(e)
        return
    event("a tree")
    n = tree.size
    assert 1 <= n <= MAX_TREE_NODES + 1
    assert all(int(tree.parent[i]) < i for i in range(1, n)) and int(tree.rank.max()) < k
    assert torch.equal(tree.mask.diagonal(), torch.ones(n, dtype=torch.bool))


# --- matrix files ------------------------------------------------------------------------------------------------

V, K = 50, 4
small_ints = st.integers(-(2**40), 2**40)


@st.composite
def matrix_contents(draw):
    """A saved matrix's dict, mutated: the right keys with values of every kind, or something else entirely."""
    table = torch.randint(0, V, (V, K))
    data = {"table": table, "confidence": torch.rand(V, K).half(), "vocab_size": V, "fingerprint": "fp"}
    mutated = draw(st.sampled_from([0, 0, 1, 2]))
    for key in draw(st.lists(st.sampled_from(sorted(data)), min_size=mutated, max_size=mutated, unique=True)):
        choice = draw(st.integers(0, 7))  # 6 and 7: this key is left as it is
        if choice == 0:
            data.pop(key)
        elif choice == 1:
            data[key] = draw(json_values)
        elif choice == 2:
            shape = draw(st.lists(st.integers(0, 60), min_size=0, max_size=3))
            dtype = draw(st.sampled_from([torch.long, torch.int32, torch.float32, torch.float16, torch.bool]))
            data[key] = (torch.rand(shape) * 100).to(dtype)
        elif choice == 3 and isinstance(data.get(key), torch.Tensor):
            flat = data[key].view(-1)
            if flat.numel():
                value = draw(st.one_of(small_ints, st.sampled_from([float("nan"), float("inf"), -1.0, 1.5, V])))
                try:
                    flat[draw(st.integers(0, flat.numel() - 1))] = value
                except RuntimeError:  # not representable in the tensor's dtype: leave it as it is
                    pass
        elif choice == 4:
            data[key] = draw(small_ints)
        elif choice == 5 and isinstance(data.get(key), torch.Tensor):
            data[key] = data[key].t()  # same elements, wrong layout
    return data if draw(st.integers(0, 5)) else draw(json_values)


@fuzz(150)
@given(content=st.one_of(matrix_contents(), st.binary(max_size=200)))
def test_fuzz_matrix_files(tmp_path, content):
    path = tmp_path / "m.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    try:
        m = RecyclingMatrix.load(path, V, "fp")
    except UserError as e:
        event("refused")
        assert "\n" not in str(e)
        return
    event("loaded")
    assert m.table.shape[0] == V and 0 <= int(m.table.min()) and int(m.table.max()) < V
    assert bool(((m.confidence >= 0) & (m.confidence <= 1)).all())
    tree = build_tree([[r] for r in range(m.k)] + [[0, r] for r in range(m.k)] + [[0, 0, 0]], m.k)
    for root in range(V):  # drafting from it never indexes out of range
        assert int(m.retrieve(torch.tensor(root), tree).max()) < V


# --- the Python API's arguments ----------------------------------------------------------------------------------

anything = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8),
                     st.binary(max_size=4), st.lists(st.integers(), max_size=2),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def mostly(good):
    """Good values five times in six, anything at all otherwise."""
    return st.integers(0, 5).flatmap(lambda i: good if i else anything)


messages = st.lists(mostly(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                  "content": st.text(max_size=20)})), min_size=1, max_size=3)
API_ARGS = {
    "max_new_tokens": mostly(st.integers(1, 12)),
    "chat_template": mostly(st.booleans()),
    "method": mostly(st.sampled_from(["ar", "tr", "pld", "hybrid", None])),
    "seed_from_prompt": mostly(st.booleans()),
    "reuse_cache": mostly(st.booleans()),
    "temperature": mostly(st.one_of(st.floats(0, 5), st.sampled_from([1e-45, 5e-324, 1e300]))),
    "top_k": mostly(st.integers(0, 400)),
    "top_p": mostly(st.floats(0, 1, exclude_min=True)),
    "seed": mostly(st.one_of(st.none(), st.integers(0, 2**63 - 1))),
}


@pytest.fixture(scope="module")
def api_engine(folder):
    return Engine.from_pretrained(str(folder), dtype="float64", max_context=256)


@fuzz(120)
@given(prompt=mostly(st.one_of(st.text(min_size=1, max_size=30), messages)),
       kwargs=st.fixed_dictionaries({}, optional=API_ARGS))
@example(prompt="0", kwargs={"temperature": 2**64})  # (found by CI: an int too big for a tensor to divide by)
def test_fuzz_api_arguments(api_engine, prompt, kwargs):
    if "max_new_tokens" not in kwargs or kwargs["max_new_tokens"] is None:
        kwargs["max_new_tokens"] = 4
    try:
        result = api_engine.generate(prompt, **kwargs)
    except UserError as e:
        event(f"refused: {type(e).__name__}")
        assert "\n" not in str(e)
        return
    event("generated")
    assert 1 <= len(result.token_ids) <= kwargs["max_new_tokens"]
    assert all(0 <= t < api_engine.model.config.vocab_size for t in result.token_ids)
    assert not any(math.isnan(v) for v in result.generation.phase_s.values())


# --- the HTTP server ------------------------------------------------------------------------------------------------

http_message = st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "assistant", "system", "developer"])),
                                      "content": mostly(st.text(max_size=30))})
HTTP_FIELDS = {
    "messages": mostly(st.lists(mostly(http_message), min_size=1, max_size=3)),
    "prompt": mostly(st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, 299), max_size=5))),
    "max_tokens": mostly(st.integers(1, 8)),
    "temperature": mostly(st.one_of(st.floats(0, 2), st.sampled_from([1e-45, 5e-324, float("nan"), float("inf")]))),
    "top_p": mostly(st.floats(0, 1)),
    "top_k": mostly(st.integers(0, 400)),
    "seed": mostly(st.integers(0, 2**64)),
    "stop": mostly(st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5))),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ignore_eos": mostly(st.booleans()),
    "n": mostly(st.integers(0, 3)),
    "speculative_config": mostly(st.fixed_dictionaries({}, optional={
        "method": st.sampled_from(["ar", "hybrid", "tr", "suffix"]), "num_speculative_tokens": st.integers(-1, 9),
        "disable_by_batch_size": st.integers(1, 4)})),
    "logprobs": mostly(st.booleans()),
    "presence_penalty": mostly(st.floats(-2, 2)),
}


@pytest.fixture(scope="module")
def http_server(tiny_factory):
    from test_serve import Server

    s = Server(str(tiny_factory("serve64", dtype=torch.float64, vocab_size=300, std=0.5, max_positions=16384)),
               "--dtype", "float64", "--batch", "2", "--no-persist", "--max-context", "256")
    s.model_seen = s.model
    yield s
    code, out = s.stop()
    assert code == 0 and "Traceback" not in out and "internal error" not in out, out[-3000:]


def http_body(chat: bool):
    """A request body for the chat (or completions) endpoint: its fields, each mostly good; or any JSON object; or
    any bytes."""
    fields = {k: v for k, v in HTTP_FIELDS.items() if k != ("prompt" if chat else "messages")}
    required = {"messages" if chat else "prompt": fields.pop("messages" if chat else "prompt")}
    return st.one_of(st.fixed_dictionaries(required, optional=fields),
                     st.dictionaries(st.text(max_size=6), anything, max_size=3),
                     st.binary(max_size=64)).map(lambda b: b if isinstance(b, bytes) else json.dumps(
                         b, default=repr).encode())


@fuzz(25)
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), data=st.data())
def test_fuzz_http_requests(http_server, path, data):
    """Any body to either endpoint: an answer (200, whole or streamed) or a client error in OpenAI's shape (4xx) or
    a busy 503; never a 500, and (the fixture checks at the end) never a traceback in the server's log."""
    body = data.draw(http_body(chat="chat" in path))
    status, _, text = http_server.request("POST", path, raw=body)
    event(f"{status}")
    assert status in (200, 503) or 400 <= status < 500, (status, text[:300])
    if status != 200:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"], text[:300]
    elif text.startswith("data: "):  # a stream: events, then [DONE]
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
    else:
        assert json.loads(text)["choices"], text[:300]
