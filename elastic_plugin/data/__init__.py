"""The demo's data pipeline: reasoning problems -> tokenizer -> Megatron indexed datasets.

Modules: ``tasks`` (reasoning-gym problems, rendering, scoring), ``tokenizer`` (small
``tokenizers`` vocabulary + Megatron-Core tokenizer wrapper), ``indexed`` (``.bin/.idx``
writing, ``GPTDataset`` building, micro-batch iterator), ``prepare`` (all of it into one
cached directory), ``cli`` (``elastic-plugin prepare-data``). Kept import-light: importing
this package does not import Megatron-Core.
"""
