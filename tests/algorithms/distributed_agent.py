"""The agent of the torchrun end-to-end test (tests/algorithms/test_distributed.py): one chat
call; the reward is the share of 'a' among the reply's letters plus a thousandth per character
of the reply, so a group of a random model's replies is almost never flat (a flat group trains
nothing, and the test checks both ranks trained). Its own module: every torchrun rank imports
it by path."""

from __future__ import annotations

from agentbolt import LitAgent, Task
from agentbolt.schemas import LLM


class VowelAgent(LitAgent):
    async def execute_rollout(self, task: Task) -> float:
        import openai

        llm: LLM = self.get_resource("llm")
        async with openai.AsyncOpenAI(
            base_url=llm.base_url, api_key=llm.api_key or "x", max_retries=0
        ) as client:
            response = await client.chat.completions.create(
                model=llm.model,
                messages=[{"role": "user", "content": task.data["q"]}],
                max_tokens=8,
                temperature=1.0,
            )
        text = response.choices[0].message.content or ""
        letters = [c for c in text.lower() if c.isalpha()]
        share = letters.count("a") / len(letters) if letters else 0.0
        return share + len(text) / 1000


vowels = VowelAgent()
