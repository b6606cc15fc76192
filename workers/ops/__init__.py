"""The operator commands: `rollouts status`, `show`, `stuck`, `cancel` and `requeue`
(``commands``), their text (``text``) and a rollout's timeline as a picture
(``timeline_plot``)."""
