"""Exports of nested models to other ecosystems: the family's Hugging Face safetensors (``hf``) and
FP8 / NVFP4 quantized weights in ModelOpt's unified layout (``quantize``)."""
