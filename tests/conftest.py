import os

import pytest
import torch


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most 4 (each imports torch; the end-to-end tests start processes too)."""
    return min(4, os.cpu_count() or 1)


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """In-process train.py runs set --threads 1; every other test keeps the session's thread count."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(model, tokenizer): the tiny preset trained until it answers chats.CHATS and then says <|im_end|>; the
    module using it runs on one thread (a model this small is ~10x faster so on a busy machine)."""
    from chats import train_chat_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield train_chat_model(tmp_path_factory.mktemp("tokenizer"))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def patch_python_children(monkeypatch, tmp_path):
    """Run `code` at the start of every Python process the test starts (a sitecustomize.py on PYTHONPATH).

    For what runs in a child process, e.g. checkpoint_cloud.BackupProcess, where monkeypatch cannot reach.
    """
    import os
    from pathlib import Path

    def patch(code: str) -> None:
        folder = tmp_path / "sitecustomize"
        folder.mkdir(exist_ok=True)
        root = Path(__file__).resolve().parent.parent
        (folder / "sitecustomize.py").write_text(f"import sys\nsys.path.insert(0, {str(root)!r})\n{code}\n")
        paths = [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))

    return patch


@pytest.fixture
def flip_byte():
    """flip_byte(path, offset, mask=0x01): corrupt one byte of a file in place, keeping its size."""

    def flip(path, offset: int, mask: int = 0x01) -> None:
        raw = bytearray(path.read_bytes())
        raw[offset] ^= mask
        path.write_bytes(bytes(raw))

    return flip


@pytest.fixture(scope="module")
def moto_server():
    """moto's S3 server (tests/stores.py) for the module's tests; stopped and started again, it keeps its data."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    import logging

    from stores import MotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_url(moto_server, monkeypatch, tmp_path):
    """A fresh bucket on `moto_server`; credentials and endpoint only through the usual AWS variables."""
    import uuid

    from stores import ACCESS_KEY, SECRET_KEY

    from tinyllm.store import remote_store

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # fail fast while the server is down
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    bucket = f"bkt-{uuid.uuid4().hex[:10]}"
    fs, _ = remote_store.open_remote(f"s3://{bucket}")
    fs.mkdir(bucket)
    return f"s3://{bucket}/runs/tiny"


def pytest_report_header(config):
    """Which CPU kernels this run's half-precision results come from (they differ between CPUs)."""
    from pathlib import Path

    flags = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
    present = [flag for flag in wanted if flag in flags] or ["none of " + ", ".join(wanted)]
    return (
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"CPU features: {' '.join(present)}"
    )
