"""Importing a Hugging Face NemotronH directory vs copying its bytes; peak memory vs one shard.

``elastic-plugin import`` should cost little more than moving the checkpoint's bytes (read every
shard, build the model, write the dist checkpoint) and hold no second copy of the model: its
peak memory should be the model plus about one shard. For a randomly initialised
``NemotronHForCausalLM`` saved by ``save_pretrained`` in several shards (``small``: hidden 256;
``wide``: hidden 768, both of every layer kind), these run interleaved (``interleaved_medians``):

* ``import``: ``import_hf(hf_dir, out)`` (checks, Megatron model at TP=1, shard streaming, save);
* ``copy``: ``shutil.copyfile`` of a file the size of the shards, the floor of moving the bytes.

Peak memory is measured in a fresh process (a thread samples the RSS every 2 ms during one
import, after Megatron's imports and process groups are up): ``peak_MB`` is the rise over the
RSS before the import, ``model_MB`` the model's parameters, ``shard_MB`` the largest shard.
Columns: ``import/copy`` (lower is better) and ``extra/shard`` = (peak - model) / largest shard,
the memory beyond the model itself in shards (about 1 is what streaming promises; a second
copy of the model would show as model/shard more).

Run: ``python bench/bench_import.py [--quick] [--reps N] [--json PATH]`` or
``python bench/run_all.py --only import``. ``--quick``: ``wide`` only, one repetition, no warmup.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import copy_floor, interleaved_medians  # noqa: E402

MODELS = {
    "small": {"hidden_size": 256, "shard": "4MB"},
    "wide": {"hidden_size": 768, "shard": "24MB"},
}
_PEAK_SCRIPT = """
import json, sys, threading, time
import psutil
from elastic_plugin.cli_args import start_ranks
from elastic_plugin.export.hf_import import import_hf
from elastic_plugin.parallel import Layout

def main():
    start_ranks(Layout())
    proc, peak, done = psutil.Process(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)
    base = proc.memory_info().rss
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    result = import_hf(sys.argv[1], sys.argv[2], progress=False)
    done.set()
    thread.join()
    print(json.dumps({"base": base, "peak": peak[0], "parameters": result["parameters"]}))

if __name__ == "__main__":
    main()
"""


def _hf_dir(name: str, work: Path) -> Path:
    """A randomly initialised NemotronH (every layer kind) saved in several shards."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    spec = MODELS[name]
    hidden = spec["hidden_size"]
    config = NemotronHConfig(
        vocab_size=8192,
        hidden_size=hidden,
        hybrid_override_pattern="M*EM-E",
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=hidden // 8,
        intermediate_size=2 * hidden,
        mamba_num_heads=16,
        mamba_head_dim=hidden // 8,
        n_groups=2,
        ssm_state_size=32,
        chunk_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden,
        moe_shared_expert_intermediate_size=hidden,
        routed_scaling_factor=2.5,
    )
    torch.manual_seed(0)
    path = work / f"hf_{name}"
    NemotronHForCausalLM(config).save_pretrained(path, max_shard_size=spec["shard"])
    return path


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _peak(hf_dir: Path, out: Path) -> dict[str, int]:
    """Base and peak RSS of one import in a fresh process."""
    run = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(hf_dir), str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        raise RuntimeError(f"peak-memory import failed:\n{run.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def run(quick: bool = False, reps: int | None = None, models: tuple[str, ...] | None = None):
    from elastic_plugin.export.hf_import import import_hf

    reps = reps or (1 if quick else 3)
    models = models or (("wide",) if quick else ("small", "wide"))
    rows = []
    for name in models:
        work = Path(tempfile.mkdtemp(prefix=f"bench_import_{name}_"))
        try:
            hf_dir = _hf_dir(name, work)
            shards = _shards(hf_dir)
            nbytes = sum(p.stat().st_size for p in shards)
            largest = max(p.stat().st_size for p in shards)
            counter = itertools.count()

            def convert(source=hf_dir):
                out = work / f"ckpt_{next(counter)}"
                import_hf(source, out, progress=False)
                shutil.rmtree(out)

            times = interleaved_medians(
                {"import": convert, "copy": copy_floor(work, nbytes)},
                reps=reps,
                warmup=0 if quick else 1,
            )
            memory = _peak(hf_dir, work / "ckpt_peak")
            peak = memory["peak"] - memory["base"]
            model = 4 * memory["parameters"]  # fp32 import
            rows.append(
                {
                    "name": f"import/{name}",
                    "MB": round(nbytes / 1e6, 3),
                    "shards": len(shards),
                    "import_ms": 1e3 * times["import"],
                    "copy_ms": 1e3 * times["copy"],
                    "import/copy": times["import"] / times["copy"],
                    "peak_MB": round(peak / 1e6, 3),
                    "model_MB": round(model / 1e6, 3),
                    "shard_MB": round(largest / 1e6, 3),
                    "extra/shard": (peak - model) / largest,
                }
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    from run_all import bench_main

    bench_main(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
