"""The all-reduce spec language: parse, validate and route by size.

A spec is an ordered list of entries ``(alg, shards, limit)``: a tensor of ``B`` bytes
is reduced by the first entry whose ``limit >= B``; the last entry has ``limit = -1``
(no upper bound). Accepted forms (one parser serves the library and the CLI):

* TensorFlow's Python forms: a string ``"xring"``, a tuple of 1 to 3 elements
  ``(alg, shards, limit)``, an ``AllReduceSpecTuple``, a list of such tuples;
* the tf_cnn_benchmarks string grammar ``alg[#shards][:limit:alg[#shards]]...``
  (``"nccl#2:1K:pscpu/pscpu#2"``), where the last limit is left out and means -1;
* a comma form ``alg:shards:limit,...`` (``"nccl:2:1024,pscpu/pscpu:2:-1"``), where
  an entry may leave out ``limit`` (-1) or ``shards:limit`` (1, -1) when the spec
  has several entries (a single entry is ``alg:shards:limit``, or just ``alg``).

Limits are **bytes** (TensorFlow's code compared element counts although its docs said
bytes; mpistrat follows the docs). The suffixes K, M, G and T are powers of two
(``1K`` = 1024), written ``1K``, ``1KB`` or ``1KiB`` in any case. A limit is at most
:data:`MAX_BYTES` (2**63 - 1, the largest size NumPy can give an array) and ``shards`` at
most :data:`MAX_SHARDS` (1024).

Validation is eager and complete: every problem TensorFlow let through (a dict or
None silently becoming an empty spec, unknown names found only at reduce time, limits
that starve later entries, a missing catch-all) is an error here, naming the entry,
what was expected and how to fix it. Parsing needs no MPI.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

from . import algorithms
from .errors import SpecError, SpecTypeError

__all__ = [
    "check_entry",
    "MAX_SHARDS",
    "MAX_BYTES",
    "AllReduceSpecTuple",
    "AllReduceSpec",
    "PlanRow",
    "SpecLike",
    "parse_spec",
    "parse_bytes",
    "format_bytes",
    "format_limit",
]

UNBOUNDED = -1

MAX_SHARDS = 1024
"""The most shards a spec entry may have. Ring pipelines (``xring#S``) each run a ring of
their own: a call posts ``2 S`` messages per step and cuts the buffer into ``n S`` chunks,
so its cost grows with ``S`` while the overlap it buys levels off after a few, and pipeline
``s`` sends with MPI tag ``s`` (MPI promises tags up to 32767 only). Gather ranks
(``pscpu#k``) are bounded by the ranks or devices of the job as well; 1024 of them is a
shuffle in which each of 1024 ranks gathers a piece from every other."""

MAX_BYTES = (1 << 63) - 1
"""The largest limit a spec entry may have, in bytes: an array's size is an int64."""

_MAX_DIGITS = len(str(MAX_BYTES))

_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_LIMIT_RE = re.compile(r"^\s*(\d+)\s*(?:([KMGT])(?:I?B)?|B)?\s*$", re.IGNORECASE)
_INT_RE = re.compile(r"^\s*[+-]?\d+\s*$")


class AllReduceSpecTuple(NamedTuple):
    """One spec entry, as TensorFlow names it: ``(alg, shards, limit)``."""

    alg: str
    shards: int = 1
    limit: int = UNBOUNDED


SpecLike = Union[str, tuple, list, "AllReduceSpec"]


def parse_bytes(text: str | int) -> int:
    """Parse a byte count such as ``"1024"``, ``"32K"``, ``"1MiB"``, ``"-1"`` or ``1024``.

    Raises:
        SpecError: the text is not a whole number of bytes with an optional K/M/G/T
            suffix, nor -1, or it is above :data:`MAX_BYTES` (``SpecTypeError`` for a
            value that is neither str nor int).
    """
    if not isinstance(text, str):
        if isinstance(text, bool) or not _is_integer(text):
            raise SpecTypeError(
                f"a byte count must be a str or an int, got {_show(text)} "
                f"({type(text).__name__})"
            )
        value = operator.index(text)
        if abs(value) > MAX_BYTES:  # (never str() of thousands of digits: Python refuses)
            raise SpecError(_too_large(_show(value)) if value > 0 else _not_bytes(_show(value)))
        text = str(value)
    if text.strip() == "-1":
        return UNBOUNDED
    match = _LIMIT_RE.match(text)
    if not match:
        raise SpecError(_not_bytes(_quote(text)))
    number, unit = match.groups()
    digits = number.lstrip("0")
    if len(digits) > _MAX_DIGITS:  # (before int(): Python refuses more than 4300 digits)
        raise SpecError(_too_large(_quote(text)))
    value = int(digits or "0") << (10 * _UNITS[(unit or "").upper()])
    if value > MAX_BYTES:
        raise SpecError(_too_large(_quote(text)))
    return value


def _not_bytes(shown: str) -> str:
    return (f"byte count {shown} is not a whole number of bytes: expected digits with an "
            f"optional K/M/G/T suffix (powers of two, e.g. 1024, 32K, 4MiB) or -1 for no limit")


def _too_large(shown: str) -> str:
    return (f"byte count {shown} is too large: at most {MAX_BYTES} bytes (2**63 - 1, 8 EiB); "
            f"give a smaller count, or -1 for no limit")


def format_limit(limit: int) -> str:
    """Write a limit in the shortest exact spec form: ``1024`` → ``"1K"``, -1 → ``"-1"``."""
    if limit < 0:
        return str(limit)
    for unit in "TGMK":
        shift = 10 * _UNITS[unit]
        if limit and limit % (1 << shift) == 0:
            return f"{limit >> shift}{unit}"
    return str(limit)


def format_bytes(nbytes: int | None) -> str:
    """Write a byte count for people: ``0 B``, ``1 KiB``, ``1536 B``; None is ``∞``."""
    if nbytes is None or nbytes < 0:
        return "∞"
    for unit in "TGMK":
        shift = 10 * _UNITS[unit]
        if nbytes and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}iB"
    return f"{nbytes} B"


@dataclass(frozen=True)
class PlanRow:
    """One row of a spec's plan: which tensors an entry takes and what runs on them.

    ``min_bytes`` is the smallest size routed to the entry (inclusive), ``max_bytes``
    the largest (inclusive; None for no bound).
    """

    index: int
    alg: str
    shards: int
    limit: int
    min_bytes: int
    max_bytes: int | None
    hierarchical: bool
    intra: str | None
    inter: str | None
    needs_gpu: bool
    shards_meaning: str

    @property
    def range_text(self) -> str:
        """The size range as people read it: ``0 B – 1 KiB``, ``1 KiB – ∞``.

        The lower end is the previous entry's limit (exclusive): a tensor of exactly
        1 KiB goes to the row that ends at 1 KiB.
        """
        low = 0 if self.index == 0 else self.min_bytes - 1
        return f"{format_bytes(low)} – {format_bytes(self.max_bytes)}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "index": self.index,
            "algorithm": self.alg,
            "shards": self.shards,
            "shards_meaning": self.shards_meaning,
            "limit": self.limit,
            "min_bytes": self.min_bytes,
            "max_bytes": self.max_bytes,
            "range": self.range_text,
            "hierarchical": self.hierarchical,
            "intra": self.intra,
            "inter": self.inter,
            "needs_gpu": self.needs_gpu,
        }


@dataclass(frozen=True)
class AllReduceSpec:
    """A parsed and validated all-reduce spec: an immutable, ordered tuple of entries.

    Build one with :func:`parse_spec` (or ``AllReduceSpec.parse``); constructing it
    directly from entries also validates them.
    """

    entries: tuple[AllReduceSpecTuple, ...]

    def __post_init__(self) -> None:
        raw = self.entries
        if not isinstance(raw, (tuple, list)) or not all(isinstance(e, tuple) for e in raw):
            raise SpecTypeError(
                f"AllReduceSpec takes a tuple of (alg, shards, limit) tuples, got {_show(raw)}; "
                f"use parse_spec() for the other forms"
            )
        entries = tuple(_entry_from_tuple(e, i) for i, e in enumerate(raw))
        object.__setattr__(self, "entries", entries)
        _validate(entries, [_show(e) for e in raw])

    @classmethod
    def parse(cls, spec: SpecLike) -> AllReduceSpec:
        """Same as :func:`parse_spec`."""
        return parse_spec(spec)

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> AllReduceSpecTuple:
        return self.entries[index]

    def index_for(self, nbytes: int) -> int:
        """Index of the entry that reduces a tensor of ``nbytes`` bytes."""
        if nbytes < 0:
            raise ValueError(f"a tensor size cannot be negative, got {nbytes} bytes")
        for index, entry in enumerate(self.entries):
            if entry.limit == UNBOUNDED or nbytes <= entry.limit:
                return index
        raise AssertionError("unreachable: a validated spec ends with limit -1")

    def route(self, nbytes: int) -> AllReduceSpecTuple:
        """The entry that reduces a tensor of ``nbytes`` bytes (first with limit ≥ it)."""
        return self.entries[self.index_for(nbytes)]

    def plan(self) -> list[PlanRow]:
        """One :class:`PlanRow` per entry: the byte range it takes and what runs."""
        rows = []
        low = 0
        for index, (alg, shards, limit) in enumerate(self.entries):
            info = algorithms.get(alg)
            rows.append(PlanRow(
                index=index, alg=alg, shards=shards, limit=limit, min_bytes=low,
                max_bytes=None if limit == UNBOUNDED else limit,
                hierarchical=info.hierarchical, intra=info.intra, inter=info.inter,
                needs_gpu=info.needs_gpu, shards_meaning=info.shards.value,
            ))
            low = limit + 1
        return rows

    def __str__(self) -> str:
        """The tf_cnn_benchmarks form, e.g. ``nccl#2:1K:pscpu/pscpu#2``."""
        parts = []
        for alg, shards, limit in self.entries:
            parts.append(alg if shards == 1 else f"{alg}#{shards}")
            if limit != UNBOUNDED:
                parts.append(format_limit(limit))
        return ":".join(parts)

    def to_comma_form(self) -> str:
        """The comma form, e.g. ``nccl:2:1024,pscpu/pscpu:2:-1``."""
        return ",".join(f"{alg}:{shards}:{limit}" for alg, shards, limit in self.entries)

    def __repr__(self) -> str:
        return f"AllReduceSpec({str(self)!r})"


# --------------------------------------------------------------------------- parsing


def parse_spec(spec: SpecLike) -> AllReduceSpec:
    """Parse and validate an all-reduce spec in any accepted form.

    Args:
        spec: a string (tf_cnn_benchmarks grammar or comma form), a tuple of 1–3
            elements, an ``AllReduceSpecTuple``, a list of tuples, or an
            ``AllReduceSpec`` (returned as is).

    Returns:
        The validated, immutable :class:`AllReduceSpec`.

    Raises:
        SpecError: (a ``ValueError``) the spec is malformed or invalid; the message names
            the entry, what was expected and a fix. ``SpecTypeError`` (also a
            ``TypeError``) when the spec or one of its parts has the wrong type.
    """
    if isinstance(spec, AllReduceSpec):
        return spec
    if isinstance(spec, str):
        raw, sources = _parse_string(spec)
    elif isinstance(spec, tuple):
        raw, sources = [_entry_from_tuple(spec, None)], [_show(spec)]
    elif isinstance(spec, list):
        if not spec:
            raise SpecError(_EMPTY)
        raw, sources = [], []
        for index, element in enumerate(spec):
            if not isinstance(element, tuple):
                raise SpecTypeError(
                    f"entry {index} of the spec list is {_show(element)} (a "
                    f"{type(element).__name__}); each element of a list spec must be a tuple "
                    f"(alg, shards, limit), e.g. ({_show(element)}, 1, -1)"
                    + (" — or pass the string alone instead of a list"
                       if isinstance(element, str) and len(spec) == 1 else "")
                )
            raw.append(_entry_from_tuple(element, index))
            sources.append(_show(element))
    else:
        raise SpecTypeError(
            f"an all-reduce spec must be a str, a tuple (alg, shards, limit) or a list of "
            f"such tuples, got {_show(spec)} ({type(spec).__name__}); for example 'xring', "
            f"('pscpu', 2), or [('nccl', 1, 1024), ('xring', 2, -1)]"
        )
    # Check the cross-entry rules here, where the messages can quote the user's text.
    _validate(tuple(raw), sources)
    return AllReduceSpec(tuple(raw))


def check_entry(alg: Any, shards: Any = 1) -> AllReduceSpecTuple:
    """Validate one entry ``alg#shards`` as :func:`parse_spec` validates entry 0 of a list
    spec (the same :class:`SpecError`), without building a spec."""
    return _entry_from_tuple((alg, shards), 0)


_EMPTY = (
    "empty all-reduce spec: expected at least one algorithm, e.g. 'xring' or "
    "'nccl#2:1K:pscpu/pscpu#2'"
)


def _where(index: int | None, source: str) -> str:
    return f"entry {index} {source}" if index is not None else f"spec {source}"


def _check_alg(alg: Any, where: str) -> str:
    if not isinstance(alg, str):
        raise SpecTypeError(
            f"{where}: the algorithm must be a str, got {_show(alg)} ({type(alg).__name__})"
            + ("; to give several entries, pass a list of tuples, not a tuple of tuples"
               if isinstance(alg, tuple) else "")
        )
    try:
        algorithms.get(alg)
    except SpecError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    return alg


def _check_shards(shards: Any, where: str) -> int:
    if isinstance(shards, str) and _INT_RE.match(shards):
        text = shards.strip()
        if len(text.lstrip("+-").lstrip("0")) > _MAX_DIGITS:  # (before int(): Python
            raise SpecError(  # refuses to convert more than 4300 digits)
                f"{where}: shards must be an integer from 1 to {MAX_SHARDS}, got "
                f"{_quote(text)}; use e.g. 1, 2 or 4"
            )
        shards = int(text)
    if isinstance(shards, bool) or not _is_integer(shards):
        raise SpecTypeError(
            f"{where}: shards must be an integer >= 1, got {_show(shards)}; e.g. 1 or 2"
        )
    shards = operator.index(shards)
    if shards < 1:
        raise SpecError(
            f"{where}: shards must be an integer >= 1, got {_show(shards)}; use 1 for a "
            f"single ring or gather rank"
        )
    if shards > MAX_SHARDS:
        raise SpecError(
            f"{where}: shards must be at most {MAX_SHARDS}, got {_show(shards)}; ring "
            f"pipelines gain nothing past a few and a shuffle has at most one gather rank "
            f"per rank: use e.g. 1, 2 or 4"
        )
    return shards


def _check_limit(limit: Any, where: str) -> int:
    if isinstance(limit, str):
        try:
            limit = parse_bytes(limit)
        except SpecError as exc:
            raise type(exc)(f"{where}: limit: {exc}") from None
    if isinstance(limit, bool) or not _is_integer(limit):
        raise SpecTypeError(
            f"{where}: the limit must be an integer number of bytes >= 0, or -1 for no "
            f"limit, got {_show(limit)} ({type(limit).__name__})"
        )
    limit = operator.index(limit)
    if limit < UNBOUNDED:
        raise SpecError(
            f"{where}: the limit must be an integer number of bytes >= 0, or -1 for no "
            f"limit, got {_show(limit)}"
        )
    if limit > MAX_BYTES:
        raise SpecError(
            f"{where}: the limit must be at most {MAX_BYTES} bytes (2**63 - 1, 8 EiB), got "
            f"{_show(limit)}; give a smaller limit, or -1 for no limit"
        )
    return limit


def _is_integer(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


_SHOW = 60  # characters of a value that a message quotes


def _quote(text: str) -> str:
    """``repr(text)`` for a message, shortened past :data:`_SHOW` characters (a spec of
    thousands of digits stays a one-line error)."""
    if len(text) <= _SHOW:
        return repr(text)
    return f"{text[:_SHOW // 2]!r}...{text[-10:]!r} ({len(text)} characters)"


def _show(value: Any) -> str:
    """``repr(value)`` for a message, shortened as :func:`_quote` does; an int too long
    for ``repr`` (Python converts at most 4300 digits) is described by its size."""
    if isinstance(value, (tuple, list)):
        items = [_show(item) for item in value]
        text = ", ".join(items) + ("," if isinstance(value, tuple) and len(items) == 1 else "")
        text = f"({text})" if isinstance(value, tuple) else f"[{text}]"
    elif _is_integer(value) and not isinstance(value, bool) \
            and abs(operator.index(value)).bit_length() > 200:
        number = operator.index(value)
        text = (f"{'-' if number < 0 else ''}<an integer of about "
                f"{int(number.bit_length() * 0.30103) + 1} digits>")
    else:
        text = repr(value)
    if len(text) <= _SHOW:
        return text
    return f"{text[:_SHOW // 2]}...{text[-10:]} ({len(text)} characters)"


def _entry_from_tuple(entry: tuple, index: int | None) -> AllReduceSpecTuple:
    where = _where(index, _show(entry))
    if not 1 <= len(entry) <= 3:
        raise SpecError(
            f"{where}: a spec tuple has 1 to 3 elements (alg, shards, limit), got "
            f"{len(entry)}; e.g. ('xring',), ('pscpu', 2) or ('nccl', 1, 1024)"
        )
    alg = _check_alg(entry[0], where)
    shards = _check_shards(entry[1], where) if len(entry) > 1 else 1
    limit = _check_limit(entry[2], where) if len(entry) > 2 else UNBOUNDED
    return AllReduceSpecTuple(alg, shards, limit)


def _parse_string(text: str) -> tuple[list[AllReduceSpecTuple], list[str]]:
    spec = text.strip()
    if not spec:
        raise SpecError(_EMPTY)
    if "," in spec:
        return _parse_comma_form(spec)
    parts = spec.split(":")
    if len(parts) == 3 and _INT_RE.match(parts[1]) and _looks_like_limit(parts[2]):
        return _parse_comma_form(spec)  # a single comma-form entry: alg:shards:limit
    if len(parts) % 2 == 0 and parts[-1].strip() == "-1":
        raise SpecError(
            f"all-reduce spec {_quote(text)} ends with ':-1': in the form "
            f"alg[#shards][:limit:alg[#shards]]... the last entry has no limit, so leave "
            f"it out (e.g. {_quote(':'.join(parts[:-1]))}), or write every entry as "
            f"alg:shards:limit separated by commas"
        )
    if len(parts) % 2 == 0:
        raise SpecError(
            f"all-reduce spec {_quote(text)} is not well formed: expected "
            f"alg[#shards][:limit:alg[#shards]]... (an algorithm after every limit, e.g. "
            f"'nccl#2:1K:pscpu/pscpu#2') or the comma form alg:shards:limit,... "
            f"(e.g. 'nccl:2:1024,pscpu/pscpu:2:-1')"
        )
    entries, sources = [], []
    for position in range(0, len(parts), 2):
        alg_spec = parts[position].strip()
        index = position // 2
        where = _where(index, _quote(alg_spec))
        if not alg_spec:
            raise SpecError(f"{where}: missing algorithm name in spec {_quote(text)}")
        alg, sep, shards_text = alg_spec.partition("#")
        alg = _check_alg(alg.strip(), where)
        if sep:
            if not shards_text.strip():
                raise SpecError(f"{where}: '#' must be followed by the number of shards")
            shards = _check_shards(shards_text.strip(), where)
        else:
            shards = 1
        if position + 1 < len(parts):
            limit_text = parts[position + 1]
            source = f"{alg_spec}:{limit_text.strip()}"
            limit = _check_limit(limit_text, _where(index, _quote(source)))
            if limit == UNBOUNDED:
                raise SpecError(
                    f"{_where(index, _quote(source))}: limit -1 (no limit) can only end a "
                    f"spec; in this form leave the last limit out instead"
                )
        else:
            source, limit = alg_spec, UNBOUNDED
        entries.append(AllReduceSpecTuple(alg, shards, limit))
        sources.append(_quote(source))
    return entries, sources


def _looks_like_limit(text: str) -> bool:
    return text.strip() == "-1" or bool(_LIMIT_RE.match(text))


def _parse_comma_form(spec: str) -> tuple[list[AllReduceSpecTuple], list[str]]:
    entries, sources = [], []
    for index, chunk in enumerate(spec.split(",")):
        chunk = chunk.strip()
        where = _where(index, _quote(chunk))
        if not chunk:
            raise SpecError(f"{where}: empty entry in the comma form {_quote(spec)}")
        if "#" in chunk:
            raise SpecError(
                f"{where}: the comma form is alg:shards:limit (e.g. 'pscpu:2:1024'); "
                f"'#shards' belongs to the other form (e.g. 'pscpu#2:1K:xring')"
            )
        fields = chunk.split(":")
        if len(fields) > 3:
            raise SpecError(
                f"{where}: a comma-form entry is alg[:shards[:limit]], got {len(fields)} "
                f"fields; separate entries with ','"
            )
        alg = _check_alg(fields[0].strip(), where)
        shards = _check_shards(fields[1].strip(), where) if len(fields) > 1 else 1
        limit = _check_limit(fields[2], where) if len(fields) > 2 else UNBOUNDED
        entries.append(AllReduceSpecTuple(alg, shards, limit))
        sources.append(_quote(chunk))
    return entries, sources


# ------------------------------------------------------------------------ validation


def _validate(entries: tuple[AllReduceSpecTuple, ...], sources: list[str]) -> None:
    """Check the rules that involve several entries (each entry is already checked)."""
    if not entries:
        raise SpecError(_EMPTY)
    for index, entry in enumerate(entries):
        where = _where(index, sources[index])
        _check_alg(entry.alg, where)
        _check_shards(entry.shards, where)
        _check_limit(entry.limit, where)
    unbounded = [i for i, e in enumerate(entries) if e.limit == UNBOUNDED]
    if not unbounded:
        last = entries[-1]
        raise SpecError(
            f"no entry has limit -1 (no upper bound): tensors larger than "
            f"{format_bytes(last.limit)} would have no algorithm; make the last limit -1, "
            f"e.g. ({last.alg!r}, {last.shards}, -1), or append an entry such as "
            f"('xring', 1, -1)"
        )
    if len(unbounded) > 1:
        first, second = unbounded[:2]
        raise SpecError(
            f"limit -1 appears more than once (entries {first} {sources[first]} and "
            f"{second} {sources[second]}): only the last entry may be unbounded; give the "
            f"earlier one a byte limit"
        )
    if unbounded[0] != len(entries) - 1:
        index = unbounded[0]
        raise SpecError(
            f"{_where(index, sources[index])} has limit -1 (no upper bound) but is not the "
            f"last entry: the {len(entries) - 1 - index} entries after it would never "
            f"receive a tensor; move it to the end or give it a byte limit"
        )
    for index in range(1, len(entries) - 1):
        previous, current = entries[index - 1], entries[index]
        if current.limit <= previous.limit:
            raise SpecError(
                f"limits must strictly increase: {_where(index, sources[index])} has limit "
                f"{current.limit} B, not above the {previous.limit} B of entry {index - 1} "
                f"{sources[index - 1]}, so it would never receive a tensor; raise its limit "
                f"or remove it"
            )
