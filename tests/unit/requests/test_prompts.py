"""Prompts from rows: chat and raw, template fields, row errors, overlong policies."""

from __future__ import annotations

import re

import pytest

from batchinfer.config.schema import PromptConfig
from batchinfer.errors import InputError
from batchinfer.requests.build import overlong_tokens
from batchinfer.requests.prompts import PromptBuilder, RowError


def test_prompt_builder_chat_raw_and_row_errors() -> None:
    b = PromptBuilder(PromptConfig(template="Label: {text}", system="Be brief", mode="chat"))
    assert b.build({"text": "hi"}) == [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Label: hi"},
    ]
    raw = PromptBuilder(PromptConfig(template="Q: {text} {{json}}", system=None, mode="raw"))
    assert raw.build({"text": "hi"}) == "Q: hi {json}"
    with pytest.raises(RowError, match="^field 'text' is null or missing$"):
        b.build({"text": None})
    with pytest.raises(RowError, match=r"^the prompt is empty \(field 'text' is blank\)$"):
        PromptBuilder(PromptConfig(template="{text}", system=None, mode="raw")).build({"text": "  "})


def test_template_fields_take_text_numbers_and_bools_not_lists_or_objects() -> None:
    b = PromptBuilder(PromptConfig(template="{text} n={n} ok={ok} {meta.k}", system=None, mode="raw"))
    assert b.build({"text": "t", "n": 2.5, "ok": True, "meta": {"k": 7}}) == "t n=2.5 ok=True 7"
    cases = [
        ({"text": ["a", "b"]}, "field 'text' is a list, not a string, number or bool"),
        ({"meta": {"k": {"x": 1}}}, "field 'meta.k' is an object (dict), not a string, number or bool"),
        ({"meta": {"k": None}}, "field 'meta.k' is null or missing"),
        ({"meta": {"j": 1}}, "field 'meta.k' is missing in this row"),
    ]
    for change, message in cases:
        with pytest.raises(RowError) as e:
            b.build({"text": "t", "n": 1, "ok": False, "meta": {"k": 1}} | change)
        assert e.value.kind == "prompt" and e.value.message.startswith(message), e.value.message
    with pytest.raises(RowError) as e:
        PromptBuilder(PromptConfig(template="Tags: {meta}", system=None, mode="raw")).build({"meta": [1]})
    assert e.value.message == (
        "field 'meta' is a list, not a string, number or bool; "
        "to put JSON in a prompt, write it into a string column first (json.dumps)"
    )


def test_overlong_policies() -> None:
    ids = list(range(10))
    assert overlong_tokens(ids, "error_row", 11, 4) == ids
    with pytest.raises(RowError, match="prompt has 10 tokens; model.max_model_len is 10"):
        overlong_tokens(ids, "error_row", 10, 4)
    assert overlong_tokens(ids, "truncate_left", 8, 2) == ids[-6:]
    assert overlong_tokens(ids, "truncate_right", 8, 6) == ids[:4]
    with pytest.raises(InputError, match="prompt.overlong=fail"):
        overlong_tokens(ids, "fail", 10, 4)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{meta.keys}", "field 'meta.keys' is missing in this row"),
        ("{meta.items}", "field 'meta.items' is missing in this row"),
        ("{text.upper}", "field 'text.upper': 'upper' is not a key of an object here (the value before it is str)"),
        ("{text.__class__}", "field 'text.__class__': '__class__' is not a key of an object here"),
        ("{tags[5]}", "field 'tags[5]' is missing in this row (the list has 2 items)"),
    ],
)
def test_dotted_parts_are_keys_never_attributes(template: str, message: str) -> None:
    """A method's repr holds a memory address: the prompt would differ per process (dedup, resume)."""
    builder = PromptBuilder(PromptConfig(template=template, mode="raw"))
    row = {"text": "abc", "meta": {"title": "T"}, "tags": ["x", "y"]}
    with pytest.raises(RowError, match=re.escape(message)):
        builder.build(row)
    ok = PromptBuilder(PromptConfig(template="{meta.title} {meta[title]} {tags[1]}", mode="raw"))
    assert ok.build(row) == "T T y"
