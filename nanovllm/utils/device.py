"""What the machine offers, asked of torch only when asked: importing this module (and Config, which
uses it) imports no torch, so that the engine's bookkeeping can be imported and tested without it."""


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def gpu_total_memory() -> int:
    """Bytes of memory on the current CUDA device."""
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
