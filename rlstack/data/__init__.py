"""Prompt data: verl-schema rows (rows.py), tokenised datasets and samplers (dataset.py,
sampler.py), built-in synthetic tasks (synthetic.py, `python -m rlstack.data.make_arith`).

Nothing here imports torch; import the submodules directly.
"""
