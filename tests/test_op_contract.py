"""The contract of every op in the registry (tr_engine.model.ops.OP_NAMES; schemas and contracts in
csrc/registration.cpp),
on every device this machine has: the kernel agrees with its pure-PyTorch reference (tr_engine/model/reference.py),
passes torch.library.opcheck (schema, fake, dispatch), and refuses each input its shared checks (csrc/op_checks.h) exist
for, with their message; and the sources keep those checks shared: every CPU kernel and CUDA launcher of an op calls
its op's check function first, and every check in the header has a refused case here.

The per-op files (tests/test_<op>.py) test each kernel in depth: its shapes, dtypes, edge cases and speed paths."""

import re
from pathlib import Path

import pytest
import torch

from tr_engine.model import reference
from tr_engine.model.ops import OP_NAMES, load_ops

CSRC = Path(__file__).parents[1] / "csrc"
kernels = load_ops("kernels")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def tree_args(device, dynamic=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).to(device) for shape in ((4, 4, 8), (2, 16, 8), (2, 16, 8)))
    mask = torch.ones(4, 4, dtype=torch.bool).tril().to(device)
    prefix = torch.tensor([5], device=device) if dynamic else 5
    return [q, k, v, prefix, mask, 0.35]


def weights(device, n=40, k=64):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(1)).to(device)


def rows(device, t=3, k=64):
    return torch.randn(t, k, generator=torch.Generator().manual_seed(2)).to(device)


# op -> valid arguments on a device. The first argument of an op ending in "_" is the tensor it mutates.
VALID = {
    "compact_kv_": lambda d: [torch.randn(2, 2, 2, 16, 8).to(d), torch.tensor([5, 7, 9], device=d), 3],
    "skinny_linear": lambda d: [rows(d), weights(d)],
    "pack_linear": lambda d: [weights(d)],
    "packed_linear": lambda d: [rows(d, 5), reference.pack_linear(weights(d)), 40],
    "recycle_update_": lambda d: [torch.zeros(50, 4, dtype=torch.long, device=d), torch.tensor([3, 7, 3], device=d),
                                  torch.randn(3, 50).to(d)],
    "tree_attention": tree_args,
    "tree_attention_dynamic": lambda d: tree_args(d, dynamic=True),
    "tree_attention_batch": lambda d: batch_args(d),
    "tree_attention_rows": lambda d: rows_args(d),
    "decoder_layers": lambda d: layer_args(d),
    "argmax_rows": lambda d: [torch.randn(3, 50, generator=torch.Generator().manual_seed(5)).to(d)],
    "top_k_rows": lambda d: [(torch.randint(0, 9, (5, 70), generator=torch.Generator().manual_seed(6)) / 4).to(d), 6],
}


def batch_args(device):
    """Two sequences of 3 and 2 rows in slots 2 and 0 of a 3-slot cache, after 5 and 0 cached tokens."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*shape, generator=g).to(device) for shape in ((5, 4, 8), (3, 2, 16, 8), (3, 2, 16, 8)))
    masks = torch.cat([torch.ones(3, 3, dtype=torch.bool).tril().reshape(-1),
                       torch.eye(2, dtype=torch.bool).reshape(-1)])
    return [q, k, v, [2, 0], [5, 0], [0, 3, 5], masks.to(device), 0.35]


def rows_args(device):
    """batch_args' two sequences as tree_attention_rows takes them: each row's slot, prefix and first row, and one
    [T, T] mask over the batch's rows."""
    q, k, v, slots, prefixes, offsets, masks, scale = batch_args(device)
    rows, mask, at = torch.empty(5, 3, dtype=torch.long), torch.zeros(5, 5, dtype=torch.bool), 0
    for slot, prefix, lo, hi in zip(slots, prefixes, offsets, offsets[1:]):
        n = hi - lo
        rows[lo:hi] = torch.tensor([slot, prefix, lo])
        mask[lo:hi, lo:hi] = masks[at : at + n * n].view(n, n).cpu()
        at += n * n
    return [q, k, v, rows.to(device), mask.to(device), scale]


def layer_args(device, L=2, E=32, Hq=4, Hkv=2, D=8, F=24, dtype=torch.float32):
    """L layers of packed random weights (in `dtype`, the rest float32); two sequences of 3 and 2 rows in slots 2
    and 0 (batch_args' shapes)."""
    g = torch.Generator().manual_seed(4)
    weights = []
    for _ in range(L):
        packed = [reference.pack_linear((torch.randn(n, k, generator=g) / k**0.5).to(dtype))
                  for n, k in (((Hq + 2 * Hkv) * D, E), (E, Hq * D), (2 * F, E), (E, F))]
        weights += [torch.ones(E), packed[0], packed[1], torch.ones(E), packed[2], packed[3]]
    cos, sin = torch.randn(5, D, generator=g), torch.randn(5, D, generator=g)
    x, kv = torch.randn(5, E, generator=g), torch.randn(L, 3, 2, Hkv, 16, D, generator=g)
    *_, slots, prefixes, offsets, masks, _ = batch_args(device)
    return [x, weights, cos, sin, kv, slots, prefixes, offsets, masks, Hq, F, 1e-5]


CPU_ONLY = {"pack_linear", "packed_linear", "decoder_layers", "argmax_rows", "top_k_rows"}  # (the blocked layout of
# the CPU matmul; greedy's argmax and tensor parallelism's top-k, which a GPU leaves to PyTorch)


def op_device_cases():
    for name in OP_NAMES:
        for device in DEVICES:
            marks = device.marks if not isinstance(device, str) else ()
            device = device if isinstance(device, str) else device.values[0]
            if device == "cpu" or name not in CPU_ONLY:
                yield pytest.param(name, device, marks=marks, id=f"{name}-{device}")


# The ops that choose the CPU kernel tier and measure its peak (tests/test_cpu_tiers.py): no tensors, no reference.
TIER_OPS = {"cpu_features", "use_cpu_tier", "cpu_tier", "multiply_add_peak"}


def test_every_registered_op_has_a_contract_case():
    assert set(VALID) == set(OP_NAMES)
    assert set(OP_NAMES) | TIER_OPS == set(re.findall(r'm\.def\("(\w+)\(', (CSRC / "registration.cpp").read_text()))


# The kernel's agreement and opcheck on every CPU tier this machine runs (conftest.cpu_tier; avx512 too where
# avx512bf16 runs, for its own bf16 matmuls); the refusals are the op library's own checks, made before any tier runs.
EVERY_TIER = True
@pytest.mark.parametrize("name,device", op_device_cases())
def test_the_kernel_agrees_with_its_reference(name, device, cpu_tier):
    args = VALID[name](device)
    theirs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got, want = getattr(kernels, name)(*args), getattr(reference, name)(*theirs)
    if name.endswith("_"):  # the mutated tensor is the result
        got, want = args[0], theirs[0]
    exact = got.dtype == torch.long or name == "pack_linear"
    torch.testing.assert_close(got, want, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)


@pytest.mark.parametrize("name,device", op_device_cases())
def test_opcheck(name, device, cpu_tier):
    torch.library.opcheck(getattr(torch.ops.tr_engine, name), tuple(VALID[name](device)))


def threaded_args(name, dtype):
    """Arguments in `dtype` whose work every thread gets a share of: several 32-row blocks of a weight, several
    heads, rows and layers."""
    if name == "packed_linear":
        return [rows("cpu", 13, 96).to(dtype), reference.pack_linear(weights("cpu", 300, 96).to(dtype)), 300]
    if name == "skinny_linear":
        return [rows("cpu", 5, 96).to(dtype), weights("cpu", 300, 96).to(dtype)]
    if name == "argmax_rows":  # (float32 or float64 logits)
        return [torch.randn(7, 5000, generator=torch.Generator().manual_seed(5), dtype=torch.float64)]
    if name == "top_k_rows":  # (ties: a few distinct values)
        return [(torch.randint(0, 40, (9, 5000), generator=torch.Generator().manual_seed(5)) / 4).to(dtype), 8]
    if name == "decoder_layers":
        args = layer_args("cpu", E=64, Hq=8, Hkv=4, F=96, dtype=dtype)
        args[1] = [w.to(dtype) for w in args[1]]
    else:
        attention = {"tree_attention": tree_args, "tree_attention_batch": batch_args, "tree_attention_rows": rows_args}
        args = attention[name]("cpu")
    return [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["packed_linear", "skinny_linear", "tree_attention", "tree_attention_batch",
                                  "tree_attention_rows", "decoder_layers", "argmax_rows", "top_k_rows"])
def test_the_thread_count_splits_the_work_never_a_sum(name, dtype, cpu_tier):
    """Threads share out whole outputs (a weight's blocks, attention's heads and rows), each computed by one thread
    in one order: 1, 2 and 3 threads give the same bits, so `--threads` (or a test worker's one thread) changes no
    token."""
    args = threaded_args(name, dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(getattr(kernels, name)(*args))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])


def replace(i, value):
    """A mutation of the valid arguments: argument i replaced by value(args, device)."""
    def mutate(args, device):
        args[i] = value(args, device)
        return args
    return mutate


# (op, the first literal of the check's message in csrc/op_checks.h, the mutation it refuses)
REFUSED = [
    ("compact_kv_", "compact_kv_: cache must be [L, 2, Hkv, S, D], got ", replace(0, lambda a, d: a[0][0])),
    ("compact_kv_", "compact_kv_: cache must be contiguous", replace(0, lambda a, d: a[0].transpose(3, 4))),
    ("compact_kv_", "compact_kv_: src_slots must be a 1-D int64 tensor, got ",
     replace(1, lambda a, d: a[1].int())),
    ("compact_kv_", "compact_kv_: dst_start ", replace(2, lambda a, d: 14)),
    ("recycle_update_", "recycle_update_: table must be a contiguous int64 [V, k] tensor",
     replace(0, lambda a, d: a[0].int())),
    ("recycle_update_", "recycle_update_: tokens must be int64 [T]", replace(1, lambda a, d: a[1].int())),
    ("recycle_update_", "recycle_update_: logits must be [T, V] with T = ", replace(2, lambda a, d: a[2][:2])),
    ("recycle_update_", "recycle_update_: logits have ", replace(2, lambda a, d: a[2][:, :40])),
    ("recycle_update_", "recycle_update_: k = ",
     lambda a, d: [torch.zeros(2, 4, dtype=torch.long, device=d), a[1][:1], a[2][:1, :2]]),
    ("skinny_linear", "skinny_linear: x must be [T, K] and w [N, K], got ", replace(0, lambda a, d: a[0][0])),
    ("skinny_linear", "skinny_linear: x is [", replace(1, lambda a, d: a[1][:, :32])),
    ("skinny_linear", "skinny_linear: x has ", replace(0, lambda a, d: rows(d, 17))),
    ("skinny_linear", "skinny_linear: x is ", replace(1, lambda a, d: a[1].double())),
    ("skinny_linear", "skinny_linear: w must be contiguous [N, K]",
     replace(1, lambda a, d: weights(d, 64, 40).t())),
    ("tree_attention", "tree_attention: q must be [T, Hq, D], got ", replace(0, lambda a, d: a[0][0])),
    ("tree_attention", "tree_attention: k and v must be [Hkv, S, D]", replace(1, lambda a, d: a[1][0])),
    ("tree_attention", "tree_attention: k and v must have the same shape and strides, got ",
     replace(2, lambda a, d: a[2][:, :12])),
    ("tree_attention", "tree_attention: q has head dim ", replace(0, lambda a, d: a[0][:, :, :4])),
    ("tree_attention", "tree_attention: q's ", replace(0, lambda a, d: a[0][:, :3])),
    ("tree_attention", "tree_attention: q, k and v must share a dtype, got ", replace(0, lambda a, d: a[0].double())),
    ("tree_attention", "tree_attention: q, k and v need a contiguous last (head) dim",
     replace(0, lambda a, d: a[0].transpose(1, 2).contiguous().transpose(1, 2))),
    ("tree_attention", "tree_attention: prefix_len ", replace(3, lambda a, d: 13)),
    ("tree_attention", "tree_attention: tree_mask must be bool [T, T] = [", replace(4, lambda a, d: a[4][:3])),
    ("tree_attention_dynamic", "tree_attention_dynamic: prefix_len must be a one-element int64 tensor, got ",
     replace(3, lambda a, d: torch.tensor([5, 6], device=d))),
    ("tree_attention_dynamic", "tree_attention: tree_mask must be bool [T, T] = [",
     replace(4, lambda a, d: a[4].int())),
    ("tree_attention_batch", "tree_attention_batch: k and v must be [N, Hkv, S, D], got ",
     replace(1, lambda a, d: a[1][0])),
    ("tree_attention_batch", "tree_attention_batch: B slots need B prefix_lens and B + 1 offsets; got ",
     replace(4, lambda a, d: [5])),
    ("tree_attention_batch", "tree_attention_batch: offsets must run from 0 to q's ",
     replace(5, lambda a, d: [0, 3, 4])),
    ("tree_attention_batch", "tree_attention_batch: slots[", replace(3, lambda a, d: [3, 0])),
    ("tree_attention_batch", "tree_attention_batch: two sequences share slot ", replace(3, lambda a, d: [0, 0])),
    ("tree_attention_batch", "tree_attention_batch: offsets must not decrease", replace(5, lambda a, d: [0, 6, 5])),
    ("tree_attention_batch", "tree_attention_batch: tree_masks must be bool [", replace(6, lambda a, d: a[6][:-1])),
    ("tree_attention_batch", "tree_attention: prefix_len ", replace(4, lambda a, d: [14, 0])),
    ("tree_attention_rows", "tree_attention_rows: k and v must be [N, Hkv, S, D] with N >= 1, got ",
     replace(1, lambda a, d: a[1][0])),
    ("tree_attention_rows", "tree_attention_rows: q must be [T, Hq, D], got ", replace(0, lambda a, d: a[0][0])),
    ("tree_attention_rows", "tree_attention_rows: rows must be int64 [T, 3] = [", replace(3, lambda a, d: a[3][:, :2])),
    ("tree_attention_rows", "tree_attention_rows: k and v must have the same strides",
     replace(2, lambda a, d: a[2].transpose(0, 1).contiguous().transpose(0, 1))),
    ("tree_attention_rows", "tree_attention: tree_mask must be bool [T, T] = [", replace(4, lambda a, d: a[4][:4])),
    ("decoder_layers", "decoder_layers: x must be [T, E], got ", replace(0, lambda a, d: a[0][0])),
    ("decoder_layers", "decoder_layers: x is ", replace(0, lambda a, d: a[0].double())),
    ("decoder_layers", "decoder_layers: kv must be [L, N, 2, Hkv, S, D] with a contiguous last dim, got ",
     replace(4, lambda a, d: a[4][0])),
    ("decoder_layers", "decoder_layers: weights must hold 6 tensors a layer ", replace(1, lambda a, d: a[1][:6])),
    ("decoder_layers", "decoder_layers: n_heads = ", replace(9, lambda a, d: 3)),
    ("decoder_layers", "decoder_layers: cos and sin must be [T, D] = [", replace(2, lambda a, d: a[2][:4])),
    ("decoder_layers", "decoder_layers: every tensor must be ",
     replace(1, lambda a, d: a[1][:7] + [a[1][7].double()] + a[1][8:])),
    ("decoder_layers", "decoder_layers: the norms' weights must be [E] = [",
     replace(1, lambda a, d: a[1][:9] + [a[1][9][:8]] + a[1][10:])),
    ("decoder_layers", "decoder_layers: the final norm's weight must be [E] = [",
     replace(1, lambda a, d: a[1] + [a[1][0][:8]])),
    ("decoder_layers", "decoder_layers: qkv, o, gate_up and down must be pack_linear's of [(Hq + 2 Hkv) D, E], "
     "[E, Hq D], ", replace(10, lambda a, d: 40)),
    ("decoder_layers", "tree_attention_batch: two sequences share slot ", replace(5, lambda a, d: [0, 0])),
    ("decoder_layers", "tree_attention: prefix_len ", replace(6, lambda a, d: [14, 0])),
    ("argmax_rows", "argmax_rows: x must be [..., V] with V >= 1, got ", replace(0, lambda a, d: a[0][:, :0])),
    ("argmax_rows", "argmax_rows: x is ", replace(0, lambda a, d: a[0].bfloat16())),
    ("top_k_rows", "top_k_rows: x must be [T, V] with V >= 1, got ", replace(0, lambda a, d: a[0][None])),
    ("top_k_rows", "top_k_rows: x is ", replace(0, lambda a, d: a[0].long())),
    ("top_k_rows", "top_k_rows: k = ", replace(1, lambda a, d: 71)),
    ("top_k_rows", "top_k_rows: k = 0 must be in 1..70", replace(1, lambda a, d: 0)),
]
# Checks that need two devices to fail (a CPU tensor beside a CUDA one): refused on a machine with a GPU.
CROSS_DEVICE = [
    ("compact_kv_", "compact_kv_: src_slots must be on ", 1),
    ("recycle_update_", "recycle_update_: table, tokens and logits must be on one device", 1),
    ("skinny_linear", "skinny_linear: x and w must be on one device", 1),
    ("tree_attention", "tree_attention: q, k, v and tree_mask must be on one device", 4),
    ("tree_attention_dynamic", "tree_attention_dynamic: prefix_len must be on ", 3),
    ("tree_attention_rows", "tree_attention_rows: rows must be on ", 3),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,message,mutate", REFUSED, ids=[f"{n}: {m[len(n) + 2:]}" for n, m, _ in REFUSED])
def test_the_shared_checks_refuse_bad_arguments(name, message, mutate, device):
    args = mutate(VALID[name](device), device)
    with pytest.raises(RuntimeError) as e:
        getattr(kernels, name)(*args)
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.cuda
@pytest.mark.parametrize("name,message,i", CROSS_DEVICE, ids=[n for n, _, _ in CROSS_DEVICE])
def test_the_shared_checks_refuse_arguments_on_two_devices(name, message, i):
    args = VALID[name]("cuda")
    args[i] = args[i].cpu()
    with pytest.raises(RuntimeError) as e:
        getattr(kernels, name)(*args)
    assert str(e.value).startswith(message), str(e.value)


def test_the_cpu_kernels_refuse_indices_out_of_range():
    cache, src, dst = VALID["compact_kv_"]("cpu")
    with pytest.raises(RuntimeError, match=r"compact_kv_: src_slots\[1\] = 16 is outside \[0, 16\)"):
        kernels.compact_kv_(cache, torch.tensor([5, 16, 9]), dst)
    table, tokens, logits = VALID["recycle_update_"]("cpu")
    with pytest.raises(RuntimeError, match=r"recycle_update_: tokens\[2\] = 50 is outside \[0, 50\)"):
        kernels.recycle_update_(table, torch.tensor([3, 7, 50]), logits)


@pytest.mark.cuda
def test_the_cuda_kernels_skip_indices_out_of_range():
    """What the CUDA kernels do instead of a check that would need a host sync: nothing for that index."""
    cache, src, dst = VALID["compact_kv_"]("cuda")
    want = cache.clone()
    reference.compact_kv_(want, torch.tensor([5, 9], device="cuda"), dst)  # slot 4, the skipped one's, left alone
    want[:, :, :, dst + 1] = cache[:, :, :, dst + 1]
    want[:, :, :, dst + 2] = cache[:, :, :, 9]
    want[:, :, :, dst] = cache[:, :, :, 5]
    kernels.compact_kv_(cache, torch.tensor([5, 16, 9], device="cuda"), dst)
    torch.testing.assert_close(cache, want, rtol=0, atol=0)
    table, tokens, logits = VALID["recycle_update_"]("cuda")
    kernels.recycle_update_(table, torch.tensor([3, 7, 50], device="cuda"), logits)
    want = torch.zeros_like(table)
    reference.recycle_update_(want, torch.tensor([3, 7], device="cuda"), logits[:2])
    assert torch.equal(table, want)


def checked_messages() -> dict[str, list[str]]:
    """Each check function of csrc/op_checks.h -> the first literal of each of its TORCH_CHECK messages."""
    text = (CSRC / "op_checks.h").read_text()
    found = {}
    for m in re.finditer(r"inline void (check_\w+)\((.*?)\n}\n", text, re.S):
        found[m.group(1)] = re.findall(r'TORCH_CHECK\(.*?,\s*"((?:[^"\\]|\\.)*)"', m.group(2), re.S)
    return found


def test_every_shared_check_has_a_refused_case():
    covered = {message for _, message, _ in REFUSED} | {message for _, message, _ in CROSS_DEVICE}
    messages = [m for ms in checked_messages().values() for m in ms]
    assert len(messages) >= 25, messages  # the header was read
    assert not [m for m in messages if m not in covered]


def function_body(source: str, name: str) -> str:
    start = re.search(rf"^\S.*\b{name}\(", source, re.M)
    assert start, name
    return source[start.start() : source.index("\n}\n", start.start())]


@pytest.mark.parametrize("backend", ["cpu", "cuda"], ids=["cpu-sources", "cuda-sources"])  # (no GPU needed)
def test_every_kernel_calls_its_ops_shared_check(backend):
    """Every op a backend registers whose contract has shared checks (all but the CPU-only matmul layout) calls its
    check function in the function it registers: deleting the call from one side fails here, on any machine."""
    sources = {p: p.read_text() for p in (CSRC / backend).glob("*.cpp")}
    checks = checked_messages()
    registered = 0
    for path, source in sources.items():
        for op, function in re.findall(r'm\.impl\("(\w+)",\s*&(\w+)\)', source):
            check = f"check_{op.rstrip('_')}_args"
            if op in CPU_ONLY:
                continue
            assert check in checks, (op, check)
            assert f"tr_engine::{check}(" in function_body(source, function), (path.name, function, check)
            registered += 1
    assert registered == len(OP_NAMES) - len(CPU_ONLY)
