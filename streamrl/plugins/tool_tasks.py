"""The tool-use task of recipes/tool_agent.yaml: multiplication problems ("37*86=") that the tiny
model cannot compute but can hand to the example agent's calculator tool
(recipes/agents/tool_agent.py), and SFT data that teach it the tool-call format.

An episode goes: the model calls `calculator` with the problem's expression (Qwen/Hermes
`<tool_call>` text, streamrl/core/chat.py), the agent runs it and sends the result back, the model
answers with it. The SFT rows come from a noisy teacher, as in the quick-start
(streamrl/plugins/tasks.py says why): half are first turns, where the teacher answers directly
(a guess) `direct` of the time and otherwise calls the tool with the problem copied right
`call_accuracy` of the time (else an operand off by 1 or 2); half are second turns, after such a
call and the tool's exact result, where the teacher copies the result right `answer_accuracy` of the
time. The warm-started model therefore knows the format but spreads its choices over the
teacher's: sampled accuracy starts near (1 - direct) x call_accuracy x answer_accuracy, and RL on
the agent's final answer teaches it to always call the tool, copy the problem and copy the result.
Tuned on the tiny preset: with the defaults, 1500 SFT steps leave sampled accuracy near 0.3 with the
right behaviour as the mode (greedy accuracy near 1), the reward-over-imitation setting of the quick-start.

The SFT rows carry the agent's own tool definitions (`tools`, OpenAI's fine-tuning format), so
their prompts render exactly as the agent's requests do.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from streamrl.core.chat import format_tool_call
from streamrl.plugins.tasks import _write_jsonl, teacher_response, write_task
from streamrl.recipes.agents.tool_agent import TOOLS, call_tool


def write_tool_task(out_dir: str | Path, seed: int = 0, n_train: int = 2000, n_eval: int = 128, n_sft: int = 4000,
                    direct: float = 0.2, call_accuracy: float = 0.6, answer_accuracy: float = 0.8,
                    a_max: int = 99, b_max: int = 99, ops: str = "*") -> dict[str, Path]:
    """train.jsonl and eval.jsonl as `write_task(chat=True)` writes them (one user message per
    problem, the exact answer as label) and sft.jsonl with tool-use rows
    ({"id", "prompt": messages, "tools", "response"}). Deterministic for a seed; returns the paths."""
    paths = write_task(out_dir, seed, n_train, n_eval, n_sft, chat=True, a_max=a_max, b_max=b_max, ops=ops)
    problems = [json.loads(line)["prompt"][-1]["content"] for line in paths["sft"].read_text().splitlines()]
    rng = random.Random(f"tool-teacher-{seed}")
    rows = []
    for i, problem in enumerate(problems):
        expression = problem.rstrip("=")
        messages: list[dict[str, Any]] = [{"role": "user", "content": problem}]
        if i % 2 == 0:
            if rng.random() < direct:
                response = teacher_response(rng, call_tool("calculator", json.dumps({"expression": expression})), 0.0)
            else:
                response = format_tool_call("calculator", {"expression": _copied(rng, expression, call_accuracy)})
        else:
            arguments = json.dumps({"expression": _copied(rng, expression, call_accuracy)})
            result = call_tool("calculator", arguments)
            messages += [{"role": "assistant", "content": "", "tool_calls": [
                              {"id": f"call_{i}", "type": "function", "function": {"name": "calculator", "arguments": arguments}}]},
                         {"role": "tool", "tool_call_id": f"call_{i}", "content": result}]
            response = teacher_response(rng, result, answer_accuracy)
        rows.append({"id": f"sft-{i}", "prompt": messages, "tools": TOOLS, "response": response})
    _write_jsonl(paths["sft"], rows)
    return paths


def _copied(rng: random.Random, expression: str, accuracy: float) -> str:
    """`expression` copied right with probability `accuracy`, else with one operand off by 1 or 2."""
    if rng.random() < accuracy:
        return expression
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", expression).groups()  # type: ignore[union-attr]
    if rng.random() < 0.5:
        return f"{teacher_response(rng, a, 0.0)}{op}{b}"
    return f"{a}{op}{teacher_response(rng, b, 0.0)}"
