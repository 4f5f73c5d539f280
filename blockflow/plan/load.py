"""Reading a plan: parse YAML or JSON, check every field, then the whole graph.

:func:`load_plan` raises one :class:`~blockflow.core.errors.PlanError` listing every problem
with its key path, the bad value and the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from blockflow.core.errors import PlanError, PlanIssue
from blockflow.core.spec import TensorMQSettings
from blockflow.plan.checks import graph_issues
from blockflow.plan.deployment import Plan
from blockflow.plan.schema import (
    BlockDef,
    BlockSettings,
    ModelDef,
    PlanModel,
    TaskDef,
    Weights,
)


def load_plan(path: str | Path) -> Plan:
    """Read, parse and fully validate the plan file at ``path``."""
    p = Path(path)
    if not p.is_file():
        raise PlanError([PlanIssue("", f"plan file not found: {p} (give an existing YAML or JSON file)")], str(p))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError([PlanIssue("", f"not valid YAML/JSON: {exc}")], str(p)) from None
    return parse_plan_text(text, source=str(p), base_dir=p.parent.resolve())


class _PlanLoader(yaml.SafeLoader):
    """YAML without aliases: a plan has no use for them, and nested aliases expand exponentially
    (a 1 kB "billion laughs" document is a billion nodes to validate)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(None, None, "YAML aliases (*name) are not allowed in a plan", event.start_mark)
        return super().compose_node(parent, index)


def parse_plan_text(text: str, source: str = "", base_dir: Path | None = None,
                    weights_dirs: Sequence[Path] | None = None) -> Plan:
    """Parse and fully validate a plan given as YAML or JSON text (JSON is YAML)."""
    try:
        data = yaml.load(text, Loader=_PlanLoader)  # noqa: S506 - a SafeLoader that also refuses aliases
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise PlanError([PlanIssue("", f"not valid YAML/JSON{at}: {getattr(exc, 'problem', exc)}")], source) from None
    except RecursionError:
        raise PlanError([PlanIssue("", "not a plan: nested too deeply")], source) from None
    return parse_plan(data, source=source, base_dir=base_dir, weights_dirs=weights_dirs)


def parse_plan(data: object, source: str = "", base_dir: Path | None = None,
               weights_dirs: Sequence[Path] | None = None) -> Plan:
    """Validate plan data already loaded from YAML/JSON."""
    if not isinstance(data, dict):
        raise PlanError([PlanIssue("", f"a plan is a mapping with keys version, models, blocks, tasks; got {type(data).__name__}")], source)
    try:
        raw = PlanModel.model_validate(data)
    except ValidationError as exc:
        raise PlanError(_pydantic_issues(exc), source) from None
    except RecursionError:
        raise PlanError([PlanIssue("", "not a plan: nested too deeply")], source) from None
    plan = Plan(raw, source, base_dir, weights_dirs)
    issues = list(graph_issues(plan))
    if issues:
        raise PlanError(issues, source)
    return plan


def _loc(parts: Iterable[int | str]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


_MODEL_FIELDS: dict[str, type[BaseModel]] = {
    "": PlanModel,
    "models": ModelDef,
    "blocks": BlockDef,
    "tasks": TaskDef,
    "defaults": BlockSettings,
    "weights": Weights,
    "tensormq": TensorMQSettings,
}


def _allowed_keys(loc: tuple[int | str, ...]) -> list[str]:
    """Keys allowed at the mapping that holds ``loc``'s last element."""
    parent = loc[:-1]
    if not parent:
        return list(PlanModel.model_fields)
    if parent[0] in ("models", "blocks", "tasks") and len(parent) == 2:
        return list(_MODEL_FIELDS[str(parent[0])].model_fields)
    if parent[-1] in _MODEL_FIELDS:
        return list(_MODEL_FIELDS[str(parent[-1])].model_fields)
    return []


def _pydantic_issues(exc: ValidationError) -> list[PlanIssue]:
    issues: list[PlanIssue] = []
    for err in exc.errors():
        # Drop pydantic's union-branch tags (e.g. 'int', 'tuple[int,int]', 'list[int]') from the path.
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("int", "str", "bool"))))
        kind = err["type"]
        value = err.get("input")
        if kind == "extra_forbidden":
            key = str(loc[-1])
            allowed = _allowed_keys(loc)
            near = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            msg = f"unknown key {key!r}; {hint}allowed keys: {', '.join(allowed)}"
        elif kind == "missing":
            msg = "required key is missing; add it"
        elif kind == "literal_error":
            msg = f"{value!r} is not allowed; use {err['ctx']['expected']}"
        else:
            msg = f"{err['msg']} (got {value!r})" if kind != "value_error" else str(err["ctx"]["error"])
        issues.append(PlanIssue(_loc(loc), msg))
    # One problem per key path: union branches repeat the same complaint.
    unique: dict[str, PlanIssue] = {}
    for issue in issues:
        unique.setdefault(issue.loc, issue)
    return list(unique.values())


