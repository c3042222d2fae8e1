"""``mlm-convert``: inspect, reshard and convert Megatron-layout checkpoints.

::

    mlm-convert inspect CKPT [--json]
    mlm-convert reshard --load CKPT --save NEW --target-tp 4 --target-pp 1 [--target-vp V]
    mlm-convert to-hf --load CKPT --save HFDIR [--tokenizer-dir TOK] [--verify per-layer | --no-verify]
    mlm-convert from-hf --load HFDIR --save CKPT --tp 2 --pp 2 [--vp 2]

``CKPT`` is a checkpoint root (with ``latest_checkpointed_iteration.txt``) or one iteration
directory, written by mlm-toolkit or by Megatron-LM (legacy ``torch`` format of any era, or
``torch_dist``). Every output directory is written under a temporary sibling and renamed when
complete. User errors print one line and exit with code 2; ``inspect`` exits 1 when the
checkpoint is inconsistent. ``inspect``, ``reshard`` and ``to-hf`` take the shared tokenizer flags
(``--tokenizer-type``/``--vocab-file``/``--merge-file``/``--tokenizer-model`` or ``--tokenizer-dir``;
e.g. local copies of the files an upstream checkpoint's ``args`` name on its training cluster).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.config import ParallelConfig
from pretrain.models.families.registry import supported_architectures, supported_model_types
from pretrain.tokenizer.flags import TokenizerFlags
from pretrain.utils.cli import OneLineParser
from pretrain.utils.errors import UserError, cli_entry
from pretrain.utils.flag_groups import add_flag_group, flags_from_namespace, renamed_flag_errors
from pretrain.utils.outputs import check_writable_output

if TYPE_CHECKING:
    from pretrain.checkpoint.types import CheckpointReader, TensorSource
    from pretrain.tokenizer.base import Tokenizer
    from pretrain.tokenizer.loader import ResolvedTokenizer
    from tools.hf_verify import VerifyMode

Given = tuple["Tokenizer", str]  # a tokenizer the flags name, and how they name it

# transformers' save_pretrained default (tools.hf_shards.DEFAULT_MAX_SHARD_SIZE; a test keeps them equal).
# The heavy modules (torch, transformers) are imported inside the functions that use them, so that
# ``mlm-convert --help`` and flag errors answer at once.
DEFAULT_MAX_SHARD_SIZE = "5GB"


@dataclass(frozen=True, kw_only=True)
class SourceOptions:
    """How to open the source checkpoint and which tokenizer to use with it (the shared flags:
    Megatron's ``--tokenizer-type``/``--vocab-file``/``--merge-file``/``--tokenizer-model`` or
    ``--tokenizer-dir``; none: the checkpoint's own)."""

    load: Path
    iteration: int | str | None = None
    vocab_size: int | None = None
    tok_flags: TokenizerFlags = TokenizerFlags()

    def open(self) -> tuple[CheckpointReader, Given | None]:
        """The reader, and the tokenizer the flags name when it was loaded to tell the true
        vocabulary (``args`` record none): the reader is then its :meth:`with_vocab` view."""
        from pretrain.checkpoint.opener import open_checkpoint

        reader = open_checkpoint(self.load, iteration=self.iteration, vocab_size=self.vocab_size)
        if reader.info.vocab_known or self.vocab_size is not None:
            return reader, None
        given = self.given(reader)
        if given is None:
            return reader, None
        tok, what = given
        return reader.with_vocab(tok.vocab_size, source=what), given

    def given(self, reader: CheckpointReader) -> Given | None:
        """The tokenizer the flags name and how they name it, or ``None`` (the checkpoint's own).
        Files without ``--tokenizer-type`` take the type the checkpoint names (``args`` or record)."""
        from pretrain.tokenizer.factory import build_tokenizer
        from pretrain.tokenizer.loader import load_tokenizer_dir

        flags = self.tok_flags
        cfg = flags.megatron_config(default_type=_named_tokenizer_type(reader))
        if cfg is not None:
            files = [f"{flag} {value}" for flag, value in (("--vocab-file", cfg.vocab_file),
                     ("--merge-file", cfg.merge_file), ("--tokenizer-model", cfg.model_path)) if value]  # fmt: skip
            return build_tokenizer(cfg), " ".join([f"--tokenizer-type {cfg.tokenizer_type}", *files])
        if flags.tokenizer_dir is not None:
            tok = load_tokenizer_dir(flags.tokenizer_dir, tokenizer_type=flags.tokenizer_type)
            return tok, f"--tokenizer-dir {flags.tokenizer_dir}"
        return None

    def tokenizer(
        self, reader: CheckpointReader, *, required: bool, given: Given | None = None
    ) -> ResolvedTokenizer | None:
        """The checked tokenizer (the flags' or the recorded one; see ``resolve_tokenizer``);
        ``given``: the flags' tokenizer :meth:`open` already loaded (not loaded again)."""
        from pretrain.tokenizer.loader import resolve_tokenizer

        given = given if given is not None else self.given(reader)
        return resolve_tokenizer(reader, given=given, force=self.tok_flags.force_tokenizer, required=required)


def _named_tokenizer_type(reader: CheckpointReader) -> str | None:
    """The tokenizer type a checkpoint names: its record's, else upstream ``args.tokenizer_type``."""
    meta = reader.metadata
    if meta is not None and meta.tokenizer is not None:
        return str(meta.tokenizer.tokenizer_type)
    kind = reader.args.get("tokenizer_type")
    return kind if isinstance(kind, str) else None


def _iteration(text: str) -> int | str:
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an iteration number or 'release', got {text!r}") from None


# reshard names its layout --target-tp/--target-pp/--target-vp (the source's layout is read from disk)
TARGET_FLAGS = {"tp": ("--target-tp",), "pp": ("--target-pp",), "vp": ("--target-vp",)}
TARGET_DESTS = {"tp": "target_tp", "pp": "target_pp", "vp": "target_vp"}


def _add_source(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    if positional:
        p.add_argument("load", type=Path, metavar="DIR", help="checkpoint root or iteration directory")
    else:
        p.add_argument("--load", type=Path, required=True, help="source checkpoint directory")
    p.add_argument("--iteration", type=_iteration, help="iteration to read (default: the tracker's)")
    p.add_argument("--vocab-size", type=int, help="true vocabulary size, where the checkpoint records none")
    add_flag_group(p, TokenizerFlags, title="tokenizer (default: the checkpoint's own)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mlm-convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="describe a checkpoint and check it across shards")
    _add_source(p, positional=True)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p = sub.add_parser("reshard", help="rewrite a checkpoint at another TP/PP/VP layout")
    _add_source(p)
    p.add_argument("--save", type=Path, required=True, help="new output directory")
    add_flag_group(p, ParallelConfig, title="target layout", include=ParallelConfig.SIZES, flags=TARGET_FLAGS,
                   dests=TARGET_DESTS, required=("tp", "pp"))  # fmt: skip
    p.add_argument("--with-optimizer", action="store_true", help="reshard the optimizer state too")
    p.add_argument("--dist-optimizer", action="store_true",
                   help="with --ckpt-format torch_dist --with-optimizer: write the state as megatron-core's "
                        "distributed optimizer saves it (fully_reshardable), for runs with --use-distributed-optimizer")  # fmt: skip
    _add_module_names(p)
    _add_format(p)
    _add_verify(p)
    p = sub.add_parser("to-hf", help="export to a Hugging Face model directory")
    _add_source(p)
    p.add_argument("--save", type=Path, required=True, help="new Hugging Face directory")
    p.add_argument("--weights-only", action="store_true",
                   help="write no tokenizer (only for checkpoints that have none; the result is not a usable model)")  # fmt: skip
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                   help="largest safetensors shard, as save_pretrained (e.g. 5GB, 500MB; default 5GB)")  # fmt: skip
    _add_hf_verify(p)
    p = sub.add_parser("from-hf", help=f"import a Hugging Face model directory ({supported_architectures()})")
    p.add_argument("--load", type=Path, required=True,
                   help=f"Hugging Face model directory (config.json model_type {supported_model_types()})")  # fmt: skip
    p.add_argument("--save", type=Path, required=True, help="new checkpoint directory")
    add_flag_group(p, ParallelConfig, title="parallel layout", include=ParallelConfig.SIZES)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    _add_module_names(p)
    add_flag_group(p, TokenizerFlags, title="tokenizer", include=("tokenizer_dir", "force_tokenizer"))
    p.add_argument("--weights-only", action="store_true",
                   help="accept a Hugging Face directory without a tokenizer (the checkpoint records none)")  # fmt: skip
    _add_format(p)
    _add_verify(p)
    return parser


def _add_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt-format", choices=("torch", "torch_dist"), default="torch",
                   help="output format: legacy per-rank files (torch) or megatron-core's torch_dist")  # fmt: skip


def _write(fmt: str, source: TensorSource, save: Path, target: ParallelConfig, **kw: Any) -> None:
    """``write_layout`` (legacy ``torch``) or :func:`write_torch_dist` with the same options."""
    from pretrain.checkpoint.legacy.writer import write_layout

    optimizer_state = kw.pop("optimizer_state", None)
    distributed_optimizer = kw.pop("distributed_optimizer", False)
    if fmt == "torch":
        write_layout(source, save, target, **kw)
        return
    from pretrain.checkpoint.torch_dist.writer import write_torch_dist

    write_torch_dist(source, save, target, options=kw["options"], extra_files=kw.get("extra_files"),
                     optimizer=optimizer_state, distributed_optimizer=distributed_optimizer)  # fmt: skip


def _add_module_names(p: argparse.ArgumentParser) -> None:
    p.add_argument("--module-names", choices=("mcore", "legacy"), default=None,
                   help="tensor names in the files: megatron-core's (default for GPT; current Megatron-LM) or the "
                        "legacy nested ones (older Megatron-LM, HF's Megatron GPT-2 converter; always for BERT)")  # fmt: skip


def _add_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify", action="store_true",
                   help="run source and target on a probe batch; exit 1 if the max difference exceeds --verify-tol")  # fmt: skip
    p.add_argument("--verify-tol", type=float, default=1e-4, help="tolerance of --verify (default 1e-4)")


def _add_hf_verify(p: argparse.ArgumentParser) -> None:
    """to-hf verifies by default (tools.hf_verify): a mismatch exits 2 and leaves no output."""
    p.add_argument("--verify", nargs="?", const="auto", default="auto", choices=("auto", "full", "per-layer"),
                   help="compare the export, loaded by transformers, with the checkpoint on a probe batch "
                        "(default; auto = per-layer when two float32 copies would not fit in half the free memory)")  # fmt: skip
    p.add_argument("--no-verify", dest="verify", action="store_const", const=None,
                   help="write the export without loading it back")  # fmt: skip
    p.add_argument("--verify-tol", type=float, default=1e-4,
                   help="largest difference, relative to max(1, largest |logit|) (default 1e-4)")  # fmt: skip


def _verify(args: argparse.Namespace) -> int:
    from pretrain.checkpoint.verify import verify_against_hf, verify_checkpoints

    try:
        if args.command == "reshard":
            verify_checkpoints(args.load, args.save, tolerance=args.verify_tol)
            if args.with_optimizer:
                from pretrain.checkpoint.verify import verify_optimizer

                verify_optimizer(args.load, args.save)
        else:
            verify_against_hf(args.save, args.load, tolerance=args.verify_tol)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _source(args: argparse.Namespace) -> SourceOptions:
    return SourceOptions(load=args.load, iteration=args.iteration, vocab_size=args.vocab_size,
                         tok_flags=flags_from_namespace(TokenizerFlags, args))  # fmt: skip


def _progress(total: int, desc: str, unit: str = "file") -> Any:
    """A bar on a terminal; ``disable=None`` turns it off when stderr is not a TTY (logs, CI)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=None, file=sys.stderr)


# --- inspect ---------------------------------------------------------------------------------------
def verify(reader: TensorSource) -> list[str]:
    """Assemble every tensor (shapes, replicated copies, tied head): the problems found."""
    problems = []
    for name in reader.names():
        try:
            reader.tensor(name)
        except UserError as exc:
            problems.append(str(exc))
    return problems


def run_inspect(source: SourceOptions, *, as_json: bool) -> int:
    from pretrain.checkpoint.optimizer.reshard import describe_optimizer

    reader, given = source.open()
    problems = verify(reader)
    tokenizer = None
    try:  # the tokenizer the checkpoint carries (or names) must fit the model
        tok = source.tokenizer(reader, required=False, given=given)
        if tok is not None:
            tokenizer = {
                "source": tok.source,
                "type": tok.record.tokenizer_type,
                "vocab_size": tok.record.vocab_size,
            }
    except UserError as exc:
        problems.append(str(exc))
    info = dataclasses.asdict(reader.info)
    meta = reader.metadata
    record = {
        **info,
        "ok": not problems,
        "problems": problems,
        "model_config": dataclasses.asdict(reader.spec.cfg),
        "tokenizer": tokenizer,
        "provenance": None if meta is None else dataclasses.asdict(meta.provenance),
        "optimizer": describe_optimizer(reader),
    }
    if as_json:
        print(json.dumps(record, default=str))
    else:
        _print_inspect(record)
    return 0 if not problems else 1


def _print_inspect(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from pretrain.checkpoint.fingerprint import short_fingerprint

    table = Table(title=f"checkpoint {record['path']}", show_header=False)
    for key in ("format", "kind", "iteration", "checkpoint_version", "tp", "pp", "vp", "vocab_size",
                "vocab_source", "padded_vocab_size", "num_parameters", "dtypes", "ours", "tokenizer"):  # fmt: skip
        table.add_row(key, str(record[key]))
    cfg = record["model_config"]
    table.add_row(
        "model", ", ".join(f"{k}={cfg[k]}" for k in ("num_layers", "hidden_size", "num_attention_heads"))
    )
    prov = record["provenance"] or {}
    if prov.get("weights_fingerprint"):  # the full string is in --json
        table.add_row("weights_fingerprint", short_fingerprint(str(prov["weights_fingerprint"])))
    if prov.get("data_hash"):
        table.add_row("data_hash", str(prov["data_hash"]))
    opt = record["optimizer"]
    table.add_row("optimizer", f"step {opt['step']}, reshardable (--with-optimizer)" if opt["reshardable"]
                  else f"not carried: {opt['why']}" if opt["present"] else "none")  # fmt: skip
    console = Console()
    console.print(table)
    for p in record["problems"]:
        console.print(f"[red]problem:[/red] {p}", highlight=False)
    verdict = (
        "[green]consistent[/green]"
        if record["ok"]
        else f"[red]INCONSISTENT ({len(record['problems'])})[/red]"
    )
    console.print(f"verdict: {verdict}")


# --- conversions -------------------------------------------------------------------------------
def _save_tokenizer_files(tok: ResolvedTokenizer | None) -> Any:
    """``extra_files`` for :func:`write_layout`: the tokenizer's files into ``tokenizer/``."""
    from pretrain.tokenizer.loader import save_tokenizer
    from pretrain.tokenizer.record import TOKENIZER_SUBDIR

    return None if tok is None else (lambda tmp: save_tokenizer(tok.tokenizer, tmp / TOKENIZER_SUBDIR))


def _carried_rng(reader: CheckpointReader, target: ParallelConfig) -> Any:
    """Each target rank's ``rng_state``: the source rank file's at the same (tp, pp) modulo the
    source layout (the tracker states of TP rank t stay with TP rank t)."""
    states, info = getattr(reader, "states", None), reader.info
    if not states:
        return None

    def rng(tp_rank: int, pp_rank: int) -> Any:
        state = states[(pp_rank % info.pp) * info.tp + tp_rank % info.tp]
        return state.get("rng_state")

    return rng


def run_reshard(source: SourceOptions, save: Path, target: ParallelConfig, *, with_optimizer: bool,
                ckpt_format: str = "torch", module_names: str | None = None,
                dist_optimizer: bool = False) -> int:  # fmt: skip
    from pretrain.checkpoint.fingerprint import weights_fingerprint
    from pretrain.checkpoint.legacy.writer import WriteOptions, check_output_dir
    from pretrain.checkpoint.types import Provenance

    check_output_dir(save, sources=(source.load,))
    reader, given = source.open()
    tok = source.tokenizer(reader, required=False, given=given)
    opt = None
    if with_optimizer:
        from pretrain.checkpoint.optimizer.reshard import open_optimizer_source

        opt = open_optimizer_source(reader)
    optimizer = None
    if opt is not None and ckpt_format == "torch":
        from pretrain.checkpoint.optimizer.reshard import optimizer_writer

        optimizer = optimizer_writer(opt, reader.spec, target)
    scheduler = (
        opt.scheduler if opt is not None else getattr(reader, "states", [{}])[0].get("opt_param_scheduler")
    )
    meta = reader.metadata
    prov = meta.provenance if meta is not None else Provenance(iteration=reader.info.iteration)
    if prov.global_batch_size is None and opt is not None and opt.global_batch_size:
        prov = dataclasses.replace(prov, global_batch_size=opt.global_batch_size)  # the schedule's unit
    if prov.weights_fingerprint is None:  # resharding keeps the weights: the source's fingerprint holds
        prov = dataclasses.replace(prov, weights_fingerprint=weights_fingerprint(reader))
    options = WriteOptions(
        iteration=reader.info.iteration if reader.info.iteration is not None else "release",
        opt_param_scheduler=scheduler if isinstance(scheduler, dict) else None,
        tokenizer=None if tok is None else tok.record,
        provenance=dataclasses.replace(prov, resharded_from=str(source.load)),
        finetune=None if meta is None else meta.finetune,
        rng_state=_carried_rng(reader, target),
        module_names=module_names,
    )
    bar = _progress(target.tp * target.pp, "reshard")
    with bar:
        _write(ckpt_format, reader, save, target, options=options, optimizer=optimizer, optimizer_state=opt,
               distributed_optimizer=dist_optimizer,
               progress=lambda _name: bar.update(1), extra_files=_save_tokenizer_files(tok))  # fmt: skip
    print(f"wrote {save} (tp={target.tp}, pp={target.pp}, vp={target.vp}, iteration {options.iteration})")
    return 0


def run_to_hf(source: SourceOptions, save: Path, *, weights_only: bool = False,
              max_shard_size: str = DEFAULT_MAX_SHARD_SIZE, verify: VerifyMode | None = "auto",
              verify_tol: float = 1e-4) -> int:  # fmt: skip
    """Export; ``verify`` (``auto``/``full``/``per-layer``; None: skip) checks the written directory
    against the checkpoint before it is renamed to ``save`` (:mod:`tools.hf_verify`)."""
    from pretrain.checkpoint.legacy.writer import check_output_dir
    from tools.hf_io import check_exportable, export_hf

    check_output_dir(save, sources=(source.load,))
    reader, given = source.open()
    check_exportable(reader.spec)  # an option the target lacks: refused before any tensor is read
    try:
        tok = source.tokenizer(reader, required=not weights_only, given=given)
    except UserError as exc:
        if "no usable tokenizer" not in str(exc):
            raise
        raise UserError(f"{exc} (or --weights-only to export the weights alone)") from None
    if not reader.info.vocab_known:
        raise UserError(
            f"--load {source.load}: the true vocabulary size is unknown; pass --vocab-size or --tokenizer-dir"
        )
    meta = reader.metadata
    family = None if meta is None else meta.provenance.source_model_type  # e.g. Mistral stays Mistral
    bars: list[Any] = []

    def start_bar(total: int) -> Any:
        bars.append(_progress(total, "to-hf", unit="tensor"))
        return lambda _name: bars[0].update(1)

    def check(directory: Path) -> None:
        from tools.hf_verify import verify_export

        for bar in bars:
            bar.close()
        try:
            result = verify_export(
                reader, reader.spec, directory, mode=verify or "auto", tolerance=verify_tol
            )
        except UserError as exc:
            raise UserError(f"{exc}; {save} not written (--no-verify skips the check)") from None
        print(result.line())

    try:
        export_hf(reader, reader.spec, save, tokenizer=None if tok is None else tok.tokenizer, family=family,
                  max_shard_size=max_shard_size, progress=start_bar,
                  check=None if verify is None else check)  # fmt: skip
    finally:
        for bar in bars:
            bar.close()
    print(f"wrote {save} ({reader.spec.kind}, {reader.info.num_parameters} parameters)")
    return 0


def _hf_tokenizer(
    hf_dir: Path, tokenizer_dir: Path | None, *, rows: int, weights_only: bool, divisible_by: int = 128,
    force: bool = False,
) -> ResolvedTokenizer | None:  # fmt: skip
    from pretrain.tokenizer.loader import ResolvedTokenizer, check_tokenizer, load_tokenizer_dir, record_of

    where, flag = (tokenizer_dir, "--tokenizer-dir") if tokenizer_dir is not None else (hf_dir, "--load")
    try:
        tok = load_tokenizer_dir(where, flag=flag)
    except UserError as exc:
        if tokenizer_dir is not None:
            raise
        if not weights_only:
            raise UserError(
                f"{exc}; pass --tokenizer-dir DIR, or --weights-only for a model without one"
            ) from None
        return None
    forced = check_tokenizer(tok, what=f"{flag} {where}", model_vocab=rows, recorded=None,
                             model_source=f"the model {hf_dir}", divisible_by=divisible_by, force=force)  # fmt: skip
    return ResolvedTokenizer(
        tokenizer=tok, source=f"{flag} {where}", record=record_of(tok), forced=tuple(forced)
    )


def _hf_model_type(hf_dir: Path) -> str | None:
    """``model_type`` of a Hugging Face directory's config.json (already read by ``open_hf``)."""
    value = json.loads((hf_dir / "config.json").read_text(encoding="utf-8")).get("model_type")
    return value if isinstance(value, str) else None


def run_from_hf(hf_dir: Path, save: Path, target: ParallelConfig, *, divisible_by: int,
                tokenizer_dir: Path | None = None, weights_only: bool = False,
                ckpt_format: str = "torch", module_names: str | None = None,
                force_tokenizer: bool = False) -> int:  # fmt: skip
    from pretrain.checkpoint.fingerprint import weights_fingerprint
    from pretrain.checkpoint.legacy.writer import WriteOptions, check_output_dir
    from pretrain.checkpoint.types import Provenance
    from tools.hf_io import open_hf

    check_output_dir(save, sources=(hf_dir,))
    # streamed: each canonical tensor is built from the memory-mapped HF files when written
    source = open_hf(hf_dir, make_vocab_size_divisible_by=divisible_by)
    tok = _hf_tokenizer(hf_dir, tokenizer_dir, rows=source.spec.cfg.vocab_size, weights_only=weights_only,
                        divisible_by=divisible_by, force=force_tokenizer)  # fmt: skip
    bar = _progress(target.tp * target.pp, "from-hf")
    options = WriteOptions(
        iteration="release",
        tokenizer=None if tok is None else tok.record,
        provenance=Provenance(
            converted_from=str(hf_dir),
            source_model_type=_hf_model_type(hf_dir),
            weights_fingerprint=weights_fingerprint(source),
        ),
        module_names=module_names,
    )
    with bar:
        _write(ckpt_format, source, save, target, options=options, progress=lambda _name: bar.update(1),
               extra_files=_save_tokenizer_files(tok))  # fmt: skip
    print(
        f"wrote {save} ({source.spec.kind}, tp={target.tp}, pp={target.pp}, vp={target.vp}, iteration release)"
    )
    return 0


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "inspect":
        _check_tokenizer_flags(args)
        return run_inspect(_source(args), as_json=args.json)
    _check_outputs_and_flags(args)
    if not args.verify or args.command == "to-hf":  # to-hf verifies inside its atomic write
        return _convert(args)
    announced = io.StringIO()  # "wrote ..." is printed only once the conversion is verified
    with contextlib.redirect_stdout(announced):
        rc = _convert(args)
    if rc != 0:
        print(announced.getvalue(), end="")
        return rc
    rc = _verify(args)
    if rc != 0:  # a conversion that fails its check is not kept
        shutil.rmtree(args.save, ignore_errors=True)
        print(f"error: --verify failed; removed {args.save}", file=sys.stderr)
        return rc
    print(announced.getvalue(), end="")
    return 0


def _check_outputs_and_flags(args: argparse.Namespace) -> None:
    """Before any work: --save writable, --verify-tol sane, --tokenizer-dir a directory."""
    if getattr(args, "dist_optimizer", False) and not (
        args.with_optimizer and args.ckpt_format == "torch_dist"
    ):
        raise UserError("--dist-optimizer needs --with-optimizer and --ckpt-format torch_dist")
    if not args.verify_tol >= 0:  # (also NaN)
        raise UserError(f"--verify-tol must be >= 0, got {args.verify_tol}")
    _check_tokenizer_flags(args)
    check_writable_output(args.save, kind="dir", flag="--save")


def _check_tokenizer_flags(args: argparse.Namespace) -> None:
    """The tokenizer flags name files and directories that exist."""
    tok = getattr(args, "tokenizer_dir", None)
    if tok is not None and not Path(tok).is_dir():
        raise UserError(f"--tokenizer-dir {tok}: not a directory")
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        value = getattr(args, name, None)
        if value is not None and not Path(value).exists():
            raise UserError(f"--{name.replace('_', '-')} {value}: no such file")


def _convert(args: argparse.Namespace) -> int:
    if args.command == "reshard":
        with renamed_flag_errors(ParallelConfig, TARGET_FLAGS):  # the user typed --target-tp, not --tp
            target = flags_from_namespace(ParallelConfig, args, dests=TARGET_DESTS)
            rc = run_reshard(_source(args), args.save, target, with_optimizer=args.with_optimizer,
                             ckpt_format=args.ckpt_format, module_names=args.module_names,
                             dist_optimizer=args.dist_optimizer)  # fmt: skip
    elif args.command == "to-hf":
        rc = run_to_hf(_source(args), args.save, weights_only=args.weights_only,
                       max_shard_size=args.max_shard_size, verify=args.verify, verify_tol=args.verify_tol)  # fmt: skip
    else:
        target = flags_from_namespace(ParallelConfig, args)
        rc = run_from_hf(args.load, args.save, target, divisible_by=args.make_vocab_size_divisible_by,
                         tokenizer_dir=args.tokenizer_dir, weights_only=args.weights_only,
                         ckpt_format=args.ckpt_format, module_names=args.module_names,
                         force_tokenizer=args.force_tokenizer)  # fmt: skip
    return rc


if __name__ == "__main__":
    sys.exit(main())
