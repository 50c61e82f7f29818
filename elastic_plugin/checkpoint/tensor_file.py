"""The plugin's own tensor files (importance scores, permutations, partial importance state):
safetensors plus JSON, so reading one never runs code.

A file is one safetensors archive: named tensors, and in its header's ``__metadata__`` the
format's name (``elastic_plugin.format``), its version and a JSON document of everything that
is not a tensor. safetensors' header is JSON with declared sizes and offsets that the library
checks against the file (no pickle, no code). Files of the old format (``torch.save`` zip
archives) still load, through ``checkpoint.safe_pickle.load_torch_file`` (an allowlist check,
then ``torch.load(weights_only=True)``). Anything else is a ``ConfigError`` naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_plugin.models.config import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "TensorFile",
    "layer_key",
    "layers_from",
    "read_tensor_file",
    "write_tensor_file",
]

FORMAT_KEY = "elastic_plugin.format"
VERSION_KEY = "elastic_plugin.version"
INFO_KEY = "elastic_plugin.info"
_ZIP_MAGIC = b"PK\x03\x04"


class TensorFile:
    """What :func:`read_tensor_file` found: tensors by name and the JSON document (``legacy``:
    the old ``torch.save`` object, when the file is one)."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], info: dict[str, Any], legacy: Any = None
    ) -> None:
        self.tensors, self.info, self.legacy = tensors, info, legacy


def layer_key(prefix: str, layer: int) -> str:
    """The tensor name of ``prefix``'s entry for ``layer`` (``ffn/3``)."""
    return f"{prefix}/{layer}"


def layers_from(
    tensors: Mapping[str, torch.Tensor], prefix: str, where: str
) -> dict[int, torch.Tensor]:
    """``{layer: tensor}`` of every tensor named ``prefix/<int>``."""
    out: dict[int, torch.Tensor] = {}
    for name, tensor in tensors.items():
        head, _, tail = name.rpartition("/")
        if head != prefix:
            continue
        if not tail.lstrip("-").isdigit():
            raise ConfigError(f"{where}: tensor {name!r}: the layer must be an integer")
        out[int(tail)] = tensor
    return dict(sorted(out.items()))


def write_tensor_file(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor],
    info: Mapping[str, Any],
    kind: str,
    version: int,
) -> Path:
    """Write atomically (temporary file + rename): ``tensors`` (made contiguous, CPU, unshared)
    and ``info`` (JSON-serializable) as format ``kind`` version ``version``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    header = {
        FORMAT_KEY: kind,
        VERSION_KEY: str(version),
        INFO_KEY: json.dumps(dict(info), default=str),
    }
    save_file(
        {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(tmp), header
    )
    tmp.replace(path)
    return path


def read_tensor_file(path: str | Path, kind: str, version: int, what: str) -> TensorFile:
    """Read a file of format ``kind``/``version`` written by :func:`write_tensor_file`, or an
    old ``torch.save`` one (``TensorFile.legacy``). ``what`` names the file in errors (``--scores
    importance.pt``). A ConfigError for anything else: no such file, a malformed header, another
    format or version, a JSON document that is not an object."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    where = f"{what} ({path})" if str(path) not in what else what
    if not path.is_file():
        raise ConfigError(f"{where}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == _ZIP_MAGIC:
        from elastic_plugin.checkpoint.safe_pickle import load_torch_file

        try:
            legacy = load_torch_file(path)
        except ConfigError as exc:  # the old pickle format: refused unless it is plain data
            raise ConfigError(
                f"{what} (the old torch.save format): {exc}; write it again with this "
                "version of elastic-plugin"
            ) from None
        return TensorFile({}, {}, legacy=legacy)
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"{where}: not a safetensors file of {kind} ({str(exc)[:160]}); write it again "
            f"with this version of elastic-plugin"
        ) from None
    if header.get(FORMAT_KEY) != kind:
        raise ConfigError(
            f"{where}: holds {header.get(FORMAT_KEY) or 'no elastic_plugin format'!s:.60}, "
            f"not {kind}"
        )
    if header.get(VERSION_KEY) != str(version):
        raise ConfigError(
            f"{where}: {kind} version {header.get(VERSION_KEY)!s:.20}; this version reads "
            f"{version} (write it again with this version of elastic-plugin)"
        )
    try:
        info = json.loads(header.get(INFO_KEY, "{}"))
    except ValueError as exc:
        raise ConfigError(f"{where}: its {INFO_KEY} is not JSON ({exc})") from None
    if not isinstance(info, dict):
        raise ConfigError(f"{where}: its {INFO_KEY} is not a JSON object")
    return TensorFile(tensors, info)
