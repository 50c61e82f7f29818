"""Context parallelism in one process: the chunk layout, the per-chunk causal attention against
full causal attention (values and gradients), and the checks that name the flag. The ranks'
collectives are tested in tests/test_context_parallel.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from elastic_plugin.models.attention import attend_chunks
from elastic_plugin.models.config import ConfigError
from elastic_plugin.models.context_parallel import check_context_parallel, chunk_order


def test_chunk_order_is_megatrons_mirrored_pairs():
    assert chunk_order(1) == [0, 1]
    assert chunk_order(2) == [0, 3, 1, 2]
    assert chunk_order(3) == [0, 5, 1, 4, 2, 3]
    # every chunk held once; rank r's pair sums to 2cp-1 (the same causal work on every rank)
    for cp in (2, 3, 4):
        order = chunk_order(cp)
        assert sorted(order) == list(range(2 * cp))
        assert {order[2 * r] + order[2 * r + 1] for r in range(cp)} == {2 * cp - 1}


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_chunks_attend_as_full_causal_attention(cp, heads, groups):
    """Every rank's two chunks give the full causal attention's rows, and the gradients summed
    over the ranks (the all-gather's reduce-scatter) are the full attention's."""
    torch.manual_seed(0)
    chunk, b, hn = 3, 2, 8
    seq = 2 * cp * chunk
    q = torch.randn(seq, b, heads, hn, dtype=torch.float64, requires_grad=True)
    k = torch.randn(seq, b, groups, hn, dtype=torch.float64, requires_grad=True)
    v = torch.randn(seq, b, groups, hn, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(seq, b, heads * hn, dtype=torch.float64)
    scale = hn**-0.5

    rep = heads // groups
    full = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3),
        k.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3),
        v.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3),
        is_causal=True,
        scale=scale,
    )
    full = full.permute(2, 0, 1, 3).reshape(seq, b, heads * hn)
    (full * weight).sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None

    order = chunk_order(cp)
    for rank in range(cp):
        pair = (order[2 * rank], order[2 * rank + 1])
        rows = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in pair])
        out = attend_chunks(q[rows], k, v, pair, scale)
        torch.testing.assert_close(out, full[rows].detach(), rtol=1e-12, atol=1e-12)
        (out * weight[rows]).sum().backward()  # accumulates over ranks, as the reduce-scatter
    for got, ref in zip((q.grad, k.grad, v.grad), ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_checks_name_the_flag(tiny):
    check_context_parallel(tiny, 1, seq_length=7)  # CP=1: anything goes
    check_context_parallel(tiny, 2, tp=1, seq_length=128)
    cases = [
        (dict(cp=0), "--context-parallel-size=0: must be an int >= 1"),
        (dict(cp=2, seq_length=30), "divisible by 2 x 2 = 4"),
        (dict(cp=4, seq_length=128), "must divide the Mamba groups per tensor-parallel rank"),
        (dict(cp=2, tp=2, seq_length=128), "(model.mamba_num_groups=2 / TP 2 = 1)"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ConfigError) as err:
            check_context_parallel(tiny, **kwargs)
        assert needle in str(err.value), err.value
    no_mamba = dataclasses.replace(tiny, hybrid_layer_pattern="*E-*E-").validate()
    check_context_parallel(no_mamba, 4, tp=2, seq_length=128)  # attention alone: any CP


def test_only_plain_causal_masks_pass():
    """What the batch split drops (and the SDPA path accepts as Megatron-LM's split rows): plain
    causal masks only; a document-boundary mask or a float mask is refused."""
    from elastic_plugin.models.context_parallel import is_causal_mask

    seq = 8
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1).expand(2, 1, seq, seq)
    assert is_causal_mask(causal)
    rows = torch.tensor([0, 1, 6, 7])  # CP=2, rank 0's chunks of 2 rows: 0 and 3
    assert is_causal_mask(causal[..., rows, :], rows)
    assert not is_causal_mask(causal[..., rows, :])  # the wrong positions
    documents = causal.clone()
    documents[..., 4:, :4] = True  # a second document starts at 4
    assert not is_causal_mask(documents)
    assert not is_causal_mask(causal.float())
