"""The H2O Lens dashboard: a multipage Streamlit app over a runs root.

Start it with :func:`app.launch.run_app` (``h2o-lens app [ROOT]``). Pages lay
out widgets and call :mod:`analyses`; every aggregation happens in DuckDB
there, so a page sends kilobytes to the browser even for runs of millions
of evictions. This package never imports torch or transformers.
"""
