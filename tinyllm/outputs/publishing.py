"""Publishing a finished run: `python report.py publish RUN URL` uploads its model, GGUF files, settings and
loss curve, in one flat layout (publish_layout), to a Hugging Face model repository (hf://USER/REPO, private
unless --public) or a folder or any other store remote_store.py opens (STORES_TEXT, from remote_store.BACKENDS),
and verifies every file after the upload.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from tinyllm.common import UserError, read_json_or, sha256_file
from tinyllm.outputs import artifacts
from tinyllm.store import checkpoint_store as store
from tinyllm.store import remote_store

# beside the model's files and the GGUFs: the run's settings, and what the end-of-run artifacts declare published
PUBLISHED_RUN_FILES = ("training_settings.json", *artifacts.published_files())
HUB_SCHEME = "hf"  # hf://USER/REPO: a model repository, through the Hub's API; any other URL: remote_store
STORES_TEXT = f"a folder, {remote_store.schemes_text(', ', last=' or ', without=(HUB_SCHEME,))} URL"


def publish_layout(run: Path) -> dict[str, Path]:
    """{name in the repository: local file}: RUN/model/'s files at the root (so from_pretrained("USER/REPO")
    and the Hub's model card work), the GGUF files export_gguf.py wrote beside model/, the run's settings
    and loss curve."""
    model = run / "model"
    if not (model / "config.json").is_file():
        raise UserError(
            f"{model} has no exported model (config.json): train.py exports it at the end of a run, "
            f"or `python train.py --data CORPUS --out {run} --export-only`"
        )
    files = {path.relative_to(model).as_posix(): path for path in sorted(model.rglob("*")) if path.is_file()}
    files.update({path.name: path for path in sorted(run.glob("*.gguf"))})
    files.update({name: run / name for name in PUBLISHED_RUN_FILES if (run / name).is_file()})
    return files


def git_blob_sha1(path: Path) -> str:
    """The id git (and so the Hub) gives a file stored without LFS."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def hub_mismatches(api, repo_id: str, files: dict[str, Path], prefix: str) -> list[str]:
    """The files whose copy on the Hub is not the local one: the LFS sha256 the Hub computed, or the git
    blob id of a file stored without LFS."""
    remote = {
        info.path: info
        for info in api.get_paths_info(repo_id, [f"{prefix}{name}" for name in files], repo_type="model")
    }
    wrong = []
    for name, path in files.items():
        info = remote.get(f"{prefix}{name}")
        lfs = getattr(info, "lfs", None)
        if info is None or getattr(info, "size", None) != path.stat().st_size:
            wrong.append(name)
        elif (lfs.sha256 if lfs is not None else info.blob_id) != (
            sha256_file(path) if lfs is not None else git_blob_sha1(path)
        ):
            wrong.append(name)
    return wrong


def publish_to_hub(files: dict[str, Path], url: str, public: bool, api=None) -> str:
    """hf://USER/REPO[/FOLDER]: a model repository (private unless `public`), all files in one commit, then
    verified. The token comes from HF_TOKEN or `hf auth login` and is never printed."""
    from huggingface_hub import CommitOperationAdd, HfApi

    parts = url.split("://", 1)[1].strip("/").split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise UserError(f"publish: {url} is not hf://USER/REPO")
    repo_id, prefix = "/".join(parts[:2]), "".join(f"{part}/" for part in parts[2:] if part)
    api = api or HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=not public, exist_ok=True)
        operations = [
            CommitOperationAdd(path_in_repo=f"{prefix}{name}", path_or_fileobj=str(path))
            for name, path in files.items()
        ]
        api.create_commit(repo_id, operations, commit_message="tinyllm: publish the model", repo_type="model")
        wrong = hub_mismatches(api, repo_id, files, prefix)
    except Exception as error:  # huggingface_hub's errors name the repo and the HTTP status, not the token
        raise UserError(f"publishing to hf://{repo_id} failed: {type(error).__name__}: {error}") from None
    if wrong:
        raise UserError(f"publish: the copy on hf://{repo_id} of {', '.join(wrong)} differs from the local file")
    return f"https://huggingface.co/{repo_id}"


def publish_to_store(files: dict[str, Path], url: str) -> str:
    """STORES_TEXT: each file uploaded and verified as backups are (remote_store.upload_verified)."""
    fs, root = remote_store.open_remote(url)
    shown = remote_store.printable_url(url) or "the publish URL"
    try:
        for name, path in files.items():
            remote_store.upload_verified(fs, path, f"{root.rstrip('/')}/{name}")
    except remote_store.VerificationError as error:
        raise UserError(f"publish to {shown}: {error}") from None
    except OSError as error:
        raise UserError(f"publish to {shown} failed: {type(error).__name__}: {error}") from None
    return shown


def publish(run: str | os.PathLike, url: str, public: bool = False, api=None) -> str:
    """Upload a run's model (see publish_layout) to `url`; returns where it went (printable)."""
    run = Path(run)
    files = publish_layout(run)
    status = read_json_or(run / "run_status.json", {}).get("status")
    if status != store.COMPLETE:
        print(
            f"warning: {run} is {status or 'without a run_status.json'}, not COMPLETE: its model card says so",
            file=sys.stderr,
            flush=True,
        )
    if remote_store.scheme_of(url) == HUB_SCHEME:
        return publish_to_hub(files, url, public, api)
    if public:
        raise UserError(f"publish --public is for {HUB_SCHEME}:// repositories (a store's access is its own setting)")
    return publish_to_store(files, url)
