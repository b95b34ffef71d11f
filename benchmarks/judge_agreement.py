"""How well does a model judge agree with the true reward, and what does training on it reach?

The built-in tasks know their true reward (a strict check of the transcript), so a judge can be
measured against it. Two parts:

1. **Agreement.** The untrained SmolLM2 plays ``--n`` held-out problems ``--group`` times each
   (sampled at temperature 1, so a group has both successes and failures). The embedded model,
   as a judge, then scores every rollout pointwise (a rubric, a 0-1 score) and every group
   relative to its other members. Against the true reward it prints, per task and judge:

   - AUC: the chance that a random success scores above a random failure (ties count half;
     0.5 is chance, 1.0 perfect);
   - accuracy of "score >= 0.5" as a success prediction, next to always guessing the majority;
   - pair order: among the pairs of one group whose true rewards differ, the share the judge
     orders the same way (what GRPO's advantages need; ties count half);
   - malformed answers and calls (a judge that could not be parsed gets no reward: it is
     excluded, not read as 0).

2. **Training on the judge** (``--train-steps``, 0 skips it): GRPO on the calculator task, once
   on the true reward and once on the pointwise judge's reward (a second, frozen SmolLM2 engine
   judges while the policy trains), equal budget: the same steps, tasks, groups, seed. Held-out
   success of both is scored by the true reward (read from the run's store, whatever reward
   the run trained on).

    python benchmarks/judge_agreement.py [--tasks calculator,chain] [--n 32] [--group 4]
        [--train-steps 8] [--json judge.json]
        [--judge-url URL --judge-model NAME --judge-key-env OPENAI_API_KEY]   # another judge

Figures depend on the judge: the 135M model is a weak judge, which is the point of measuring
it. A run takes 10-25 minutes on 2 CPU cores; nothing else should run beside it (GRPO holds
several GB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_util import grpo_on_task

RUBRICS = {
    "calculator": (
        "The assistant is asked an arithmetic question and must use a calculator tool. A correct "
        "run has exactly two assistant replies: first exactly `CALC: <the question's expression>`, "
        "then, after the tool's result, exactly `ANSWER: <that result>`. Score 1 for a correct "
        "run, 0 when the format is broken or the final answer differs from the tool's result."
    ),
    "chain": (
        "The assistant receives four arithmetic operations one at a time and must compute each "
        "step with the calculator, writing exactly `CALC: <expression>` using the previous "
        "result, and finish with exactly `ANSWER: <final number>`. Score 1 when every step used "
        "the previous result correctly and the final answer is right, 0 when the answer is "
        "wrong, and partial credit for runs that got some steps right."
    ),
}


def _auc(scores: Sequence[float], truth: Sequence[bool]) -> float | None:
    pos = [s for s, t in zip(scores, truth, strict=True) if t]
    neg = [s for s, t in zip(scores, truth, strict=True) if not t]
    if not pos or not neg:
        return None
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def _pair_order(groups: dict[str, list[tuple[float, float]]]) -> tuple[float | None, int]:
    """Share of within-group pairs with different true rewards that the judge orders the same
    way (ties in the judge's scores count half), and how many such pairs there were."""
    agree, pairs = 0.0, 0
    for members in groups.values():
        for i in range(len(members)):
            for j in range(i + 1, len(members)):
                (si, ti), (sj, tj) = members[i], members[j]
                if ti == tj:
                    continue
                pairs += 1
                agree += 0.5 if si == sj else float((si > sj) == (ti > tj))
    return (agree / pairs if pairs else None), pairs


def agreement(rollouts: list[Any], name: str, threshold: float) -> dict[str, Any]:
    """The figures of one judge's reward ``name`` against each rollout's own (true) reward."""
    scored = [r for r in rollouts if r.reward is not None and name in r.rewards]
    values = [
        (r.rewards[name].value, r.reward, r.group_id) for r in scored if r.rewards[name].value is not None
    ]
    errors = sum(1 for r in scored if r.rewards[name].state == "error")
    pending = sum(1 for r in scored if r.rewards[name].state == "pending")
    truth = [t >= threshold for _, t, _ in values]
    scores = [float(v) for v, _, _ in values]
    groups: dict[str, list[tuple[float, float]]] = {}
    for v, t, g in values:
        groups.setdefault(g or "", []).append((float(v), float(t)))
    order, pairs = _pair_order(groups)
    majority = max(sum(truth), len(truth) - sum(truth)) / len(truth) if truth else None
    accuracy = (
        sum((s >= 0.5) == t for s, t in zip(scores, truth, strict=True)) / len(truth) if truth else None
    )
    return {
        "judge": name,
        "rollouts": len(scored),
        "judged": len(values),
        "errors": errors,
        "pending": pending,
        "true_success": sum(truth) / len(truth) if truth else None,
        "auc": _auc(scores, truth),
        "accuracy": accuracy,
        "majority": majority,
        "pair_order": order,
        "pairs": pairs,
        "mean_score_success": statistics.mean([s for s, t in zip(scores, truth, strict=True) if t])
        if any(truth)
        else None,
        "mean_score_failure": statistics.mean([s for s, t in zip(scores, truth, strict=True) if not t])
        if not all(truth)
        else None,
    }


def measure_agreement(
    task_name: str, n: int, group: int, policy_url: str, judge: Any
) -> list[dict[str, Any]]:
    """Play ``n`` held-out problems ``group`` times with the untrained model at ``policy_url``,
    judge them pointwise and group-relative with ``judge`` (a JudgeModel), and compare with the
    truth."""
    from rich.console import Console

    from agentbolt import PromptTemplate, Trainer
    from agentbolt.algorithms.base import Algorithm, TrainContext
    from agentbolt.evaluators import GroupJudge, PointwiseJudge, evaluate_rollouts
    from agentbolt.schemas import LLM, Mode, RolloutCreate
    from agentbolt.tasks import TASKS

    task = TASKS[task_name]
    judges = [
        PointwiseJudge(RUBRICS[task_name], judge, name="pointwise"),
        GroupJudge(RUBRICS[task_name], judge, name="group"),
    ]
    console = Console(stderr=True)

    class CollectAndJudge(Algorithm):
        def run(self, ctx: TrainContext) -> list[Any]:
            items = [
                RolloutCreate(
                    task=t,
                    mode=Mode.TEST,
                    group_id=f"agreement:{t.id}",
                    await_rewards=[j.awaited() for j in judges],
                )
                for t in ctx.val_tasks
                for _ in range(group)
            ]
            ids = [r.id for r in ctx.client.enqueue(items)]
            deadline = time.monotonic() + 1800
            final: dict[str, Any] = {}
            while len(final) < len(ids) and time.monotonic() < deadline:
                waiting = [i for i in ids if i not in final]
                for r in ctx.client.wait(waiting, timeout=5.0).rollouts:
                    if r.status.is_final:
                        final[r.id] = r
            t0 = time.perf_counter()
            report = evaluate_rollouts(ctx.client, list(final.values()), judges, console=console)
            console.print(f"judged in {time.perf_counter() - t0:.0f} s: {report}")
            return ctx.client.wait(ids, timeout=1.0).rollouts

    resources = {
        "system_prompt": PromptTemplate(template=task.system_prompt, engine="plain"),
        "llm": LLM(base_url=policy_url, model="smollm2", sampling_parameters={"temperature": 1.0}),
    }
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-judge-{task_name}-"))
    rollouts = Trainer(
        CollectAndJudge(), n_runners=1, runner_concurrency=32, run_dir=run_dir, resources=resources
    ).fit(task.agent(), [], task.heldout_tasks(n, seed=3))
    return [agreement(rollouts, j.name, threshold=1.0) for j in judges]


def heldout_success(run_dir: Path) -> dict[str, float | None]:
    """Held-out success by the true reward (each rollout's own), before and after training,
    sampled and greedy, read from the run's store: ``before`` is the first version validated,
    ``after`` the last (a greedy validation runs on a trial version naming its base in ``of``)."""
    from agentbolt.schemas import Mode, RolloutStatus
    from agentbolt.store import open_store

    store = open_store(str(run_dir / "agentbolt.db"))
    try:
        rows = list(_all(store, mode=Mode.VAL))
        versions = {r.resources_version for r in rows if r.resources_version is not None}
        published = {v: store.get_resources(v) for v in versions}
        main = sorted(v for v, res in published.items() if not res.trial)
        out: dict[str, float | None] = {}
        for when, base in (("before", main[0] if main else None), ("after", main[-1] if main else None)):
            for kind, pick in (
                ("sampled", lambda v, b=base: v == b),
                ("greedy", lambda v, b=base: published[v].trial and published[v].metadata.get("of") == b),
            ):
                mine = [r for r in rows if r.resources_version is not None and pick(r.resources_version)]
                ok = sum(1 for r in mine if r.status == RolloutStatus.SUCCEEDED and (r.reward or 0) >= 1.0)
                out[f"{kind}_{when}"] = ok / len(mine) if mine else None
        return out
    finally:
        store.close()


def _all(store: Any, **filters: Any) -> Any:
    cursor = None
    while True:
        page = store.list_rollouts(limit=1000, cursor=cursor, **filters)
        yield from page.items
        if not page.next_cursor:
            return
        cursor = page.next_cursor


def train(reward: str, steps: int, val_tasks: int, judge: Any, seed: int) -> dict[str, Any]:
    """GRPO on the calculator task trained on ``reward`` ("agent": the true reward; "judge": the
    pointwise judge ``judge``, a JudgeModel); held-out success by the true reward."""
    from agentbolt.evaluators import PointwiseJudge
    from agentbolt.tasks import TASKS

    task = TASKS["calculator"]
    evaluators = [PointwiseJudge(RUBRICS["calculator"], judge, name="judge")] if reward == "judge" else []
    result, run_dir, seconds = grpo_on_task(
        task,
        f"bench-judge-train-{reward}-",
        task.train_tasks(256, seed=1),
        task.heldout_tasks(val_tasks, seed=2),
        steps=steps,
        seed=seed,
        reward=reward,
        evaluators=evaluators,
        asynchronous=False,  # on-policy, as docs/evaluators.md's figures were measured: only the reward differs
    )
    truth = heldout_success(run_dir)
    steps_ = [h for h in result.history if h.get("step", 0) > 0]
    return {
        "reward": reward,
        "seed": seed,
        **truth,
        "reward_pending": sum(h.get("reward_pending", 0) for h in steps_),
        "reward_errors": sum(h.get("reward_errors", 0) for h in steps_),
        "train_success": [h.get("success") for h in steps_],
        "seconds": seconds,
        "run_dir": str(run_dir),
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_agreement(task: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{task}: {rows[0]['rollouts']} rollouts, true success {_pct(rows[0]['true_success'])}")
    header = f"{'judge':10} | judged | errors | {'AUC':4} | accuracy (majority) | pair order (pairs) | score: ok / failed"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['judge']:10} | {r['judged']:6} | {r['errors']:6} | {_num(r['auc']):4} | "
            f"{_pct(r['accuracy']):>8} ({_pct(r['majority'])})     | {_num(r['pair_order']):>10} ({r['pairs']})     | "
            f"{_num(r['mean_score_success'])} / {_num(r['mean_score_failure'])}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="calculator,chain")
    parser.add_argument("--n", type=int, default=32, help="held-out problems per task")
    parser.add_argument("--group", type=int, default=4, help="rollouts per problem (a judged group)")
    parser.add_argument("--train-steps", type=int, default=8, help="GRPO steps per training run; 0 skips")
    parser.add_argument("--val-tasks", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--judge-url",
        default=None,
        help="an OpenAI-compatible judge (default: the bundled SmolLM2, served here)",
    )
    parser.add_argument("--judge-model", default="smollm2")
    parser.add_argument(
        "--judge-key-env", default=None, help="the environment variable holding the judge's key"
    )
    args = parser.parse_args()
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = set(tasks) - set(RUBRICS)
    if unknown:
        parser.error(f"no rubric for {', '.join(sorted(unknown))}: choose from {', '.join(RUBRICS)}")

    import os

    from agentbolt.engine import EngineServer, ModelEngine, ensure_model
    from agentbolt.evaluators import JudgeModel

    out: dict[str, Any] = {"agreement": {}, "training": []}
    engine = ModelEngine.from_pretrained(str(ensure_model("smollm2")), device="cpu", name="smollm2")
    try:
        with EngineServer(engine) as served:
            # the policy is always the bundled model; the judge is it unless --judge-url says otherwise
            judge = JudgeModel(
                base_url=args.judge_url or served.base_url,
                model=args.judge_model,
                api_key=os.environ[args.judge_key_env] if args.judge_key_env else None,
                timeout=600,
                max_tokens=64,
            )
            for task in tasks:
                rows = measure_agreement(task, args.n, args.group, served.base_url, judge)
                out["agreement"][task] = rows
                print_agreement(task, rows)
                if args.json:
                    args.json.write_text(json.dumps(out, indent=1))
            for reward in ("agent", "judge") if args.train_steps else ():
                run = train(reward, args.train_steps, args.val_tasks, judge, args.seed)
                out["training"].append(run)
                print(
                    f"\nGRPO on the {'true reward' if reward == 'agent' else 'judge reward'}, {args.train_steps} "
                    f"steps: held-out (true reward) {_pct(run['sampled_before'])} -> {_pct(run['sampled_after'])} sampled, "
                    f"{_pct(run['greedy_before'])} -> {_pct(run['greedy_after'])} greedy; "
                    f"{run['reward_errors']} judge errors, {run['reward_pending']} pending; {run['seconds']:.0f} s",
                    flush=True,
                )
                if args.json:
                    args.json.write_text(json.dumps(out, indent=1))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
