"""Examples that run against durable-rollouts: importable from the repository's root
(``examples.calculator``), e.g. as ``rollouts env --tools examples.calculator:calculator``."""
