"""``make demo-real``: a real pretrained model (SmolLM2-135M-Instruct) nested end to end
(pipeline: the stages; measure / report / evaluate: what the run buys, on held-out text)."""
