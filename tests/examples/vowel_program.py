"""A program agent for GRPO on a random model: one sampled chat call through ``openai.OpenAI()``
from the environment; the reward, written to ``AGENTBOLT_RESULT_FILE``, is the share of 'a'
among the reply's letters (a spread a random model shows from the first step)."""

import json
import os

import openai

with open(os.environ["AGENTBOLT_TASK_FILE"], encoding="utf-8") as f:
    task = json.load(f)
reply = openai.OpenAI(max_retries=0).chat.completions.create(
    model=os.environ["OPENAI_MODEL"],
    messages=[{"role": "user", "content": task["q"]}],
    max_tokens=8,
    temperature=1.0,
)
letters = [c for c in (reply.choices[0].message.content or "").lower() if c.isalpha()]
reward = letters.count("a") / len(letters) if letters else 0.0
with open(os.environ["AGENTBOLT_RESULT_FILE"], "w", encoding="utf-8") as f:
    json.dump({"reward": reward}, f)
print(json.dumps({"reward": reward}))
