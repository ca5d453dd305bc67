"""lm-evaluation-harness's `local-completions` against a kvgate worker serving the
`llama-f32-v5` reference fixture, on a multiple-choice task built here from the fixture's
`lm_eval.json` (no downloads). Log-likelihood requests use token-id prompts (its `remote`
tokenizer calls the worker's /tokenize), `echo` and `logprobs`. Run by worker/tests/clients.rs:
    python lm_eval_check.py FIXTURE_DIR BASE_URL WORK_DIR
It checks every choice's loglikelihood against the one transformers computed, and the task's
accuracy against the accuracy those reference numbers give; prints the accuracy."""

import json
import os
import sys

fixture, base_url, work = sys.argv[1:4]
os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=os.path.join(work, "hf"), TOKENIZERS_PARALLELISM="false")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

docs = json.load(open(os.path.join(fixture, "lm_eval.json")))
data = os.path.join(work, "docs.jsonl")
with open(data, "w") as f:
    for d in docs:
        f.write(json.dumps(d) + "\n")
with open(os.path.join(work, "kvgate_reference.yaml"), "w") as f:
    f.write(f"""task: kvgate_reference
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: " "
metric_list:
  - metric: acc
""")

out = lm_eval.simple_evaluate(
    model="local-completions",
    model_args=f"model=llama-f32-v5,base_url={base_url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,max_retries=1",
    tasks=["kvgate_reference"],
    task_manager=TaskManager(include_path=work),
    log_samples=True,
)
acc = out["results"]["kvgate_reference"]["acc,none"]
samples = sorted(out["samples"]["kvgate_reference"], key=lambda s: s["doc_id"])
failures = []
for s in samples:
    want = docs[s["doc_id"]]["reference_loglikelihoods"]
    got = [r[0][0] for r in s["resps"]]
    if any(abs(g - w) > 1e-3 for g, w in zip(got, want)) or len(got) != len(want):
        failures.append(f"doc {s['doc_id']}: {got} vs transformers {want}")
reference_acc = sum(max(range(3), key=lambda i: d["reference_loglikelihoods"][i]) == d["gold"] for d in docs) / len(docs)
if failures:
    sys.exit("loglikelihoods differ from transformers':\n" + "\n".join(failures))
if abs(acc - reference_acc) > 1e-9:
    sys.exit(f"accuracy {acc} != {reference_acc} from the reference loglikelihoods")
print(json.dumps({"acc": acc, "reference_acc": reference_acc, "docs": len(samples)}))
