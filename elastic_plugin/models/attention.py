"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (no TE needed).

Why: Megatron's non-TE ``DotProductAttention`` materialises the ``[b, heads, sq, sk]`` scores,
their softmax and its gradient, so memory grows with the square of the sequence length (8K tokens
x 8 heads is 2 GiB per copy in FP32). SDPA's flash / memory-efficient kernels (on a GPU, and the
flash kernel on a CPU) never hold them. :class:`SDPAAttention` is a drop-in ``core_attention``
for the local spec: the same constructor and forward signatures, the same result as
``DotProductAttention`` (causal or explicit boolean masks, GQA, softmax scale, query-key layer
scaling, attention dropout under Megatron's RNG tracker) and no parameters, so checkpoints keep
their keys.

The head counts are read from the tensors, not from ``num_attention_heads_per_partition``: the
elastic attention (``elastic.layers.modules._heads_active``) runs fewer query heads per group for
one forward by feeding fewer query heads (and sets the attributes, which stay here for it and for
code that reads them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from torch import Tensor
from torch.nn.attention import SDPBackend


def _torch_has_native_gqa() -> bool:
    """``enable_gqa`` arrived in torch 2.5; older versions repeat K/V instead."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


_NATIVE_GQA = _torch_has_native_gqa()
_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding, AttnMaskType.no_mask)


def _native_gqa_is_fused(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, dropout_p: float, causal: bool
) -> bool:
    """Whether ``enable_gqa=True`` keeps these inputs on a fused (non-materialising) kernel.

    Not every kernel takes grouped K/V (CUDA's memory-efficient one does not, so a GQA call
    with an explicit mask would fall back to the math kernel, which builds the full scores);
    repeating K/V (linear in the sequence length) then lets the fused kernel run. Torch's own
    dispatcher answers the question where it is exposed; otherwise assume only the flash kernel
    (no mask) takes GQA.
    """
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return mask is None
    try:
        backend = choose(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=causal,
            enable_gqa=True,
        )
    except (RuntimeError, TypeError):
        return mask is None
    return int(backend) != int(SDPBackend.MATH.value)


def _is_standard_causal(mask: Tensor, sq: int, sk: int) -> bool:
    """True for Megatron's default causal mask (``triu(ones(s, s), 1)``, any broadcast batch)."""
    if sq != sk or tuple(mask.shape[-2:]) != (sq, sk):
        return False
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
    return torch.equal(mask, causal.expand_as(mask))


class SDPAAttention(MegatronModule):
    """Megatron ``core_attention`` computed by ``scaled_dot_product_attention``.

    Shapes as ``DotProductAttention``: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]``
    (``np`` a multiple of ``ng``), output ``[sq, b, np * hn]`` in the input dtype. Masks follow
    Megatron: a boolean ``attention_mask`` broadcastable to ``[b, 1, sq, sk]`` with True = masked
    out; without one a causal module masks causally (``is_causal``, no mask tensor). Query rows
    with every key masked get Megatron's result (uniform attention over all keys) instead of
    SDPA's NaN.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        self.config: TransformerConfig = config
        self._refuse_unsupported(config, layer_number, attn_mask_type)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        if pg_collection is None:
            required = ["tp", "cp"] if config.context_parallel_size > 1 else ["tp"]
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=required)
        elif not hasattr(pg_collection, "tp"):
            raise ValueError("SDPAAttention: pg_collection must have a 'tp' process group")
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        if config.context_parallel_size > 1 and self.cp_group is None:
            raise ValueError("SDPAAttention: context parallelism needs a 'cp' process group")
        world_size = pg_collection.tp.size()

        # The same attributes as DotProductAttention: the elastic attention and the cached
        # inference step read (and the former sets) them.
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)

        # Megatron divides the scale by the layer number here and multiplies the scores back in
        # FP32 inside its softmax: the net scale is unchanged. SDPA's kernels accumulate in FP32,
        # so the net scale is applied once (``_scale``); ``softmax_scale`` keeps Megatron's value.
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.softmax_scale = softmax_scale
        self._scale = softmax_scale
        if config.apply_query_key_layer_scaling:
            self.softmax_scale = softmax_scale / self.layer_number

        # A parameter-free Dropout module, as in DotProductAttention (its ``p`` is read there).
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.softmax_offset = None  # vanilla softmax only (Megatron's flash decode reads it)

    @staticmethod
    def _refuse_unsupported(
        config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType
    ) -> None:
        if config.context_parallel_size != 1 and attn_mask_type != AttnMaskType.causal:
            raise ValueError(
                "SDPAAttention: context parallelism (--context-parallel-size="
                f"{config.context_parallel_size}) supports causal attention only, got "
                f"{attn_mask_type.name}"
            )
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"SDPAAttention: softmax_type must be 'vanilla', got {config.softmax_type!r} "
                "(use core_attention='unfused' for Megatron's DotProductAttention)"
            )
        if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        ):
            raise ValueError(
                f"SDPAAttention: sliding-window attention (window_size={config.window_size}) is "
                "not supported; use core_attention='unfused'"
            )
        if attn_mask_type not in _MASK_TYPES:
            raise ValueError(
                f"SDPAAttention: attn_mask_type must be one of "
                f"{[t.name for t in _MASK_TYPES]}, got {attn_mask_type.name}"
            )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """Attention of ``query`` over ``key``/``value``: ``[sq, b, np * hn]``."""
        if packed_seq_params is not None:
            raise ValueError(
                "SDPAAttention: packed sequences (packed_seq_params) are not supported; "
                "use Transformer Engine's attention"
            )
        if attention_bias is not None:
            raise ValueError("SDPAAttention: attention_bias is not supported")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in _MASK_TYPES:
            raise ValueError(
                f"SDPAAttention: attn_mask_type must be one of "
                f"{[t.name for t in _MASK_TYPES]}, got {mask_type.name}"
            )
        sq, b, heads, _ = query.shape
        sk, groups = key.shape[0], key.shape[2]
        if heads % groups != 0 or value.shape[2] != groups:
            raise ValueError(
                f"SDPAAttention: query heads ({heads}) must be a multiple of the key/value "
                f"groups ({groups}, value {value.shape[2]})"
            )

        if self.cp_group is not None and self.cp_group.size() > 1:
            return self._context_parallel(query, key, value, attention_mask, mask_type)

        # [s, b, n, d] -> [b, n, s, d]: views, SDPA takes the strides.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed, causal, dead = self._sdpa_mask(attention_mask, mask_type, sq, sk)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        gqa = heads != groups
        if gqa and not (_NATIVE_GQA and _native_gqa_is_fused(q, k, v, allowed, dropout_p, causal)):
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
            gqa = False
        kwargs = {"enable_gqa": True} if gqa else {}

        def attend() -> Tensor:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allowed,
                dropout_p=dropout_p,
                is_causal=causal,
                scale=self._scale,
                **kwargs,
            )

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()

        if dead is not None:
            # Megatron fills masked scores with -10000: a row with every key masked attends
            # uniformly to all keys (and passes no gradient to q or k).
            uniform = value.mean(dim=0).to(context.dtype)  # [b, ng, hn]
            uniform = uniform.repeat_interleave(heads // groups, dim=1).unsqueeze(2)
            context = torch.where(dead, uniform, context)

        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * context.shape[-1])

    def _context_parallel(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        mask_type: AttnMaskType,
    ) -> Tensor:
        """Causal attention of this CP rank's two query chunks over the whole sequence.

        All-gather K/V over the CP group (autograd: the backward reduce-scatters their
        gradients), put the chunks back in sequence order, and attend query chunk ``c`` (global
        chunk index) to keys ``[0, (c + 1) L)`` with the causal mask aligned to the bottom right
        (its last query row sees every key). Why all-gather and not a ring: under GQA K/V are a
        fraction of the activations (Nano v3: 2 groups for 32 heads), so one all-gather moves
        little, is exact (no running softmax merge) and runs on every backend; the memory is one
        sequence's K/V per layer."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        from elastic_plugin.models.context_parallel import chunk_order, is_causal_mask

        group = self.cp_group
        assert group is not None  # forward calls this only under CP
        cp, rank = group.size(), group.rank()
        if mask_type != AttnMaskType.causal:
            raise ValueError(
                f"SDPAAttention: context parallelism supports causal attention only, got "
                f"{mask_type.name}"
            )
        sq = query.shape[0]
        if sq % 2:
            raise ValueError(f"SDPAAttention: a CP rank holds two equal chunks, got {sq} rows")
        order = chunk_order(cp)
        if attention_mask is not None:  # Megatron-LM's split keeps this rank's causal rows
            chunk = sq // 2
            rows = torch.cat(
                [torch.arange(c * chunk, (c + 1) * chunk) for c in order[2 * rank : 2 * rank + 2]]
            )
            if not is_causal_mask(attention_mask, rows):
                raise ValueError(
                    "SDPAAttention: context parallelism supports causal attention only; the "
                    f"attention_mask {tuple(attention_mask.shape)} is another mask"
                )
        natural = sorted(range(2 * cp), key=order.__getitem__)  # gathered index of chunk c

        def whole(t: Tensor) -> Tensor:  # [2L, b, g, d] per rank -> [2 cp L, b, g, d] in order
            gathered = gather_from_sequence_parallel_region(
                t.contiguous(), tensor_parallel_output_grad=True, group=group
            )
            parts = gathered.chunk(2 * cp, dim=0)
            return torch.cat([parts[i] for i in natural], dim=0)

        keys, values = whole(key), whole(value)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        chunks = (order[2 * rank], order[2 * rank + 1])
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return attend_chunks(query, keys, values, chunks, self._scale, dropout_p)
        return attend_chunks(query, keys, values, chunks, self._scale, dropout_p)

    @staticmethod
    def _sdpa_mask(
        attention_mask: Tensor | None, mask_type: AttnMaskType, sq: int, sk: int
    ) -> tuple[Tensor | None, bool, Tensor | None]:
        """``(attn_mask, is_causal, dead_rows)`` for SDPA from Megatron's mask and mask type.

        Megatron's softmax uses the given mask alone when there is one, else builds the causal
        mask for a causal module (none for one query row: a decode step over a KV cache).
        ``dead_rows`` ([b, 1, sq, 1], True where every key is masked) is None when there are none.
        """
        if attention_mask is None:
            if mask_type != AttnMaskType.causal or sq == 1:
                return None, False, None
            if sq != sk:
                raise ValueError(
                    f"SDPAAttention: a causal mask without attention_mask needs as many queries "
                    f"as keys, got sq={sq}, sk={sk}"
                )
            return None, True, None
        if attention_mask.dtype != torch.bool:
            raise ValueError(
                "SDPAAttention: attention_mask must be boolean (True = masked out), got "
                f"{attention_mask.dtype}"
            )
        if _is_standard_causal(attention_mask, sq, sk):
            return None, True, None
        allowed = ~attention_mask
        dead = ~allowed.any(dim=-1, keepdim=True)
        if not bool(dead.any()):
            return allowed, False, None
        return allowed | dead, False, dead  # unmask dead rows for SDPA (else NaN); fixed after


def attend_chunks(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    chunks: tuple[int, int],
    scale: float,
    dropout_p: float = 0.0,
) -> Tensor:
    """Causal attention of two query chunks over the whole sequence's keys (context parallelism).

    ``query`` [2L, b, np, hn]: sequence chunks ``chunks[0]`` then ``chunks[1]`` (global chunk
    indices, L rows each); ``keys`` / ``values`` [S, b, ng, hn] in sequence order. Chunk ``c``
    attends to keys ``[0, (c + 1) L)`` with the causal mask aligned to the bottom right (its
    row ``i`` sees key ``c L + i`` and every earlier one): the rows of full causal attention
    that the chunk holds. Returns ``[2L, b, np * hn]``."""
    from torch.nn.attention.bias import causal_lower_right

    rows, b, heads, _ = query.shape
    groups, chunk = keys.shape[2], rows // 2
    outputs = []
    for local, c in enumerate(chunks):
        end = (c + 1) * chunk
        q = query[local * chunk : (local + 1) * chunk].permute(1, 2, 0, 3)
        k, v = keys[:end].permute(1, 2, 0, 3), values[:end].permute(1, 2, 0, 3)
        kwargs = {}
        if heads != groups:
            if _NATIVE_GQA:
                kwargs = {"enable_gqa": True}
            else:
                k = k.repeat_interleave(heads // groups, dim=1)
                v = v.repeat_interleave(heads // groups, dim=1)
        outputs.append(
            F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=causal_lower_right(chunk, end),
                dropout_p=dropout_p,
                scale=scale,
                **kwargs,
            )
        )
    context = torch.cat(outputs, dim=2)  # [b, np, 2L, hn]
    return context.permute(2, 0, 1, 3).reshape(rows, b, heads * context.shape[-1])
