"""Text in the static figures (matplotlib): fonts that hold the glyphs, and titles that fit their width.

A schedule name comes from the user (a file name, any script). Characters the figure's fonts lack are drawn with
another installed font that has them; where no installed font has them they are written as ``\\uXXXX`` escapes,
so a figure never shows empty boxes and matplotlib never warns about missing glyphs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from matplotlib.font_manager import FontProperties, findfont, fontManager
from matplotlib.textpath import text_to_path

FONT_FAMILY = ("Helvetica", "Arial", "Liberation Sans", "DejaVu Sans")
ELLIPSIS = "…"


@functools.cache
def base_families() -> tuple[str, ...]:
    """The figure's sans-serif fonts that are installed, best first."""
    available = {f.name for f in fontManager.ttflist}
    return tuple(f for f in FONT_FAMILY if f in available) or ("sans-serif",)


@functools.cache
def _charmap(path: str) -> frozenset[int]:
    from matplotlib.ft2font import FT2Font

    try:
        return frozenset(FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):
        return frozenset()


@functools.cache
def _family_path(family: str) -> str | None:
    try:
        return findfont(FontProperties(family=family), fallback_to_default=False)
    except ValueError:
        return None


def _covered(families: tuple[str, ...]) -> frozenset[int]:
    out: set[int] = set()
    for family in families:
        path = _family_path(family)
        if path is not None:
            out |= _charmap(path)
    return frozenset(out)


#: Words in the names of fonts made to cover many scripts (CJK, Arabic, Indic, ...): only these are searched for a
#: missing character, as opening every installed font costs seconds. matplotlib's "Last Resort" font has every
#: code point but draws each as a box, so it never counts.
_WIDE_COVERAGE = ("CJK", "Han", "Noto", "Fallback", "Unicode", "WenQuanYi", "Droid", "YaHei", "PingFang",
                  "Hiragino", "Heiti", "SimHei", "SimSun", "Gothic", "Mincho", "Malgun", "Nanum", "Ming", "Kai")


@functools.cache
def _wide_fonts() -> tuple[tuple[str, str], ...]:
    """``(family, file)`` of installed fonts that are likely to hold scripts the figure fonts lack."""
    return tuple(
        (e.name, e.fname) for e in fontManager.ttflist
        if "Last Resort" not in e.name and any(word in e.name for word in _WIDE_COVERAGE)
    )


@functools.cache
def _fallback_for(codepoint: int) -> str | None:
    """An installed font family that has ``codepoint``, if any (searched once per character)."""
    for name, path in _wide_fonts():
        if codepoint in _charmap(path):
            return name
    return None


def displayable(text: str) -> tuple[str, tuple[str, ...]]:
    """``text`` with characters no installed font has escaped, and the font families to draw it with."""
    families = base_families()
    if text.isascii():  # every figure font has ASCII
        return text, families
    have = _covered(families)
    extra: list[str] = []
    out: list[str] = []
    for ch in text:
        cp = ord(ch)
        if cp in have or not ch.isprintable():
            out.append(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii"))
            continue
        family = _fallback_for(cp)
        if family is None:
            out.append(ch.encode("unicode_escape").decode("ascii"))
            continue
        if family not in extra:
            extra.append(family)
            have = have | _charmap(_family_path(family) or "")
        out.append(ch)
    return "".join(out), families + tuple(extra)


def text_width_pt(text: str, *, fontsize: float, families: tuple[str, ...]) -> float:
    """Advance width of one line of ``text`` in points (from the font's metrics; no drawing)."""
    if not text:
        return 0.0
    prop = FontProperties(family=list(families), size=fontsize)
    width, _, _ = text_to_path.get_text_width_height_descent(text, prop, ismath=False)
    return float(width)


@dataclass(frozen=True)
class FittedTitle:
    text: str  # lines joined with "\n"
    fontsize: float
    families: tuple[str, ...]

    @property
    def num_lines(self) -> int:
        return self.text.count("\n") + 1


def fit_title(text: str, width_pt: float, *, fontsize: float = 11.0, min_fontsize: float = 8.0) -> FittedTitle:
    """The title as it fits ``width_pt``: on one line; else broken after the name ("name:" / the numbers); then
    set smaller, down to ``min_fontsize``; then the longest line shortened in the middle with an ellipsis."""
    text, families = displayable(text)

    @functools.cache
    def unit_width(line: str) -> float:
        return text_width_pt(line, fontsize=100.0, families=families) / 100.0

    def width(line: str, size: float) -> float:  # widths scale with the size
        return unit_width(line) * size

    if width(text, fontsize) <= width_pt:
        return FittedTitle(text, fontsize, families)
    head, sep, tail = text.partition(": ")
    lines = [head + sep.rstrip(), tail] if sep else [text]
    size = fontsize
    while size > min_fontsize and max(width(ln, size) for ln in lines) > width_pt:
        size = max(min_fontsize, size - 0.5)
    for i, line in enumerate(lines):
        if width(line, size) <= width_pt:
            continue
        lo, hi = 1, len(line)  # the most characters that fit, kept from both ends
        while lo < hi:
            keep = (lo + hi + 1) // 2
            if width(_middle(line, keep), size) <= width_pt:
                lo = keep
            else:
                hi = keep - 1
        lines[i] = _middle(line, lo)
    return FittedTitle("\n".join(lines), size, families)


def _middle(line: str, keep: int) -> str:
    if keep >= len(line):
        return line
    front = (keep + 1) // 2
    return line[:front] + ELLIPSIS + line[len(line) - (keep - front):]
