"""GLUE readers (official TSV and HF datasets), pair encoding, evaluation names, submission files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from finetune.builtin import builtin_task_dir
from finetune.builtin.generate import NEGATIVE, POSITIVE, generate
from finetune.glue import (
    evaluate_glue,
    read_glue_hf,
    read_glue_split,
    read_glue_tsv,
    resolve_task_dir,
    write_glue_submission,
)
from finetune.glue_tasks import GLUE_TASKS, glue_task
from finetune.tokenization import PairEncoder, clean_text, truncate_seq_pair
from pretrain.utils.errors import UserError
from pretrain.utils.results import TASK_METRICS
from tests.finetune_wordpiece import tiny_wordpiece

MNLI_HEAD = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
    "sentence1_parse\tsentence2_parse\tsentence1\tsentence2"
)


def _mnli_row(i: int, s1: str, s2: str, labels: list[str]) -> str:
    return "\t".join(
        [str(i), "31193", f"{i}n", "government", "( x )", "( y )", "(ROOT x)", "(ROOT y)", s1, s2, *labels]
    )


def _write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture()
def glue_dir(tmp_path: Path) -> Path:
    """A glue_data/ tree with every task in the official formats (header lines as distributed)."""
    root = tmp_path / "glue_data"
    _write(
        root / "MNLI/train.tsv",
        [
            MNLI_HEAD + "\tlabel1\tgold_label",
            _mnli_row(0, 'He said "yes" to it.', "He agreed.", ["entailment", "entailment"]),
            _mnli_row(1, "The cat sleeps.", "The cat runs.", ["contradiction", "contradiction"]),
            _mnli_row(2, "A man walks.", "A man walks home.", ["neutral", "neutral"]),
        ],
    )
    dev_head = MNLI_HEAD + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label"
    for kind in ("matched", "mismatched"):
        _write(
            root / f"MNLI/dev_{kind}.tsv",
            [
                dev_head,
                _mnli_row(7, "It rains.", "It is wet.", ["entailment"] * 5 + ["entailment"]),
                _mnli_row(8, "It rains.", "It is dry.", ["contradiction"] * 5 + ["contradiction"]),
            ],
        )
        _write(root / f"MNLI/test_{kind}.tsv", [MNLI_HEAD, _mnli_row(9, "Snow.", "Cold.", [])])
    _write(
        root / "QQP/train.tsv",
        [
            "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
            "133273\t213221\t213222\tHow is the life of a math student?\tWhich level of math is best?\t0",
            "402555\t536040\t536041\tHow do I control my emotions?\tHow do you control emotions?\t1",
        ],
    )
    _write(root / "QQP/test.tsv", ["id\tquestion1\tquestion2", "0\tWhy am I here?\tWhy are we here?"])
    _write(
        root / "CoLA/train.tsv",
        ["gj04\t1\t\tOur friends won't buy this analysis.", "gj04\t0\t*\tThey drank the pub."],
    )
    _write(root / "CoLA/test.tsv", ["index\tsentence", "0\tBill whistled past the house."])
    _write(root / "SST-2/train.tsv", ["sentence\tlabel", "hide new secretions from the parental units \t0"])
    _write(root / "SST-2/test.tsv", ["index\tsentence", "0\tuneasy mishmash of styles and genres ."])
    _write(
        root / "MRPC/train.tsv",
        [
            "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
            "1\t702876\t702977\tAmrozi accused his brother.\tReferring to him, Amrozi accused his brother.",
        ],
    )
    _write(
        root / "MRPC/test.tsv",
        ["index\t#1 ID\t#2 ID\t#1 String\t#2 String", "0\t1089874\t1089925\tPCCW said.\tPCCW added."],
    )
    stsb_head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
    _write(
        root / "STS-B/train.tsv",
        [
            stsb_head + "\tscore",
            "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\t"
            "A plane is taking off.\tAn air plane is taking off.\t5.000",
        ],
    )
    _write(root / "STS-B/test.tsv", [stsb_head, "0\tmain-news\tx\t2016\t1\tnone\tnone\tA cat.\tA dog."])
    for task, dirname, a, b, label in (
        ("qnli", "QNLI", "question", "sentence", "not_entailment"),
        ("rte", "RTE", "sentence1", "sentence2", "entailment"),
        ("wnli", "WNLI", "sentence1", "sentence2", "1"),
    ):
        _write(
            root / f"{dirname}/train.tsv",
            [f"index\t{a}\t{b}\tlabel", f"0\tText A of {task}.\tText B.\t{label}"],
        )
        _write(root / f"{dirname}/dev.tsv", [f"index\t{a}\t{b}\tlabel", f"5\tDev A.\tDev B.\t{label}"])
        _write(root / f"{dirname}/test.tsv", [f"index\t{a}\t{b}", "0\tTest A.\tTest B."])
    return root


def test_mnli_reader_label_mapping_and_splits(glue_dir: Path) -> None:
    train = read_glue_split("mnli", glue_dir, "train")
    assert [e.label for e in train] == [1, 0, 2]  # entailment 1, contradiction 0, neutral 2
    assert train[0].text_a == 'He said "yes" to it.'  # bare quotes survive (no CSV quoting)
    assert (train[0].uid, train[0].text_b) == ("0", "He agreed.")
    assert train[1].source.endswith("MNLI/train.tsv:3")
    task = glue_task("mnli")
    assert task.dev_splits == ("dev_matched", "dev_mismatched")
    assert task.test_splits == ("test_matched", "test_mismatched")
    dev = read_glue_split(task, glue_dir / "MNLI", "dev_mismatched")  # task dir works as well as the root
    assert [(e.uid, e.label) for e in dev] == [("7", 1), ("8", 0)]
    test = read_glue_split(task, glue_dir, "test_matched")
    assert [(e.uid, e.text_a, e.text_b, e.label) for e in test] == [("9", "Snow.", "Cold.", None)]


def test_every_task_reads_train_and_test(glue_dir: Path) -> None:
    expected = {  # task: (first train (uid, a, b, label), test (uid, a, b))
        "qqp": (
            ("133273", "How is the life of a math student?", "Which level of math is best?", 0),
            ("0", "Why am I here?", "Why are we here?"),
        ),
        "cola": (
            ("0", "Our friends won't buy this analysis.", None, 1),
            ("0", "Bill whistled past the house.", None),
        ),
        "sst2": (
            ("0", "hide new secretions from the parental units", None, 0),
            ("0", "uneasy mishmash of styles and genres .", None),
        ),
        "mrpc": (
            ("0", "Amrozi accused his brother.", "Referring to him, Amrozi accused his brother.", 1),
            ("0", "PCCW said.", "PCCW added."),
        ),
        "stsb": (
            ("0", "A plane is taking off.", "An air plane is taking off.", 5.0),
            ("0", "A cat.", "A dog."),
        ),
        "qnli": (("0", "Text A of qnli.", "Text B.", 1), ("0", "Test A.", "Test B.")),
        "rte": (("0", "Text A of rte.", "Text B.", 0), ("0", "Test A.", "Test B.")),
        "wnli": (("0", "Text A of wnli.", "Text B.", 1), ("0", "Test A.", "Test B.")),
    }
    for name, (train_row, test_row) in expected.items():
        e = read_glue_split(name, glue_dir, "train")[0]
        assert (e.uid, e.text_a, e.text_b, e.label) == train_row, name
        t = read_glue_split(name, glue_dir, "test")[0]
        assert (t.uid, t.text_a, t.text_b, t.label) == (*test_row, None), name
    cola = read_glue_split("cola", glue_dir, "train")
    assert [e.label for e in cola] == [1, 0] and cola[1].uid == "1"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (_mnli_row(3, "A.", "B.", ["neutral", "maybe"]), "train.tsv:5 column 12: mnli label 'maybe'"),
        ("3\tshort row", "train.tsv:5: 2 tab-separated columns, expected 12"),
        (_mnli_row(3, "  ", "B.", ["neutral", "neutral"]), "train.tsv:5 column 9: empty text"),
    ],
)
def test_bad_rows_name_file_line_and_column(glue_dir: Path, line: str, message: str) -> None:
    path = glue_dir / "MNLI/train.tsv"
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        read_glue_split("mnli", glue_dir, "train")
    assert len(read_glue_tsv("mnli", "train", path, on_bad_row="skip")) == 3


def test_wrong_file_and_bad_scores_are_user_errors(glue_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"QQP/train.tsv:1: header has 6 columns, expected 4"):
        read_glue_tsv("qnli", "train", glue_dir / "QQP/train.tsv")
    with pytest.raises(
        UserError, match=r"RTE/train.tsv:1 column 2: header is 'sentence1', expected 'question'"
    ):
        read_glue_tsv("qnli", "train", glue_dir / "RTE/train.tsv")
    bad = _write(
        tmp_path / "stsb.tsv",
        [
            "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
            "0\tg\tf\ty\t1\tn\tn\tA.\tB.\t5.5",
        ],
    )
    with pytest.raises(UserError, match=r"stsb.tsv:2 column 10: stsb score 5.5 is outside"):
        read_glue_tsv("stsb", "train", bad)
    with pytest.raises(UserError, match="no qqp files"):
        resolve_task_dir("qqp", tmp_path)
    with pytest.raises(UserError, match="unknown GLUE task"):
        glue_task("squad")


def test_hf_datasets_mnli_labels_are_remapped() -> None:
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {
            "premise": datasets.Value("string"),
            "hypothesis": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["entailment", "neutral", "contradiction"]),
            "idx": datasets.Value("int32"),
        }
    )
    data = {
        "premise": ["p0", "p1", "p2", "p3"],
        "hypothesis": ["h0", "h1", "h2", "h3"],
        "label": [0, 1, 2, 0],
        "idx": [0, 1, 2, 3],
    }
    dd = datasets.DatasetDict({"validation_matched": datasets.Dataset.from_dict(data, features=features)})
    ex = read_glue_hf("mnli", dd, "dev_matched")
    assert [e.label for e in ex] == [1, 2, 0, 1]  # entailment 1, neutral 2, contradiction 0
    assert (ex[2].text_a, ex[2].text_b, ex[2].uid) == ("p2", "h2", "2")
    test = datasets.Dataset.from_dict({"premise": ["p"], "hypothesis": ["h"], "label": [-1], "idx": [0]})
    assert read_glue_hf("mnli", test, "test_matched")[0].label is None
    wrong = datasets.Dataset.from_dict(
        data,
        features=datasets.Features(
            {**features, "label": datasets.ClassLabel(names=["contradiction", "entailment", "neutral"])}
        ),
    )
    with pytest.raises(UserError, match="label names"):
        read_glue_hf("mnli", wrong, "dev_matched")
    sst = datasets.Dataset.from_dict({"sentence": ["good", "bad"], "label": [1, 0], "idx": [0, 1]})
    assert [(e.text_a, e.text_b, e.label) for e in read_glue_hf("sst2", sst, "train")] == [
        ("good", None, 1),
        ("bad", None, 0),
    ]


def test_evaluate_glue_names_match_the_leaderboard_schema() -> None:
    for name, task in GLUE_TASKS.items():
        labels = np.array([0.0, 1.0, 1.0, 0.5]) if task.is_regression else np.array([0, 1, 1, 0])
        results = {split: (labels, labels) for split in task.dev_splits}
        metrics = evaluate_glue(task, results)
        assert set(metrics) == set(TASK_METRICS[name]), name
        assert all(v == pytest.approx(100.0) for v in metrics.values()), name
    m = evaluate_glue(
        "mnli", {"dev_matched": ([1, 0, 2, 2], [1, 0, 2, 0]), "dev_mismatched": ([0, 0], [1, 0])}
    )
    assert m == {"accuracy_m": 75.0, "accuracy_mm": 50.0}


def test_submission_files(tmp_path: Path) -> None:
    path = write_glue_submission("mnli", ["9", "10", "11"], [1, 0, 2], tmp_path / "MNLI-m.tsv")
    assert path.read_text() == "index\tprediction\n9\tentailment\n10\tcontradiction\n11\tneutral\n"
    assert glue_task("mnli").split("test_mismatched").submission_file == "MNLI-mm.tsv"
    write_glue_submission("stsb", [0, 1], [5.7, 2.34567], tmp_path / "STS-B.tsv")
    assert (tmp_path / "STS-B.tsv").read_text() == "index\tprediction\n0\t5.000\n1\t2.346\n"
    write_glue_submission("qnli", [0], np.array([1]), tmp_path / "QNLI.tsv")
    assert (tmp_path / "QNLI.tsv").read_text().splitlines()[1] == "0\tnot_entailment"
    with pytest.raises(UserError, match="not a class id"):
        write_glue_submission("cola", [0], [2], tmp_path / "CoLA.tsv")
    with pytest.raises(UserError, match="2 ids but 1 predictions"):
        write_glue_submission("cola", [0, 1], [1], tmp_path / "CoLA.tsv")


def test_truncate_seq_pair_pops_from_the_longer() -> None:
    a, b = list("abcdef"), list("xyz")
    truncate_seq_pair(a, b, 6)
    assert (a, b) == (list("abc"), list("xyz"))
    a, b = list("ab"), list("wxyz")
    truncate_seq_pair(a, b, 3)
    assert (a, b) == (list("ab"), list("w"))  # B 4->2, then the 2/2 tie pops from B
    assert clean_text("a\nb   c . d") == "a b c. d"


def test_pair_encoder_layout_types_padding_and_truncation() -> None:
    tok = tiny_wordpiece(["the cat sat on the mat", "a dog ran in the park"], vocab_size=80)
    enc = PairEncoder(tok, max_seq_length=12)
    cls, sep, pad = enc.cls_id, enc.sep_id, enc.pad_id
    assert (cls, sep, pad) == (tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]"), tok.token_to_id("[PAD]"))
    out = enc.encode_ids([10, 11], [20, 21, 22])
    assert out.input_ids == [cls, 10, 11, sep, 20, 21, 22, sep, pad, pad, pad, pad]
    assert out.token_type_ids == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    assert out.attention_mask == [1] * 8 + [0] * 4
    assert (out.len_a, out.len_b, out.b_start) == (2, 3, 4)
    single = enc.encode_ids(list(range(30, 45)))
    assert single.input_ids == [cls, *range(30, 40), sep] and single.token_type_ids == [0] * 12
    pair = enc.encode_ids(list(range(30, 45)), [1, 2, 3])  # budget 9: A 15 -> 6, B keeps 3
    assert pair.input_ids == [cls, *range(30, 36), sep, 1, 2, 3, sep]
    assert pair.token_type_ids == [0] * 8 + [1] * 4
    cap = enc.encode_ids([5, 6], list(range(30, 45)), truncation="cap")  # A whole, B cut at its end
    assert cap.input_ids == [cls, 5, 6, sep, *range(30, 37), sep]
    text = enc.encode("The cat sat.", "A dog ran.")
    assert text.input_ids[: text.len_a + text.len_b + 3] == [
        cls,
        *tok.encode("The cat sat.", add_special_tokens=False).ids,
        sep,
        *tok.encode("A dog ran.", add_special_tokens=False).ids,
        sep,
    ]


def test_pair_encoder_accepts_transformers_fast_tokenizer() -> None:
    transformers = pytest.importorskip("transformers")
    tok = tiny_wordpiece(["the cat sat on the mat"], vocab_size=60)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]"
    )
    fast("the cat " * 50, truncation=True, max_length=4)  # leaves truncation set on its backend
    a, b = PairEncoder(fast, 64), PairEncoder(tok, 64)
    text = "the cat sat on the mat " * 5
    assert a.tokenize_with_offsets(text) == b.tokenize_with_offsets(text)
    assert len(a.tokenize(text)) > 4  # our private backend copy is not truncated
    with pytest.raises(UserError, match="not a Hugging Face fast tokenizer"):
        PairEncoder(object(), 16)


def test_builtin_sst2_tiny_is_learnable_and_reproducible(tmp_path: Path) -> None:
    root = builtin_task_dir("sst2_tiny")
    train, dev = read_glue_split("sst2", root, "train"), read_glue_split("sst2", root, "dev")
    assert (len(train), len(dev)) == (200, 60)
    assert sum(e.label for e in train) == 100 and sum(e.label for e in dev) == 30  # type: ignore[misc]
    assert not {e.text_a for e in train} & {e.text_a for e in dev}
    for e in train + dev:
        words = set(e.text_a.split())
        assert bool(words & set(POSITIVE)) == (e.label == 1) and bool(words & set(NEGATIVE)) == (e.label == 0)
    generate(tmp_path)  # the shipped files are exactly the generator's output
    for path in sorted(p for p in tmp_path.rglob("*") if p.is_file()):
        shipped = root.parent / path.relative_to(tmp_path)
        assert shipped.read_bytes() == path.read_bytes(), shipped
    with pytest.raises(UserError, match="unknown built-in"):
        builtin_task_dir("nope")
