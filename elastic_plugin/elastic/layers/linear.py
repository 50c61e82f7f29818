"""Megatron parallel linears on an active sub-block of their weight: the GEMM really shrinks.

Megatron's ``ColumnParallelLinear``/``RowParallelLinear`` always multiply by the whole local
weight. An elastic model at a smaller budget only needs some output rows (e.g. the first FFN
neurons, the active query heads) and some input columns (the first hidden channels). These
functions run the same communication pattern as Megatron's own forwards (copy-to / all-gather
for sequence parallel in, all-reduce / reduce-scatter out, nothing for expert linears) on the
selected block. A prefix is taken as a strided view (no copy: BLAS reads it in place); a
scattered index set (heads nested per query group) is gathered, which costs the active weight's
size, not the full one. Gradients reach the full parameter through autograd, so Megatron's DDP
hooks and optimizers see an ordinary (partly zero) gradient.

Inside ``elastic.layers.fp8.fp8_gemm`` the same communication runs around an FP8 GEMM of the active
block (``elastic.layers.fp8``) instead of Megatron's ``_forward_impl``.
"""

from __future__ import annotations

import torch

from elastic_plugin.elastic.layers import fp8
from elastic_plugin.models.prefix import Index


def select(tensor: torch.Tensor, dim: int, index: Index) -> torch.Tensor:
    """The active part of ``tensor`` along ``dim`` (a view for prefixes)."""
    if index is None:
        return tensor
    if isinstance(index, int):
        if index == tensor.shape[dim]:
            return tensor
        return tensor.narrow(dim, 0, index)
    return tensor.index_select(dim, index.to(tensor.device))


def active_weight(weight: torch.Tensor, out_index: Index, in_index: Index) -> torch.Tensor:
    return select(select(weight, 0, out_index), 1, in_index)


def _bias_parts(module, out_index: Index):
    """(bias added inside, bias returned) with Megatron's ``skip_bias_add`` convention."""
    bias = getattr(module, "bias", None)
    if bias is None:
        return None, None
    bias = select(bias, 0, out_index)
    return (None, bias) if module.skip_bias_add else (bias, None)


def column_parallel_forward(
    module,
    input_: torch.Tensor,
    out_index: Index = None,
    in_index: Index = None,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``ColumnParallelLinear.forward`` on rows ``out_index`` (local) and columns ``in_index``.

    ``input_`` already holds only the active input columns. ``weight``: the full weight to cut
    from when it is not the module's own (a tied output layer gets the word embeddings from
    Megatron, as ``ColumnParallelLinear.forward(weight=...)`` does). ``gather_output`` is not
    supported for a partial output (an elastic model keeps column outputs sharded, as Megatron's
    GPT does).
    """
    if module.gather_output and out_index is not None:
        raise NotImplementedError(
            f"{type(module).__name__} with gather_output=True cannot produce a partial output"
        )
    if weight is None:
        weight = module.weight
        if weight is None:
            raise ValueError(
                f"{type(module).__name__} holds no weight (tied embeddings): pass the "
                "embedding weight Megatron passes to its forward"
            )
    weight = active_weight(weight, out_index, in_index)
    bias_in, bias_out = _bias_parts(module, out_index)
    if fp8.runs_fp8(module):
        output = _fp8_column(module, input_, weight)
        if bias_in is not None:
            output = output + bias_in
    else:
        output = _megatron_column(module, input_, weight, bias_in)
    if module.gather_output:
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        output = gather_from_tensor_model_parallel_region(output, group=module.tp_group)
    return output, bias_out


def _megatron_column(
    module, input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Megatron's own GEMM + communication (``_forward_impl``) on the active block."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    if (
        module.allreduce_dgrad
        or module.sequence_parallel
        or module.explicit_expert_comm
        or getattr(module, "disable_grad_reduce", False)
    ):
        input_parallel = input_
    else:
        input_parallel = copy_to_tensor_model_parallel_region(input_, group=module.tp_group)
    return module._forward_impl(
        input=input_parallel,
        weight=weight,
        bias=bias,
        # a slice of a parameter has no main_grad: let autograd route the gradient
        gradient_accumulation_fusion=module.gradient_accumulation_fusion
        and weight is module.weight,
        allreduce_dgrad=False if module.explicit_expert_comm else module.allreduce_dgrad,
        sequence_parallel=False if module.explicit_expert_comm else module.sequence_parallel,
        grad_output_buffer=None,
        wgrad_deferral_limit=None,
        tp_group=module.tp_group,
    )


def _fp8_column(module, input_: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The column-parallel GEMM in FP8, with the input communication Megatron's
    ``_forward_impl`` would do (copy-to-TP: all-reduce of the input gradient; or the
    sequence-parallel all-gather, whose backward is a reduce-scatter)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if module.explicit_expert_comm or getattr(module, "disable_grad_reduce", False):
        input_parallel = input_
    elif module.sequence_parallel:
        input_parallel = gather_from_sequence_parallel_region(
            input_, tensor_parallel_output_grad=True, group=module.tp_group
        )
    else:
        input_parallel = copy_to_tensor_model_parallel_region(input_, group=module.tp_group)
    recipe = fp8.active_recipe()
    assert recipe is not None  # called only where fp8.runs_fp8(module)
    return fp8.fp8_linear(input_parallel, weight, recipe, module.tp_group)


def row_parallel_forward(
    module, input_: torch.Tensor, out_index: Index = None, in_index: Index = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``RowParallelLinear.forward`` on rows ``out_index`` and (local) columns ``in_index``.

    ``input_`` is this rank's shard of the active input columns; the output is reduced over TP
    (all-reduce, or reduce-scatter under sequence parallelism) at the active width.
    """
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
        scatter_to_tensor_model_parallel_region,
    )

    if module.input_is_parallel:
        input_parallel = input_
    else:
        input_parallel = scatter_to_tensor_model_parallel_region(input_, group=module.tp_group)
    weight = active_weight(module.weight, out_index, in_index)
    if fp8.runs_fp8(module):
        recipe = fp8.active_recipe()
        assert recipe is not None  # runs_fp8: a recipe is active
        output = fp8.fp8_linear(
            input_parallel,
            weight,
            recipe,
            module.tp_group,
            x_sharded=True,
            w_sharded=True,
        )
    else:
        output = module._forward_impl(
            input=input_parallel,
            weight=weight,
            bias=None,
            gradient_accumulation_fusion=module.gradient_accumulation_fusion
            and weight is module.weight,
            allreduce_dgrad=False,
            sequence_parallel=False,
            tp_group=module.tp_group,  # unused without SP/all-reduce; avoids Megatron's deprecation
            grad_output_buffer=None,
        )
    if module.explicit_expert_comm:
        pass
    elif module.sequence_parallel:
        output = reduce_scatter_to_sequence_parallel_region(output, group=module.tp_group)
    else:
        output = reduce_from_tensor_model_parallel_region(output, group=module.tp_group)
    bias = getattr(module, "bias", None)
    if bias is None:
        return output, None
    bias = select(bias, 0, out_index)
    if module.skip_bias_add:
        return output, bias
    return output + bias, None
