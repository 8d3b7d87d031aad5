"""`redo --where EXPR`: a small filter grammar over output columns, compiled to a pyarrow.compute
Expression checked against the output's schema.

    expr       := or
    or         := and ("or" and)*
    and        := not ("and" not)*
    not        := "not" not | "(" expr ")" | test
    test       := field "is" ["not"] "null" | field OP value
    field      := NAME ("." NAME)*          a column, or a struct's field: error.kind, input.meta.lang
    OP         := == != < <= > >=
    value      := "text" | 'text' | number | true | false

Keywords (and, or, not, is, null, true, false) are lower case. A comparison on a null value is
false (not null): `not finish_reason == "stop"` selects error rows too, whose finish_reason is null;
`error.kind == "overlong"` is false for a row without an error."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Union

import pyarrow as pa
import pyarrow.compute as pc

from batchinfer.errors import ConfigError

OPS = {"==": "equal", "!=": "not_equal", "<": "less", "<=": "less_equal", ">": "greater", ">=": "greater_equal"}
KEYWORDS = {"and", "or", "not", "is", "null", "true", "false"}
MAX_NESTING = 100  # `not`s and parentheses inside one another
MAX_TESTS = 1000  # tests joined by `and`/`or` (pyarrow's expressions crash the process at ~10,000)
INT64 = (-(2**63), 2**63 - 1)  # what an integer literal becomes in Arrow; past it pa.scalar overflows
_TOKEN = re.compile(
    r"""(?P<space>\s+)
    |(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    |(?P<number>-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)
    |(?P<op>==|!=|<=|>=|<|>)
    |(?P<paren>[()])
    |(?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)""",
    re.X,
)


@dataclass(frozen=True)
class Token:
    """One token of the expression and where it starts (0-based character)."""

    kind: str  # string, number, op, paren, name, keyword, end
    text: str
    pos: int


class WhereError(ConfigError):
    """An expression that does not parse or does not fit the output's columns."""


def tokenize(text: str) -> list[Token]:
    """The expression's tokens, ending with an `end` token; WhereError at a character nothing matches."""
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _error(text, pos, f"unexpected character {text[pos]!r}")
        kind = m.lastgroup or ""
        if kind != "space":
            word = m.group()
            out.append(Token("keyword" if kind == "name" and word in KEYWORDS else kind, word, pos))
        pos = m.end()
    out.append(Token("end", "", len(text)))
    return out


def _error(text: str, pos: int, what: str, hint: str = "") -> WhereError:
    # A long expression is shown around the character (60 before it at most), on one screen line.
    start = max(0, pos - 60)
    shown = ("..." if start else "") + text[start : pos + 60] + ("..." if pos + 60 < len(text) else "")
    caret = " " * (pos - start + (5 if start else 2)) + "^"
    return WhereError(f"--where at character {pos + 1}: {what}{hint}\n  {shown}\n{caret}")


Value = Union[str, int, float, bool]


class _Parser:
    """Recursive descent over the tokens, building the Expression as it goes."""

    def __init__(self, text: str, schema: pa.Schema):
        self.text, self.schema = text, schema
        self.tokens = tokenize(text)
        self.i = 0
        self.depth = 0  # `not`s and parentheses open at the current token
        self.joins = 0  # `and`s and `or`s taken

    @property
    def tok(self) -> Token:
        return self.tokens[self.i]

    def take(self) -> Token:
        t = self.tokens[self.i]
        self.i += 1
        return t

    def fail(self, what: str, tok: Token | None = None, hint: str = "") -> WhereError:
        tok = tok or self.tok
        got = "the end of the expression" if tok.kind == "end" else repr(tok.text)
        return _error(self.text, tok.pos, f"{what}, got {got}", hint)

    def parse(self) -> pc.Expression:
        expr = self.or_()
        if self.tok.kind != "end":
            raise self.fail("expected `and`, `or` or the end")
        return expr

    def or_(self) -> pc.Expression:
        expr = self.and_()
        while self.tok.text == "or" and self.tok.kind == "keyword":
            self.joined()
            expr = expr | self.and_()
        return expr

    def and_(self) -> pc.Expression:
        expr = self.not_()
        while self.tok.text == "and" and self.tok.kind == "keyword":
            self.joined()
            expr = expr & self.not_()
        return expr

    def joined(self) -> None:
        """Take an `and`/`or`, refusing one past MAX_TESTS."""
        self.joins += 1
        if self.joins >= MAX_TESTS:
            raise self.fail(f"more than {MAX_TESTS} tests joined by `and`/`or`; write a shorter expression")
        self.take()

    def not_(self) -> pc.Expression:
        if self.tok.text in ("not", "(") and self.tok.kind in ("keyword", "paren"):
            # Each level is a Python call: refused long before the interpreter's recursion limit.
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise self.fail(f"more than {MAX_NESTING} nested `not`s and parentheses; write a simpler expression")
            try:
                return self._nested()
            finally:
                self.depth -= 1
        return self.test()

    def _nested(self) -> pc.Expression:
        if self.take().text == "not":
            return ~self.not_()
        expr = self.or_()
        if self.tok.text != ")":
            raise self.fail("expected `)`")
        self.take()
        return expr

    def test(self) -> pc.Expression:
        tok = self.take()
        if tok.kind != "name":
            raise self.fail("expected a column name", tok, f" (columns: {', '.join(column_names(self.schema))})")
        path, typ = self.field(tok)
        ref = pc.field(*path)
        if self.tok.kind == "keyword" and self.tok.text == "is":
            self.take()
            negate = self.tok.kind == "keyword" and self.tok.text == "not"
            if negate:
                self.take()
            if not (self.tok.kind == "keyword" and self.tok.text == "null"):
                raise self.fail("expected `null` after `is`" + (" not" if negate else ""))
            self.take()
            return ref.is_valid() if negate else ref.is_null()
        if self.tok.kind != "op":
            raise self.fail(f"expected a comparison (== != < <= > >=) or `is null` after {tok.text}")
        op = self.take()
        value = self.value(tok.text, typ, op)
        # A comparison on a null value is false, so `not` of it is true: two-valued, as users read it.
        return pc.coalesce(getattr(pc, OPS[op.text])(ref, pa.scalar(value)), pa.scalar(False))

    def field(self, tok: Token) -> tuple[tuple[str, ...], pa.DataType]:
        """The column path and type a dotted name refers to; WhereError naming the known columns."""
        parts = tok.text.split(".")
        typ: Any = None
        fields = self.schema
        for n, part in enumerate(parts):
            index = fields.get_field_index(part) if fields is not None else -1
            if index < 0:
                where = ".".join(parts[:n]) or "the output"
                names = [f.name for f in fields] if fields is not None else []
                known = ", ".join(column_names(self.schema)) if n == 0 else ", ".join(names)
                if n > 0 and fields is None:  # a column of values, not of structs
                    known_text = f" ({where} is a column of {typ} values, which have no fields: compare {where} itself)"
                else:
                    known_text = f" (known: {known})"
                raise _error(self.text, tok.pos, f"{where} has no field {part!r}", known_text)
            typ = fields.field(index).type
            fields = typ if pa.types.is_struct(typ) else None
        return tuple(parts), typ

    def value(self, name: str, typ: pa.DataType, op: Token) -> Value:
        """The literal after an operator, checked to be comparable with the column's type."""
        tok = self.take()
        if tok.kind == "string":
            value: Value = _unquote(tok.text)
            ok = pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_dictionary(typ)
        elif tok.kind == "number":
            is_float = re.search(r"[.eE]", tok.text) is not None
            # past 19 significant digits no integer fits 64 bits; int() of > 4300 digits would raise
            sign, digits = ("-" if tok.text.startswith("-") else ""), tok.text.lstrip("+-").lstrip("0")
            huge = not is_float and len(digits) > 19
            value = float(tok.text) if is_float else 0 if huge else int(sign + (digits or "0"))
            ok = pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_decimal(typ)
            if huge or (isinstance(value, int) and not INT64[0] <= value <= INT64[1]):
                shown = tok.text if len(tok.text) <= 30 else f"{tok.text[:12]}...({len(tok.text)} digits)"
                raise _error(
                    self.text,
                    tok.pos,
                    f"{shown} is outside the 64-bit integer range {INT64[0]} to {INT64[1]} that {name} is compared in",
                    "; use a number inside it",
                )
        elif tok.kind == "keyword" and tok.text in ("true", "false"):
            value = tok.text == "true"
            ok = pa.types.is_boolean(typ)
        elif tok.kind == "keyword" and tok.text == "null":
            raise _error(
                self.text, tok.pos, f"`{op.text} null` compares nothing", f"; write `{name} is null` or `is not null`"
            )
        else:
            raise self.fail(f'expected a value after {op.text} ("text", a number, true or false)', tok)
        if not ok:
            raise _error(
                self.text,
                tok.pos,
                f"{name} holds {_kind(typ)}, not {_kind(pa.scalar(value).type)}",
                f"; compare it with {_example(typ)}" if _example(typ) else "; only `is null` / `is not null` apply",
            )
        return value


def _unquote(text: str) -> str:
    """A quoted literal's text: backslash escapes the next character (\\" \\' \\\\), \\n is a newline."""
    body = text[1:-1]
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else "\t" if m.group(1) == "t" else m.group(1), body)


def _kind(typ: pa.DataType) -> str:
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return "text"
    if pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_decimal(typ):
        return "numbers"
    if pa.types.is_boolean(typ):
        return "true/false"
    if pa.types.is_struct(typ):
        return "a struct (fields " + ", ".join(f.name for f in typ) + ")"
    return str(typ)


def _example(typ: pa.DataType) -> str:
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return 'a quoted text ("length")'
    if pa.types.is_integer(typ) or pa.types.is_floating(typ):
        return "a number (10, 0.5)"
    if pa.types.is_boolean(typ):
        return "true or false"
    if pa.types.is_struct(typ):
        return "one of its fields (" + ", ".join(f.name for f in typ) + ")"
    return ""


def column_names(schema: pa.Schema) -> list[str]:
    """The names --where knows: columns, and struct fields as dotted names (error.kind)."""
    out: list[str] = []

    def walk(prefix: str, fields: Any) -> None:
        for f in fields:
            out.append(prefix + f.name)
            if pa.types.is_struct(f.type):
                walk(prefix + f.name + ".", f.type)

    walk("", schema)
    return out


def compile_where(text: str, schema: pa.Schema) -> pc.Expression:
    """The Expression of a --where text over tables of this schema; WhereError naming the position."""
    if not text.strip():
        raise WhereError("--where is empty: give an expression such as 'finish_reason == \"length\"'")
    return _Parser(text, schema).parse()
