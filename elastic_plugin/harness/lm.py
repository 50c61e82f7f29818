"""The lm-eval model ``elastic-plugin``: a checkpoint of this plugin, any trained budget of a
nested one, scored and run on our own inference path.

    lm_eval --model elastic-plugin --model_args ckpt=run/checkpoints/elastic,budget=0.7 \
        --include_path TASKS_DIR --tasks arc_easy,hellaswag --batch_size 16

- **model**: ``nested.model.load_nested_model`` (the budget's plain ``HybridModel``, cut from the
  elastic weights; a budget the checkpoint was not trained for is refused, naming those it has,
  before any weight is read);
- **tokens**: the model's own token rule (``data/token_rule.py``): a prompt is the tokenizer's
  encoding with its special tokens (a BOS exactly when the tokenizer adds one), as lm-eval's
  ``hf`` model encodes it; the EOS and the stop ids come from the model's files;
- **log-likelihoods**: ``harness.scoring`` (right-padded batches, the output layer only where a
  continuation token is predicted), lm-eval's request handling as its ``hf`` model does it:
  trailing context spaces moved to the continuation (``TemplateLM``), context and continuation
  encoded together and split, the context cut from the left to the model's length;
- **generation**: ``inference.generate`` greedy (batched, cached), stopping at the model's stop
  ids or when the text holds one of the request's ``until`` strings, then cut there, as lm-eval
  cuts ``hf``'s output. Sampling requests are refused (lm-eval's tasks here decode greedily).

Importing this module registers the class with lm-eval (``register_model``); lm-eval's own
command line finds it through ``harness.hook``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from elastic_plugin.data.token_rule import TokenRule, read_token_rule
from elastic_plugin.models.config import ConfigError

__all__ = ["MODEL_NAME", "ElasticLM", "tokenizer_of_checkpoint"]

MODEL_NAME = "elastic-plugin"
DEFAULT_MAX_GEN_TOKS = 256


def tokenizer_of_checkpoint(ckpt: str | Path, tokenizer: str | None = None) -> str:
    """The ``tokenizer.json`` a checkpoint was trained with (its metadata records it), or
    ``tokenizer`` when given; a ConfigError naming the argument when neither is readable."""
    from elastic_plugin.checkpoint.meta import read_checkpoint_meta

    def resolve(path: Path) -> Path:
        return path / "tokenizer.json" if path.is_dir() else path

    if tokenizer is not None:
        path = resolve(Path(tokenizer))
        if not path.is_file():
            raise ConfigError(
                f"tokenizer={tokenizer}: no such file (a tokenizer.json or its folder)"
            )
        return str(path)
    recorded = read_checkpoint_meta(ckpt).get("tokenizer")
    if not recorded or not resolve(Path(recorded)).is_file():
        raise ConfigError(
            f"ckpt={ckpt}: its metadata records no readable tokenizer ({recorded!r}); pass "
            "tokenizer=PATH (the tokenizer.json the model was trained with)"
        )
    return str(resolve(Path(recorded)))


def _batches_by_context(rows: list[tuple[list[int], int]], batch_size: int) -> list[list[int]]:
    """Row indices in batches of at most ``batch_size``, the rows of one context (a question's
    answers) kept together and the longest groups first. Sorting rows by length alone, as a plain
    padded forward wants, scatters a question's answers over several batches, so the scorer's
    shared-context prefill (``harness.scoring``) would find nothing to share."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (seq, start) in enumerate(rows):
        groups.setdefault(tuple(seq[:start]), []).append(i)
    ordered = sorted(groups.values(), key=lambda g: (-max(len(rows[i][0]) for i in g), g[0]))
    batches: list[list[int]] = []
    for group in ordered:
        members = sorted(group, key=lambda i: -len(rows[i][0]))
        if batches and len(batches[-1]) + len(members) <= batch_size:
            batches[-1].extend(members)
            continue
        for begin in range(0, len(members), batch_size):
            batches.append(members[begin : begin + batch_size])
    return batches


def _clean_up(rule: TokenRule) -> bool:
    """Whether transformers cleans decoded text up for this tokenizer (``tokenizer_config.json``
    asks for it; transformers 5 never does it for BPE models)."""
    config_file = Path(rule.path).parent / "tokenizer_config.json"
    if not config_file.is_file():
        return False
    config = json.loads(config_file.read_text())
    wanted = bool(config.get("clean_up_tokenization_spaces", False))
    return wanted and type(rule.backend.model).__name__ != "BPE"


@register_model(MODEL_NAME)
class ElasticLM(TemplateLM):
    """``ckpt``: an elastic (or extracted / plain) checkpoint of this plugin; ``budget``: the
    trained budget to cut out (elastic checkpoints only); ``tokenizer``: overrides the one its
    metadata records; ``batch_size``: sequences per forward (and prompts per generation)."""

    def __init__(
        self,
        ckpt: str,
        budget: float | str | None = None,
        tokenizer: str | None = None,
        batch_size: int | str = 16,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        device: str | None = None,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if str(batch_size).startswith("auto"):
            batch_size = 16
        try:
            self.batch_size = int(batch_size)
        except (TypeError, ValueError):
            raise ConfigError(f"batch_size={batch_size!r}: must be an integer >= 1") from None
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r}: must be an integer >= 1")
        self.rule = read_token_rule(tokenizer_of_checkpoint(ckpt, tokenizer))
        # decoding as transformers decodes: the rule's backend, or transformers' own tokenizer
        # where it would clean the text up (a non-BPE tokenizer that asks for it)
        self._decoder: Any = None
        if _clean_up(self.rule):
            from transformers import AutoTokenizer

            self._decoder = AutoTokenizer.from_pretrained(str(Path(self.rule.path).parent))
        self.max_gen_toks = int(max_gen_toks)
        self.ckpt, self.budget = str(ckpt), None if budget in (None, "") else float(budget)
        begin = time.perf_counter()
        if model is None:
            from elastic_plugin.nested.model import load_nested_model

            model, _ = load_nested_model(ckpt, self.budget)
        self.model = model
        self.load_s = time.perf_counter() - begin
        from elastic_plugin.inference.steps import check_model

        inner = check_model(model)
        if inner.vocab_size < self.rule.backend.get_vocab_size(with_added_tokens=True):
            raise ConfigError(
                f"tokenizer {self.rule.path}: {self.rule.backend.get_vocab_size()} tokens, more "
                f"than the model's vocabulary ({inner.vocab_size}); is it the model's tokenizer?"
            )
        self._max_length = int(inner.max_sequence_length)
        self.tokenizer = None  # lm-eval reads chat templates here; ours come from the rule
        bos = self.rule.special_tokens.get("bos_token")
        bos_id = self.rule.backend.token_to_id(bos) if bos is not None else None
        self._prefix_id = bos_id if bos_id is not None else self.rule.eos_id

    # ------------------------------------------------------------------- what lm-eval reads
    @property
    def eot_token_id(self) -> int:
        return self.rule.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.rule.path

    def get_model_info(self) -> dict[str, Any]:
        return {"ckpt": self.ckpt, "budget": self.budget, "token_rule": self.rule.summary()}

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        """The rule's encoding (the tokenizer's special tokens added, as transformers adds
        them); a string that already starts with the BOS is encoded as it is (lm-eval's rule)."""
        specials = True if add_special_tokens is None else bool(add_special_tokens)
        if add_special_tokens is None and has_bos_prefix(
            string, self.tok_decode([self._prefix_id], False)
        ):
            specials = False
        ids = list(self.rule.backend.encode(string, add_special_tokens=specials).ids)
        left = kwargs.get("left_truncate_len")
        return ids[-left:] if left else ids

    def tok_decode(self, tokens: Iterable[int], skip_special_tokens: bool = True) -> str:
        if self._decoder is not None:
            return str(self._decoder.decode(list(tokens), skip_special_tokens=skip_special_tokens))
        return str(self.rule.backend.decode(list(tokens), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The model's chat template over lm-eval's turns, rendered as transformers renders it."""
        if self.rule.chat_template is None:
            raise ConfigError(
                f"--apply_chat_template: the tokenizer {self.rule.path} has no chat template"
            )
        from transformers.utils.chat_template_utils import render_jinja_template

        special: dict[str, Any] = dict(self.rule.special_tokens)  # template variables
        rendered: Any = render_jinja_template(
            conversations=[chat_history], chat_template=self.rule.chat_template,
            add_generation_prompt=add_generation_prompt, **special,
        )  # fmt: skip
        return str(rendered[0][0])

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.rule.chat_template if chat_template else None

    # ------------------------------------------------------------------------ log-likelihood
    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """Each ``(key, context ids, continuation ids)`` scored; longest first, in batches."""
        from elastic_plugin.harness.scoring import score_continuations

        limit = self.max_length
        rows = []
        for _, context, continuation in requests:
            if not continuation:
                raise ConfigError("a request with an empty continuation (nothing to score)")
            seq = (list(context) + list(continuation))[-(limit + 1) :]
            rows.append((seq, len(seq) - len(continuation)))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        bar = tqdm(total=len(rows), disable=disable_tqdm, desc="log-likelihoods")
        for chunk in _batches_by_context(rows, self.batch_size):
            scored = score_continuations(
                self.model, [rows[i][0] for i in chunk], [max(rows[i][1], 1) for i in chunk]
            )
            for i, s in zip(chunk, scored):
                # a context cut to nothing: the first continuation token has no prediction
                results[i] = (s.logprob, s.greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
            bar.update(len(chunk))
        bar.close()
        return [r for r in results if r is not None]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Perplexity tasks: lm-eval's disjoint rolling windows of the model's length."""
        from lm_eval import utils

        out = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm):
            windows = [
                (None, *utils.make_disjoint_window(w))
                for w in utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1,
                )
            ]  # fmt: skip
            scores = self._loglikelihood_tokens(windows, disable_tqdm=True)
            total = sum(s for s, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # ---------------------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from elastic_plugin.inference.generation import generate

        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        results: list[str] = [""] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
                raise ConfigError(
                    "generation: sampling requested (do_sample / temperature > 0); the "
                    "elastic-plugin model decodes greedily only"
                )
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if max_gen >= self.max_length:
                raise ConfigError(
                    f"max_gen_toks {max_gen}: must be below the model's length {self.max_length}"
                )
            prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_gen) :]
                       for i in members}  # fmt: skip
            ordered = sorted(members, key=lambda i: -len(prompts[i]))
            for begin in range(0, len(ordered), self.batch_size):
                chunk = ordered[begin : begin + self.batch_size]

                def stop_text(row: int, generated: list[int]) -> bool:
                    text = self.tok_decode(generated)
                    return any(term and term in text for term in until)

                batch = [prompts[i] for i in chunk]
                # the cache holds what this batch can reach, not the model's whole length
                reach = min(max(len(p) for p in batch) + max_gen + 1, self.max_length)
                result = generate(
                    self.model, batch, max_gen, stop_tokens=self.rule.stop_ids,
                    finished=stop_text, max_length=reach,
                )  # fmt: skip
                for i, tokens in zip(chunk, result.tokens):
                    text = postprocess_generated_text(self.tok_decode(tokens), until, None)
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return results
