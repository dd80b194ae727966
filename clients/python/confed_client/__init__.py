"""Python clients for confed (docs/protocol.md, docs/api.md)."""

from .device import Device, DeviceError, Trust
from .envelope import aad, encode_envelope, info, open_envelope, seal
from .partner import Partner, PartnerError
from .policy import PolicyError, check_policy, parse_policy
from .release import ReleaseError, verify_release
from .tensors import from_safetensors, to_safetensors

__all__ = [
    "Device",
    "DeviceError",
    "Trust",
    "Partner",
    "PartnerError",
    "PolicyError",
    "ReleaseError",
    "aad",
    "check_policy",
    "encode_envelope",
    "from_safetensors",
    "info",
    "open_envelope",
    "parse_policy",
    "seal",
    "to_safetensors",
    "verify_release",
]
