"""A program agent for GRPO on a random model: one sampled chat call through ``openai.OpenAI()``
from the environment; the reward, written to ``AGENTBOLT_RESULT_FILE``, is mostly the share of
vowels among the reply's letters, and a little its length: a group of four random replies then
practically always differs (the share of 'a' alone was 0 for all eight replies of a step once,
and a flat step trains nothing)."""

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
text = reply.choices[0].message.content or ""
letters = [c for c in text.lower() if c.isalpha()]
vowels = sum(1 for c in letters if c in "aeiou") / len(letters) if letters else 0.0
reward = 0.9 * vowels + 0.1 * min(len(text), 32) / 32
with open(os.environ["AGENTBOLT_RESULT_FILE"], "w", encoding="utf-8") as f:
    json.dump({"reward": reward}, f)
print(json.dumps({"reward": reward}))
