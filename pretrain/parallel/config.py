"""The parallel layout, one frozen object for every command (torchtitan's ``ParallelDims``); its
fields are also the shared ``--tp``/``--pp``/``--vp``/``--ep``/``--etp`` flag group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pretrain.utils.errors import UserError
from pretrain.utils.flag_groups import flag_meta


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The parallel layout, one object for every command (torchtitan's ``ParallelDims``).

    Tensor (t), pipeline (p) and virtual-pipeline (V) sizes; data parallel d = world / (t * p).
    The shared command-line flags are these fields (``metadata`` names the flags and the help,
    :func:`pretrain.utils.flag_groups.add_flag_group` turns them into an argument group and
    :func:`~pretrain.utils.flag_groups.flags_from_namespace` builds this object back), so a new
    parallel dimension is one field here plus its name in :attr:`SIZES` (the sizes every layout
    command takes, each checked positive). Where a run executes (``--device``) is not part of it.
    """

    SIZES: ClassVar[tuple[str, ...]] = ("tp", "pp", "vp")
    # expert parallelism (mixture-of-experts layers), carved out of data parallelism
    EXPERT: ClassVar[tuple[str, ...]] = ("ep", "etp")

    tp: int = field(
        default=1,
        metadata=flag_meta(
            "tensor-parallel size (TP)", flags=("--tensor-model-parallel-size", "--tp"), metavar="N"
        ),
    )
    pp: int = field(
        default=1,
        metadata=flag_meta(
            "pipeline-parallel size (PP); DP = world / (TP x PP)",
            flags=("--pipeline-model-parallel-size", "--pp"),
            metavar="N",
        ),
    )
    vp: int = field(
        default=1, metadata=flag_meta("virtual pipeline chunks per stage (VP)", flags=("--vp",), metavar="N")
    )
    ep: int = field(
        default=1,
        metadata=flag_meta(
            "expert-parallel size (EP): experts split over EP ranks carved out of DP (megatron-core's layout)",
            flags=("--expert-model-parallel-size", "--ep"),
            metavar="N",
        ),
    )
    etp: int | None = field(
        default=None,
        metadata=flag_meta(
            "expert tensor-parallel size (ETP): TP of each expert, any size (default: TP)",
            flags=("--expert-tensor-parallel-size", "--etp"),
            metavar="N",
        ),
    )
    # Optional uneven pipeline split: layers on the first / last stage (None = even split).
    num_layers_in_first_stage: int | None = field(
        default=None,
        metadata=flag_meta(
            "layers on the first pipeline stage (default: an even split)",
            flags=("--decoder-first-pipeline-num-layers",),
            metavar="N",
        ),
    )
    num_layers_in_last_stage: int | None = field(
        default=None,
        metadata=flag_meta(
            "layers on the last pipeline stage (default: an even split)",
            flags=("--decoder-last-pipeline-num-layers",),
            metavar="N",
        ),
    )

    def __post_init__(self) -> None:
        for name in self.SIZES:
            if int(getattr(self, name)) <= 0:
                raise UserError(f"--{name} must be a positive integer, got {getattr(self, name)}")
        if self.vp > 1 and self.pp < 2:
            raise UserError(f"--vp {self.vp} needs --pp >= 2 (virtual stages interleave real ones)")
        if int(self.ep) <= 0:
            raise UserError(f"--expert-model-parallel-size must be a positive integer, got {self.ep}")
        if self.etp is not None and int(self.etp) <= 0:
            raise UserError(f"--expert-tensor-parallel-size must be a positive integer, got {self.etp}")

    @property
    def expert_tp(self) -> int:
        """Tensor-parallel size of each expert: ``etp``, else ``tp`` (megatron-core's default)."""
        return self.tp if self.etp is None else self.etp

    def check_expert_engine(self) -> None:
        """Evaluation's expert layouts (mlm_eval pairs its replicas' all-to-alls over the EP group
        only): whole experts (ETP 1) or split like the dense layers (ETP = TP). Training and
        checkpoints take any ETP."""
        if self.expert_tp not in (1, self.tp):
            raise UserError(
                f"--expert-tensor-parallel-size {self.expert_tp} is not supported with --tp {self.tp}: "
                "use 1 (whole experts) or the TP size"
            )

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model: ``tp * pp``."""
        return self.tp * self.pp

    def data_parallel_size(self, world_size: int) -> int:
        """Model replicas among ``world_size`` ranks: ``world / (tp * pp)`` (:class:`UserError` if uneven)."""
        if world_size <= 0 or world_size % self.model_parallel_size:
            raise UserError(
                f"world size {world_size} is not divisible by TP {self.tp} x PP {self.pp} (DP = world / (TP x PP))"
            )
        return world_size // self.model_parallel_size
