"""What vLLM's grammar backends refuse in a regex (structured_outputs.regex), known without vllm.

vLLM turns a regex into a grammar with its structured-output backend: `xgrammar` alone when
model.compact_json is on (batchinfer's default), else `auto` (xgrammar, and guidance where xgrammar
refuses). Python's `re` checks the syntax; a scan of the pattern finds what the backends refuse
although Python takes it. tests/contract/test_request_verdict.py holds these rules against vLLM.

Refused under every backend (both refuse it, or xgrammar takes it first and misreads it):
lookarounds, backreferences, word boundaries, atomic groups, conditionals, comment groups, `{,n}`, a
`{` that starts no repetition, `\\A` and `\\Z` (xgrammar matches the letters A and Z). Refused under
xgrammar alone (guidance takes them): Unicode classes `\\p{L}` (under auto, general categories only),
inline flags such as `(?i)`, `(?P<name>...)` groups, possessive quantifiers (`a++`), a class opening
with `]` (the last four taken in a JSON schema's pattern). Escapes Python does not know (`\\G`, `\\h`)
are refused: xgrammar would match the letter.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, Optional

XGRAMMAR = "xgrammar"
_NAMED = re.compile(r"\(\?<([A-Za-z_]\w*)>")  # (?<name>...): both backends take it, Python spells it (?P<name>
_REPEAT = re.compile(r"\{(\d+)(,\d*)?\}")
_FLAGS = re.compile(r"\(\?[aiLmsux-]+[:)]")
# \p{..}, \P{..}, \pL (and \\, kept: an escaped backslash is no class)
_PROPERTY = re.compile(r"\\\\|\\[pP](?:\{\^?\w+\}|[A-Za-z])")
# Unicode general categories, as guidance's regex reader (Rust's regex-syntax) names them
GENERAL_CATEGORIES = frozenset(
    "L Lu Ll Lt Lm Lo LC M Mn Mc Me N Nd Nl No P Pc Pd Ps Pe Pi Pf Po S Sm Sc Sk So Z Zs Zl Zp C Cc Cf Cs Co Cn".split()
)
_UNSUPPORTED = "lookarounds, backreferences, word boundaries are not supported"


def regex_problem(pattern: str, backend: str = XGRAMMAR, in_json: bool = False) -> Optional[str]:
    """Why vLLM's structured outputs refuse a regex under backend ("it takes ..."), or None. in_json:
    a JSON schema's pattern, which xgrammar converts with a reader that also takes inline flags and
    possessive quantifiers."""
    if "\x00" in pattern:
        return "a regex without a NUL character"
    named = [m.group(0) for m in _PROPERTY.finditer(pattern) if m.group(0) != "\\\\"]
    if named and backend == XGRAMMAR:
        return (
            "a regex without '\\p' under vLLM's xgrammar backend (Unicode classes such as \\p{L} are not "
            "supported; write the characters as a class, e.g. [a-zA-Z\\u00c0-\\u024f], or set "
            "model.compact_json=false: vLLM then falls back to guidance, which takes them)"
        )
    if named and _in_class(pattern, ("\\p", "\\P")):
        return (
            "a regex without '\\p' in a character class (vLLM's xgrammar backend takes it first and matches "
            "the letter p; write the class as an alternative, e.g. (?:\\p{L}|\\d) for [\\p{L}\\d])"
        )
    unknown = [n for n in named if n[2:].strip("{}^") not in GENERAL_CATEGORIES]
    if unknown:
        return f"a regex whose \\p classes name Unicode general categories (L, Lu, N, P, ...), not {unknown[0]!r}"
    # each class stands for one character, for Python's syntax check and the scan
    plain = _PROPERTY.sub(lambda m: m.group(0) if m.group(0) == "\\\\" else "a", pattern)
    try:
        re.compile(_NAMED.sub(r"(?P<\1>", plain))
    except re.error as e:
        # xgrammar would take such an escape and match the letter itself (\\G as G): refused here
        hint = "; write the character itself, or a class" if str(e).startswith("bad escape") else ""
        return f"a valid regex ({e}{hint})"
    except (RecursionError, OverflowError) as e:  # nesting or a repetition count Python cannot take
        return f"a valid regex ({type(e).__name__})"
    return _scan(plain, backend == XGRAMMAR and not in_json)


def _in_class(p: str, escapes: tuple[str, ...]) -> bool:
    """Whether one of escapes stands inside a character class of p."""
    i, inside = 0, False
    while i < len(p):
        if p[i] == "\\":
            if inside and p.startswith(escapes, i):
                return True
            i += 2
            continue
        if p[i] == "[" and not inside:
            inside = True
            i += 2 if p.startswith(("[]", "[^"), i) else 1  # a ] first is a character
            continue
        inside = inside and p[i] != "]"
        i += 1
    return False


def _scan(p: str, xgrammar_only: bool) -> Optional[str]:
    """The first construct the backend refuses, walking the pattern (Python found it valid)."""
    i, n = 0, len(p)
    while i < n:
        c = p[i]
        if c == "\\":
            esc = p[i + 1]
            if esc in "123456789" or esc in "bB" or p.startswith("k<", i + 1):
                return f"a regex without {p[i : i + 2]!r} ({_UNSUPPORTED})"
            if esc in "AZ":
                return (
                    f"a regex without {p[i : i + 2]!r} (vLLM's xgrammar backend reads it as the letter {esc}, "
                    "not an anchor; the whole output must match the regex anyway: leave it out)"
                )
            i += 2
            continue
        if c == "[":
            i, found = _class(p, i + 1, xgrammar_only)
            if found:
                return found
            continue
        if c == "(" and p.startswith("?", i + 1):
            found = _group(p, i, xgrammar_only)
            if found:
                return found
        elif c == "{":
            m = _REPEAT.match(p, i)
            if p.startswith("{,", i):
                return "a regex without '{,' (a repetition needs its lower bound: write {0,n})"
            if not m:
                return "a regex whose '{' starts a repetition {m}, {m,} or {m,n} (write \\{ for a literal brace)"
            i = m.end()
            if xgrammar_only and p.startswith("+", i):
                return _possessive(p[m.start() : i + 1])
            continue
        elif c in "*+?" and xgrammar_only and p.startswith("+", i + 1) and not _lazy_mark(p, i):
            return _possessive(p[i : i + 2])
        i += 1
    return None


def _lazy_mark(p: str, i: int) -> bool:
    """p[i] is the `?` making the quantifier before it lazy (a*?, a+?, a??, a{2}?): not a quantifier itself."""
    return p[i] == "?" and i > 0 and p[i - 1] in "*+?}" and not (i > 1 and p[i - 2] == "\\")


def _possessive(token: str) -> Optional[str]:
    return (
        f"a regex without {token!r} under vLLM's xgrammar backend (possessive quantifiers are not supported; "
        "with model.compact_json=false vLLM falls back to guidance, which takes them)"
    )


def _group(p: str, i: int, xgrammar_only: bool) -> Optional[str]:
    """Why the group opening at p[i] ("(?...") is refused, or None."""
    head = p[i : i + 4]
    if head.startswith("(?#"):
        return "a regex without '(?#' (comment groups are not supported: remove the comment)"
    if head.startswith(("(?=", "(?!", "(?>", "(?(", "(?<=", "(?<!", "(?P=")):
        what = head[:4] if head.startswith(("(?<", "(?P")) else head[:3]
        return f"a regex without {what!r} ({_UNSUPPORTED})"
    if head.startswith("(?:") or _NAMED.match(p, i):
        return None
    if xgrammar_only:
        flags = _FLAGS.match(p, i)
        what = flags.group(0) if flags else p[i : i + 4]
        return (
            f"a regex without {what!r} under vLLM's xgrammar backend (inline flags and (?P<name> groups are not "
            "supported; write (?<name>...) or (?:...), or set model.compact_json=false: vLLM then falls back to "
            "guidance, which takes them)"
        )
    return None


def _class(p: str, i: int, xgrammar_only: bool) -> tuple[int, Optional[str]]:
    """The index after the character class whose body starts at p[i], and why it is refused (or None)."""
    if p.startswith("^", i):
        i += 1
    if p.startswith("]", i):
        if xgrammar_only:
            return i, "a regex whose character class does not open with ']' under vLLM's xgrammar backend (write \\])"
        i += 1
    while i < len(p) and p[i] != "]":
        i += 2 if p[i] == "\\" else 1
    return i + 1, None


UNBOUNDED = 2**31  # a width at or above it: Python's parser says "no upper bound" (MAXREPEAT)


class PatternLengths(NamedTuple):
    """The lengths of the strings a JSON schema's pattern admits (a search, not a full match)."""

    fewest: int  # characters of the shortest string holding a match
    most: Optional[int]  # of the longest (anchored at both ends and bounded; None: no limit)
    anchored: bool  # at both ends (^...$): the match is the whole string


def pattern_lengths(pattern: str) -> Optional[PatternLengths]:
    """The lengths of strings holding a match of pattern, as Python's parser reads it; None when it
    cannot read the pattern (e.g. \\p classes)."""
    try:
        from re import _constants as sre_constants
        from re import _parser as sre_parse
    except ImportError:  # Python 3.10
        import sre_constants  # type: ignore[no-redef]
        import sre_parse  # type: ignore[no-redef]
    try:
        parsed = sre_parse.parse(_NAMED.sub(r"(?P<\1>", pattern))
        low, high = parsed.getwidth()
    except (re.error, RecursionError, OverflowError, ValueError):
        return None
    both = _anchored(list(parsed), sre_constants, True) and _anchored(list(parsed), sre_constants, False)
    return PatternLengths(low, high if both and high < UNBOUNDED else None, both)


def _anchored(items: list, c: Any, start: bool) -> bool:
    """Whether every match of items begins (start) or ends at the string's edge: ^ / $ (\\A, \\Z) first
    or last, inside groups and in every alternative."""
    if not items:
        return False
    op, av = items[0] if start else items[-1]
    if op is c.AT:
        return av in ((c.AT_BEGINNING, c.AT_BEGINNING_STRING) if start else (c.AT_END, c.AT_END_STRING))
    if op is c.SUBPATTERN:
        return _anchored(list(av[-1]), c, start)
    if op is c.BRANCH:
        return all(_anchored(list(alt), c, start) for alt in av[1])
    return False
