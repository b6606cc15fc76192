"""`rollouts demo`: a small RL loop on a tiny local model, with faults, checked token for token
(``run`` starts everything, ``loop`` is the trainer, ``display`` the live view, ``reference``
the uninterrupted run it is checked against), and the tiny-model builder it, the tests and the
benchmarks use (``tiny_model``, also `rollouts make-tiny-model`)."""
