"""Plan a parallel layout before a job starts (``elastic-plugin plan``): which TP/PP/EP/DP layouts
fit a model on N GPUs, what each rank holds, how much each budget computes and communicates per
step, and an estimated step time and curriculum cost from a stated model.

Arithmetic over a ``ModelConfig`` only: nothing is built or allocated. The pieces, one job each:
``devices`` (the GPU table), ``layouts`` (valid layouts, checked as elastic-train checks them),
``params`` (parameters each rank holds), ``memory`` (bytes per rank), ``budgets`` (the nested
model each budget runs and its FLOPs), ``comm`` (bytes per process group per step), ``timing``
(step time, PP bubble included), ``plan`` (assembles and ranks), ``report`` (table, JSON, plot).
"""
