"""Exports of nested models to other ecosystems: Hugging Face NemotronH safetensors (``hf``) and
FP8 / NVFP4 quantized weights in ModelOpt's unified layout (``quantize``)."""
