"""publishing.py (`report.py publish`): a run's model, GGUF files, card, settings and loss curve to a folder, S3
(moto) or the Hub."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tinyllm.common import UserError, sha256_file
from tinyllm.outputs import publishing, report
from tinyllm.store import remote_store


def fake_run(folder: Path, status: str = "COMPLETE") -> Path:
    """The files of a run folder that publish reads (no training needed to test the upload)."""
    model = folder / "model"
    model.mkdir(parents=True)
    for name, content in {
        "config.json": b'{"model_type": "qwen3"}',
        "model.safetensors": bytes(range(256)) * 40,
        "tokenizer.json": b"{}",
        "README.md": b"# run\n\n- Test loss: 1.2345\n",
    }.items():
        (model / name).write_bytes(content)
    (folder / "model-q8_0.gguf").write_bytes(b"GGUF" + bytes(5000))
    (folder / "training_settings.json").write_text('{"run_id": "abc"}')
    (folder / "loss_curve.png").write_bytes(b"\x89PNG" + bytes(100))
    (folder / "run_status.json").write_text(json.dumps({"status": status}))
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "step-00000004.pt").write_bytes(b"not published")
    return folder


EXPECTED = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "README.md",
    "model-q8_0.gguf",
    "training_settings.json",
    "loss_curve.png",
}


def test_the_layout_is_the_model_folder_at_the_root_plus_gguf_settings_and_curve(tmp_path):
    run = fake_run(tmp_path / "run")
    layout = publishing.publish_layout(run)
    assert set(layout) == EXPECTED
    assert layout["README.md"] == run / "model" / "README.md"  # the model card is the repository's README
    with pytest.raises(UserError, match="has no exported model"):
        publishing.publish_layout(tmp_path / "empty")


def test_publish_to_a_folder_is_verified_and_complete(tmp_path, capsys):
    run = fake_run(tmp_path / "run", status="CHECKPOINTED_NEEDS_RESUME")
    assert report.main(["publish", str(run), str(tmp_path / "published")]) == 0
    published = {
        p.relative_to(tmp_path / "published").as_posix(): sha256_file(p)
        for p in (tmp_path / "published").rglob("*")
        if p.is_file()
    }
    assert published == {name: sha256_file(path) for name, path in publishing.publish_layout(run).items()}
    captured = capsys.readouterr()
    assert "published 7 files" in captured.out and "not COMPLETE" in captured.err


def test_publish_to_s3_and_a_corrupted_upload_is_refused(s3_url, tmp_path, monkeypatch):  # noqa: F811
    run = fake_run(tmp_path / "run")
    url = s3_url.replace("/runs/tiny", "/models/tiny")
    publishing.publish(run, url)
    fs, root = remote_store.open_remote(url)
    assert {path.rsplit("/", 1)[-1] for path in fs.find(root)} == EXPECTED
    assert fs.cat_file(f"{root}/model.safetensors") == (run / "model" / "model.safetensors").read_bytes()

    real_put = type(fs).put_file

    def corrupting_put(self, local, remote, **kwargs):
        real_put(self, local, remote, **kwargs)
        if "model.safetensors" in remote:
            self.pipe_file(remote, b"bit rot")

    monkeypatch.setattr(type(fs), "put_file", corrupting_put)
    with pytest.raises(UserError, match="model.safetensors differs"):
        publishing.publish(run, s3_url.replace("/runs/tiny", "/models/again"))


class FakeHub:
    """HfApi at its boundary: create_repo, create_commit, get_paths_info; files kept as the Hub keeps them
    (LFS with the sha256 for binaries, git blobs for the rest)."""

    def __init__(self, corrupt: str | None = None):
        self.repos, self.files, self.commits, self.corrupt = {}, {}, [], corrupt

    def create_repo(self, repo_id, repo_type=None, private=None, exist_ok=False):
        assert repo_type == "model"
        self.repos.setdefault(repo_id, {"private": private})

    def create_commit(self, repo_id, operations, commit_message="", repo_type=None):
        assert repo_id in self.repos
        self.commits.append([op.path_in_repo for op in operations])
        for op in operations:
            content = Path(op.path_or_fileobj).read_bytes()
            self.files[(repo_id, op.path_in_repo)] = b"x" + content if op.path_in_repo == self.corrupt else content

    def get_paths_info(self, repo_id, paths, repo_type=None):
        found = []
        for path in paths:
            content = self.files.get((repo_id, path))
            if content is None:
                continue
            lfs = (
                SimpleNamespace(sha256=hashlib.sha256(content).hexdigest())
                if path.endswith((".safetensors", ".gguf", ".png"))
                else None
            )
            blob = hashlib.sha1(f"blob {len(content)}\0".encode() + content).hexdigest()
            found.append(SimpleNamespace(path=path, size=len(content), lfs=lfs, blob_id=blob))
        return found


def test_publish_to_the_hub_is_one_commit_to_a_private_repo_then_verified(tmp_path):
    run = fake_run(tmp_path / "run")
    hub = FakeHub()
    assert publishing.publish(run, "hf://someone/tiny-model", api=hub) == "https://huggingface.co/someone/tiny-model"
    assert hub.repos == {"someone/tiny-model": {"private": True}}
    assert len(hub.commits) == 1 and set(hub.commits[0]) == EXPECTED
    publishing.publish(run, "hf://someone/public-one/v1", public=True, api=hub)
    assert hub.repos["someone/public-one"] == {"private": False}
    assert set(hub.commits[1]) == {f"v1/{name}" for name in EXPECTED}


@pytest.mark.parametrize("corrupt", ["model.safetensors", "config.json"])  # an LFS file, a git blob
def test_a_hub_copy_that_differs_is_an_error(tmp_path, corrupt):
    run = fake_run(tmp_path / "run")
    with pytest.raises(UserError, match=f"hf://someone/m of {corrupt} differs"):
        publishing.publish(run, "hf://someone/m", api=FakeHub(corrupt=corrupt))


def test_hub_errors_never_show_the_token(tmp_path, monkeypatch):
    run = fake_run(tmp_path / "run")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value")

    class Refusing(FakeHub):
        def create_repo(self, *args, **kwargs):
            raise PermissionError("401 Unauthorized for url https://huggingface.co/api/repos/create")

    with pytest.raises(UserError) as caught:
        publishing.publish(run, "hf://someone/m", api=Refusing())
    assert "401" in str(caught.value) and "hf_secret" not in str(caught.value)
    with pytest.raises(UserError, match="is not hf://USER/REPO"):
        publishing.publish(run, "hf://only-a-user", api=FakeHub())
