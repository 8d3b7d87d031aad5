"""The secret-name rule of the one redaction (redaction.py): whether a config key, option or
environment variable name holds a secret, as secret scanners (gitleaks, detect-secrets) decide it."""

from __future__ import annotations

import functools
import re

# Whole word parts only: `max_tokens`, `sort_keys`, `tokenizer`, `passes` and `keep` are not secrets.
# (A DSN carries its key, Sentry's, or a password, a database's.)
SECRET_WORDS = frozenset(
    "token key apikey secret secrets password passwords passwd pass pwd passphrase credential credentials auth "
    "authorization jwt cookie cookies webhook webhooks pat bearer dsn sessionid sessid".split()
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
# Word parts of snake_case, kebab-case, dotted and camelCase names (HFToken -> HF, Token).
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")

# Names with a secret word that hold no secret: the shell's working folders (pwd); and a secret's
# location (a socket, a file, a folder) as the name's last word part, which records name as paths.
NOT_SECRET_ENV = frozenset({"PWD", "OLDPWD"})
LOCATION_PARTS = frozenset({"path", "file", "dir", "sock", "socket", "home"})


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a config key, option or environment variable name looks like it holds a secret: a
    secret word as a word part, or inside a word written without separators (AWSSECRETKEY, hftoken);
    a name that ends in a location (MY_KEY_FILE, HF_TOKEN_PATH) holds no secret, only where one is."""
    if name in NOT_SECRET_ENV:
        return False
    parts = [p.lower() for p in _WORD.findall(str(name))]
    if not parts or parts[-1] in LOCATION_PARTS:
        return False
    return any(_secret_word(p) for p in parts) or _secret_word("".join(parts))


def _secret_word(word: str) -> bool:
    """One lower-case word part (or a whole name's parts joined: SESSION_ID) that names a secret."""
    if word in SECRET_WORDS or any(w in word for w in SECRET_INFIXES) or word.endswith(SECRET_ENDINGS):
        return True
    for ending, before in QUALIFIED_ENDINGS.items():
        if word.endswith(ending) and word[: -len(ending)].endswith(before):
            return True
    return False
