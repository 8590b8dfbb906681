"""A calculator agent written only against the `openai` package: it knows a base URL and an API
key, nothing about StreamRL. StreamRL trains the model behind that URL without changing a line
here (recipes/openai_agent.yaml; the glue is recipes/envs/calculator.py:solve_openai).

It adds a chain of numbers one at a time: the model answers "397+8=", the agent's calculator
tool evaluates the expression exactly and sends the running total with the next number back as
a tool message ("405+5="), and so on. It returns the model's answer to every step.

    python -m streamrl.recipes.agents.calculator_agent --base-url http://127.0.0.1:8000/v1 --api-key KEY 397 8 5 2
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import operator

import openai

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> int:
    """The agent's tool: exact integer arithmetic (+, -, *) on a string like "397+8"."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"calculator: cannot evaluate {expression!r}")
    return ev(ast.parse(expression, mode="eval").body)


_http: openai.DefaultAsyncHttpxClient | None = None


def shared_client(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    """A client per conversation over one shared connection pool: building an AsyncOpenAI client
    with its own pool creates an SSL context, ~24 ms of CPU each time."""
    global _http
    if _http is None:
        _http = openai.DefaultAsyncHttpxClient()
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_http)


async def run(numbers: list[int], base_url: str, api_key: str, max_tokens: int = 8) -> list[str]:
    client = shared_client(base_url, api_key)
    expression = f"{numbers[0]}+{numbers[1]}"
    messages = [{"role": "user", "content": expression + "="}]
    answers = []
    for nxt in [*numbers[2:], None]:
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
        answer = reply.choices[0].message.content or ""
        answers.append(answer)
        if nxt is None:
            break
        total = calculator(expression)  # the tool keeps the chain exact even after a wrong answer
        expression = f"{total}+{nxt}"
        # OpenAI requires a tool message to name the call it answers; the template does not render the id.
        messages += [{"role": "assistant", "content": answer},
                     {"role": "tool", "tool_call_id": "calculator", "content": expression + "="}]
    return answers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", required=True)
    p.add_argument("numbers", nargs="+", type=int)
    a = p.parse_args()
    print(asyncio.run(run(a.numbers, a.base_url, a.api_key)))


if __name__ == "__main__":
    main()
