"""Secrets found by their text, for the one redaction (redaction.py) and compose's refusal
(security.py): values of a known issuer's shape under any name (a GitHub or Hugging Face token, an
OpenAI key, a Slack webhook, a JWT, ...), and the plain-text forms that hold one in free text and
shell lines (`HF_TOKEN: X`, `"api_key": "X"`, `Authorization: Bearer X`, `?sig=X`, `.netrc`'s
`password X`, `docker login -p X`, `wandb login X`, `echo X > ~/.cache/huggingface/token`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Optional

from batchinfer.secret_names import is_secret_name

# (what it is, its shape): an issuer's prefix with the length and alphabet it issues, as gitleaks'
# rules have them, so that text merely naming a prefix ("keys start with sk-") is no secret. The
# group `secret` is what is struck (a webhook URL keeps its host); without it, the whole match.
VALUE_SHAPES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (what, re.compile(shape))
    for what, shape in (
        ("a GitHub token (ghp_...)", r"\b(?:gh[pousr]_[A-Za-z0-9]{36,251}|github_pat_[A-Za-z0-9_]{50,250})\b"),
        ("a GitLab token (glpat-...)", r"\bgl(?:pat|dt|ptt|rt|cbt|oas)-[A-Za-z0-9_-]{20,}"),
        ("a Hugging Face token (hf_...)", r"(?<![\w-])(?:hf|api_org)_[A-Za-z0-9]{30,40}(?![\w-])"),
        # sk-ant-api03-... shorter than the generic sk- shape's 32 (a short or truncated Anthropic key).
        # An sk- key is one random token: mixed case with digits, never a path's component nor a
        # hyphenated run of lower-case words (sk-learn-experiments-2024, sk-ant-colony-optimization-2024)
        (
            "an Anthropic key (sk-ant-...)",
            r"(?<![\w/-])sk-ant-(?:[a-z]+\d*-)?(?=[\w-]*\d)(?=[\w-]*[A-Z])[A-Za-z0-9_-]{16,}(?![\w/-])",
        ),
        (
            "an API key (sk-...)",
            r"(?<![\w/-])sk-(?:proj-|svcacct-|admin-|ant-[a-z]+\d*-)?(?=[\w-]*\d)(?=[\w-]*[A-Z])"
            r"[A-Za-z0-9_-]{32,}(?![\w/-])",
        ),
        ("a Google OAuth token (ya29....)", r"\bya29\.[A-Za-z0-9_-]{20,}"),
        ("a Replicate token (r8_...)", r"\br8_[A-Za-z0-9]{37}\b"),
        ("a Groq key (gsk_...)", r"\bgsk_[A-Za-z0-9]{52}\b"),
        ("a DigitalOcean token (dop_v1_...)", r"\bdo[opr]_v1_[a-f0-9]{64}\b"),
        ("a SendGrid key (SG....)", r"\bSG\.[\w-]{22}\.[\w-]{43}(?![\w-])"),
        # an Azure connection string's key (DefaultEndpointsProtocol=...;AccountKey=X;...): X is struck
        (
            "an Azure storage key (AccountKey=...)",
            r"\b(?:AccountKey|SharedAccessKey)=(?P<secret>[A-Za-z0-9+/]{20,}={0,2})",
        ),
        ("a Stripe key (sk_live_...)", r"\b[rs]k_(?:live|test)_[A-Za-z0-9]{16,}\b"),
        ("a Slack token (xoxb-...)", r"\b(?:xox[abposre]|xapp)-\d+-[A-Za-z0-9-]{8,}"),
        (
            "a Slack webhook URL",
            r"https://hooks\.slack\.com/(?:services|workflows|triggers)/(?P<secret>[A-Za-z0-9+/_-]{20,})",
        ),
        (
            "a Discord webhook URL",
            r"https://(?:ptb\.|canary\.)?discord(?:app)?\.com/api/webhooks/(?P<secret>\d+/[A-Za-z0-9_-]{20,})",
        ),
        # AWS's documented example key (AKIAIOSFODNN7EXAMPLE) is no secret, as gitleaks allows it; nor is
        # a DNA sequence (ACCAGTTCAGGCTTAGCATG): an id's 16 characters are base32, never all of A, C, G, T
        (
            "an AWS access key id (AKIA...)",
            r"\b(?:AKIA|ASIA|ABIA|ACCA)(?![A-Z0-9]{9}EXAMPLE)(?![ACGT]{16}\b)[A-Z0-9]{16}\b",
        ),
        ("a Google API key (AIza...)", r"\bAIza[A-Za-z0-9_-]{35}(?![\w-])"),
        ("a JWT (eyJ...)", r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
        ("an npm token (npm_...)", r"\bnpm_[A-Za-z0-9]{36}\b"),
        ("a PyPI token (pypi-...)", r"\bpypi-AgEIcHlwaS5vcmc[A-Za-z0-9_-]{50,}"),
        (
            "a private key",
            r"-----BEGIN (?P<kind>[A-Z ]*)PRIVATE KEY( BLOCK)?-----(?P<secret>[\s\S]*?)(?:-----END|\Z)",
        ),
    )
)

# Where a shape may start (one pass over the text; most lines hold none, and skip the shapes).
_SHAPE_HINT = re.compile(
    r"gh[pousr]_|github_pat_|gl(?:pat|dt|ptt|rt|cbt|oas)-|hf_|api_org_|sk-|[rs]k_(?:live|test)_|xox|xapp-|"
    r"hooks\.slack\.com|discord|AKIA|ASIA|ABIA|ACCA|AIza|eyJ|npm_|pypi-|PRIVATE KEY|ya29\.|r8_|gsk_|do[opr]_v1_|SG\.|"
    r"AccountKey=|SharedAccessKey="
)

# A value in free text: up to a space, a quote or a shell separator.
_VALUE = r"(?P<secret>[^\s'\";&|`<>]+)"
# An unquoted value after `NAME:` or `password` in prose is a secret only when it looks like one (a
# digit or a symbol, or 20 characters): `HF_TOKEN: not set` and `password required` stay as written.
_LIKE_SECRET = r"(?=[^\s'\";&|`<>,}\]]*[\d_+/=.@!#%^*~-]|[^\s'\";&|`<>,}\]]{20})"
# echo's options or printf's format before the value echoed
_ECHO = r"\b(?:echo|printf)[ \t]+(?:-\w+[ \t]+|'[^'\n%]*%[^'\n]*'[ \t]+|\"[^\"\n%]*%[^\"\n]*\"[ \t]+)*['\"]?"


def _tail(words: str) -> str:
    """The rest of a command up to a shell separator, never past one of `words`: each
    occurrence then scans only up to the next one, so text repeating a word ('echo x | echo x | ...',
    'docker login login ...') is scanned once, not from every occurrence to its end."""
    return rf"(?:(?!\b(?:{words})\b)[^;&|\n])*?"


_LOGIN_TOOLS = r"docker|podman|buildah|skopeo|nerdctl|helm|oras|apptainer|singularity|az"
# Forms holding a secret in free text and shell lines; a group `name` must be secret-named, a group
# `file` a file that holds secrets (_secret_file); the group `secret` is struck.
FORMS: tuple[re.Pattern[str], ...] = (
    # ${oc.env:HF_TOKEN,X}: a default stands in for the secret's value (a parse error echoes it)
    re.compile(r"\$\{oc\.env:[ \t]*['\"]?(?P<name>[A-Za-z_]\w*)['\"]?[ \t]*,[ \t]*(?P<secret>[^}\s'\"]+)"),
    # "api_key": "X", 'token': 'X', api_key: "X" (JSON, a Python dict, YAML)
    re.compile(r"(?<![\w.-])(?P<q>[\"']?)(?P<name>[A-Za-z_][\w.-]*)(?P=q)[ \t]*:[ \t]*([\"'])(?P<secret>[^\"'\s]+)\3"),
    # HF_TOKEN: X, Authorization: Bearer X, X-Api-Key: X (a log line, a YAML key in a heredoc, a header)
    re.compile(
        r"(?<![\w.-])(?P<name>[A-Za-z_][\w.-]*)[ \t]*:[ \t]+(?:(?i:bearer|basic|token|bot|digest|apikey)[ \t]+)?"
        + _LIKE_SECRET
        + _VALUE
    ),
    # HF_TOKEN+=X (a shell's append)
    re.compile(r"(?<![\w$.-])(?P<name>[A-Za-z_]\w*)\+=['\"]?" + _VALUE),
    # a signed URL's signature: Azure SAS ?sig=, AWS X-Amz-Signature, GCS X-Goog-Signature
    re.compile(r"[?&](?i:sig|signature|x-amz-signature|x-goog-signature)=(?P<secret>[^&\s'\"#]+)"),
    # .netrc: machine HOST login USER password X (one line or a heredoc's line)
    re.compile(r"(?:^|\n|\b(?:login|machine)[ \t]+\S+)[ \t]*\bpassword[ \t]+" + _LIKE_SECRET + _VALUE),
    # docker login -p X (podman, helm registry, oras, apptainer, az login -p X)
    re.compile(
        rf"\b(?:{_LOGIN_TOOLS})\b"
        + _tail(_LOGIN_TOOLS)
        + r"\blogin\b"
        + _tail(_LOGIN_TOOLS + "|login")
        + r"[ \t]-p(?:[ \t]+|=)?['\"]?(?!-)"
        + _VALUE
    ),
    # wandb login KEY (its options before the key)
    re.compile(r"\bwandb[ \t]+login(?:[ \t]+--?[\w-]+(?:=\S+)?)*[ \t]+['\"]?(?!-)" + _VALUE),
    # echo X > ~/.cache/huggingface/token, printf X >> ~/.netrc
    re.compile(_ECHO + _VALUE + r"['\"]?[ \t]*>>?[ \t]*['\"]?(?P<file>[^\s'\";&|`]+)"),
    # echo X | docker login --password-stdin, | huggingface-cli login, | chpasswd
    re.compile(
        _ECHO + _VALUE + r"['\"]?[ \t]*\|(?:(?!\b(?:echo|printf)\b)[^;&\n])*?"
        r"(?:\blogin\b|--password-stdin|\bchpasswd\b|\bpasswd\b)"
    ),
)
# What each form's text must hold (lower-cased) for the form to be tried: most lines hold none.
FORM_HINTS: tuple[tuple[str, ...], ...] = (
    ("oc.env",),
    (":",),
    (":",),
    ("+=",),
    ("sig", "signature"),
    ("password",),
    ("login",),
    ("wandb",),
    ("echo", "printf"),
    ("echo", "printf"),
)
# Files that hold secrets whatever their name says: netrc, the PostgreSQL and PyPI password files.
SECRET_FILES = frozenset({".netrc", "_netrc", ".pgpass", ".pypirc", ".git-credentials"})


def _secret_file(path: str) -> bool:
    """A file whose name says it holds a secret (~/.cache/huggingface/token, token.txt, ~/.netrc)."""
    p = PurePosixPath(path.strip("'\""))
    return p.name in SECRET_FILES or is_secret_name(p.stem) or is_secret_name(p.name)


def shape_of(text: str) -> Optional[str]:
    """What secret of a known shape text holds ("a GitHub token (ghp_...)"), or None."""
    if not _SHAPE_HINT.search(text):
        return None
    for what, shape in VALUE_SHAPES:
        if shape.search(text):
            return what
    return None


def strike_shapes(text: str, struck: str) -> str:
    """text with every value of a known shape replaced by struck (a URL's or a key block's frame kept)."""
    if not _SHAPE_HINT.search(text):
        return text
    for _, shape in VALUE_SHAPES:
        text = shape.sub(lambda m: _replace(m, struck), text)
    return text


def strike_forms(text: str, struck: str, is_value: Callable[[str], bool]) -> str:
    """text with the secret of each form (FORMS) replaced by struck, where the form's name is a
    secret's and is_value(secret) says it is a value (not a reference, a placeholder, struck)."""

    def strike(m: re.Match[str]) -> str:
        names = m.re.groupindex
        if "name" in names and not is_secret_name(m.group("name")):
            return m.group(0)
        if "file" in names and not _secret_file(m.group("file")):
            return m.group(0)
        return _replace(m, struck) if is_value(m.group("secret")) else m.group(0)

    lower = text.lower()
    for form, hints in zip(FORMS, FORM_HINTS, strict=True):
        if any(h in lower for h in hints):
            text = form.sub(strike, text)
    return text


def _replace(m: re.Match[str], struck: str) -> str:
    """The match with its `secret` group (else all of it) replaced by struck."""
    if "secret" not in m.re.groupindex or m.group("secret") is None:
        return struck
    start, end = m.span("secret")
    if start == end:
        return m.group(0)
    return m.group(0)[: start - m.start()] + struck + m.group(0)[end - m.start() :]
