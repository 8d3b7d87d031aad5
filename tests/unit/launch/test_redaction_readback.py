"""Issue 42, records read back and printed lines: what a printed line keeps around a struck value, old
run directories whose run.yaml holds struck free text, refusals that would show two identical struck
texts, and the records a redo or a tune reads back."""

from __future__ import annotations

from batchinfer.redaction import REDACTED, record_yaml, redact_printed, redact_text


def test_a_struck_value_keeps_the_quote_that_closes_it_and_a_placeholder_is_no_secret() -> None:
    # `--cfg job` and `status` printed `'token=<redacted>` (the closing quote eaten) and `key=<redacted>}`
    # for a template's `key={key}` placeholder
    line = "use key={key} or key={{key}} and 'token=abc' now --token 'x y' --api-key=k1\" end"
    assert redact_text(line) == (
        f"use key={{key}} or key={{{{key}}}} and 'token={REDACTED}' now --token {REDACTED} --api-key={REDACTED}\" end"
    )
    assert redact_printed('say "api_key=xyz" ok') == f'say "api_key={REDACTED}" ok'
    printed = record_yaml({"prompt": {"template": "use key={key} and 'token=abc' now", "system": 'say "pass=xyz" ok'}})
    assert f"template: use key={{key}} and 'token={REDACTED}' now\n" in printed
    assert f'system: say "pass={REDACTED}" ok\n' in printed
    assert "abc" not in printed and "xyz" not in printed
