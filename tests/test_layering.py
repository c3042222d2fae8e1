"""Dependencies point one way: checked on the source (every import, also inside functions and under
TYPE_CHECKING), so a late import cannot hide an upward edge or a loop."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    """The absolute module names ``path`` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _package_imports(package: str) -> set[str]:
    return {name for f in (ROOT / package).rglob("*.py") for name in _imports(f)}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_flag_machinery_in_utils_imports_nothing_above_utils() -> None:
    """``pretrain/utils`` is the floor: the flag groups live with their owners, not here."""
    for f in (ROOT / "pretrain" / "utils").rglob("*.py"):
        upward = {n for n in _imports(f) if _within(n, "pretrain") and not _within(n, "pretrain.utils")}
        assert not upward, (f.name, sorted(upward))


def test_the_tokenizer_package_does_not_import_the_commands_flags() -> None:
    for f in (ROOT / "pretrain" / "tokenizer").rglob("*.py"):
        assert not any(_within(n, "pretrain.training") for n in _imports(f)), f.name


def test_tools_and_finetune_do_not_import_each_other_both_ways() -> None:
    tools_to_finetune = {n for n in _package_imports("tools") if _within(n, "finetune")}
    finetune_to_tools = {n for n in _package_imports("finetune") if _within(n, "tools")}
    assert not (tools_to_finetune and finetune_to_tools), (
        sorted(tools_to_finetune),
        sorted(finetune_to_tools),
    )


def test_pretrain_imports_no_application_package() -> None:
    apps = ("mlm_eval", "finetune", "tools")
    found = {n for n in _package_imports("pretrain") if any(_within(n, a) for a in apps)}
    assert not found, sorted(found)
