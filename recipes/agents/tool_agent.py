"""A function-calling agent written only against the `openai` package: the SDK's `tools=` loop as
OpenAI's documentation shows it. The model may call `calculator`; the agent runs each call,
sends the results back as `tool` messages and returns the model's first reply without tool calls.
StreamRL trains the model behind the URL without changing a line here (recipes/tool_agent.yaml;
the glue is recipes/envs/calculator.py:solve_tools).

    python -m streamrl.recipes.agents.tool_agent --base-url http://127.0.0.1:8000/v1 --api-key KEY "37*86="
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import openai

from streamrl.recipes.agents.calculator_agent import calculator, shared_client

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly (integers; +, - and *).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 37*86"}},
                       "required": ["expression"]},
    },
}]


def call_tool(name: str, arguments: str) -> str:
    """Run one tool call; a bad call is reported to the model as the tool's output."""
    try:
        if name != "calculator":
            raise ValueError(f"no tool named {name!r}")
        return str(calculator(**json.loads(arguments)))
    except Exception as e:  # noqa: BLE001 - the model sees the error, as agent frameworks do
        return f"error: {e}"


async def run(question: str, base_url: str, api_key: str, max_turns: int = 3, max_tokens: int = 64,
              stream: bool = False) -> str | None:
    """The model's answer to `question`, or None when it still called tools after `max_turns` turns."""
    client = shared_client(base_url, api_key)
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(max_turns):
        if stream:  # the SDK accumulates the streamed deltas into the same completion
            try:
                async with client.chat.completions.stream(model="policy", messages=messages, tools=TOOLS,
                                                          max_tokens=max_tokens) as s:
                    reply = await s.get_final_completion()
            except openai.LengthFinishReasonError as e:  # a reply cut at max_tokens: the streaming helper
                reply = e.completion  # raises where create() returns it; treat it as create() would
        else:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                         max_tokens=max_tokens)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": call_tool(call.function.name, call.function.arguments)})
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", required=True)
    p.add_argument("--stream", action="store_true", help="stream every reply")
    p.add_argument("question")
    a = p.parse_args()
    print(asyncio.run(run(a.question, a.base_url, a.api_key, stream=a.stream)))


if __name__ == "__main__":
    main()
