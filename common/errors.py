"""One exception hierarchy for everything a user can get wrong.

The CLI turns any :class:`EaglenestError` into exit code 2 and one line on stderr; anything else is
a bug and keeps its traceback.
"""

import importlib


class EaglenestError(Exception):
    """A problem the user can fix (bad input, missing file, wrong version)."""


class ConfigError(EaglenestError):
    """A recipe key is missing, unknown or of the wrong type."""


class ManifestError(ConfigError):
    """The domain manifest is invalid."""


class SchemaError(EaglenestError):
    """A table does not match the declared feature-store schema."""


class StoreError(EaglenestError):
    """The feature store cannot do what was asked (missing table, version, corrupt data)."""


class MissingExtraError(EaglenestError, ImportError):
    """An optional dependency is not installed."""


def require(module: str, extra: str | None = None):
    """Import ``module`` lazily; raise a :class:`MissingExtraError` if it is missing, naming the extra
    of pyproject.toml that installs it (``cpu``, ``cuda``, ``track``), or, with ``extra=None``, saying
    it is one of eaglenest's own dependencies (a broken install)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = (f"install eaglenest with the '{extra}' extra (pip install 'eaglenest[{extra}]')" if extra else
                "it is one of eaglenest's own dependencies: reinstall eaglenest (make install, or pip install -e .)")
        raise MissingExtraError(f"{module} is not installed: {hint}") from exc
