"""How a model's own files say text becomes token ids and where generation stops (torch-free).

One rule for every command that tokenizes or stops (``generate`` and its budget control, the
evaluation prompts, ``demo-real``, the data tools), read from the files beside a
``tokenizer.json`` exactly as transformers reads them, so a model behaves here as it does in
transformers:

- **prompt**: the tokenizer's own encoding *with* its special tokens: ``tokenizer.json``'s
  post-processor adds a BOS (or any prefix) exactly when the model's tokenizer does (transformers
  5 takes the post-processor of ``tokenizer.json`` and ignores ``add_bos_token`` beside it);
- **chat** (``--chat``): the model's chat template (``chat_template.jinja``, else
  ``tokenizer_config.json``'s ``chat_template``) rendered with one user message and the
  generation prompt, as ``apply_chat_template(..., add_generation_prompt=True)`` renders it
  (transformers' own renderer, with the named special tokens), then encoded without special
  tokens;
- **stop ids**: ``generation_config.json``'s ``eos_token_id`` (one id or a list), else
  ``config.json``'s, else the tokenizer's EOS: what transformers' ``generate`` stops at;
- **EOS** (what ends each built document): the tokenizer's ``eos_token``
  (``tokenizer_config.json`` / ``special_tokens_map.json``), else the first stop id, else a special
  token with a usual EOS name;
- **pad**: ``generation_config.json``'s ``pad_token_id``, else ``config.json``'s, else the
  tokenizer's ``pad_token``.

The built-in toy states its convention in its own files the same way (``data/tokenizer.py``:
``<eod>`` is its BOS, added by its post-processor, and its EOS), so no command special-cases it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "EOS_NAMES",
    "TOKENIZER_FILES",
    "TokenRule",
    "TokenRuleError",
    "read_token_rule",
]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
# the files of a model's tokenizer a directory carries (import copies them, exports write them)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    CHAT_TEMPLATE_FILE,
    "chat_template.json",
)
# special tokens that end a document in common Hub tokenizers, tried in this order when no file
# names the EOS
EOS_NAMES = (
    "</s>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<eos>",
    "<|im_end|>",
    "<|eot_id|>",
    "<eod>",
)
_NAMED = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenRuleError(ValueError):
    """A tokenizer directory whose files do not say what the rule needs (message names the file)."""


@dataclass(frozen=True)
class TokenRule:
    """What a tokenizer directory says (see the module docstring). ``backend`` is the
    ``tokenizers.Tokenizer`` of ``path``."""

    path: str
    eos_token: str
    eos_id: int
    eos_source: str
    stop_ids: tuple[int, ...]
    stop_source: str
    pad_token: str | None
    pad_id: int | None
    special_tokens: dict[str, str]
    chat_template: str | None
    chat_template_source: str | None
    backend: Any = field(repr=False, compare=False)

    @property
    def prefix_ids(self) -> list[int]:
        """What the tokenizer adds in front of a text (its BOS; [] when it adds none)."""
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        return full[: len(full) - len(plain)] if full[-len(plain) :] == plain else []

    def encode(self, text: str) -> list[int]:
        """``text`` as the model's tokenizer encodes a prompt (``tokenizer(text)``)."""
        return list(self.backend.encode(text, add_special_tokens=True).ids)

    def chat_text(self, text: str) -> str:
        """``text`` as one user turn of the chat template, ready for the reply."""
        if self.chat_template is None:
            raise TokenRuleError(
                f"{self.path}: no chat template beside it (no {CHAT_TEMPLATE_FILE}, no "
                "chat_template in tokenizer_config.json); --chat needs the model's template"
            )
        from transformers.utils.chat_template_utils import render_jinja_template

        # the named special tokens are template variables, as apply_chat_template passes them
        special: dict[str, Any] = dict(self.special_tokens)
        rendered: Any = render_jinja_template(
            conversations=[[{"role": "user", "content": text}]],
            chat_template=self.chat_template,
            add_generation_prompt=True,
            **special,
        )
        return str(rendered[0][0])

    def chat_ids(self, text: str) -> list[int]:
        """``apply_chat_template([user text], add_generation_prompt=True)``'s ids."""
        return list(self.backend.encode(self.chat_text(text), add_special_tokens=False).ids)

    def prompt_ids(self, text: str, chat: bool = False) -> list[int]:
        return self.chat_ids(text) if chat else self.encode(text)

    def summary(self) -> dict[str, Any]:
        """What the rule resolved to, for reports and ``generate --json``."""
        return {
            "tokenizer": self.path,
            "prefix_ids": self.prefix_ids,
            "eos": {"token": self.eos_token, "id": self.eos_id, "source": self.eos_source},
            "stop_ids": list(self.stop_ids),
            "stop_source": self.stop_source,
            "pad_id": self.pad_id,
            "chat_template": self.chat_template_source,
        }


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenRuleError(f"{path}: not readable JSON ({exc})") from None
    return data if isinstance(data, dict) else None


def _content(value: Any) -> str | None:
    """``"</s>"`` or ``{"content": "</s>", ...}`` (the two forms tokenizer files use)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int] | None:
    """A token id or a list of them (``eos_token_id``'s two forms); None when absent."""
    values = value if isinstance(value, list) else [value]
    ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return ids if ids and len(ids) == len(values) else None


def _chat_template(directory: Path, config: dict[str, Any]) -> tuple[str | None, str | None]:
    """The default chat template as transformers loads it: the separate file first."""
    file = directory / CHAT_TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8"), CHAT_TEMPLATE_FILE
    listed = _read_json(directory / "chat_template.json")
    if listed is not None and isinstance(listed.get("chat_template"), str):
        return listed["chat_template"], "chat_template.json"
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template, "tokenizer_config.json chat_template"
    return None, None


def read_token_rule(path: str | os.PathLike) -> TokenRule:
    """The rule of ``path`` (a ``tokenizer.json`` or a directory holding one)."""
    from tokenizers import Tokenizer

    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise TokenRuleError(f"--tokenizer {path}: no such file (a tokenizer.json)")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises plain Exceptions for bad files
        raise TokenRuleError(f"--tokenizer {file}: not a readable tokenizer.json ({exc})") from None
    directory = file.parent
    config = _read_json(directory / "tokenizer_config.json") or {}
    special_map = _read_json(directory / "special_tokens_map.json") or {}
    generation = _read_json(directory / "generation_config.json") or {}
    model_config = _read_json(directory / "config.json") or {}
    named = {}
    for key in _NAMED:
        value = _content(config.get(key))
        value = value if value is not None else _content(special_map.get(key))
        if value is not None:
            named[key] = value

    def check(token_id: int, where: str) -> int:
        if tok.id_to_token(token_id) is None:
            raise TokenRuleError(f"{directory / where}: token id {token_id} is not in {file}")
        return token_id

    stops, stop_source = _ids(generation.get("eos_token_id")), "generation_config.json eos_token_id"
    if stops is None:
        stops, stop_source = _ids(model_config.get("eos_token_id")), "config.json eos_token_id"
    stops = [check(i, stop_source.split()[0]) for i in stops] if stops else None

    eos, source = named.get("eos_token"), "tokenizer_config.json eos_token"
    if eos is not None and "eos_token" not in config:
        source = "special_tokens_map.json eos_token"
    if eos is None and stops:
        eos, source = tok.id_to_token(stops[0]), stop_source
    if eos is None:
        specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        eos = next((name for name in EOS_NAMES if name in specials), None)
        source = "the tokenizer's special tokens"
    if eos is None:
        raise TokenRuleError(
            f"--tokenizer {file}: no EOS token found (no eos_token in tokenizer_config.json, no "
            f"eos_token_id in generation_config.json or config.json, no special token among "
            f"{', '.join(EOS_NAMES)})"
        )
    eos_id = tok.token_to_id(eos)
    if eos_id is None:
        raise TokenRuleError(
            f"--tokenizer {file}: its EOS {eos!r} ({source}) is not in the vocabulary"
        )
    if not stops:
        stops, stop_source = [eos_id], f"the EOS ({source})"

    pad_id = _ids(generation.get("pad_token_id")) or _ids(model_config.get("pad_token_id"))
    pad = tok.id_to_token(pad_id[0]) if pad_id else named.get("pad_token")
    template, template_source = _chat_template(directory, config)
    return TokenRule(
        path=str(file),
        eos_token=eos,
        eos_id=eos_id,
        eos_source=source,
        stop_ids=tuple(dict.fromkeys(stops)),
        stop_source=stop_source,
        pad_token=pad,
        pad_id=tok.token_to_id(pad) if pad is not None else None,
        special_tokens=named,
        chat_template=template,
        chat_template_source=template_source,
        backend=tok,
    )
