"""redact_text on hostile long strings: every line batchinfer prints or writes goes through it, so a
text that makes one of its patterns rescan the rest of the text from every position (quadratic time)
would hang a command on one crafted prompt or error message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from batchinfer import redaction, secret_shapes

ROOT = Path(__file__).resolve().parents[3]
SIZE = 1_000_000
# Each repeated to SIZE characters; none holds a secret except where EXPECTED says.
HOSTILE = (
    "a-", "a.", "a+", "--a", "sk-", "SG.", "ya29.", "eyJa.", "xoxb-1-", "curl ", "a:b@", "echo ",
    "wandb login ", "printf '%' ", 'x="', "AKIA", "echo x | ", "docker login ", "mysql ", "sshpass ",
)  # fmt: skip
N_WANDB = SIZE // len("wandb login ")
EXPECTED = {
    # one Slack token's shape (xoxb-1-...) running to the end: struck whole
    "xoxb-1-": "<redacted>",
    # `wandb login X` strikes X, here the next `wandb`
    "wandb login ": "wandb login <redacted> login " * (N_WANDB // 2) + "wandb login " * (N_WANDB % 2),
}
CHILD = """
import json, sys
from batchinfer.redaction import redact_text
out = {}
for h in json.loads(sys.argv[1]):
    text = h * (int(sys.argv[2]) // len(h))
    got = redact_text(text, values=[])
    out[h] = None if got == text else got
print(json.dumps(out))
"""


def test_hostile_megabyte_strings_are_redacted_as_written():
    """Each hostile 1 MB string comes back (unchanged, or with its one secret-shaped part struck)."""
    # The timeout is a guard against a hang (the quadratic patterns took hours on these), not a
    # speed claim: the batch takes about 10 s on a loaded 2-core machine.
    run = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(HOSTILE), str(SIZE)],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = json.loads(run.stdout)
    assert sorted(out) == sorted(HOSTILE)
    for h in HOSTILE:
        assert out[h] == EXPECTED.get(h), h


def test_no_pattern_scans_unbounded_to_the_end_from_every_occurrence():
    """No pattern holds a repeat that reruns to the end of the text from each word: an unbounded URL
    scheme, or a command's lazy tail `[^;&|\\n]*?` that may cross the next occurrence of the command."""
    patterns = [redaction._URL_PASSWORD, *redaction._COMMAND_SECRETS, *secret_shapes.FORMS]
    for p in patterns:
        assert "[A-Za-z0-9+.-]*" not in p.pattern, p.pattern
        assert "[^;&|\\n]*?" not in p.pattern, p.pattern
        assert "[^;&\\n]*?" not in p.pattern, p.pattern
    assert redaction._URL_PASSWORD.search("a-" * 50 + "postgres://bob:pw@db") is not None
