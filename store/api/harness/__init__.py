"""The endpoints RL harnesses already call (vLLM's token-in/token-out generate, SkyRL's,
OpenAI completions and chat), each call one durable rollout (``call``)."""
