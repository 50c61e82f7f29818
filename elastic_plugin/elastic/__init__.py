"""Elastic nested training: config, router, elastic Megatron layers, losses and the training loop."""
