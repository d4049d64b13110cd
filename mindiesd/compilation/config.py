"""Settings of the MindieSD backend.

The settings live on the class, as the specification shows::

    CompilationConfig.fusion_patterns.enable_rope = False
    CompilationConfig.aclgraph_with_compile = True

A backend takes a snapshot when it is created (``MindieSDBackend()``): later changes to the class affect only
backends created later. ``CompilationConfig(**overrides)`` builds such a snapshot directly, for a backend of
its own that leaves the globals alone; ``CompilationConfig.reset()`` restores the defaults.

Each setting is declared once, in ``_FIELDS`` (default, type check, doc); the class attributes, the class
docstring's list and the settings table of the docs (:func:`settings_table`) are derived from it. Every
assignment is checked: an unknown name raises :class:`UnknownSettingError` listing the valid ones, a value
of the wrong type raises :class:`SettingTypeError`.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from ..files.trust import TRUST_ENV_VAR  # noqa: F401  (public here too)
from ..files.trust import trust_foreign_owner_from_env as default_trust_foreign_owner
from .families import FAMILIES

__all__ = [
    "CompilationConfig",
    "settings_table",
    "default_cache_dir",
    "ENV_VAR",
    "TRUST_ENV_VAR",
    "DEFAULT_CACHE_MAX_BYTES",
    "FusionPatterns",
    "CompilationConfigError",
    "UnknownSettingError",
    "SettingTypeError",
]


class CompilationConfigError(Exception):
    """Base class of the configuration errors."""


class UnknownSettingError(CompilationConfigError, AttributeError):
    """A setting name that does not exist (usually a misspelling)."""


class SettingTypeError(CompilationConfigError, TypeError):
    """A setting given a value of the wrong type."""


#: Environment variable: the cache folder, or ``off`` (or empty) to turn the persistent cache off by default.
ENV_VAR = "MINDIESD_CACHE_DIR"
_OFF = ("", "0", "off", "none", "false")


def default_cache_dir() -> Optional[str]:
    """``$MINDIESD_CACHE_DIR`` (``off`` or empty: no cache), else ``$XDG_CACHE_HOME/mindiesd``, else
    ``~/.cache/mindiesd``."""
    value = os.environ.get(ENV_VAR)
    if value is not None:
        return None if value.strip().lower() in _OFF else value
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mindiesd")


#: Default of ``cache_max_bytes``: 2 GiB. A deep Flux (19 + 38 blocks) whole-model artifact measured 11 MB and its
#: graph entry 1.9 MB, so it holds some 160 such resolutions; without a limit the folder only grows, since every
#: new version, setting or resolution adds entries and nothing removes the old ones.
DEFAULT_CACHE_MAX_BYTES = 2 * 2**30


@dataclass(frozen=True)
class _Field:
    """One setting: its default, its type check (and the type in words, for errors and docs), its doc."""

    default: Any
    check: Callable[[Any], bool]
    expected: str
    doc: str
    #: Reads the default when the settings are reset (a default that comes from the environment).
    default_from: Optional[Callable[[], Any]] = None
    #: The default as the docs show it, where the value itself depends on the machine.
    default_doc: str = ""

    def current_default(self) -> Any:
        return self.default_from() if self.default_from is not None else self.default


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_optional_path(value: Any) -> bool:
    """None, a path, or a file:// URL (the graph log is written to a local folder)."""
    if value is None or isinstance(value, os.PathLike):
        return True
    if not isinstance(value, str):
        return False
    scheme = value.split("://", 1)[0].lower() if "://" in value else ""
    return scheme in ("", "file")


def _is_optional_folder(value: Any) -> bool:
    """None or a local folder path (no URL)."""
    if value is None or isinstance(value, os.PathLike):
        return True
    return isinstance(value, str) and "://" not in value


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_optional_positive_int(value: Any) -> bool:
    return value is None or _is_positive_int(value)


def _unknown(owner: str, name: str, fields: Dict[str, _Field]) -> UnknownSettingError:
    valid = sorted(fields)
    hint = difflib.get_close_matches(name, valid, n=1)
    did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
    return UnknownSettingError(
        f"{owner} has no setting {name!r}.{did_you_mean} Valid settings: {', '.join(valid)}."
    )


def _checked(owner: str, name: str, value: Any, fields: Dict[str, _Field]) -> Any:
    field = fields.get(name)
    if field is None:
        raise _unknown(owner, name, fields)
    if not field.check(value):
        raise SettingTypeError(
            f"{owner}.{name} must be {field.expected}, got {value!r} of type {type(value).__name__}."
        )
    return os.fspath(value) if isinstance(value, os.PathLike) else value


_FUSION_FIELDS: Dict[str, _Field] = {
    family.switch: _Field(True, _is_bool, "a bool", family.doc) for family in FAMILIES.values()
}

#: Fusion family name -> the switch that enables it, in the order the passes run (from mindiesd.compilation.families).
FAMILY_SWITCHES: Dict[str, str] = {name: family.switch for name, family in FAMILIES.items()}


class FusionPatterns:
    """The ``enable_*`` switch of every fusion family (:data:`mindiesd.compilation.families.FAMILIES`), each on by default."""

    __slots__ = tuple(_FUSION_FIELDS)

    def __init__(self, **values: bool) -> None:
        for name, field in _FUSION_FIELDS.items():
            object.__setattr__(self, name, field.default)
        for name, value in values.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, _checked("CompilationConfig.fusion_patterns", name, value, _FUSION_FIELDS))

    def __getattr__(self, name: str) -> Any:  # only reached for names that are not slots
        raise _unknown("CompilationConfig.fusion_patterns", name, _FUSION_FIELDS)

    def copy(self) -> "FusionPatterns":
        return FusionPatterns(**self.to_dict())

    def to_dict(self) -> Dict[str, bool]:
        return {name: getattr(self, name) for name in _FUSION_FIELDS}

    def enabled_families(self) -> Tuple[str, ...]:
        """The enabled families, in pass order."""
        return tuple(family for family, switch in FAMILY_SWITCHES.items() if getattr(self, switch))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FusionPatterns) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.to_dict().items())
        return f"FusionPatterns({inner})"


def _is_fusion_patterns(value: Any) -> bool:
    return isinstance(value, (FusionPatterns, dict))


_FIELDS: Dict[str, _Field] = {
    "fusion_patterns": _Field(
        None, _is_fusion_patterns, "a FusionPatterns or a dict of enable_* switches",
        "Switches of the fusion families (see FusionPatterns).", default_from=FusionPatterns,
        default_doc="every enable_* True",
    ),
    "aclgraph_only": _Field(
        False, _is_bool, "a bool",
        "Capture the graph as a device graph without pattern fusion. aclgraph_with_compile wins when both are set.",
    ),
    "aclgraph_with_compile": _Field(
        False, _is_bool, "a bool", "Apply pattern fusion, then capture the result as a device graph.",
    ),
    "aclgraph_max_graphs": _Field(
        16, _is_positive_int, "a positive int",
        "Captured graphs kept per compiled graph (one per input signature); the least recently used is evicted.",
    ),
    "enable_freezing": _Field(
        True, _is_bool, "a bool",
        "Treat parameters and buffers as constants and fold the computations that depend on them alone. The folded "
        "values are cached per set of weights and recomputed when a weight is replaced or modified in place.",
    ),
    "safe_output_mode": _Field(
        True, _is_bool, "a bool", "Clone the outputs of each device-graph replay (False returns the static buffers).",
    ),
    "graph_log_url": _Field(
        None, _is_optional_path, "None, a folder path or a file:// URL",
        "Folder that receives, per compiled graph, each pass's graph before and after, and a summary.",
    ),
    "strict": _Field(
        False, _is_bool, "a bool",
        "Raise on an internal failure of a pass or trace instead of warning and running the unfused graph.",
    ),
    "kernel_choice": _Field(
        "auto", lambda value: value in ("auto", "measure", "declared"), "one of 'auto', 'measure', 'declared'",
        "What runs each fused op site: 'measure' times the family's kernel, an ATen composition of the same "
        "function where one exists and the op's reference composition (eager's aten ops) on the graph's device, at "
        "the site's shapes, dtypes and strides, and keeps the fastest (the graph stores the choice, so a warm start "
        "does not measure again); 'declared' takes the families' declared choice and measures nothing (reproducible "
        "runs); 'auto' measures on an accelerator (CUDA, NPU) without device-graph capture and takes the declared "
        "choice elsewhere.",
    ),
    "cache_dir": _Field(
        None, _is_optional_folder, "None or a folder path",
        "Persistent compile cache: the folder where each compiled graph is stored and loaded from by later "
        "processes (None: off). Default: $MINDIESD_CACHE_DIR ('off' turns it off), else ~/.cache/mindiesd.",
        default_from=default_cache_dir, default_doc="$MINDIESD_CACHE_DIR, else ~/.cache/mindiesd",
    ),
    "cache_max_bytes": _Field(
        DEFAULT_CACHE_MAX_BYTES, _is_optional_positive_int, "None or a positive int",
        "Size limit of the persistent cache folder (its graphs and ahead-of-time artifacts, in bytes): a store that "
        "would pass it first removes the least recently stored or loaded ones; an entry larger than the limit is "
        "kept in memory only (None: no limit).", default_doc="2147483648 (2 GiB)",
    ),
    "cache_trust_foreign_owner": _Field(
        False, _is_bool, "a bool",
        "Read cache entries and artifacts owned by another user: a read-only cache shared on purpose (baked into "
        "an image, on a shared volume). Without it such files are ignored with a warning, as ssh ignores an "
        "authorized_keys file another user owns. Anything writable by group or others, and symbolic links below "
        "the cache folder, are refused all the same; nothing is written into a folder another user owns. "
        "Default: $MINDIESD_CACHE_TRUST_FOREIGN_OWNER=1.",
        default_from=default_trust_foreign_owner, default_doc="$MINDIESD_CACHE_TRUST_FOREIGN_OWNER, else False",
    ),
}


def _fusion_value(value: Any) -> FusionPatterns:
    return value.copy() if isinstance(value, FusionPatterns) else FusionPatterns(**value)


class _ConfigMeta(type):
    """Checks assignments made on the class itself (``CompilationConfig.aclgraph_only = True``)."""

    def __setattr__(cls, name: str, value: Any) -> None:
        if name.startswith("_"):
            type.__setattr__(cls, name, value)
            return
        value = _checked("CompilationConfig", name, value, _FIELDS)
        if name == "fusion_patterns":
            value = _fusion_value(value)
        type.__setattr__(cls, name, value)

    def __delattr__(cls, name: str) -> None:
        raise CompilationConfigError(f"settings cannot be deleted; use CompilationConfig.reset() ({name!r})")


class CompilationConfig(metaclass=_ConfigMeta):
    """Settings of MindieSDBackend.

    Class attributes are the global settings; an instance is an independent snapshot of them, optionally with
    overrides: ``CompilationConfig(aclgraph_with_compile=True)``. Every setting, its default and its meaning:
    :meth:`settings` (docs/settings.md renders them as a table, :func:`settings_table`).
    """

    def __init__(self, **overrides: Any) -> None:
        cls = type(self)
        for name in _FIELDS:
            value = getattr(cls, name)
            object.__setattr__(self, name, value.copy() if name == "fusion_patterns" else value)
        for name, value in overrides.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        value = _checked("CompilationConfig", name, value, _FIELDS)
        if name == "fusion_patterns":
            value = _fusion_value(value)
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:  # only reached for names that do not exist
        raise _unknown("CompilationConfig", name, _FIELDS)

    @classmethod
    def snapshot(cls) -> "CompilationConfig":
        """An independent copy of the current global settings."""
        return cls()

    @classmethod
    def reset(cls) -> None:
        """Restore every global setting to its default."""
        for name, field in _FIELDS.items():
            setattr(cls, name, field.current_default())

    @classmethod
    def settings(cls) -> Iterator[Tuple[str, Any, str]]:
        """(name, default, description) of every setting, fusion switches included."""
        for name, field in _FIELDS.items():
            if name == "fusion_patterns":
                for sub, sub_field in _FUSION_FIELDS.items():
                    yield f"fusion_patterns.{sub}", sub_field.default, sub_field.doc
            else:
                yield name, field.current_default(), field.doc

    def copy(self) -> "CompilationConfig":
        return CompilationConfig(**self.to_dict())

    def to_dict(self) -> Dict[str, Any]:
        out = {name: getattr(self, name) for name in _FIELDS}
        out["fusion_patterns"] = self.fusion_patterns.to_dict()
        return out

    @property
    def capture(self) -> bool:
        """Whether the compiled graph is captured as a device graph."""
        return self.aclgraph_with_compile or self.aclgraph_only

    @property
    def fuse(self) -> bool:
        """Whether pattern fusion runs: off only for aclgraph_only without aclgraph_with_compile."""
        return self.aclgraph_with_compile or not self.aclgraph_only

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"CompilationConfig({inner})"


CompilationConfig.reset()  # the class attributes: each setting's default, from the table above
CompilationConfig.__doc__ = (CompilationConfig.__doc__ or "") + "\n    Settings:\n\n" + "".join(
    f"    - ``{name}`` ({field.default_doc or repr(field.default)}): {field.doc}\n" for name, field in _FIELDS.items())


def _setting_rows() -> Iterator[Tuple[str, str, str, str]]:
    """(name, default, type, description) of every setting as the docs show them, fusion switches included."""
    for name, field in _FIELDS.items():
        if name == "fusion_patterns":
            for sub, sub_field in _FUSION_FIELDS.items():
                yield f"fusion_patterns.{sub}", repr(sub_field.default), sub_field.expected, sub_field.doc
        else:
            yield name, field.default_doc or repr(field.default), field.expected, field.doc


def settings_table() -> str:
    """The Markdown table of every setting (name, default, type, description): docs/settings.md holds it."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| Setting | Default | Type | Description |", "| --- | --- | --- | --- |"]
    lines += [f"| `{name}` | `{cell(default)}` | {cell(kind)} | {cell(doc)} |"
              for name, default, kind, doc in _setting_rows()]
    return "\n".join(lines) + "\n"
