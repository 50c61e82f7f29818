"""transformers' bookkeeping in ``config.json``: the fields no family reads, stated once
(torch-free).

Why: transformers writes its own base-class fields next to a model's architecture (the 5.x
``PreTrainedConfig`` fields, and in 4.x files also its generation defaults), every field whose
name starts with an underscore (``_name_or_path``, ``_commit_hash``, ``_attn_implementation``,
``_model_name_or_path`` from its GGUF loader ...) and special token ids. None of them changes
what the model computes from tokens, so every family drops them here before it maps the rest;
a field that is not bookkeeping still has to be mapped, checked or named harmless by its family,
or the import is refused naming it. The few base-class fields that do change the function
(:data:`FUNCTION_BASE`) are checked here instead, by name.

``tests/test_hub_configs.py`` checks that :data:`BASE_FIELDS` covers the installed
transformers' ``PreTrainedConfig`` fields, so a new release's bookkeeping is noticed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elastic_plugin.families.base import refuse

__all__ = ["BASE_FIELDS", "FUNCTION_BASE", "is_bookkeeping", "without_bookkeeping"]

# transformers' PreTrainedConfig base fields: 5.x's, and those 4.x wrote (its generation
# defaults and legacy switches); the architecture's own fields are the family's business
BASE_FIELDS = frozenset(
    {
        # 5.x PreTrainedConfig (its __init__ and to_dict)
        "transformers_version",
        "architectures",
        "model_type",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "dtype",
        "chunk_size_feed_forward",
        "id2label",
        "label2id",
        "problem_type",
        # 4.x PretrainedConfig: storage, outputs, tasks, tokenizer
        "torch_dtype",
        "use_bfloat16",
        "torchscript",
        "tf_legacy_loss",
        "finetuning_task",
        "num_labels",
        "task_specific_params",
        "tokenizer_class",
        "prefix",
        "is_decoder",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        "attn_implementation",
        # 4.x PretrainedConfig: generation defaults (generation_config.json holds them now)
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
    }
)

# base-class fields that do change the function: checked, not ignored (field -> allowed, why)
FUNCTION_BASE: dict[str, tuple[Any, str]] = {
    "is_encoder_decoder": (False, "decoder-only models"),
    "add_cross_attention": (False, "decoder-only models have no cross-attention"),
    "pruned_heads": ({}, "every attention head is kept (no pruned heads)"),
}


def is_bookkeeping(field: str) -> bool:
    """Whether ``field`` is transformers' bookkeeping: a base-class field, a leading-underscore
    field or a special token id (``bos_token_id``, ``unk_token_id`` ...: the tokenizer's)."""
    return field.startswith("_") or field in BASE_FIELDS or field.endswith("_token_id")


def without_bookkeeping(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``raw`` less transformers' bookkeeping; a function-changing base field with another value
    than the one our models compute is refused naming it."""
    for field, (allowed, why) in FUNCTION_BASE.items():
        value = raw.get(field)
        if value not in (None, allowed):
            raise refuse(source, field, value, repr(allowed), why)
    return {k: v for k, v in raw.items() if k not in FUNCTION_BASE and not is_bookkeeping(k)}
