"""What every pass shares: the `Pass` base, the compile context, and pass errors."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

from kapc.errors import KapcError
from kapc.ir import Module
from kapc.models import ModelAssets, load_assets
from kapc.prompt import Tokenization


class PassError(KapcError):
    """A pass cannot do its job on this input; the message says why and what to change."""


class CompileContext:
    """What passes may consult besides the IR: the target model's assets, loaded on first use, and
    a tokenization memo shared by every pass and by lowering."""

    def __init__(
        self,
        model: str | None = None,
        assets: ModelAssets | None = None,
        engine: str | None = None,
        threads: int | None = None,
    ):
        self.model_spec = model
        self._assets = assets
        self.engine = engine  # the target engine (kapc.policy.ENGINE_BLOCK_SIZE), if named
        # the threads its worker computes with, where known: which of its profiles prices plans
        self.threads = threads

    @property
    def assets(self) -> ModelAssets:
        if self._assets is None:
            self._assets = load_assets(self.model_spec)
        return self._assets

    @functools.cached_property
    def tokenize(self) -> Tokenization:
        return Tokenization(self.assets)


@dataclasses.dataclass(frozen=True)
class Pass:
    """A pass reads a module and returns a new one. Subclasses are frozen dataclasses whose fields
    are the pass's options (written kebab-case in pipelines: `select{budget-tokens=1024}`)."""

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        # Options are checked when the pipeline is built, before any input is read or tokenized.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise PassError(
                    f"{self.name}: option {f.name.replace('_', '-')}={value} is not a finite number"
                )
        problem = self.option_problem()
        if problem:
            raise PassError(f"{self.name}: {problem}")

    def option_problem(self) -> str | None:
        """Why these option values are outside the pass's domain (naming the option), or None."""
        return None

    def run(self, module: Module, ctx: CompileContext) -> Module:
        raise NotImplementedError

    def options_text(self) -> str:
        """The options that differ from the defaults, in pipeline syntax."""
        changed = [
            f"{f.name.replace('_', '-')}={_fmt(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return "{" + ",".join(changed) + "}" if changed else ""


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
