"""Evaluation of nested models on the reasoning task: accuracy per budget and precision, and
budget control (think with a small nested model, answer with a larger one) against the full
model and against capped thinking. ``evaluate_demo`` writes the demo's report."""
