"""The on-disk format: ``meta`` (the one reader/writer of ``elastic_meta.json``, torch-free),
``layout`` (canonical order on disk <-> strided order in memory) and ``io`` (atomic save, any-layout
load of Megatron dist checkpoints)."""
