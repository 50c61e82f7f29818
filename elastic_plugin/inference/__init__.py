"""Incremental generation for Megatron-Core hybrid models (Mamba-2 / attention / MLP / MoE).

``prefill`` / ``decode_step`` / ``extend`` / ``extend_ragged`` run a plain ``HybridModel`` with a KV cache for
attention layers and conv + SSM state caches for Mamba layers (``InferenceCache``);
``generate`` does batched greedy or seeded sampling generation with stop tokens;
``recompute_generate`` is the cache-free reference (a full forward per token);
``budget_control_generate`` thinks with a small nested model and answers with a larger one;
``capped_thinking_generate`` is the standard baseline (one model, thinking capped).
The models to run come from ``nested.model`` (one budget's plain model).

The names are resolved on first use, so that ``elastic-plugin``'s argument parsing (which imports
``inference.cli``) imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_plugin.compat.lazy import lazy_exports

_EXPORTS = {
    "BudgetControlResult": "budget_control",
    "budget_control_generate": "budget_control",
    "capped_thinking_generate": "budget_control",
    "InferenceCache": "cache",
    "GenerationResult": "generation",
    "generate": "generation",
    "full_logits": "reference",
    "recompute_generate": "reference",
    "Sampler": "sampling",
    "decode_step": "steps",
    "extend": "steps",
    "extend_ragged": "steps",
    "prefill": "steps",
}
__all__ = [
    "BudgetControlResult",
    "GenerationResult",
    "InferenceCache",
    "Sampler",
    "budget_control_generate",
    "capped_thinking_generate",
    "decode_step",
    "extend",
    "extend_ragged",
    "full_logits",
    "generate",
    "prefill",
    "recompute_generate",
]

if TYPE_CHECKING:
    from elastic_plugin.inference.budget_control import (
        BudgetControlResult,
        budget_control_generate,
        capped_thinking_generate,
    )
    from elastic_plugin.inference.cache import InferenceCache
    from elastic_plugin.inference.generation import GenerationResult, generate
    from elastic_plugin.inference.reference import full_logits, recompute_generate
    from elastic_plugin.inference.sampling import Sampler
    from elastic_plugin.inference.steps import decode_step, extend, extend_ragged, prefill

__getattr__ = lazy_exports(__name__, _EXPORTS)
