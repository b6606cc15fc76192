"""SkyRL 0.4.0's client, run in an environment of its own (Python >= 3.12, a stand-in torch):
``environment`` builds it, ``driver`` runs in it."""
