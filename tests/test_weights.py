"""Strict weight loading and each bad model folder's one-line error."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tr_engine.errors import UserError
from tr_engine.model import reference
from tr_engine.model.ops import PackedWeight
from tr_engine.model.weights import load_model
from weights_tools.bin_to_safetensors import convert as bin_to_safetensors


@pytest.fixture
def folder(tiny_factory, tmp_path):
    """A private copy of a tiny model folder that a test may break."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_factory("float32", dtype=torch.float64), dst)
    return dst


def rewrite(folder, edit):
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors")


def one_line_error(fn, *match):
    with pytest.raises(UserError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    for m in match:
        assert m in message, message
    return message


def test_loads_and_casts_once(folder):
    model = load_model(folder, torch.bfloat16, ops="reference")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ref = load_file(folder / "model.safetensors")["model.layers.0.self_attn.k_proj.weight"].to(torch.bfloat16)
    assert torch.equal(model.model.layers[0].self_attn.k_proj.weight, ref)


def test_progress_hears_every_file_byte_in_order(folder):
    """Split over shards, the files' bytes (headers and tensors) are counted as read, up to their sizes' sum."""
    weights = load_file(folder / "model.safetensors")
    names = sorted(weights)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, folder / shard)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    heard = []
    load_model(folder, torch.float32, ops="reference", progress=lambda done, total: heard.append((done, total)))
    total = sum((folder / shard).stat().st_size for shard in shards)
    assert len(heard) == len(names) and all(t == total for _, t in heard)
    done = [d for d, _ in heard]
    assert done == sorted(done) and done[-1] == total


def test_the_loading_line_shows_on_a_terminal_for_big_models_only(capsys):
    from tr_engine.cli.args import LoadProgress

    bar = LoadProgress("vicuna-7b")
    for done in (0, 1 << 29, 1 << 29, 1 << 31):
        bar(done, 1 << 31)
    bar.end(ok=True)
    err = capsys.readouterr().err
    assert err.count("\r") == 3 and "loading vicuna-7b: 25% of 2.1 GB" in err  # a repeated percentage is not redrawn
    assert err.rstrip("\n").endswith("100% of 2.1 GB in 0 s") and err.endswith("\n")
    small = LoadProgress("tiny")
    small(10, 100)
    small.end(ok=True)
    assert capsys.readouterr().err == ""
    assert LoadProgress.on_terminal("vicuna-7b") is None  # capsys's stderr is no terminal: no carriage returns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_model_keeps_its_projections_packed_and_only_packed(folder, dtype):
    """With the kernels, load_model packs every projection (q/k/v fused, gate/up fused, o, down, the tied LM head)
    exactly and drops the plain copies; float64 (no packed kernel) keeps them. (test_model covers a tied head.)"""
    weights = {k: v.to(dtype) for k, v in load_file(folder / "model.safetensors").items()}
    model = load_model(folder, dtype)
    layer = model.model.layers[1]
    p = "model.layers.1."
    qkv = torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    gate_up = torch.cat([weights[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")])
    for got, want in [(layer.self_attn.qkv_weight, qkv), (layer.mlp.gate_up_weight, gate_up),
                      (layer.self_attn.o_weight, weights[p + "self_attn.o_proj.weight"]),
                      (layer.mlp.down_weight, weights[p + "mlp.down_proj.weight"]),
                      (model.head_weight, weights["lm_head.weight"])]:
        assert isinstance(got, PackedWeight) and got.n == want.shape[0]
        assert torch.equal(got.data, reference.pack_linear(want))
    assert layer.self_attn.q_proj.weight is None and model.lm_head.weight is None
    assert set(model.state_dict()) == {n for n in weights if "norm" in n or "embed" in n}
    plain = load_model(folder, torch.float64)
    assert torch.is_tensor(plain.model.layers[1].self_attn.qkv_weight)


def test_missing_folder(tmp_path):
    one_line_error(lambda: load_model(tmp_path / "nope"), "does not exist")


def test_missing_key(folder):
    rewrite(folder, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    one_line_error(lambda: load_model(folder), "missing 1 weight(s): model.layers.1.mlp.up_proj.weight")


def test_unexpected_key(folder):
    rewrite(folder, lambda w: w.update({"model.layers.9.extra.weight": torch.zeros(2)}))
    one_line_error(lambda: load_model(folder), "unexpected 1: model.layers.9.extra.weight")


def test_inv_freq_buffers_are_ignored(folder):
    rewrite(folder, lambda w: w.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}))
    load_model(folder)


def test_wrong_shape(folder):
    rewrite(folder, lambda w: w.update({"model.norm.weight": torch.ones(65)}))
    one_line_error(lambda: load_model(folder), "model.norm.weight has shape [65]", "[64]")


def test_truncated_safetensors(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    one_line_error(lambda: load_model(folder), "corrupt or truncated", "download or convert it again")


def broken_header(raw: bytes, how: str) -> bytes:
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    if how == "header length":
        return (len(raw) * 2).to_bytes(8, "little") + raw[8:]
    if how == "header json":
        return raw[:8] + b"{" * n + raw[8 + n :]
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"][1] -= 2  # its bytes no longer fit its shape
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + raw[8 + n :]


@pytest.mark.parametrize("how", ["header length", "header json", "bytes against shape"])
def test_a_safetensors_file_broken_inside_is_one_line(folder, how):
    """The reader (weights.SafetensorsFile, plain reads, no mapping) checks what it reads: each inconsistency is
    the one-line corrupt-or-truncated error, never a traceback or a tensor of garbage."""
    path = folder / "model.safetensors"
    path.write_bytes(broken_header(path.read_bytes(), how))
    one_line_error(lambda: load_model(folder), str(path), "corrupt or truncated", "download or convert it again")


def test_unsupported_hidden_act(folder):
    config = json.loads((folder / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(config))
    one_line_error(lambda: load_model(folder), "hidden_act 'gelu' is not supported")


def test_unsupported_rope_type(folder):
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    one_line_error(lambda: load_model(folder), "rope scaling type 'yarn' is not supported", "llama3")


def test_bin_only_folder_says_how_to_convert(folder):
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    one_line_error(lambda: load_model(folder), "python -m weights_tools.bin_to_safetensors")


def test_bin_to_safetensors_round_trip(folder, tmp_path):
    """Two .bin shards with an index (as Vicuna ships) convert to safetensors shards that load to the same model."""
    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    src = tmp_path / "bin"
    src.mkdir()
    shutil.copy(folder / "config.json", src)
    weight_map = {}
    for i, part in enumerate([names[::2], names[1::2]]):
        shard = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({n: state[n] for n in part} | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)},
                   src / shard)
        weight_map.update({n: shard for n in part})
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    out = tmp_path / "converted"
    bin_to_safetensors(src, out)
    assert (out / "model.safetensors.index.json").is_file()
    a, b = load_model(folder, ops="reference"), load_model(out, ops="reference")  # unpacked: the whole state_dict
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def test_bin_with_pickled_code_is_refused(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pickled code ran",))

    src = tmp_path / "evil"
    src.mkdir()
    with open(src / "pytorch_model.bin", "wb") as f:
        pickle.dump({"w": Evil()}, f)
    from weights_tools.bin_to_safetensors import ConversionError

    with pytest.raises(ConversionError, match="cannot be loaded safely"):
        bin_to_safetensors(src, tmp_path / "out")


def test_random_model_has_the_config_shapes_and_ties_its_head():
    """What the GPU check measures with: the checkpoint's shapes, random projections, unit norms, a tied head tied."""
    import dataclasses

    from bench.shapes import SHAPES
    from tr_engine.model.weights import random_model

    config = dataclasses.replace(SHAPES["tiny"], tie_word_embeddings=True)
    model = random_model(config, torch.bfloat16, ops="reference", seed=1)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.dtype == torch.bfloat16
    w = model.model.layers[0].self_attn.q_proj.weight
    assert w.shape == (config.num_attention_heads * config.head_dim, config.hidden_size)
    assert 0.015 < w.float().std().item() < 0.025
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    again = random_model(config, torch.bfloat16, ops="reference", seed=1)
    assert torch.equal(again.model.layers[0].self_attn.q_proj.weight, w)  # seeded


def test_loading_holds_the_weights_once(tiny_factory, tmp_path):
    """A bf16 checkpoint loaded as bf16 (nothing to cast): afterwards the process holds the packed weights and
    little else (a view into safetensors' mapping of the file kept all of it resident beside them: 2.1x), and at no
    point does it hold the weights twice (the mapped file's pages beside the copies read from it made 2.2x; the
    plain weights kept beside their fused and packed replacements, 3.2x)."""
    from bench.load_memory import measure
    from weights_tools.tiny_llama import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "m", hidden_size=1024, intermediate_size=2816, num_layers=4, num_heads=8,
                              num_kv_heads=8, dtype=torch.bfloat16, std=0.02)  # ~100 MB of bf16 weights
    got = measure(folder, tiny_factory(), threads=1)  # (a fresh process, as bench/results/load_memory_*.md)
    assert got["held_bytes"] > 90e6
    assert got["grown_x"] < 1.25 and got["peak_x"] < 1.5, got


ADVISED = """
import torch, tr_engine._C
w = torch.ops.tr_engine.pack_linear(torch.ones(8192, 576))  # 18.9 MB: a 2 MB-aligned block of its own
at = w.data_ptr()
for line in open("/proc/self/smaps"):
    if "-" in line.split()[0] and ":" not in line.split()[0]:
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    elif line.startswith("VmFlags:") and lo <= at < hi:
        print(" hg" in line)
"""


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc/self/smaps says what was advised")
@pytest.mark.parametrize("setting, advised", [(None, True), ("1", True), ("0", False)])
def test_the_huge_page_advice_is_given_unless_turned_off(setting, advised):
    """The weights' memory is advised for huge pages (VmFlags "hg"), unless TR_ENGINE_HUGE_PAGES=0 (faster loads on
    VMs whose huge pages cost ~15 ms each at first touch; the test suite runs so, conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TR_ENGINE_HUGE_PAGES"}
    if setting is not None:
        env["TR_ENGINE_HUGE_PAGES"] = setting
    proc = subprocess.run([sys.executable, "-c", ADVISED], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == [str(advised)], proc.stderr


FREED_BLOCKS = """
import ctypes, sys
from tr_engine.model.weights import server_malloc
if sys.argv[1] == "server":
    server_malloc()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
first = libc.malloc(8 << 20)  # one large block freed: glibc's own threshold rises to its size
ctypes.memset(first, 1, 8 << 20)
libc.free(first)
before = rss_mb()
blocks, pins = [], []
for _ in range(20):  # a step's temporaries of 2 MB, each followed by something smaller that lives on
    blocks.append(libc.malloc(2 << 20))
    ctypes.memset(blocks[-1], 1, 2 << 20)
    pins.append(libc.malloc(100 << 10))  # (too big for the heap's small free chunks: carved after the block)
for b in blocks:
    libc.free(b)
print(rss_mb() - before)
"""


@pytest.mark.skipif(sys.platform != "linux" or not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
def test_the_servers_malloc_gives_freed_large_blocks_back():
    """weights.server_malloc fixes glibc's mmap threshold: 40 MB of 2 MB blocks freed between small blocks that live on
    stay resident under glibc's own rising threshold (the heap's middle), and go back with the server's."""
    from tr_engine.model.weights import glibc

    if glibc("mallopt") is None:
        pytest.skip("not glibc: the server leaves malloc as it is")
    grown = {how: float(subprocess.run([sys.executable, "-c", FREED_BLOCKS, how], capture_output=True, text=True,
                                       check=True, cwd=Path(__file__).resolve().parent.parent).stdout)
             for how in ("default", "server")}
    assert grown["default"] > 30 and grown["server"] < 5, grown
