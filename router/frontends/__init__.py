"""The front doors: the HTTP app's assembly, TGI's, OpenAI's and the service routes, the dashboard, gRPC;
each beside its types in `router/api/`. They parse a body, hand it to the pipeline, and write what the core
streams back."""
