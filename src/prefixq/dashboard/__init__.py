"""The live dashboard of ``prefixq serve`` and ``prefixq dashboard`` (docs/dashboard.md): a page
shipped in the package (static/: HTML, CSS and plain JavaScript drawing SVG charts; no build
step, nothing fetched from elsewhere) and its JSON API under ``/api/``.

Modules: `api` (the routes, mounted on the server's app by prefixq.openai.app), `access` (keys,
namespaces, read-only, cross-site guards), `downloads` (a burst's results as JSONL). The data
comes from prefixq.ops. Needs the ``serve`` extra (FastAPI, uvicorn).
"""
