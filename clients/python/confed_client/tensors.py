"""Tensors: safetensors <-> NumPy (F32, as confed's models and updates are), and PyTorch state
dicts on either side (PyTorch is optional: imported only when asked for)."""

from __future__ import annotations

from typing import Mapping

import numpy as np
from safetensors.numpy import load, save


def as_arrays(tensors: Mapping) -> dict[str, np.ndarray]:
    """A dict of F32 NumPy arrays from NumPy arrays, PyTorch tensors (a state dict: detached and
    moved to the CPU first) or anything `numpy.asarray` takes."""
    out = {}
    for name, value in tensors.items():
        if hasattr(value, "detach"):  # a torch.Tensor, possibly on a GPU or requiring grad
            value = value.detach().cpu().numpy()
        out[name] = np.ascontiguousarray(value, dtype=np.float32)
    return out


def to_torch(arrays: Mapping[str, np.ndarray]) -> dict:
    """A PyTorch state dict (float32 CPU tensors) from arrays; needs `pip install torch`."""
    import torch

    return {name: torch.from_numpy(np.array(value, dtype=np.float32, copy=True))
            for name, value in arrays.items()}


def from_safetensors(data: bytes) -> dict[str, np.ndarray]:
    return {name: np.asarray(array) for name, array in load(data).items()}


def to_safetensors(tensors: Mapping) -> bytes:
    """safetensors bytes of NumPy arrays or a PyTorch state dict (as F32)."""
    return save(as_arrays(tensors))
