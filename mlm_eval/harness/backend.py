"""The lm-evaluation-harness model ``mlm``: our checkpoints, any layout, TP x PP x DP.

``lm_eval --model mlm --model_args ckpt=DIR[,dtype=bf16,batch_size=16,tp=2,pp=2,ep=2,etp=1] --tasks ...``
(see :mod:`mlm_eval.harness.cli` for how the name is found). Under ``torchrun`` every process
reports ``rank 0 / world 1`` to the harness, so each sees all requests (the harness neither
splits nor pads them); the :class:`~mlm_eval.harness.engine.HarnessEngine` deals them to the
data-parallel replicas, each request is computed exactly once, and every rank gets all results.
The harness builds and writes results only where ``LOCAL_RANK == 0``.

The three request types follow the harness's ``HFLM`` token by token (same context cut, same
rolling windows, same stop handling), with log-probabilities in float64 over the true
vocabulary and the output layer only at scored positions.
"""

from __future__ import annotations

import atexit
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (the harness's own models first: it skips them if the registry is not empty)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import simple_parse_args_string
from tqdm import tqdm

from mlm_eval.harness.engine import EngineConfig, HarnessEngine
from mlm_eval.harness.requests import Row, loglikelihood_row, rolling_rows
from pretrain.inference.generate import GenerationConfig
from pretrain.inference.sampling import SamplingConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.tokenizer.chat import chat_template_of, read_template_file, render_chat
from pretrain.tokenizer.factory import TokenizerConfig
from pretrain.utils.errors import UserError


def _load_engine(
    ckpt: str | None, *, parallel: ParallelConfig, device: str, dtype: str, batch_size: int,
    tokenizer: TokenizerConfig | None,
) -> HarnessEngine:  # fmt: skip
    """The engine of ``--model_args ckpt=DIR`` (closed at exit)."""
    if not ckpt:
        raise UserError("--model mlm needs --model_args ckpt=DIR")
    engine = HarnessEngine.load(
        EngineConfig(
            ckpt=str(ckpt),
            parallel=parallel,
            device=device,
            dtype=dtype,
            batch_size=batch_size,
            tokenizer=tokenizer,
        )  # fmt: skip
    )
    atexit.register(engine.close)
    return engine


@register_model("mlm", "mlm-toolkit")
class MLMHarnessLM(TemplateLM):
    """``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` on an mlm-toolkit checkpoint."""

    def __init__(
        self,
        ckpt: str | None = None,
        *,
        dtype: str = "float32",
        batch_size: int | str | None = 16,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        device: str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        use_cache: bool = True,
        seed: int = 1234,
        add_bos_token: bool = False,
        tokenizer_type: str | None = None,
        vocab_file: str | None = None,
        merge_file: str | None = None,
        tokenizer_model: str | None = None,
        chat_template: str | None = None,
        max_batch_size: int | None = None,
        engine: HarnessEngine | None = None,
        **unused: Any,
    ) -> None:
        super().__init__()
        if not device or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            device = "cpu"  # the harness CLI's default is cuda:0 (its hf backend falls back to CPU too)
        size = _batch_size(batch_size)
        # model_args chat_template=FILE: --apply_chat_template renders with it (checked before loading)
        self._chat_template = (
            None if chat_template is None else read_template_file(chat_template, flag="chat_template")
        )
        if engine is None:
            tok = None
            if tokenizer_type is not None:
                tok = TokenizerConfig(tokenizer_type=tokenizer_type, vocab_file=vocab_file, merge_file=merge_file,
                                      model_path=tokenizer_model)  # fmt: skip
            parallel = _layout(tp=int(tp), pp=int(pp), ep=int(ep), etp=None if etp is None else int(etp))
            engine = _load_engine(
                ckpt, parallel=parallel, device=device, dtype=str(dtype), batch_size=size, tokenizer=tok
            )
        self.engine = engine
        self.tok = self.engine.tokenizer
        self._max_length = int(max_length) if max_length else self.engine.max_length
        if self._max_length > self.engine.max_length:
            raise UserError(f"max_length={max_length} exceeds the model's {self.engine.max_length} positions")
        self.max_gen_toks = int(max_gen_toks)
        self.use_cache = bool(use_cache)
        self.seed = int(seed)
        self.add_bos_token = bool(add_bos_token)
        self.batch_size = engine.batch_size
        self._device = device

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> MLMHarnessLM:
        """``--model_args`` as the harness parses them (see :meth:`create_from_arg_obj`)."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> MLMHarnessLM:
        """``--model_args`` over the harness-wide settings: a key given in both (``batch_size``,
        ``device``, ``max_batch_size``) takes the ``--model_args`` value, where the harness's own
        ``create_from_arg_*`` pass it twice (``TypeError``); an unknown key is one line naming it."""
        check_model_args(arg_dict)
        harness = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **harness)

    # --- what the harness asks of a model -------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eod = self.tok.eod
        if eod is None:
            raise UserError("the checkpoint's tokenizer has no end-of-document token")
        return int(eod)

    @property
    def prefix_token_id(self) -> int:
        """BOS if the tokenizer has one, else EOD (the harness's ``HFLM`` rule)."""
        bos = getattr(self.tok, "bos", None)
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        """Fingerprints the harness's request cache: the tokenizer's directory (as ``HFLM``'s
        ``name_or_path``), else its type."""
        path = getattr(self.tok, "model_path", None)
        return str(path).replace("/", "__") if path else type(self.tok).__name__

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template ``--apply_chat_template`` renders with (recorded in the harness's results)."""
        if chat_template is False or chat_template is None:
            return None
        return chat_template_of(self.tok, self._chat_template, source=self._chat_source)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """``chat_history`` as prompt text, as the harness's ``hf`` backend renders it: the assistant's
        turn opened, or (``add_generation_prompt=False``) the last message left open to continue."""
        return render_chat(self.tok, chat_history, add_generation_prompt=add_generation_prompt,
                           template=self._chat_template, source=self._chat_source)  # fmt: skip

    @property
    def _chat_source(self) -> str:
        return "model_args chat_template" if self._chat_template is not None else "the checkpoint's tokenizer"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        ids = list(self.tok.tokenize(string))
        if self.add_bos_token and add_special_tokens is not False:
            ids = [self.prefix_token_id, *ids]
        return ids

    def tok_decode(self, ids: list[int]) -> str:
        return str(self.tok.detokenize(ids))

    def get_model_info(self) -> dict[str, Any]:
        """Recorded in the harness's results ``config``."""
        # the batch size used (the harness's config.batch_size is its --batch_size, not --model_args')
        return {**{f"mlm_{k}": v for k, v in self.engine.info.items()}, "mlm_batch_size": self.batch_size}

    # --- request types ------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str], list[int], list[int]]],
        disable_tqdm: bool = False,
        **_: Any,
    ) -> list[tuple[float, bool]]:
        rows = [loglikelihood_row(ctx, cont, self.max_length) for _, ctx, cont in requests]
        scored = self.engine.score(rows, desc="loglikelihood")
        out = [(-sum(r.nll), all(r.is_argmax)) for r in scored]
        for (pair, _ctx, _cont), answer in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", pair, answer)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        rows: list[Row] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            (string,) = req.args
            windows = rolling_rows(self.tok_encode(string), self.prefix_token_id, self.max_length)
            rows += windows
            owner += [i] * len(windows)
        totals = [0.0] * len(requests)
        for i, row in zip(owner, self.engine.score(rows, desc="loglikelihood_rolling"), strict=True):
            totals[i] -= sum(row.nll)
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        results: list[str] = [""] * len(requests)
        bar = tqdm(
            total=len(requests), desc="generate_until", disable=disable_tqdm or not self.engine.is_main
        )
        for idx in groups.values():
            texts = self._generate_group([requests[i].args[0] for i in idx], requests[idx[0]].args[1], bar)
            for i, text in zip(idx, texts, strict=True):
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        bar.close()
        return results

    def _generate_group(self, contexts: list[str], gen_kwargs: dict[str, Any], bar: tqdm) -> list[str]:
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id]))
        max_new = int(kwargs.pop("max_gen_toks"))
        if max_new >= self.max_length:
            raise UserError(
                f"max_gen_toks {max_new} must be less than the model's max_length {self.max_length}"
            )
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        greedy = not kwargs.get("do_sample") or temperature == 0.0
        sampling = SamplingConfig(greedy=greedy, temperature=temperature if not greedy else 1.0,
                                  top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0),
                                  seed=self.seed)  # fmt: skip
        prompts = [self.tok_encode(c)[-(self.max_length - max_new) :] for c in contexts]
        gen = GenerationConfig(max_new_tokens=max_new, sampling=sampling, use_cache=self.use_cache,
                               eos_id=self.eot_token_id, pad_id=self.eot_token_id)  # fmt: skip
        stops = [s for s in until if s]

        def stop(_: int, ids: list[int]) -> bool:
            text = self.tok_decode(ids)
            return any(s in text for s in stops)

        ids = self.engine.generate(prompts, gen, stop=stop, progress=bar.update)
        return [postprocess_generated_text(self.tok_decode(x), until, None) for x in ids]


def check_model_args(arg_dict: Mapping[str, object]) -> None:
    """What ``--model_args`` of ``--model mlm`` can be checked without loading anything, with the
    lines the constructor's own checks give: every key an option, ``ckpt`` given and present,
    ``batch_size`` a positive integer or ``auto``, ``chat_template`` a readable template file.
    ``mlm-lm-eval`` runs this before the harness indexes and loads its tasks (seconds)."""
    known = model_arg_names()
    unknown = sorted(set(arg_dict) - known)
    if unknown:
        raise UserError(
            f"--model_args {unknown[0]}={arg_dict[unknown[0]]}: not an option of --model mlm "
            f"(options: {', '.join(sorted(known))})"
        )
    ckpt = arg_dict.get("ckpt")
    if not ckpt:
        raise UserError("--model mlm needs --model_args ckpt=DIR")
    if not Path(str(ckpt)).exists():
        raise UserError(f"--ckpt {ckpt}: no such directory")
    if "batch_size" in arg_dict:
        _batch_size(arg_dict["batch_size"])  # type: ignore[arg-type]
    if arg_dict.get("chat_template") is not None:
        read_template_file(str(arg_dict["chat_template"]), flag="chat_template")


def model_arg_names() -> set[str]:
    """The ``--model_args`` keys ``--model mlm`` takes: its constructor's keyword parameters."""
    params = inspect.signature(MLMHarnessLM.__init__).parameters.values()
    return {p.name for p in params if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD} - {
        "self",
        "engine",
    }


def _layout(*, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> ParallelConfig:
    """``model_args`` ``tp``/``pp``/``ep``/``etp`` as the layout (the harness's wording for a size below 1)."""
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("etp", 1 if etp is None else etp)):
        if value < 1:
            raise UserError(f"model_args {name}={value}: must be >= 1")
    return ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp)


def _batch_size(value: int | str | None) -> int:
    """Rows per forward: ``auto``/``auto:N`` (no search here) and ``None`` mean 16."""
    if value is None or str(value).startswith("auto"):
        return 16
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1 or str(size) != str(value).strip():
        raise UserError(f"batch_size={value}: expected a positive integer or 'auto'")
    return size
