"""A rendered repository as typed models: each model's files with its ``config.pbtxt`` parsed once
(its config, its block spec, its digest), for the code that compares and changes a served repository
(:mod:`blockflow.control`).

The bytes stay those :func:`blockflow.ensemble_gen.generator.render` gives or the disk holds: a model
written back from here is written exactly as it was read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from blockflow.core.errors import GenerateError
from blockflow.core.spec import SPEC_PARAMETER, ModelSpec
from blockflow.ensemble_gen import generator
from blockflow.ensemble_gen.configs import DIGEST_PARAMETER, parse_pbtxt, to_pbtxt
from blockflow.plan import Plan

CONFIG = "config.pbtxt"


@dataclass(frozen=True, eq=False)
class RenderedModel:
    """One model directory: its ``files`` (relative to the directory) and what its ``config.pbtxt`` says.

    ``config`` is shared by every reader and never changed in place (a changed config is a new model:
    :meth:`with_config`)."""

    name: str
    files: Mapping[str, bytes]
    config: mc.ModelConfig
    spec: ModelSpec | None  # the ``blockflow.spec`` parameter; None for ensembles
    unreadable: str = ""  # why a served model's config or spec did not parse (read leniently); '' when it did

    @classmethod
    def parse(cls, name: str, files: Mapping[str, bytes], where: str = "the rendered repository") -> RenderedModel:
        """``files`` of model ``name`` with its config and spec parsed; a :class:`GenerateError` naming the
        model (and ``where`` it is) if either is missing or does not parse."""
        if CONFIG not in files:
            raise GenerateError(f"model {name} in {where} has no {CONFIG}")
        try:
            config = parse_pbtxt(files[CONFIG].decode())
        except (text_format.ParseError, UnicodeDecodeError) as exc:
            raise GenerateError(f"model {name} in {where}: its {CONFIG} does not parse: {exc}") from None
        param = config.parameters.get(SPEC_PARAMETER)
        try:
            spec = ModelSpec.model_validate(json.loads(param.string_value)) if param is not None else None
        except ValueError as exc:  # not JSON, or not a spec (pydantic's errors are ValueErrors)
            raise GenerateError(f"model {name} in {where}: its {SPEC_PARAMETER!r} parameter is not a block spec: {exc}") from None
        return cls(name, dict(files), config, spec)

    @property
    def ensemble(self) -> bool:
        return bool(self.config.platform == "ensemble")

    @property
    def digest(self) -> str:
        """The ``blockflow.digest`` the generator stamped on the config ('' when none)."""
        param = self.config.parameters.get(DIGEST_PARAMETER)
        return param.string_value if param is not None else ""

    @property
    def steps(self) -> tuple[str, ...]:
        """An ensemble's step models, in order (none for a block)."""
        return tuple(s.model_name for s in self.config.ensemble_scheduling.step)

    def with_config(self, config: mc.ModelConfig) -> RenderedModel:
        """This model with another config (its ``config.pbtxt`` rewritten from it), the other files kept."""
        return dataclasses.replace(self, files={**self.files, CONFIG: to_pbtxt(config).encode()}, config=config)

    def with_file(self, rel: str, data: bytes) -> RenderedModel:
        """This model with one more (or another) file that is not its config."""
        assert rel != CONFIG, "a config goes through with_config"
        return dataclasses.replace(self, files={**self.files, rel: data})


@dataclass(frozen=True, eq=False)
class RenderedRepository:
    """Every model of a rendered repository, by name (in the repository's order), and its marker file."""

    models: Mapping[str, RenderedModel]
    marker: bytes

    @classmethod
    def parse(cls, files: Mapping[str, bytes]) -> RenderedRepository:
        """The repository :func:`generator.render` gave as ``files`` (relative path -> bytes)."""
        return cls({name: RenderedModel.parse(name, model_files) for name, model_files in generator.by_model(files).items()},
                   files[generator.MARKER])

    @property
    def files(self) -> dict[str, bytes]:
        """Every file, keyed by relative POSIX path, as :func:`generator.render` gives them."""
        out = {f"{name}/{rel}": data for name, m in self.models.items() for rel, data in m.files.items()}
        out[generator.MARKER] = self.marker
        return dict(sorted(out.items()))


def render(plan: Plan) -> RenderedRepository:
    """The repository for ``plan`` (:func:`generator.render`), each model's config parsed once."""
    return RenderedRepository.parse(generator.render(plan))


def read_model(root: Path, name: str, lenient: bool = False) -> RenderedModel | None:
    """Model ``name`` of the repository at ``root`` as the disk holds it, or None when it has no directory.

    ``lenient``: a directory whose config or spec does not parse (edited by hand, or written by another
    version) comes back with its files, an empty config, no spec and ``unreadable`` saying why, instead of
    a :class:`GenerateError`: a plan change replaces or removes such a model (it computes something
    else as far as any comparison goes) and can put its files back on a rollback."""
    files = generator.read_model(root, name)
    if files is None:
        return None
    try:
        return RenderedModel.parse(name, files, where=str(root))
    except GenerateError as exc:
        if not lenient:
            raise
        return RenderedModel(name, dict(files), mc.ModelConfig(), None, unreadable=str(exc))
