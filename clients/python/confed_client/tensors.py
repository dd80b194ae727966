"""safetensors <-> NumPy (F32 tensors, as confed's models and updates are)."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import load, save


def from_safetensors(data: bytes) -> dict[str, np.ndarray]:
    return {name: np.asarray(array) for name, array in load(data).items()}


def to_safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    return save({name: np.ascontiguousarray(array, dtype=np.float32)
                 for name, array in tensors.items()})
