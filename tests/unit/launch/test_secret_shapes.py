"""Secrets found by their text (batchinfer/secret_shapes.py): values of a known issuer's shape under
neutral names (G1), plain-text forms in free text (B18) and in cluster.setup (B3), struck from
printed lines and records and refused where they would be stored (a template file too: K2);
look-alikes kept."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.corpus import write_corpus
from support.fake_engine import fake_overrides

from batchinfer import redaction, security
from batchinfer.config.compose import compose
from batchinfer.errors import ConfigError
from batchinfer.redaction import REDACTED, record_json, redact_text
from batchinfer.rundir.prepare import prepare

# Made-up values of each issuer's shape (length and alphabet as issued), each under a neutral name.
SHAPED = {
    "github": "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8",
    "github_fine": "github_pat_11ABCDEFG0" + "x1Y2z3" * 10,
    "gitlab": "glpat-" + "aB3dE6gH9jK2mN5pQ8sT",
    "hf": "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYzAbCdEfGh",
    "openai": "sk-" + "aB3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3hJ6kM9n",
    "openai_project": "sk-proj-" + "aB3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3hJ6kM9n_x-Y",
    "stripe": "sk_live_" + "51HaB3dE6gH9jK2mN5pQ8s",
    "slack": "xoxb-1234567890-1234567890123-" + "aB3dE6gH9jK2mN5pQ8sT1vW4",
    "slack_webhook": "https://hooks.slack.com/services/T0000AAAA/B0000BBBB/" + "aB3dE6gH9jK2mN5pQ8sT1vW4",
    "aws": "AKIA" + "Z7Q2M4N6P8R1T3V5",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "google_oauth": "ya29.a0AfH6SMB" + "x1Y2z3-_" * 8,
    "replicate": "r8_" + "aB3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3hJ6k",
    "groq": "gsk_" + "aB3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3hJ6kM9nP2qR5sU8wX1z",
    "digitalocean": "dop_v1_" + "0123456789abcdef" * 4,
    "sendgrid": "SG." + "aB3dE6gH9jK2mN5pQ8sT1v" + "." + "aB3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3hJ6kM9nP2q",
    "anthropic_short": "sk-ant-api03-" + "aB3dE6gH9jK2mN5pQ8sT",
    "anthropic_plain": "sk-ant-" + "aB3dE6gH9jK2mN5pQ8",
    "azure_connection_string": "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey="
    + "aB3dE6gH9jK2mN5pQ8sT1vW4+/" * 3
    + "xY==;EndpointSuffix=core.windows.net",
}
# Text that mentions a prefix or looks alike, which must pass (prompts, paths, digests, docs' examples).
LOOK_ALIKES = [
    "API keys start with sk- and are secret.",
    "Use sk-learn and scikit-learn interchangeably.",
    "sk-" + "x" * 48,  # a placeholder: no digit
    "pip install hf_transfer; hf_hub_download(repo_id=...)",
    "AKIAIOSFODNN7EXAMPLE",  # AWS's documented example key
    "xoxb-your-token-here",
    "eyJhbGciOiJIUzI1NiJ9 is a JWT header",
    "sha256:" + "0123456789abcdef" * 4,
    "github_pat_ tokens are fine-grained",
    "/scratch/runs/ghp_notes/out.parquet",
    "Google OAuth tokens start with ya29. and expire in an hour.",
    "Replicate tokens look like r8_... and Groq keys like gsk_...",
    "cd /data/gsk_runs/r8_test && ls dop_v1_notes",
    "DigitalOcean tokens start with dop_v1_ (doo_v1_ for OAuth).",
    "SG. is a SendGrid key's prefix; SG.Results.csv is a file.",
    "Anthropic keys look like sk-ant-api03-... and sk-ant-admin01-...",
    "Azure connection strings hold AccountKey=...;EndpointSuffix=core.windows.net",
    "AccountKey=...; SharedAccessKey=",
]


@pytest.mark.parametrize("kind", sorted(SHAPED))
def test_a_shaped_value_under_a_neutral_name_is_struck_and_refused(kind: str) -> None:
    value = SHAPED[kind]
    assert value not in redact_text(f"starting with GH={value} on node 3") and REDACTED in redact_text(value)
    assert value not in record_json({"note": f"a {value} b"})
    # in a config value read back to run: refused at compose naming the key, the value not echoed
    with pytest.raises(ConfigError, match=r"^prompt\.system holds what looks like an? ") as e:
        security.check_config_secrets({"prompt": {"system": f"Use {value} to call"}})
    assert value not in str(e.value)
    # in cluster.env under a neutral name: a secret entry (travels by environment, struck in run.yaml)
    assert redaction.is_secret_entry("MY_SETTING", value)
    assert redaction.exact({"cluster": {"env": {"MY_SETTING": value}}}) == {
        "cluster": {"env": {"MY_SETTING": REDACTED}}
    }
    security.check_config_secrets({"cluster": {"env": {"MY_SETTING": value}}})


@pytest.mark.parametrize("text", LOOK_ALIKES)
def test_text_naming_a_prefix_or_looking_alike_passes(text: str) -> None:
    assert redact_text(text) == text
    security.check_config_secrets({"prompt": {"system": text}})
    assert not redaction.is_secret_entry("MY_SETTING", text)


def test_compose_refuses_a_shaped_value_in_a_prompt() -> None:
    with pytest.raises(ConfigError, match=r"prompt\.system holds what looks like a GitHub token") as e:
        compose([f"prompt.system=Call the API with {SHAPED['github']}"])
    assert SHAPED["github"] not in redact_text(str(e.value)) and SHAPED["github"] not in str(e.value)


P = "PLANTEDfree-0123456789"
# Plain-text forms of a secret in free text: log lines, a setup line's heredoc, printed lines (B18).
FREE_TEXT = [
    (f"HF_TOKEN: {P}", "HF_TOKEN: <redacted>"),
    (f'{{"api_key": "{P}", "model": "m"}}', '{"api_key": "<redacted>", "model": "m"}'),
    (f"{{'token': '{P}'}}", "{'token': '<redacted>'}"),
    (f"Authorization: Bearer {P}", "Authorization: Bearer <redacted>"),
    (f"authorization: Basic {P}", "authorization: Basic <redacted>"),
    (
        f"GET https://acct.blob.core.windows.net/c/b.jsonl?sv=2022-11-02&sig={P}&se=2026",
        "GET https://acct.blob.core.windows.net/c/b.jsonl?sv=2022-11-02&sig=<redacted>&se=2026",
    ),
    (f"https://b.s3.amazonaws.com/k?X-Amz-Signature={P}", "https://b.s3.amazonaws.com/k?X-Amz-Signature=<redacted>"),
    (f"https://x/export?user=bob&password={P}&fmt=csv", "https://x/export?user=bob&password=<redacted>&fmt=csv"),
]
# The same words holding no secret: kept.
FREE_TEXT_KEPT = [
    "HF_TOKEN: not set",
    "cluster.env.HF_TOKEN: Cannot convert 'list' to string",
    "Authorization: Bearer $HF_TOKEN",
    "password required",
    "max_tokens: 256",
    "time: 12:30",
    "https://x/search?q=sig&page=2",
    'token: "${oc.env:HF_TOKEN}"',
]


@pytest.mark.parametrize("text,shown", FREE_TEXT)
def test_a_secret_in_free_text_is_struck(text: str, shown: str) -> None:
    assert redact_text(text) == shown


@pytest.mark.parametrize("text", FREE_TEXT_KEPT)
def test_free_text_without_a_secret_is_kept(text: str) -> None:
    assert redact_text(text) == text


# cluster.setup variants that were stored as written (B3): each refused naming the line.
SETUP = [
    f"mysql -u root -p'{P}' db < q.sql",
    f'mysql -u root -p"{P}" db',
    f"curl -ubob:{P} https://x/f -o f",
    f"HF_TOKEN+={P}",
    f"cat > ~/.netrc <<EOF\nmachine huggingface.co login bob password {P}\nEOF",
    f"cat > ~/.config/app.yaml <<EOF\napi_key: {P}\nEOF",
    f"docker login -u bob -p {P} registry.example.org",
    f"podman login -p={P} quay.io",
    f"wandb login {P}",
    f"wandb login --relogin {P}",
    f"echo {P} > ~/.cache/huggingface/token",
    f"printf '%s' {P} >> ~/.netrc",
    f"echo {P} | docker login -u bob --password-stdin reg",
    f"huggingface-cli login --token {P}",
    f"export X={SHAPED['hf']}",
]
SETUP_KEPT = [
    "wandb login --relogin",
    "docker login -u bob --password-stdin reg < ~/.docker-pw",
    'echo "$HF_TOKEN" > ~/.cache/huggingface/token',
    'huggingface-cli login --token "$HF_TOKEN"',
    "echo done > log.txt",
    "mysql -p db",
    "cat > ~/.netrc <<EOF\nmachine host login bob password $NETRC_PW\nEOF",
]


@pytest.mark.parametrize("line", SETUP)
def test_a_setup_line_giving_a_secret_is_refused_naming_it(line: str) -> None:
    with pytest.raises(ConfigError) as e:
        security.check_config_secrets({"cluster": {"setup": ["module load x", line]}})
    msg = str(e.value)
    assert msg.startswith("cluster.setup[1] ") and "cluster.env_inherit=[" in msg
    assert P not in msg and SHAPED["hf"] not in msg
    assert P not in redact_text(line) and SHAPED["hf"] not in redact_text(line)


@pytest.mark.parametrize("line", SETUP_KEPT)
def test_a_setup_line_referring_to_a_variable_is_accepted(line: str) -> None:
    security.check_config_secrets({"cluster": {"setup": [line]}})
    assert redact_text(line) == line


def test_a_template_file_holding_a_secret_is_refused_before_it_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K2: a prompt.template_file is copied into DIR/files (0644 under umask 022): holding a secret
    variable's value or a shaped secret, it is refused as the same text inline is, naming file:line."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    template = tmp_path / "t.txt"
    secret = "s3cr3t-PLANTEDfile-0123"
    monkeypatch.setenv("PROJECT_TOKEN", secret)
    cfg = compose(fake_overrides(tmp_path, corpus, f"prompt.template_file={template}"))
    out = Path(cfg.output.dir)
    for body, line, what in (
        (f"Answer briefly.\nCall with key {secret}.\nQ: {{text}}\n", 2, "the value of PROJECT_TOKEN, a secret"),
        (f"Q: {{text}}\nAuth {SHAPED['github']}\n", 2, "what looks like a GitHub token"),
        (f"Fetch https://bob:{P}@host/x\nQ: {{text}}\n", 1, "a URL with a password"),
    ):
        template.write_text(body)
        with pytest.raises(ConfigError) as e:
            prepare(cfg)
        assert str(e.value).startswith(f"prompt.template_file {template}:{line} holds {what}")
        assert secret not in str(e.value) and SHAPED["github"] not in str(e.value) and P not in str(e.value)
        assert not (out / "files").exists()
    template.write_text("Answer briefly.\nQ: {text}\n")
    run = prepare(cfg)
    assert [p.read_text() for p in (run.path / "files").rglob("t.txt")] == ["Answer briefly.\nQ: {text}\n"]


# Words and paths an attacker found refused as keys (M1, M2): an sk- key is one mixed-case token with
# digits, never a path's component or a run of lower-case words; an AWS key id is never all of A, C, G, T.
NOT_KEYS = [
    "/tmp/atk8/sk-learn-experiments-2024-run-000123/in.jsonl",
    "sk-learn-experiments-2024-run-000123-and-more-words",
    "sk-ant-colony-optimization-2024",
    "Find primer ACCAGTTCAGGCTTAGCATG in {text}",
    "/data/" + SHAPED["openai"] + "/in.jsonl",  # a folder named like a key is a path's component
]


@pytest.mark.parametrize("text", NOT_KEYS)
def test_words_paths_and_primers_are_no_keys(text: str) -> None:
    assert redact_text(text) == text
    security.check_config_secrets({"prompt": {"system": text}})


def test_a_path_key_is_never_refused_by_shape_but_a_prompt_is() -> None:
    path = "/scratch/sk-Ab3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3hJ6kM9n.d/in.jsonl"
    for key in ("input.path", "output.dir", "model.path", "prompt.template_file", "cluster.cache_dir"):
        section, name = key.split(".")
        security.check_config_secrets({section: {name: path}})
    security.check_config_secrets({"model": {"lora": {"adapters": {"a": SHAPED["aws"]}}}})
    with pytest.raises(ConfigError, match=r"^prompt\.system holds what looks like an AWS access key id"):
        security.check_config_secrets({"prompt": {"system": f"see {SHAPED['aws']}"}})
