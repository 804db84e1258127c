"""The node types a schema is built from: scalars, names, lists and blocks, each yielding one message
per problem, as

    config.process[0].train.steps = 'ten': not a whole number; allowed: a whole number >= 1, at most 10,000,000

naming the key path, the value, what is allowed and, for an unknown key or value, the
closest known one. Scalars are checked by the settings catalogue's own rule and words
(`Setting.problem`, flux2_contract/settings.py), so a fault reads the same in a catalogued
setting and in a key of the trainer's. Values the trainer decides come from a `Vocabulary` read from the trainer
itself (launcher/runs/vocabulary.py); without a trainer checkout those parts are not checked.
The preset's table of them is launcher/runs/schema.py.

A small declarative table, not a validation library: the messages above are the point, and
jsonschema or pydantic would need the same amount of code again to phrase their errors this
way, plus dependencies (compiled ones for pydantic) in a launcher that needs only PyYAML and
GitPython.
"""

import re
import reprlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from flux2_contract import settings
from launcher.suggest import did_you_mean


@dataclass(frozen=True)
class Vocabulary:
    """What the trainer accepts, read from its checkout; None = not known, not checked."""

    section_keys: dict[str, set[str]] | None = None
    """{section: keys the trainer reads}; "process" is the process level."""
    model_kwargs: set[str] | None = None
    qtypes: set[str] | None = None
    optimizers: set[str] | None = None
    optimizer_prefixes: set[str] = field(default_factory=set)
    network_types: set[str] | None = None
    dtypes: set[str] | None = None
    jobs: set[str] | None = None
    arches: set[str] | None = None
    """The `arch` of each model class of the trainer's extensions (launcher/runs/vocabulary.py)."""


_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel, _PREVIEW.maxdict, _PREVIEW.maxlist, _PREVIEW.maxstring = 2, 3, 3, 60


def short(value) -> str:
    """A value as the message shows it: repr, cut to a readable length; a mapping or list is
    previewed a few items deep, never expanded whole (an alias bomb stands for billions)."""
    text = _PREVIEW.repr(value) if isinstance(value, (dict, list, tuple, set)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def kind_of(value) -> str:
    """What a whole file parsed to, in words and without its content: a file that is not a preset
    (a key file, a note) is named, never shown."""
    if value is None:
        return "nothing (an empty document)"
    words = {bool: "true or false", int: "a number", float: "a number", str: "a line of text", list: "a list"}
    return words.get(type(value), f"a {type(value).__name__}")


def problem(path: str, value, what: str, allowed: str, known=()) -> str:
    hint = did_you_mean(value, known) if isinstance(value, str) and known else ""
    return f"{path} = {short(value)}: {what}; allowed: {allowed}{hint}"


class Spec:
    """One node of the schema: `check` yields a message per problem under `path`."""

    allowed = "anything"

    def check(self, value, path: str, vocab: Vocabulary) -> Iterator[str]:
        yield from ()


class Anything(Spec):
    pass


NO_DEFAULT = object()
"""What null is checked as where no default stands behind it: in the catalogue null means the
setting's default, while the schema's own keys have none, so there it is a value of no kind,
refused in the kind's own words."""


def kind(name: str, **bounds):
    """A nameless setting of one of the catalogue's kinds (bool, int, number, text, choice): the
    catalogue's rule and words for a key it does not hold (the trainer's own, the watchdog's)."""
    return settings.Setting("", "", name, None, "", **bounds)


@dataclass(frozen=True)
class Value(Spec):
    """A scalar checked by the settings catalogue's rule (`Setting.problem`, flux2_contract/settings.py),
    so one fault reads the same in every block. A catalogued setting takes null as its default (`null_is_default`)."""

    setting: object
    multiple_of: int | None = None
    null_is_default: bool = False

    @property
    def allowed(self) -> str:
        return self.setting.allowed + (f", a multiple of {self.multiple_of}" if self.multiple_of else "")

    def check(self, value, path, vocab):
        if self.setting.kind == "number" and isinstance(value, str) and _looks_numeric(value):
            yield problem(path, value, "text, not a number (YAML reads 1e-4 as text: write 1.0e-4)", self.allowed)
            return
        why = self.setting.problem(NO_DEFAULT if value is None and not self.null_is_default else value)
        if why:
            yield problem(path, value, why, self.allowed, self.setting.choices)
        elif self.multiple_of and isinstance(value, int) and value % self.multiple_of:
            below = value // self.multiple_of * self.multiple_of
            yield problem(path, value, f"not a multiple of {self.multiple_of} (use {below} or "
                          f"{below + self.multiple_of})", self.allowed)


def flag() -> Value:
    return Value(kind("bool"))


def whole(minimum: int | None = None, maximum: int | None = None, multiple_of: int | None = None) -> Value:
    """A whole number; `maximum` is what a human would still mean, a bound far above any real value,
    so a typo's extra digits are refused here, before the disk and memory arithmetic multiplies them."""
    return Value(kind("int", minimum=minimum, maximum=maximum), multiple_of)


def number(minimum: float | None = None, maximum: float | None = None, above: float | None = None) -> Value:
    return Value(kind("number", minimum=minimum, maximum=maximum, above=above))


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Text(Spec):
    """Text, or one of a set of words: the catalogue's `text` and `choice` kinds."""

    choices: tuple[str, ...] | Callable[[Vocabulary], set[str] | None] | None = None
    """Allowed values: fixed, or read from the trainer's vocabulary (None there: unchecked)."""
    prefixes: Callable[[Vocabulary], set[str]] | None = None
    """Values starting with one of these are allowed too (optimizer families)."""
    fold_case: bool = False
    max_chars: int | None = None

    def check(self, value, path, vocab):
        choices = self.choices(vocab) if callable(self.choices) else self.choices
        prefixes = self.prefixes(vocab) if self.prefixes else set()
        words = kind("choice", choices=tuple(sorted(choices))) if choices else None
        allowed = words.values + "".join(f" | {p}..." for p in sorted(prefixes)) if words else \
            kind("text").values + (f" of at most {self.max_chars:,} characters" if self.max_chars else "")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not words:
            yield problem(path, value, f"a number, not text (write it in quotes: '{value}')", allowed)
        elif why := kind("text").problem(NO_DEFAULT if value is None else value):
            yield problem(path, value, why, allowed)
        elif self.max_chars is not None and len(value) > self.max_chars:
            yield problem(path, value, f"longer than {self.max_chars:,} characters ({len(value):,})", allowed)
        elif words and not (word := value.lower() if self.fold_case else value).startswith(tuple(prefixes)) \
                and (why := words.problem(word)):
            yield problem(path, value, why, allowed, choices)


@dataclass(frozen=True)
class PlainName(Spec):
    """A file or folder name the launcher creates: no separators, no `..`, portable on Windows."""

    MAX_CHARS = 100
    """The run folder and the LoRA files are named after it (`<name>/<name>_000001000.safetensors`, about
    30 characters more): 100 keeps each inside the 255 bytes a file name may have on common filesystems
    (even at 2 bytes a character in UTF-8), and a run folder path short enough for Windows' 260-character
    MAX_PATH where the output folder itself is not deep."""
    allowed = f"a plain folder name of at most {MAX_CHARS} characters (letters, digits, . _ - and spaces; no / \\ : or ..)"
    FORBIDDEN = re.compile(r'[<>:"/\\|?*\x00-\x1f]')
    MAX_BYTES = 200
    """In UTF-8, with the LoRA's `_000001000.safetensors` or its workflow's `.workflow.json` after it
    (24 more): inside 255 bytes on Linux, where 100 characters of a script other than Latin reach 300."""
    DEVICES = frozenset({"con", "prn", "aux", "nul", "conin$", "conout$", "clock$",
                         *(f"{port}{digit}" for port in ("com", "lpt") for digit in "0123456789\u00b9\u00b2\u00b3")})
    """Names Windows keeps for devices, in any case and with any extension (`nul.txt` too): a folder
    or file of that name cannot be made, or writes go to the device."""

    def check(self, value, path, vocab):
        if not isinstance(value, str) or not value.strip():
            yield problem(path, value, "not a name", self.allowed)
        elif len(value) > self.MAX_CHARS:
            yield problem(path, value, f"{len(value)} characters; the run folder and LoRA files are named after it",
                          self.allowed)
        elif len(value.encode("utf-8", errors="surrogateescape")) > self.MAX_BYTES:
            yield problem(path, value, f"{len(value.encode('utf-8', errors='surrogateescape'))} bytes in UTF-8, over "
                          f"{self.MAX_BYTES}; the run folder and LoRA files are named after it", self.allowed)
        elif self.FORBIDDEN.search(value) or value.strip(". ") == "" or value != value.rstrip(". "):
            yield problem(path, value, "would not stay one folder inside the output folder", self.allowed)
        elif value.split(".")[0].rstrip(" ").lower() in self.DEVICES:
            yield problem(path, value, "a name Windows keeps for a device (CON, PRN, AUX, NUL, COM1-9, LPT1-9): "
                          "no folder of that name can be made there", self.allowed)


@dataclass(frozen=True)
class Extension(Spec):
    """A caption file extension: a plain suffix, never a path."""

    allowed = "a plain file extension without the dot (txt, caption): letters, digits, _ and -"
    PLAIN = re.compile(r"[A-Za-z0-9_-]{1,32}")

    def check(self, value, path, vocab):
        if not isinstance(value, str) or not self.PLAIN.fullmatch(value):
            yield problem(path, value, "not a plain file extension", self.allowed)


@dataclass(frozen=True)
class Nullable(Spec):
    inner: Spec

    @property
    def allowed(self) -> str:
        return f"null or {self.inner.allowed}"

    def check(self, value, path, vocab):
        if value is not None:
            yield from self.inner.check(value, path, vocab)


@dataclass(frozen=True)
class ListOf(Spec):
    item: Spec
    min_items: int = 0

    @property
    def allowed(self) -> str:
        least = f" of at least {self.min_items} item{'s' if self.min_items > 1 else ''}" if self.min_items else ""
        return f"a list{least}, each {self.item.allowed}"

    def check(self, value, path, vocab):
        if not isinstance(value, list) or len(value) < self.min_items:
            yield problem(path, value, "not a list" if not isinstance(value, list) else "too few items",
                          self.allowed)
            return
        for index, item in enumerate(value):
            yield from self.item.check(item, f"{path}[{index}]", vocab)


@dataclass(frozen=True)
class OneOrList(Spec):
    """A single value or a list of them (dataset resolutions)."""

    item: Spec

    @property
    def allowed(self) -> str:
        return f"{self.item.allowed}, or a list of them"

    def check(self, value, path, vocab):
        yield from ListOf(self.item, 1).check(value if isinstance(value, list) else [value], path, vocab)


@dataclass(frozen=True)
class Block(Spec):
    """A mapping with typed keys; other keys are refused unless `extra` admits them."""

    keys: dict[str, Spec] = field(default_factory=dict)
    extra: str | Spec | None = None
    """None: closed; a Spec: any other key, with that value type; a section name: the other
    keys the trainer reads in that section (unchecked without a trainer checkout)."""
    required: tuple[str, ...] = ()

    allowed = "a mapping (key: value lines)"

    def check(self, value, path, vocab):
        if not isinstance(value, dict):
            yield problem(path, value, "not a mapping", self.allowed)
            return
        for key in self.required:
            if key not in value:
                yield f"{path}.{key} is missing; it is required"
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            spec = self.keys.get(key) or self._extra_spec(key, vocab)
            if spec is None:
                yield self._unknown(key, item, where, vocab)
            else:
                yield from spec.check(item, where, vocab)

    def _known(self, vocab: Vocabulary) -> set[str] | None:
        if isinstance(self.extra, str):
            known = (vocab.model_kwargs if self.extra == "model_kwargs"
                     else (vocab.section_keys or {}).get(self.extra))
            return None if known is None else set(known) | set(self.keys)
        return set(self.keys)

    def _extra_spec(self, key, vocab: Vocabulary) -> Spec | None:
        if isinstance(self.extra, Spec):
            return self.extra
        known = self._known(vocab)
        return Anything() if known is None or key in known else None

    def _unknown(self, key, item, where: str, vocab: Vocabulary) -> str:
        known = self._known(vocab) or set()
        who = "the trainer would silently ignore it" if isinstance(self.extra, str) else "not a setting"
        # the key only: an unknown key's value may be anything, a secret of a file inherited by mistake too
        return f"{where}: unknown key ({who}){did_you_mean(str(key), known)}"


def catalogued(table: dict, refined: dict[str, Spec]) -> dict[str, Spec]:
    """The settings of one block (name: Setting) as specs; `refined` gives a nested block its own keys."""
    return {name: refined.get(name) or Value(item, null_is_default=True) for name, item in table.items()}
