"""elastic_plugin: elastic, nested ("many-in-one") training for Megatron-Core.

Several nested models of one hybrid Mamba-attention-MoE network live in one checkpoint;
this package ranks, reorders, trains and extracts them on top of Megatron-Core.
"""

__version__ = "0.1.0"
