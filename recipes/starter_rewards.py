"""Your reward function, written by `streamrl init` as my_rewards.py beside recipe.yaml, which
names it as `reward: {fn: "my_rewards:score"}`.

StreamRL calls it once per sample with the decoded response and the prompt's label (more
arguments are passed when the function asks for them by name: `prompt`, `record` (the dataset row); see
streamrl/plugins/rewards.py). Return a number, or {"reward": r, ...components} to keep components
in the pool. A function that raises marks that sample failed and the run goes on.
"""


def score(response: str, label: str) -> float:
    """1 when the response is exactly the label (spaces around it ignored), else 0."""
    return float(response.strip() == str(label).strip())
