"""``mlm-layout``: print the process groups of a (world, tp, pp, vp, ep, etp) run.

Example::

    mlm-layout --world-size 16 --tp 2 --pp 4
    mlm-layout --world-size 16 --tp 2 --pp 4 --json
    mlm-layout --world-size 8 --tp 2 --ep 4 --etp 1   # expert groups (megatron-core's)
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.layout import RankLayout, compute_layout
from pretrain.utils.cli import OneLineParser
from pretrain.utils.errors import cli_entry
from pretrain.utils.flag_groups import add_flag_group, flags_from_namespace


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="mlm-layout", description="Print Megatron's process groups.")
    p.add_argument("--world-size", type=int, required=True, metavar="N", help="number of ranks")
    add_flag_group(
        p, ParallelConfig, title="parallel layout", include=(*ParallelConfig.SIZES, *ParallelConfig.EXPERT)
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def _render(layout: RankLayout, console: Console) -> None:
    console.print(
        f"world {layout.world_size} = tp {layout.tp} x dp {layout.dp} x pp {layout.pp}"
        + (f" (virtual chunks {layout.vp})" if layout.vp > 1 else "")
        + (
            f"; experts: etp {layout.etp} x ep {layout.ep} x edp {layout.edp} x pp {layout.pp}"
            if layout.has_expert_groups
            else ""
        )
    )
    for kind, groups in layout.as_dict().items():
        table = Table(title=f"{kind} groups ({len(groups)})", show_header=True)
        table.add_column("#", justify="right")
        table.add_column("ranks")
        for i, g in enumerate(groups):
            table.add_row(str(i), " ".join(map(str, g)))
        console.print(table)
    coords = Table(title="rank coordinates")
    for col in ("rank", "tp_rank", "dp_rank", "pp_rank", "etp_rank", "ep_rank", "edp_rank"):
        coords.add_column(col, justify="right")
    for r in range(layout.world_size):
        c = layout.coords(r)
        coords.add_row(
            str(r), str(c.tp_rank), str(c.dp_rank), str(c.pp_rank), *map(str, layout.expert_coords(r))
        )
    console.print(coords)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    par = flags_from_namespace(ParallelConfig, args)
    layout = compute_layout(
        world_size=args.world_size, tp=par.tp, pp=par.pp, vp=par.vp, ep=par.ep, etp=par.etp
    )
    if args.json:
        print(json.dumps(layout.as_dict()))
    else:
        _render(layout, Console())
    return 0


if __name__ == "__main__":
    sys.exit(main())
