"""Rewards: verifiers run in a pool of worker processes, each check under a timeout, every
failure counted by kind, and a call that fails too often stops the run.

    scorer = RewardScorer("math", timeout_s=5.0, num_workers=4, max_error_frac=0.5)
    rewards, info = scorer.score(completions, answers, records)
    # info: n, failed, timeouts, errors, seconds, budget_s,
    #       failures_by_kind {kind: count}, first_failures ["record <id>: <kind>: <message>", ...]
    scorer.close()

Kinds:
  "exact"       the synthetic tasks' verifier (tasks.exact_match): stripped string equality.
  "math"        math-verify equivalence of the completion's final answer with the gold answer:
                the last \\boxed{...} if there is one, else the text after the last "####" (GSM8K
                style), else whatever math-verify extracts from the whole completion.
  "pkg.mod:fn"  a user function fn(completion_text: str, answer: str, record) -> float, where
                record is what the caller passed for that completion (the trainer passes the
                data.PromptRecord: id, prompt, messages, answer, extra; None if nothing was passed).
                It must be importable by module path in a fresh process, and records picklable.

Failures. A failed check gets reward 0.0 and is counted under one kind (FAILURE_KINDS):
  timeout       the check ran past timeout_s: its worker is killed and replaced
  raised        the function raised (the message is the exception)
  non-numeric   it returned something that is not a real number: a string, even "1", is an
                error, not a reward (a verifier returning text is a bug to show, not to coerce)
  non-finite    it returned NaN or +-inf
  worker-died   the worker process exited during the check (os._exit, a segfault in a native
                parser, the OOM killer): it is replaced and the pool keeps working
  deadline      the call's time budget ran out before the check finished (or started)
info["failures_by_kind"] has a count for each kind that occurred, info["first_failures"] the first
five as "record <id>: <kind>: <message>". If more than max_error_frac of a call's checks failed,
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

Why processes: math parsing (sympy) can hang or blow up on adversarial model output, and a user
function can crash its interpreter. Model-generated text is only ever parsed, never executed.

Start method: "forkserver" by default. The trainer process runs OpenMP/gloo/vLLM threads, and
fork()ing a multi-threaded process can leave a lock held forever in the child. "spawn" would also
be safe, but forkserver forks each worker from a small single-threaded server, so replacing a
killed worker costs a fork instead of a fresh interpreter. As with spawn, a script that builds a
scorer needs the `if __name__ == "__main__":` guard. This module imports nothing heavy at top level
so that workers start fast.

No worker outlives the trainer: an idle worker exits when its pipe to the trainer closes, and
every worker asks the kernel (PR_SET_PDEATHSIG) to be killed when its parent dies: the
forkserver, which exits when the trainer's end of its lifeline pipe closes (workers close the
copy of that end they inherit, or a hung worker would keep the forkserver alive and the
forkserver the worker). So a check hung even in native code does not survive a SIGKILL of the
trainer, and multiprocessing's resource tracker exits once they are all gone.
"""

from megatron_dppo.rewards.extract import gsm8k_final, last_boxed
from megatron_dppo.rewards.scorer import FAILURE_KINDS, RewardFailureError, RewardScorer
from megatron_dppo.rewards.spec import resolve_reward_fn
from megatron_dppo.rewards.verifiers import BUILTIN_KINDS, exact_reward, math_reward

__all__ = [
    "BUILTIN_KINDS",
    "FAILURE_KINDS",
    "RewardFailureError",
    "RewardScorer",
    "exact_reward",
    "gsm8k_final",
    "last_boxed",
    "math_reward",
    "resolve_reward_fn",
]
