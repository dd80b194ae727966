"""PyTorch state dicts in, as the partner's model or a device's update. PyTorch is not installed
in CI (its wheels are gigabytes); these use an object with a tensor's interface (`detach`,
`cpu`, `numpy`), which is all the conversion touches."""

from __future__ import annotations

import numpy as np

from confed_client import as_arrays, from_safetensors, to_safetensors


class TensorLike:
    """What `as_arrays` uses of a torch.Tensor: detach() -> cpu() -> numpy()."""

    def __init__(self, values):
        self.values = np.asarray(values, dtype=np.float64)
        self.calls = []

    def detach(self):
        self.calls.append("detach")
        return self

    def cpu(self):
        self.calls.append("cpu")
        return self

    def numpy(self):
        self.calls.append("numpy")
        return self.values


def test_a_state_dict_becomes_f32_arrays_detached_on_the_cpu():
    weight = TensorLike([[1.5, -2.0], [0.25, 4.0]])
    arrays = as_arrays({"weight": weight, "bias": np.array([1, 2])})
    assert weight.calls == ["detach", "cpu", "numpy"]
    assert arrays["weight"].dtype == np.float32 and arrays["bias"].dtype == np.float32
    np.testing.assert_array_equal(arrays["weight"], [[1.5, -2.0], [0.25, 4.0]])


def test_a_state_dict_round_trips_through_safetensors():
    data = to_safetensors({"layer.weight": TensorLike(np.arange(6).reshape(2, 3))})
    back = from_safetensors(data)
    np.testing.assert_array_equal(back["layer.weight"], np.arange(6).reshape(2, 3))
