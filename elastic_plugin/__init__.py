"""elastic_plugin: elastic, nested ("many-in-one") training for Megatron-Core.

Several nested models of one hybrid Mamba-attention-MoE network live in one checkpoint;
this package ranks, reorders, trains and extracts them on top of Megatron-Core.
"""

__version__ = "0.1.0"


def _maybe_enable_cpu_compat() -> None:
    """``ELASTIC_PLUGIN_CPU=1``: patch Megatron-Core for CPU/gloo on import, for scripts that
    import the plugin but never call :func:`elastic_plugin.compat.enable_cpu_megatron`."""
    import os

    if os.environ.get("ELASTIC_PLUGIN_CPU", "0") not in ("", "0", "false", "False"):
        from elastic_plugin.compat import maybe_enable_from_env

        maybe_enable_from_env()


def _defer_megatron_compile() -> None:
    """Megatron-Core's ``torch.compile`` decorations compile on first call instead of importing
    the compiler at import time: ~2.7 s off every process's start-up (compat/deferred_compile.py)."""
    from elastic_plugin.compat.deferred_compile import install

    install()


_defer_megatron_compile()
_maybe_enable_cpu_compat()
