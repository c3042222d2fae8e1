"""What Megatron ``args`` mean for a checkpoint's tensors (the model options themselves are the one
table in :mod:`pretrain.model_options`).

* zero-centred norm weights (``apply_layernorm_1p``): readers add 1 to every norm gamma;
* an untied output layer's local name;
* a BERT whose MLM head and layers would run different GeLUs is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

from pretrain.model_options import is_mcore
from pretrain.utils.errors import UserError

_HEAD = "word_embeddings_for_head.weight"
OUTPUT_LAYER = "language_model.output_layer.weight"


def is_zero_centred_norm(name: str) -> bool:
    """Norm weights that ``apply_layernorm_1p`` stores minus 1 (every LayerNorm/RMSNorm gamma)."""
    return name.endswith("layernorm.weight")


def untie_head_names(local_to_key: dict[str, str]) -> dict[str, str]:
    """For untied models: the output layer (megatron-core ``output_layer``) is our ``output_layer``."""
    out = dict(local_to_key)
    if _HEAD in out and OUTPUT_LAYER not in out:
        out[OUTPUT_LAYER] = out.pop(_HEAD)
    return out


def check_bert_gelu(args: Mapping[str, object], layers_gelu: object, source: str) -> None:
    """Refuse a BERT whose MLM head runs another GeLU than its layers (we run one GeLU).

    The head's GeLU ignores the fused bias-GeLU kernel: megatron-core's ``BertLMHead`` always runs
    exact ``F.gelu``; the legacy head runs tanh only for ``openai_gelu``. So ``bias_gelu_fusion``
    without ``openai_gelu`` (tanh layers, exact head) has no mlm-toolkit counterpart.
    """
    head = "tanh" if not is_mcore(args) and args.get("openai_gelu") else "erf"
    if head != layers_gelu:
        raise UserError(
            f"{source}: args.bias_gelu_fusion={args.get('bias_gelu_fusion')!r} on a BERT: its layers run "
            f"{layers_gelu} GeLU but its MLM head {head} GeLU; mlm-toolkit BERT runs one GeLU throughout"
        )
