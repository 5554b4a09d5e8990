"""The commands layer: the ``h2o-lens`` command line and the jobs that span layers.

The only package allowed to import from every layer (docs/DESIGN.md §1):
:mod:`commands.cli` (the entry point), :mod:`commands.jobs` (demo, sweep,
sample runs) and :mod:`commands.benchmarks` (the `h2o-lens bench` benchmarks, one module each).
``h2o_lens``, ``recorders``, ``analyses`` and ``app`` never import it.
"""
