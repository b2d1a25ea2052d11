#!/usr/bin/env bash
# Mutation testing of tinyllm's core rules with mutmut 3 (configured in pyproject.toml, [tool.mutmut]).
#
#   bash bench/mutation.sh                        # the whole core, one worker: 5-10 min on 2 busy cores
#   bash bench/mutation.sh "tinyllm.training.train_data.x_mix64__*"     # only the mutants named (fnmatch patterns)
#   PYTHON=.venv/bin/python JOBS=2 bash bench/mutation.sh
#
# mutmut copies the sources to mutants/, makes every mutant of the files listed in pyproject.toml
# (~2 min) and runs, for each mutant of the functions below, only the tests of tests/test_core.py,
# tests/test_store.py and tests/test_loss.py
# that call that function, each mutant forked from one warm process (torch is imported once).
# OpenMP runs single-threaded: torch's thread pool does not survive a fork while in use (mutants
# that make a test fail inside torch would hang until their timeout). It prints the score over
# these functions and every surviving mutant; `mutmut show NAME` shows a mutant's diff.
# bench/RESULTS.md ("Mutation testing") records the score and why each survivor is accepted.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}

CORE=(
  # data.py and corpus_format.py: splits, document hashing, sharding into hashed shards, corpus record verification
  "tinyllm.data.build.x_split_of__*" "tinyllm.data.build.x_document_hash__*"
  "tinyllm.data.corpus_format.x_token_dtype__*" "tinyllm.data.corpus_format.x_shard_name__*"
  "tinyllm.data.build.xǁShardWriterǁ*" "tinyllm.data.build.x_batches__*"
  "tinyllm.data.corpus_format.x_verify_files__*" "tinyllm.data.build.x_check_settings__*"
  # train_data.py: the data order; the loss, gradient clipping (optimization.py), loading a checkpoint, the settings check
  "tinyllm.training.train_data.x_mix64__*" "tinyllm.training.train_data.xǁBlockPermutationǁ*"
  "tinyllm.training.train_data.xǁBlockSamplerǁ*"
  "tinyllm.model.losses.x_language_model_loss__*" "tinyllm.model.losses.xǁLanguageModelLossǁforward__*"
  "tinyllm.training.optimization.x_clip_gradients__*"
  "tinyllm.store.checkpoint_store.x_load_checkpoint_file__*" "tinyllm.store.checkpoint_store.x_settings_changes__*"
  # checkpoint_store.py: names, records, listings, the resume, timeline, retention and mirror plans, the run
  # status (not its I/O glue moved in from train.py, the writer thread, the lock and the checkpoint readers:
  # tests/test_train.py and tests/test_checkpoints.py cover those, too slow to run per mutant)
  "tinyllm.store.checkpoint_store.x_checkpoint_name__*" "tinyllm.store.checkpoint_store.x_step_of__*"
  "tinyllm.store.checkpoint_store.x_record_name__*"
  "tinyllm.store.checkpoint_store.x_size_text__*" "tinyllm.store.checkpoint_store.xǁRecordǁ*"
  "tinyllm.store.checkpoint_store.x_read_record__*"
  "tinyllm.store.checkpoint_store.x_write_record__*" "tinyllm.store.checkpoint_store.xǁListingǁ*"
  "tinyllm.store.checkpoint_store.xǁNamesǁ*"
  "tinyllm.store.checkpoint_store.x_sort_names__*" "tinyllm.store.checkpoint_store.x_list_folder__*"
  "tinyllm.store.checkpoint_store.xǁResumePlanǁ*"
  "tinyllm.store.checkpoint_store.x_plan_resume__*" "tinyllm.store.checkpoint_store.xǁTimelinePlanǁ*"
  "tinyllm.store.checkpoint_store.x_plan_timeline__*"
  "tinyllm.store.checkpoint_store.x_newest_verified__*" "tinyllm.store.checkpoint_store.x_file_mismatch__*"
  "tinyllm.store.checkpoint_store.x_retention_deletions__*" "tinyllm.store.checkpoint_store.x_beyond_unbacked_bound__*"
  "tinyllm.store.checkpoint_store.xǁMirrorPolicyǁ*" "tinyllm.store.checkpoint_store.xǁMirrorPlanǁ*"
  "tinyllm.store.checkpoint_store.x_backed_up__*"
  "tinyllm.store.checkpoint_store.x_plan_mirror__*" "tinyllm.store.checkpoint_store.x_restore_order__*"
  "tinyllm.store.checkpoint_store.x_set_aside__*"
  "tinyllm.store.checkpoint_store.x_delete__*" "tinyllm.store.checkpoint_store.x_apply_plan__*"
  "tinyllm.store.checkpoint_store.x_apply_timeline__*"
  "tinyllm.store.checkpoint_store.x_write_status__*" "tinyllm.store.checkpoint_store.xǁRunStatusǁ*"
  "tinyllm.store.checkpoint_store.x_previous_session_note__*"
  "tinyllm.store.checkpoint_store.x_settings_changes__*" "tinyllm.store.checkpoint_store.x_describe_changes__*"
  "tinyllm.store.checkpoint_store.xǁResumeVerdictǁ*" "tinyllm.store.checkpoint_store.x_resume_verdict__*"
  "tinyllm.store.checkpoint_store.x_load_checkpoint_file__*" "tinyllm.store.checkpoint_store.x_tensor_differences__*"
  "tinyllm.store.checkpoint_store.xǁCheckpointWriteFailedǁ*"
  "tinyllm.store.checkpoint_store.xǁCheckpointerǁapply_retention__*"
  # checkpoint_cloud.py: the bound on checkpoints waiting for their upload
  "tinyllm.store.checkpoint_cloud.x_beyond_unbacked_bound__*"
  # evaluation.py: exact-match answer scoring
  "tinyllm.outputs.evaluation.x_extract_final_answer__*" "tinyllm.outputs.evaluation.x_score_answers__*"
  # evaluation.py and callbacks.py: the in-loop --eval-tasks encoding and scoring (lm-eval's rules), and the
  # evaluations' cadence
  "tinyllm.outputs.evaluation.x_encode_pair__*" "tinyllm.outputs.evaluation.x_choice_rows__*"
  "tinyllm.outputs.evaluation.x_choice_counts__*"
  "tinyllm.outputs.evaluation.x_loop_scores__*" "tinyllm.outputs.callbacks.x_due__*"
  "tinyllm.outputs.evaluation.x_default_tasks_every__*"
  # export_gguf.py: GGUF metadata
  "tinyllm.outputs.export_gguf.x_add_metadata__*" "tinyllm.outputs.export_gguf.x_model_name__*"
  "tinyllm.outputs.export_gguf.x_is_sha256__*"
  "tinyllm.outputs.export_gguf.x_ggml_type_for__*"
)
if [ $# -gt 0 ]; then CORE=("$@"); fi

rm -rf mutants  # a fresh run: no verdict cached from other sources or tests
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 "$PYTHON" -m mutmut run --max-children "${JOBS:-1}" "${CORE[@]}" > mutants-run.log 2>&1 || {
  tail -40 mutants-run.log; exit 1; }
mv mutants-run.log mutants/run.log
"$PYTHON" -m mutmut results --all true > mutants/results.txt
"$PYTHON" - "${CORE[@]}" <<'PY'
import fnmatch
import sys
from collections import Counter

patterns = sys.argv[1:]
verdicts = {}
for line in open("mutants/results.txt", encoding="utf-8"):
    name, _, verdict = line.strip().rpartition(": ")
    if name and any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
        verdicts[name] = verdict
counts = Counter(verdicts.values())
tested = sum(count for verdict, count in counts.items() if verdict not in ("skipped", "not checked"))
caught = counts["killed"] + counts["timeout"]
print(f"mutants: {len(verdicts)}  " + "  ".join(f"{verdict}: {count}" for verdict, count in sorted(counts.items())))
print(f"mutation score: {caught}/{tested} = {100 * caught / max(tested, 1):.1f}%")
for name, verdict in sorted(verdicts.items()):
    if verdict not in ("killed", "timeout"):
        print(f"  {verdict}: {name}")
PY
