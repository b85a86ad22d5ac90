"""Tool calls read out of a chat answer, one module per model family's format (`hermes`, `llama3_json`,
`mistral`, `phi4_mini_json`, vLLM's names), one machine that reads them all (`calls.CallReader`, over a family's
`Framing`), the forced modes' readers (`forced`), and the choice of a family for the served model (`registry`)."""
