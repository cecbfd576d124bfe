"""Where the model runs: a device this machine has (a CPU or a CUDA GPU), and whether its steps run as CUDA graphs."""

import torch

from tr_engine.errors import InvalidType, InvalidValue, UserError
from tr_engine.model.ops import is_compiled


def check_cuda_graphs(cuda_graphs: bool | None, device: torch.device, ops) -> bool:
    """Whether the engine runs its steps as CUDA graphs: by default wherever it can (a CUDA device and the compiled
    kernels, whose attention reads the prefix length on the device); asked for elsewhere, a one-line error."""
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise InvalidType(f"cuda_graphs must be True, False or None (where possible), got {type(cuda_graphs).__name__}")
    # the graphs' attention reads the prefix on the device: the compiled kernel's
    possible = device.type == "cuda" and is_compiled(ops, "tree_attention_dynamic")
    if cuda_graphs and not possible:
        why = "--device cuda" if device.type != "cuda" else "the compiled kernels (--ops kernels)"
        raise UserError(f"--cuda-graphs on needs {why}; drop the flag or pass --cuda-graphs off")
    return possible if cuda_graphs is None else cuda_graphs


def check_device(device) -> torch.device:
    """A CPU or a CUDA device this machine has; anything else (mps, xpu, a GPU index too high) is refused here
    rather than deep inside the first kernel."""
    if not isinstance(device, (str, torch.device)):
        raise InvalidType(f"device must be a string like 'cpu' or 'cuda:N', got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise InvalidValue(f"unknown device {str(device)!r}; use cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        raise InvalidValue(f"--device {device.type} is not supported; tr_engine runs on cpu or cuda[:N]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but this torch build has no CUDA device; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InvalidValue(f"--device {device} does not exist: this machine has {torch.cuda.device_count()} "
                               f"CUDA device(s), numbered from 0 to {torch.cuda.device_count() - 1}")
    return device
