"""Each front door's request and response types, declared once (pydantic v2): validation, `/openapi.json` and the
docs all come from them. `base` holds what every API shares; `tgi` and `openai` hold each API's shapes.

Requests are strict models (a JSON `true` is not a number, `5.0` is not an integer, NaN is not a float, an
unknown field is refused, a null is "unset"); responses are TypedDicts, which the routes fill as plain dicts, so
that serving a token costs nothing more than it did. The rules that depend on the deployment (token lengths,
`--max-stop-sequences`, `--max-top-n-tokens`) are a second, explicit stage in `router/pipeline/validation.py`.
"""
