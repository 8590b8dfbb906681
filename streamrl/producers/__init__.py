"""What produces experience besides the built-in rollout: agent-environment episodes, the
OpenAI-compatible proxy for agents, and the producer API (service, intake rules, SDK) for
external producers."""
