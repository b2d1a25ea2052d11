"""Weighted mixtures: the parse rules, the sampler's closed forms, and training runs that resume bit for bit."""

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from tiny_runs import final_state, options, run_cli, train_losses, write_tiny_corpus

from tinyllm.common import UserError
from tinyllm.data import build as data
from tinyllm.data import corpus_format
from tinyllm.outputs import export_hf
from tinyllm.store import checkpoint_store as store
from tinyllm.training import distributed, train, train_data

CPU = distributed.DistInfo(rank=0, local_rank=0, world=1, device=torch.device("cpu"))

# ----------------------------------------------------------------------------------------------
# Parsing --data mixtures and --mixture-schedule.


def test_a_plain_corpus_is_no_mixture_and_sources_parse_with_labels_and_urls():
    assert train_data.parse_mixture(["corpus/web"]) is None
    assert train_data.parse_mixture(["s3://bucket/year=2024/corpus"]) is None  # '=' inside a path is no source name
    mixture = train_data.parse_mixture(["web=corpus/web:0.8", "chat=s3://b/chat#support:0.2"], "decay:web=0.3,chat=0.7")
    assert mixture.sources == (
        train_data.MixtureSource("web", "corpus/web", None),
        train_data.MixtureSource("chat", "s3://b/chat", "support"),
    )
    assert [(phase.start, phase.weights) for phase in mixture.phases] == [("0", (0.8, 0.2)), ("decay", (0.3, 0.7))]
    later = train_data.parse_mixture(["a=x:1", "b=y:1"], "100:a=1; 200:b=2")
    assert [(phase.start, phase.weights) for phase in later.phases] == [("0", (1, 1)), ("100", (1, 0)), ("200", (0, 2))]


@pytest.mark.parametrize(
    "specs, schedule, message",
    [
        (["web=corpus/web"], None, "NAME=CORPUS:WEIGHT"),
        (["web=corpus/web:x"], None, "not a number"),
        (["web=corpus/web:-1"], None, "not a number >= 0"),
        (["web=a:1", "corpus/b"], None, "each is a mixture source"),
        (["web=a:1", "web=b:1"], None, "must differ"),
        (["web=a:0", "chat=b:0"], None, "sum to 0"),
        (["corpus/web"], "decay:web=1", "needs a mixture"),
        (["web=a:1"], "decay:chat=1", "'chat' is not a source"),
        (["web=a:1"], "soon:web=1", "START a step number"),
        (["web=a:1"], "0:web=1", "START a step number"),
        (["web=a:1"], "10:web=0", "sum to 0"),
    ],
)
def test_bad_mixtures_are_one_clear_error(specs, schedule, message):
    with pytest.raises(UserError, match=message):
        train_data.parse_mixture(specs, schedule)


def test_phase_steps_resolve_decay_and_must_increase():
    mixture = train_data.parse_mixture(["a=x:1", "b=y:1"], "decay:a=1")
    assert train_data.phase_steps(mixture, decay_start=90) == [0, 90]
    with pytest.raises(UserError, match="needs --schedule wsd"):
        train_data.phase_steps(mixture, decay_start=None)
    with pytest.raises(UserError, match="increasing steps"):
        train_data.phase_steps(train_data.parse_mixture(["a=x:1"], "100:a=1;decay:a=2"), decay_start=50)


@pytest.mark.parametrize(
    "schedule, total_steps, warned",
    [
        ("100:a=1", 101, None),  # its phase trains step 100, the last
        ("100:a=1", 100, "100"),  # the run ends at step 99: never reached
        ("100:a=1;200:b=1", 150, "200"),
        ("100:a=1;200:b=1", 5, "100, 200"),
    ],
)
def test_a_phase_the_run_never_reaches_is_warned(schedule, total_steps, warned):
    mixture = train_data.parse_mixture(["a=x:1", "b=y:1"], schedule)
    message = train_data.unreached_phases(mixture, train_data.phase_steps(mixture, None), total_steps)
    assert message == (
        None
        if warned is None
        else f"--mixture-schedule: the phase(s) starting at step {warned} come after the run's last step "
        f"({total_steps - 1}): never trained in this run"
    )


# ----------------------------------------------------------------------------------------------
# The sampler: closed-form apportionment, per-source bijections, seeks.


@pytest.mark.parametrize(
    "weights, expected",
    [
        ((0.8, 0.2), (4, 1)),
        ((0.5, 0.5), (1, 1)),
        ((3, 1, 0), (3, 1, 0)),
        ((0.1, 0.25), (2, 5)),
        ((1 / 3, 2 / 3), (1, 2)),
    ],
)
def test_integer_weights_keep_the_exact_ratio(weights, expected):
    assert train_data.integer_weights(weights) == expected


@pytest.mark.parametrize("weights", [(4, 1), (1, 1), (2, 5), (3, 1, 0), (1, 2, 3, 7), (1, 999), (333, 1)])
def test_apportion_in_closed_form_equals_taking_samples_one_by_one(weights):
    counts = [0] * len(weights)
    for count in range(2000):
        assert train_data.apportion(weights, count) == counts
        counts[train_data.next_source(weights, counts)] += 1
        if len(weights) == 2:  # Sainte-Lague stays within one sample of the quota at every prefix
            assert all(abs(c - (count + 1) * w / sum(weights)) < 1 for c, w in zip(counts, weights))
    far = train_data.apportion(weights, 10**15 + 3)
    assert sum(far) == 10**15 + 3 and all(
        abs(c - (10**15 + 3) * w / sum(weights)) < len(weights) for c, w in zip(far, weights)
    )


def sampler(blocks=(100, 10), phases=((0.5, 0.5),), starts=(0,), seed=5, batch=2, accum=2, world=2):
    return train_data.MixtureSampler(
        ["big", "small"][: len(blocks)], list(blocks), list(phases), list(starts), seed, batch, accum, world
    )


def test_half_and_half_over_sources_of_ten_to_one_reads_each_half_to_one_percent():
    mixed = sampler(blocks=(1000, 100))
    pairs = [pair for step in range(250) for pair in mixed.step_blocks(step)]  # 2000 samples, 10 small epochs
    shares = Counter(source for source, _ in pairs)
    assert abs(shares[0] / len(pairs) - 0.5) < 0.01 and abs(shares[1] / len(pairs) - 0.5) < 0.01
    assert mixed.source_counts(len(pairs)) == [shares[0], shares[1]] == [1000, 1000]


def test_every_source_epoch_is_a_bijection_of_its_blocks():
    mixed = sampler(blocks=(37, 7), phases=((3, 1),))
    pairs = [pair for step in range(40) for pair in mixed.step_blocks(step)]
    for source, blocks in enumerate((37, 7)):
        order = [block for s, block in pairs if s == source]
        epochs = [order[start : start + blocks] for start in range(0, len(order) - blocks + 1, blocks)]
        assert len(epochs) >= 3 and all(sorted(epoch) == list(range(blocks)) for epoch in epochs)
        assert epochs[0] != epochs[1]  # a new order each epoch


def test_a_seek_equals_reading_from_the_start_and_any_split_of_the_batch_reads_the_same():
    phases, starts = ((0.5, 0.5), (0.1, 0.9), (1, 0)), (0, 7, 20)
    mixed = sampler(blocks=(50, 9), phases=phases, starts=starts)
    walked = [mixed.step_blocks(step) for step in range(30)]
    for step in (0, 6, 7, 19, 20, 29):
        assert sampler(blocks=(50, 9), phases=phases, starts=starts).step_blocks(step) == walked[step]
    for world, accum, batch in ((1, 4, 2), (4, 1, 2), (2, 4, 1)):
        other = sampler(blocks=(50, 9), phases=phases, starts=starts, world=world, accum=accum, batch=batch)
        for step in (0, 7, 21):
            read = [pair for rank in range(world) for micro in other.micro_batches(step, rank) for pair in micro]
            assert sorted(read) == sorted(walked[step])
    # the counters across phase changes are a function of the step: 7 steps of 4 at 1:1, 13 at 1:9, then only big
    assert mixed.source_counts(20 * 8) == [28 + 10, 28 + 94]
    assert all(source == 0 for source, _ in walked[25])


def test_an_extension_that_moves_the_decay_phase_keeps_every_step_before_it():
    phases = ((0.5, 0.5), (0.2, 0.8))
    first, extended = sampler(phases=phases, starts=(0, 9)), sampler(phases=phases, starts=(0, 15))
    assert [first.step_blocks(step) for step in range(9)] == [extended.step_blocks(step) for step in range(9)]
    assert first.step_blocks(9) != extended.step_blocks(9)


def test_a_seek_far_into_a_long_run_is_immediate():
    mixed = sampler(blocks=(10**9, 10**6), phases=((0.7, 0.3), (0.2, 0.8)), starts=(0, 10**9))
    pairs = mixed.step_blocks(10**12)
    assert len(pairs) == 8 and all(0 <= block < (10**9, 10**6)[source] for source, block in pairs)
    assert sum(mixed.source_counts(10**13)) == 10**13


def test_a_weighted_source_without_blocks_is_refused():
    with pytest.raises(UserError, match="mixture source small has fewer train tokens than one block"):
        sampler(blocks=(10, 0))
    assert sampler(blocks=(10, 0), phases=((1, 0),)).step_blocks(3)[0][0] == 0  # weight 0: never read


def test_the_cursor_refuses_another_mixture():
    with pytest.raises(UserError, match="mixture sources"):
        sampler(blocks=(100, 10)).load_state_dict(sampler(blocks=(10, 100)).state_dict())  # the same total


CHAT = {"prompt": 30, "assistant": 20, "text": 0}
TEXT = {"prompt": 0, "assistant": 0, "text": 50}
BOTH = {"prompt": 30, "assistant": 20, "text": 50}


@pytest.mark.parametrize(
    "loss_on, text_loss, sources, resolved",
    [
        ("all", None, {"web": TEXT}, None),
        ("assistant", None, {"chat": CHAT}, "none"),
        ("assistant", "full", {"chat": CHAT}, "full"),
        ("assistant", "none", {"mixed": BOTH}, "none"),
        ("assistant", "full", {"web": TEXT, "chat": CHAT}, "full"),  # a text source first: its text counts
        ("assistant", "full", {"chat": CHAT, "web": TEXT}, "full"),
        ("assistant", None, {"web": TEXT}, "has no assistant tokens"),
        ("assistant", "full", {"web": TEXT, "web2": TEXT}, "web or web2 has no assistant tokens"),
        ("assistant", None, {"mixed": BOTH}, "mixed also has 50 tokens of plain-text"),
        ("assistant", None, {"chat": CHAT, "web": TEXT}, "web also has 50 tokens of plain-text"),
        ("assistant", "none", {"chat": CHAT, "web": TEXT}, "of web has no assistant tokens and its plain text"),
        ("assistant", "full", {"chat": CHAT, "empty": {}}, "of empty has no assistant tokens, so it would be"),
    ],
)
def test_text_loss_resolves_over_every_source_and_each_must_count_tokens(loss_on, text_loss, sources, resolved):
    if resolved in (None, "none", "full"):
        assert train_data.resolve_text_loss(loss_on, text_loss, sources) == resolved
    else:
        with pytest.raises(UserError, match=resolved):
            train_data.resolve_text_loss(loss_on, text_loss, sources)


# ----------------------------------------------------------------------------------------------
# Training on a mixture.


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mixture")
    big = write_tiny_corpus(root / "big")
    small = write_tiny_corpus(
        root / "small", documents=120, words="zebra quantum piano violet ocean lamp".split(), tokenizer_from=big
    )
    return big, small


def mixture_options(corpora, out: Path, *extra: str, weights=(0.5, 0.5)) -> list[str]:
    big, small = corpora
    args = options(
        big,
        out,
        "--schedule",
        "wsd",
        "--decay-fraction",
        "0.25",
        "--mixture-schedule",
        "decay:big=0.2,small=0.8",
        *extra,
    )
    at = args.index("--data")
    args[at + 1 : at + 2] = [f"big={big}:{weights[0]}", f"small={small}:{weights[1]}"]
    return args


@pytest.fixture(scope="module")
def mixed_reference(corpora, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixed")
    assert train.main(mixture_options(corpora, out)) == 0
    return out


def test_a_mixture_run_records_it_and_logs_tokens_epochs_and_losses_per_source(mixed_reference):
    settings = json.loads((mixed_reference / "training_settings.json").read_text())
    mixture = settings["training"]["mixture"]
    assert [source["name"] for source in mixture["sources"]] == ["big", "small"]
    assert mixture["phases"] == [
        {"start": "0", "weights": {"big": 0.5, "small": 0.5}},
        {"start": "decay", "weights": {"big": 0.2, "small": 0.8}},
    ]
    assert settings["runtime"]["mixture_phase_steps"] == [0, 9]  # 12 steps, the last 3 decay
    records = [json.loads(line) for line in (mixed_reference / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "train"][-1]
    # 9 steps of 4 blocks at 1:1, 3 steps at 1:4 -> 18 + 2 and 18 + 10 blocks of 32 tokens
    assert (last["tokens/big"], last["tokens/small"]) == (20 * 32, 28 * 32)
    assert last["epochs/small"] == pytest.approx(28 / mixture["sources"][1]["train_blocks"])
    evals = [r for r in records if r["kind"] == "eval"]
    assert all(r["val_loss/big"] > 0 and r["val_loss/small"] > 0 for r in evals)
    assert all(
        min(r["val_loss/big"], r["val_loss/small"]) <= r["val_loss"] <= max(r["val_loss/big"], r["val_loss/small"])
        for r in evals
    )


def test_a_mixture_stop_then_resume_is_bitwise_identical_across_the_phase_change(corpora, mixed_reference, tmp_path):
    out = tmp_path / "run"
    assert train.main(mixture_options(corpora, out, "--stop-after-steps", "7")) == 0  # before the decay phase
    result = run_cli(mixture_options(corpora, out, "--resume", "auto"))
    assert "resumed from" in result.stdout and "from step 9 (decay): big 0.2, small 0.8" in result.stdout
    reference, resumed = final_state(mixed_reference), final_state(out)
    assert store.tensor_differences(resumed["model"], reference["model"], "model") == []
    assert resumed["sampler"] == reference["sampler"]
    assert train_losses(out) == train_losses(mixed_reference)


def test_resuming_with_other_weights_is_refused(corpora, mixed_reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(mixed_reference, out)
    result = run_cli(mixture_options(corpora, out, "--resume", "auto", weights=(0.7, 0.3)), check=False)
    assert result.returncode != 0 and "settings differ" in result.stderr and "mixture" in result.stderr
    error = result.stderr.strip().splitlines()[-1]  # each changed weight by name, not the mixture's raw dict
    assert "mixture.phases[0].weights.big: " in error and "{" not in error and "'" not in error, error


def test_sources_with_other_tokenizers_are_refused(corpora, tmp_path):
    other = write_tiny_corpus(tmp_path / "other", documents=90, words="alpha beta gamma".split())
    args = mixture_options((corpora[0], other), tmp_path / "run")
    with pytest.raises(UserError, match="a mixture needs one tokenizer"):
        train.main(args)


@pytest.mark.slow
def test_world_size_2_mixture_resume_is_bitwise_identical_to_itself_and_close_to_world_1(
    corpora, mixed_reference, tmp_path
):
    full, split = tmp_path / "full", tmp_path / "split"
    run_cli(mixture_options(corpora, full, "--batch-size", "1"), world=2)
    run_cli(mixture_options(corpora, split, "--batch-size", "1", "--stop-after-steps", "10"), world=2)
    run_cli(mixture_options(corpora, split, "--batch-size", "1", "--resume", "auto"), world=2)
    assert store.tensor_differences(final_state(split)["model"], final_state(full)["model"], "model") == []
    assert train_losses(split) == train_losses(full)
    assert final_state(full)["sampler"] == final_state(mixed_reference)["sampler"]
    reference, two = train_losses(mixed_reference), train_losses(full)
    assert two[12] == pytest.approx(reference[12], rel=1e-4)  # the same samples per step as world size 1


# ----------------------------------------------------------------------------------------------
# Source labels in data.py: one corpus, its sources kept apart.


def test_input_labels_come_from_a_name_prefix_or_the_stem(tmp_path):
    assert data.input_label("web=crawl/part-1.jsonl.gz", label_by_stem=False) == ("web", "crawl/part-1.jsonl.gz")
    assert data.input_label("docs/kjv.jsonl", label_by_stem=False) == (None, "docs/kjv.jsonl")
    assert data.input_label("docs/kjv.jsonl", label_by_stem=True) == ("kjv", "docs/kjv.jsonl")
    assert data.input_label("hf:roneneldan/TinyStories", label_by_stem=True) == (
        "TinyStories",
        "hf:roneneldan/TinyStories",
    )
    existing = tmp_path / "year=2024.jsonl"
    existing.write_text('{"text": "a document"}\n')
    assert data.input_label(str(existing), label_by_stem=False) == (None, str(existing))  # a path, not a label
    (tmp_path / "b.jsonl").write_text('{"text": "another document"}\n')
    with pytest.raises(UserError, match="every input needs one"):
        data.resolve_inputs([f"web={existing}", str(tmp_path / "b.jsonl")])


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("labelled")
    shared = "one document that both sources hold, word for word"
    web = write_jsonl(
        root / "web.jsonl", [f"web page {i}: the cat sees a red bird by the river" for i in range(300)] + [shared]
    )
    chat = write_jsonl(
        root / "chat.jsonl", [f"chat {i}: zebra quantum piano violet ocean lamp" for i in range(60)] + [shared, shared]
    )  # the second copy is a duplicate within chat
    assert (
        data.main(
            [
                "--data",
                str(web),
                f"support={chat}",
                "--source-label",
                "stem",
                "--out",
                str(root / "corpus"),
                "--vocab-size",
                "300",
                "--val-fraction",
                "0.1",
                "--test-fraction",
                "0.1",
                "--shard-tokens",
                "2000",
                "--no-progress",
            ]
        )
        == 0
    )
    return root / "corpus"


def test_a_labelled_corpus_keeps_each_source_apart_and_reports_duplicates_across_them(labelled):
    manifest = corpus_format.load_manifest(labelled)
    for split, entry in manifest.splits.items():
        parts = entry["sources"]
        assert list(parts) == ["web", "support"]
        assert entry["tokens"] == sum(part["tokens"] for part in parts.values())
        assert entry["documents"] == sum(part["documents"] for part in parts.values())
        assert entry["files"] == parts["web"]["files"] + parts["support"]["files"]
        assert all(
            item["name"].startswith(f"{split}-{label}-") for label, part in parts.items() for item in part["files"]
        )
    assert corpus_format.verify_corpus(labelled) == []
    inputs = json.loads((labelled / corpus_format.SOURCE_MANIFEST).read_text())
    web, chat = inputs["inputs"]
    assert (web["label"], chat["label"]) == ("web", "support")
    assert (web["documents_kept"], chat["documents_kept"]) == (301, 61)  # the shared one in both
    assert chat["dropped"] == {"duplicate": 1} and chat["also_in"] == {"web": 1}
    assert inputs["totals"]["cross_source_duplicates"] == {"web~support": 1}
    assert "web and support: 1" in (labelled / corpus_format.DATA_CARD).read_text()
    for label, part in manifest.splits["train"]["sources"].items():
        assert manifest.mask_tokens("train", label) == part["mask_tokens"] != manifest.mask_tokens("train")
    support = train_data.TokenSplit(labelled, manifest, "train", 16, source="support")
    assert support.tokens == manifest.splits["train"]["sources"]["support"]["tokens"]
    assert train_data.TokenSplit(labelled, manifest, "train", 16).tokens == manifest.splits["train"]["tokens"]


def test_a_corpus_without_labels_has_no_sources_entry(corpora):
    assert all("sources" not in entry for entry in corpus_format.load_manifest(corpora[0]).splits.values())


def test_a_mixture_reads_the_labelled_sources_of_one_corpus(labelled, tmp_path):
    args = options(labelled, tmp_path / "run")
    at = args.index("--data")
    args[at + 1 : at + 2] = [f"web={labelled}#web:0.3", f"support={labelled}#support:0.7"]
    training = train.build_training(train.parse_args(args), CPU)
    manifest = corpus_format.load_manifest(labelled)
    assert training.data.sampler.source_blocks == [
        train_data.TokenSplit(labelled, manifest, "train", 32, source=label).blocks for label in ("web", "support")
    ]
    inputs = training.data.micro_batches(0, 0, CPU.device)[0].inputs
    assert inputs.shape == (2, 32)
    args[at + 2] = f"support={labelled}#chat:0.7"
    with pytest.raises(UserError, match="has no source labelled chat"):
        train.build_training(train.parse_args(args), CPU)


def test_the_model_card_names_the_mixture(mixed_reference):
    settings = json.loads((mixed_reference / "training_settings.json").read_text())
    lines = export_hf._mixture_lines(settings["training"]["mixture"])
    assert lines[0].startswith("- Mixture of sources: `big` corpus manifest sha256 ")
    assert lines[1] == "- Mixture weights: from the start: big 0.5, small 0.5; from the decay: big 0.2, small 0.8"
    assert export_hf._mixture_lines(None) == []
