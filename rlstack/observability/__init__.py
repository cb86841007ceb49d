"""Logs, metric trackers, resource monitor and progress bars (issue 10).

Import the submodules directly (`rlstack.observability.logging`, `.trackers`, `.monitor`,
`.progress`); nothing is imported here so that `import rlstack.observability` stays light.
"""
