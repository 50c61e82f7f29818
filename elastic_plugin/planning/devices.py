"""The device table: what a GPU offers the step-time and memory model.

Built in: H100 (SXM, 80 GB), H200, B200 and GB200 (one GPU of an NVL72). Figures are the
vendors' datasheet values for **dense** math (no 2:4 sparsity); bandwidths are per GPU and per
direction. ``nvlink_domain`` is how many GPUs share the NVLink fabric (a node for HGX systems,
the rack for NVL72): a group within it talks over NVLink, a larger one over the network.
A ``custom.yaml`` gives the same fields; every field is required and a bad one is named.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from elastic_plugin.models.config import ConfigError

__all__ = ["BUILTIN_DEVICES", "Device", "load_device"]


@dataclass(frozen=True)
class Device:
    """One GPU as the plan models it (units in the field names)."""

    name: str
    bf16_tflops: float  # dense BF16 tensor-core peak
    fp8_tflops: float  # dense FP8 tensor-core peak
    memory_gb: float  # HBM capacity, 1e9 bytes
    hbm_tbps: float  # HBM bandwidth, 1e12 bytes/s
    nvlink_gbps: float  # NVLink bandwidth per GPU per direction, 1e9 bytes/s
    network_gbps: float  # inter-node (InfiniBand / RoCE) bandwidth per GPU per direction, 1e9 B/s
    nvlink_domain: int  # GPUs that reach each other over NVLink

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# datasheets: H100 SXM5 / H200 SXM (NVLink 4: 900 GB/s bidirectional), HGX B200 and GB200 NVL72
# (NVLink 5: 1.8 TB/s bidirectional); one 400 Gb/s NIC per GPU (50 GB/s per direction)
BUILTIN_DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("h100", 989.0, 1979.0, 80.0, 3.35, 450.0, 50.0, 8),
        Device("h200", 989.0, 1979.0, 141.0, 4.8, 450.0, 50.0, 8),
        Device("b200", 2250.0, 4500.0, 180.0, 8.0, 900.0, 50.0, 8),
        Device("gb200", 2500.0, 5000.0, 186.0, 8.0, 900.0, 50.0, 72),
    )
}

_NUMBER_FIELDS = [f.name for f in fields(Device) if f.name not in ("name", "nvlink_domain")]


def load_device(spec: str) -> Device:
    """A built-in name (``h100``, ``h200``, ``b200``, ``gb200``) or a YAML file with every
    ``Device`` field; a missing, unknown or non-positive field raises ``ConfigError`` naming it."""
    key = spec.lower()
    if key in BUILTIN_DEVICES:
        return BUILTIN_DEVICES[key]
    path = Path(spec)
    if path.suffix not in (".yaml", ".yml") and not path.is_file():
        raise ConfigError(
            f"--gpu {spec!r}; allowed: {', '.join(BUILTIN_DEVICES)} or a YAML file with the "
            f"fields {', '.join(f.name for f in fields(Device))}"
        )
    if not path.is_file():
        raise ConfigError(f"--gpu {spec}: no such file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"--gpu {spec}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--gpu {spec}: the top level must be a mapping of the device fields")
    allowed = [f.name for f in fields(Device)]
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ConfigError(f"--gpu {spec}: unknown field(s) {', '.join(unknown)}; allowed: "
                          f"{', '.join(allowed)}")  # fmt: skip
    missing = [name for name in allowed if name not in raw and name != "name"]
    if missing:
        raise ConfigError(f"--gpu {spec}: missing field(s) {', '.join(missing)}")
    for name in _NUMBER_FIELDS:
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"--gpu {spec}: {name}={value!r}; allowed: a number > 0")
    domain = raw["nvlink_domain"]
    if isinstance(domain, bool) or not isinstance(domain, int) or domain < 1:
        raise ConfigError(f"--gpu {spec}: nvlink_domain={domain!r}; allowed: an integer >= 1")
    return Device(
        name=str(raw.get("name", path.stem)),
        **{name: float(raw[name]) for name in _NUMBER_FIELDS},
        nvlink_domain=domain,
    )
