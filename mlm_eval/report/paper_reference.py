"""The Megatron-LM paper's published numbers (Shoeybi et al., 2019), as leaderboard reference rows.

These are references, not runs: the report shows them apart from runs, never ranks them and
never marks them best. Values are on the report's display scale (percent for accuracies).

* Table 3 (zero-shot): GPT-2 355M / 2.5B / 8.3B, WikiText-103 adjusted perplexity (lower is
  better) and LAMBADA strict cloze accuracy, plus the previous state of the art (WikiText-103 from
  Khandelwal et al. 2019, LAMBADA from Radford et al. 2019). All three models were trained for
  300k iterations (Figure 6 caption).
* Table 5 (finetuned BERT): 336M / 1.3B / 3.9B, MNLI m/mm accuracy, QQP accuracy, SQuAD 1.1 and
  2.0 F1 / EM (dev), RACE accuracy all (middle / high) (test); medians over 5 seeds. 336M and 1.3B
  were trained for 2M iterations, 3.9B for 1.5M (section 5.3). The 5-way ensemble row of the 3.9B
  model (SQuAD and RACE only) is included and marked as an ensemble.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PAPER_CITATION = (
    "Shoeybi et al., Megatron-LM: Training Multi-Billion Parameter Language Models Using Model "
    "Parallelism (2019)"
)


@dataclass(frozen=True, kw_only=True)
class PaperRow:
    """One published row: ``values`` maps (task, metric) to the published number."""

    name: str
    table: str
    kind: str
    parameters: int | None
    iteration: int | None
    note: str
    values: Mapping[tuple[str, str], float]


def _zero_shot(name: str, params: int | None, ppl: float, acc: float, note: str) -> PaperRow:
    return PaperRow(
        name=name,
        table="Table 3",
        kind="eval",
        parameters=params,
        iteration=300_000 if params else None,
        note=note,
        values={("wikitext103", "adjusted_ppl"): ppl, ("lambada", "accuracy"): acc},
    )


def _finetuned(name: str, params: int, iteration: int, scores: tuple[float, ...]) -> PaperRow:
    m, mm, qqp, sq1_f1, sq1_em, sq2_f1, sq2_em, race, race_m, race_h = scores
    return PaperRow(
        name=name,
        table="Table 5",
        kind="finetune",
        parameters=params,
        iteration=iteration,
        note="median over 5 seeds; dev sets, RACE test set",
        values={
            ("mnli", "accuracy_m"): m,
            ("mnli", "accuracy_mm"): mm,
            ("qqp", "accuracy"): qqp,
            ("squad1", "f1"): sq1_f1,
            ("squad1", "exact_match"): sq1_em,
            ("squad2", "f1"): sq2_f1,
            ("squad2", "exact_match"): sq2_em,
            ("race", "accuracy"): race,
            ("race", "accuracy_middle"): race_m,
            ("race", "accuracy_high"): race_h,
        },
    )


PAPER_ROWS: tuple[PaperRow, ...] = (
    _zero_shot("Megatron GPT-2 355M", 355_000_000, 19.31, 45.18, "zero-shot"),
    _zero_shot("Megatron GPT-2 2.5B", 2_500_000_000, 12.76, 61.73, "zero-shot"),
    _zero_shot("Megatron GPT-2 8.3B", 8_300_000_000, 10.81, 66.51, "zero-shot"),
    _zero_shot(
        "Previous SOTA",
        None,
        15.79,
        63.24,
        "WikiText-103: Khandelwal et al. 2019; LAMBADA: Radford et al. 2019",
    ),
    _finetuned(
        "Megatron BERT 336M",
        336_000_000,
        2_000_000,
        (89.7, 90.0, 92.3, 94.2, 88.0, 88.1, 84.8, 83.0, 86.9, 81.5),
    ),
    _finetuned(
        "Megatron BERT 1.3B",
        1_300_000_000,
        2_000_000,
        (90.9, 91.0, 92.6, 94.9, 89.1, 90.2, 87.1, 87.3, 90.4, 86.1),
    ),
    _finetuned(
        "Megatron BERT 3.9B",
        3_900_000_000,
        1_500_000,
        (91.4, 91.4, 92.7, 95.5, 90.0, 91.2, 88.5, 89.5, 91.8, 88.6),
    ),
    PaperRow(
        name="Megatron BERT 3.9B ensemble (5-way)",
        table="Table 5",
        kind="finetune",
        parameters=3_900_000_000,
        iteration=1_500_000,
        note="5-way ensemble, not a single model",
        values={
            ("squad1", "f1"): 95.8,
            ("squad1", "exact_match"): 90.5,
            ("squad2", "f1"): 91.7,
            ("squad2", "exact_match"): 89.0,
            ("race", "accuracy"): 90.9,
            ("race", "accuracy_middle"): 93.1,
            ("race", "accuracy_high"): 90.0,
        },
    ),
)
