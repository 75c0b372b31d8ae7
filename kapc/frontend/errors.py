"""Errors the frontend raises: each message says what is wrong and, for a missing package, what to install."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from kapc.errors import KapcError


class FrontendError(KapcError):
    """Data or a frontend's input that cannot be used; the message says why."""


class MissingPackageError(FrontendError):
    """A package the frontend needs is not installed; the message names the pip command."""


def require(module: str, install: str) -> ModuleType:
    """Import `module`, or raise MissingPackageError naming `install` (the pip arguments)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingPackageError(
            f"the kapc frontend needs the Python module `{module}` ({exc}); install it with: "
            f"pip install {install}"
        ) from None


def package_dir(module: str, install: str) -> str:
    """The folder of an installed package without importing it (some data-only packages fail to
    import without their declared dependencies)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"the kapc frontend needs the package that provides `{module}`; install it with: "
            f"pip install {install}"
        )
    return list(spec.submodule_search_locations)[0]
