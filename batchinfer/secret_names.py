"""The secret-name rule of the one redaction (redaction.py): whether a config key, option or
environment variable name holds a secret, as secret scanners (gitleaks, detect-secrets) decide it.

In one sentence (docs/shared-filesystems.md, "Secrets"): a name holds a secret when its last word,
after qualifier, role and version words (API_KEY_VALUE, HF_TOKEN_READ, TOKEN_V2, PRIVATE_KEY_PEM),
is a secret word (also written joined: PGPASSWORD, HFTOKEN; CONNECTION_STRING counts as one), unless
a setting word stands directly before it (MAX_TOKEN, USE_AUTH_TOKEN, HF_HUB_DISABLE_IMPLICIT_TOKEN;
not MAX_API_KEY), the word before gives the secret word another meaning (PRIMARY_KEY, EOS_TOKEN,
FORWARD_PASS, PUBLIC_KEY, PUBLIC_API_KEY), or the name is a location (MY_KEY_FILE,
GOOGLE_APPLICATION_CREDENTIALS). A secret word anywhere else (TOKEN_LIMIT, AUTH_ENABLED, KEY_COLUMN,
PASS_THROUGH, API_KEY_HEADER) names a setting. When in doubt the rule calls a name a secret: a
struck value still travels by environment, a leaked one cannot be taken back."""

from __future__ import annotations

import functools
import re

SECRET_WORDS = frozenset(
    "token key apikey secret secrets password passwords passwd pass pwd passphrase credential credentials auth "
    "authorization jwt cookie cookies webhook webhooks pat bearer dsn sessionid sessid webhookurl".split()
)
# A word written without separators (PGPASSWORD, AWSSECRETKEY, csrftoken), matched as secret scanners
# match it. Anywhere in the word: words no English word holds by chance.
SECRET_INFIXES = ("password", "passwd", "passphrase", "credential", "apikey", "privkey", "privatekey")
# At its end: HFTOKEN, MYSQLPWD, OAUTH, SESSIONID, SENTRYDSN (tokenizers, passes, secretary: no).
SECRET_ENDINGS = tuple(
    "token secret secrets pwd jwt cookie webhook bearer auth sessionid sessid dsn connectionstring connstring "
    "connectionstr connstr".split()
)
# "key", "pass" and "pat" end many ordinary words (monkey, compass, compat): a secret only after one
# of these (PASSKEY, DBPASS, GITHUBPAT), as detect-secrets' keyword list has it.
QUALIFIED_ENDINGS = {
    "key": tuple(
        "secret api priv private access auth ssh pass sign signing encryption crypt master client service account "
        "db database session hmac license app admin root storage shared sas deploy webhook token gpg pgp rsa".split()
    ),
    "pass": tuple(
        "db database key user admin root mysql pg postgres smtp mail ldap ftp redis mongo sql app proxy login sudo "
        "ssh vault basic http".split()
    ),
    "pat": tuple("github gh gitlab gl ado azure devops hf bitbucket personal access".split()),
}
# Words after the secret word that still name its value, its role or its version (HF_TOKEN_READ,
# API_KEY_BACKUP, PRIVATE_KEY_PEM, MY_PASSWORD_HASH); a number, vN and orgN too (HF_TOKEN_2, TOKEN_V2,
# OPENAI_API_KEY_ORG1). Not "header": API_KEY_HEADER names the header a key is sent in.
QUALIFIER_WORDS = frozenset(
    "value val string str b64 base64 hex raw encoded enc base prod production dev staging test live "
    "read write ro rw old new alt backup bot ci pem der data content contents json hash ed25519 primary "
    "secondary prev previous current".split()
)
# Qualifiers that say the name holds the content (KEY_FILE_B64, GOOGLE_APPLICATION_CREDENTIALS_JSON):
# a location word or path name before them no longer makes it a path.
CONTENT_WORDS = frozenset(
    "value val string str b64 base64 hex raw encoded enc pem der data content contents json".split()
)
_VERSION = re.compile(r"\d+|v\d+|org\d*|ed25519")
# Words that make a name a setting about a secret, not the secret, directly before the secret word
# (MAX_TOKEN, USE_AUTH_TOKEN, HF_HUB_DISABLE_IMPLICIT_TOKEN); not further off (MAX_API_KEY: a key).
SETTING_WORDS = frozenset(
    "max min num count limit limits length len size ttl timeout expiry expires enable enabled disable disabled "
    "use skip no allow require required parallelism implicit".split()
)
# A key made public (PUBLIC_KEY, PUBLISHABLE_KEY), also before API_KEY (PUBLIC_API_KEY).
PUBLIC_WORDS = frozenset({"public", "publishable", "pub"})
# Words before a secret word that give it another meaning: a data key, a vocabulary token, a pass.
OTHER_MEANINGS = {
    "key": frozenset(
        "primary foreign sort partition cache group join lookup dict map row column composite unique dedup "
        "idempotency routing shard sharding hash range object record label index feature input output text prompt "
        "answer target result field metric id".split()
    )
    | PUBLIC_WORDS,
    "token": frozenset(
        "eos bos pad unk sep cls mask stop special start end begin image video audio think placeholder vocab "
        "sentinel eot eom".split()
    ),
    "pass": frozenset("first second third last next final single multi forward backward one two each every".split()),
}
# Names of a file holding secrets (the secret is in the file, the name gives its path).
PATH_NAMES = frozenset({("google", "application", "credentials")})
# Names with a secret word that hold no secret: the shell's working folders (pwd); and a secret's
# location (a socket, a file, a folder) as the name's last word part, which records name as paths.
NOT_SECRET_ENV = frozenset({"PWD", "OLDPWD"})
LOCATION_PARTS = frozenset({"path", "file", "dir", "directory", "folder", "sock", "socket", "home", "location"})

# Word parts of snake_case, kebab-case, dotted and camelCase names (HFToken -> HF, Token), digits kept
# with the letters before them (B64, V2, ED25519) and split off after (PASSWORD1 -> password, 1).
_WORD = re.compile(r"[A-Z]+\d*(?![a-z])|[A-Z]?[a-z]+\d*|\d+")
_LETTERS_DIGITS = re.compile(r"([a-z]+)(\d+)")


def _words(name: str) -> list[str]:
    """The lower-case word parts of a name (B64, V2 and ED25519 one word each; PASSWORD1 two)."""
    out: list[str] = []
    for w in _WORD.findall(name):
        w = w.lower()
        m = _LETTERS_DIGITS.fullmatch(w)
        out.extend([m[1], m[2]] if m and w not in QUALIFIER_WORDS and not _VERSION.fullmatch(w) else [w])
    return out


def _qualifier(word: str) -> bool:
    """A word after the secret word that still names its value, role or version."""
    return word in QUALIFIER_WORDS or bool(_VERSION.fullmatch(word))


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a config key, option or environment variable name holds a secret (the rule above SECRET_WORDS):
    its last word, after qualifiers, a secret word; no setting word directly before, another meaning, nor a location."""
    if name in NOT_SECRET_ENV:
        return False
    parts = _words(str(name))
    content = False
    # CONNECTION_STRING: "string" is the secret word's own, not a qualifier
    while len(parts) > 1 and _qualifier(parts[-1]) and not _secret_word(parts[-2] + parts[-1], infixes=False):
        content = parts.pop() in CONTENT_WORDS or content  # pop first: every qualifier goes
    if content:  # KEY_FILE_B64 holds the file's content, not its path
        while len(parts) > 1 and parts[-1] in LOCATION_PARTS:
            parts.pop()
    elif not parts or parts[-1] in LOCATION_PARTS or tuple(parts) in PATH_NAMES:
        return False
    if not parts:
        return False
    last, before = parts[-1], parts[-2] if len(parts) > 1 else ""
    if _secret_word(last):
        start = len(parts) - 1
    elif _secret_word(before + last, infixes=False):  # SESSION_ID, WEBHOOK_URL (not PASSWORD_RESET)
        start = len(parts) - 2
    else:
        return False
    # the secret word with the secret words just before it (AUTH_TOKEN, SECRET_KEY), then what precedes
    while start > 0 and parts[start - 1] in SECRET_WORDS:
        start -= 1
    if start > 0 and parts[start - 1] in SETTING_WORDS:
        return False
    if before in OTHER_MEANINGS.get(last, ()):
        return False
    # PUBLIC_API_KEY, STRIPE_PUBLISHABLE_API_KEY: a key made public
    return not (last == "key" and before == "api" and len(parts) > 2 and parts[-3] in PUBLIC_WORDS)


def _secret_word(word: str, infixes: bool = True) -> bool:
    """One lower-case word (or the last two joined: SESSION_ID) that names a secret."""
    if word in SECRET_WORDS or word.endswith(SECRET_ENDINGS):
        return True
    if infixes and any(w in word for w in SECRET_INFIXES):
        return True
    for ending, before in QUALIFIED_ENDINGS.items():
        if word.endswith(ending) and word[: -len(ending)].endswith(before):
            return True
    return False
