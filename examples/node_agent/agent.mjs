// A calculator agent in Node.js on the official `openai` package, with no agentbolt code:
// `new OpenAI()` reads OPENAI_BASE_URL and OPENAI_API_KEY from the environment. Under an
// agentbolt runner those name this attempt's gateway and a key valid for this attempt only,
// so every call is recorded with its token ids.
//
// The task is the JSON file named by AGENTBOLT_TASK_FILE (or the question in the arguments).
// The reward goes out with one HTTP POST of {"reward": x} to AGENTBOLT_EVENTS_URL, the same as
//   curl -H "Authorization: Bearer $OPENAI_API_KEY" -d '{"reward": 1}' "$AGENTBOLT_EVENTS_URL"
// and, when that URL is not set or not answered, into the file AGENTBOLT_RESULT_FILE names.
//
// Setup and a run under a runner:
//   npm ci --prefix examples/node_agent
//   agentbolt runner --command 'node examples/node_agent/agent.mjs'
import { readFileSync, writeFileSync } from "node:fs";
import OpenAI from "openai";

const SYSTEM_PROMPT =
  "You are a careful assistant. Use the calculator tool for arithmetic, then state the result.";
const TOOLS = [
  {
    type: "function",
    function: {
      name: "calculator",
      description: "Evaluate an arithmetic expression such as 12*(3+4).",
      parameters: {
        type: "object",
        properties: { expression: { type: "string" } },
        required: ["expression"],
      },
    },
  },
];

// + - * / and parentheses on numbers only: the expression is checked before it is evaluated.
function calculator(expression) {
  if (!/^[-+*/().\d\s]+$/.test(expression)) return "error: only numbers and + - * / are allowed";
  try {
    const value = Function(`"use strict"; return (${expression});`)();
    return Number.isFinite(value) ? String(Math.round(value * 1e6) / 1e6) : "error: not a number";
  } catch (err) {
    return `error: ${err.message}`;
  }
}

function readTask(argv) {
  let task = {};
  const path = process.env.AGENTBOLT_TASK_FILE;
  if (path) {
    task = JSON.parse(readFileSync(path, "utf8")); // the task's fields: {question, answer}
  }
  if (argv.length) task.question = argv.join(" ");
  if (!task.question) {
    console.error("no task: set AGENTBOLT_TASK_FILE or pass the question as arguments");
    process.exit(2);
  }
  return task;
}

async function solve(client, model, question) {
  const messages = [
    { role: "system", content: SYSTEM_PROMPT },
    { role: "user", content: question },
  ];
  let answer = "";
  let calls = 0;
  for (let round = 0; round < 3; round++) {
    // at most two tool rounds, then an answer
    const reply = await client.chat.completions.create({
      model,
      messages,
      tools: TOOLS,
      max_tokens: 64,
      temperature: 0,
    });
    calls += 1;
    const message = reply.choices[0].message;
    answer = message.content ?? "";
    if (!message.tool_calls?.length) break;
    messages.push({ role: "assistant", content: message.content, tool_calls: message.tool_calls });
    for (const call of message.tool_calls) {
      let expression = "";
      try {
        expression = String(JSON.parse(call.function.arguments || "{}").expression ?? "");
      } catch {
        expression = "";
      }
      messages.push({ role: "tool", tool_call_id: call.id, content: calculator(expression) });
    }
  }
  return { answer, calls };
}

function score(answer, gold) {
  if (gold === undefined || gold === null) return 0;
  const escaped = String(gold).replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  return new RegExp(`(?<![\\d.])${escaped}(?!\\d)`).test(answer) ? 1 : 0;
}

// One POST to the events URL; false when there is none or it did not take the reward.
async function postReward(reward) {
  const url = process.env.AGENTBOLT_EVENTS_URL;
  if (!url) return false;
  try {
    const response = await fetch(url, {
      method: "POST",
      headers: {
        "content-type": "application/json",
        authorization: `Bearer ${process.env.OPENAI_API_KEY}`,
      },
      body: JSON.stringify({ reward }),
      signal: AbortSignal.timeout(10_000),
    });
    if (!response.ok) console.error(`events URL answered ${response.status}`);
    return response.ok;
  } catch (err) {
    console.error(`events URL unreachable: ${err.message}`);
    return false;
  }
}

const task = readTask(process.argv.slice(2));
const client = new OpenAI(); // OPENAI_BASE_URL and OPENAI_API_KEY from the environment
const model = process.env.OPENAI_MODEL ?? "gpt-4o-mini";
const { answer, calls } = await solve(client, model, task.question);
const reward = score(answer, task.answer);
console.log(JSON.stringify({ answer, reward, calls }));
const posted = await postReward(reward);
if (!posted && process.env.AGENTBOLT_RESULT_FILE) {
  writeFileSync(process.env.AGENTBOLT_RESULT_FILE, JSON.stringify({ reward }));
}
