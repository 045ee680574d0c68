"""An OpenAI-compatible Batch API (``prefixq serve``): OpenAI's ``/v1/files`` and
``/v1/batches`` endpoints, each batch run as a prefixq burst (docs/openai.md).

Modules: `formats` (results as OpenAI batch output lines; used by the CLI too), `validate` (input
files), `files` and `uploads` (the files store), `batches` (batch records and objects), `runner`
(validating, queueing and finalizing batches), `lease`, `pages` (list pagination), `auth` (API
keys and namespaces), `apierror`, `app` (the ASGI app) and `serve`. Only `formats` and `validate`
work without the ``serve`` extra (FastAPI, uvicorn, python-multipart).
"""
