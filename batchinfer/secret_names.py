"""The secret-name rule of the one redaction (redaction.py): whether a config key, option or
environment variable name holds a secret, as secret scanners (gitleaks, detect-secrets) decide it.

In one sentence (docs/shared-filesystems.md, "Secrets"): a name holds a secret when its last word,
after qualifier words (API_KEY_VALUE, SECRET_KEY_BASE, HF_TOKEN_2), is a secret word (also written
joined: PGPASSWORD, HFTOKEN), unless a word makes it a setting (MAX_TOKEN, HF_HUB_DISABLE_IMPLICIT_TOKEN),
the word before gives the secret word another meaning (PRIMARY_KEY, EOS_TOKEN, FORWARD_PASS), or the
name is a location (MY_KEY_FILE, GOOGLE_APPLICATION_CREDENTIALS). A secret word anywhere else
(TOKEN_LIMIT, AUTH_ENABLED, KEY_COLUMN, PASS_THROUGH) names a setting."""

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
SECRET_ENDINGS = tuple("token secret secrets pwd jwt cookie webhook bearer auth sessionid sessid dsn".split())
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
# Words after the secret word that still name its value (a number too: HF_TOKEN_2).
QUALIFIER_WORDS = frozenset(
    "value val string str b64 base64 hex raw encoded enc base header prod production dev staging test live".split()
)
# Words that make a name a setting about a secret, not the secret (MAX_TOKEN, USE_AUTH_TOKEN, NO_AUTH).
SETTING_WORDS = frozenset(
    "max min num count limit limits length len size ttl timeout expiry expires enable enabled disable disabled "
    "use skip no allow require required parallelism".split()
)
# Words before a secret word that give it another meaning: a data key, a vocabulary token, a pass.
OTHER_MEANINGS = {
    "key": frozenset(
        "primary foreign sort partition cache group join lookup dict map row column composite unique dedup "
        "idempotency routing shard sharding hash range object record label index feature input output text prompt "
        "answer target result field metric id".split()
    ),
    "token": frozenset(
        "eos bos pad unk sep cls mask stop special start end begin image video audio think placeholder vocab "
        "sentinel eot eom".split()
    ),
    "pass": frozenset("first second third last next final single multi forward backward one two each every".split()),
}
# Names of a file holding secrets (the secret is in the file, the name gives its path).
PATH_NAMES = frozenset({("google", "application", "credentials")})
# Word parts of snake_case, kebab-case, dotted and camelCase names (HFToken -> HF, Token).
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")

# Names with a secret word that hold no secret: the shell's working folders (pwd); and a secret's
# location (a socket, a file, a folder) as the name's last word part, which records name as paths.
NOT_SECRET_ENV = frozenset({"PWD", "OLDPWD"})
LOCATION_PARTS = frozenset({"path", "file", "dir", "directory", "folder", "sock", "socket", "home", "location"})

# Word parts of snake_case, kebab-case, dotted and camelCase names (HFToken -> HF, Token).
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a config key, option or environment variable name holds a secret (the rule above SECRET_WORDS):
    its last word, after qualifiers, a secret word; not a setting, another meaning, nor a location."""
    if name in NOT_SECRET_ENV:
        return False
    parts = [p.lower() for p in _WORD.findall(str(name))]
    while parts and (parts[-1].isdigit() or parts[-1] in QUALIFIER_WORDS) and len(parts) > 1:
        parts.pop()
    if not parts or parts[-1] in LOCATION_PARTS or tuple(parts) in PATH_NAMES:
        return False
    if any(p in SETTING_WORDS for p in parts):
        return False
    last, before = parts[-1], parts[-2] if len(parts) > 1 else ""
    if before in OTHER_MEANINGS.get(last, ()):
        return False
    # SESSION_ID, WEBHOOK_URL: a secret word written as two (no infix: PASSWORD_RESET is a setting)
    return _secret_word(last) or _secret_word(before + last, infixes=False)


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
