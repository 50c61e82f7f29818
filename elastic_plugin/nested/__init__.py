"""One budget's plain model, built in one place for extraction, export, generation and evaluation.

``choice`` (which sizes a budget is), ``slicing`` (the weights of those sizes, cut from the full
importance-ordered model), ``model`` (the plain smaller Megatron model in memory) and ``cli``
(``elastic-plugin inspect``: every budget of a checkpoint, from its metadata alone).
"""
