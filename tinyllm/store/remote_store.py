"""Remote storage: what a URL is, the stores it can name (BACKENDS, the one table), opening one, and the
verified operations everything remote is made of (atomic put and get, upload and download confirmed by
sha256), plus a corpus folder's pull and push.

A URL is anything fsspec opens: a folder (a path, `file://...` or `local://...`: fsspec's local file system)
or a store of BACKENDS (`python checkpoint_cloud.py --help` lists them with their packages and credentials).
Credentials come from where each store's library looks for them, never from the command line; messages name
the scheme, never the URL, which may carry secrets.

How a remote copy is confirmed: the uploaded temporary file is read back and hashed. That is the one check
that means the same on every store: S3's ETag is an MD5 only for single-part uploads, its SHA256 checksums of
multipart uploads are checksums of parts, GCS offers MD5/CRC32C. The exception is the Hugging Face Hub, whose
file info carries the sha256 the Hub computed for LFS files; that one is used as is. The read-back costs
download bandwidth (egress on clouds that bill for it).

checkpoint_cloud.py (the backup of a RUN folder and its restore) and publishing.py build on this module;
train_data.py pulls a --data URL's corpus with `pull_corpus`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib.util
import json
import os
import textwrap
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tinyllm.common import (
    HASH_CHUNK_BYTES,
    UserError,
    atomic_folder,
    atomic_path,
    fsync_dir,
    fsync_file,
    os_error_text,
    sha256_file,
    temporary_name,
    temporary_target,
)
from tinyllm.data import corpus_format
from tinyllm.data.corpus_format import CORPUS_MANIFEST

# ----------------------------------------------------------------------------------------------
# The stores: one table. A new cloud backend is one Backend here (and, when its package is an extra,
# the extra in pyproject.toml that tests/test_remote_store.py checks against this table).


@dataclass(frozen=True)
class Backend:
    """A kind of remote store that fsspec opens through `package`."""

    schemes: tuple[str, ...]  # its URL schemes, the usual one first (the one help texts show)
    package: str  # the fsspec implementation (import name); only the one a URL names has to be installed
    credentials: str  # where its library looks for credentials (checkpoint_cloud.py --help, docs/backups.md)
    secrets: tuple[str, ...] = ()  # environment variables whose values no message may show
    buckets: bool = False  # the URL's first part is a bucket, which must exist: nothing here ever creates one
    extra: str | None = None  # the pyproject.toml extra that installs `package` (None: a dependency brings it)


BACKENDS = (
    Backend(
        ("s3", "s3a"),
        "s3fs",
        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN), AWS_PROFILE "
        "or ~/.aws/, region AWS_DEFAULT_REGION; S3-compatible stores (MinIO, R2, B2, Wasabi) through "
        "AWS_ENDPOINT_URL",
        secrets=("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"),
        buckets=True,
        extra="s3",
    ),
    Backend(
        ("gs", "gcs"),
        "gcsfs",
        "GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default login`",
        buckets=True,
        extra="gcs",
    ),
    Backend(
        ("hf",),
        "huggingface_hub",
        "HF_TOKEN or `hf auth login` (hf://USER/REPO/prefix, a model repo; "
        "hf://datasets/USER/REPO/prefix, a dataset repo; installed with transformers)",
        secrets=("HF_TOKEN",),
    ),
)
LOCAL_SCHEMES = ("file", "local")  # fsspec's local file system: a folder, not a remote
SECRET_VARIABLES = tuple(name for backend in BACKENDS for name in backend.secrets)


def scheme_of(url: str) -> str:
    """The URL's scheme, lower case; "file" for a plain path."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def backend_of(url: str) -> Backend | None:
    """The BACKENDS entry of `url`'s scheme; None for a folder or a protocol of fsspec's own."""
    return next((backend for backend in BACKENDS if scheme_of(url) in backend.schemes), None)


def is_url(text: str) -> bool:
    """Whether `text` names a remote store rather than a local folder (a path, file://, local://)."""
    return scheme_of(text) not in LOCAL_SCHEMES


def local_path(text: str) -> Path:
    """The folder a local `text` names (a path, file://PATH or local://PATH)."""
    for scheme in LOCAL_SCHEMES:
        if text.lower().startswith(f"{scheme}://"):
            return Path(text[len(scheme) + 3 :])
    return Path(text)


def schemes_text(separator: str = " ", last: str | None = None, without: tuple[str, ...] = ()) -> str:
    """The stores' usual schemes for a help text: "s3:// gs:// hf://"; `last` joins the last two ("or")."""
    shown = [f"{backend.schemes[0]}://" for backend in BACKENDS if backend.schemes[0] not in without]
    if last is None or len(shown) < 2:
        return separator.join(shown)
    return f"{separator.join(shown[:-1])}{last}{shown[-1]}"


def backends_text(width: int = 100) -> str:
    """Each store's schemes, package and credentials, a paragraph each (checkpoint_cloud.py --help's epilog)."""
    return "\n".join(
        textwrap.fill(
            f"{' '.join(f'{scheme}://' for scheme in backend.schemes)}: pip install "
            f"{backend.package}; credentials from {backend.credentials}",
            width,
            subsequent_indent="    ",
        )
        for backend in BACKENDS
    )


# OSErrors that only a local disk raises (a store's errors arrive as other types or errnos)
LOCAL_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)

LogFn = Callable[[str], None]
log_line: LogFn = functools.partial(print, flush=True)


class VerificationError(Exception):
    """A remote file does not have the size or sha256 it should have."""


class LocalFileChanged(VerificationError):
    """A local file no longer matches the size or sha256 recorded when it was written: never uploaded."""


# ----------------------------------------------------------------------------------------------
# Opening a remote and the small operations everything else is made of.


# The background backup's S3 client gives up on a request after FAIL_FAST_ATTEMPTS tries (botocore's, and
# s3fs's own retry loop): the backup's Mirror retries the whole upload itself, so an outage is logged within
# seconds instead of after ~25 silent connection attempts (tens of training steps later).
FAIL_FAST_ATTEMPTS = 2
FAIL_FAST_S3_CONFIG = {"connect_timeout": 10, "retries": {"max_attempts": FAIL_FAST_ATTEMPTS, "mode": "standard"}}


def open_remote(url: str, fail_fast: bool = False):
    """(fs, root) for `url`: a local folder, a store of BACKENDS or any fsspec protocol.

    Nothing is contacted yet. Credentials come from where each library looks for them (Backend.credentials).
    Error messages name the scheme, never the URL, which may carry secrets. `fail_fast`: few retries
    inside the S3 client (see FAIL_FAST_ATTEMPTS).
    """
    import fsspec

    if not url or not str(url).strip():
        raise UserError("the backup URL is empty")
    url = str(url)
    scheme, backend = scheme_of(url), backend_of(url)
    package = backend.package if backend else None
    if package and importlib.util.find_spec(package) is None:
        raise UserError(f"{scheme}:// URLs need the {package} package: pip install {package}")
    try:
        options = {"skip_instance_cache": True}
        if fail_fast and package == "s3fs":  # botocore's retry settings from the environment win
            options["config_kwargs"] = {
                key: value
                for key, value in FAIL_FAST_S3_CONFIG.items()
                if key != "retries" or "AWS_MAX_ATTEMPTS" not in os.environ
            }
        fs, root = fsspec.core.url_to_fs(url, **options)
        if fail_fast and package == "s3fs":
            fs.retries = FAIL_FAST_ATTEMPTS
    except ImportError as error:
        raise UserError(f"{scheme}:// URLs need a package that is not installed ({error.name or error})") from None
    except ValueError:
        raise UserError(f"unknown storage protocol {scheme!r} in the backup URL") from None
    root = root.rstrip("/")
    if is_local(fs) and not root:
        root = "/"
    return fs, root


def is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    return any(scheme in protocol for scheme in LOCAL_SCHEMES)


def refresh(fs, path: str) -> None:
    """Forget listings cached by the file system (s3fs caches them) so we see the store as it is."""
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)


def parent_of(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def temp_name(path: str) -> str:
    """A hidden temporary name beside `path`, unique to this upload (common.temporary_name's scheme)."""
    return f"{parent_of(path)}/{temporary_name(path.rsplit('/', 1)[-1])}"


def make_durable(fs, path: str) -> None:
    """On a local or mounted folder, fsync the file (object stores are durable once a PUT returns)."""
    if not is_local(fs):
        return
    fsync_file(path)


def remove_quietly(fs, path: str) -> None:
    with contextlib.suppress(Exception):
        fs.rm_file(path)


def promote(fs, temp: str, final: str) -> None:
    """Move a verified temporary file to its final name (a rename locally, copy + delete on S3)."""
    fs.mv(temp, final)
    if is_local(fs):
        fsync_dir(parent_of(final))
    refresh(fs, parent_of(final))


def make_parent(fs, path: str) -> None:
    """Create the folder a remote file goes into, on a local or mounted folder only: object stores have
    no folders, and s3fs's makedirs would create a missing bucket (a typo must never make one)."""
    if is_local(fs):
        fs.makedirs(parent_of(path), exist_ok=True)


def put_json(fs, path: str, obj) -> None:
    """Write a small JSON file on the remote through a temporary name and a promotion."""
    temp = temp_name(path)
    make_parent(fs, path)
    try:
        fs.pipe_file(temp, (json.dumps(obj, indent=2) + "\n").encode())
        make_durable(fs, temp)
        promote(fs, temp, path)
    except BaseException:
        remove_quietly(fs, temp)
        raise


def get_json(fs, path: str):
    """A remote JSON file, or None when it does not exist. Broken JSON raises VerificationError."""
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise VerificationError(f"{path.rsplit('/', 1)[-1]} is not valid JSON") from None


def remote_digest(fs, path: str) -> tuple[int, str]:
    """(size, sha256) of a remote file: the Hub's own LFS sha256 when it gives one, else read back."""
    refresh(fs, path)
    info = fs.info(path)
    size = int(info["size"])
    lfs = info.get("lfs")
    if isinstance(lfs, dict) and lfs.get("sha256"):
        return size, str(lfs["sha256"])
    digest = hashlib.sha256()
    with fs.open(path, "rb", block_size=HASH_CHUNK_BYTES) as handle:
        while block := handle.read(HASH_CHUNK_BYTES):
            digest.update(block)
    return size, digest.hexdigest()


def upload_verified(
    fs, local_path: str | os.PathLike, remote_path: str, sha256: str | None = None, size: int | None = None
) -> dict:
    """Upload to a temporary name, confirm size and sha256 there, then promote. Returns {sha256, bytes}.

    `sha256` (and `size`): what the local file held when it was written, e.g. train.py's record. The
    upload is then the only read of the local file (for a think72 checkpoint, 860 MB less to read), and
    the remote copy is checked against the record itself: bytes that changed on disk since are never
    promoted (LocalFileChanged). Without them the local file is hashed first, a read of its own.
    On any failure the temporary file is removed (best effort) and `remote_path` is untouched.
    """
    local = Path(local_path)
    local_size = local.stat().st_size
    if size is not None and local_size != size:
        raise LocalFileChanged(
            f"{local.name} has {local_size} bytes, its record says {size}: it changed on disk after it was written"
        )
    digest = sha256 or sha256_file(local)
    temp = temp_name(remote_path)
    make_parent(fs, remote_path)
    try:
        fs.put_file(str(local), temp)
        make_durable(fs, temp)
        remote_size, remote_sha = remote_digest(fs, temp)
        if (remote_size, remote_sha) != (local_size, digest):
            # Only now read the local file again, to say which side is wrong.
            if sha256 is not None and sha256_file(local) != sha256:
                raise LocalFileChanged(
                    f"{local.name} no longer matches the sha256 recorded when it was written: it changed on disk since"
                )
            raise VerificationError(f"the uploaded copy of {local.name} differs from the local file")
        promote(fs, temp, remote_path)
    except BaseException:
        remove_quietly(fs, temp)
        raise
    refresh(fs, remote_path)
    if int(fs.info(remote_path)["size"]) != local_size:
        raise VerificationError(f"{local.name} changed size while it was promoted")
    return {"sha256": digest, "bytes": local_size}


def download_verified(
    fs,
    remote_path: str,
    local_path: Path,
    sha256: str,
    size: int | None = None,
    on_verified: Callable[[], None] = lambda: None,
) -> bool:
    """Download to a temporary name beside `local_path`, check the sha256, call `on_verified` (e.g. write the
    file's record), then rename into place; False: a local file of that sha256 was there already (nothing
    read from the remote; `on_verified` is called all the same). A failure or a signal leaves no temporary."""
    local_path = Path(local_path)
    if local_path.is_file() and sha256_file(local_path) == sha256:
        on_verified()
        return False
    with atomic_path(local_path) as temp:
        fs.get_file(remote_path, str(temp))
        if (size is not None and temp.stat().st_size != size) or sha256_file(temp) != sha256:
            raise VerificationError(f"{local_path.name} on the remote does not match its recorded sha256")
        on_verified()
    return True


@contextlib.contextmanager
def remote_errors(action: str):
    """Turn a storage failure into one UserError naming the action and the exception type only."""
    try:
        yield
    except (UserError, VerificationError):
        raise
    except Exception as error:
        if isinstance(error, OSError) and error.errno in LOCAL_ERRNOS:  # the local disk: say which file, why
            raise UserError(f"{action} failed: {os_error_text(error)}") from None
        raise UserError(
            f"{action} failed ({type(error).__name__}); check the URL, the network and the credentials"
        ) from None


def require_remote(fs, root: str, url: str, writing: bool = False) -> None:
    """A remote that does not exist (a typo) is an error; an existing empty one is not, and nothing
    is ever created to make it exist. list / verify / pull: a local folder must exist; push and
    train.py's backup (`writing`) may create the folder itself, inside an existing parent folder.
    On S3 / GCS the bucket must exist (a prefix inside it exists once written)."""
    scheme, backend = scheme_of(url), backend_of(url)
    with remote_errors("looking at the remote"):
        refresh(fs, root)
        if is_local(fs):
            if fs.exists(root) and not fs.isdir(root):
                raise UserError(f"{root} is a file, not a folder")
            parent = parent_of(root) or "/"
            if writing and not fs.isdir(root) and not fs.isdir(parent):
                raise UserError(
                    f"no such folder: {parent} (the backup folder is created only inside an existing one, so a drive"
                    f" that is not mounted is never filled in its place; if this is the place: mkdir -p {parent})"
                )
            if not writing and not fs.isdir(root):
                raise UserError(f"no such folder: {root}")
        elif backend is not None and backend.buckets and not fs.exists(root):
            bucket = root.split("/", 1)[0]
            refresh(fs, bucket)
            if not fs.exists(bucket):
                raise UserError(f"the {scheme}:// bucket does not exist (or these credentials cannot see it)")


def remote_manifest(fs, root: str) -> corpus_format.Manifest:
    """The manifest of the corpus at `root`, read and checked as a local one is."""
    return corpus_format.parse_manifest(fs.cat_file(f"{root}/{CORPUS_MANIFEST}"), f"{root}/{CORPUS_MANIFEST}")


def remote_is_corpus(fs, root: str) -> bool:
    refresh(fs, root)
    return fs.exists(f"{root}/{CORPUS_MANIFEST}")


def probe_error_text(error: Exception, url: str) -> str:
    """'Read-only file system' / 'PermissionError: Access Denied.': the cause of a failed probe, without
    the URL (it may carry credentials) nor any credential from the environment."""
    if isinstance(error, OSError) and error.errno and not is_url(url):
        return os_error_text(error)
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc if "@" in parts.netloc else ""
    query_values = [value for _, value in urllib.parse.parse_qsl(parts.query)]
    secrets_seen = [
        url,
        netloc,
        parts.password,
        parts.query,
        *query_values,
        *(os.environ.get(name) for name in SECRET_VARIABLES),
    ]
    for secret in sorted(filter(None, secrets_seen), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text.splitlines()[0] if text else type(error).__name__


def printable_url(url: str) -> str | None:
    """`url` when it may be printed as it is (a local folder, a store's plain URL); None when
    it carries credentials (user:password@, a ?query such as a token, a #fragment)."""
    if "://" not in url:
        return url
    parts = urllib.parse.urlsplit(url)
    if "@" in parts.netloc or parts.query or parts.fragment or "?" in url or "#" in url:
        return None
    return url


# ----------------------------------------------------------------------------------------------
# Corpora: pulled the same way, verified against their manifest.


def remote_tree_sha256(fs, folder: str) -> str:
    """common.sha256_tree of a remote folder: sorted relative names and file sha256s."""
    refresh(fs, folder)
    names = sorted((PurePosixPath(p[len(folder) + 1 :]) for p in fs.find(folder)), key=lambda p: p.parts)
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.as_posix().encode() + b"\0")
        digest.update(remote_digest(fs, f"{folder}/{name.as_posix()}")[1].encode() + b"\n")
    return digest.hexdigest()


def verify_corpus_folder(folder: Path) -> None:
    """corpus_format.verify_corpus: UserError naming the first problem."""
    problems = corpus_format.verify_corpus(folder)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"corpus check against {CORPUS_MANIFEST} failed: {problems[0]}{more}")


def pull_corpus(url: str, local_dir: str | os.PathLike, log: LogFn = log_line) -> Path:
    """Download the corpus folder at `url` into `local_dir` and verify it against its manifest.

    The download goes to a temporary folder beside `local_dir` that is renamed only once verified.
    A `local_dir` already holding a verified corpus is kept as is.
    """
    target = Path(local_dir)
    if (target / CORPUS_MANIFEST).is_file():
        verify_corpus_folder(target)
        log(f"corpus pull: {target} already holds a verified corpus")
        return target
    if target.exists() and any(target.iterdir()):
        raise UserError(f"{target} exists and is not a finished corpus; remove it or choose another folder")
    fs, root = open_remote(url)
    with atomic_folder(target) as temp:
        with remote_errors("downloading the corpus"):
            refresh(fs, root)
            names = [p[len(root) + 1 :] for p in fs.find(root) if p.startswith(root + "/")]
            if CORPUS_MANIFEST not in names:
                raise UserError(f"the remote corpus has no {CORPUS_MANIFEST}")
            for name in names:
                if temporary_target(name.rsplit("/", 1)[-1]):
                    continue
                (temp / name).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{root}/{name}", str(temp / name))
        verify_corpus_folder(temp)
    log(f"corpus pull: {len(names)} files verified into {target}")
    return target


def corpus_stored(url: str) -> bool:
    """Whether a complete corpus (its manifest, uploaded last) is at `url` (the notebook's CORPUS_URL); a store
    that cannot be looked at (no credentials, no network, no such bucket) is one UserError, not a traceback."""
    fs, root = open_remote(url)
    with remote_errors(f"looking for a corpus at {printable_url(url) or 'CORPUS_URL'}"):
        return fs.exists(f"{root}/{CORPUS_MANIFEST}")


def push_corpus(corpus_dir: Path, fs, root: str, log: LogFn = log_line) -> None:
    """Upload a finished corpus, every file verified, the manifest last (its presence means complete)."""
    verify_corpus_folder(corpus_dir)
    files = sorted(p for p in corpus_dir.rglob("*") if p.is_file() and p.name != CORPUS_MANIFEST)
    for path in [*files, corpus_dir / CORPUS_MANIFEST]:
        upload_verified(fs, path, f"{root}/{path.relative_to(corpus_dir).as_posix()}")
    log(f"push: corpus of {len(files) + 1} files uploaded and verified")
