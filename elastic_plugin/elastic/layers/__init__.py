"""Elastic Megatron-Core layers: one shared ``ElasticState`` says what is active, the layers obey.

``fp8`` (FP8 GEMM context), ``state`` (the current choice per axis and layer), ``linear``
(Megatron's parallel linears on an active block), ``mamba`` (the mixer at a smaller width) and
``modules`` (the behaviours registered into Megatron's classes, and ``elastify``).
"""

from elastic_plugin.elastic.layers import fp8  # first: linear and modules import it
from elastic_plugin.elastic.layers.modules import (
    LinearActive,
    elastic_state_of,
    elastify,
    register_elastic,
    register_elastic_layer,
)
from elastic_plugin.elastic.layers.state import SLICED, ElasticState, RankInfo

__all__ = [
    "SLICED",
    "ElasticState",
    "LinearActive",
    "RankInfo",
    "elastic_state_of",
    "elastify",
    "fp8",
    "register_elastic",
    "register_elastic_layer",
]
