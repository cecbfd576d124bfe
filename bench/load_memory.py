"""What loading a model costs in memory and time, at a real model's size without its weights: a checkpoint of that
shape with random values is written to a scratch folder (sharded as Hugging Face shards it, one file per 4 layers),
loaded by tr_engine.model.weights.load_model in a fresh process as bfloat16, and deleted. Reported: seconds to load, the
bytes of weights the model holds, and how much the process grew, after loading and at its peak (VmHWM), as
multiples of those bytes: a model that loads in about one model's worth of memory, with no second copy at any point.
Checkpoints stored in float16 are cast while loading. Writes load_memory_<shape>.{md,json}.

    python -m bench.load_memory --shape vicuna-7b [--stored bfloat16 float16] [--scratch DIR]
"""

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.machine import machine_info, machine_line, save_results
from bench.shapes import SHAPES
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.errors import UserError

LOAD = """
import sys, time, torch
from pathlib import Path
from bench.shapes import held_bytes
from tr_engine.model.weights import load_model

def kb(field):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))

torch.set_num_threads(int(sys.argv[3]))
load_model(sys.argv[2], torch.bfloat16)  # the first load's one-time costs (the kernels' library, first allocations)
before, t0 = kb("VmRSS"), time.perf_counter()
model = load_model(sys.argv[1], torch.bfloat16)
print(time.perf_counter() - t0, held_bytes(model), (kb("VmRSS") - before) * 1024, (kb("VmHWM") - before) * 1024)
"""


def write_checkpoint(folder: Path, shape: str, dtype: torch.dtype, spelled: int | None = None) -> int:
    """A Hugging Face folder (config.json, shards of 4 layers, the index) of `shape` with uniform random weights in
    `dtype`; returns the bytes of weights written. One shard is in memory at a time. With `spelled` (a tokenizer's
    size, below the shape's vocabulary), the LM head's rows from that id on are zero: a random model's greedy choice
    is then a token the tokenizer can spell (a positive logit beats zero), as a real model's never is a padding id."""
    from safetensors.torch import save_file

    c = SHAPES[shape]
    E, F, V, L, D = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers, c.head_dim
    Hq, Hkv = c.num_attention_heads, c.num_key_value_heads
    g = torch.Generator().manual_seed(0)

    def rnd(*size):
        return torch.empty(size, dtype=dtype).uniform_(-0.03, 0.03, generator=g)

    def layers(first: int) -> dict:
        shard = {}
        for layer in range(first, min(first + 4, L)):
            p = f"model.layers.{layer}."
            shard |= {p + "self_attn.q_proj.weight": rnd(Hq * D, E), p + "self_attn.k_proj.weight": rnd(Hkv * D, E),
                      p + "self_attn.v_proj.weight": rnd(Hkv * D, E), p + "self_attn.o_proj.weight": rnd(E, Hq * D),
                      p + "mlp.gate_proj.weight": rnd(F, E), p + "mlp.up_proj.weight": rnd(F, E),
                      p + "mlp.down_proj.weight": rnd(E, F), p + "input_layernorm.weight": torch.ones(E, dtype=dtype),
                      p + "post_attention_layernorm.weight": torch.ones(E, dtype=dtype)}
        return shard

    folder.mkdir(parents=True, exist_ok=True)
    firsts = range(0, L, 4)
    weight_map, written, n = {}, 0, 1 + len(firsts)
    for i in range(n):
        if i == 0:
            shard = {"model.embed_tokens.weight": rnd(V, E), "model.norm.weight": torch.ones(E, dtype=dtype)}
            if not c.tie_word_embeddings:
                shard["lm_head.weight"] = rnd(V, E)
                if spelled is not None:
                    shard["lm_head.weight"][spelled:] = 0
        else:
            shard = layers(firsts[i - 1])
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(folder / name))
        weight_map |= dict.fromkeys(shard, name)
        written += sum(t.numel() * t.element_size() for t in shard.values())
        del shard
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": E,
              "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": Hq, "num_key_value_heads": Hkv,
              "head_dim": D, "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
              "rope_theta": c.rope_theta, "hidden_act": "silu", "tie_word_embeddings": c.tie_word_embeddings,
              "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(config))
    return written


def measure(folder: Path, warm: Path, threads: int) -> dict:
    """Load `folder` as bfloat16 in a fresh process (after one load of `warm`, a tiny model, for the one-time
    costs): seconds, bytes held, growth after and at the peak."""
    proc = subprocess.run([sys.executable, "-c", LOAD, str(folder), str(warm), str(threads)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        raise RuntimeError(f"loading {folder} failed: {proc.stderr.strip().splitlines()[-1:]}")
    seconds, held, grown, peak = (float(x) for x in proc.stdout.split())
    return {"load_s": seconds, "held_bytes": held, "grown_bytes": grown, "peak_bytes": peak,
            "grown_x": grown / held, "peak_x": peak / held}


def scratch_folder(scratch: Path | None) -> Path | None:
    """--scratch, made where missing (as --out is), or a one-line error where it cannot be."""
    if scratch is not None:
        try:
            scratch.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--scratch {scratch}: cannot make a folder there ({e.strerror}); give a writable folder "
                            "with room for the checkpoint") from None
    return scratch


def main(argv=None) -> int:
    from weights_tools.tiny_llama import write_tiny_llama

    ap = ArgumentParser(prog="python -m bench.load_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="vicuna-7b", choices=sorted(SHAPES))
    ap.add_argument("--stored", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--scratch", type=Path, default=None, help="where the checkpoint is written (default: a temporary "
                    "folder); it needs the checkpoint's size free")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    info, rows = machine_info(), {}
    with tempfile.TemporaryDirectory(dir=scratch_folder(args.scratch)) as tmp:
        warm = write_tiny_llama(Path(tmp) / "warm")
        for stored in args.stored:
            folder = Path(tmp) / stored
            written = write_checkpoint(folder, args.shape, getattr(torch, stored))
            rows[stored] = {"checkpoint_bytes": written, **measure(folder, warm, args.threads)}
            shutil.rmtree(folder)
            r = rows[stored]
            print(f"{stored}: {r['load_s']:.0f} s, {r['grown_x']:.3f}x after, {r['peak_x']:.3f}x at the peak",
                  file=sys.stderr, flush=True)
    lines = [f"# Loading {args.shape} as bfloat16: memory and time", "",
             f"Machine: {machine_line(info)}. A checkpoint of {args.shape}'s shape with random weights, sharded one "
             "file per 4 layers, loaded by `tr_engine.model.weights.load_model` in a fresh process (after a tiny "
             "model's load, for the one-time costs). Held: the bytes of the weights the model keeps (packed). After and peak: "
             "how much the process grew (VmRSS after loading, VmHWM), as multiples of that.", "",
             "| stored as | checkpoint GB | load s | held GB | after | peak |", "|---|---|---|---|---|---|"]
    for stored, r in rows.items():
        lines.append(f"| {stored} | {r['checkpoint_bytes'] / 1e9:.2f} | {r['load_s']:.0f} | "
                     f"{r['held_bytes'] / 1e9:.2f} | {r['grown_x']:.3f}x | {r['peak_x']:.3f}x |")
    text = "\n".join(lines) + "\n"
    save_results(args.out / f"load_memory_{args.shape}", text, {"shape": args.shape, "rows": rows}, info)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
