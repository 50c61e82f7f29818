"""Tokenizer directories as Hub models ship them, and tiny random models of every family that
use them (tests/test_token_rule.py): byte-level BPE trained here, a BOS added by the
post-processor or none, a ChatML chat template in ``chat_template.jinja``, and a
``generation_config.json`` with two EOS ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BOS, EOS, END_TURN, PAD = "<s>", "</s>", "<|im_end|>", "<pad>"
SPECIALS = [PAD, BOS, EOS, "<|im_start|>", END_TURN]
VOCAB = 160
# a ChatML template that also writes the named BOS (a template variable, as transformers passes it)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "What is the capital of France? Paris is the capital of France.",
    "Name three primary colours: red, yellow and blue.",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "Write one sentence about the sea. The sea is wide and deep.",
] * 8


def write_tokenizer(
    directory: Path,
    *,
    bos: bool,
    chat: bool,
    stop: tuple[str, ...] = (EOS, END_TURN),
    split: str = "gpt2",
) -> Path:
    """tokenizer.json (+ a BOS post-processor when ``bos``; ``split``: gpt2, llama3 or qwen2),
    tokenizer_config.json, chat_template.jinja when ``chat``, generation_config.json with the
    ``stop`` ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from elastic_plugin.export.gguf import LLAMA3_SPLIT, QWEN2_SPLIT

    splits = {"llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}  # released tokenizers' Split regex
    tok = Tokenizer(models.BPE())
    if split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(splits[split]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 4,  # room for the model's padded rows
        special_tokens=SPECIALS,
        # printable ASCII (and byte-level's space and newline): every token is whole UTF-8
        initial_alphabet=[chr(b) for b in range(33, 127)] + ["\u0120", "\u010a"],
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A",
            pair=f"{BOS} $A {BOS} $B",
            special_tokens=[(BOS, tok.token_to_id(BOS))],
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": END_TURN if chat else EOS,
        "pad_token": PAD,
        "add_bos_token": not bos,  # transformers 5 ignores it beside a tokenizer.json
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if chat:
        (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    ids = [tok.token_to_id(t) for t in stop]
    generation = {
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": ids if len(ids) > 1 else ids[0],
    }
    generation["pad_token_id"] = tok.token_to_id(PAD)
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory / "tokenizer.json"


BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=40,
    num_hidden_layers=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {**BASE, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2ForCausalLM", dict(BASE)),
    "qwen3": ("Qwen3ForCausalLM", {**BASE, "head_dim": 12}),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {
            **BASE,
            "head_dim": 12,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "norm_topk_prob": True,
        },
    ),  # fmt: skip
    "mixtral": (
        "MixtralForCausalLM",
        {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24},
    ),
}


# each family's tokenizer splits text as its released tokenizers do (transformers 5's
# Qwen2Tokenizer puts Qwen's split in place of a GPT-2 byte-level one; the rule reads the file)
SPLIT = {
    "llama": "llama3",
    "mixtral": "gpt2",
    "qwen2": "qwen2",
    "qwen3": "qwen2",
    "qwen3_moe": "qwen2",
}


def write_model(
    directory: Path, family: str, tokenizer_dir: Path, seed: int = 0, **sizes: Any
) -> Path:
    """save_pretrained of a random ``family`` model (weights perturbed, so ties are unlikely;
    ``sizes`` override the config's) with the tokenizer files of ``tokenizer_dir`` beside it;
    config.json names its ids."""
    import shutil

    import torch
    import transformers

    architecture, kwargs = FAMILIES[family]
    rule_files = json.loads((tokenizer_dir / "generation_config.json").read_text())
    cls = getattr(transformers, architecture)
    torch.manual_seed(seed)
    config = cls.config_class(
        **{**kwargs, **sizes},
        bos_token_id=rule_files["bos_token_id"],
        eos_token_id=rule_files["eos_token_id"],
        pad_token_id=rule_files["pad_token_id"],
    )
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        shutil.copyfile(file, directory / file.name)
    return directory


def transformers_greedy(
    model_dir: Path, text: str, chat: bool, max_new_tokens: int, stop: bool = True
) -> list[int]:
    """transformers' own answer: its tokenizer (``tokenizer(text)`` or ``apply_chat_template``
    with the generation prompt), greedy ``generate`` with the directory's generation config
    (its stopping; none with ``stop=False``), the new tokens only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if chat:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
    else:
        ids = tok(text)["input_ids"]
    prompt = torch.tensor([list(ids)])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if not stop:
        model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, prompt.shape[1] :].tolist()


def our_greedy(ckpt: Path, text: str, chat: bool, max_new_tokens: int, *extra: str) -> dict:
    """``elastic-plugin generate --json`` in this process: its summary."""
    import io
    from contextlib import redirect_stdout

    from elastic_plugin.cli import main

    argv = ["generate", "--ckpt", str(ckpt), "--prompt", text, "--json"]
    argv += ["--max-new-tokens", str(max_new_tokens), *extra] + (["--chat"] if chat else [])
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


def elastic_checkpoint(work: Path, model_dir: Path, tokenizer: Path) -> Path:
    """A briefly trained elastic checkpoint (budgets 1, 0.77, 0.4; two iterations on one rank)
    of the model ``model_dir``'s config.json describes, recording ``tokenizer`` as the one it
    was trained with."""
    from elastic_plugin.families import model_config_from_hf
    from elastic_plugin.models.config import load_config
    from tests.support import elastic_cases as ec

    base = load_config(Path(__file__).resolve().parents[2] / "examples/configs/tiny_llama.yaml")
    model = model_config_from_hf(json.loads((model_dir / "config.json").read_text()))
    cfg = base.__class__(
        model=model, parallel=base.parallel, training=base.training, data=base.data,
        source=base.source,
    )  # fmt: skip
    ckpt = ec.train_tiny_elastic(cfg, work)
    meta_path = ckpt / "elastic_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["tokenizer"] = str(tokenizer)
    meta_path.write_text(json.dumps(meta))
    return ckpt


def budgets_case(workdir: str, family: str) -> dict:
    """1 rank: an elastic checkpoint of ``family`` with a BOS + chat tokenizer; per trained
    budget, ``generate`` (plain and ``--chat``) and transformers' ``generate`` on that budget's
    fp32 HF export (which carries the tokenizer's files)."""
    from elastic_plugin.checkpoint.meta import budget_label, read_elastic_meta, trained_budgets
    from elastic_plugin.export.extract import extract_nested

    work = Path(workdir)
    tokenizer = write_tokenizer(work / "tok", bos=True, chat=True, split=SPLIT[family])
    model_dir = write_model(work / "hf", family, tokenizer.parent)
    ckpt = elastic_checkpoint(work / "elastic", model_dir, tokenizer)
    out: dict = {}
    for budget in trained_budgets(read_elastic_meta(ckpt)):
        label = budget_label(budget)
        export = Path(
            extract_nested(ckpt, budget, work / f"hf_{label}", fmt="hf", dtype="fp32")["out"]
        )
        out[label] = {}
        for chat in (False, True):
            ours = our_greedy(ckpt, "What is the capital of France?", chat, 10, "--budget", label)
            expected = transformers_greedy(export, "What is the capital of France?", chat, 10)
            out[label]["chat" if chat else "plain"] = (ours["results"][0]["tokens"], expected)
    out.update(_gguf_runs(ckpt, work / "exports"))
    return out


def _gguf_runs(ckpt: Path, out_dir: Path) -> dict:
    """``export --precisions bf16 --gguf f32`` of every budget: llama.cpp's greedy tokens on each
    GGUF against transformers' on the BF16 export it was written from (the same weights)."""
    from elastic_plugin.checkpoint.meta import budget_label
    from elastic_plugin.export.report import export_all
    from tests.support.gguf_cases import llama_cpp_greedy

    report = export_all(ckpt, out_dir, ["bf16"], megatron=False, eval_sequences=0,
                        progress=False, gguf=["f32"])  # fmt: skip
    exports = {row["budget"]: row["path"] for row in report["exports"]}
    runs = {}
    for entry in report["gguf"]:
        text = "What is the capital of France? 12345 sea"
        ours = llama_cpp_greedy(Path(entry["out"]), text, 8)["tokens"]
        expected = transformers_greedy(Path(exports[entry["budget"]]), text, False, 8, stop=False)
        runs[f"gguf {budget_label(entry['budget'])}"] = {"llama.cpp": (ours, expected)}
    return runs


def nested_budgets_case(workdir: str, family: str, sizes: dict) -> list[str]:
    """1 rank: an elastic checkpoint of ``family`` (``sizes``: config overrides), its BF16
    nested directory (``export --nested``) and every budget sliced out of it; the slices."""
    from elastic_plugin.checkpoint.meta import budget_label, read_elastic_meta, trained_budgets
    from elastic_plugin.export.nested_hf import slice_nested
    from elastic_plugin.export.report import export_all

    work = Path(workdir)
    tokenizer = write_tokenizer(work / "tok", bos=family != "qwen2", chat=True, split=SPLIT[family])
    model_dir = write_model(work / "hf", family, tokenizer.parent, **sizes)
    ckpt = elastic_checkpoint(work / "elastic", model_dir, tokenizer)
    export_all(ckpt, work / "exports", ["bf16"], megatron=False, eval_sequences=0,
               progress=False, nested=True)  # fmt: skip
    out = []
    for budget in trained_budgets(read_elastic_meta(ckpt)):
        target = work / f"sliced_{budget_label(budget)}"
        out.append(slice_nested(work / "exports" / "nested", budget, target)["out"])
    return out
