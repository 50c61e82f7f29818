"""Activation bytes one rank keeps per in-flight micro-batch: what autograd saves for the backward
pass in each decoder layer, plus the embedding and the output layer / distillation loss.

Per token, in elements of the model dtype unless noted; ``t`` = TP, ``sp`` = TP with sequence
parallelism (the residual stream is split over the sequence) else 1; widths are the budget's
nested ones (sliced mode computes only them). GPU kernels are assumed: SDPA / flash attention
(it saves Q, K, V, its output and a log-sum-exp, never the score matrix) and mamba_ssm's fused
chunked scan (its inputs, output and the chunk-end states). Per layer:

* every layer: the pre-norm's input, its normalised input and its output, ``3 h / sp``
  (``LocalRMSNorm`` keeps all three; the FP32 reciprocal RMS per token is left out);
* attention: the fused QKV output ``(a + 2 g) d / t`` (Q, K and V are views of it), SDPA's
  query copy and output ``2 a d / t`` (linear_proj reads the output as a view), its
  log-sum-exp ``a / t`` (FP32); under context parallelism (``c`` ranks, each holding ``1 / c``
  of the sequence: every figure here is per token *this rank holds*) also the K and V gathered
  from the other CP ranks, ``2 g d (c - 1) / t`` (``models.attention``'s SDPA path keeps them
  for its backward);
* dense MLP and the shared expert: fc1's output ``r / t`` (``r`` = 2 f when gated), the
  activation's output ``f / t``, and the gate's product ``f / t`` when gated;
* MoE: router logits and scores ``2 E`` (FP32); each token's ``k`` routed copies: the
  permuted input ``k h`` (the dispatch buffer, all-gathered over TP), and per copy the expert
  MLP as above plus its probability-weighted activation ``f / t`` (the probabilities are applied
  before fc2);
* Mamba: in_proj's output ``(2 D + 2 G N + H) / t``, the conv input copy and its output
  ``2 (D + 2 G N) / t``, the scan output and the gated norm's output ``2 D / t``, the scan's
  chunk-end states ``D N / Q / t`` and ``dt`` / decays ``2 H / t`` (FP32). This is what
  mamba_ssm's fused kernels keep (``mamba_scan="fused"``). The pure-PyTorch chunked scan
  (``compat.mamba_ops.ssd_chunk_scan``, used wherever mamba_ssm is absent: ``"torch"``) also
  keeps, per token and in the compute dtype: the intra-chunk decay matrix and its product with
  ``C B^T`` (``2 H Q / t``), ``C B^T`` itself (``G Q / t``), ``dt x``, its decayed copy and the
  entering states' output (``3 D / t``), two more decay vectors (``2 H / t``) and the states
  twice more (before and after they are passed between chunks, ``2 D N / Q / t``).
  Under context parallelism Megatron's ``MambaContextParallel`` trades the sequence shard for a
  head shard around the conv and the scan (all-to-all): the same elements per held token.

Measured on the tiny model (CPU, FP32, saved-tensor hooks, weights excluded): attention, dense
MLP and MoE layers keep what the first three items say to within 2%.

The first stage adds the embedding output ``h / sp``; the last stage the output layer's input
``h / sp`` and the distillation loss (``kd_loss_bytes``), whose row passes are
``ops.kd_row_stats`` / ``ops.kd_grad``: compiled kernels on CPU (no temporary the size of the
logits), PyTorch compositions elsewhere (CUDA), ``1024`` rows at a time. Chunked (the default,
``elastic.losses._ChunkedVocabParallelKL``): it keeps the student's logits (``V / t``, model
dtype) and the two FP32 log-normalisers per token; its backward writes the logits' gradient
(``V / t`` per token, model dtype, whole). The compositions add, per ``r = min(c, 1024)`` rows,
three FP32 ``[r, V / t]`` tensors and a mask (forward) or two FP32 ones plus a BF16 -> FP32
conversion (backward). Unchunked (``_VocabParallelKL``): the saved ``p_s - p_t`` (``V / t``,
FP32), FP32 copies of BF16 logits while it is made, and in backward its scaled FP32 copy (and
that copy in BF16). ``bench/bench_kd_loss.py`` measures both at 8K tokens against this model.
Recomputation: ``full`` keeps each
recomputed chunk's input (``h / sp``) and re-creates one chunk's activations at a time;
``selective`` recomputes core attention, which SDPA does not store anyway: no change.
"""

from __future__ import annotations

from elastic_plugin.elastic.config import DEFAULT_KD_CHUNK_TOKENS
from elastic_plugin.models.config import ModelConfig
from elastic_plugin.models.runtime import Runtime

__all__ = [
    "MAMBA_SCANS",
    "kd_loss_bytes",
    "kd_loss_peak_bytes",
    "layer_activation_elements",
    "stage_activation_bytes",
]

FP32 = 4
# rows per step of the loss's PyTorch compositions (ops._kd_loss.REFERENCE_CHUNK_ROWS; the
# planner imports no torch, tests/test_planning.py checks the two agree)
KD_REFERENCE_CHUNK_ROWS = 1024


MAMBA_SCANS = ("fused", "torch")


def layer_activation_elements(
    model: ModelConfig,
    kind: str,
    tp: int,
    sp: int,
    dtype_bytes: int,
    mamba_scan: str = "fused",
    cp: int = 1,
) -> float:
    """Elements (in units of the model dtype) saved per held token by one layer of ``kind``;
    ``mamba_scan``: which Mamba scan runs (``MAMBA_SCANS``); ``cp``: context-parallel size."""
    h = model.hidden_size
    fp32 = FP32 / dtype_bytes  # an FP32 value in model-dtype elements
    out = 3 * h / sp
    if kind == "attention":
        a, g, d = model.num_attention_heads, model.query_groups, model.head_dim
        out += (a + 2 * g) * d / tp + 2 * a * d / tp + a / tp * fp32
        out += 2 * g * d * (cp - 1) / tp  # K and V gathered from the other CP ranks
    elif kind == "mlp":
        out += _mlp(model, model.ffn_hidden_size) / tp
    elif kind == "moe":
        k, e = model.moe_router_topk, model.num_moe_experts
        routed = _mlp(model, model.moe_ffn_hidden_size) + model.moe_ffn_hidden_size
        out += 2 * e * fp32 + k * h + k * routed / tp
        if model.moe_shared_expert_intermediate_size:
            out += _mlp(model, model.moe_shared_expert_intermediate_size) / tp
    elif kind == "mamba":
        d, nh = model.mamba_d_inner, model.mamba_num_heads
        bc = 2 * model.mamba_num_groups * model.mamba_state_dim
        states = d * model.mamba_state_dim / model.mamba_chunk_size
        out += (2 * d + bc + nh + 2 * (d + bc) + 2 * d) / tp + (states + 2 * nh) / tp * fp32
        if mamba_scan == "torch":
            q, g = model.mamba_chunk_size, model.mamba_num_groups
            out += (2 * nh * q + g * q + 3 * d + 2 * nh + 2 * states) / tp
        elif mamba_scan != "fused":
            raise ValueError(f"mamba_scan {mamba_scan!r}; allowed: {', '.join(MAMBA_SCANS)}")
    else:
        raise ValueError(f"layer kind {kind!r}; allowed: mamba, attention, mlp, moe")
    return out


def _mlp(model: ModelConfig, ffn: int) -> float:
    rows = ffn * (2 if model.gated_mlp else 1)
    return rows + ffn + (ffn if model.gated_mlp else 0)


def kd_loss_bytes(
    tokens: int,
    vocab_shard: float,
    dtype_bytes: int,
    chunk_tokens: int | None,
    cpu_kernels: bool = False,
) -> dict[str, float]:
    """The distillation loss's own bytes on the last stage for one micro-batch (logits given):
    ``stored`` from its forward to its backward, ``transient`` on top of that while it runs.
    ``cpu_kernels``: the compiled row passes run (CPU with the extension built); False: the
    PyTorch compositions (CUDA). See the module docstring for what each keeps.
    """
    elements = tokens * vocab_shard
    converted = FP32 if dtype_bytes != FP32 else 0  # an FP32 copy of BF16 logits
    stats = 5 * 8 * tokens  # the forward's FP64 row statistics
    rows = min(chunk_tokens or tokens, KD_REFERENCE_CHUNK_ROWS, tokens) * vocab_shard
    # what the PyTorch compositions hold per block of rows (the compiled passes: nothing)
    stats_rows = 0.0 if cpu_kernels else (3 * FP32 + 1) * rows
    grad_rows = 0.0 if cpu_kernels else (2 * FP32 + converted) * rows
    if chunk_tokens is None:  # both passes in the forward; p_s - p_t itself is stored
        forward = 2 * converted * elements + stats + max(stats_rows, grad_rows)
        backward = (FP32 + (dtype_bytes if converted else 0)) * elements
        return {"stored": FP32 * elements, "transient": max(forward, backward)}
    stored = dtype_bytes * elements + 2 * FP32 * tokens
    forward = stats_rows + stats
    backward = dtype_bytes * elements + grad_rows
    return {"stored": stored, "transient": max(forward, backward)}


def kd_loss_peak_bytes(
    tokens: int,
    vocab_shard: float,
    dtype_bytes: int,
    chunk_tokens: int | None,
    cpu_kernels: bool = False,
) -> float:
    """Peak bytes the loss's forward + backward allocate beyond the logits it is given (what
    ``bench/bench_kd_loss.py`` measures): its stored bytes plus its transient."""
    loss = kd_loss_bytes(tokens, vocab_shard, dtype_bytes, chunk_tokens, cpu_kernels)
    if chunk_tokens is None:
        return loss["stored"] + loss["transient"]
    # the student's logits it stores are the caller's, not allocated here
    return loss["stored"] - dtype_bytes * tokens * vocab_shard + loss["transient"]


def stage_activation_bytes(
    model: ModelConfig,
    kinds: list[str],
    first: bool,
    last: bool,
    tokens: int,
    tp: int,
    sequence_parallel: bool,
    runtime: Runtime,
    mamba_scan: str = "fused",
    kd_chunk_tokens: int | None = DEFAULT_KD_CHUNK_TOKENS,
    cp: int = 1,
    cpu_kernels: bool = False,
) -> dict[str, float]:
    """Bytes of one micro-batch on one rank of a stage with layers ``kinds``: ``stored`` (kept
    until its backward), ``transient`` (the largest short-lived extra: one recomputed chunk,
    the loss) for the ``tokens`` the rank holds (``micro_batch_size x seq_length / cp``);
    ``kd_chunk_tokens``: the KD loss's chunk (``elastic.kd_chunk_tokens``; None: the
    unchunked loss); ``cpu_kernels``: the loss's compiled CPU row passes run (``kd_loss_bytes``)."""
    dtype_bytes = 2 if runtime.bf16 else 4
    sp = tp if sequence_parallel and tp > 1 else 1
    h = model.hidden_size
    per_layer = [
        layer_activation_elements(model, kind, tp, sp, dtype_bytes, mamba_scan, cp)
        * tokens
        * dtype_bytes
        for kind in kinds
    ]
    stored = sum(per_layer)
    transient = 0.0
    if runtime.full_recompute and per_layer:
        n = runtime.recompute_num_layers or 1
        inputs = h / sp * tokens * dtype_bytes
        if runtime.recompute_method == "block":
            recomputed = per_layer[:n]
            stored = sum(per_layer[n:]) + len(recomputed) * inputs
            transient = max(recomputed, default=0.0)
        else:
            chunks = [per_layer[i : i + n] for i in range(0, len(per_layer), n)]
            stored = len(chunks) * inputs
            transient = max(sum(c) for c in chunks)
    if first:
        stored += h / sp * tokens * dtype_bytes
    if last:
        loss = kd_loss_bytes(
            tokens, model.vocab_size / tp, dtype_bytes, kd_chunk_tokens, cpu_kernels
        )
        stored += h / sp * tokens * dtype_bytes + loss["stored"]
        transient = max(transient, loss["transient"])
    return {"stored": stored, "transient": transient}
