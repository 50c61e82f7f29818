"""Pickles we cannot avoid are checked before anything unpickles them.

Our own files are data (safetensors + JSON: ``checkpoint.tensor_file``), but Megatron's dist
checkpoints still carry pickles that torch unpickles with no restriction:

* ``.metadata``: torch's ``FileSystemReader.read_metadata`` reads it with plain ``pickle.load``;
* the byte items of the ``.distcp`` files (``BytesStorageMetadata`` in ``.metadata``: Megatron's
  ``_extra_state``, Megatron-LM's common state with its ``args``, optimizer param groups, RNG
  state): torch's ``DefaultLoadPlanner.load_bytes`` reads them with ``torch.load(weights_only=
  False)``;
* ``common.pt`` of older Megatron-LM checkpoints, and any other ``*.pt`` / ``*.pkl`` file a
  checkpoint directory holds.

Each is checked here first: every global it names must be in :data:`ALLOWED_GLOBALS` (torch's
checkpoint metadata classes, tensors, storages, dtypes, plain containers, ``argparse.Namespace``
and the few enums and numpy helpers Megatron-LM's saved args and RNG state need); anything else
is an :class:`UnsafePickleError` (a ``ConfigError``: exit 2, ``PROG: error:`` naming the file
and the global) raised before the real load reads a byte, and a file that is not a well-formed
pickle is a ``ConfigError`` too.

How. The check runs CPython's own unpickler (``pickle.Unpickler``, every protocol) with its
documented ``find_class`` hook restricted ("Restricting Globals" in the pickle docs): every way
a pickle names a global (``GLOBAL``, ``STACK_GLOBAL``, ``INST``, ``OBJ``, ``EXT1/2/4``) goes
through that hook, so none is missed by construction, and an allowed global resolves to an
inert placeholder class, so nothing is imported and nothing the file names is called while it
is checked (it needs no torch: ``elastic-plugin verify`` reports it in seconds). The structure
the placeholders record is enough to find the byte items ``.metadata`` points at.

Why not the alternatives (measured on the elastic checkpoint of ``tests/test_safe_loading.py``'s
tiny model, a 148 KB ``.metadata``, with torch 2.14.1):

* torch's ``weights_only`` unpickler (``torch._weights_only_unpickler``) implements the opcodes
  of ``torch.save``'s protocol 2 only; ``.metadata`` is protocol 4 and stops at its first
  ``FRAME`` ("Unsupported operand 149"). Where it fits it is used: the tensor files we load
  ourselves in the old ``torch.save`` format load with ``torch.load(weights_only=True)`` after
  this check (:func:`load_torch_file`).
* picklescan 1.0.5 finds ``STACK_GLOBAL``'s names by looking back over the preceding opcodes,
  ignores ``EXT1/2/4``, and returns a clean result with no globals for bytes it cannot parse
  (tried: garbage and an ``EXT2`` pickle both pass), so it cannot tell a malformed file from a
  safe one; it took 1.06 s on that ``.metadata``.
* fickling 0.1.12 interprets the pickle symbolically into a Python AST: 6.6 s on it.
* this check: 9.6 ms (``pickle.loads`` of it: 8.7 ms). ``bench/bench_safe_load.py`` measures
  it against a whole load: the tiny and 4x-wide models load in 1.04x the time with it (the
  check alone, ``.metadata`` and 50 byte items: 17 and 20 ms, 9 to 12% of the load).

What it does not prove: that an allowed class is given sensible values (the loaders after it
validate those), or that the file is the one that was saved (the digests in
``elastic_meta.json``; ``checkpoint.integrity``). The file is read again by torch after the
check, so a writer racing the reader is outside this model.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_plugin.models.config import ConfigError

__all__ = [
    "ALLOWED_GLOBALS",
    "PickleReport",
    "UnsafePickleError",
    "check_checkpoint_pickles",
    "check_pickle_bytes",
    "check_torch_bytes",
    "check_torch_file",
    "forget_checked",
    "load_torch_file",
]

_DCP = "torch.distributed.checkpoint"
_DTYPES = (
    "float32 float64 float16 bfloat16 complex32 complex64 complex128 uint8 uint16 uint32 uint64 "
    "int8 int16 int32 int64 bool float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz "
    "float8_e8m0fnu float4_e2m1fn_x2 qint8 quint8 qint32 half float double long int short"
).split()
_STORAGES = (
    "Float Double Half BFloat16 Long Int Short Char Byte Bool ComplexFloat ComplexDouble "
    "QInt8 QUInt8 QInt32 QUInt4x2 QUInt2x4 Untyped"
).split()

ALLOWED_GLOBALS: frozenset[str] = frozenset(
    {
        # torch's dist-checkpoint metadata (what .metadata holds)
        f"{_DCP}.metadata.Metadata",
        f"{_DCP}.metadata.TensorStorageMetadata",
        f"{_DCP}.metadata.BytesStorageMetadata",
        f"{_DCP}.metadata.ChunkStorageMetadata",
        f"{_DCP}.metadata.TensorProperties",
        f"{_DCP}.metadata.MetadataIndex",
        f"{_DCP}.metadata.StorageMeta",
        f"{_DCP}.metadata._MEM_FORMAT_ENCODING",
        f"{_DCP}.filesystem._StorageInfo",
        f"{_DCP}.planner.SavePlan",
        f"{_DCP}.planner.WriteItem",
        f"{_DCP}.planner.WriteItemType",
        f"{_DCP}.planner.TensorWriteData",
        f"{_DCP}.planner.BytesIOWriteData",
        # tensors and storages as torch.save writes them (torch's weights_only defaults)
        "torch._utils._rebuild_tensor",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor_v3",
        "torch._utils._rebuild_parameter",
        "torch._utils._rebuild_parameter_with_state",
        "torch.nn.parameter.Parameter",
        "torch.serialization._get_layout",
        "torch.storage.UntypedStorage",
        "torch.storage.TypedStorage",
        "torch.Size",
        "torch.device",
        *(f"torch.{name}Storage" for name in _STORAGES),
        *(f"torch.{name}" for name in _DTYPES),
        "torch.contiguous_format",
        "torch.channels_last",
        "torch.preserve_format",
        # plain containers and values
        "collections.OrderedDict",
        "collections.Counter",
        "builtins.set",
        "builtins.frozenset",
        "builtins.complex",
        "builtins.bytearray",
        "builtins.slice",
        "_codecs.encode",
        "pathlib.PosixPath",  # StorageMeta.checkpoint_id of torch's own dcp.save
        "pathlib.PurePosixPath",
        # Megatron-LM's saved args and RNG state
        "argparse.Namespace",
        "signal.Signals",  # Megatron-LM's --exit-signal
        # Megatron-LM's rerun_state_machine_state (enums)
        "megatron.core.rerun_state_machine.RerunDiagnostic",
        "megatron.core.rerun_state_machine.RerunMode",
        "megatron.core.rerun_state_machine.RerunState",
        "megatron.core.rerun_state_machine.RerunValidationStatus",
        "numpy.dtype",
        "numpy.ndarray",
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
    }
)
# modules whose every top-level class may appear: Megatron-Core's enums (Megatron-LM's saved
# args hold their members) and numpy's dtype classes (numpy >= 1.25 pickles dtypes by class)
ALLOWED_CLASS_MODULES: frozenset[str] = frozenset(
    {"megatron.core.enums", "megatron.core.transformer.enums", "numpy.dtypes"}
)

_TORCH_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle")
_ZIP_MAGIC = b"PK\x03\x04"


class UnsafePickleError(ConfigError):
    """A pickle names a global outside :data:`ALLOWED_GLOBALS`: refused before it is loaded."""

    def __init__(self, where: str, global_name: str) -> None:
        self.where, self.global_name = where, global_name
        super().__init__(
            f"{where}: refused to load: the pickle references {global_name}, which is not "
            f"on the allowlist of what checkpoints hold (tensors, torch's checkpoint "
            f"metadata, plain containers); loading it could run code "
            f"(elastic_plugin/checkpoint/safe_pickle.py)"
        )


def is_allowed(name: str) -> bool:
    """Whether ``module.qualname`` may appear in a checkpoint's pickle."""
    if name in ALLOWED_GLOBALS:
        return True
    module, _, attr = name.rpartition(".")
    return module in ALLOWED_CLASS_MODULES and attr[:1].isupper()


class _Inert:
    """What an allowed global becomes during the check: accepts any arguments and state and
    records them, runs nothing. ``_name`` is the global it stands for."""

    _name = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args = args

    def __setstate__(self, state: Any) -> None:
        """BUILD: a dict (or ``(dict, slots)``) becomes fields, as pickle would set them."""
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:
            if isinstance(part, dict):
                self.__dict__.update({k: v for k, v in part.items() if isinstance(k, str)})
            elif part is not None:
                self.__dict__["_state"] = part

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("_items", {})[key] = value

    def append(self, value: Any) -> None:
        self.__dict__.setdefault("_list", []).append(value)

    def extend(self, values: Any) -> None:
        self.__dict__.setdefault("_list", []).extend(values)


class _CheckingUnpickler(pickle.Unpickler):
    """CPython's unpickler with every global checked and replaced by an :class:`_Inert`."""

    def __init__(self, file: Any, where: str, persistent: bool) -> None:
        super().__init__(file)
        self.where, self.persistent = where, persistent
        self.names: set[str] = set()
        self.classes: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if not is_allowed(full):
            raise UnsafePickleError(self.where, full)
        self.names.add(full)
        if full not in self.classes:
            self.classes[full] = type(name, (_Inert,), {"_name": full})
        return self.classes[full]

    def persistent_load(self, pid: Any) -> Any:
        if not self.persistent:  # plain pickle.load has no persistent_load: it would fail too
            raise pickle.UnpicklingError("a persistent id in a plain pickle")
        return _Inert(pid)


def _parse(data: bytes | io.BytesIO, where: str, persistent: bool) -> tuple[Any, set[str], int]:
    """Check one pickle: (its inert structure, the globals it names, bytes consumed)."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    start = stream.tell()
    unpickler = _CheckingUnpickler(stream, where, persistent)
    try:
        value = unpickler.load()
    except UnsafePickleError:
        raise
    except (Exception, RecursionError) as exc:  # any malformation: truncated, bad opcode, ...
        raise ConfigError(
            f"{where}: not a well-formed pickle ({type(exc).__name__}: {str(exc)[:160]}); "
            "the file is damaged or was not written by torch / Megatron"
        ) from None
    return value, unpickler.names, stream.tell() - start


def check_pickle_bytes(data: bytes, where: str) -> Any:
    """Check a plain pickle (``.metadata``); returns its inert structure."""
    return _parse(data, where, persistent=False)[0]


def check_torch_bytes(data: bytes, where: str) -> set[str]:
    """Check what ``torch.load`` would unpickle from ``data`` (a ``torch.save`` zip archive:
    every ``.pkl`` record; duplicate record names are refused, since two zip readers could pick
    different ones). Returns the globals named. The legacy (non-zip) format is refused."""
    if not data.startswith(_ZIP_MAGIC):
        if not data:
            raise ConfigError(f"{where}: empty file")
        raise ConfigError(
            f"{where}: not a torch.save zip archive (the pre-1.6 legacy format, or not torch's "
            "at all); it is not read"
        )
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = archive.namelist()
        if len(set(names)) != len(names):
            raise ConfigError(f"{where}: the archive holds the same record twice; refused")
        pickles = [n for n in names if n.endswith(".pkl")]
        if not pickles:
            raise ConfigError(f"{where}: a zip archive without torch's data.pkl")
        found: set[str] = set()
        for name in pickles:
            found |= _parse(archive.read(name), f"{where} ({name})", persistent=True)[1]
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where}: not a readable torch.save archive ({exc})") from None
    return found


def check_torch_file(path: str | Path) -> set[str]:
    """:func:`check_torch_bytes` of a file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: not readable ({exc})") from None
    return check_torch_bytes(data, str(path))


def load_torch_file(path: str | Path) -> Any:
    """A ``torch.save`` file read safely: checked here, then ``torch.load(weights_only=True)``
    (torch's own allowlist of tensors and containers, on CPU)."""
    import torch

    check_torch_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the check passed, but torch's weights_only unpickler refuses
        raise ConfigError(f"{path}: not loadable as tensors and plain data ({exc})") from None


# ------------------------------------------------------------------------ checkpoints
@dataclass
class PickleReport:
    """What :func:`check_checkpoint_pickles` checked: files and byte items, and every global
    they name (all on the allowlist, or it would have raised)."""

    files: int = 0
    byte_items: int = 0
    globals: set[str] = field(default_factory=set)


def _attr(obj: Any, name: str) -> Any:
    """A field of an inert dataclass instance (set by BUILD from its ``__dict__`` state)."""
    return obj.__dict__.get(name) if isinstance(obj, _Inert) else None


def _byte_items(metadata: Any, where: str) -> Iterator[tuple[str, str, int, int]]:
    """(fqn, relative file, offset, length) of every byte item ``.metadata`` lists."""
    state = _attr(metadata, "state_dict_metadata")
    storage = _attr(metadata, "storage_data")
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise ConfigError(f"{where}: not torch's dist-checkpoint Metadata")
    byte_fqns = {
        fqn
        for fqn, entry in state.items()
        # the class it was built from (never an instance field: BUILD state could set one)
        if getattr(type(entry), "_name", "") == f"{_DCP}.metadata.BytesStorageMetadata"
    }
    for index, info in storage.items():
        fqn = _attr(index, "fqn")
        if fqn not in byte_fqns:
            continue
        rel, offset, length = (_attr(info, k) for k in ("relative_path", "offset", "length"))
        if not (isinstance(rel, str) and isinstance(offset, int) and isinstance(length, int)):
            raise ConfigError(f"{where}: the byte item {fqn!r} has no valid location")
        if _attr(info, "transform_descriptors"):
            raise ConfigError(
                f"{where}: the byte item {fqn!r} is stored transformed (compressed); it "
                "cannot be checked before loading, so it is not read"
            )
        yield str(fqn), rel, offset, length


# directories this process has checked, keyed by every file's (name, size, mtime, ctime, inode):
# loading the same unchanged checkpoint again (model, then optimizer, then router) checks once
_CHECKED: dict[tuple[Any, ...], PickleReport] = {}


def _signature(root: Path) -> tuple[Any, ...] | None:
    try:
        stats = tuple(
            (p.name, (st := p.stat()).st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
            for p in sorted(root.iterdir())
            if p.is_file()
        )
    except OSError:
        return None
    return (str(root.resolve()), stats)


def forget_checked() -> None:
    """Check everything again on the next load, as a fresh process does (benchmarks, tests)."""
    _CHECKED.clear()


def check_checkpoint_pickles(directory: str | Path, use_cache: bool = True) -> PickleReport:
    """Check every pickle torch and Megatron would unpickle from a checkpoint directory: each
    ``*.metadata``, the byte items it lists in the ``.distcp`` files, and each ``*.pt`` /
    ``*.pkl`` file. Torch-free. Raises :class:`UnsafePickleError` naming the file (and item)
    and the global, or ``ConfigError`` for a malformed one."""
    root = Path(directory)
    if not root.is_dir():
        return PickleReport()
    signature = _signature(root) if use_cache else None
    if signature is not None and signature in _CHECKED:
        return _CHECKED[signature]
    report = _check_directory(root)
    if signature is not None:
        _CHECKED[signature] = report
    return report


def _check_directory(root: Path) -> PickleReport:
    report = PickleReport()
    for path in sorted(root.iterdir()):
        if not path.is_file():
            continue
        if path.name.endswith(".metadata"):
            metadata, names, _ = _parse(path.read_bytes(), str(path), persistent=False)
            report.files += 1
            report.globals |= names
            for fqn, rel, offset, length in _byte_items(metadata, str(path)):
                report.globals |= _check_byte_item(root, fqn, rel, offset, length)
                report.byte_items += 1
        elif path.suffix in _TORCH_SUFFIXES:
            report.globals |= check_torch_file(path)
            report.files += 1
    return report


def _check_byte_item(root: Path, fqn: str, rel: str, offset: int, length: int) -> set[str]:
    where = f"{root / rel} (item {fqn})"
    target = (root / rel).resolve()
    if target.parent != root.resolve() or not target.is_file():
        raise ConfigError(f"{where}: .metadata points outside the checkpoint or at no file")
    size = target.stat().st_size
    if offset < 0 or length < 0 or offset + length > size:
        raise ConfigError(
            f"{where}: .metadata places it at bytes {offset}..{offset + length}, past the "
            f"file's {size} bytes"
        )
    with open(target, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    return check_torch_bytes(data, where)
