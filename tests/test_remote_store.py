"""remote_store.py: the one table of stores (BACKENDS), what a URL is, opening a remote, and the texts and
packaging that follow from the table. Uploads, downloads and the corpus pull are exercised against a folder
and a real S3 endpoint in tests/test_cloud.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import tomllib

from tinyllm.common import UserError
from tinyllm.outputs import publishing
from tinyllm.store import checkpoint_cloud, remote_store
from tinyllm.store.remote_store import Backend
from tinyllm.training import train, train_data

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------
# The table.


def test_each_scheme_names_one_store_and_none_is_a_folder():
    schemes = [scheme for backend in remote_store.BACKENDS for scheme in backend.schemes]
    assert len(schemes) == len(set(schemes)) and all(scheme == scheme.lower() for scheme in schemes)
    assert not set(schemes) & set(remote_store.LOCAL_SCHEMES)
    for backend in remote_store.BACKENDS:
        assert backend.schemes and backend.package and backend.credentials
        for scheme in backend.schemes:
            assert remote_store.backend_of(f"{scheme.upper()}://bucket/x") is backend


def test_the_secret_variables_are_the_tables():
    assert remote_store.SECRET_VARIABLES == tuple(name for backend in remote_store.BACKENDS for name in backend.secrets)
    assert {"AWS_SECRET_ACCESS_KEY", "HF_TOKEN"} <= set(remote_store.SECRET_VARIABLES)


def test_each_stores_extra_in_pyproject_installs_its_package():
    """pyproject.toml's extras are packaging metadata (no code can write them): they are checked against the table."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    packages = {backend.package for backend in remote_store.BACKENDS}
    stores = {
        name: re.split(r"[<>=!~\[ ]", specs[0], maxsplit=1)[0].replace("-", "_")
        for name, specs in extras.items()
        if len(specs) == 1 and re.split(r"[<>=!~\[ ]", specs[0], maxsplit=1)[0] in packages
    }
    assert stores == {backend.extra: backend.package for backend in remote_store.BACKENDS if backend.extra}


# ----------------------------------------------------------------------------------------------
# What a URL is: one rule. fsspec opens file:// and local:// as its local file system, so both name a folder
# (train_data.is_url once said local:// was a remote, checkpoint_cloud.is_remote_url that it was not).


@pytest.mark.parametrize(
    "text, url, folder",
    [
        ("runs/tiny", False, "runs/tiny"),
        ("/kaggle/working/corpus", False, "/kaggle/working/corpus"),
        ("file:///tmp/corpus", False, "/tmp/corpus"),
        ("FILE:///tmp/corpus", False, "/tmp/corpus"),
        ("local:///tmp/corpus", False, "/tmp/corpus"),
        ("s3://bucket/corpus", True, None),
        ("S3://bucket/corpus", True, None),
        ("gs://bucket/corpus", True, None),
        ("hf://datasets/user/repo/corpus", True, None),
        ("memory://corpus", True, None),  # any other fsspec protocol is a remote too
    ],
)
def test_is_url_and_the_folder_a_local_one_names(text, url, folder):
    assert remote_store.is_url(text) is url
    if folder is not None:
        assert remote_store.local_path(text) == Path(folder)
        assert train_data.local_corpus_folder(text) == Path(folder)  # --data reads it in place, never pulls it
    else:
        assert train_data.local_corpus_folder(text).parent == Path(train_data.PULLED_CORPORA)


def test_open_remote_local_paths_and_missing_backends(tmp_path, monkeypatch):
    fs, root = remote_store.open_remote(str(tmp_path / "a"))
    assert remote_store.is_local(fs) and root == (tmp_path / "a").as_posix()
    fs, root = remote_store.open_remote(f"file://{tmp_path}/b")
    assert remote_store.is_local(fs) and root == (tmp_path / "b").as_posix()
    fs, root = remote_store.open_remote(f"local://{tmp_path}/c")
    assert remote_store.is_local(fs) and root == (tmp_path / "c").as_posix()
    with pytest.raises(UserError, match="unknown storage protocol 'nosuch'"):
        remote_store.open_remote("nosuch://bucket/x")
    real_find_spec = remote_store.importlib.util.find_spec
    monkeypatch.setattr(
        remote_store.importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("s3fs", "gcsfs") else real_find_spec(name, *a),
    )
    with pytest.raises(UserError, match="need the s3fs package: pip install s3fs"):
        remote_store.open_remote("s3://bucket/run")
    with pytest.raises(UserError, match="need the gcsfs package"):
        remote_store.open_remote("gs://bucket/run")


@pytest.mark.parametrize(
    "url, shown",
    [
        ("s3://bucket/runs/x", "s3://bucket/runs/x"),
        ("gs://bucket/runs", "gs://bucket/runs"),
        ("hf://user/repo", "hf://user/repo"),
        ("hf://datasets/user/repo@main/runs", "hf://datasets/user/repo@main/runs"),
        ("/kaggle/working/backups", "/kaggle/working/backups"),
        ("my backups?/v1", "my backups?/v1"),  # a local folder: every character is a path's
        ("file:///tmp/b", "file:///tmp/b"),
        ("s3://KEY:SECRET@bucket/x", None),
        ("s3://token@bucket/x", None),
        ("https://host/x?token=abc", None),
        ("s3://bucket/x?", None),
        ("gs://bucket/x#secret", None),
    ],
)
def test_printable_url(url, shown):
    assert remote_store.printable_url(url) == shown


# ----------------------------------------------------------------------------------------------
# What follows from the table: a new store is one Backend.


def test_a_new_backend_is_one_entry_of_the_table(tmp_path, monkeypatch):
    """fsspec's in-memory store added as a Backend: opened, named in the help texts, its package required."""
    memory = Backend(("memory",), "fsspec", "none needed", secrets=("MEMORY_TOKEN",))
    monkeypatch.setattr(remote_store, "BACKENDS", (*remote_store.BACKENDS, memory))
    assert remote_store.backend_of("memory://runs/x") is memory and remote_store.is_url("memory://runs/x")
    assert remote_store.schemes_text().endswith(" memory://")
    assert "memory://: pip install fsspec; credentials from none needed" in remote_store.backends_text()
    fs, root = remote_store.open_remote("memory://runs/x")
    remote_store.put_json(fs, f"{root}/a.json", {"a": 1})
    assert remote_store.get_json(fs, f"{root}/a.json") == {"a": 1}
    monkeypatch.setattr(remote_store.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(UserError, match="memory:// URLs need the fsspec package: pip install fsspec"):
        remote_store.open_remote("memory://runs/x")


def test_schemes_text_joins_the_tables_usual_schemes():
    usual = [f"{backend.schemes[0]}://" for backend in remote_store.BACKENDS]
    assert remote_store.schemes_text() == " ".join(usual)
    assert remote_store.schemes_text(", ", last=" or ") == ", ".join(usual[:-1]) + " or " + usual[-1]
    assert "hf://" not in remote_store.schemes_text(without=("hf",))


def test_every_help_text_lists_every_store(capsys):
    """train.py --data and --backup-to, report.py publish and checkpoint_cloud.py --help name each store."""
    backup_help = next(
        field.metadata["help"] for field in dataclasses.fields(train.SessionSettings) if field.name == "backup_to"
    )
    with pytest.raises(SystemExit):
        checkpoint_cloud.parse_args(["--help"])
    cloud_help = capsys.readouterr().out
    for backend in remote_store.BACKENDS:
        scheme = f"{backend.schemes[0]}://"
        assert scheme in train.DATA_HELP and scheme in backup_help and scheme in cloud_help
        assert f"pip install {backend.package}" in cloud_help
        assert (scheme in publishing.STORES_TEXT) is (backend.schemes[0] != publishing.HUB_SCHEME)


def test_a_backup_folder_whose_parent_is_missing_says_how_to_make_it(tmp_path):
    """push into file:///store/runs/mine when /store/runs does not exist: one line naming the missing folder and the
    mkdir that makes it (only the last folder is made, so an unmounted drive is never filled in its place)."""
    parent = tmp_path / "store" / "runs"
    url = f"file://{parent}/mine"
    fs, root = remote_store.open_remote(url)
    with pytest.raises(UserError) as raised:
        remote_store.require_remote(fs, root, url, writing=True)
    message = str(raised.value)
    assert message.startswith(f"no such folder: {parent} (") and message.endswith(f"mkdir -p {parent})")
    assert "\n" not in message and not parent.exists()
    parent.mkdir(parents=True)
    remote_store.require_remote(fs, root, url, writing=True)  # the parent exists: the folder itself may be new
