"""Rewards: verifiers run in a pool of worker processes, each check under a timeout, every
failure counted by kind, and a call that fails too often stops the run.

    scorer = RewardScorer.from_config(cfg.reward)   # or RewardScorer("math", timeout_s=5.0, ...)
    rewards, info = scorer.score(completions, answers, records)
    # info: n, failed, timeouts, errors, seconds, budget_s, failures_by_kind {kind: count},
    #       first_failures ["record <id>: <kind>: <message>", ...], extras [{name: number}, ...]
    scorer.close()

Kinds (a "spec"; spec.py parses them, and names the config key in every error):
  "exact"          the synthetic tasks' verifier (verifiers.exact_match): stripped string equality of
                   the whole completion.
  "math"           math-verify equivalence of the completion's final answer with the gold answer:
                   the last \\boxed{...} if there is one, else the text after the last "####" (GSM8K
                   style), else whatever math-verify extracts. With a thinking template (Qwen3's
                   <think>...</think>) only the text after the last "</think>" is read; a "<think>"
                   never closed has no answer: reward 0.0, not a failure.
  "pkg.mod:fn"     a user function fn(completion_text: str, answer: str, record), imported by module
                   path in each worker (fresh process: it must be importable there);
  "path/to/r.py:fn"  the same, loaded from a file (verl's form); a relative path is made absolute
                   when the config is read. record is what the caller passed for that completion
                   (the trainer passes the data.PromptRecord; None if nothing was passed); records
                   must pickle. User code is imported only in the workers (never in the trainer's
                   process), each under the scorer's startup_timeout_s, and its signature is checked
                   there, so a reward that hangs or crashes at import, or cannot take the call, is a
                   one-line error naming its config key before the trainer's engine starts.
A user function returns a number (the reward) or a dict with a numeric "score" (the reward) and
extra numbers ({"score": 1.0, "acc": 1.0, "format": 0.5}): info["extras"][i] holds completion
i's extras, and metrics.reward_metrics_by_source turns them into "reward/<source>/<name>" means.
With batched=True (reward.batched) every user function is called once per score() call with all
of its completions: fn(completions: list[str], answers: list[str], records: list) -> a list of
one number or dict per completion (for rewards that call a service); built-in kinds never are.

Routing. by_source {data_source: spec} (reward.by_source) picks the spec of a completion by its
record's data_source (data.PromptRecord.data_source, or a dict's "data_source" key); `kind` scores
every other record. ONE pool serves all specs: every worker imports every spec's function at
start, and any worker takes the next check whatever its source. So the pool stays num_workers
processes (not one pool per kind), no worker idles while one source's checks queue, and a step
whose batch is all one source uses the whole pool; the price is each worker's start-up importing
all the functions (math's sympy included when any source uses "math").

Failures. A failed check gets reward 0.0 and is counted under one kind (FAILURE_KINDS):
  timeout       the check ran past its timeout: its worker is killed and replaced
  raised        the function raised (the message is the exception)
  non-numeric   it returned something that is not a real number (nor a dict): a string, even "1",
                is an error, not a reward (a verifier returning text is a bug to show, not to
                coerce); also a dict whose "score" is not a number
  non-finite    it returned NaN or +-inf, or a number float32 (the rewards' dtype from here on)
                cannot hold, such as 1e200: |x| > 3.4e38 (or a dict whose "score" is)
  bad-dict      it returned a dict without "score", or with an extra that is not a finite number
                (or not named by a non-empty string other than "mean")
  bad-batch     a batched function returned something other than a list of one result per
                completion: every completion of the batch fails with it (an element that is
                wrong fails on its own, under the kinds above)
  worker-died   the worker process exited during the check (os._exit, a segfault in a native
                parser, the OOM killer): it is replaced and the pool keeps working
  deadline      the call's time budget ran out before the check finished (or started)
info["failures_by_kind"] has a count for each kind that occurred, info["first_failures"] the first
five as "record <id>: <kind>: <message>" ("record <id> (<spec>): ..." when by_source routes records
to several functions). If more than max_error_frac of a call's checks failed,
score() raises RewardFailureError with the counts and those messages: a run must not train for
hours on rewards that are all zeros because the verifier is broken.

Bounding a whole call. timeout_s bounds one check, but a verifier that hangs on every input would
still cost timeout_s per completion (ceil(n / num_workers) rounds of it). So each score() call also
has one deadline across the pool: call_timeout_s if given, else
    2 * timeout_s + 4 * ceil(n / num_workers) * (mean time of the checks that returned so far)
i.e. room for one round of hung checks plus four times the pool's measured healthy workload (the
mean is over this scorer's life and updated as the call runs, so a slow but healthy verifier gets
its time; time in which no worker is ready, all of them starting, is not charged). When the
deadline passes, the checks still running are killed (their workers replaced) and the checks not
yet started are not run: all are counted as "deadline". A verifier that always hangs therefore
costs about 2 * timeout_s per call, not timeout_s * n / num_workers, and fails the call loudly
through max_error_frac.
A batched call of m completions runs in one worker under timeout_s * ceil(m / num_workers): the
time the pool would have for the same m checks one by one, ceil(m / num_workers) rounds of
timeout_s each. Batches are sent first, n above counts only the other completions, and the
batches' timeouts are added to the call's budget (with one worker they run one after another).

Why processes: math parsing (sympy) can hang or blow up on adversarial model output, and a user
function can crash its interpreter. Model-generated text is only ever parsed, never executed.

Start method: "forkserver" by default. The trainer process runs OpenMP/gloo/vLLM threads, and
fork()ing a multi-threaded process can leave a lock held forever in the child. "spawn" would also
be safe, but forkserver forks each worker from a small single-threaded server, so replacing a
killed worker costs a fork instead of a fresh interpreter. As with spawn, a script that builds a
scorer needs the `if __name__ == "__main__":` guard. This package imports nothing heavy at top
level so that workers start fast.

Signals. Stopping is the trainer's business: workers ignore SIGINT and SIGTERM, and so does the
forkserver (forkserver_signals.py), so a Ctrl-C or a SIGTERM to the whole process group (torchrun
stopping a rank signals its group) neither prints a traceback in a worker nor kills a check in
flight; the trainer finishes its step and closes the pool.
No worker outlives the trainer: an idle worker exits when its pipe to the trainer closes, and
every worker asks the kernel (PR_SET_PDEATHSIG) to be killed when its parent dies: the
forkserver, which exits when the trainer's end of its lifeline pipe closes (workers close the
copy of that end they inherit, or a hung worker would keep the forkserver alive and the
forkserver the worker). So a check hung even in native code does not survive a SIGKILL of the
trainer, and multiprocessing's resource tracker exits once they are all gone.

Shaping and metrics for the trainer: shaping.overlong_penalty (DAPO's soft overlong penalty),
metrics.reward_metrics_by_source.
"""

from megatron_dppo.rewards.extract import answer_after_thinking, gsm8k_final, last_boxed
from megatron_dppo.rewards.metrics import reward_metrics_by_source
from megatron_dppo.rewards.scorer import FAILURE_KINDS, RewardFailureError, RewardScorer
from megatron_dppo.rewards.shaping import overlong_penalty
from megatron_dppo.rewards.spec import absolute_spec, data_source_of, resolve_reward_fn
from megatron_dppo.rewards.verifiers import BUILTIN_KINDS, exact_reward, math_reward

__all__ = [
    "BUILTIN_KINDS",
    "FAILURE_KINDS",
    "RewardFailureError",
    "RewardScorer",
    "absolute_spec",
    "answer_after_thinking",
    "data_source_of",
    "exact_reward",
    "gsm8k_final",
    "last_boxed",
    "math_reward",
    "overlong_penalty",
    "resolve_reward_fn",
    "reward_metrics_by_source",
]
