"""``mlm-generate --hf-model``: the same flags on a local Hugging Face causal LM (``transformers`` generate)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from mlm_eval.generation.stream import TextStream, cut_at_stop
from pretrain.config import DTypeFlags
from pretrain.inference.sampling import SamplingConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.utils.errors import UserError


def run_hf(
    args: argparse.Namespace,
    prompts: list[str],
    sampling: SamplingConfig,
    *,
    parallel: ParallelConfig,
    dtype: DTypeFlags,
) -> int:
    """Generate for each prompt in one process; stream to stdout or print JSON lines."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if parallel.model_parallel_size > 1 or parallel.ep > 1:
        raise UserError("--hf-model runs in one process; TP/PP/EP generation needs --ckpt DIR")
    path = Path(args.hf_model)
    if not path.is_dir():
        raise UserError(f"--hf-model {path}: not a directory")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"--hf-model {path}: cannot load ({str(exc).splitlines()[0]})") from None
    model = model.to(device=args.device, dtype=getattr(torch, dtype.dtype_name())).eval()
    kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "do_sample": not sampling.greedy,
                              "use_cache": not args.no_cache, "pad_token_id": tok.eos_token_id}  # fmt: skip
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
    if args.stop:
        kwargs.update(stop_strings=list(args.stop), tokenizer=tok)

    def decode(out: list[int]) -> str:  # as HF users read generated text (and as --ckpt prints it)
        return str(tok.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    for i, prompt in enumerate(prompts):
        torch.manual_seed(sampling.seed + i)
        ids = torch.tensor([_prompt_ids(args, tok, prompt) or [tok.eos_token_id]], device=args.device)
        stream = None if args.json else TextStream(decode, args.stop, show=True)
        if stream is not None:
            stream.start(prompt)
        with torch.no_grad():
            out = model.generate(ids, streamer=_feed(stream), **kwargs)[0, ids.shape[1] :].tolist()
        if stream is not None:
            stream.finish()
        if tok.eos_token_id in out:
            out = out[: out.index(tok.eos_token_id)]
        if args.json:
            text, stopped = cut_at_stop(decode(out), args.stop)
            print(json.dumps({"index": i, "prompt": prompt, "text": text, "tokens": out, "stopped": stopped}))
    return 0


def _prompt_ids(args: argparse.Namespace, tok: Any, prompt: str) -> list[int]:
    """The prompt's ids; with ``--apply-chat-template`` one user message in the chat template
    (``--chat-template FILE`` or the tokenizer's), the assistant's turn opened."""
    if not getattr(args, "apply_chat_template", False):
        return list(tok.encode(prompt, add_special_tokens=False))
    template = getattr(args, "chat_template_text", None)
    if template is None and not getattr(tok, "chat_template", None):
        raise UserError(
            f"--hf-model {args.hf_model}: the tokenizer has no chat template (--chat-template FILE)"
        )
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], chat_template=template,
                                   tokenize=False, add_generation_prompt=True)  # fmt: skip
    return list(tok.encode(text, add_special_tokens=False))


def _feed(stream: Any) -> Any:
    """A ``transformers`` streamer handing each generated id to ``stream`` (a ``TextStream``), or None."""
    if stream is None:
        return None
    from transformers.generation.streamers import BaseStreamer

    class Feed(BaseStreamer):  # type: ignore[misc]
        prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if not self.prompt_seen:  # generate() first puts the prompt
                self.prompt_seen = True
                return
            for token in value.reshape(-1).tolist():
                stream.add(0, int(token))

        def end(self) -> None:
            return None

    return Feed()
