"""Incremental generation for Megatron-Core hybrid models (Mamba-2 / attention / MLP / MoE).

``prefill`` / ``decode_step`` / ``extend`` / ``extend_ragged`` run a plain ``HybridModel`` with a KV cache for
attention layers and conv + SSM state caches for Mamba layers (``InferenceCache``);
``generate`` does batched greedy or seeded sampling generation with stop tokens;
``recompute_generate`` is the cache-free reference (a full forward per token);
``budget_control_generate`` thinks with a small nested model and answers with a larger one;
``capped_thinking_generate`` is the standard baseline (one model, thinking capped).
The models to run come from ``nested.model`` (one budget's plain model).
"""

from elastic_plugin.inference.budget_control import (
    BudgetControlResult,
    budget_control_generate,
    capped_thinking_generate,
)
from elastic_plugin.inference.cache import InferenceCache
from elastic_plugin.inference.generate import GenerationResult, generate
from elastic_plugin.inference.reference import full_logits, recompute_generate
from elastic_plugin.inference.sampling import Sampler
from elastic_plugin.inference.steps import decode_step, extend, extend_ragged, prefill

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
