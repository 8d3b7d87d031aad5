"""What vLLM's grammar backends refuse in a structured_outputs.grammar, known without vllm.

vLLM reads a grammar with a `::=` rule as EBNF (GBNF: `root ::= "yes" | "no"`), any other as Lark
(`start: "yes" | "no"`), as its grammar_is_likely_lark decides. Both are parsed here as xgrammar
parses them: every token known, strings and classes closed with known escapes, brackets balanced,
no quantifier on a quantifier, `root` (EBNF) or `start` (Lark) defined, every rule a grammar uses
defined and defined once, Lark's regexes held to the regex rules. xgrammar refuses an empty
alternative in EBNF (`root ::= "a" |`) and a rule defined twice; guidance, which vLLM falls back to
under the backend `auto` (model.compact_json=false), takes them. tests/contract/test_request_verdict.py
holds these rules against vLLM."""

from __future__ import annotations

import re
from typing import Optional

from batchinfer.requests.regexes import XGRAMMAR, regex_problem

_EBNF = re.compile(
    r"""(?P<ws>\s+) | (?P<comment>\#[^\n]*)
    | (?P<string>"(?:\\.|[^"\\\n])*")
    | (?P<cls>\[(?:\\.|[^\]\\])*\])
    | (?P<assign>::=)
    | (?P<name>[A-Za-z_][A-Za-z0-9_-]*)
    | (?P<repeat>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
    | (?P<op>[()|*+?])""",
    re.X,
)
_STRING_ESCAPES = set("0abefnrtv\"'/?\\")
_CLASS_ESCAPES = _STRING_ESCAPES | set("$()*+-.[]^{|}")
_HEX = {"x": r"[0-9a-fA-F]+", "u": r"[0-9a-fA-F]{4}", "U": r"[0-9a-fA-F]{8}"}
_LARK_RULE = re.compile(r"\s*[?!]?([_A-Za-z]\w*)(?:\.-?\d+)?\s*:(?!:)")
_LARK = re.compile(
    r"""(?P<ws>[ \t]+) | (?P<comment>(?://|\#)[^\n]*)
    | (?P<string>"(?:\\.|[^"\\\n])*"i?)
    | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
    | (?P<alias>->\s*[_A-Za-z]\w*)
    | (?P<special><[^>\n]*>) | (?P<json>%json\b.*)
    | (?P<name>[_A-Za-z]\w*)
    | (?P<number>\d+) | (?P<range>\.\.)
    | (?P<op>[()\[\]|*+?~,])""",
    re.X,
)


class _Bad(Exception):
    """A grammar vLLM refuses: why."""


def grammar_problem(grammar: str, backend: str = XGRAMMAR) -> Optional[str]:
    """Why vLLM refuses a structured_outputs.grammar under backend ("it takes ..."), or None."""
    if not grammar.strip():
        return "a non-empty grammar string"
    lark = not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.split("\n"))
    try:
        _lark_rules(grammar, backend) if lark else _ebnf_rules(grammar, backend == XGRAMMAR)
    except _Bad as e:
        return f"a valid {'Lark' if lark else 'EBNF'} grammar ({e})"
    return None


def _tokens(pattern: re.Pattern[str], text: str, what: str) -> list[tuple[str, str]]:
    out, i = [], 0
    while i < len(text):
        m = pattern.match(text, i)
        if not m:
            raise _Bad(f"unexpected {text[i]!r} at {what} character {i + 1}")
        if m.lastgroup not in ("ws", "comment"):
            out.append((m.lastgroup or "", m.group(0)))
        i = m.end()
    return out


def _check_escapes(literal: str, allowed: set[str]) -> None:
    i = 0
    while i < len(literal):
        if literal[i] == "\\":
            c = literal[i + 1]
            if c in _HEX:
                m = re.match(_HEX[c], literal[i + 2 :])
                if not m:
                    raise _Bad(f"the escape \\{c} in {literal} needs hex digits")
                i += 2 + m.end()
                continue
            if c not in allowed:
                raise _Bad(f"the escape \\{c} in {literal} is not one xgrammar knows")
            i += 2
        else:
            i += 1


def _ebnf_rules(text: str, strict: bool) -> dict[str, int]:
    """Rule name -> its count; _Bad when xgrammar (strict) or guidance refuses the grammar."""
    tokens = _tokens(_EBNF, text, "grammar")
    starts = [i for i in range(len(tokens) - 1) if tokens[i][0] == "name" and tokens[i + 1][0] == "assign"]
    if not starts or starts[0] != 0:
        raise _Bad("it must start with a rule `root ::= ...`")
    rules: dict[str, int] = {}
    used: set[str] = set()
    for n, start in enumerate(starts):
        name = tokens[start][1]
        rules[name] = rules.get(name, 0) + 1
        if strict and rules[name] > 1:
            raise _Bad(f"rule {name!r} is defined twice")
        body = tokens[start + 2 : starts[n + 1] if n + 1 < len(starts) else len(tokens)]
        if any(kind == "assign" for kind, _ in body):
            raise _Bad(f"rule {name!r} has a '::=' inside its body")
        _EbnfBody(body, strict, name).parse()
        used |= {value for kind, value in body if kind == "name"}
    if "root" not in rules:
        raise _Bad("no rule `root ::= ...`: the grammar starts at root")
    missing = sorted(used - set(rules))
    if missing:
        raise _Bad(f"rule {missing[0]!r} is used but never defined")
    return rules


class _EbnfBody:
    """A recursive-descent parse of one EBNF rule's body, as xgrammar's parser takes it."""

    def __init__(self, tokens: list[tuple[str, str]], strict: bool, rule: str):
        self.tokens, self.i, self.strict, self.rule = tokens, 0, strict, rule

    def parse(self) -> None:
        self.alternatives(top=True)
        if self.i < len(self.tokens):
            raise _Bad(f"rule {self.rule!r}: unexpected {self.tokens[self.i][1]!r}")

    def peek(self) -> str:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else ""

    def alternatives(self, top: bool) -> None:
        count = self.sequence()
        alone = count == 0 and self.peek() != "|"
        if count == 0 and self.strict and not (alone and not top):  # xgrammar takes `()` alone
            raise _Bad(f'rule {self.rule!r} has an empty alternative (write "" for the empty string)')
        while self.peek() == "|":
            self.i += 1
            if self.sequence() == 0 and self.strict:
                raise _Bad(f'rule {self.rule!r} has an empty alternative (write "" for the empty string)')

    def sequence(self) -> int:
        count = 0
        while self.i < len(self.tokens) and self.peek() not in ("|", ")"):
            kind, value = self.tokens[self.i]
            self.i += 1
            if value == "(":
                self.alternatives(top=False)
                if self.peek() != ")":
                    raise _Bad(f"rule {self.rule!r}: a '(' is not closed")
                self.i += 1
            elif kind == "string":
                _check_escapes(value[1:-1], _STRING_ESCAPES)
            elif kind == "cls":
                _check_class(value)
            elif kind == "repeat" or value in ("*", "+", "?"):
                raise _Bad(f"rule {self.rule!r}: {value!r} follows no element")
            elif kind != "name":
                raise _Bad(f"rule {self.rule!r}: unexpected {value!r}")
            if self.i < len(self.tokens) and (self.tokens[self.i][0] == "repeat" or self.peek() in ("*", "+", "?")):
                _check_repeat(self.peek(), self.rule)
                self.i += 1
            count += 1
        return count


def _check_repeat(token: str, rule: str) -> None:
    bounds = [b.strip() for b in token.strip("{}").split(",")] if token.startswith("{") else []
    if len(bounds) == 2 and bounds[1] and int(bounds[0]) > int(bounds[1]):
        raise _Bad(f"rule {rule!r}: {token} has its lower bound above its upper bound")


def _check_class(token: str) -> None:
    body = token[1:-1]
    _check_escapes(body, _CLASS_ESCAPES)
    chars = re.findall(r"\\(?:x[0-9a-fA-F]+|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)|.", body.lstrip("^"), re.S)
    for i in range(1, len(chars) - 1):
        if chars[i] == "-" and len(chars[i - 1]) == 1 and len(chars[i + 1]) == 1 and chars[i - 1] > chars[i + 1]:
            raise _Bad(f"the class {token} has a range {chars[i - 1]}-{chars[i + 1]} running backwards")


def _lark_rules(text: str, backend: str) -> dict[str, int]:
    """Rule name -> its count; _Bad when xgrammar's Lark reader refuses the grammar."""
    rules: dict[str, int] = {}
    used: set[str] = set()
    current = None
    for n, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("//", "#", "%")):
            continue  # blank, a comment, or a directive (%import, %ignore)
        rule = _LARK_RULE.match(line)
        if rule:
            current = rule.group(1)
            rules[current] = rules.get(current, 0) + 1
            if rules[current] > 1:
                raise _Bad(f"rule {current!r} is defined twice")
            body = line[rule.end() :]
        elif stripped.startswith("|") and current is not None:
            body = stripped
        else:
            raise _Bad(f"line {n} is neither a rule (`name: ...`) nor an alternative starting with |")
        used |= _lark_body(body, n, backend)
    if "start" not in rules:
        raise _Bad("no rule `start: ...`: the grammar starts at start")
    missing = sorted(used - set(rules))
    if missing:
        raise _Bad(f"rule {missing[0]!r} is used but never defined")
    return rules


def _lark_body(body: str, line: int, backend: str) -> set[str]:
    """The names a Lark rule's body uses; _Bad for what xgrammar's Lark reader refuses in it."""
    depth = {"(": 0, "[": 0}
    names = set()
    for kind, value in _tokens(_LARK, body, f"line {line}"):
        if kind == "name":
            names.add(value)
        elif kind == "regex":
            pattern = value[1 : value.rindex("/")]
            why = regex_problem(pattern, backend)
            if why:
                raise _Bad(f"line {line}: the regex {value} is refused: vLLM takes {why}")
        elif kind == "string":
            _check_escapes(value.rstrip("i")[1:-1], _STRING_ESCAPES)
        elif value in "([":
            depth[value] += 1
        elif value in ")]":
            opening = "(" if value == ")" else "["
            depth[opening] -= 1
            if depth[opening] < 0:
                raise _Bad(f"line {line}: {value!r} closes nothing")
    if any(depth.values()):
        raise _Bad(f"line {line}: a bracket is not closed")
    return names
