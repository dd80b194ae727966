"""Python clients for confed (docs/protocol.md, docs/api.md)."""

from .device import Device, DeviceError, TrainingProblem, Trust, well_formed_update
from .envelope import aad, encode_envelope, info, open_envelope, seal
from .errors import ConfedError
from .partner import Partner, PartnerError, TaskEnded
from .policy import PolicyError, check_policy, parse_policy
from .release import ReleaseError, verify_release
from . import analytics
from .simulation import (AnalyticsRound, RoundResult, SimulationError, run_analytics,
                         run_simulation)
from .tensors import as_arrays, from_safetensors, to_safetensors, to_torch
from . import tokens
from .tokens import (AndroidKeyAttestation, AppAttestInvalidKey, AppAttestServerUnavailable,
                     AppleAppAttest, DevAttestation)

__all__ = [
    "AnalyticsRound",
    "ConfedError",
    "AndroidKeyAttestation",
    "AppleAppAttest",
    "AppAttestInvalidKey",
    "AppAttestServerUnavailable",
    "DevAttestation",
    "Device",
    "DeviceError",
    "TrainingProblem",
    "Trust",
    "Partner",
    "PartnerError",
    "PolicyError",
    "ReleaseError",
    "RoundResult",
    "SimulationError",
    "TaskEnded",
    "aad",
    "as_arrays",
    "check_policy",
    "encode_envelope",
    "from_safetensors",
    "info",
    "open_envelope",
    "parse_policy",
    "seal",
    "run_analytics",
    "run_simulation",
    "analytics",
    "to_safetensors",
    "to_torch",
    "tokens",
    "verify_release",
    "well_formed_update",
]
